"""torchvision's classification families as feature blocks.

Every family gives an ordered chain that runs exactly what the model's own
``forward`` runs up to its classifier's first ``Linear``, with vissl's names:

- hierarchical families (ResNet, RegNet, ConvNeXt, EfficientNet, MobileNet,
  MNASNet, ShuffleNet, DenseNet, VGG, Swin, MaxViT): ``conv1`` (the stem, up to
  stride 2 or, where the stem itself strides 4, the stem alone), then the stages
  ``res2``..``res5`` whose outputs have strides 4, 8, 16 and 32;
- ViT: ``embed`` (patches, class token, position embedding), ``encoder`` (the
  encoder layers, one stage), ``norm``;
- then the pooling, flattening and normalisation before the classifier; the
  last key is always ``flatten``, the pooled ``[B, C]`` vector.

Values are the model's own modules. Where the model's ``forward`` does work
outside a module (ViT's class token, DenseNet's final ReLU, a functional
pooling) a small adapter module does it, holding the model's own parameters;
where a stage spans several of the model's containers (EfficientNet's stride-16
stage is two of its ``features``), the stage is an ``nn.Sequential`` holding the
model's own blocks.
"""
import math
from typing import List, Sequence

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models import convnext, densenet, efficientnet, maxvit, mnasnet, mobilenetv2, mobilenetv3
from torchvision.models import shufflenetv2, swin_transformer, vgg, vision_transformer

from .blocks import FeatureBlocks, small_view_copied


