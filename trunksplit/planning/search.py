"""Where to cut: the optimal plan under the peak model, for a segment count or a memory budget.

:func:`best_plan` finds the optimal cuts exactly by dynamic programming over
Pareto sets of (P, peak so far, recompute) (see :mod:`trunksplit.planning.peak`
for P and the peak), with forced cuts after requested features and no cut before
an in-place op. :func:`plan_trunk` is what a ``CheckpointedTrunk`` calls: balanced
plans for a segment count, budget plans (with regions) for a memory budget.
"""
import bisect
import functools
import itertools
import warnings
from dataclasses import replace
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..chains.blocks import layer_splittable_before
from ..chains.traced import begin_names
from .memory import meter_name, tensors_in
from .unit_copies import first_input_with_gradient, units_without_gradient
from .costs import NOTHING, Cost, add_costs
from .peak import PeakModel
from .budget import BudgetTooLowError, format_bytes
from .plan import Segment, SplitPlan, plain_where_frozen
from .profile import profile_units
from .request import PlanRequest, priced_in
from .sharding import measured_by_allocator, per_rank
from .templates import Region, _as_run
from .vissl import vissl_segments

PEAK_TOLERANCE = 0.02  # balanced plans: predicted peaks this close count as equal
RECOMPUTE_SLACK = 0.10  # balanced plans recompute at most this much more than vissl's plan of the same count


class Cuts(NamedTuple):
    """A plan as the planner sees it: where segments start, and the regions of units run
    under their own checkpoint, each ``(start, stop, policy)`` with ``policy``
    a policy of :data:`trunksplit.recompute.regions.REGION_POLICIES`."""

    starts: List[int]
    regions: FrozenSet[Region] = frozenset()


def best_plan(
    model: PeakModel,
    splittable: Sequence[bool],
    forced: Sequence[int],
    num_segments: Optional[int] = None,
    max_segments: Optional[int] = None,
    budget: Optional[int] = None,
    max_recompute: Optional[int] = None,
) -> Optional[Cuts]:
    """The optimal plan under ``model``, or None if none qualifies.

    With ``budget``: the least recompute whose peak fits (ties: lower peak).
    Without: the lowest peak (ties: less recompute). Recompute is compared as the model's
    objective ranks it (:meth:`PeakModel.cost_key`): time, or FLOPs first. ``num_segments``
    asks for an exact count, ``max_segments`` bounds it; ``max_recompute`` bounds
    the FLOPs run again. A cut may fall before unit i only where ``splittable[i]``,
    and must fall at every index in ``forced``. Regions come from the model's
    templates (see :meth:`PeakModel.options`).
    """
    search = functools.partial(_search, model, splittable, forced, num_segments, max_segments)
    if budget is None and max_recompute is None:
        # The lowest peak first, ignoring recompute, then the least recompute at that peak: the first
        # search keeps Pareto sets of (prefix, peak), the second drops every plan above the peak. One
        # search for both would keep sets of (prefix, peak, recompute), which grow large on a long
        # chain (fit plans its lowest peak at every batch it tries) and with regions' trade-offs.
        lowest = search(None, None, with_cost=False)
        return lowest and search(model.peak(*lowest), None)
    if budget is None and model.spans:
        raise ValueError("with regions, bound the recompute under a budget")
    return search(budget, max_recompute)


