"""``fit``: the largest batch whose whole training step fits a memory size, in one shot.

Batch-size finders try batches until one runs out of memory. This predicts it
instead: profile the trunk's units at two small batches, take every activation
cost as linear in the batch (it is: the same ops on more images), and ask the
planner, for each batch, for the lowest peak any plan reaches. What is resident
during a step is counted exactly: every parameter and buffer of the model (its
classifier too), the optimizer's state, and the gradients (kept between steps,
or allocated by the step in backward order). The optimizer's own step peak is
measured once on stand-in tensors. One real step at the chosen batch then checks
the prediction; where it measured more, the difference is kept free as a margin (a
smaller budget, or batch) and checked again, so the prediction is never under the step
it checked. Why the profile's lines can miss: a unit's peak is the largest of several
moments, a weight gradient's (constant) against an activation's (growing with the
batch); through two small batches the line follows the first and runs below the peak
wherever the second overtakes it (ResNet-50's res4 blocks: 3x at 24 images).

Sharp edges: the step is the trunk's forward and backward under a surrogate loss;
a head and loss of your own add their activations on top (small next to a
trunk's). On a GPU the figure is the caching allocator's, so fragmentation and
cuDNN workspaces are not modelled; leave a margin.
"""
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
from .planning.memory import PeakMemory, gpu_bytes_available, host_bytes_available, measuring_alone
from .planning.scaled import ScaledChain
from .planning.sharding import RankMemory, gib, rank_memory
from .planning.plan import SplitPlan
from .planning.request import frozen_parameters
from .trunk import CheckpointedTrunk, plan_key

OPTIMIZERS = ("sgd", "lars", "adamw", None)
CHECKS = 4  # real steps fit may run to check its prediction


