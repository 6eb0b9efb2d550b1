"""``fit``: the largest batch whose whole training step fits a memory size, in one shot.

Batch-size finders try batches until one runs out of memory. This predicts it
instead: profile the trunk's units at two small batches, take every activation
cost as linear in the batch (it is: the same ops on more images), and ask the
planner, for each batch, for the lowest peak any plan reaches. What is resident
during a step is counted exactly: every parameter and buffer of the model (its
classifier too), the optimizer's state, and the gradients (kept between steps,
or allocated by the step in backward order). The optimizer's own step peak is
measured once on stand-in tensors. One real step at the chosen batch then checks
the prediction (and shrinks the batch if it was optimistic).

Sharp edges: the step is the trunk's forward and backward under a surrogate loss;
a head and loss of your own add their activations on top (small next to a
trunk's). On a GPU the figure is the caching allocator's, so fragmentation and
cuDNN workspaces are not modelled; leave a margin.
"""
import copy
import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .chains import feature_blocks
from .in_backward import optimizer_in_backward, update_temporaries
from .lars import LARS
from .planning.budget import format_bytes, parse_memory_size
from .planning.memory import PeakMemory
from .planning.peak import PeakModel
from .planning.profile import UnitCosts, profile_units
from .planning.search import best_plan, plan_from_cuts
from .planning.sharding import RankMemory, gib, measured_by_allocator, rank_memory, sharded_costs
from .planning.plan import SplitPlan
from .trunk import CheckpointedTrunk, plan_key

OPTIMIZERS = ("sgd", "lars", "adamw", None)
PROFILE_BATCHES = (2, 4)  # two small batches give each cost's slope and intercept; 2, not 1: BatchNorm needs two values


@dataclass
class Fit:
    """What :func:`fit` found. Byte counts are of everything resident during a step."""

    batch_size: int
    trunk: CheckpointedTrunk  # planned for ``batch_size``, with the least recompute that fits
    plan: SplitPlan  # that plan
    predicted_peak_bytes: int  # the step's own peak, beyond what is resident before it
    resident_bytes: int  # parameters, buffers, optimizer state (and kept gradients)
    predicted_total_bytes: int
    measured_total_bytes: Optional[int]  # the checking step's figure; None when not checked
    memory: int
    rank: RankMemory  # the same by part, for one rank (world size 1: the whole model)

    def __str__(self) -> str:
        measured = "-" if self.measured_total_bytes is None else f"{gib(self.measured_total_bytes)} ({self.measured_total_bytes / self.memory:.1%} of memory)"
        return (
            f"batch {self.batch_size} fits {gib(self.memory)}: resident {gib(self.resident_bytes)} + step peak "
            f"{gib(self.predicted_peak_bytes)} = predicted {gib(self.predicted_total_bytes)}, measured {measured}"
        )


