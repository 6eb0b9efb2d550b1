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
local to the segment (the gradients allocated so far depend on the unit only). :func:`best_plan` finds the optimal cuts exactly by
dynamic programming over Pareto sets of (P, peak so far, recompute), with forced
cuts after requested features and no cut before an in-place op.
"""
import itertools
import warnings
from dataclasses import replace
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from .blocks import layer_splittable_before
from .profile import UnitCosts, profile_units
from .split import Segment, SplitPlan, expand_units, vissl_plan
from .wrapper import UNIT_POLICIES


PEAK_TOLERANCE = 0.02  # balanced plans: predicted peaks this close count as equal
RECOMPUTE_SLACK = 0.10  # balanced plans recompute at most this much more than vissl's plan of the same count


GRADIENT_MODES = ("allocated", "kept")


class Cuts(NamedTuple):
    """A plan as the planner sees it: where segments start, and the units that do not
    keep everything for backward, with their policy (see :func:`trunksplit.wrapper.run_under_policy`)."""

    starts: List[int]
    policies: FrozenSet[Tuple[int, str]] = frozenset()


class PeakModel:
    """Predicts a step's peak bytes for any cut of a chain: what the step allocates beyond
    what was live before it (parameters, and in ``"kept"`` mode their gradients).

    ``candidates`` are the units that may also run under the other unit policies
    (``costs.policies`` measured them so). Under ``"save_expensive"`` a unit keeps only
    its expensive ops' outputs and its input; under ``"recompute"`` only its input. In
    the last segment that is what backward finds; in a checkpointed segment, what the
    segment's recompute holds, the unit's own backward recomputing the rest (nested
    checkpointing: one unit's activations at a time).
    """

    def __init__(self, costs: UnitCosts, feature_units: Sequence[int], gradients: str = "allocated", candidates: Iterable[int] = ()):
        if gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}")
        self.costs = costs
        self.n = len(costs)
        self.gradients = gradients
        self.features = sorted(set(feature_units))  # unit indices whose outputs the caller holds
        candidates = set(candidates)
        if candidates and costs.policies is None:
            raise ValueError("policy candidates need costs measured under each policy (profile_units(..., candidates=...))")
        # a policy is offered where it keeps less than keeping everything
        self._unit_policies = [
            ("keep",) + tuple(p for p in UNIT_POLICIES[1:] if i in candidates and costs.under(p).saved[i] < costs.saved[i])
            for i in range(self.n)
        ]
        c = costs
        self._flops_prefix = [0] + list(itertools.accumulate(c.flops))
        self._cheap = c.recompute_bytes or (0,) * self.n
        # grads_after[i]: gradients that exist while unit i runs its backward (those of units after it)
        after = list(itertools.accumulate(reversed(c.param_bytes)))[::-1] + [0]
        self._grads_after = after[1:] if gradients == "allocated" else [0] * self.n
        # a unit that allocates a new activation (rather than passing its input's storage on)
        self._allocates = [i + 1 < self.n and c.input_from[i + 1] == i for i in range(self.n)]
        self._options: Dict[int, Dict[int, list]] = {}
        self._templates: Optional[List[Dict[int, str]]] = None

    def boundary(self, a: int) -> int:
        """Bytes a segment starting at unit ``a`` keeps as its input (the chain's own input is not counted)."""
        return self.costs.output[a - 1] if a > 0 else 0

    def _step(self, state: "_Scan", a: int, i: int, policy: str, last: bool) -> "_Scan":
        """The scan of a segment starting at ``a`` extended by unit ``i`` under ``policy``;
        ``last``: the segment is the last, not checkpointed.

        Kept bytes: what each unit allocates and keeps itself, plus the outputs of
        units in the segment that later units keep as their input, each storage once
        (``counted``: the current activation's storage is already in ``kept``)."""
        c = self.costs.under(policy)
        kept, forward, backward, counted, cost = state
        source = self.costs.input_from[i]
        forward = max(forward, kept + c.forward_peak[i])
        if c.saves_input[i] and source >= a and not counted:
            kept, counted = kept + self.costs.output[source], True
        kept += c.saved[i]
        backward = max(backward, kept + c.backward_excess[i] + self._grads_after[i])
        if self._allocates[i]:
            counted = c.keeps_output[i]
        # What runs again: a checkpointed segment's recompute runs every unit once more, and
        # a unit's own checkpoint its cheap ops ("save_expensive") or all of it ("recompute").
        flops, cheap, inner = self.costs.flops[i], self._cheap[i], policy != "keep"
        again = flops if policy == "recompute" else 0
        if last:  # only max(forward, backward) matters: one field, fewer distinct scans
            forward = backward = max(forward, backward)
            cost = (cost[0] + again, cost[1] + cheap * inner)
        else:
            cost = (cost[0] + flops + again, cost[1] + cheap * (1 + inner))
        return _Scan(kept, forward, backward, counted, cost)

    def _local(self, state: "_Scan", b: int) -> int:
        """Peak of a segment ending before ``b`` beyond the prefix of kept boundaries.

        The last segment's forward keeps what it saves. A checkpointed segment's forward
        keeps nothing (its peak, a unit's forward peak, is below the recompute's); the
        recompute, in backward with later gradients allocated, keeps everything, with
        the output's gradient waiting."""
        held = sum(self.costs.output[f] for f in self.features if f >= b - 1)
        if b == self.n:
            return held + max(state.forward, state.backward)
        recompute = self._grads_after[b - 1] + self.costs.output[b - 1] + state.forward
        return held + max(recompute, state.backward)

    def local(self, a: int, b: int, policies: Iterable[Tuple[int, str]] = ()) -> int:
        """Peak of segment [a, b) beyond the prefix of kept boundaries (the last one ends at ``n``)."""
        return self._run(a, b, dict(policies))[0]

    def _run(self, a: int, b: int, policies: Dict[int, str]) -> Tuple[int, Tuple[int, int]]:
        state = _EMPTY
        for i in range(a, b):
            state = self._step(state, a, i, policies.get(i, "keep"), last=b == self.n)
        return self._local(state, b), state.cost

    def options(self, a: int, b: int) -> List[Tuple[int, Tuple[int, int], FrozenSet[Tuple[int, str]]]]:
        """The choices of unit policies for segment [a, b) worth considering: (local peak,
        recompute (FLOPs, cheap bytes), the units not under "keep"), none worse in both than another.

        The choices are the model's templates (see :meth:`templates`), each evaluated exactly."""
        if a not in self._options:
            found: Dict[int, list] = {}
            for template in self.templates():
                last = self._run_all(a, template, last=True)
                for stop, (local, cost) in self._run_all(a, template, last=False).items():
                    found.setdefault(stop, []).append((local, cost, _restrict(template, a, stop)))
                found.setdefault(self.n, []).append((*last[self.n], _restrict(template, a, self.n)))
            self._options[a] = {stop: _pareto_options(opts) for stop, opts in found.items()}
        return self._options[a][b]

    def templates(self) -> List[Dict[int, str]]:
        """Unit policy assignments to try on every segment (restricted to its units).

        Exhaustive choice per unit multiplies past what a plan can afford to search, so
        the units are ranked once: for ``"save_expensive"`` by bytes no longer kept per
        byte of cheap ops run again, for ``"recompute"`` by bytes per FLOP. The templates
        are the best j of the first ranking (j = 0..all), and the best k of the second,
        alone or with the first ranking on every other unit."""
        if self._templates is None:
            c = self.costs

            def ranked(policy, price):
                offered = [i for i in range(self.n) if policy in self._unit_policies[i]]
                return sorted(offered, key=lambda i: -(c.saved[i] - c.under(policy).saved[i]) / max(1, price[i]))

            cheap, recompute = ranked("save_expensive", self._cheap), ranked("recompute", c.flops)
            templates = [{i: "save_expensive" for i in cheap[:j]} for j in range(len(cheap) + 1)]
            for k in range(1, len(recompute) + 1):
                chosen = {i: "recompute" for i in recompute[:k]}
                templates += [chosen, {**{i: "save_expensive" for i in cheap}, **chosen}]
            self._templates = templates
        return self._templates

    def _run_all(self, a: int, policies: Dict[int, str], last: bool) -> Dict[int, Tuple[int, Tuple[int, int]]]:
        """(local peak, recompute) of segment [a, b) under ``policies`` for every b, in one scan
        (``last``: only b = n, the last segment)."""
        out, state = {}, _EMPTY
        for i in range(a, self.n if last else self.n - 1):
            state = self._step(state, a, i, policies.get(i, "keep"), last)
            if not last:
                out[i + 1] = (self._local(state, i + 1), state.cost)
        if last:
            out[self.n] = (self._local(state, self.n), state.cost)
        return out

    def recompute(self, a: int, b: int) -> int:
        return self._flops_prefix[b] - self._flops_prefix[a]

    def segment_peaks(self, starts: Sequence[int], policies: Iterable[Tuple[int, str]] = ()) -> List[int]:
        """The predicted peak while each segment runs, for segments starting at ``starts`` (first is 0)."""
        policies = dict(policies)
        bounds = list(starts) + [self.n]
        prefix, peaks = 0, []
        for a, b in zip(bounds, bounds[1:]):
            prefix += self.boundary(a)
            peaks.append(prefix + self._run(a, b, policies)[0])
        return peaks

    def peak(self, starts: Sequence[int], policies: Iterable[Tuple[int, str]] = ()) -> int:
        return max(self.segment_peaks(starts, policies))

    def recomputed(self, starts: Sequence[int], policies: Iterable[Tuple[int, str]] = ()) -> Tuple[int, int]:
        """What backward runs again: (FLOPs, bytes written by cheap ops)."""
        bounds = list(starts) + [self.n]
        policies, total = dict(policies), (0, 0)
        for a, b in zip(bounds, bounds[1:]):
            cost = self._run(a, b, policies)[1]
            total = (total[0] + cost[0], total[1] + cost[1])
        return total

    def total_recompute(self, starts: Sequence[int]) -> int:
        return self._flops_prefix[starts[-1]]  # everything before the last segment runs twice


class _Scan(NamedTuple):
    """A segment scanned up to some unit, for one choice of policies: what the peak
    model needs to extend it by one more unit."""

    kept: int  # bytes kept for backward so far
    forward: int  # max over units so far of (kept before it + its forward peak)
    backward: int  # max over units so far of (kept up to it + its backward excess + gradients allocated)
    counted: bool  # the current activation's storage is already in ``kept``
    cost: Tuple[int, int]  # recompute so far: (FLOPs, cheap bytes)


_EMPTY = _Scan(0, 0, 0, True, (0, 0))  # a segment's input is its boundary, counted in the prefix


def _restrict(policies: Dict[int, str], a: int, b: int) -> FrozenSet[Tuple[int, str]]:
    return frozenset((i, p) for i, p in policies.items() if a <= i < b)


def _pareto_options(entries: list) -> list:
    entries.sort(key=lambda e: (e[1], e[0], len(e[2])))
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
    and must fall at every index in ``forced``. Each unit gets the policy (among
    those the model offers it) that serves the objective.
    """
    n = model.n
    forced_set = set(forced)
    allowed = [i for i in range(1, n) if splittable[i] or i in forced_set]
    limit = num_segments or max_segments or n
    # states[p]: {count: [(prefix, peak, recompute, starts, policies)]}, Pareto-pruned
    states: Dict[int, Dict[int, list]] = {0: {0: [(0, 0, (0, 0), (), frozenset())]}}
    for p in [0] + allowed:
        for count, entries in sorted(states.get(p, {}).items()):
            # Under a budget only (prefix, recompute) shape what can follow: the peak so far
            # just has to fit. Without one the peak so far is part of the objective.
            entries = _pareto(entries, with_peak=budget is None)
            if count >= limit:
                continue
            next_forced = min([f for f in forced_set if f > p] + [n])
            for q in [i for i in allowed if p < i <= next_forced] + ([n] if next_forced == n else []):
                options = model.options(p, q)
                for prefix, peak, recompute, starts, policies in entries:
                    new_prefix = prefix + model.boundary(p)
                    for local, cost, chosen in options:  # by cost, then lower local peak
                        new_peak = max(peak, new_prefix + local)
                        if budget is not None and new_peak > budget:
                            continue
                        new_recompute = (recompute[0] + cost[0], recompute[1] + cost[1])
                        if max_recompute is not None and new_recompute[0] > max_recompute:
                            continue
                        states.setdefault(q, {}).setdefault(count + 1, []).append((new_prefix, new_peak, new_recompute, starts + (p,), policies | chosen))
                        if budget is not None:
                            break  # the cheapest option that fits: more cost buys nothing under a budget
    finals = [e for count, entries in states.get(n, {}).items() if num_segments is None or count == num_segments for e in entries]
    if not finals:
        return None
    key = (lambda e: (e[2], e[1])) if budget is not None else (lambda e: (e[1], e[2]))
    best = min(finals, key=key)
    return Cuts(list(best[3]), best[4])


def _pareto(entries: list, with_peak: bool = True) -> list:
    """Entries not dominated in (prefix, peak, recompute), or (prefix, recompute) without
    ``with_peak``; of equals, the first in (prefix, recompute, peak) order is kept."""
    entries = sorted(set(entries), key=lambda e: (e[0], e[2], e[1], e[3], sorted(e[4])))
    kept = []
    for e in entries:
        if not any(k[0] <= e[0] and k[2] <= e[2] and (k[1] <= e[1] or not with_peak) for k in kept):
            kept.append(e)
    return kept


def annotate(plan: SplitPlan, model: PeakModel) -> SplitPlan:
    """``plan`` with the model's predicted peak and recompute per segment."""
    policies = plan.policies
    peaks = model.segment_peaks([s.start for s in plan.segments], policies.items())
    segments = []
    for s, pk in zip(plan.segments, peaks):
        flops, cheap = model._run(s.start, s.stop, policies)[1]
        segments.append(replace(s, predicted_bytes=pk, recompute_flops=flops, recompute_bytes=cheap))
    return replace(plan, segments=tuple(segments), predicted_peak_bytes=max(peaks))


def plan_from_cuts(units: Sequence[str], cuts: Cuts, feature_stops: Dict[str, int], strategy: str, model: PeakModel) -> SplitPlan:
    """A plan cutting before each of ``cuts.starts``; segments ending at a requested feature take its name."""
    names_at = {stop: name for name, stop in feature_stops.items()}
    bounds = list(cuts.starts) + [len(units)]
    policies = dict(cuts.policies)
    segments, extra = [], 0
    for a, b in zip(bounds, bounds[1:]):
        name = names_at.get(b)
        if name is None:
            name, extra = f"activation_split_{extra}", extra + 1
        chosen = tuple(policies.get(i, "keep") for i in range(a, b)) if any(a <= i < b for i in policies) else ()
        segments.append(Segment(name, a, b, checkpointed=b != bounds[-1], policies=chosen))
    return annotate(SplitPlan(tuple(units), tuple(segments), strategy), model)


def policy_candidates(units: Sequence[Tuple[str, nn.Module]]) -> List[int]:
    """Units that may run under their own checkpoint (``"save_expensive"``, ``"recompute"``):
    neither they nor the unit after them start with an in-place op, which would overwrite
    the input their recompute needs, or an output the policy keeps."""
    splittable = [layer_splittable_before(m) for _, m in units] + [True]
    return [i for i in range(len(units)) if splittable[i] and splittable[i + 1]]


def peak_model(trunk, x, unit_policies: bool = False) -> PeakModel:
    """Profile a :class:`CheckpointedTrunk`'s units at inputs shaped like ``x`` and model its peaks.

    ``unit_policies``: also measure the units under the other unit policies, and let the
    model choose among them (costs about twice the profiling)."""
    units = expand_units(trunk._blocks())
    candidates = policy_candidates(units) if unit_policies else []
    return PeakModel(profile_units(units, x, candidates), [stop - 1 for stop in trunk._ends.values()], trunk.gradients, candidates)


def plan_trunk(trunk, x) -> SplitPlan:
    """The cost-aware plan of a :class:`CheckpointedTrunk` for inputs shaped like ``x``.

    Balanced plans cut at unit boundaries only. Budget plans also choose a policy per
    unit (non-reentrant trunks: torch's selective checkpointing has no reentrant form),
    which reaches below the block-level floor."""
    units = expand_units(trunk._blocks())
    names = [n for n, _ in units]
    budgeted = trunk.memory_budget is not None
    model = peak_model(trunk, x, unit_policies=budgeted and not trunk.use_reentrant)
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
    budget = trunk.memory_budget
    budget_bytes = int(budget * unsplit) if isinstance(budget, float) else int(budget)
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