class GlobalAvgPool(nn.Module):
    """``x.mean([2, 3])``, as ShuffleNetV2 and MNASNet pool in their forward (not ``adaptive_avg_pool2d``,
    which rounds differently)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean([2, 3])


class VitEmbedding(nn.Module):
    """ViT's forward before the encoder layers: patchify, prepend the class token, add the
    position embedding, dropout. Holds the model's own ``conv_proj``, ``class_token``,
    ``encoder.pos_embedding`` and ``encoder.dropout``.

    At the size the ViT was built for this is torchvision's forward, exactly. At other sizes
    (DINO's local crops) the patch position embeddings are resized bicubically to the input's
    patch grid, as DINO's ``interpolate_pos_encoding`` and timm's ``dynamic_img_size`` do; the
    plain torchvision model refuses such inputs."""

    def __init__(self, model: vision_transformer.VisionTransformer):
        super().__init__()
        self.image_size, self.hidden_dim, self.patch_size = model.image_size, model.hidden_dim, model.patch_size
        self.conv_proj = model.conv_proj
        self.class_token = model.class_token
        self.pos_embedding = model.encoder.pos_embedding
        self.dropout = model.encoder.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"this ViT cuts {self.patch_size}x{self.patch_size} patches; a {h}x{w} image is not a whole number of them")
        x = self.conv_proj(x)
        n = x.shape[0]
        x = x.reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.dropout(x + self.position_embedding(h // self.patch_size, w // self.patch_size))

    def position_embedding(self, rows: int, cols: int) -> torch.Tensor:
        """The position embedding for a ``rows`` x ``cols`` patch grid (the class token's unchanged)."""
        side = self.image_size // self.patch_size
        if (rows, cols) == (side, side):
            return self.pos_embedding
        cls, grid = self.pos_embedding[:, :1], self.pos_embedding[:, 1:]
        grid = grid.reshape(1, side, side, self.hidden_dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([cls, grid.permute(0, 2, 3, 1).reshape(1, rows * cols, self.hidden_dim)], dim=1)


class ClassToken(nn.Module):
    """``x[:, 0]``, copied: the class token, ViT's pooled feature. The model's own ``x[:, 0]`` is a view,
    which keeps the whole token map alive wherever the feature is held (a head's input, through backward);
    the copy holds one token per image, and the map goes after the forward, as nothing saves it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_view_copied(x[:, 0], x)


def spatial_stride(module: nn.Module) -> int:
    """How many times ``module`` shrinks the spatial size, read from its layers (nothing is run).

    A convolution or pooling layer strides by its ``stride``; a ``Sequential`` by the
    product of its children; any other block by the largest of its children (its
    branches, a residual shortcut included, stride alike).
    """
    if isinstance(module, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
        stride = module.stride
        return stride[0] if isinstance(stride, (tuple, list)) else int(stride)
    strides = [spatial_stride(c) for c in module.children()]
    if not strides:
        return 1
    return math.prod(strides) if isinstance(module, nn.Sequential) else max(strides)


def by_stride(stem: Sequence[nn.Module], blocks: Sequence[nn.Module], tail: Sequence) -> FeatureBlocks:
    """``conv1`` and ``res2``..``res5`` from a flat chain, each block in the stage of its output stride.

    ``stem`` always forms ``conv1`` (with any block after it that still has stride 2 at
    most); a block of stride 4 goes to ``res2``, 8 to ``res3``, 16 to ``res4``, 32 or more
    to ``res5`` (see :func:`staged`). ``tail``: (name, module) pairs after res5.
    """
    groups = {"conv1": list(stem)}
    stride = math.prod(spatial_stride(m) for m in stem)
    for block in blocks:
        stride *= spatial_stride(block)
        level = min(5, max(1, round(math.log2(stride))))
        groups.setdefault("conv1" if level <= 1 else f"res{level}", []).append(block)
    return staged(groups, tail)


def staged(groups: dict, tail: Sequence) -> FeatureBlocks:
    """Feature blocks from named groups of modules and a tail of single blocks.

    Every ``res*`` group is a stage (an ``nn.Sequential`` of the model's own modules), so
    unit names (``res2.0``) do not depend on how deep the model is; ``conv1`` is a stage
    only where it has several members."""
    blocks, stages = [], []
    for name, members in groups.items():
        if len(members) == 1 and not name.startswith("res"):
            blocks.append((name, members[0]))
        else:
            blocks.append((name, nn.Sequential(*members)))
            stages.append(name)
    return FeatureBlocks(blocks + list(tail), stages=stages)


def _children(*containers: nn.Module) -> List[nn.Module]:
    return [block for c in containers for block in c]


def resnet_blocks(model: torchvision.models.ResNet) -> FeatureBlocks:
    return FeatureBlocks(
        conv1=model.conv1,
        bn1=model.bn1,
        conv1_relu=model.relu,
        maxpool=model.maxpool,
        res2=model.layer1,
        res3=model.layer2,
        res4=model.layer3,
        res5=model.layer4,
        avgpool=model.avgpool,
        flatten=nn.Flatten(1),
    )


def regnet_blocks(model: torchvision.models.RegNet) -> FeatureBlocks:
    stages = list(model.trunk_output.children())
    if len(stages) != 4:
        raise TypeError(f"expected a RegNet with 4 stages, this one has {len(stages)}")
    res = [(f"res{i + 2}", stage) for i, stage in enumerate(stages)]
    return FeatureBlocks([("conv1", model.stem), *res, ("avgpool", model.avgpool), ("flatten", nn.Flatten(1))], stages=[n for n, _ in res])


def convnext_blocks(model: convnext.ConvNeXt) -> FeatureBlocks:
    # features: stem, stage, downsample, stage, ... ; classifier: LayerNorm2d, Flatten, Linear
    f = model.features
    blocks = [m for i, part in enumerate(f) if i > 0 for m in (part if i % 2 else [part])]
    norm, flatten = model.classifier[0], model.classifier[1]
    return by_stride([f[0]], blocks, [("avgpool", model.avgpool), ("norm", norm), ("flatten", flatten)])


def _features_then_pool(model: nn.Module, avgpool: nn.Module) -> FeatureBlocks:
    """EfficientNet, MobileNetV2/V3: ``features`` is stem, stages (or blocks), last conv; pooled and flattened."""
    f = list(model.features)
    blocks = [b for part in f[1:-1] for b in (part if isinstance(part, nn.Sequential) else [part])] + [f[-1]]
    return by_stride([f[0]], blocks, [("avgpool", avgpool), ("flatten", nn.Flatten(1))])


def efficientnet_blocks(model: efficientnet.EfficientNet) -> FeatureBlocks:
    return _features_then_pool(model, model.avgpool)


def mobilenet_v2_blocks(model: mobilenetv2.MobileNetV2) -> FeatureBlocks:
    return _features_then_pool(model, nn.AdaptiveAvgPool2d((1, 1)))  # forward pools functionally


def mobilenet_v3_blocks(model: mobilenetv3.MobileNetV3) -> FeatureBlocks:
    return _features_then_pool(model, model.avgpool)


def mnasnet_blocks(model: mnasnet.MNASNet) -> FeatureBlocks:
    layers = list(model.layers)
    blocks = [b for part in layers[1:] for b in (part if isinstance(part, nn.Sequential) else [part])]
    return by_stride(layers[:1], blocks, [("avgpool", GlobalAvgPool()), ("flatten", nn.Flatten(1))])


def shufflenet_v2_blocks(model: shufflenetv2.ShuffleNetV2) -> FeatureBlocks:
    blocks = [model.maxpool, *_children(model.stage2, model.stage3, model.stage4), model.conv5]
    return by_stride([model.conv1], blocks, [("avgpool", GlobalAvgPool()), ("flatten", nn.Flatten(1))])


def densenet_blocks(model: densenet.DenseNet) -> FeatureBlocks:
    layers = list(model.features)
    tail = [("relu", nn.ReLU(inplace=True)), ("avgpool", nn.AdaptiveAvgPool2d((1, 1))), ("flatten", nn.Flatten(1))]
    return by_stride(layers[:1], layers[1:], tail)  # forward: F.relu(features, inplace=True), pooled, flattened


def vgg_blocks(model: vgg.VGG) -> FeatureBlocks:
    layers = list(model.features)
    return by_stride(layers[:1], layers[1:], [("avgpool", model.avgpool), ("flatten", nn.Flatten(1))])


def swin_blocks(model: swin_transformer.SwinTransformer) -> FeatureBlocks:
    # features: patch embedding (stride 4), stage, patch merging, stage, ... ; channels last.
    # Patch merging halves the resolution without a strided layer, so stages are read by position.
    f = list(model.features)
    if len(f) != 8:
        raise TypeError(f"expected a Swin Transformer with 4 stages, this one has {(len(f) + 1) // 2 - 1}")
    groups = {"conv1": [f[0]], "res2": list(f[1])}
    for level, i in zip((3, 4, 5), (2, 4, 6)):
        groups[f"res{level}"] = [f[i], *f[i + 1]]
    tail = [("norm", model.norm), ("permute", model.permute), ("avgpool", model.avgpool), ("flatten", model.flatten)]
    return staged(groups, tail)


def maxvit_blocks(model: maxvit.MaxVit) -> FeatureBlocks:
    # stem strides 2; each block's first layer strides 2 again; classifier: pool, Flatten, LayerNorm, Linear, ...
    if len(model.blocks) != 4:
        raise TypeError(f"expected a MaxViT with 4 blocks, this one has {len(model.blocks)}")
    res = [(f"res{i + 2}", block.layers) for i, block in enumerate(model.blocks)]
    tail = [("avgpool", model.classifier[0]), ("flatten", nn.Sequential(model.classifier[1], model.classifier[2]))]
    return FeatureBlocks([("conv1", model.stem), *res, *tail], stages=[n for n, _ in res])


def vit_blocks(model: vision_transformer.VisionTransformer) -> FeatureBlocks:
    return FeatureBlocks(
        [("embed", VitEmbedding(model)), ("encoder", model.encoder.layers), ("norm", model.encoder.ln), ("flatten", ClassToken())],
        stages=["encoder"],
    )


TORCHVISION_FAMILIES = {
    torchvision.models.ResNet: resnet_blocks,
    torchvision.models.RegNet: regnet_blocks,
    convnext.ConvNeXt: convnext_blocks,
    efficientnet.EfficientNet: efficientnet_blocks,
    mobilenetv2.MobileNetV2: mobilenet_v2_blocks,
    mobilenetv3.MobileNetV3: mobilenet_v3_blocks,
    mnasnet.MNASNet: mnasnet_blocks,
    shufflenetv2.ShuffleNetV2: shufflenet_v2_blocks,
    densenet.DenseNet: densenet_blocks,
    vgg.VGG: vgg_blocks,
    swin_transformer.SwinTransformer: swin_blocks,
    maxvit.MaxVit: maxvit_blocks,
    vision_transformer.VisionTransformer: vit_blocks,
}
