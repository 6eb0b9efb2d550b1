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
from typing import Dict, List, Optional, Sequence, Tuple

from .blocks import layer_splittable_before
from .profile import UnitCosts, profile_units
from .split import Segment, SplitPlan, expand_units, vissl_plan


PEAK_TOLERANCE = 0.02  # balanced plans: predicted peaks this close count as equal
RECOMPUTE_SLACK = 0.10  # balanced plans recompute at most this much more than vissl's plan of the same count


GRADIENT_MODES = ("allocated", "kept")


class PeakModel:
    """Predicts a step's peak bytes for any cut of a chain: what the step allocates beyond
    what was live before it (parameters, and in ``"kept"`` mode their gradients)."""

    def __init__(self, costs: UnitCosts, feature_units: Sequence[int], gradients: str = "allocated"):
        if gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}")
        self.costs = costs
        self.n = len(costs)
        self.gradients = gradients
        self.features = sorted(set(feature_units))  # unit indices whose outputs the caller holds
        c = costs
        self._saved_prefix = [0] + list(itertools.accumulate(c.saved))
        self._flops_prefix = [0] + list(itertools.accumulate(c.flops))
        # grads_after[i]: gradients that exist while unit i runs its backward (those of units after it)
        after = list(itertools.accumulate(reversed(c.param_bytes)))[::-1] + [0]
        self._grads_after = after[1:] if gradients == "allocated" else [0] * self.n
        self._local: Dict[Tuple[int, int, bool], int] = {}

    def boundary(self, a: int) -> int:
        """Bytes a segment starting at unit ``a`` keeps as its input (the chain's own input is not counted)."""
        return self.costs.output[a - 1] if a > 0 else 0

    def _kept(self, a: int, i: int) -> int:
        """Bytes kept for backward by units a..i-1 of a segment starting at a (its input excluded).

        What each unit allocates and keeps itself, plus outputs of units in [a, i)
        that later units in [a, i) keep as their input, each storage once."""
        c = self.costs
        kept_inputs = {c.input_from[j] for j in range(a, i) if c.saves_input[j]}
        return self._saved_prefix[i] - self._saved_prefix[a] + sum(c.output[u] for u in kept_inputs if a <= u < i and not c.keeps_output[u])

    def local(self, a: int, b: int, last: bool) -> int:
        """Peak of segment [a, b) beyond the prefix of kept boundaries."""
        key = (a, b, last)
        if key not in self._local:
            c = self.costs
            held = sum(c.output[f] for f in self.features if f >= b - 1)
            grads = self._grads_after
            backward = max(self._kept(a, i + 1) + c.backward_excess[i] + grads[i] for i in range(a, b))
            if last:  # the forward keeps what it saves
                forward = max(self._kept(a, i) + c.forward_peak[i] for i in range(a, b))
            else:  # the forward keeps nothing; the recompute (in backward, later gradients allocated) keeps
                # everything, with the output's gradient waiting
                recompute = grads[b - 1] + c.output[b - 1] + max(self._kept(a, i) + c.forward_peak[i] for i in range(a, b))
                forward = max(max(c.forward_peak[a:b]), recompute)
            self._local[key] = held + max(forward, backward)
        return self._local[key]

    def recompute(self, a: int, b: int) -> int:
        return self._flops_prefix[b] - self._flops_prefix[a]

    def segment_peaks(self, starts: Sequence[int]) -> List[int]:
        """The predicted peak while each segment runs, for segments starting at ``starts`` (first is 0)."""
        bounds = list(starts) + [self.n]
        prefix, peaks = 0, []
        for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
            prefix += self.boundary(a)
            peaks.append(prefix + self.local(a, b, last=j == len(bounds) - 2))
        return peaks

    def peak(self, starts: Sequence[int]) -> int:
        return max(self.segment_peaks(starts))

    def total_recompute(self, starts: Sequence[int]) -> int:
        return self._flops_prefix[starts[-1]]  # everything before the last segment runs twice


def best_plan(
    model: PeakModel,
    splittable: Sequence[bool],
    forced: Sequence[int],
    num_segments: Optional[int] = None,
    max_segments: Optional[int] = None,
    budget: Optional[int] = None,
    max_recompute: Optional[int] = None,
) -> Optional[List[int]]:
    """Segment starts of the optimal plan under ``model``, or None if none qualifies.

    With ``budget``: the least recompute whose peak fits (ties: lower peak).
    Without: the lowest peak (ties: less recompute). ``num_segments`` asks for an
    exact count, ``max_segments`` bounds it; ``max_recompute`` bounds the FLOPs
    run again. A cut may fall before unit i only where ``splittable[i]``, and
    must fall at every index in ``forced``.
    """
    n = model.n
    forced_set = set(forced)
    allowed = [i for i in range(1, n) if splittable[i] or i in forced_set]
    limit = num_segments or max_segments or n
    # states[p]: {count: [(prefix, peak, recompute, starts)]}, Pareto-pruned
    states: Dict[int, Dict[int, list]] = {0: {0: [(0, 0, 0, ())]}}
    for p in [0] + allowed:
        for count, entries in sorted(states.get(p, {}).items()):
            entries = _pareto(entries)
            if count >= limit:
                continue
            next_forced = min([f for f in forced_set if f > p] + [n])
            for q in [i for i in allowed if p < i <= next_forced] + ([n] if next_forced == n else []):
                last = q == n
                for prefix, peak, recompute, starts in entries:
                    new_prefix = prefix + model.boundary(p)
                    new_peak = max(peak, new_prefix + model.local(p, q, last))
                    if budget is not None and new_peak > budget:
                        continue
                    new_recompute = recompute if last else recompute + model.recompute(p, q)
                    if max_recompute is not None and new_recompute > max_recompute:
                        continue
                    states.setdefault(q, {}).setdefault(count + 1, []).append((new_prefix, new_peak, new_recompute, starts + (p,)))
    finals = [e for count, entries in states.get(n, {}).items() if num_segments is None or count == num_segments for e in entries]
    if not finals:
        return None
    key = (lambda e: (e[2], e[1])) if budget is not None else (lambda e: (e[1], e[2]))
    return list(min(finals, key=key)[3])