def fit(
    model: nn.Module,
    input_shape: Sequence[int],
    memory: Union[int, str],
    optimizer: Optional[str] = "sgd",
    out_feat_keys: Optional[Sequence[str]] = None,
    num_splits: Optional[int] = None,
    gradients: str = "allocated",
    use_reentrant: bool = False,
    verify: bool = True,
    world_size: int = 1,
    progress: Optional[Callable[[str], None]] = None,
) -> Fit:
    """The largest batch of ``input_shape`` images (C, H, W) whose training step fits ``memory``.

    ``memory`` (bytes, or ``"16GiB"``) is everything resident during a step: all of
    ``model``'s parameters and buffers, the gradients of the parameters the trunk
    trains, ``optimizer``'s state (``"sgd"`` with momentum: one buffer per
    parameter, as ``"lars"``; ``"adamw"``: two; ``None``: none) and the step's peak. ``gradients``
    is how the loop clears them (see :class:`CheckpointedTrunk`); ``"in_backward"``: ``optimizer``
    steps in backward (:func:`trunksplit.optimizer_in_backward`), its updates within the step's peak. ``out_feat_keys``
    defaults to the model's last feature block, as the trunk's does. ``num_splits``
    bounds the segment count. Returns a :class:`Fit` whose ``trunk`` is planned for
    the batch found. With ``verify``, one step at that batch is measured (the model's
    weights, gradients, buffers and RNG are left as they were). A memory too small
    for a batch of one raises ``ValueError`` naming the smallest that fits.

    ``world_size`` > 1 fits one rank of the trunk sharded with FSDP2 over that many ranks
    (:func:`trunksplit.shard_trunk`): ``memory`` and the batch are per rank, parameters,
    gradients and optimizer state count as this rank's shards, and the step's peak holds the
    whole parameters the rank gathers to run each unit (see :mod:`trunksplit.planning.sharding`). That is a
    prediction only: one process cannot run the sharded step to check it. ``progress(unit name)``
    is called as each unit is profiled (twice per unit: at two batches).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if len(input_shape) != 3 or not all(isinstance(d, int) and d > 0 for d in input_shape):
        raise ValueError(f"input_shape is one image's (C, H, W), got {tuple(input_shape)}")
    memory = parse_memory_size(memory)
    device = next(model.parameters()).device
    blocks = feature_blocks(model)

    trunk = _trunk_maker(blocks, out_feat_keys, num_splits, gradients, use_reentrant, optimizer, device)
    chain = _ScaledChain(trunk(), input_shape, device, world_size, progress)
    rank = rank_memory(model, chain.units, world_size, optimizer, 0, gradients)
    resident = rank.resident
    optimizer_peak = _optimizer_peak(chain, rank, _optimizer_step_transient(chain.trunk, optimizer))

    def total(batch: int) -> int:
        return resident + max(chain.lowest_peak(batch), optimizer_peak)

    if total(1) > memory:
        raise ValueError(
            f"memory {format_bytes(memory)} is too small for a batch of 1: the smallest that fits is "
            f"{format_bytes(total(1))} ({gib(resident)} resident and the step's peak)"
        )
    batch = _largest(lambda b: total(b) <= memory)
    measured, verify = None, verify and world_size == 1  # one process cannot run a sharded step
    for _ in range(4):  # the check may find the prediction optimistic: shrink and check again
        plan = chain.plan(batch, budget=memory - resident)
        fitted = trunk(memory_budget=memory - resident)
        # planned from the scaled profile: no profiling, and no allocation, at this batch
        fitted.store_plan(plan_key([((batch, *input_shape), torch.get_default_dtype())], device), plan)
        predicted = max(plan.predicted_peak_bytes, optimizer_peak)
        if not verify:
            break
        measured = resident + max(_measured_step(fitted, _check_input(batch, input_shape, device), optimizer), optimizer_peak)
        if measured <= memory or batch == 1:
            break
        batch = max(1, min(batch - 1, int(batch * (memory - resident) / (measured - resident))))
    rank = replace(rank, step_peak=plan.predicted_peak_bytes)
    return Fit(batch, fitted, plan, predicted, resident, resident + predicted, measured, memory, rank)


@dataclass
class ScalingRow:
    """One line of :func:`scaling`: a plan's largest per-rank batch at a world size."""

    world_size: int
    plan: str  # one of SCALING_PLANS
    batch_size: int  # the largest per-rank batch whose step fits (0: not one image)
    recompute: float  # FLOPs run again per step / forward FLOPs, at that batch
    rank: RankMemory  # one rank's bytes by part at that batch (step_peak: activations, allocated gradients)


# what scaling() compares: trunksplit's lowest-peak plan, a checkpoint around every unit (torchtitan's
# per-block default, each block of a stage its own segment), and no checkpoint
SCALING_PLANS = ("trunksplit", "every unit", "none")


def scaling(model: nn.Module, input_shape: Sequence[int], memory: Union[int, str], optimizer: Optional[str] = "adamw",
            world_sizes: Sequence[int] = (1, 8, 64, 512), gradients: str = "allocated") -> List[ScalingRow]:
    """Predicted per-rank memory and largest per-rank batch under FSDP2 at each of
    ``world_sizes``, for each of :data:`SCALING_PLANS`: the arithmetic of :func:`fit`
    (``verify=False``), from one profile of the trunk at two small batches, shards
    counted for each world size. A prediction: nothing runs sharded here."""
    memory = parse_memory_size(memory)
    device = next(model.parameters()).device
    base = _ScaledChain(_trunk_maker(feature_blocks(model), None, None, gradients, False, optimizer, device)(), input_shape, device)
    transient = _optimizer_step_transient(base.trunk, optimizer)
    rows = []
    for n in world_sizes:
        chain = base.sharded(n)
        rank = rank_memory(model, chain.units, n, optimizer, 0, gradients)
        optimizer_peak = _optimizer_peak(chain, rank, transient)
        for kind in SCALING_PLANS:

            def total(batch: int) -> int:
                return rank.resident + max(chain.peak(batch, kind), optimizer_peak)

            batch = _largest(lambda b: total(b) <= memory) if total(1) <= memory else 0
            peak, recompute = chain.least_recompute(max(batch, 1), kind, memory - rank.resident)
            rows.append(ScalingRow(n, kind, batch, recompute, replace(rank, step_peak=peak)))
    return rows