def _search(model, splittable, forced, num_segments, max_segments, budget, max_recompute, with_cost=True) -> Optional[Cuts]:
    """The dynamic programme of :func:`best_plan` (``with_cost=False``: lowest peak only)."""
    n = model.n
    forced_set = set(forced)
    allowed = [i for i in range(1, n) if splittable[i] or i in forced_set]
    limit = num_segments or max_segments or n
    # Without a bound on the count, plans of every count compete in one Pareto set per boundary:
    # counted apart, each boundary's set is kept once per count (as many as the chain has units).
    counted = num_segments is not None or max_segments is not None
    # states[p]: {count: [_Entry]} (count 0 for all when not ``counted``), prefix without the boundary at p, Pareto-pruned
    states: Dict[int, Dict[int, list]] = {0: {0: [_Entry(0, 0, NOTHING, (), frozenset())]}}
    for p in [0] + allowed:
        for count, entries in sorted(states.get(p, {}).items()):
            # the boundary at p depends on where the segment before it started: added before pruning,
            # the entries' futures depend on (prefix, peak, recompute) alone
            entries = _pareto([e._replace(prefix=e.prefix + model.boundary(p, e.starts[-1] if e.starts else None)) for e in entries],
                              model.cost_key, with_cost)
            if count >= limit:
                continue
            next_forced = min([f for f in forced_set if f > p] + [n])
            for q in [i for i in allowed if p < i <= next_forced] + ([n] if next_forced == n else []):
                options = model.options(p, q)
                if not with_cost:  # only the lowest local peak matters
                    options = [min(options, key=lambda o: o[0])]
                for e in entries:
                    for local, cost, chosen in options:  # by cost, then lower local peak
                        new_peak = max(e.peak, e.prefix + local)
                        if budget is not None and new_peak > budget:
                            continue
                        new_recompute = add_costs(e.recompute, cost)
                        if max_recompute is not None and new_recompute.flops > max_recompute:
                            continue
                        states.setdefault(q, {}).setdefault(count + 1 if counted else 0, []).append(_Entry(e.prefix, new_peak, new_recompute, e.starts + (p,), e.regions | chosen))
                        if budget is not None:
                            break  # the cheapest option that fits: more cost buys nothing under a budget
    finals = [e for count, entries in states.get(n, {}).items() if num_segments is None or count == num_segments for e in entries]
    if not finals:
        return None
    cost = model.cost_key
    key = (lambda e: (cost(e.recompute), e.peak)) if budget is not None else (lambda e: (e.peak, cost(e.recompute)))
    best = min(finals, key=key)
    return Cuts(list(best.starts), best.regions)


class _Entry(NamedTuple):
    """One way to cut the chain up to a boundary, in the dynamic programme of :func:`_search`."""

    prefix: int  # bytes of the boundaries kept before it
    peak: int  # the highest segment peak so far
    recompute: Cost  # what its segments run again
    starts: Tuple[int, ...]  # where its segments start
    regions: FrozenSet[Region]


def _pareto(entries: list, cost_key, with_cost: bool = True) -> list:
    """Entries not dominated in (prefix, peak, recompute as ``cost_key`` ranks it), or in
    (prefix, peak) without ``with_cost``; of equals, the first in (prefix, peak, recompute,
    starts, regions) order is kept."""
    rank = (lambda e: (e.prefix, e.peak, cost_key(e.recompute))) if with_cost else (lambda e: (e.prefix, e.peak))
    ranked = sorted(((rank(e), e) for e in set(entries)), key=lambda r: r[0])
    # In prefix order every kept entry has a prefix no larger than the next one's, so an entry is
    # dominated when a kept one is no worse in (peak, cost): kept on a staircase of peaks rising
    # and costs falling, the cheapest at or below a peak is the last step at or below it.
    peaks, costs, kept = [], [], []
    for key, group in itertools.groupby(ranked, key=lambda r: r[0]):
        equals = [e for _, e in group]  # only the first of equals can be kept: order them only when there are several
        entry = equals[0] if len(equals) == 1 else min(equals, key=lambda e: (cost_key(e.recompute), e.starts, sorted(e.regions)))
        peak, cost = key[1], key[2] if with_cost else ()
        below = bisect.bisect_right(peaks, peak)
        if below and costs[below - 1] <= cost:
            continue
        kept.append(entry)
        at = end = bisect.bisect_left(peaks, peak)
        while end < len(peaks) and costs[end] >= cost:  # steps this one dominates
            end += 1
        peaks[at:end], costs[at:end] = [peak], [cost]
    return kept


