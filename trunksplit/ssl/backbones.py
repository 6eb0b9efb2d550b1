"""torchvision backbones by name, built with random weights (nothing is downloaded)."""
from typing import Optional

import torchvision
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from ..chains import feature_blocks


def vit_s_16(image_size: int = 224, **kwargs) -> VisionTransformer:
    """ViT-S/16 (DINO's ViT-small: 12 layers, 6 heads, width 384), on torchvision's ViT class."""
    return VisionTransformer(image_size=image_size, patch_size=16, num_layers=12, num_heads=6, hidden_dim=384, mlp_dim=1536, **kwargs)


EXTRA_BACKBONES = {"vit_s_16": vit_s_16}  # the recipes' models that torchvision does not build


def check_backbone_name(name: str) -> None:
    """A torchvision classification model's name (or one of :data:`EXTRA_BACKBONES`), or a ``ValueError`` that lists them."""
    names = torchvision.models.list_models(module=torchvision.models) + list(EXTRA_BACKBONES)
    if name not in names:
        raise ValueError(f"MODEL.TRUNK.NAME: torchvision has no model {name!r} (try resnet50, convnext_tiny, vit_b_16; all: {', '.join(names)})")


def fixed_resolution(name: str) -> bool:
    """MaxViT is built for one input size (its attention partitions). A ViT is built for one too,
    but the trunk resizes its position embeddings for other sizes (multi-crop)."""
    return name.startswith("maxvit")


def build_backbone(name: str, image_size: Optional[int] = None) -> nn.Module:
    """A randomly initialised torchvision classification model (nothing is downloaded) that trunksplit can cut.

    ``image_size`` builds ViT and MaxViT for that resolution (the zoo's default is 224); a ViT
    trunk takes other sizes too (see ``trunksplit.chains.families.VitEmbedding``)."""
    check_backbone_name(name)
    kwargs = {}
    if image_size is not None and name.startswith("vit_"):
        kwargs = {"image_size": image_size}
    elif image_size is not None and fixed_resolution(name):
        kwargs = {"input_size": (image_size, image_size)}
    try:
        model = EXTRA_BACKBONES[name](**kwargs) if name in EXTRA_BACKBONES else torchvision.models.get_model(name, **kwargs)
    except (ValueError, AssertionError, RuntimeError) as e:  # e.g. a ViT size that is not a multiple of its patch
        raise ValueError(f"MODEL.TRUNK.NAME {name} cannot be built for {image_size}px crops: {e}") from None
    try:
        feature_blocks(model)
    except TypeError as e:
        raise ValueError(f"MODEL.TRUNK.NAME {name!r}: {e}") from None
    return model