def _trunk_maker(blocks, out_feat_keys, num_splits, gradients: str, use_reentrant: bool, optimizer: Optional[str], device) -> Callable[..., CheckpointedTrunk]:
    """What makes fit's trunks (``maker(memory_budget=...)``); stepped in backward, planned for ``optimizer``'s updates."""
    if gradients == "in_backward" and optimizer is None:
        raise ValueError("gradients='in_backward' steps an optimizer in backward: name it (optimizer='sgd', 'lars' or 'adamw')")
    temporaries = update_temporaries(*NAMED_OPTIMIZERS[optimizer], device) if gradients == "in_backward" else None

    def maker(**kw) -> CheckpointedTrunk:
        made = CheckpointedTrunk(blocks, out_feat_keys, num_splits=num_splits, gradients=gradients, use_reentrant=use_reentrant, **kw)
        if temporaries is not None:
            made.update_temporaries = temporaries
        return made

    return maker


def _optimizer_peak(chain: "_ScaledChain", rank: RankMemory, transient: int) -> int:
    """The optimizer step's peak beyond what is resident: the gradients (all allocated by then)
    and its temporaries (``transient``, measured on the whole model, scaled to a shard). Stepped in
    backward there is no step after it: the updates are in the step's peak."""
    if rank.in_backward:
        return 0
    scaled = transient * rank.gradients // max(1, chain.full_grad_bytes)
    return (rank.gradients if not rank.gradients_kept else 0) + scaled


class _ScaledChain:
    """A trunk's units profiled at two small batches (:data:`PROFILE_BATCHES`) and planned at
    any batch from costs scaled linearly (see :func:`_scaled`), for one of ``world_size`` ranks."""

    def __init__(self, trunk: CheckpointedTrunk, input_shape: Sequence[int], device: torch.device, world_size: int = 1,
                 progress: Optional[Callable[[str], None]] = None):
        self.request = request = trunk.plan_request()
        self.trunk = trunk
        self.names = list(request.names)
        self.units = list(request.modules)
        self.splittable = request.splittable
        self.forced = request.forced
        self.features = request.feature_units
        units = list(request.units)
        allocator = measured_by_allocator(world_size, device)
        self.unsharded = [profile_units(units, torch.zeros(b, *input_shape, device=device), allocator=allocator, progress=progress) for b in PROFILE_BATCHES]
        self.full_grad_bytes = sum(self.unsharded[0].param_bytes)
        self.small = self._costs_for(world_size)

    def _costs_for(self, world_size: int) -> List[UnitCosts]:
        return [sharded_costs(c, self.units, world_size) for c in self.unsharded] if world_size > 1 else self.unsharded

    def sharded(self, world_size: int) -> "_ScaledChain":
        """The same chain for one of ``world_size`` FSDP2 ranks, without profiling again."""
        chain = copy.copy(self)
        chain.small = self._costs_for(world_size)
        return chain

    def peak(self, batch: int, kind: str) -> int:
        """The step peak at ``batch`` of a plan of :data:`SCALING_PLANS` (trunksplit's: the lowest)."""
        if kind == "trunksplit":
            return self.lowest_peak(batch)
        peaks = self._peaks(batch)
        return peaks.peak(self._fixed_starts(kind))

    def least_recompute(self, batch: int, kind: str, budget: int) -> Tuple[int, float]:
        """(step peak, FLOPs run again / forward FLOPs) at ``batch``: trunksplit's plan with the
        least recompute within ``budget`` (where one fits; else the lowest peak), or the fixed one."""
        peaks = self._peaks(batch)
        starts = self._fixed_starts(kind) if kind != "trunksplit" else None
        if starts is None:
            cuts = best_plan(peaks, self.splittable, self.forced, max_segments=self.trunk.num_splits, budget=budget)
            starts = (cuts or best_plan(peaks, self.splittable, self.forced, max_segments=self.trunk.num_splits)).starts
        return peaks.peak(starts), peaks.total_recompute(starts) / max(1, sum(peaks.costs.flops))

    def _peaks(self, batch: int) -> PeakModel:
        return PeakModel(_scaled(self.small, batch), self.features, self.trunk.gradients, update_temporaries=self.trunk.update_temporaries)

    def _fixed_starts(self, kind: str) -> List[int]:
        """Segment starts of "every unit" (a cut before each unit that may start a segment) or "none"."""
        return [0] + ([i for i in range(1, len(self.units)) if self.splittable[i]] if kind == "every unit" else [])

    def _cuts(self, batch: int, budget: Optional[int] = None):
        peaks = self._peaks(batch)
        return peaks, best_plan(peaks, self.splittable, self.forced, max_segments=self.trunk.num_splits, budget=budget)

    def lowest_peak(self, batch: int) -> int:
        """The lowest step peak any plan reaches at ``batch``."""
        peaks, cuts = self._cuts(batch)
        return peaks.peak(*cuts)

    def plan(self, batch: int, budget: int):
        """The least-recompute plan at ``batch`` whose peak fits ``budget``."""
        peaks, cuts = self._cuts(batch, budget)
        return plan_from_cuts(self.names, cuts, self.request.stops, "budget", peaks)


