"""``TRAIN.BATCH_SIZE_PER_RANK 0``: the most images per rank whose whole SSL step fits
``TRAIN.MEMORY_LIMIT``, and the trunk budget that leaves (the least recompute that fits).

The step is more than the trunk: the head and the loss (DINO's 65536-wide outputs and their
softmaxes), the teacher's targets, the crops, and in a multi-crop step the trunk once per crop
resolution: every group's activations alive at once in a whole-step backward, one group's at a
time backward by crop group (:mod:`trunksplit.ssl.grouped`). So the fit adds three parts:

- resident, exact: every parameter and buffer (a DINO teacher's too), and the gradients and
  optimizer state of what trains (one rank's shards under FSDP2; DDP's buckets: :class:`RankLayout`);
- the trunk at each resolution, profiled once at two small batches
  (:class:`trunksplit.planning.scaled.ScaledChain`): its planned peak at any batch and budget;
- the rest of the step, measured: the launcher's own step at two small batches with a stand-in
  trunk that holds next to nothing, a line in the batch.

The step's predicted peak is the rest's plus the trunk's (the largest group's when grouped; every
group's, gradients once, when whole). The two peaks fall at different moments, so the sum leans
high; one real step at the batch found (world size 1) checks it, and what a check measured beyond
its prediction is left free by the next batch and budget; at most three checks (six while none fits),
keeping the largest batch that fitted.

Sharp edges: on CUDA the check's figure is the allocator's (fragmentation, cuDNN workspaces
included), the prediction's is not; an optimizer stepped in backward makes its state in the checking
step, so that check reads the state twice (the fit errs small).
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..fit import OptimizerSpec, check_room, largest_fitting, optimizer_step_peak, optimizer_step_transient, trunk_maker
from ..in_backward import optimizer_in_backward
from ..planning.budget import format_bytes
from ..planning.memory import PeakMemory
from ..planning.plan import SplitPlan, policy_counts
from ..planning.scaled import ScaledChain
from ..planning.sharding import gib, rank_memory, shard_bytes
from ..trunk import plan_key
from .grouped import backward_calls, by_crop_group, held_calls
from .losses import alone_as_one_of
from .model import SSLModel, build_ssl_model
from .optim import gradient_mode, optimizer_of
from .parallel import autocast_for
from .swav import fill_queue

RunStep = Callable[[SSLModel, List[torch.Tensor]], object]  # the launcher's forward and backward of one step
CHECKS = 3


@dataclass
class StepFit:
    """What :func:`fit_step` found, for one rank. Byte counts are of everything resident during a step."""

    images: int  # per rank: each brings every crop of DATA.CROP_COUNTS
    trunk_budget: int  # bytes: each resolution's trunk plan peaks within it
    resident: int
    predicted_total: int
    measured_total: Optional[int]  # the checking step's; None where not checked (FSDP2's world, verify=False)
    memory: int
    groups: List[str]  # one line per crop group: its crops and its trunk plan
    plans: Dict[tuple, SplitPlan]  # the trunk's plan for each group's input (:func:`plan_key`): train what was checked

    def __str__(self) -> str:
        measured = "-" if self.measured_total is None else f"{gib(self.measured_total)} ({self.measured_total / self.memory:.1%} of memory)"
        return "\n".join([
            f"{self.images} images per rank fit {gib(self.memory)}: resident {gib(self.resident)}, predicted {gib(self.predicted_total)}, "
            f"measured {measured}; trunk budget {format_bytes(self.trunk_budget)}",
            *self.groups,
        ])


@dataclass(frozen=True)
class RankLayout:
    """One rank's memory as the run's strategy lays it out (``Strategy.rank_layout``), what a fit must know.

    ``world``: FSDP2 ranks that share the model's parameters, gradients and optimizer state (1: each
    rank holds them whole). ``ranks``: every rank of the run, whose embeddings a loss gathers (SimCLR's,
    SwAV's): one rank's step is measured alone as one of them (:func:`alone_as_one_of`). ``buckets``:
    DDP's gradient buckets, a flat copy of every trained gradient made when DDP wraps the model and
    resident the whole run: ``"views"`` where the gradients are views into them
    (``gradient_as_bucket_view``, kept between steps: DDP's ``Strategy.configured``), ``"copy"`` where
    the gradients are tensors of their own beside them (vissl's manual path), ``""`` without DDP.
    ``host_ranks``: ranks whose steps fill this host's memory at once (on a CPU, torchrun's
    ``LOCAL_WORLD_SIZE``; a GPU rank's step fills its own GPU: 1)."""

    world: int = 1
    ranks: int = 1
    buckets: str = ""
    host_ranks: int = 1

    def bucket_bytes(self, mode: str, gradient_bytes: int) -> int:
        """Bytes of DDP's buckets resident beside the gradients that gradient mode ``mode`` counts
        (``gradient_bytes`` in all): none where the gradients are kept views into them."""
        views = self.buckets == "views" and mode == "kept"
        return gradient_bytes if self.buckets and not views else 0

    def between_steps_bytes(self, mode: str, gradient_bytes: int) -> int:
        """Bytes beyond what is resident at a moment outside the step's own peak, no activation alive:
        DDP copying kept gradients into the buckets it makes anew as the second step starts (old and new
        alive), or vissl's manual all-reduce, every gradient flattened into its buckets at once beside
        the gradients (:func:`trunksplit.manual_gradient_all_reduce`)."""
        if self.buckets == "views":
            return gradient_bytes if mode == "kept" else 0
        if self.buckets == "copy":
            return gradient_bytes + (gradient_bytes if mode == "allocated" else 0)
        return 0


def crop_groups(cfg) -> List[Tuple[int, int]]:
    """(crop size, crops per image) of each trunk call of a step, in step order."""
    groups: List[Tuple[int, int]] = []
    for size, count in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS):
        if groups and groups[-1][0] == size:
            groups[-1] = (size, groups[-1][1] + count)
        else:
            groups.append((size, count))
    return groups


def crop_shapes(cfg) -> List[torch.Tensor]:
    """One empty stand-in per crop of a step (1 x 1 x size x size), in step order: what ``grouped.held_calls`` and
    ``backward_calls`` read of a step's crops (their sizes) when the config is all there is."""
    return [torch.zeros(1, 1, size, size) for size, count in crop_groups(cfg) for _ in range(count)]


class _StandInTrunk(nn.Module):
    """A trunk's outputs at a trunk's width that keeps next to nothing for backward: the rest of
    the step measured without the trunk."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, dim))

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        return [x.mean(dim=(2, 3)) @ self.weight]


def fit_step(cfg, device: torch.device, run_step: RunStep, layout: RankLayout = RankLayout(), progress: Optional[Callable[[str], None]] = None,
             images_at_most: Optional[int] = None, verify: bool = True) -> StepFit:
    """The most images per rank whose whole step fits ``cfg.TRAIN.MEMORY_LIMIT`` (bytes), for one
    rank laid out as ``layout`` says (the default: one process), and at most ``images_at_most`` (the
    rank's share of the data set: a step holds each image once). ``run_step(model, crops)`` is the
    launcher's forward and backward; ``progress(line)`` hears each phase. ``verify=False`` predicts
    only: no real step checks the batch found (one FSDP2 rank's step never is). A limit too small for
    one image is a ``ValueError`` naming the smallest that fits."""
    say = progress or (lambda line: None)
    if images_at_most is not None and images_at_most < 1:
        raise ValueError(f"the data set holds fewer images than the run has ranks ({layout.ranks}): no step gives each rank an image of its own")
    memory, world = int(cfg.TRAIN.MEMORY_LIMIT), layout.world
    # checked by real steps (one rank's FSDP2 step cannot be) and trained at that size: on every rank of this host at once
    host = "TRAIN.MEMORY_LIMIT" if layout.host_ranks == 1 else f"TRAIN.MEMORY_LIMIT for each of this host's {layout.host_ranks} ranks, in all"
    check_room(memory * layout.host_ranks, device, host, "set TRAIN.BATCH_SIZE_PER_RANK yourself")
    torch.manual_seed(cfg.SEED)
    # a SwAV queue full, as a run's steps use it once it is: the queue's scores and its Sinkhorn are in the step measured
    step = _StepPrediction(cfg, fill_queue(build_ssl_model(cfg).to(device)), device, layout, run_step, say, images_at_most)
    if step.total(1) > memory:
        raise ValueError(f"TRAIN.MEMORY_LIMIT {format_bytes(memory)} is too small for one image per rank: the smallest that fits is "
                         f"{format_bytes(step.total(1))} ({gib(step.rank.resident)} resident and the step's peak)")
    say("searching the largest batch and the least recompute that fits")
    images = largest_fitting(lambda b: step.fits(b, memory))
    if images > max(step.rest.measured):  # the rest's line through two small batches runs under it at larger ones
        say(f"measuring the head, the loss and the teacher with a stand-in trunk at {images} images, then searching again")
        step.rest.measure_at(images)
        images = largest_fitting(lambda b: step.fits(b, memory))
    if images == images_at_most and step.total(images + 1) <= memory:
        say(f"the data set gives each rank {images} images a step: the batch stops there (the memory would hold more)")
    budget, measured = step.budget(images, memory), None
    if world == 1 and verify:  # one process cannot run a sharded step
        images, budget, measured = _checked(step, images, memory, say)
    plans = step.plans(images, budget)
    total, budget = step.total(images, budget), trunk_budget(budget, plans)
    planned = iter(plans.values())
    lines = [_group_line(k, s, n, images, next(planned), budget, held) if read else
             f"  group {k + 1}: {n} x {s}px crops per image, the trunk on {images * n}: without a graph (a lone large crop, read by no loss term)"
             for k, ((s, n), held, read) in enumerate(zip(step.groups, step.held, step.backward))]
    return StepFit(images, budget, step.rank.resident, total, measured, memory, lines, plans)


def trunk_budget(budget: int, plans: Dict[tuple, SplitPlan]) -> int:
    """``budget`` as a trunk takes it, its ``plans`` given: 0, where the search found none that fits (each group's
    lowest-peak plan, checked by a real step all the same), reads as no budget to a trunk (``memory_budget=0``:
    not planned by cost, so it takes no stored plan), so it is the largest of those plans' peaks, which each meets."""
    return budget or max(plan.predicted_peak_bytes for plan in plans.values())


class _StepPrediction:
    """The step's predicted bytes at any images per rank and trunk budget: resident, the rest of
    the step (measured with a stand-in trunk) and the trunk at each crop group (scaled profiles)."""

    def __init__(self, cfg, model: SSLModel, device, layout: RankLayout, run_step: RunStep, say: Callable[[str], None], images_at_most: Optional[int]):
        self.cfg, self.model, self.device, self.run_step, self.ranks = cfg, model, device, run_step, layout.ranks
        self.images_at_most = images_at_most
        self.groups = crop_groups(cfg)
        sizes = crop_shapes(cfg)
        self.grouped, self.held = by_crop_group(cfg, sizes), held_calls(cfg, sizes)  # held: the trunk plans the call so
        self.backward = backward_calls(cfg, sizes)
        self.mode = mode = gradient_mode(cfg)
        self.optimizer = optimizer_of(cfg)  # the run's own: its class and the config's arguments
        world = layout.world
        trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        # the head trains (and shards) as the trunk does
        self.rank = rank_memory(model, [model], world, cfg.OPTIM.NAME, 0, mode, layout.bucket_bytes(mode, trained))
        # outside the step's own peak: the optimizer's step, and DDP's moments between steps
        self.optimizer_peak = max(optimizer_step_peak(self.rank, optimizer_step_transient(model, self.optimizer), trained),
                                  layout.between_steps_bytes(mode, trained))
        ac = cfg.MODEL.ACTIVATION_CHECKPOINTING
        self.make = trunk_maker(model.trunk.feature_blocks, list(model.trunk.out_feat_keys), ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS,
                                mode, ac.USE_REENTRANT, self.optimizer, device)
        self.chains: Dict[int, ScaledChain] = {}
        for size in sorted({s for s, _ in self.groups}, reverse=True):
            say(f"profiling the trunk's units at {size}px, two small batches")
            with autocast_for(cfg, device):  # as the run's trunk runs: a bf16 step holds other tensors than an fp32 one
                self.chains[size] = ScaledChain(self.make().plan_request(), (3, size, size), device, world)
        # what a trunk call finds made by the calls whose backward ran before its own: the gradients (allocated), or,
        # stepped in backward, the gradients held for the last group's update (grouped) or their parts waiting in autograd's
        # buffers until the first call's part arrives (whole)
        self.trunk_grads = sum(shard_bytes(p, world) for p in model.trunk.parameters() if p.requires_grad) if mode != "kept" else 0
        say("measuring the head, the loss and the teacher with a stand-in trunk, two small batches")
        self.rest = _RestOfStep(model, run_step, self.groups, device, mode == "kept", layout.ranks)

    def trunk_peak(self, images: int, budget: Optional[int]) -> int:
        """Grouped: each group's trunk alone, a later one finding the gradients the first one made.
        Whole: the groups are backpropagated last first, each beside what the earlier ones' forwards
        still hold, every one after the first finding the gradients made. Stepped in backward, no
        parameter is updated before its gradient's last part: whole, the later calls' backward holds
        the parts (autograd's buffers) as allocated gradients and the first call finds them; grouped,
        the first group's backward keeps its gradients (allocated), the later groups find them."""
        sized = [(self.chains[s], images * n) for s, n in self.groups]
        # grouped, a lone large crop's group runs without a graph (grouped.backward_calls): no gradients for the next group to
        # find; its forward holds a unit's input and output at a time, below a trained group's peak
        first = self.backward.index(True)
        waiting = self.mode == "in_backward" and len(sized) - first > 1
        alone = [chain.planned_peak(b, budget, "allocated" if waiting else None, held) for (chain, b), held in zip(sized, self.held)]
        # waiting, the first call's backward updates as it goes (its own mode's peak) beside the parts the others left
        found = [a if self.mode == "kept" else chain.planned_peak(b, budget, None if waiting and j == 0 else "kept", held) + self.trunk_grads
                 for j, ((chain, b), a, held) in enumerate(zip(sized, alone, self.held))]
        if self.grouped:
            return max([alone[first], *found[first + 1:]])
        held = [chain.held_after_forward(b, budget) for chain, b in sized]
        last = len(sized) - 1
        return max(sum(held[:j]) + (alone[j] if j == last else found[j]) for j in range(last, -1, -1))

    def in_data_set(self, images: int) -> bool:
        """Whether the data set gives each rank ``images`` distinct images a step."""
        return self.images_at_most is None or images <= self.images_at_most

    def fits(self, images: int, memory: int, margin: int = 0) -> bool:
        """Whether a step of ``images`` per rank is predicted within ``memory`` less ``margin``, and the data set gives a rank that many."""
        return self.in_data_set(images) and self.total(images) + margin <= memory

    def total(self, images: int, budget: Optional[int] = None) -> int:
        """Everything resident during the step at ``images`` per rank (``budget`` None: the lowest-peak plans)."""
        return self.rank.resident + max(self.rest(images) + self.trunk_peak(images, budget), self.optimizer_peak)

    def budget(self, images: int, memory: int) -> int:
        """The trunk's byte budget at ``images``: all that is left where the step still fits with it, else
        the largest that does (a whole step adds the groups' peaks; a later group finds the gradients), by bisection."""
        lo, hi = 0, memory - self.rest(images) - self.rank.resident  # 0: every group's lowest-peak plan; everything left
        if self.total(images, hi) <= memory:
            return hi
        while hi - lo > memory // 200:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.total(images, mid) <= memory else (lo, mid)
        return lo

    def plans(self, images: int, budget: int) -> Dict[tuple, SplitPlan]:
        """The trunk's plan for each group's input (:func:`plan_key`) at ``images`` per rank; none for a group that
        runs without a graph (a lone large crop's: its trunk plans nothing)."""
        with autocast_for(self.cfg, self.device):  # the key the run's trunk looks its plan up by, under the run's autocast
            return {plan_key([((images * n, 3, s, s), torch.get_default_dtype())], self.device, held): self.chains[s].plan(images * n, budget, held)
                    for (s, n), held, read in zip(self.groups, self.held, self.backward) if read}

    def measured(self, images: int, budget: int) -> int:
        """Everything resident during one real step at ``images`` per rank, the trunk planned as predicted (no profiling)."""
        plans = self.plans(images, budget)
        trunk = self.make(memory_budget=trunk_budget(budget, plans))
        for key, plan in plans.items():
            trunk.store_plan(key, plan)
        peak = _measured_step(self.model, trunk, self.run_step, _crops(self.groups, images, self.device), self.mode, self.optimizer, self.ranks)
        return self.rank.resident + max(peak, self.optimizer_peak)


def _checked(step: _StepPrediction, images: int, memory: int, say) -> Tuple[int, int, int]:
    """(images, trunk budget, measured bytes): the largest batch a real step showed fits, from the
    predicted ``images``. What a check measured beyond its prediction is kept as a margin that the
    next batch and budget leave free. At most :data:`CHECKS` checks (twice that while none fits)."""
    best, margin = None, 0
    for check in range(2 * CHECKS):
        if check >= CHECKS and best is not None:
            break
        budget = step.budget(images, memory - margin)
        say(f"checking {images} images per rank by one real step")
        measured = step.measured(images, budget)
        if measured <= memory and (best is None or images > best[0]):
            best = (images, budget, measured)
        if memory * 0.95 <= measured <= memory or measured > memory and images == 1:
            break
        margin = max(0, measured - step.total(images, budget))  # what the prediction missed at the plans checked
        following = largest_fitting(lambda b: step.fits(b, memory, margin)) if step.total(1) + margin <= memory else 1
        if following == images:
            following = images - 1 if measured > memory else images + 1
        if following < 1 or best is not None and following <= best[0] or not step.in_data_set(following):
            break
        images = following
    if best is None:
        raise ValueError(f"TRAIN.MEMORY_LIMIT {format_bytes(memory)} fits no batch checked: the last, {images} images per rank, measured "
                         f"{format_bytes(measured)}. Give more memory, or a smaller model or crops")
    return best


def fitted_batch(cfg, device: torch.device, run_step: RunStep, layout: RankLayout = RankLayout(),
                 progress: Optional[Callable[[str], None]] = None, images_at_most: Optional[int] = None) -> Tuple[int, int, list]:
    """What the launcher trains with: (images per rank, trunk budget in bytes, the trunk's plans as
    ``[(key, plan.state())]``, plain data any rank can receive) of :func:`fit_step`."""
    found = fit_step(cfg, device, run_step, layout, progress, images_at_most)
    return found.images, found.trunk_budget, [(key, plan.state()) for key, plan in found.plans.items()]


def _group_line(k: int, size: int, count: int, images: int, plan, budget: int, held: bool) -> str:
    """A crop group's plan; one above the trunk budget is the group's lowest-peak plan (the budget binds another group)."""
    regions = policy_counts(plan.regions)
    above = plan.predicted_peak_bytes > budget
    return (f"  group {k + 1}: {count} x {size}px crops per image{', updates held' if held else ''}, the trunk on {images * count}: "
            f"{len(plan.segments)} segment{'s' if len(plan.segments) > 1 else ''}{f' ({regions})' if regions else ''}, predicted trunk peak "
            f"{gib(plan.predicted_peak_bytes)}" + (" (above the trunk budget: the lowest this group reaches"
                                                   + ("; its backward keeps every gradient" if held else "") + "; another group's peak binds the step)" if above else ""))


def _crops(groups, images: int, device) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(images, 3, s, s, generator=g).to(device) for s, n in groups for _ in range(n)]


class _RestOfStep:
    """Bytes of the step's peak outside the trunk, in the images per rank: the launcher's own step with stand-in
    trunks that keep next to nothing (head, loss, a teacher's targets, crops), measured at two small batches and
    at any added (:meth:`measure_at`); between two of them their chord, beyond the last the last two's line.

    Sharp edge: the peak is the largest of lines in the batch (the head's weight gradients lead at 2 and 4 images,
    its activations at a hundred): beyond the batches measured it runs under, between them above (a chord)."""

    def __init__(self, model: SSLModel, run_step: RunStep, groups, device, kept: bool, ranks: int):
        self.model, self.run_step, self.groups, self.device, self.kept, self.ranks = model, run_step, groups, device, kept, ranks
        self.measured: Dict[int, int] = {}
        for images in (2, 4):
            self.measure_at(images)

    def measure_at(self, images: int) -> None:
        """Measure the rest of the step at ``images`` per rank; the prediction passes through it from then on."""
        model = self.model
        dim = next(m for m in model.head.modules() if isinstance(m, nn.Linear)).in_features
        trunk, teacher = model.trunk, model.teacher
        model.trunk = _StandInTrunk(dim).to(self.device)
        if teacher is not None:
            teacher_trunk, teacher.trunk = teacher.trunk, _StandInTrunk(dim).to(self.device).requires_grad_(False)
        try:
            self.measured[images] = _peak_of(model, self.run_step, _crops(self.groups, images, self.device), self.kept, self.ranks)
        finally:
            model.trunk = trunk
            if teacher is not None:
                teacher.trunk = teacher_trunk

    def __call__(self, images: int) -> int:
        batches = sorted(self.measured)
        upper = next((k for k, b in enumerate(batches) if b >= images and k > 0), len(batches) - 1)
        (b0, f0), (b1, f1) = [(b, self.measured[b]) for b in batches[upper - 1 : upper + 1]]
        return math.ceil(f0 + (f1 - f0) * (images - b0) / (b1 - b0))


def _peak_of(model: SSLModel, run_step: RunStep, crops, kept: bool, ranks: int) -> int:
    """The step's peak beyond what was live before it, with the crops, as one of ``ranks`` ranks alone (no
    collective: ranks that measured apart would not meet); the model's gradients left as the loop leaves them."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if kept and p.requires_grad else None
    with torch.random.fork_rng(devices=[crops[0].device] if crops[0].device.type == "cuda" else []), alone_as_one_of(ranks), \
            PeakMemory(crops[0].device) as mem:
        run_step(model, crops)
    for p in model.parameters():
        p.grad = None
    return mem.peak_bytes + sum(c.numel() * c.element_size() for c in crops)


def _measured_step(model: SSLModel, trunk, run_step: RunStep, crops, mode: str, optimizer: OptimizerSpec, ranks: int) -> int:
    """The peak of one real step of ``model`` with ``trunk`` in place of its own (stepped in backward by
    ``optimizer``, its class and arguments, where ``mode`` says, after a first step has made the optimizer's
    state: the state is resident, counted apart, and a run's first step makes it where the others find it)."""
    saved, model.trunk = model.trunk, trunk
    stepping = None
    if mode == "in_backward":
        optimizer_class, kwargs = optimizer
        stepping = optimizer_in_backward([p for p in model.parameters() if p.requires_grad], optimizer_class, **kwargs)
        _peak_of(model, run_step, crops, False, ranks)
    try:
        return _peak_of(model, run_step, crops, mode == "kept", ranks)  # alone: no rank reduces its gradients
    finally:
        model.trunk = saved
        if stepping is not None:
            stepping.remove()
