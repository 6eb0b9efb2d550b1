"""Wall times for the ``"time"`` objective: what running a unit again in a checkpointed
segment, or a span under a region policy, costs on the device in use.

Memory is counted exactly by a tracker; time cannot be. These are wall-clock
measurements of warm runs outside any tracker (a dispatch mode would slow every op
and hide a checkpoint's own per-tensor and per-op overhead, which is what they must see),
the fastest of ``REPEATS`` or more: the least disturbed by other work on a shared machine.
Short runs (a unit of a launch-bound step takes a millisecond) are repeated until they
have taken ``MIN_SECONDS`` together, up to ``MAX_REPEATS``: the fastest of two such runs
varied too much between profiles for their plans to agree (docs/benchmarks.md). Timings vary
from run to run by a few percent, so a ``"time"`` plan may too where two choices are that close.

Every price is a measured step difference, overhead included: a unit's step under a checkpoint
of its own less its plain step (:func:`rerun_seconds`), a span's step under a region policy less
its plain step (:func:`time_span`). A unit's forward alone misprices a cut: non-reentrant
checkpoint runs Python hooks for every tensor a segment saves, in the forward and at the unpack,
which cost as much as the rerun ops themselves where ops are small (a GPU's launch-bound step;
docs/benchmarks.md).
"""
import ctypes
import ctypes.util
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..chains.blocks import layer_splittable_before
from ..recompute.checkpoint import map_tensors, run_checkpointed
from ..recompute.compiled import CompiledUnits, compiled_apart, run_plain
from ..recompute.policies import POLICIES
from ..recompute.regions import run_region, run_units
from .memory import tensors_in
from .unit_copies import arriving_ones, first_input_with_gradient, private_copy, unit_input

REPEATS = 2  # at least
MIN_SECONDS, MAX_REPEATS = 0.05, 10  # short runs: repeated until they took MIN_SECONDS, at most MAX_REPEATS times


