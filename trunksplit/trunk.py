"""`CheckpointedTrunk`: run a trunk as a plan of checkpoint segments."""
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .blocks import feature_blocks
from .planner import plan_trunk
from .split import SplitPlan, expand_units, feature_ends, vissl_plan
from .wrapper import batchnorms, run_checkpointed

STRATEGIES = ("vissl", "balanced")


class CheckpointedTrunk(nn.Module):
    """A trunk that trains with checkpointed segments and returns the requested features.

    Args:
        trunk: a torchvision ResNet/ResNeXt/Wide-ResNet/RegNet (or a registered
            family), or an ordered dict of feature blocks in execution order.
        out_feat_keys: feature blocks to return, in this order, from ``forward``.
        num_splits: how many checkpoint segments to make (vissl's
            ``NUM_ACTIVATION_CHECKPOINTING_SPLITS``); ``None`` cuts only after
            the requested features. A count that cannot be reached warns.
        strategy: ``"vissl"`` cuts as vissl did (by module count);
            ``"balanced"`` places the cuts from measured per-layer memory.
        memory_budget: bytes (int), or a fraction in (0, 1] of the unsplit peak:
            the plan with the least recompute whose predicted peak fits.
        use_reentrant: torch's reentrant checkpoint (vissl's, for manual DDP) or not.

    Exact: a training step gives the plain model's outputs, every parameter's
    gradient and BatchNorm buffers. The last segment is never checkpointed, and in
    eval mode or under ``no_grad`` nothing is. The trunk holds only the blocks up to
    the last requested feature (a classifier head is not among its parameters, so
    plain ``DDP(trunk)`` needs no ``find_unused_parameters``). Its ``state_dict``
    keys are the feature block names (``res2.0.conv1.weight``) and do not depend
    on the plan.
    """

    def __init__(
        self,
        trunk: Union[nn.Module, Mapping[str, nn.Module]],
        out_feat_keys: Sequence[str] = ("flatten",),
        num_splits: Optional[int] = None,
        strategy: str = "vissl",
        memory_budget: Optional[Union[int, float]] = None,
        use_reentrant: bool = False,
    ):
        super().__init__()
        blocks = trunk if isinstance(trunk, Mapping) else feature_blocks(trunk)
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits must be an integer >= 1 or None, got {num_splits!r}")
        memory_budget = _check_budget(memory_budget)
        ends = feature_ends(blocks, out_feat_keys)  # validates the keys
        last = list(blocks).index(next(reversed(ends)))
        for name, block in list(blocks.items())[: last + 1]:
            self.add_module(name, block)
        self.out_feat_keys = tuple(out_feat_keys)
        self.num_splits = num_splits
        self.strategy = strategy
        self.memory_budget = memory_budget
        self.use_reentrant = bool(use_reentrant)
        self._ends = ends
        self._plans: Dict[Tuple, SplitPlan] = {}
        # vissl's plan needs no measurement; cost-aware ones start from the cuts after the features
        self._fixed_plan = vissl_plan(self._blocks(), list(ends), 1 if self._cost_aware else (num_splits or 1))
        self._plan: SplitPlan = self._fixed_plan

    def _blocks(self) -> "OrderedDict[str, nn.Module]":
        return OrderedDict(self.named_children())

    @property
    def _cost_aware(self) -> bool:
        return self.strategy != "vissl" or self.memory_budget is not None

    @property
    def plan(self) -> SplitPlan:
        """The plan of the last training forward (a cost-aware trunk: only the feature cuts before one)."""
        return self._plan

    def plan_for(self, x: torch.Tensor) -> SplitPlan:
        """The plan used for an input like ``x``.

        Cost-aware plans are measured once per input shape, dtype, device and autocast
        dtype, and cached. Call it with a sample batch to plan up front (before wrapping
        in DDP, say); otherwise the first training forward does."""
        if not self._cost_aware:
            return self._fixed_plan
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        key = (tuple(x.shape), x.dtype, device, autocast)
        if key not in self._plans:
            self._plans[key] = plan_trunk(self, x)
        return self._plans[key]

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        checkpointing = self.training and torch.is_grad_enabled()
        units = [m for _, m in expand_units(self._blocks())]
        plan = self._fixed_plan
        if checkpointing:
            plan = self._plan = self.plan_for(x)
        stops = {stop: name for name, stop in self._ends.items()}
        features = {}
        for seg in plan.segments:
            layers = units[seg.start : seg.stop]
            if checkpointing and seg.checkpointed:
                x = run_checkpointed(_run_layers, batchnorms(layers), x, *layers, use_reentrant=self.use_reentrant)
            else:
                x = _run_layers(x, *layers)
            if seg.stop in stops:
                features[stops[seg.stop]] = x
        return [features[k] for k in self.out_feat_keys]

    def extra_repr(self) -> str:
        return f"out_feat_keys={self.out_feat_keys}, strategy={self.strategy!r}, num_splits={self.num_splits}, use_reentrant={self.use_reentrant}"


def _run_layers(x: torch.Tensor, *layers: nn.Module) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _check_budget(budget):
    if budget is None or budget == 0:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget must be bytes (int) or a fraction (float), got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"a fractional memory_budget must be in (0, 1], got {budget}")
    if budget < 0:
        raise ValueError(f"memory_budget must be positive, got {budget}")
    return budget
