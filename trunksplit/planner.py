"""Cost-aware plans: where to cut a chain so a training step peaks lowest.

The peak model. A training step with checkpoint segments S_1..S_m (S_m not
checkpointed) holds, while segment j runs its backward:

- P_j: the input of every segment up to j (checkpoints keep their inputs), plus
  the requested features the caller still holds;
- the tensors S_j saves for backward, recomputed (or, for S_m, kept from the
  forward), freed unit by unit as backward walks back;
- the gradient flowing into the current unit and the unit's own backward
  excess: gradient buffers of activations and transient weight gradients. A
  model of saved tensors alone misses these and predicts far too low a peak.

- in torch's default gradient mode (``zero_grad()`` sets gradients to None, so
  the step allocates them in backward order: ``gradients="allocated"``), the
  gradients of every parameter after the current unit, kept from then on; with
  ``zero_grad(set_to_none=False)`` (``"kept"``) they existed before the step
  and are not part of its figure.

So peak = max_j (P_j + L(S_j)), with P_j a prefix sum of boundary sizes and L
local to the segment (the gradients allocated so far depend on the unit only).
:func:`best_plan` finds the optimal cuts exactly by dynamic programming over
Pareto sets of (P, peak so far, recompute), with forced cuts after requested
features and no cut before an in-place op.

Regions (budget plans) go below the block level: runs of units checkpointed on
their own inside a segment (see :class:`PeakModel`). Which regions to try comes
from a few ranked templates, each evaluated exactly: the search over cuts stays
exact, the one over regions is as good as its templates.
"""
import functools
import itertools
import warnings
from dataclasses import replace
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from .blocks import layer_splittable_before
from .profile import UnitCosts, profile_units
from .split import Segment, SplitPlan, expand_units, vissl_plan
from .regions import REGION_POLICIES, nested_policy


PEAK_TOLERANCE = 0.02  # balanced plans: predicted peaks this close count as equal
RECOMPUTE_SLACK = 0.10  # balanced plans recompute at most this much more than vissl's plan of the same count


GRADIENT_MODES = ("allocated", "kept")


Region = Tuple[int, int, str]  # units [start, stop) run as one nested checkpoint under a policy


class Cuts(NamedTuple):
    """A plan as the planner sees it: where segments start, and the regions of units run
    under their own checkpoint, each ``(start, stop, policy)`` with ``policy``
    a policy of :data:`trunksplit.regions.REGION_POLICIES`."""

    starts: List[int]
    regions: FrozenSet[Region] = frozenset()


