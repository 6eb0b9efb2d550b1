"""What one rank holds under FSDP2, predicted from the unsharded model for any world size.

FSDP2 (``fully_shard``) splits every parameter on dim 0 into ``world_size`` chunks, padded to
equal size, so a rank holds ``ceil(rows / world_size)`` rows of each (the figure of the first
ranks, the largest); its gradients and the optimizer's per-element state are shards of the
same shape. Buffers are replicated. During a unit's backward the rank also holds that unit's
all-gathered (full) parameters and its unsharded gradients before they are reduce-scattered:
twice the largest unit's parameters is the *in flight* term (at world size 1 nothing is
gathered). Activations are the planner's, at the per-rank batch, with the gradients a step
allocates counted as shards.

Exact: parameter, gradient, optimizer and buffer bytes (tensor sizes). Estimated: the in-flight
term. FSDP2's all-gather and reduce-scatter buffers, its prefetching and what a checkpointed
segment's recompute gathers are not modelled one by one; measured on gloo ranks the total is
within -10% to +20% (docs/distributed.md, ``tools/fsdp_memory.py``), not the 5% of the rest of
the planner.
"""
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from torch import nn

from .peak import PeakModel
from .profile import UnitCosts, unit_param_bytes

# per-element optimizer state, in units of the parameter's own size; AdamW adds a step counter per parameter
OPTIMIZER_SLOTS = {"sgd": 1, "lars": 1, "adamw": 2, None: 0}


def shard_bytes(p: torch.Tensor, world_size: int) -> int:
    """Bytes of the largest rank's shard of ``p``: ``ceil(rows / world_size)`` rows (a 0-d tensor stays whole)."""
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world_size)
    return rows * (p.numel() // max(1, p.shape[0])) * p.element_size()


def sharded_costs(costs: UnitCosts, units: Sequence[nn.Module], world_size: int) -> UnitCosts:
    """``costs`` with each unit's gradients as one rank's shards (what a step allocates under FSDP2)."""
    shards = unit_param_bytes(units, lambda p: shard_bytes(p, world_size))
    policies = None if costs.policies is None else {k: replace(c, param_bytes=shards) for k, c in costs.policies.items()}
    return replace(costs, param_bytes=shards, policies=policies)


def per_rank(model: PeakModel, units: Sequence[nn.Module], world_size: int) -> PeakModel:
    """``model`` (a trunk's peak model, profiled unsharded) for one of ``world_size`` FSDP2 ranks."""
    if world_size == 1:
        return model
    return PeakModel(sharded_costs(model.costs, units, world_size), model.features, model.gradients, model.spans, model.objective)


def in_flight_bytes(units: Sequence[nn.Module], world_size: int) -> int:
    """Twice the largest unit's full parameters (0 on one rank): while it runs its backward a rank
    holds its all-gathered weights and its unsharded gradients, which FSDP2 then reduce-scatters."""
    if world_size == 1:
        return 0
    return 2 * max((sum(p.numel() * p.element_size() for p in u.parameters() if p.requires_grad) for u in units), default=0)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes during a training step, by part."""

    world_size: int
    parameters: int  # this rank's shards of the trunk, and the rest of the model whole
    gradients: int  # the shards of the trunk's gradients (resident between steps only if kept)
    optimizer: int  # the optimizer's state for this rank's shards
    buffers: int  # replicated on every rank
    in_flight: int  # all-gathered parameters and unsharded gradients of the unit in backward
    step_peak: int  # the planner's step peak at this rank's batch: activations, and gradients as the step allocates them
    gradients_kept: bool

    @property
    def resident(self) -> int:
        """What exists before the step starts."""
        return self.parameters + self.optimizer + self.buffers + (self.gradients if self.gradients_kept else 0)

    @property
    def total(self) -> int:
        return self.resident + self.step_peak + self.in_flight

    def __str__(self) -> str:
        grads = f"gradients {gib(self.gradients)} ({'kept' if self.gradients_kept else 'allocated by the step, within its peak'})"
        return (f"per rank at world size {self.world_size}: parameters {gib(self.parameters)}, {grads}, optimizer {gib(self.optimizer)}, "
                f"buffers {gib(self.buffers)}, in flight {gib(self.in_flight)}, step peak {gib(self.step_peak)}; total {gib(self.total)}")


def gib(n: int) -> str:
    """Bytes as people read them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def rank_memory(model: nn.Module, units: Sequence[nn.Module], world_size: int, optimizer: Optional[str], step_peak: int, gradients: str) -> RankMemory:
    """The breakdown for one rank: ``model``'s parameters and buffers (only the trunk's ``units``
    are sharded and trained; the rest of ``model`` stays whole), and ``step_peak``, the planner's
    peak of a step at this rank's batch (which includes gradients the step allocates)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_SLOTS)}, got {optimizer!r}")
    trained = {id(p): p for u in units for p in u.parameters() if p.requires_grad}
    rest = {id(p): p for p in model.parameters() if id(p) not in trained}
    shards = sum(shard_bytes(p, world_size) for p in trained.values())
    steps = 4 * len(trained) if optimizer == "adamw" else 0  # AdamW's step counters: one float32 scalar per parameter
    return RankMemory(
        world_size=world_size,
        parameters=shards + sum(p.numel() * p.element_size() for p in rest.values()),
        gradients=shards,
        optimizer=OPTIMIZER_SLOTS[optimizer] * shards + steps,
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        in_flight=in_flight_bytes(units, world_size),
        step_peak=step_peak,
        gradients_kept=gradients == "kept",
    )