# an optimizer as fit prices and steps it: its class and its arguments
OptimizerSpec = Tuple[Callable[..., torch.optim.Optimizer], dict]
# each name's optimizer (class, arguments) as fit and ``trunksplit plan`` count it: its state and its
# update's temporaries matter, not the values
NAMED_OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)), "lars": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)),
               "adamw": (torch.optim.AdamW, dict(lr=1e-3))}


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
    margin_bytes: int = 0  # of the step's peak, what a check measured beyond the profile's prediction

    def __str__(self) -> str:
        measured = "-" if self.measured_total_bytes is None else f"{gib(self.measured_total_bytes)} ({self.measured_total_bytes / self.memory:.1%} of memory)"
        margin = f" (of it {gib(self.margin_bytes)} a check measured beyond the profile's line)" if self.margin_bytes else ""
        return (
            f"batch {self.batch_size} fits {gib(self.memory)}: resident {gib(self.resident_bytes)} + step peak "
            f"{gib(self.predicted_peak_bytes)}{margin} = predicted {gib(self.predicted_total_bytes)}, measured {measured}"
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

    Sharp edge, DDP: its buckets hold a copy of every gradient from the wrap on. With
    ``DistributedDataParallel(..., gradient_as_bucket_view=True)`` and the gradients zeroed, not
    freed, fit with ``gradients="kept"`` (the gradients are the buckets); otherwise leave one
    gradient copy of ``memory`` out (the launcher counts both: ``TRAIN.BATCH_SIZE_PER_RANK 0``).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if isinstance(input_shape, str) or len(input_shape) != 3 or not all(isinstance(d, int) and d > 0 for d in input_shape):
        raise ValueError(f"input_shape is one image's (C, H, W), such as (3, 224, 224), got {input_shape!r}")
    memory = parse_memory_size(memory)
    device = next(model.parameters()).device
    if verify and world_size == 1:
        check_room(memory, device, "memory", "predict only (verify=False; trunksplit fit --no-verify)")

    trunk = trunk_maker(feature_blocks(model), out_feat_keys, num_splits, gradients, use_reentrant, priced := named_optimizer(optimizer), device)
    chain = ScaledChain((profiled := trunk()).plan_request(), input_shape, device, world_size, progress)
    rank = rank_memory(model, chain.units, world_size, optimizer, 0, gradients)
    resident = rank.resident
    optimizer_peak = optimizer_step_peak(rank, optimizer_step_transient(profiled, priced), chain.full_grad_bytes)

    def total(batch: int) -> int:
        return resident + max(chain.lowest_peak(batch), optimizer_peak)

    if total(1) > memory:
        raise ValueError(
            f"memory {format_bytes(memory)} is too small for a batch of 1: the smallest that fits is "
            f"{format_bytes(total(1))} ({gib(resident)} resident and the step's peak)"
        )
    batch = largest_fitting(lambda b: total(b) <= memory)
    measured, verify = None, verify and world_size == 1  # one process cannot run a sharded step
    margin = 0  # what a check measured beyond the plan's peak: kept free by the next plan, and predicted
    for _ in range(CHECKS):
        plan = chain.plan(batch, budget=memory - resident - margin)
        fitted = trunk(memory_budget=memory - resident - margin)
        # planned from the scaled profile: no profiling, and no allocation, at this batch
        fitted.store_plan(plan_key([((batch, *input_shape), torch.get_default_dtype())], device, frozen=frozen_parameters(fitted.parameters())), plan)
        predicted = max(plan.predicted_peak_bytes + margin, optimizer_peak)
        if not verify:
            break
        step = _measured_step(fitted, _check_input(batch, input_shape, device), priced)
        measured = resident + max(step, optimizer_peak)
        if measured <= min(memory, resident + predicted) or batch == 1:
            break
        # The profile's lines run below a peak that a larger batch moves (see scaled.scaled_costs): keep
        # the miss free, at a smaller batch where the step did not fit
        margin = max(margin, step - plan.predicted_peak_bytes)
        fitting = largest_fitting(lambda b: total(b) + margin <= memory) if total(1) + margin <= memory else 1
        batch = min(fitting, batch - 1) if measured > memory else min(fitting, batch)
    rank = replace(rank, step_peak=plan.predicted_peak_bytes + margin)
    return Fit(batch, fitted, plan, predicted, resident, resident + predicted, measured, memory, rank, margin)


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
    profiled = trunk_maker(feature_blocks(model), None, None, gradients, False, named_optimizer(optimizer), device)()
    base = ScaledChain(profiled.plan_request(), input_shape, device)
    transient = optimizer_step_transient(profiled, named_optimizer(optimizer))
    rows = []
    for n in world_sizes:
        chain = base.sharded(n)
        rank = rank_memory(model, chain.units, n, optimizer, 0, gradients)
        optimizer_peak = optimizer_step_peak(rank, transient, chain.full_grad_bytes)
        for kind in SCALING_PLANS:

            def total(batch: int) -> int:
                return rank.resident + max(chain.peak(batch, kind), optimizer_peak)

            batch = largest_fitting(lambda b: total(b) <= memory) if total(1) <= memory else 0
            peak, recompute = chain.least_recompute(max(batch, 1), kind, memory - rank.resident)
            rows.append(ScalingRow(n, kind, batch, recompute, replace(rank, step_peak=peak)))
    return rows


def check_room(memory: int, device: torch.device, what: str, instead: str) -> None:
    """A step that fills ``memory`` on ``device`` must find it there: refused up front (``ValueError``) where the
    device has less available. On the CPU the kernel answers by killing the process mid-step, saying nothing; on a
    GPU the checking step ran out of memory after the profiling, with the allocator's error."""
    device = torch.device(device)
    if device.type == "cpu":
        available, where, outcome = host_bytes_available(), "this machine has available", "on the CPU would run the machine out of memory"
    elif device.type == "cuda":
        available, where, outcome = gpu_bytes_available(device), f"{device} can give (free, and held by this process's allocator)", "on the GPU would run out of GPU memory"
    else:
        return
    if available is not None and memory > available:
        raise ValueError(f"{what} {format_bytes(memory)} is more than {where} ({format_bytes(available)}): a step that fills it "
                         f"{outcome}. Fit on the device it is for, or {instead}")


def trunk_maker(blocks, out_feat_keys, num_splits, gradients: str, use_reentrant: bool, optimizer: Optional[OptimizerSpec], device) -> Callable[..., CheckpointedTrunk]:
    """What makes fit's trunks (``maker(memory_budget=...)``); stepped in backward, planned for the updates of
    ``optimizer`` (its class and arguments)."""
    if gradients == "in_backward" and optimizer is None:
        raise ValueError("gradients='in_backward' steps an optimizer in backward: name it (optimizer='sgd', 'lars' or 'adamw')")
    temporaries = update_temporaries(*optimizer, device) if gradients == "in_backward" else None

    def maker(**kw) -> CheckpointedTrunk:
        made = CheckpointedTrunk(blocks, out_feat_keys, num_splits=num_splits, gradients=gradients, use_reentrant=use_reentrant, **kw)
        if temporaries is not None:
            made.update_temporaries = temporaries
        return made

    return maker


def optimizer_step_peak(rank: RankMemory, transient: int, full_grad_bytes: int) -> int:
    """The optimizer step's peak beyond what is resident: the gradients (all allocated by then)
    and its temporaries (``transient``, measured on the whole model, whose gradients are
    ``full_grad_bytes``, scaled to a shard). Stepped in
    backward there is no step after it: the updates are in the step's peak."""
    if rank.in_backward:
        return 0
    scaled = transient * rank.gradients // max(1, full_grad_bytes)
    return (rank.gradients if not rank.gradients_kept else 0) + scaled


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


def largest_fitting(fits) -> int:
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


def _trainable(trunk: nn.Module):
    return [p for p in trunk.parameters() if p.requires_grad]


def named_optimizer(name: Optional[str]) -> Optional[OptimizerSpec]:
    """The class and arguments fit prices for an optimizer's name (None: no optimizer)."""
    return None if name is None else NAMED_OPTIMIZERS[name]


def optimizer_step_transient(trunk: nn.Module, optimizer: Optional[OptimizerSpec]) -> int:
    """Peak of one step of ``optimizer`` (its class and arguments) beyond its state and the gradients,
    measured on full-size stand-ins."""
    if optimizer is None:
        return 0
    stand_ins = _stand_ins(trunk, torch.zeros_like)
    optimizer_class, kwargs = optimizer
    opt = optimizer_class(stand_ins, **kwargs)
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


def _measured_step(trunk: CheckpointedTrunk, x: torch.Tensor, optimizer: Optional[OptimizerSpec] = None) -> int:
    """Peak of one training step of ``trunk`` on ``x``, beyond what was live before it; leaves no trace.
    With gradients ``"in_backward"``, ``optimizer`` (its class and arguments) steps in backward (its state
    made by a first, unmeasured step; the weights are put back after)."""
    params = _trainable(trunk)
    grads = [p.grad for p in params]
    buffers = [b.clone() for b in trunk.buffers()]
    weights = [p.detach().clone() for p in params] if trunk.gradients == "in_backward" else []
    modes = [(m, m.training) for m in trunk.modules()]  # the model's own modules: put their mode back too
    stepping = None
    if weights:
        optimizer_class, kwargs = optimizer
        stepping = optimizer_in_backward(params, optimizer_class, **kwargs)
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if trunk.gradients == "kept" else None
        # measuring_alone: the weights are put back after, and in a DDP process nothing reduces this step nor communicates
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), warnings.catch_warnings(), measuring_alone():
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
