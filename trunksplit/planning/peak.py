"""The peak model: a training step's predicted peak and recompute for any plan of a chain.

A training step with checkpoint segments S_1..S_m (S_m not checkpointed) holds, while segment j runs its backward:

- P_j: the input of every segment up to j (checkpoints keep their inputs), plus
  the requested features the caller still holds;
- the tensors S_j saves for backward, recomputed (or, for S_m, kept from the
  forward), freed unit by unit as backward walks back;
- the loss's gradients of features backward has not reached, the caller's features (:func:`unit_terms.feature_terms`);
- the gradient flowing into the current unit and the unit's own backward
  excess: gradient buffers of activations and transient weight gradients. A
  model of saved tensors alone misses these and predicts far too low a peak.

- in torch's default gradient mode (``zero_grad()`` sets gradients to None, so
  the step allocates them in backward order: ``gradients="allocated"``), the
  gradients of every parameter after the current unit, kept from then on; with
  ``zero_grad(set_to_none=False)`` (``"kept"``) they existed before the step
  and are not part of its figure; with the optimizer stepped in backward
  (``"in_backward"``, :func:`trunksplit.optimizer_in_backward`) each lives only
  from its accumulation to its update, and the update of the unit's largest
  parameter allocates ``update_temporaries`` tensors of its size beside it.

A checkpointed segment's recompute stops at the last tensor it saves (non-reentrant checkpoint's early
stop: the last unit's forward beyond its last save never runs again, ``UnitCosts.rerun_peak``); its
first forward keeps nothing (``UnitCosts.first_peak``). So peak = max_j (P_j + L(S_j)), with P_j a prefix sum of boundary sizes and L
local to the segment (the gradients allocated so far depend on the unit only).
:func:`best_plan` finds the optimal cuts exactly by dynamic programming over
Pareto sets of (P, peak so far, recompute), with forced cuts after requested
features and no cut before an in-place op (:mod:`trunksplit.planning.search`).

Regions (budget plans) go below the block level: runs of units checkpointed on
their own inside a segment (see :class:`PeakModel`); which ones to try comes from
:mod:`trunksplit.planning.templates`.

Regions in the model. A run of consecutive ``spans`` (``[start, stop)`` runs of units that may
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

Compiled trunks (``compiled``): the trunk runs compiled (``CheckpointedTrunk.compile``): each unit one graph,
each selective region one graph. A graph's backward returns the gradients of all its weights
together: with gradients ``"kept"`` a unit holds all of its own as its backward makes them
(``backward_fresh``, not ``backward_excess``: eager autograd adds each into its ``.grad`` at once),
and a region those of the units its backward has passed, until it returns; and the cheap ops
a selective region runs again cost nothing (they fuse into its backward's kernels; measured in
docs/benchmarks.md#torchcompile).
"""
import itertools
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..recompute.policies import POLICIES
from .choices import GRADIENT_MODES, PRICES
from .costs import NOTHING, Cost, RegionCosts, add_costs, rebuilt
from .profile import UnitCosts
from .request import UPDATE_TEMPORARIES
from .sharded_peak import fsdp_at_reduce, fsdp_in_backward
from .unit_terms import backward_terms, copies, feature_terms, gradients_after, held_features, input_relief, packs
from .templates import Region, RegionTemplates, _as_run


def _check_words(gradients: str, objective: str) -> None:
    if gradients not in GRADIENT_MODES:
        raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}")
    if objective not in PRICES:  # "auto" is resolved for a device before a model is made (request.priced_in)
        raise ValueError(f"objective must be one of {PRICES}, got {objective!r}")


def _prefix(values: Sequence) -> list:
    """Prefix sums, starting at 0: ``out[b] - out[a]`` sums ``values[a:b]``."""
    return [values[0] * 0 if len(values) else 0] + list(itertools.accumulate(values))