class PeakModel:
    """Predicts a step's peak bytes for any cut of a chain: what the step allocates beyond
    what was live before it (parameters, and in ``"kept"`` mode their gradients).

    Regions. A run of consecutive ``spans`` (``[start, stop)`` runs of units that may
    run under their own checkpoint, measured so in ``costs.policies``: see
    :func:`region_spans`) may form a region, checkpointed inside its segment. Under
    ``"save_expensive"`` it keeps its input and its expensive ops' outputs, under
    ``"save_heavy"`` only its heavy ones', under ``"recompute"`` and
    ``"recompute_stages"`` only its input. In the last segment that is what backward
    finds; in a checkpointed segment, what the segment's recompute holds, and there a
    selective region is a ``"recompute"`` one (see :func:`nested_policy`). The region's
    own backward then recomputes it, like a checkpointed segment of its own, on top of
    what is kept before it: the outputs it does not keep (a bottleneck block's output is
    its successor's input) are never held, which is where a region of several blocks
    saves more than each block on its own. A ``"recompute_stages"`` region's backward,
    which rebuilds one stage at a time, is measured whole (see :meth:`_region`).
    """

    def __init__(self, costs: UnitCosts, feature_units: Sequence[int], gradients: str = "allocated", spans: Iterable[Tuple[int, int]] = ()):
        if gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}")
        self.costs = costs
        self.n = len(costs)
        self.gradients = gradients
        self.features = sorted(set(feature_units))  # unit indices whose outputs the caller holds
        # while a segment ending before unit b runs its backward: the features it and later segments returned
        self._features_held = [sum(costs.output[f] for f in self.features if f >= b - 1) for b in range(self.n + 1)]
        self.spans = sorted(set(spans))
        if self.spans and costs.policies is None:
            raise ValueError("region spans need costs measured under each policy (profile_units(..., spans=...))")
        c = costs
        self._flops_prefix = [0] + list(itertools.accumulate(c.flops))
        self._cheap = c.recompute_bytes or (0,) * self.n
        self._cheap_prefix = [0] + list(itertools.accumulate(self._cheap))
        self._light_prefix = [0] + list(itertools.accumulate(c.light_flops or (0,) * self.n))
        # what a region runs again under each policy, the measure its templates are ranked by
        self._prices = {"save_expensive": self._cheap_prefix, "save_heavy": self._light_prefix, "recompute": self._flops_prefix,
                        "recompute_stages": [2 * f for f in self._flops_prefix]}
        # grads_after[i]: gradients that exist while unit i runs its backward (those of units after it)
        after = list(itertools.accumulate(reversed(c.param_bytes)))[::-1] + [0]
        self._grads_after = after[1:] if gradients == "allocated" else [0] * self.n
        # a unit that allocates a new activation (rather than passing its input's storage on)
        self._allocates = [i + 1 < self.n and c.input_from[i + 1] == i for i in range(self.n)]
        self._options: Dict[int, Dict[int, list]] = {}
        self._regions: Dict[Region, tuple] = {}  # see _region
        self._region_steps: Dict[Tuple[Region, bool], tuple] = {}  # see _step_region
        self._templates: Optional[List[List[Region]]] = None

    def boundary(self, a: int) -> int:
        """Bytes a segment starting at unit ``a`` keeps as its input (the chain's own input is not counted)."""
        return self.costs.output[a - 1] if a > 0 else 0

    def _step(self, state: "_Scan", a: int, i: int, last: bool) -> "_Scan":
        """The scan of a segment starting at ``a`` extended by unit ``i``, which keeps
        everything; ``last``: the segment is the last, not checkpointed.

        Kept bytes: what each unit allocates and keeps itself, plus the outputs of
        units in the segment that later units keep as their input, each storage once
        (``counted``: the current activation's storage is already in ``kept``)."""
        c = self.costs
        kept, forward, backward, counted, cost, pending = state
        source = c.input_from[i]
        forward = max(forward, kept + c.forward_peak[i])
        if c.saves_input[i] and source >= a and not counted:
            kept, counted = kept + c.output[source], True
        kept += c.saved[i]
        backward = max(backward, kept + c.backward_excess[i] + self._grads_after[i])
        if self._allocates[i]:
            counted = c.keeps_output[i]
        if not last:
            # A checkpointed segment's recompute runs the unit once more, if it must: torch stops
            # a recompute once it has rebuilt the last tensor backward needs, so units after the
            # last one that saves a tensor of its own do not run (a unit that keeps only its
            # input, as a lone convolution does, needs only the units before it).
            if c.saves_input[i]:
                cost, pending = _add(cost, pending), (0, 0)
            pending = _add(pending, (c.flops[i], self._cheap[i]))
            if c.saved[i] or c.keeps_output[i]:
                cost, pending = _add(cost, pending), (0, 0)
        return _Scan(kept, forward, backward, counted, cost, pending)

    def _step_region(self, state: "_Scan", a: int, region: Region, last: bool) -> "_Scan":
        """The scan extended by a region ``(r, s, policy)``, checkpointed inside the segment.

        The planner's inner loop: what the region adds is looked up once per (region, last)."""
        step = self._region_steps.get((region, last))
        if step is None:
            step = self._region_steps[region, last] = (*self._region(_as_run(region, last)), self.costs.input_from[region[0]])
        held, region_forward, backward_peak, output_counted, again, body, source = step
        kept, forward, backward, counted, cost, pending = state
        forward = max(forward, kept + region_forward)
        if source >= a and not counted:  # the region keeps its input
            kept, counted = kept + self.costs.output[source], True
        backward = max(backward, kept + backward_peak)
        kept += held
        counted = counted if output_counted is None else output_counted
        if not last:  # the region keeps its input: the segment's recompute runs it only if a later unit needs it
            cost, pending = (cost[0] + pending[0], cost[1] + pending[1]), body
        return _Scan(kept, forward, backward, counted, (cost[0] + again[0], cost[1] + again[1]), pending)

    def _region(self, region: Region) -> tuple:
        """What a region adds to a scan, whatever comes before it: (bytes it keeps, its
        forward's peak, its backward's peak, whether its output is counted as kept (None:
        its output is its input's storage), what its own backward runs again, what running
        it once costs: (FLOPs, cheap bytes) both)."""
        if region not in self._regions:
            r, s, policy = region
            c = self.costs.under(policy)
            held, region_forward = 0, 0  # the region's forward keeps its own expensive outputs as it goes
            for i in range(r, s):  # span by span: a span's figures are at its first unit (see profile._span_costs)
                region_forward = max(region_forward, held + c.forward_peak[i])
                held += c.saved[i]
            allocates = s == self.n or self.costs.input_from[s] >= r  # the region's output is a storage it allocated
            flops, cheap = self._flops_prefix[s] - self._flops_prefix[r], self._cheap_prefix[s] - self._cheap_prefix[r]
            # the expensive ops a region's backward runs again: as far as it must, all twice (in stages),
            # the light ones, or none ("save_expensive"); and its cheap ops
            alone = self._alone(r, s)
            again = {"recompute": alone.cost, "recompute_stages": (2 * flops, 2 * cheap),
                     "save_heavy": (self._light_prefix[s] - self._light_prefix[r], cheap)}.get(policy, (0, cheap))
            if policy == "recompute_stages":
                if (r, s) not in self.spans:
                    raise ValueError(f"a recompute_stages region is one span of units, not {(r, s)}")
                # measured whole: its recompute's holdings and its stages' backward, beyond its input
                backward = c.saved[r] + c.backward_excess[r] + self._grads_after[r]
            else:
                backward = self._region_backward(alone, s)
            self._regions[region] = (held, region_forward, backward, c.keeps_output[s - 1] if allocates else None, again, (flops, cheap))
        return self._regions[region]

    def _alone(self, r: int, s: int) -> "_Scan":
        """Units [r, s) scanned as a checkpoint of their own: what its backward runs again
        (``cost``, see :meth:`_step`) and what it holds."""
        state = _EMPTY
        for i in range(r, s):
            state = self._step(state, r, i, last=False)
        return state

    def _region_backward(self, state: "_Scan", s: int) -> int:
        """Peak of a region's backward beyond what is kept before it, from its scan alone
        (``state``, ending before unit ``s``): its recompute holds everything it saves (the
        kept expensive outputs among them), with its output's gradient waiting, then
        backward walks back through it."""
        recompute = self._grads_after[s - 1] + self.costs.output[s - 1] + state.forward
        return max(recompute, state.backward)

    def _local(self, state: "_Scan", b: int) -> int:
        """Peak of a segment ending before ``b`` beyond the prefix of kept boundaries.

        The last segment's forward keeps what it saves. A checkpointed segment's forward
        keeps nothing (its peak, a unit's forward peak, is below the recompute's); the
        recompute, in backward with later gradients allocated, keeps everything, with
        the output's gradient waiting."""
        held = self._features_held[b]
        if b == self.n:
            return held + max(state.forward, state.backward)
        recompute = self._grads_after[b - 1] + self.costs.output[b - 1] + state.forward
        return held + max(recompute, state.backward)

    def _scan(self, a: int, regions: Iterable[Region], last: bool, stop: Optional[int] = None):
        """Scan from unit ``a`` under ``regions``, yielding (b, local peak, recompute) at each
        unit boundary b a segment [a, b) could end at (``last``: only b = n)."""
        starting = {r: (r, s, p) for r, s, p in regions if r >= a}
        state, i, stop = _EMPTY, a, stop or self.n
        while i < stop:
            region = starting.get(i)
            if region is not None and region[1] <= stop:
                state, i = self._step_region(state, a, region, last), region[1]
            else:
                state, i = self._step(state, a, i, last), i + 1
            if (i == self.n) if last else (i < self.n):  # the last segment ends at n; others before it
                yield i, self._local(state, i), state.cost

    def _segment(self, a: int, b: int, regions: Iterable[Region]) -> Tuple[int, Tuple[int, int]]:
        inside = [g for g in regions if a <= g[0] and g[1] <= b]
        for stop, local, cost in self._scan(a, inside, last=b == self.n, stop=b):
            if stop == b:
                return local, cost
        raise ValueError(f"segment [{a}, {b}) does not end at a unit boundary of its regions")

    def options(self, a: int, b: int) -> List[Tuple[int, Tuple[int, int], FrozenSet[Region]]]:
        """The choices of regions for segment [a, b) worth considering: (local peak,
        recompute (FLOPs, cheap bytes), regions), none worse in both than another.

        The choices are the model's templates (see :meth:`templates`) restricted to the
        segment (a region it cuts through is dropped), each evaluated exactly."""
        if a not in self._options:
            found: Dict[int, dict] = {}  # stop -> {(local, cost): template index}, the first template wins
            templates, scanned = self.templates(), set()
            for t, template in enumerate(templates):
                after = frozenset(g for g in template if g[0] >= a)  # all a scan from a looks at
                if after in scanned:
                    continue
                scanned.add(after)
                for last in (False, True):
                    for stop, local, cost in self._scan(a, template, last):
                        found.setdefault(stop, {}).setdefault((local, cost), t)
            self._options[a] = {
                stop: [(local, cost, frozenset(_as_run(g, stop == self.n) for g in templates[t] if a <= g[0] and g[1] <= stop))
                       for local, cost, t in _pareto_options([(*k, t) for k, t in opts.items()])]
                for stop, opts in found.items()
            }
        return self._options[a][b]

    def templates(self) -> List[List[Region]]:
        """Region assignments to try on every segment.

        Choosing per span multiplies past what a plan can afford to search, so regions
        come from a few shapes: runs of consecutive spans cut into regions of 1, 2, 3, 4
        or 6 spans (at every offset: where the cuts fall matters as much as how far
        apart), or whole runs. For each shape and policy the regions are ranked by bytes
        no longer kept per unit of recompute (cheap-op bytes for ``"save_expensive"``,
        FLOPs for the others), and a template takes the best j of them (j = 0..all).
        Mixed templates start from every region of a shape under ``"save_expensive"``
        (or ``"save_heavy"``, or ``"recompute"``) and upgrade the best k to a policy that
        keeps less: regions to ``"save_heavy"``, single spans to ``"recompute"`` or
        ``"recompute_stages"`` (only ever single spans: see :meth:`_region`)."""
        if self._templates is not None:
            return self._templates
        templates: List[List[Region]] = [[]]
        seen = {frozenset()}
        shapes = [(size, offset) for size in (1, 2, 3, 4, 6, None) for offset in range(size or 1)] if self.spans else []
        eligible = {policy: self._eligible(policy) for policy in REGION_POLICIES} if self.spans else {}
        grouped = [p for p in REGION_POLICIES if p != "recompute_stages"]  # the policies a region of several spans may have
        for size, offset in shapes:
            chunks = {policy: _chunks(eligible[policy], size, offset) for policy in grouped}
            if size not in (1, None) and all(len(chunks[p]) == len(eligible[p]) for p in grouped):
                continue  # no run is longer than one span: the same as size 1
            chunks["recompute_stages"] = eligible["recompute_stages"] if size == 1 else []
            found = []
            for policy in REGION_POLICIES:
                ranked = self._ranked(chunks[policy], policy)
                found += [[(r, s, policy) for r, s in ranked[:j]] for j in range(1, len(ranked) + 1)]
            upgrades = (("save_expensive", "save_heavy", chunks["save_heavy"]), ("save_expensive", "recompute", eligible["recompute"]),
                        ("save_heavy", "recompute", eligible["recompute"]), ("save_expensive", "recompute_stages", eligible["recompute_stages"]),
                        ("save_heavy", "recompute_stages", eligible["recompute_stages"]), ("recompute", "recompute_stages", eligible["recompute_stages"]))
            for base, policy, candidates in upgrades:
                every = [(r, s, base) for r, s in chunks[base]]
                ranked = self._ranked(candidates, policy, base)
                for k in range(1, len(ranked) + 1):
                    chosen = ranked[:k]
                    found.append([g for g in every if not any(g[0] < s and r < g[1] for r, s in chosen)] + [(r, s, policy) for r, s in chosen])
            for template in found:
                if frozenset(template) not in seen:
                    seen.add(frozenset(template))
                    templates.append(sorted(template))
        self._templates = templates
        return templates

    def _ranked(self, chunks: Sequence[Tuple[int, int]], policy: str, base: Optional[str] = None) -> List[Tuple[int, int]]:
        """``chunks`` best first under ``policy``: bytes freed (beyond what ``base`` frees) per unit of recompute."""
        price = self._prices[policy]

        def worth(chunk):
            freed = self._freed(chunk, policy) - (self._freed(chunk, base) if base else 0)
            return -freed / max(1, price[chunk[1]] - price[chunk[0]])

        return sorted(chunks, key=worth)

    def _freed(self, chunk: Tuple[int, int], policy: str) -> int:
        """Bytes the units of ``chunk`` keep for backward, less what they keep under ``policy``;
        for ``"recompute_stages"``, also what its backward's peak falls below a ``"recompute"`` region's."""
        r, s = chunk
        freed = sum(self.costs.saved[r:s]) - sum(self.costs.under(policy).saved[r:s])
        if policy == "recompute_stages":
            freed += max(0, self._region((r, s, "recompute"))[2] - self._region((r, s, policy))[2])
        return freed

    def _eligible(self, policy: str) -> List[Tuple[int, int]]:
        """Spans that ran under ``policy`` when profiled."""
        eligible = self.costs.under(policy).eligible
        return [(r, s) for r, s in self.spans if not eligible or eligible[r]]

    def segment_peaks(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> List[int]:
        """The predicted peak while each segment runs, for segments starting at ``starts`` (first is 0)."""
        return [peak for peak, _ in self.segments(starts, regions)]

    def segments(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> List[Tuple[int, Tuple[int, int]]]:
        """Each segment's predicted peak and recompute (FLOPs, cheap bytes)."""
        regions = list(regions)
        bounds = list(starts) + [self.n]
        prefix, out = 0, []
        for a, b in zip(bounds, bounds[1:]):
            prefix += self.boundary(a)
            local, cost = self._segment(a, b, regions)
            out.append((prefix + local, cost))
        return out

    def peak(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> int:
        return max(self.segment_peaks(starts, regions))

    def total_recompute(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> int:
        """The FLOPs a step runs again (see :meth:`_step`)."""
        return sum(flops for _, (flops, _) in self.segments(starts, regions))


def _as_run(region: Region, last: bool) -> Region:
    """``region`` with the policy it runs under in the last segment (``last``) or a checkpointed one (see :func:`nested_policy`)."""
    r, s, policy = region
    return region if last else (r, s, nested_policy(policy))


class _Scan(NamedTuple):
    """A segment scanned up to some unit, for one choice of policies: what the peak
    model needs to extend it by one more unit."""

    kept: int  # bytes kept for backward so far
    forward: int  # max over units so far of (kept before it + its forward peak)
    backward: int  # max over units so far of (kept up to it + its backward excess + gradients allocated)
    counted: bool  # the current activation's storage is already in ``kept``
    cost: Tuple[int, int]  # recompute so far: (FLOPs, cheap bytes)
    pending: Tuple[int, int]  # recompute of the units since the last that saves a tensor: paid only if a later one does


_EMPTY = _Scan(0, 0, 0, True, (0, 0), (0, 0))  # a segment's input is its boundary, counted in the prefix


def _add(a: Tuple[int, int], b: Tuple[int, int]) -> Tuple[int, int]:
    return (a[0] + b[0], a[1] + b[1])


def _chunks(spans: Sequence[Tuple[int, int]], size: Optional[int], offset: int = 0) -> List[Tuple[int, int]]:
    """Runs of consecutive ``spans`` (each starting where the last stopped) cut into
    [start, stop) pieces of ``size`` spans (None: whole runs), the first piece of a run
    ``offset`` spans long (when not 0)."""
    runs: List[List[Tuple[int, int]]] = []
    for span in spans:
        if runs and runs[-1][-1][1] == span[0]:
            runs[-1].append(span)
        else:
            runs.append([span])
    pieces = []
    for run in runs:
        step = size or len(run)
        ends = sorted((set(range(offset % step, len(run), step)) | {len(run)}) - {0})
        pieces += [run[i:j] for i, j in zip([0] + ends, ends)]
    return [(piece[0][0], piece[-1][1]) for piece in pieces]


def _pareto_options(entries: list) -> list:
    """(local peak, cost, ...) entries none of which another beats or equals in both."""
    entries.sort(key=lambda e: (e[1], e[0]))
    kept = []
    for e in entries:
        if not kept or e[0] < kept[-1][0]:  # sorted by cost: keep only strictly lower peaks
            kept.append(e)
    return kept


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
    Without: the lowest peak (ties: less recompute). Recompute is compared as
    (FLOPs run again, bytes of cheap ops run again), FLOPs first. ``num_segments``
    asks for an exact count, ``max_segments`` bounds it; ``max_recompute`` bounds
    the FLOPs run again. A cut may fall before unit i only where ``splittable[i]``,
    and must fall at every index in ``forced``. Regions come from the model's
    templates (see :meth:`PeakModel.options`).
    """
    search = functools.partial(_search, model, splittable, forced, num_segments, max_segments)
    if budget is None and model.spans:
        # Regions offer many (peak, recompute) trade-offs per segment: find the lowest peak
        # first, ignoring recompute, then the least recompute at that peak.
        if max_recompute is not None:
            raise ValueError("with regions, bound the recompute under a budget")
        lowest = search(None, None, with_cost=False)
        return lowest and search(model.peak(*lowest), None)
    return search(budget, max_recompute)


def _search(model, splittable, forced, num_segments, max_segments, budget, max_recompute, with_cost=True) -> Optional[Cuts]:
    """The dynamic programme of :func:`best_plan` (``with_cost=False``: lowest peak only)."""
    n = model.n
    forced_set = set(forced)
    allowed = [i for i in range(1, n) if splittable[i] or i in forced_set]
    limit = num_segments or max_segments or n
    # states[p]: {count: [(prefix, peak, recompute, starts, regions)]}, Pareto-pruned
    states: Dict[int, Dict[int, list]] = {0: {0: [(0, 0, (0, 0), (), frozenset())]}}
    for p in [0] + allowed:
        for count, entries in sorted(states.get(p, {}).items()):
            entries = _pareto(entries, with_cost)
            if count >= limit:
                continue
            next_forced = min([f for f in forced_set if f > p] + [n])
            for q in [i for i in allowed if p < i <= next_forced] + ([n] if next_forced == n else []):
                options = model.options(p, q)
                if not with_cost:  # only the lowest local peak matters
                    options = [min(options, key=lambda o: o[0])]
                for prefix, peak, recompute, starts, regions in entries:
                    new_prefix = prefix + model.boundary(p)
                    for local, cost, chosen in options:  # by cost, then lower local peak
                        new_peak = max(peak, new_prefix + local)
                        if budget is not None and new_peak > budget:
                            continue
                        new_recompute = (recompute[0] + cost[0], recompute[1] + cost[1])
                        if max_recompute is not None and new_recompute[0] > max_recompute:
                            continue
                        states.setdefault(q, {}).setdefault(count + 1, []).append((new_prefix, new_peak, new_recompute, starts + (p,), regions | chosen))
                        if budget is not None:
                            break  # the cheapest option that fits: more cost buys nothing under a budget
    finals = [e for count, entries in states.get(n, {}).items() if num_segments is None or count == num_segments for e in entries]
    if not finals:
        return None
    key = (lambda e: (e[2], e[1])) if budget is not None else (lambda e: (e[1], e[2]))
    best = min(finals, key=key)
    return Cuts(list(best[3]), best[4])


def _pareto(entries: list, with_cost: bool = True) -> list:
    """Entries not dominated in (prefix, peak, recompute), or in (prefix, peak) without
    ``with_cost``; the first of equals is kept."""
    entries = sorted(set(entries), key=lambda e: (e[0], e[1], e[2], e[3], sorted(e[4])))
    kept = []
    for e in entries:
        if not any(k[0] <= e[0] and k[1] <= e[1] and (k[2] <= e[2] or not with_cost) for k in kept):
            kept.append(e)
    return kept


def annotate(plan: SplitPlan, model: PeakModel) -> SplitPlan:
    """``plan`` with the model's predicted peak and recompute per segment."""
    predicted = model.segments([s.start for s in plan.segments], plan.regions)
    segments = tuple(
        replace(s, predicted_bytes=peak, recompute_flops=flops, recompute_bytes=cheap)
        for s, (peak, (flops, cheap)) in zip(plan.segments, predicted)
    )
    return replace(plan, segments=segments, predicted_peak_bytes=max(peak for peak, _ in predicted))


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


def region_spans(units: Sequence[Tuple[str, nn.Module]]) -> List[Tuple[int, int]]:
    """The smallest runs of units ``[start, stop)`` that may form a region (a nested
    checkpoint): a region must neither start nor be followed by an in-place op, which
    would overwrite the input its recompute needs, or an output the
    ``"save_expensive"`` policy keeps. So runs are cut where a unit is splittable;
    inside one, an in-place op changes only what the region itself produced. The
    ResNet stem gives ``conv1``, ``bn1 + conv1_relu`` and ``maxpool``."""
    bounds = [i for i, (_, m) in enumerate(units) if layer_splittable_before(m)] + [len(units)]
    return [(r, s) for r, s in zip(bounds, bounds[1:])]


def peak_model(trunk, x, regions: bool = False) -> PeakModel:
    """Profile a :class:`CheckpointedTrunk`'s units at inputs shaped like ``x`` and model its peaks.

    ``regions``: also measure the units under the region policies, and let the model
    plan regions (about three times the profiling)."""
    units = expand_units(trunk._blocks())
    spans = region_spans(units) if regions else []
    return PeakModel(profile_units(units, x, spans), [stop - 1 for stop in trunk._ends.values()], trunk.gradients, spans)


def budget_in_bytes(budget, unsplit: int) -> int:
    """A memory budget in bytes: a float is a fraction of the ``unsplit`` peak."""
    return int(budget * unsplit) if isinstance(budget, float) else int(budget)


def plan_trunk(trunk, x, model: Optional[PeakModel] = None) -> SplitPlan:
    """The cost-aware plan of a :class:`CheckpointedTrunk` for inputs shaped like ``x``.

    Balanced plans cut at unit boundaries only. Budget plans also place regions
    (nested checkpoints under a region policy of :func:`trunksplit.regions.run_region`; non-reentrant
    trunks only: torch's selective checkpointing has no reentrant form), which reach
    below the block-level floor at less recompute. ``model``: the trunk's peak model at
    ``x`` if already measured (with regions exactly where this plan may use them), so
    that several plans of one trunk share one measurement."""
    units = expand_units(trunk._blocks())
    names = [n for n, _ in units]
    budgeted = trunk.memory_budget is not None
    model = model or peak_model(trunk, x, regions=budgeted and not trunk.use_reentrant)
    splittable = [layer_splittable_before(m) for _, m in units]
    forced = [stop for stop in trunk._ends.values() if stop < len(units)]
    if not budgeted:
        k = max(trunk.num_splits or 1, len(forced) + 1)  # the cuts after requested features always exist
        cuts = best_plan(model, splittable, forced, num_segments=k)
        while cuts is None:  # fewer valid cuts than asked for
            k -= 1
            cuts = best_plan(model, splittable, forced, num_segments=k)
        if k < (trunk.num_splits or 0):
            warnings.warn(f"asked for {trunk.num_splits} checkpoint segments but only {k} can be made", UserWarning, stacklevel=4)
        # Switching from vissl to balanced must not cost compute: cap the recompute at vissl's
        # (plus RECOMPUTE_SLACK), where a plan under the cap exists.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vissl = vissl_plan(trunk._blocks(), list(trunk._ends), k)
        cap = int(model.total_recompute([s.start for s in vissl.segments]) * (1 + RECOMPUTE_SLACK))
        if best_plan(model, splittable, forced, num_segments=k, max_recompute=cap) is None:
            cap = None
        lowest = best_plan(model, splittable, forced, num_segments=k, max_recompute=cap)
        # Peaks within the model's own accuracy are a tie: take the least recompute among them,
        # but never a plan predicted to peak above vissl's.
        lowest_peak, vissl_peak = model.peak(lowest.starts), model.peak([s.start for s in vissl.segments])
        near_best = min(int(lowest_peak * (1 + PEAK_TOLERANCE)), max(lowest_peak, vissl_peak))
        cuts = best_plan(model, splittable, forced, num_segments=k, budget=near_best, max_recompute=cap)
        return plan_from_cuts(names, cuts, trunk._ends, "balanced", model)
    unsplit = model.peak([0])
    budget_bytes = budget_in_bytes(trunk.memory_budget, unsplit)
    cuts = best_plan(model, splittable, forced, max_segments=trunk.num_splits, budget=budget_bytes)
    if cuts is None:
        smallest = model.peak(*best_plan(model, splittable, forced, max_segments=trunk.num_splits))
        raise ValueError(
            f"no plan meets the memory budget of {budget_bytes} bytes ({budget_bytes / unsplit:.2f} of the unsplit "
            f"{unsplit} bytes) for input {tuple(x.shape)}; the smallest feasible budget is {smallest} bytes "
            f"({smallest / unsplit:.3f} of unsplit)" + (f" with at most {trunk.num_splits} segments" if trunk.num_splits else "")
            + ("; use_reentrant=False lets the planner recompute cheap ops only, which goes lower" if trunk.use_reentrant else "")
        )
    return plan_from_cuts(names, cuts, trunk._ends, "budget", model)