def annotate(plan: SplitPlan, model: PeakModel) -> SplitPlan:
    """``plan`` with the model's predicted peak and recompute per segment."""
    predicted = model.segments([s.start for s in plan.segments], plan.regions)
    timed = model.objective == "time"
    segments = tuple(
        replace(s, predicted_bytes=peak, recompute_flops=cost.flops, recompute_bytes=cost.cheap_bytes, recompute_seconds=cost.seconds if timed else None)
        for s, (peak, cost) in zip(plan.segments, predicted)
    )
    plan = replace(plan, segments=segments, predicted_peak_bytes=max(peak for peak, _ in predicted))
    if not timed:
        return plan
    seconds = sum(cost.seconds for _, cost in predicted)
    said = f"objective time: what runs again, with its checkpoints' own cost, adds {seconds * 1e3:.1f} ms to a step, from times measured while profiling"
    return replace(plan, note="\n".join(filter(None, [plan.note, said])))


def plan_from_cuts(units: Sequence[str], cuts: Cuts, feature_stops: Dict[str, int], strategy: str, model: PeakModel) -> SplitPlan:
    """A plan cutting before each of ``cuts.starts``; segments ending at a requested feature take its name."""
    names_at = {stop: name for name, stop in feature_stops.items()}
    bounds = list(cuts.starts) + [len(units)]
    segments, extra = [], 0
    for a, b in zip(bounds, bounds[1:]):
        name = names_at.get(b)
        if name is None:
            name, extra = f"activation_split_{extra}", extra + 1
        inside = tuple(sorted(_as_run(g, b == bounds[-1]) for g in cuts.regions if a <= g[0] and g[1] <= b))
        segments.append(Segment(name, a, b, checkpointed=b != bounds[-1], regions=inside))
    return annotate(SplitPlan(tuple(units), tuple(segments), strategy), model)


def region_spans(units: Sequence[Tuple[str, nn.Module]], x=None) -> List[Tuple[int, int]]:
    """The smallest runs of units ``[start, stop)`` that may form a region (a nested
    checkpoint): a region must neither start nor be followed by an in-place op, which
    would overwrite the input its recompute needs, or an output the
    ``"save_expensive"`` policy keeps. So runs are cut where a unit is splittable;
    inside one, an in-place op changes only what the region itself produced. The
    ResNet stem gives ``conv1``, ``bn1 + conv1_relu`` and ``maxpool``. Frozen units before
    the first that trains form none: they save nothing for backward (nothing of theirs needs a
    gradient), so a region there frees nothing, and costs what their profiles do not show: a
    selective region keeps their convolutions' outputs until its recompute, and a recompute region
    nested in a checkpointed segment held one more activation (as measured: ResNet-50, its stem and
    res2 frozen, 1.43x and 1.04x a budget plan). ``x``: the input, which carries a gradient to every unit
    where it requires grad."""
    bounds = [i for i, (_, m) in enumerate(units) if layer_splittable_before(m)] + [len(units)]
    trains = first_input_with_gradient([m for _, m in units], x) - 1  # the first unit that trains (or passes a gradient on)
    return [(r, s) for r, s in zip(bounds, bounds[1:]) if s > trains]


def peak_model(request: PlanRequest, x, regions: bool = False, world_size: Optional[int] = None,
               progress: Optional[Callable[[str], None]] = None) -> PeakModel:
    """Profile the request's units at inputs shaped like ``x`` and model its peaks.

    ``regions``: also measure the units under the region policies, and let the model
    plan regions (about three times the profiling). ``world_size``: model one of that many
    FSDP2 ranks (see :func:`trunksplit.planning.sharding.per_rank`); by default the request's.
    A rank's step on CPU is measured by the allocator (see
    :class:`trunksplit.planning.memory.ProfiledPeak`), so its units are profiled by it too.
    ``progress(unit name)`` is called as each unit is profiled."""
    units = list(request.units)
    world_size = world_size or request.world_size
    spans = region_spans(units, x) if regions else []
    device = next(iter(tensors_in(x))).device
    objective = priced_in(request.objective, device)
    timed = objective == "time"
    allocator = measured_by_allocator(world_size, device, compiled=request.compiled)
    costs = profile_units(units, x, spans, timed, allocator=allocator, progress=progress, use_reentrant=request.use_reentrant, features=request.feature_units)
    model = PeakModel(costs=costs, feature_units=request.feature_units, gradients=request.gradients, spans=spans, objective=objective, compiled=request.compiled,
                      update_temporaries=request.update_temporaries, reentrant=request.use_reentrant)
    return per_rank(model, list(request.modules), world_size)