def fastest(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """The least wall time of ``repeats`` or more calls of ``fn`` (see :func:`_more`; CUDA work
    included: synchronised)."""
    times: List[float] = []
    while _more(times, repeats):
        times.append(wall_seconds(fn, device))
    return min(times)


def wall_seconds(fn: Callable[[], Any], device) -> float:
    """The wall time of one call of ``fn``, ``device``'s queued kernels waited for before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device) -> None:
    """Wait for the kernels queued on ``device`` (a no-op on a CPU). CUDA runs them asynchronously:
    a clock read without this measures their launches. The device is named: ``torch.cuda.synchronize()``
    waits for the current one, which a tensor on ``cuda:1`` need not be on."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(steps: Mapping[str, Callable[[], Any]], device, repeats: int, warmup: int = 1) -> Dict[str, float]:
    """Median wall seconds of each of ``steps`` over ``repeats`` timed rounds, after ``warmup`` untimed ones.

    The steps take turns within a round, so load drifting on a shared machine hits each alike (a step's
    calls in a row would each meet another moment's load); a call is timed between two synchronisations
    of ``device``. On a CPU the process first keeps the host memory a step frees (:func:`keep_freed_host_memory`),
    as the launcher does: with glibc's default each step faults its pages in again, a cost that grows with its
    peak and so favours the steps that peak lower. Compare the medians of one call with each other, not with
    another call's: ``interleaved_medians({"plain": plain_step, "split": split_step}, "cpu", repeats=5)``."""
    if torch.device(device).type == "cpu":
        keep_freed_host_memory()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            seconds = wall_seconds(step, device)
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def _more(times: Sequence[float], repeats: int) -> bool:
    """Whether to time once more, after ``times``: until ``repeats`` times, then while short runs
    have taken under ``MIN_SECONDS`` together, up to ``MAX_REPEATS``. ``repeats=1``: once (a caller
    that times in turn repeats the rounds itself)."""
    return len(times) < repeats or (repeats > 1 and sum(times) < MIN_SECONDS and len(times) < MAX_REPEATS)


def forward_seconds(m: nn.Module, h: Any, input_needs_grad: bool) -> float:
    """Seconds of a forward of a private copy ``m`` on ``h``, with autograd (as a recompute runs it)."""
    return fastest(lambda: m(unit_input(h, input_needs_grad)), _device(h))


def step_seconds(run: Callable[[Any], Any], h: Any, input_needs_grad: bool, repeats: int = REPEATS) -> float:
    """Seconds of one forward and backward of ``run`` (a module, or any function of one input) on ``h``."""

    def step():
        outs = [t for t in tensors_in(run(unit_input(h, input_needs_grad))) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [arriving_ones(t) for t in outs])

    return fastest(step, _device(h), repeats)


def added_seconds(runs: Dict[str, Callable[[Any], Any]], plain: Callable[[Any], Any], h: Any, input_needs_grad: bool,
                  repeats: int = REPEATS) -> Dict[str, float]:
    """What each of ``runs`` adds to ``plain``'s step on ``h`` (see :func:`step_seconds`): the fastest
    of ``repeats`` or more steps of each (see :func:`_more`; a round is a step of each), timed in
    turn, so that a burst of other work on a shared machine slows a step of each rather than every
    step of one (a difference of two timings amplifies it)."""
    fastest_plain, best = float("inf"), {name: float("inf") for name in runs}
    rounds: List[float] = []  # each round's seconds, all its steps together (see _more)
    while _more(rounds, repeats):
        took = step_seconds(plain, h, input_needs_grad, repeats=1)
        fastest_plain = min(fastest_plain, took)
        for name, run in runs.items():
            seconds = step_seconds(run, h, input_needs_grad, repeats=1)
            best[name], took = min(best[name], seconds), took + seconds
        rounds.append(took)
    return {name: seconds - fastest_plain for name, seconds in best.items()}


def checkpoint_seconds(device: torch.device, use_reentrant: bool) -> float:
    """What one checkpoint costs beyond the units it runs (entering it, keeping and restoring the
    RNG state, starting its recompute): paid once per checkpointed segment. Measured on a
    one-element tensor through one op that saves its output, the faster of 5."""
    under = {"checkpointed": lambda t: run_checkpointed(torch.sigmoid, [], (t,), use_reentrant=use_reentrant)}
    return max(added_seconds(under, torch.sigmoid, torch.ones(1, device=device), True, repeats=5)["checkpointed"], 0.0)


def rerun_seconds(m: nn.Module, h: Any, input_needs_grad: bool, use_reentrant: bool, own: float, forward: float) -> float:
    """What a private copy ``m`` adds to a step when a checkpointed segment runs it: its step under
    a checkpoint of its own less its plain step, less ``own`` (one checkpoint's cost, paid once per
    segment: :func:`checkpoint_seconds`), at least ``forward`` (its forward's seconds: two timings'
    difference may come out below it). It runs as a segment of its own runs in the trunk
    (:func:`run_units`: a unit whose first op is in place on a copy of its input)."""
    body = functools.partial(run_units, not layer_splittable_before(m), (), True)
    under = {"checkpointed": lambda x: run_checkpointed(body, [m], (x, m), use_reentrant=use_reentrant)}
    return max(added_seconds(under, m, h, input_needs_grad)["checkpointed"] - own, forward)


def faster_eagerly(units: Sequence[nn.Module], x: Any, groups: Sequence[Tuple[int, int]],
                   compiled: Callable[[int, int], Callable]) -> List[Tuple[int, int]]:
    """The groups ``[start, stop)`` of ``units`` (in order) whose training step, forward and
    backward on the input the chain hands them, is faster eagerly than compiled as
    ``compiled(start, stop)(x, *layers)`` runs them: what ``CheckpointedTrunk.compile`` runs
    eagerly on this device.

    Why measure: whether a unit compiled on its own beats eager kernels depends on the device.
    On a CPU, inductor's batch-norm kernels can make a bottleneck compiled alone slower than eager
    (tools/unit_compile_times.py; docs/benchmarks.md), while a selective region compiled whole,
    whose cheap recompute fuses into its backward, is nearly free.
    Runs on private copies (the model, its gradients, statistics and RNG untouched); a compiled
    function keeps the graph it traced for them, and the trunk's own units reuse it (their
    parameters are the graph's inputs), so measuring compiles nothing the first step would not."""
    device, carries = _device(x), first_input_with_gradient(units, x)
    slower = []
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        h, at = map_tensors(lambda t: t.detach().clone() if t.is_inference() else t.detach(), x), 0  # inference tensors cannot enter autograd
        for start, stop in groups:
            with torch.no_grad():
                h = run_plain(h, *map(private_copy, units[at:start]))
            layers = [private_copy(u) for u in units[start:stop]]
            runs = (run_plain, compiled(start, stop))
            seconds = [float("inf")] * len(runs)
            for repeat in range(3):  # interleaved; the first round warms up (the compiled one compiles)
                for i, run in enumerate(runs):
                    t = group_step_seconds(run, layers, h, start >= carries)
                    if repeat:
                        seconds[i] = min(seconds[i], t)
            if seconds[0] < seconds[1]:
                slower.append((start, stop))
            with torch.no_grad():
                h = run_plain(h, *layers)
            at = stop
    return slower


def run_eagerly(compiled: CompiledUnits, units: Sequence[nn.Module], segments, x: Any, agreement: Callable) -> frozenset:
    """The unit groups a compiled trunk's plan (``segments``) runs compiled one by one that step
    faster eagerly on ``x`` (ids of their units): they run eagerly. Every rank runs the ones
    ``agreement`` returns. None but with inductor (see ``CompiledUnits.times_units``)."""
    if not compiled.times_units:
        return frozenset()
    slower = agreement(faster_eagerly(units, x, compiled_apart(segments, units), lambda a, b: compiled.group(units[a:b])))
    return frozenset(tuple(map(id, units[a:b])) for a, b in slower)


def group_step_seconds(run: Callable, layers: Sequence[nn.Module], h: Any, input_needs_grad: bool) -> float:
    """Seconds of one forward and backward of ``run(h, *layers)`` (eager or compiled units)."""
    return step_seconds(lambda inp: run(inp, *layers), h, input_needs_grad)


def _device(h: Any) -> torch.device:
    return next(iter(tensors_in(h))).device


def time_span(members: Sequence[nn.Module], h, input_needs_grad: bool, policies: Sequence[str], forward: float, rerun: float) -> Dict[str, Dict[str, float]]:
    """For each region policy in ``policies`` (those the span could be measured under), what running the
    span so adds to its plain step (``again_seconds``), at least the forwards the policy reruns
    (``forward`` each: two timings' difference may come out below it); and what the segment's
    recompute adds where it runs a region nested in a checkpointed segment (``nested_forward_seconds``,
    at least ``forward``).

    Nested, a region runs in the segment's recompute too where a later unit of the segment needs
    it, and not as a plain forward: torch reruns a nested checkpoint as its first forward ran, its
    hooks on every tensor it saves (a selective policy runs as it nests: see
    :attr:`~trunksplit.recompute.policies.Policy.nested`). Measured as run: a checkpoint of the span
    nested as a region and one op after it that saves its output (so that the recompute runs
    through the region), against the same checkpoint of the span run plainly, whose units add
    ``rerun`` (their ``rerun_seconds``); less what the region adds on its own (``again_seconds``)."""
    under = {p: functools.partial(_run_region, members, p) for p in policies}
    seconds = {p: {"again_seconds": max(added, POLICIES[p].reruns * forward)}
               for p, added in added_seconds(under, nn.Sequential(*members), h, input_needs_grad).items()}
    nests_as = {p: POLICIES[p].nested.name for p in policies if POLICIES[p].nested.name in policies}
    nested = {q: functools.partial(_run_in_segment, members, q) for q in set(nests_as.values())}
    for q, added in added_seconds(nested, functools.partial(_run_in_segment, members, None), h, input_needs_grad).items():
        for policy in (p for p, as_run in nests_as.items() if as_run == q):
            seconds[policy]["nested_forward_seconds"] = max(added + rerun - seconds[q]["again_seconds"], forward)
    return seconds


def _run_in_segment(members: Sequence[nn.Module], policy: Optional[str], x: Any) -> Any:
    """``members`` in a checkpointed segment as one region of ``policy`` (None: plainly), and after
    them an op that saves what they return, as a later unit of the segment would."""

    def body(h, *layers):
        regions = () if policy is None else ((0, len(layers), policy),)
        return map_tensors(torch.sin, run_units(not layer_splittable_before(layers[0]), regions, True, h, *layers))

    return run_checkpointed(body, members, (x, *members))


def _run_region(members: Sequence[nn.Module], policy: str, x: Any) -> Any:
    return run_region(members, x, policy)


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep the blocks a step frees for the next step, as CUDA's caching allocator
    does, where by default it hands blocks above its mmap threshold (128 KiB, raised as blocks are freed, so
    how many varies run to run) back to the system and the next step page-faults them in again: the step
    runs faster, a step that peaks higher is no longer timed slower for its peak alone, and the ``"time"``
    objective's prices hold (measured: docs/benchmarks.md). Blocks above 32 MiB (glibc's ceiling) are still
    returned. Linux's glibc only; where the user set any ``MALLOC_*`` variable, theirs win. True if set.
    The launcher, the ``trunksplit`` commands and :func:`interleaved_medians` call it on a CPU; the library's
    planning does not (it would change the allocator of a process it was only asked to plan in)."""
    if any(k.startswith("MALLOC_") for k in os.environ) or not sys.platform.startswith("linux"):
        return False
    try:  # glibc's mallopt, by ctypes: torch has no say over the host's allocator
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    return all([mallopt(m_mmap_threshold, 32 * 2**20), mallopt(m_trim_threshold, 2**31 - 1), mallopt(m_top_pad, 64 * 2**20)])
