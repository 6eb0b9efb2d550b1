"""Backbones by name, built with random weights (nothing is downloaded): torchvision's, timm's as
``timm:NAME`` and transformers' as ``hf:TYPE`` where those are installed (optional extras)."""
import difflib
import importlib
import importlib.util
import re
from typing import List, Optional

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import ResNet, conv1x1
from torchvision.models.vision_transformer import VisionTransformer

from ..chains import feature_blocks
from ..chains.hugging_face import HF_FAMILIES


def vit_s_16(image_size: int = 224, **kwargs) -> VisionTransformer:
    """ViT-S/16 (DINO's ViT-small: 12 layers, 6 heads, width 384), on torchvision's ViT class."""
    return VisionTransformer(image_size=image_size, patch_size=16, num_layers=12, num_heads=6, hidden_dim=384, mlp_dim=1536, **kwargs)


EXTRA_BACKBONES = {"vit_s_16": vit_s_16}  # the recipes' models that torchvision does not build


TIMM = "timm:"  # the prefix of a timm model's name
HF = "hf:"  # the prefix of a transformers model type (its config's defaults)


def hf_is_chain(name: str) -> bool:
    """Whether ``hf:TYPE`` names a transformers model type trunksplit cuts (ViT, DeiT, DINOv2, ConvNeXt, ResNet and kin:
    ``trunksplit/chains/hugging_face.py``); the others are wrapped to a budget. A ``ValueError`` names a
    type transformers does not have, with the nearest."""
    transformers, kind = _extra("transformers", name), name[len(HF):]
    if kind not in transformers.CONFIG_MAPPING:
        near = difflib.get_close_matches(kind, list(transformers.CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"{name}: transformers has no model type {kind!r}" + (f"; did you mean {' or '.join(HF + n for n in near)}?" if near else ""))
    return _hf_model_classes().get(kind) in HF_FAMILIES


def _hf_model_classes() -> dict:
    """transformers' model type -> the class name ``AutoModel`` builds for it (``vit`` -> ``ViTModel``)."""
    return importlib.import_module("transformers.models.auto.modeling_auto").MODEL_MAPPING_NAMES


def check_backbone_name(name: str) -> None:
    """A torchvision classification model's name (or one of :data:`EXTRA_BACKBONES`), ``timm:NAME``, or
    ``hf:TYPE`` that trunksplit cuts; else a ``ValueError`` with the nearest names (``timm/convnext_atto``
    finds ``timm:convnext_atto``) or, for a transformers type it cannot cut, where to wrap it instead."""
    if name.startswith(HF):
        if not hf_is_chain(name):
            cut = ", ".join(sorted(HF + k for k, c in _hf_model_classes().items() if c in HF_FAMILIES))
            raise ValueError(f"MODEL.TRUNK.NAME {name}: this transformers model is not a chain trunksplit can cut (it cuts {cut}); it is wrapped to "
                             f"a budget: trunksplit plan --arch {name} --budget 0.5, or trunksplit.apply_activation_checkpointing in your code")
        return
    if name.startswith(TIMM):
        if name[len(TIMM):] not in _extra("timm", name).list_models():
            raise ValueError(f"MODEL.TRUNK.NAME: timm has no model {name[len(TIMM):]!r}{_did_you_mean(name, [])}")
        return
    names = torchvision.models.list_models(module=torchvision.models) + list(EXTRA_BACKBONES)
    if name not in names:
        near = _did_you_mean(name, names)
        raise ValueError(f"MODEL.TRUNK.NAME: torchvision has no model {name!r}" + (near or f" (try resnet50, convnext_tiny, vit_b_16, or a timm "
                         f"model as timm:NAME; all of torchvision's: {', '.join(names)})"))


def _did_you_mean(name: str, torchvision_names: List[str]) -> str:
    """The nearest names to a near miss, torchvision's and (where installed) timm's as ``timm:NAME``."""
    bare = re.split("[/:]", name)[-1]
    timm_names = importlib.import_module("timm").list_models() if importlib.util.find_spec("timm") else []
    near = [n for n in torchvision_names if n == bare] + [TIMM + n for n in timm_names if n == bare]
    family = sorted((n for n in torchvision_names if n.startswith(bare)), key=lambda n: (len(n), n))  # vissl's "resnet", "regnet"
    if not near and len(family) > 1:
        more = f" ({len(family)} in all)" if len(family) > 4 else ""
        return f"; did you mean {' or '.join(family[:4])}{more}?"
    near = near or difflib.get_close_matches(bare, torchvision_names, n=3) + [TIMM + n for n in difflib.get_close_matches(bare, timm_names, n=3)]
    return f"; did you mean {' or '.join(near[:4])}?" if near else ""


def _extra(package: str, name: str):
    """An optional extra (timm, transformers), or a ``ValueError`` that says how to get it."""
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"MODEL.TRUNK.NAME {name}: {package} is not installed here (pip install {package})")
    return importlib.import_module(package)