def plan_trunk(request: PlanRequest, x, model: Optional[PeakModel] = None, *, held: bool = False) -> SplitPlan:
    """The cost-aware plan that ``request`` asks for, for inputs shaped like ``x``.

    Balanced plans cut at unit boundaries only. Budget plans also place regions
    (nested checkpoints under a region policy of :func:`trunksplit.recompute.regions.run_region`; non-reentrant
    trunks only: torch's selective checkpointing has no reentrant form), which reach
    below the block-level floor at less recompute. ``model``: the request's peak model at
    ``x`` if already measured (with regions exactly where this plan may use them), so
    that several plans of one trunk share one measurement. ``held``: the call's updates in backward are
    held (``CheckpointedTrunk.updates_held``; the request plans it as ``"allocated"``), which a refused budget says."""
    names = list(request.names)
    budgeted = request.budget is not None
    frozen = units_without_gradient(request.modules, x)  # the leading units no gradient reaches: all where nothing trains
    trains = frozen < len(names)
    model = model or peak_model(request, x, regions=budgeted and trains and not request.use_reentrant)
    strategy = "budget" if budgeted else "balanced"
    device = next(iter(tensors_in(x))).device
    meter = meter_name(device, measured_by_allocator(request.world_size, device, compiled=request.compiled))
    unsplit = model.peak([0])
    if not trains:  # a frozen feature extractor (a linear probe's trunk): every segment would run plainly anyway
        why = "nothing in it trains (no parameter, nor the input, requires grad), so no backward runs through it and it saves nothing"
        plan = unsplit_plan(names, request.stops, strategy, unsplit, why)
    elif budgeted and request.budget.in_bytes(unsplit) >= unsplit:
        plan = unsplit_plan(names, request.stops, strategy, unsplit, "the budget is at or above the unsplit step")
    else:
        cuts = _budget_cuts(request, x, model, held) if budgeted else _balanced_cuts(request, model)
        plan = plain_where_frozen(plan_from_cuts(names, cuts, request.stops, strategy, model), frozen)
        if not budgeted and plan.predicted_peak_bytes > unsplit:
            plan = unsplit_plan(names, request.stops, strategy, unsplit, f"every cut is predicted above the unsplit step (the best: {plan.predicted_peak_bytes / unsplit:.4f} of it)")
    return replace(plan, meter=meter, begins=tuple(begin_names(request.units)))


def unsplit_plan(units: Sequence[str], feature_stops: Dict[str, int], strategy: str, unsplit: int, why: str) -> SplitPlan:
    """A plan that checkpoints nothing: segments end at the requested features only, none
    checkpointed, and the plan says ``why``."""
    bounds = [0] + list(feature_stops.values())
    segments = tuple(Segment(name, a, b, checkpointed=False, recompute_flops=0, recompute_bytes=0)
                     for name, a, b in zip(feature_stops, bounds, bounds[1:]))
    return SplitPlan(tuple(units), segments, strategy, unsplit, note=f"runs unsplit: {why}")


