"""Hugging Face transformers' vision models as feature blocks.

transformers' models cannot be traced by ``torch.fx`` (their forwards take ``**kwargs`` and
dispatch attention at run time), but their bodies are chains: ViT (and ViT-MSN), DeiT and DINOv2 (with
or without registers) run embeddings, then a list of layers that each take and give one tensor, then a
norm; ConvNeXt (v1, v2) and ResNet run a stem and four stages of blocks, then pool. These functions
name them as the torchvision families are named (``embed, encoder, norm, flatten``; ``conv1, res2..res5, avgpool, flatten``), holding the
model's own modules, so a trunk cut from them trains the model.

Models are matched by class name and module (``transformers.models.*``), so nothing here
imports transformers (an optional extra). A ``...ForImageClassification`` model gives the blocks
of the model it holds, whose pooled output its classifier takes.

Sharp edges: a layer is called with its hidden states alone, as the model's own loop calls it
without an attention mask (a vision model is given none); ViT's and DeiT's embeddings interpolate
the position embeddings at any size other than the configured one (``interpolate_pos_encoding=True``,
which at the configured size adds them unchanged), so multi-crop trunks run where the model's own
forward would ask for that flag.
"""
from typing import Callable, Dict, Optional

import torch
from torch import nn

from .blocks import FeatureBlocks
from .families import ClassToken


class HfVitEmbedding(nn.Module):
    """ViT's (or DeiT's) embeddings as ``ViTModel.forward`` runs them: pixels cast to the weights' dtype, patches,
    class token, position embeddings (interpolated where the input is not the configured size)."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.embeddings.patch_embeddings.projection.weight.dtype
        return self.embeddings(x.to(dtype), interpolate_pos_encoding=True)


class SpatialMean(nn.Module):
    """``x.mean([-2, -1])``: ConvNeXt's global average pool, ``[B, C, H, W] -> [B, C]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean([-2, -1])


def _four(stages, model: nn.Module) -> list:
    if len(stages) != 4:
        raise TypeError(f"expected a {type(model).__name__} with 4 stages, this one has {len(stages)}")
    return list(stages)


def vit_blocks(model: nn.Module) -> FeatureBlocks:
    """``ViTModel`` (and ``DeiTModel``, which adds a distillation token): ``flatten`` is the class token after
    the final norm (what their ``...ForImageClassification``'s classifier takes; the BERT-style ``pooler``,
    a dense layer and tanh, is left out as a head)."""
    return FeatureBlocks([("embed", HfVitEmbedding(model.embeddings)), ("encoder", model.layers), ("norm", model.layernorm), ("flatten", ClassToken())],
                         stages=["encoder"])


def dinov2_blocks(model: nn.Module) -> FeatureBlocks:
    """``Dinov2Model``: ``flatten`` is its ``pooler_output``, the class token after the final norm."""
    return FeatureBlocks([("embed", model.embeddings), ("encoder", model.encoder.layer), ("norm", model.layernorm), ("flatten", ClassToken())],
                         stages=["encoder"])


def convnext_blocks(model: nn.Module) -> FeatureBlocks:
    """``ConvNextModel``: the patchify stem, each stage's downsampling (norm, strided conv) and blocks;
    ``flatten`` is its ``pooler_output``, the norm of the spatial mean."""
    stages = _four(model.encoder.stages, model)
    res = [(f"res{i + 2}", nn.Sequential(*stage.downsampling_layer, *stage.layers)) for i, stage in enumerate(stages)]
    tail = [("avgpool", SpatialMean()), ("norm", model.layernorm), ("flatten", nn.Flatten(1))]
    return FeatureBlocks([("conv1", model.embeddings), *res, *tail], stages=[n for n, _ in res])


def resnet_blocks(model: nn.Module) -> FeatureBlocks:
    """``ResNetModel``: vissl's ResNet names (the stem's conv, norm and activation are one module);
    ``flatten`` is its ``pooler_output`` flattened, what ``ResNetForImageClassification``'s classifier takes."""
    stages = _four(model.encoder.stages, model)
    res = [(f"res{i + 2}", stage.layers) for i, stage in enumerate(stages)]
    return FeatureBlocks([("conv1", model.embedder.embedder), ("maxpool", model.embedder.pooler), *res, ("avgpool", model.pooler), ("flatten", nn.Flatten(1))],
                         stages=[n for n, _ in res])


# a transformers class's name -> its feature blocks
HF_FAMILIES: Dict[str, Callable[[nn.Module], FeatureBlocks]] = {
    "ViTModel": vit_blocks,
    "ViTMSNModel": vit_blocks,
    "DeiTModel": vit_blocks,
    "Dinov2Model": dinov2_blocks,
    "Dinov2WithRegistersModel": dinov2_blocks,
    "ConvNextModel": convnext_blocks,
    "ConvNextV2Model": convnext_blocks,
    "ResNetModel": resnet_blocks,
    "ViTForImageClassification": lambda m: vit_blocks(m.vit),
    "ViTMSNForImageClassification": lambda m: vit_blocks(m.vit),
    "DeiTForImageClassification": lambda m: vit_blocks(m.deit),
    "ConvNextForImageClassification": lambda m: convnext_blocks(m.convnext),
    "ConvNextV2ForImageClassification": lambda m: convnext_blocks(m.convnextv2),
    "ResNetForImageClassification": lambda m: resnet_blocks(m.resnet),
}


def hf_family(model: nn.Module) -> Optional[Callable[[nn.Module], FeatureBlocks]]:
    """The function giving ``model``'s blocks where it is one of :data:`HF_FAMILIES` (or a subclass), else None."""
    for klass in type(model).__mro__:
        if klass.__module__.startswith("transformers.models.") and klass.__name__ in HF_FAMILIES:
            return HF_FAMILIES[klass.__name__]
    return None