def fixed_resolution(name: str) -> bool:
    """MaxViT is built for one input size (its attention partitions). A ViT is built for one too,
    but the trunk resizes its position embeddings for other sizes (multi-crop)."""
    return name.startswith("maxvit")


def build_backbone(name: str, image_size: Optional[int] = None, width: float = 1.0) -> nn.Module:
    """A randomly initialised classification model (nothing is downloaded) that trunksplit can cut:
    torchvision's by name, timm's as ``timm:NAME``, transformers' as ``hf:TYPE`` (:func:`hf_is_chain`).

    ``image_size`` builds ViT and MaxViT (timm's ViTs too) for that resolution (the zoo's default is 224); a ViT
    trunk takes other sizes too (see ``trunksplit.chains.families.VitEmbedding``). ``width`` other than 1
    widens or narrows a torchvision ResNet (:func:`resnet_of_width`)."""
    check_backbone_name(name)
    if width != 1:  # a ResNet (feature_blocks cuts any), its own refusals naming the key
        return resnet_of_width(name, width)
    try:
        if name.startswith(HF):
            model = build_hf_model(name, image_size)
        else:
            model = _timm_model(name[len(TIMM):], image_size) if name.startswith(TIMM) else _torchvision_model(name, image_size)
    except (ValueError, AssertionError, RuntimeError) as e:  # e.g. a ViT size that is not a multiple of its patch
        raise ValueError(f"MODEL.TRUNK.NAME {name} cannot be built for {image_size}px crops: {e}") from None
    try:
        feature_blocks(model)
    except TypeError as e:
        raise ValueError(f"MODEL.TRUNK.NAME {name!r}: {e}") from None
    return model


def _torchvision_model(name: str, image_size: Optional[int]) -> nn.Module:
    kwargs = {}
    if image_size is not None and name.startswith("vit_"):
        kwargs = {"image_size": image_size}
    elif image_size is not None and fixed_resolution(name):
        kwargs = {"input_size": (image_size, image_size)}
    return EXTRA_BACKBONES[name](**kwargs) if name in EXTRA_BACKBONES else torchvision.models.get_model(name, **kwargs)


WIDTH_KEY = "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER"