def _check_input(batch: int, input_shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """The checking step's input; a clear error where this machine cannot hold it."""
    try:
        return torch.zeros(batch, *input_shape, device=device)
    except (RuntimeError, MemoryError) as e:  # the allocator's own error: too big for this machine
        raise ValueError(
            f"the predicted batch {batch} cannot be checked here: its input alone ({gib(batch * math.prod(input_shape) * 4)}) "
            f"cannot be allocated on {device} ({type(e).__name__}). Pass verify=False (trunksplit fit --no-verify) for the "
            "prediction alone, or fit on the machine that will train"
        ) from None


def _largest(fits) -> int:
    """The largest batch ``b >= 1`` with ``fits(b)``, given ``fits(1)``: doubling, then bisection."""
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**24:
            raise ValueError("the memory fits more than 16M images: is it really that large?")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _scaled(small: Sequence[UnitCosts], batch: int) -> UnitCosts:
    """Unit costs at ``batch``, each byte and FLOP count a line through the two profiled batches."""
    (b0, b1), (c0, c1) = PROFILE_BATCHES, small

    def line(v0, v1):
        return tuple(max(0, round(a + (b - a) * (batch - b0) / (b1 - b0))) for a, b in zip(v0, v1))

    counts = ("output", "saved", "forward_peak", "backward_excess", "backward_fresh", "flops")
    return UnitCosts(
        names=c1.names,
        saves_input=c1.saves_input,
        input_from=c1.input_from,
        keeps_output=c1.keeps_output,
        param_bytes=c1.param_bytes,
        largest_param=c1.largest_param,
        gathered=c1.gathered,
        **{k: line(getattr(c0, k), getattr(c1, k)) for k in counts},
    )


def _trainable(trunk: nn.Module):
    return [p for p in trunk.parameters() if p.requires_grad]


# each name's optimizer (class, arguments) as fit and ``trunksplit plan`` count it: its state and its
# update's temporaries matter, not the values
NAMED_OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)), "lars": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)),
               "adamw": (torch.optim.AdamW, dict(lr=1e-3))}


def _make_optimizer(name: str, params):
    optimizer_class, kwargs = NAMED_OPTIMIZERS[name]
    return optimizer_class(params, **kwargs)


def _optimizer_step_transient(trunk: nn.Module, name: Optional[str]) -> int:
    """Peak of one optimizer step beyond its state and the gradients, measured on full-size stand-ins."""
    if name is None:
        return 0
    stand_ins = _stand_ins(trunk, torch.zeros_like)
    opt = _make_optimizer(name, stand_ins)
    opt.step()  # allocates the state
    with PeakMemory(stand_ins[0].device) as mem:
        opt.step()
    return mem.peak_bytes


def _stand_ins(trunk: nn.Module, make):
    stand_ins = []
    for p in _trainable(trunk):
        s = make(p).requires_grad_()
        s.grad = torch.zeros_like(s)
        stand_ins.append(s)
    return stand_ins


def _measured_step(trunk: CheckpointedTrunk, x: torch.Tensor, optimizer: Optional[str] = None) -> int:
    """Peak of one training step of ``trunk`` on ``x``, beyond what was live before it; leaves no trace.
    With gradients ``"in_backward"``, ``optimizer`` steps in backward (its state made by a first,
    unmeasured step; the weights are put back after)."""
    params = _trainable(trunk)
    grads = [p.grad for p in params]
    buffers = [b.clone() for b in trunk.buffers()]
    weights = [p.detach().clone() for p in params] if trunk.gradients == "in_backward" else []
    modes = [(m, m.training) for m in trunk.modules()]  # the model's own modules: put their mode back too
    stepping = None
    if weights:
        optimizer_class, kwargs = NAMED_OPTIMIZERS[optimizer]
        stepping = optimizer_in_backward(params, optimizer_class, **kwargs)
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if trunk.gradients == "kept" else None
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trunk.train()
            for _ in range(2 if stepping else 1):
                with PeakMemory(x.device) as mem:
                    sum(f.float().sum() for f in trunk(x)).backward()
    finally:
        if stepping is not None:
            stepping.remove()
        with torch.no_grad():  # weights (stepped in backward) and buffers as they were
            for t, saved in [*zip(params, weights), *zip(trunk.buffers(), buffers)]:
                t.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g
        for m, training in modes:
            m.training = training
    return mem.peak_bytes
