"""What one rank holds under FSDP2, predicted from the unsharded model for any world size.

FSDP2 (``fully_shard``) splits every parameter on dim 0 into ``world_size`` chunks, padded to
equal size, so a rank holds ``ceil(rows / world_size)`` rows of each (the figure of the first
ranks, the largest); its gradients and the optimizer's per-element state are shards of the
same shape. Buffers are replicated. To run a unit a rank all-gathers its whole parameters:
the peak model places those gathered weights, the unit's whole gradients before they are
reduce-scattered, the reduce-scatter buffer and the prefetched weights of the next unit on the
step's timeline, unit by unit (see :func:`trunksplit.planning.sharded_peak.fsdp_in_backward`).
A checkpointed segment's recompute holds the gathered weights of every unit in it until their
backward, so under FSDP2 a long segment costs its weights as well as its activations.

Exact: parameter, gradient, optimizer and buffer bytes (tensor sizes). Modelled from FSDP2's
schedule: the gathered weights and the buffers around them, the reduce-scatter, and the backend's
copy of its input on gloo. Measured on gloo ranks with torch.profiler's allocation events
(``tools/fsdp_memory.py``, docs/distributed.md): within 0.5% where weights dominate; kernels'
scratch, which the tensor tracker that profiles units cannot see, is missed where activations do.
"""
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .budget import gib
from .peak import PeakModel
from .param_bytes import largest_param_bytes, unit_param_bytes
from .profile import UnitCosts

# per-element optimizer state, in units of the parameter's own size; AdamW adds a step counter per parameter
OPTIMIZER_SLOTS = {"sgd": 1, "lars": 1, "adamw": 2, None: 0}


def shard_bytes(p: torch.Tensor, world_size: int) -> int:
    """Bytes of the largest rank's shard of ``p``: ``ceil(rows / world_size)`` rows (a 0-d tensor stays whole)."""
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world_size)
    return rows * (p.numel() // max(1, p.shape[0])) * p.element_size()


def sharded_costs(costs: UnitCosts, units: Sequence[nn.Module], world_size: int) -> UnitCosts:
    """``costs`` for one of ``world_size`` FSDP2 ranks: each unit's gradients as this rank's shards
    (what a step allocates), and its whole parameters as what the rank all-gathers to run it."""
    shards = unit_param_bytes(units, lambda p: shard_bytes(p, world_size))
    gathered = tuple(sum(p.numel() * p.element_size() for p in u.parameters() if p.requires_grad) for u in units)
    largest = largest_param_bytes(units, lambda p: shard_bytes(p, world_size))
    sharded = dict(param_bytes=shards, largest_param=largest, gathered=gathered, reduce_scatter_copies=reduce_scatter_copies())
    policies = None if costs.policies is None else {k: replace(c, **sharded) for k, c in costs.policies.items()}
    return replace(costs, policies=policies, **sharded)


def sharded_world_size(units: Sequence[nn.Module]) -> int:
    """The number of ranks the units' parameters are sharded over by FSDP2 (1 when they are not):
    the mesh dimensions they are sharded on, not the whole mesh. HSDP's 2-D mesh (replicas x
    shards) shards over its second dimension only; each replica holds whole shards of that size."""
    p = next((p for u in units for p in u.parameters() if isinstance(p, DTensor)), None)
    if p is None:
        return 1
    return math.prod(p.device_mesh.size(dim) for dim, placement in enumerate(p.placements) if placement.is_shard())


def reduce_scatter_copies() -> int:
    """Whole copies of a reduce-scatter's input its backend makes: gloo clones it (1), NCCL works
    in place (0). The backend of the process group in use; NCCL's where there is none (a plan
    for a cluster made on a laptop)."""
    return int(dist.is_initialized() and dist.get_backend() == "gloo")


def measured_by_allocator(world_size: int, device: torch.device, compiled: bool = False) -> bool:
    """Whether one rank's step is measured by the allocator, so that its units must be profiled by
    it (``profile_units(..., allocator=True)``): always on CUDA, where the step's meter is the caching
    allocator, which also holds cuDNN's workspaces (a tensor count missed 30 MB of them at a ResNet-50
    region's backward: docs/gpu.md); on CPU, FSDP2, where only torch.profiler's allocation events see
    the gathered weights (see :class:`trunksplit.planning.memory.ProfiledPeak`), and a compiled trunk,
    whose step only they see (a tracker around compiled code stops dynamo compiling)."""
    device = torch.device(device).type
    return device == "cuda" or (world_size > 1 or compiled) and device == "cpu"


def per_rank(model: PeakModel, units: Sequence[nn.Module], world_size: int) -> PeakModel:
    """``model`` (a trunk's peak model, profiled unsharded) for one of ``world_size`` FSDP2 ranks."""
    if world_size == 1:
        return model
    return PeakModel(costs=sharded_costs(model.costs, units, world_size), feature_units=model.features, gradients=model.gradients, spans=model.spans, objective=model.objective,
                     compiled=model.compiled, update_temporaries=model.update_temporaries, reentrant=model.reentrant)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes during a training step, by part."""

    world_size: int
    parameters: int  # this rank's shards of the trunk, and the rest of the model whole
    gradients: int  # the shards of the trunk's gradients (resident between steps only if kept)
    optimizer: int  # the optimizer's state for this rank's shards
    buffers: int  # replicated on every rank
    step_peak: int  # the planner's step peak at this rank's batch: activations, gradients as the step allocates them, gathered weights
    gradients_kept: bool
    in_backward: bool = False  # the optimizer steps in backward: no step after it, no gradients all alive at once
    buckets: int = 0  # DDP's gradient buckets where they are a copy beside the gradients (made when DDP wraps the model)

    @property
    def resident(self) -> int:
        """What exists before the step starts."""
        return self.parameters + self.optimizer + self.buffers + self.buckets + (self.gradients if self.gradients_kept else 0)

    @property
    def total(self) -> int:
        return self.resident + self.step_peak

    def __str__(self) -> str:
        grads = f"gradients {gib(self.gradients)} ({'kept' if self.gradients_kept else 'allocated by the step, within its peak'})"
        if self.in_backward:
            grads = f"gradients {gib(self.gradients)} (each freed at its update in backward)"
        buckets = f", DDP's gradient buckets {gib(self.buckets)}" if self.buckets else ""
        return (f"per rank at world size {self.world_size}: parameters {gib(self.parameters)}, {grads}{buckets}, optimizer {gib(self.optimizer)}, "
                f"buffers {gib(self.buffers)}, step peak {gib(self.step_peak)}; total {gib(self.total)}")


def rank_memory(model: nn.Module, units: Sequence[nn.Module], world_size: int, optimizer: Optional[str], step_peak: int, gradients: str,
                buckets: int = 0) -> RankMemory:
    """The breakdown for one rank: ``model``'s parameters and buffers (only the trunk's ``units``
    are sharded and trained; the rest of ``model`` stays whole), and ``step_peak``, the planner's
    peak of a step at this rank's batch (which includes gradients the step allocates); ``buckets``:
    bytes of DDP's gradient buckets where they are not the gradients themselves (resident from DDP's wrap on)."""
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
        step_peak=step_peak,
        gradients_kept=gradients == "kept",
        in_backward=gradients == "in_backward",
        buckets=buckets,
    )