def resnet_of_width(name: str, width: float) -> ResNet:
    """torchvision's ResNet ``name`` with every stage ``width`` times as wide, as vissl's ``WIDTH_MULTIPLIER``
    builds it: a stem of ``64 * width`` channels, stages of 64, 128, 256 and 512 times ``width`` planes (a
    bottleneck's 4x expansion, a ResNeXt's groups and a Wide-ResNet's inner width scale with them), the
    classifier on the wider features; initialised as torchvision initialises a ResNet.

    2 and 4 make SimCLR's ResNet-50 (2x) and (4x); a fraction narrows a ResNet for quick runs on a CPU.
    Sharp edge: ``64 * width`` must be a whole number of channels (0.25 gives 16; 0.3 is refused).

        resnet_of_width("resnet50", 2)   # SimCLR's ResNet-50 (2x): 94M parameters without the classifier
    """
    model = _resnet_layout(name, width)
    block, stem = type(model.layer1[0]), int(64 * width)
    inplanes = stem
    model.conv1 = nn.Conv2d(3, inplanes, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = nn.BatchNorm2d(inplanes)
    for k, name_k in enumerate(("layer1", "layer2", "layer3", "layer4")):
        planes = stem * 2**k
        stage = _resnet_stage(block, inplanes, planes, len(getattr(model, name_k)), 1 if k == 0 else 2, model.groups, model.base_width)
        setattr(model, name_k, stage)
        inplanes = planes * block.expansion
    model.fc = nn.Linear(inplanes, model.fc.out_features)
    for m in model.modules():  # torchvision's ResNet init (BatchNorm's own is its ones and zeros)
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


def check_resnet_width(name: str, width: float, said_as: str = WIDTH_KEY) -> None:
    """Refuse a width multiplier :func:`resnet_of_width` cannot build, naming it as the user gave it
    (``said_as``: the config's key, or a command's flag) and what to change."""
    if width != 1:
        _resnet_layout(name, width, said_as)


def _resnet_layout(name: str, width: float, said_as: str = WIDTH_KEY) -> ResNet:
    """torchvision's ResNet ``name`` on the meta device (its layout, no memory), where ``width`` can widen it."""
    if not (width > 0 and 64 * width == int(64 * width)):
        raise ValueError(f"{said_as} must be > 0 with 64 x it a whole number of channels (2 and 4: SimCLR's wide ResNets, 0.25: "
                         f"16 channels), got {width}")
    with torch.device("meta"):
        model = torchvision.models.get_model(name) if name in torchvision.models.list_models(module=torchvision.models) else None
    if not isinstance(model, ResNet):
        raise ValueError(f"{said_as} {width} sets the width of torchvision's ResNets (resnet18 to resnet152, resnext, wide_resnet); "
                         f"{name} is not one: leave it at 1")
    return model


def _resnet_stage(block, inplanes: int, planes: int, blocks: int, stride: int, groups: int, base_width: int) -> nn.Sequential:
    """One stage of ``blocks`` residual blocks, as torchvision's ResNet makes its ``layer1``..``layer4``."""
    downsample = None
    if stride != 1 or inplanes != planes * block.expansion:
        downsample = nn.Sequential(conv1x1(inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion))
    layers = [block(inplanes, planes, stride, downsample, groups, base_width)]
    layers += [block(planes * block.expansion, planes, groups=groups, base_width=base_width) for _ in range(1, blocks)]
    return nn.Sequential(*layers)


def feature_key(name: str, key: str) -> str:
    """A config's feature key (``OUT_FEAT_KEYS``) for backbone ``name``: ``flatten``, the default, means the
    pooled features, which a timm model built here gives as its ``output`` (no classifier). Among a traced
    model's blocks a ``flatten`` is an op's name: timm's ResNets flatten their pooled features, its ViTs
    their patches; torchvision's traced models (AlexNet, GoogLeNet) their pooled features, kept as they are."""
    return "output" if key == "flatten" and name.startswith(TIMM) else key


def _timm_model(name: str, image_size: Optional[int]) -> nn.Module:
    """timm's model with random weights and no classifier (``num_classes=0``: its output is its pooled
    features, what torchvision's ``flatten`` block gives); a model built for one input size (a ViT) is
    built for ``image_size``."""
    timm = importlib.import_module("timm")
    if image_size is not None:
        try:
            return timm.create_model(name, pretrained=False, num_classes=0, img_size=image_size)
        except TypeError:  # a model of any input size takes no img_size
            pass
    return timm.create_model(name, pretrained=False, num_classes=0)


def build_hf_model(name: str, image_size: Optional[int] = None) -> nn.Module:
    """A transformers vision model by its type (``hf:dinov2``, ``hf:vit``, ``hf:swin``): the type's
    default config (for ``image_size`` where it has one), random weights, nothing downloaded. Those
    :func:`hf_is_chain` accepts are cut as any trunk; the others are wrapped to a budget
    (``apply_activation_checkpointing``)."""
    hf_is_chain(name)  # the type exists
    transformers = _extra("transformers", name)
    config = transformers.AutoConfig.for_model(name[len(HF):])
    if image_size is not None and hasattr(config, "image_size"):
        config.image_size = image_size
    return transformers.AutoModel.from_config(config)
