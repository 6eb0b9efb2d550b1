"""torchvision backbones by name, built with random weights (nothing is downloaded)."""
from typing import Optional

import torchvision
from torch import nn

from ..chains import feature_blocks


def check_backbone_name(name: str) -> None:
    """A torchvision classification model's name, or a ``ValueError`` that lists them."""
    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        raise ValueError(f"MODEL.TRUNK.NAME: torchvision has no model {name!r} (try resnet50, convnext_tiny, vit_b_16; all: {', '.join(names)})")


def fixed_resolution(name: str) -> bool:
    """ViT and MaxViT are built for one input size (position embeddings, attention partitions)."""
    return name.startswith(("vit_", "maxvit"))


def build_backbone(name: str, image_size: Optional[int] = None) -> nn.Module:
    """A randomly initialised torchvision classification model (nothing is downloaded) that trunksplit can cut.

    ``image_size`` builds ViT and MaxViT for that resolution (the zoo's default is 224)."""
    check_backbone_name(name)
    kwargs = {}
    if image_size is not None and fixed_resolution(name):
        kwargs = {"image_size": image_size} if name.startswith("vit_") else {"input_size": (image_size, image_size)}
    try:
        model = torchvision.models.get_model(name, **kwargs)
    except (ValueError, AssertionError, RuntimeError) as e:  # e.g. a ViT size that is not a multiple of its patch
        raise ValueError(f"MODEL.TRUNK.NAME {name} cannot be built for {image_size}px crops: {e}") from None
    try:
        feature_blocks(model)
    except TypeError as e:
        raise ValueError(f"MODEL.TRUNK.NAME {name!r}: {e}") from None
    return model