def _balanced_cuts(request: PlanRequest, model: PeakModel) -> Cuts:
    """The lowest-peak cuts into ``request.num_splits`` segments (fewer, with a warning, where
    fewer valid cuts exist), recomputing no more than vissl's plan of the same count."""
    splittable, forced = request.splittable, request.forced
    k = max(request.num_splits or 1, len(forced) + 1)  # the cuts after requested features always exist
    cuts = best_plan(model, splittable, forced, num_segments=k)
    while cuts is None:  # fewer valid cuts than asked for
        k -= 1
        cuts = best_plan(model, splittable, forced, num_segments=k)
    if k < (request.num_splits or 0):
        warnings.warn(f"asked for {request.num_splits} checkpoint segments but only {k} can be made", UserWarning, stacklevel=5)
    # Switching from vissl to balanced must not cost compute: cap the recompute at vissl's
    # (plus RECOMPUTE_SLACK), where a plan under the cap exists.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vissl = vissl_segments(splittable, request.stops, k)
    cap = int(model.total_recompute([s.start for s in vissl]) * (1 + RECOMPUTE_SLACK))
    if best_plan(model, splittable, forced, num_segments=k, max_recompute=cap) is None:
        cap = None
    lowest = best_plan(model, splittable, forced, num_segments=k, max_recompute=cap)
    # Peaks within the model's own accuracy are a tie: take the least recompute among them,
    # but never a plan predicted to peak above vissl's.
    lowest_peak, vissl_peak = model.peak(lowest.starts), model.peak([s.start for s in vissl])
    near_best = min(int(lowest_peak * (1 + PEAK_TOLERANCE)), max(lowest_peak, vissl_peak))
    return best_plan(model, splittable, forced, num_segments=k, budget=near_best, max_recompute=cap)


def _budget_cuts(request: PlanRequest, x, model: PeakModel, held: bool) -> Cuts:
    """The least-recompute cuts and regions whose predicted peak meets ``request.budget``;
    a ``ValueError`` naming the smallest feasible budget where none does, and why."""
    splittable, forced = request.splittable, request.forced
    unsplit = model.peak([0])
    budget_bytes = request.budget.in_bytes(unsplit)
    cuts = best_plan(model, splittable, forced, max_segments=request.num_splits, budget=budget_bytes)
    if cuts is None:
        smallest = model.peak(*best_plan(model, splittable, forced, max_segments=request.num_splits))
        raise BudgetTooLowError(
            f"no plan meets the memory budget of {format_bytes(budget_bytes)}{request.budget.percent_hint()}, {budget_bytes / unsplit:.2f} of the unsplit "
            f"step's {format_bytes(unsplit)}, for input {_shapes(x)}; the smallest feasible budget is {format_bytes(smallest)}, "
            f"{smallest / unsplit:.3f} of unsplit" + (f", with at most {request.num_splits} segments" if request.num_splits else "")
            + ("; use_reentrant=False lets the planner recompute cheap ops only, which goes lower" if request.use_reentrant else "")
            + _what_would_help(request, model, unsplit, smallest, held),
            smallest, unsplit, held)
    return cuts


def _what_would_help(request: PlanRequest, model: PeakModel, unsplit: int, smallest: int, held: bool) -> str:
    """Why no plan goes lower, where the parameters' gradients are much of the step: they are
    allocated by it in torch's default mode, and kept where updates in backward are held, and no
    checkpoint frees them."""
    gradients = sum(model.costs.param_bytes)
    if request.gradients != "allocated" or gradients < 0.25 * smallest:
        return ""
    if held:
        return (f". This call's updates in backward are held (the optimizer's accumulating(), or holding_updates: an earlier crop "
                f"group of a multi-crop step, gradient accumulation), so its backward keeps every gradient, {format_bytes(gradients)}, "
                f"{gradients / unsplit:.2f} of the step at this input, and no checkpoint frees them: a larger batch makes activations "
                "the larger share, and trunksplit.fit finds the batch and budget that fit a memory size")
    return (f". The parameters' gradients, which this step allocates (gradients=\"allocated\"), are {format_bytes(gradients)}, "
            f"{gradients / unsplit:.2f} of the step at this input, and no checkpoint frees them: a larger batch makes activations "
            "the larger share, gradients=\"kept\" leaves them out of the step when the loop keeps them (zero_grad(set_to_none=False)), "
            "gradients=\"in_backward\" frees each as soon as the optimizer steps it in backward (trunksplit.optimizer_in_backward), "
            "and trunksplit.fit finds the batch and budget that fit a memory size")


def _shapes(x) -> str:
    """The input's shape, or the shapes of the tensors in a structured input."""
    shapes = [tuple(t.shape) for t in tensors_in(x)]
    return str(shapes[0]) if isinstance(x, torch.Tensor) else str(shapes)
