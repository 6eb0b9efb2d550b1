"""An SSL model: a checkpointed torchvision trunk, a projection head, SwAV's prototypes."""
from typing import List, Optional

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from ..config import budget_bytes
from ..selective import apply_activation_checkpointing, condition_from_config
from ..blocks import feature_blocks
from ..trunk import CheckpointedTrunk


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


def build_trunk(cfg) -> CheckpointedTrunk:
    """The trunk the config asks for, checkpointed as it says (splits, a budget, or selective wrapping)."""
    model = build_backbone(cfg.MODEL.TRUNK.NAME, cfg.DATA.CROP_SIZES[0])
    keys = list(cfg.MODEL.TRUNK.OUT_FEAT_KEYS)
    ac = cfg.MODEL.ACTIVATION_CHECKPOINTING
    if not ac.USE_ACTIVATION_CHECKPOINTING:
        return CheckpointedTrunk(model, keys, gradients=cfg.TRAIN.GRADIENTS)
    if len(ac.SELECT):
        trunk = CheckpointedTrunk(model, keys, gradients=cfg.TRAIN.GRADIENTS)  # one unsplit segment; the selected blocks checkpoint themselves
        apply_activation_checkpointing(trunk, condition_from_config(dict(ac.SELECT)))
        return trunk
    return CheckpointedTrunk(
        model,
        keys,
        num_splits=ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS,
        strategy=ac.STRATEGY,
        memory_budget=budget_bytes(ac.MEMORY_BUDGET),
        use_reentrant=ac.USE_REENTRANT,
        gradients=cfg.TRAIN.GRADIENTS,
    )


class SSLModel(nn.Module):
    """Runs the trunk once per crop resolution (crops of one size are batched), then the head."""

    def __init__(self, trunk: CheckpointedTrunk, feature_dim: int, hidden_dim: int, output_dim: int, num_prototypes: int = 0):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, output_dim))
        self.prototypes = nn.Linear(output_dim, num_prototypes, bias=False) if num_prototypes else None

    def forward(self, crops: List[torch.Tensor]) -> List[torch.Tensor]:
        """Embeddings (SimCLR) or prototype scores (SwAV), one tensor per crop."""
        out = []
        for i, j in _same_size_runs(crops):
            feature = self.trunk(torch.cat(crops[i:j]))[-1]
            if feature.dim() == 4:
                feature = feature.mean(dim=(2, 3))
            z = self.head(feature)
            if self.prototypes is not None:
                z = self.prototypes(F.normalize(z, dim=1))
            out += list(z.chunk(j - i))
        return out

    def plan_for(self, crops: List[torch.Tensor], autocast) -> None:
        """Make the trunk's cost-aware plans for these crops now (one per resolution), not in the first step."""
        for i, j in _same_size_runs(crops):
            with autocast:
                self.trunk.plan_for(torch.cat(crops[i:j]))

    @torch.no_grad()
    def normalize_prototypes(self) -> None:
        if self.prototypes is not None:
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight, dim=1))


def _same_size_runs(crops: List[torch.Tensor]):
    """(start, stop) of each run of consecutive crops of one size: they are batched through the trunk together."""
    i = 0
    while i < len(crops):
        j = i
        while j < len(crops) and crops[j].shape[-2:] == crops[i].shape[-2:]:
            j += 1
        yield i, j
        i = j


def build_model(cfg) -> SSLModel:
    trunk = build_trunk(cfg)
    trunk_was_training = trunk.training
    with torch.no_grad():
        trunk.eval()
        size = cfg.DATA.CROP_SIZES[0]
        feature = trunk(torch.zeros(1, 3, size, size))[-1]
        trunk.train(trunk_was_training)
    dim = feature.shape[1]
    prototypes = cfg.METHOD.NUM_PROTOTYPES if cfg.METHOD.NAME == "swav" else 0
    return SSLModel(trunk, dim, cfg.MODEL.HEAD.HIDDEN_DIM, cfg.MODEL.HEAD.OUTPUT_DIM, prototypes)