def _pareto(entries: list) -> list:
    """Entries not dominated in (prefix, peak, recompute); the first of equals is kept."""
    entries = sorted(set(entries), key=lambda e: (e[0], e[1], e[2], e[3]))
    kept = []
    for e in entries:
        if not any(k[0] <= e[0] and k[1] <= e[1] and k[2] <= e[2] for k in kept):
            kept.append(e)
    return kept


def annotate(plan: SplitPlan, model: PeakModel) -> SplitPlan:
    """``plan`` with the model's predicted peak and recompute per segment."""
    starts = [s.start for s in plan.segments]
    peaks = model.segment_peaks(starts)
    segments = tuple(
        replace(s, predicted_bytes=pk, recompute_flops=model.recompute(s.start, s.stop) if s.checkpointed else 0)
        for s, pk in zip(plan.segments, peaks)
    )
    return replace(plan, segments=segments, predicted_peak_bytes=max(peaks))


def plan_from_starts(units: Sequence[str], starts: Sequence[int], feature_stops: Dict[str, int], strategy: str, model: PeakModel) -> SplitPlan:
    """A plan cutting before each of ``starts``; segments ending at a requested feature take its name."""
    names_at = {stop: name for name, stop in feature_stops.items()}
    bounds = list(starts) + [len(units)]
    segments, extra = [], 0
    for a, b in zip(bounds, bounds[1:]):
        name = names_at.get(b)
        if name is None:
            name, extra = f"activation_split_{extra}", extra + 1
        segments.append(Segment(name, a, b, checkpointed=b != bounds[-1]))
    return annotate(SplitPlan(tuple(units), tuple(segments), strategy), model)


def peak_model(trunk, x) -> PeakModel:
    """Profile a :class:`CheckpointedTrunk`'s units at inputs shaped like ``x`` and model its peaks."""
    return PeakModel(profile_units(expand_units(trunk._blocks()), x), [stop - 1 for stop in trunk._ends.values()], trunk.gradients)


def plan_trunk(trunk, x) -> SplitPlan:
    """The cost-aware plan of a :class:`CheckpointedTrunk` for inputs shaped like ``x``."""
    units = expand_units(trunk._blocks())
    names = [n for n, _ in units]
    model = peak_model(trunk, x)
    splittable = [layer_splittable_before(m) for _, m in units]
    forced = [stop for stop in trunk._ends.values() if stop < len(units)]
    if trunk.memory_budget is None:
        k = max(trunk.num_splits or 1, len(forced) + 1)  # the cuts after requested features always exist
        starts = best_plan(model, splittable, forced, num_segments=k)
        while starts is None:  # fewer valid cuts than asked for
            k -= 1
            starts = best_plan(model, splittable, forced, num_segments=k)
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
        lowest_peak, vissl_peak = model.peak(lowest), model.peak([s.start for s in vissl.segments])
        near_best = min(int(lowest_peak * (1 + PEAK_TOLERANCE)), max(lowest_peak, vissl_peak))
        starts = best_plan(model, splittable, forced, num_segments=k, budget=near_best, max_recompute=cap)
        return plan_from_starts(names, starts, trunk._ends, "balanced", model)
    unsplit = model.peak([0])
    budget = trunk.memory_budget
    budget_bytes = int(budget * unsplit) if isinstance(budget, float) else int(budget)
    starts = best_plan(model, splittable, forced, max_segments=trunk.num_splits, budget=budget_bytes)
    if starts is None:
        smallest = model.peak(best_plan(model, splittable, forced, max_segments=trunk.num_splits))
        raise ValueError(
            f"no plan meets the memory budget of {budget_bytes} bytes ({budget_bytes / unsplit:.2f} of the unsplit "
            f"{unsplit} bytes) for input {tuple(x.shape)}; the smallest feasible budget is {smallest} bytes "
            f"({smallest / unsplit:.3f} of unsplit)" + (f" with at most {trunk.num_splits} segments" if trunk.num_splits else "")
        )
    return plan_from_starts(names, starts, trunk._ends, "budget", model)