class PeakModel:
    """Predicts a step's peak bytes for any cut of a chain: what the step allocates beyond
    what was live before it (parameters, and in ``"kept"`` mode their gradients).

    Regions (``spans``) and compiled trunks (``compiled``): see the module docstring.
    ``reentrant``: checkpointed segments run under reentrant checkpoint, whose backward holds the
    segment's rerun output until the segment's whole backward is done (a local of torch's
    ``CheckpointFunction.backward``), where non-reentrant backward frees it after the last unit's.
    """

    def __init__(self, *, costs: UnitCosts, feature_units: Sequence[int], gradients: str, spans: Iterable[Tuple[int, int]] = (),
                 objective: str = "flops", compiled: bool = False, update_temporaries: float = UPDATE_TEMPORARIES, reentrant: bool = False):
        _check_words(gradients, objective)
        c = self.costs = costs
        self.objective, self.n, self.gradients = objective, len(costs), gradients
        self.features = sorted(set(feature_units))  # unit indices whose outputs the caller holds
        # while a segment ending before unit b runs its backward: the features it and later segments returned
        self._features_held = [sum(costs.output[f] for f in held_features(c, self.features) if f >= b - 1) for b in range(self.n + 1)]
        self.spans = sorted(set(spans))
        if self.spans and costs.policies is None:
            raise ValueError("region spans need costs measured under each policy (profile_units(..., spans=...))")
        self._flops_prefix, self._cheap = _prefix(c.flops), c.recompute_bytes or (0,) * self.n
        self._cheap_prefix = _prefix(self._cheap)
        # what running each unit again in a checkpointed segment costs (timed: its rerun and the checkpoint's
        # hooks), once per checkpointed segment what the checkpoint costs itself, and what a region's forward takes
        self._unit_costs = [Cost(*v) for v in zip(c.flops, self._cheap, c.rerun_seconds or (0.0,) * self.n)]
        self._checkpointed_start = _EMPTY._replace(cost=Cost(0, 0, c.checkpoint_seconds)) if c.checkpoint_seconds else _EMPTY
        self._seconds_prefix, self._light_prefix = _prefix(c.forward_seconds or (0.0,) * self.n), _prefix(c.light_flops or (0,) * self.n)
        self._gathered = c.gathered or (0,) * self.n  # FSDP2: whole weights a rank all-gathers per unit
        self._gathered_prefix = _prefix(self._gathered)
        self._own_from, self._copied_inside = copies(c, self.features)  # segments run on a copy of their input
        self._caller_keeps = [i in self.features and i < self.n - 1 for i in range(self.n)]  # a feature held past its backward
        waiting, held_in_last, just_after = feature_terms(c, self.features, self._copied_inside)  # the loss's gradients of features, the caller's features
        self._grads_after = [g + w for g, w in zip(gradients_after(c) if gradients == "allocated" else [0] * self.n, waiting)]  # beside a unit's backward
        self._grads_in_last = [g + h for g, h in zip(self._grads_after, held_in_last)]  # and in the last segment
        self._grads_at_recompute = [g + j for g, j in zip(self._grads_after, just_after)]  # and beside a recompute ending at it
        self.compiled, self.reentrant = compiled, reentrant
        # a checkpointed segment ending before b holds this beside its backward (see ``reentrant``); beside a recompute ending at
        # unit i, its output's gradient and what non-reentrant backward made of it first (UnitCosts.rerun_gradient)
        self._rerun_output_held = [c.output[b - 1] if reentrant and 0 < b < self.n else 0 for b in range(self.n + 1)]
        self._rerun_gradient = list(c.output if reentrant or not c.rerun_gradient else map(max, c.output, c.rerun_gradient))
        # a unit's backward beyond what its forward left, while it holds what it saved and after (unit_terms.backward_terms)
        self.update_temporaries = update_temporaries
        terms = backward_terms(c, gradients, compiled, update_temporaries, reentrant)
        self._backward_excess, self._released, self._update, self._running_last, self._released_last = terms
        self._param_prefix = _prefix(c.param_bytes)
        # a unit that allocates a new activation (rather than passing its input's storage on)
        self._allocates = [i + 1 < self.n and c.input_from[i + 1] == i for i in range(self.n)]
        # a non-reentrant recompute stops at the last tensor its segment saves (torch's early stop): what
        # runs to where (see _step); a reentrant one runs its segment whole
        self._packs = packs(c, reentrant)
        self._rerun_peak, self._first_peak = c.forward_peak if reentrant else c.rerun_peak or c.forward_peak, c.first_peak or c.forward_peak
        self._regions: Dict[Region, tuple] = {}  # see _region
        self._region_steps: Dict[Tuple[Region, bool], _RegionStep] = {}  # see _step_region
        self._choices = RegionTemplates(self)

    def cost_key(self, cost: "Cost") -> tuple:
        """What plans are compared by, for a recompute ``cost`` of (FLOPs, cheap bytes, seconds):
        under ``"flops"`` FLOPs first, then bytes; under ``"time"`` the measured seconds
        first (see :mod:`trunksplit.planning.timing`), then FLOPs. Without timings in the
        profile, seconds are all 0 and ``"time"`` compares FLOPs, then bytes."""
        return (cost.flops, cost.cheap_bytes) if self.objective == "flops" else (cost.seconds, cost.flops, cost.cheap_bytes)

    def boundary(self, a: int, previous: Optional[int] = None) -> int:
        """Bytes a segment starting at unit ``a`` keeps as its input: none for the chain's own input,
        nor where the segment before it (starting at ``previous``) allocated no storage its input
        holds: both inputs are one storage (views, in-place units), counted once; but a copy (``_own_from``) is its own."""
        if a == 0 or (previous is not None and self.costs.input_from[a] < self._own_from[previous]):
            return 0
        return self.costs.output[a - 1]

    def _step(self, state: "_Scan", a: int, i: int, last: bool, grads_after: Optional[int] = None) -> "_Scan":
        """The scan of a segment starting at ``a`` extended by unit ``i``, which keeps
        everything; ``last``: the segment is the last, not checkpointed.

        Kept bytes: what each unit allocates and keeps itself, plus the outputs of
        units in the segment that later units keep as their input, each storage once
        (``counted``: the current activation's storage is already in ``kept``)."""
        c, g, own = self.costs, self._gathered, self._own_from[a]  # storages from unit ``own`` on are the segment's own
        kept, forward, backward, counted, cost, pending, ran, tail, rerun, first, unheld, input_held, ending = state
        source, counted = c.input_from[i], counted and not (last and i > a and self._copied_inside[i])  # a new storage (unit_terms.copies)
        saver = (c.saves_input[i] and source < own) if last else self._packs[i]  # holds the segment's input (see unit_terms.input_relief)
        peak = max(c.forward_peak[i] + g[i], 2 * g[i])  # FSDP2: see sharded_peak.fsdp_in_backward
        live = kept + (0 if counted or source < own else c.output[source])  # its input is alive, kept or not
        here = live + peak
        forward = max(forward, here)
        first = max(first, (c.output[source] if source >= own else 0) + max(self._first_peak[i] + g[i], 2 * g[i]))
        if not last and self._packs[i]:  # the recompute runs every unit before this one whole, and this one to its last save
            ran, tail, rerun = max(ran, tail), here, max(ran, tail, live + max(self._rerun_peak[i] + g[i], 2 * g[i]))
        elif not last:  # runs in the recompute only if a later unit saves
            tail = max(tail, here)
        reduced = kept + fsdp_at_reduce(self, a, i, last)  # FSDP2: after its backward, before what it keeps is counted
        took = c.output[source] if c.saves_input[i] and source >= own and not counted else 0  # held by this unit alone
        kept, counted = kept + took, counted or took > 0
        kept += c.saved[i] + (0 if last else g[i])
        counted = c.keeps_output[i] if self._allocates[i] else counted
        if last and self._caller_keeps[i] and not counted:  # held to the step's end, where no unit keeps it
            kept, counted = kept + c.output[i], True
        grads_after = (self._grads_in_last if last else self._grads_after)[i] if grads_after is None else grads_after
        sharded = fsdp_in_backward(self, a, i, last)
        # the segment's input is held through this unit's backward if this unit or one before it holds it,
        # and once its saves are let go, if one before it does (see unit_terms.input_relief); where the unit
        # ends a checkpointed segment, what runs beside the recompute (``ending``, see _local)
        held_now, parts = input_held or bool(saver), (backward, unheld)
        after_saves, running = kept - took + grads_after, kept + grads_after + sharded  # beside its own parts
        ending = _routed(_routed(parts, input_held, max(reduced, after_saves + self._released_last[i])), held_now, running + self._running_last[i])
        backward, unheld = _routed(_routed(parts, input_held, max(reduced, after_saves + self._released[i])), held_now, running + self._backward_excess[i])
        input_held = held_now
        if not last:
            # A checkpointed segment's recompute runs the unit once more, if it must: torch stops
            # a recompute once it has rebuilt the last tensor backward needs, so units after the
            # last one that saves a tensor of its own do not run (a unit that keeps only its
            # input, as a lone convolution does, needs only the units before it).
            if c.saves_input[i]:
                cost, pending = add_costs(cost, pending), NOTHING
            pending = add_costs(pending, self._unit_costs[i])
            if c.saved[i] or c.keeps_output[i]:
                cost, pending = add_costs(cost, pending), NOTHING
        return tuple.__new__(_Scan, (kept, forward, backward, counted, cost, pending, ran, tail, rerun, first, unheld, input_held, ending))  # _Scan(...) without a call: the inner loop

    def _region_step(self, region: Region, last: bool) -> "_RegionStep":
        """What a region ``(r, s, policy)`` adds to a scan, looked up once per (region, last)."""
        step = self._region_steps.get((region, last))
        if step is None:
            r, s, _ = region
            step = self._region_steps[region, last] = _RegionStep(
                self._region(_as_run(region, last)), source=self.costs.input_from[r],
                gathered=self._gathered_prefix[s] - self._gathered_prefix[r], largest=max(self._gathered[r:s]))  # FSDP2: see sharded_peak.fsdp_in_backward
        return step

    def _step_region(self, state: "_Scan", a: int, region: Region, last: bool) -> "_Scan":
        """The scan extended by a region ``(r, s, policy)``, checkpointed inside the segment."""
        step, own = self._region_step(region, last), self._own_from[a]
        g = step.region
        kept, forward, backward, counted, cost, pending, ran, tail, rerun, first, unheld, input_held, ending = state
        here = kept + (0 if counted or step.source < own else self.costs.output[step.source]) + g.forward + step.largest
        forward = max(forward, here)
        first = max(first, (self.costs.output[step.source] if step.source >= own else 0) + g.forward + step.largest)
        if not last:  # a region saves (its input at least): the recompute runs it whole
            ran, tail, rerun = max(ran, tail), here, max(ran, tail, here)
        if step.source >= own and not counted:  # the region keeps its input
            kept, counted = kept + self.costs.output[step.source], True
        # the region's backward recomputes it holding its weights: in a recomputed segment, held already;
        # it saves its input, the segment's too where that is its input (see unit_terms.input_relief)
        region_backward = kept + g.backward - (0 if last else step.gathered)
        input_held = input_held or not last or step.source < own
        backward, unheld = _routed((backward, unheld), input_held, region_backward)
        kept += g.held + (0 if last else step.gathered)
        counted = counted if g.output_counted is None else g.output_counted
        if not last:  # the region keeps its input: the segment's recompute runs it only if a later unit needs it
            cost, pending = add_costs(cost, pending), g.body
        return tuple.__new__(_Scan, (kept, forward, backward, counted, add_costs(cost, g.again), pending, ran, tail, rerun, first, unheld, input_held, (backward, unheld)))

    def _region(self, region: Region) -> "RegionCosts":
        """What a region adds to a scan (:func:`_region_costs`), worked out once."""
        if region not in self._regions:
            self._regions[region] = _region_costs(self, region)
        return self._regions[region]

    def _alone(self, r: int, s: int, compiled: bool = False) -> "_Scan":
        """Units [r, s) scanned as a checkpoint of their own: what its backward runs again
        (``cost``, see :meth:`_step`) and what it holds. ``compiled``: one graph, whose backward
        holds the gradients of the units it has passed (see ``compiled``), beside the loss's waiting ones."""
        state = _EMPTY
        for i in range(r, s):
            within = self._param_prefix[s] - self._param_prefix[i + 1] + self._grads_after[i] if compiled and self.gradients != "allocated" else None
            state = self._step(state, r, i, last=False, grads_after=within)
        return state

    def _region_backward(self, state: "_Scan", s: int, compiled: bool = False) -> int:
        """Peak of a region's backward beyond what is kept before it, from its scan alone
        (``state``, ending before unit ``s``): its recompute holds everything it saves (the
        kept expensive outputs among them), with its output's gradient waiting, then
        backward walks back through it. As a segment's, its last unit's backward up to its first
        unpack runs before the recompute (see ``_local``); a ``compiled`` region is one graph,
        which recomputes before any of its backward."""
        recompute = self._grads_at_recompute[s - 1] + self._rerun_gradient[s - 1] + state.rerun
        if compiled:
            return max(recompute, state.backward)
        return max(recompute, state.ending[0], self.before_recompute(s - 1))

    def before_recompute(self, i: int) -> int:
        """What unit ``i``'s backward holds where it ends a checkpoint, up to its first unpack (where the checkpoint
        recomputes), beside none of the recompute: its whole backward, at most, with the gradients after it."""
        return self._grads_after[i] + max(self._backward_excess[i], self._released[i])

    def _local(self, state: "_Scan", b: int, relief: int = 0) -> int:
        """Peak of a segment ending before ``b`` beyond the prefix of kept boundaries, its input among
        them (``relief``: its bytes where they go before the segment's backward ends, see :func:`trunksplit.planning.unit_terms.input_relief`).

        The last segment's forward keeps what it saves. A checkpointed segment's first forward
        keeps nothing (its peak: a unit's forward peak beside its input); the recompute, in
        backward with later gradients allocated, keeps everything, with the output's gradient
        waiting, and stops at the last tensor the segment saves (non-reentrant: see ``_step``)."""
        held = self._features_held[b]
        if b == self.n:
            return held + max(state.forward, state.backward, state.unheld - relief)
        recompute = self._grads_at_recompute[b - 1] + self._rerun_gradient[b - 1] + state.rerun
        backward, unheld = state.ending
        return held + max(recompute, state.first, backward + self._rerun_output_held[b], unheld - relief, self.before_recompute(b - 1))

    def _scan(self, a: int, regions: Iterable[Region], last: bool, stop: Optional[int] = None):
        """Scan from unit ``a`` under ``regions``, yielding (b, local peak, recompute) at each
        unit boundary b a segment [a, b) could end at (``last``: only b = n)."""
        starting = {r: (r, s, p) for r, s, p in regions if r >= a}
        relief = input_relief(self, a, last)
        start = (_EMPTY if last else self._checkpointed_start)._replace(input_held=not relief, counted=self._own_from[a] == a)  # a copy is not in the prefix
        state, i, stop = start, a, stop or self.n
        while i < stop:
            region = starting.get(i)
            if region is not None and region[1] <= stop:
                state, i = self._step_region(state, a, region, last), region[1]
            else:
                state, i = self._step(state, a, i, last), i + 1
            if (i == self.n) if last else (i < self.n):  # the last segment ends at n; others before it
                yield i, self._local(state, i, relief), state.cost

    def _segment(self, a: int, b: int, regions: Iterable[Region]) -> Tuple[int, "Cost"]:
        inside = [g for g in regions if a <= g[0] and g[1] <= b]
        for stop, local, cost in self._scan(a, inside, last=b == self.n, stop=b):
            if stop == b:
                return local, cost
        raise ValueError(f"segment [{a}, {b}) does not end at a unit boundary of its regions")

    def options(self, a: int, b: int) -> List[Tuple[int, "Cost", FrozenSet[Region]]]:
        """The choices of regions for segment [a, b) worth considering (see :meth:`RegionTemplates.options`)."""
        return self._choices.options(a, b)

    def segment_peaks(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> List[int]:
        """The predicted peak while each segment runs, for segments starting at ``starts`` (first is 0)."""
        return [peak for peak, _ in self.segments(starts, regions)]

    def segments(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> List[Tuple[int, "Cost"]]:
        """Each segment's predicted peak and recompute (FLOPs, cheap bytes, seconds)."""
        regions = list(regions)
        bounds = list(starts) + [self.n]
        prefix, out = 0, []
        for previous, a, b in zip([None] + bounds, bounds, bounds[1:]):
            prefix += self.boundary(a, previous)
            local, cost = self._segment(a, b, regions)
            out.append((prefix + local, cost))
        return out

    def peak(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> int:
        return max(self.segment_peaks(starts, regions))

    def total_recompute(self, starts: Sequence[int], regions: Iterable[Region] = ()) -> int:
        """The FLOPs a step runs again (see :meth:`_step`)."""
        return sum(cost.flops for _, cost in self.segments(starts, regions))


def _region_costs(model: "PeakModel", region: Region) -> "RegionCosts":
    """What a region adds to a scan, whatever comes before it (see :class:`RegionCosts`; a
    region's seconds are measured under its policy, overhead included)."""
    r, s, policy = region
    c = model.costs.under(policy)
    held, region_forward = 0, 0  # the region's forward keeps its own expensive outputs as it goes
    for i in range(r, s):  # span by span: a span's figures are at its first unit (see profile._span_costs)
        region_forward = max(region_forward, held + c.forward_peak[i])
        held += c.saved[i]
    allocates = s == model.n or model.costs.input_from[s] >= r  # the region's output is a storage it allocated
    flops, cheap = model._flops_prefix[s] - model._flops_prefix[r], model._cheap_prefix[s] - model._cheap_prefix[r]
    seconds = sum(c.again_seconds[r:s]) if c.again_seconds else 0.0  # measured per span, at its first unit
    # the expensive ops a region's backward runs again: as far as it must, all twice (in stages),
    # the light ones, or none ("save_expensive"); and its cheap ops
    chosen = POLICIES[policy]
    compiled = model.compiled and chosen.selective
    alone = model._alone(r, s, compiled)
    if compiled:  # its cheap ops run again fused into its backward's kernels: free, as measured
        cheap, seconds = 0, 0.0
    again = Cost(*rebuilt(chosen, (alone.cost.flops, alone.cost.cheap_bytes), (flops, cheap), model._light_prefix[s] - model._light_prefix[r]), seconds)
    if chosen.staged:
        if (r, s) not in model.spans:
            raise ValueError(f"a {policy} region is one span of units, not {(r, s)}")
        # measured whole: its recompute's holdings and its stages' backward, beyond its input
        gathered = model._gathered_prefix[s] - model._gathered_prefix[r]
        backward = c.saved[r] + c.backward_excess[r] + max(model._update[r:s]) + model._grads_after[r] + gathered + fsdp_in_backward(model, r, r, False)
    else:
        backward = model._region_backward(alone, s, compiled)
    # a checkpointed segment's recompute runs it as its first forward ran (hooks included), where timed so
    body = Cost(flops, cheap, sum(c.nested_forward_seconds[r:s]) if any(c.nested_forward_seconds) else model._seconds_prefix[s] - model._seconds_prefix[r])
    return RegionCosts(held, region_forward, backward, c.keeps_output[s - 1] if allocates else None, again, body)


def _routed(parts: Tuple[int, int], held: bool, term: int) -> Tuple[int, int]:
    """``(backward, unheld)`` with a backward term where the segment's input is ``held``, or not."""
    backward, unheld = parts
    return (max(backward, term), unheld) if held else (backward, max(unheld, term))


class _Scan(NamedTuple):
    """A segment scanned up to some unit, for one choice of policies: what the peak
    model needs to extend it by one more unit."""

    kept: int  # bytes kept for backward so far
    forward: int  # max over units so far of (kept before it + its forward peak)
    backward: int  # max over units so far of (kept up to it + its backward excess + gradients allocated)
    counted: bool  # the current activation's storage is already in ``kept``
    cost: "Cost"  # recompute so far
    pending: "Cost"  # recompute of the units since the last that saves a tensor: paid only if a later one does
    ran: int  # a checkpointed segment's recompute: the forward peak of the units it runs whole (those before the last that saves)
    tail: int  # the forward peak of the units from the last that saves on: they run whole only if a later one saves
    rerun: int  # the recompute's forward peak: ``ran``, or the last unit that saves up to its last save (``rerun_peak``)
    first: int  # a checkpointed segment's first forward, which keeps nothing: its largest unit's peak, with its input
    unheld: int  # as ``backward``, over the moments the segment's input is let go (see unit_terms.input_relief)
    input_held: bool  # a unit so far holds the segment's input through its backward
    ending: Tuple[int, int]  # ``backward`` and ``unheld`` where the segment, checkpointed, ends here (see PeakModel._local)


class _RegionStep(NamedTuple):
    """A region's figures as the scan of one segment reads them (see PeakModel._step_region)."""

    region: RegionCosts
    source: int  # the unit that allocated its input's storage
    gathered: int  # FSDP2: the whole weights its units gather
    largest: int  # FSDP2: the largest of them


_EMPTY = _Scan(0, 0, 0, True, NOTHING, NOTHING, 0, 0, 0, 0, 0, True, (0, 0))  # a segment's input is its boundary, counted in the prefix
