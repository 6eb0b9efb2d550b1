"""A trunk's units profiled at two small batches and planned at any batch, costs scaled linearly.

What :func:`trunksplit.fit` and the launcher's whole-step fit plan from: one profile (two
small batches), then the planner's peak for any batch and any budget, without allocating
that batch. Every activation cost is a line in the batch (the same ops on more images).
"""
import copy
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..chains.traced import begin_names
from .memory import meter_name
from .peak import PeakModel
from .plan import plain_where_frozen
from .profile import UnitCosts, profile_units
from .request import PlanRequest
from .unit_copies import units_without_gradient
from .search import best_plan, plan_from_cuts
from .sharding import measured_by_allocator, sharded_costs

PROFILE_BATCHES = (2, 4)  # two small batches give each cost's slope and intercept; 2, not 1: BatchNorm needs two values


class ScaledChain:
    """A trunk's units profiled at two small batches (:data:`PROFILE_BATCHES`) and planned at
    any batch from costs scaled linearly (see :func:`_scaled`), for one of ``world_size`` ranks."""

    def __init__(self, request: PlanRequest, input_shape: Sequence[int], device: torch.device, world_size: int = 1,
                 progress: Optional[Callable[[str], None]] = None):
        self.request = request  # a trunk's (CheckpointedTrunk.plan_request)
        self.names = list(request.names)
        self.begins = tuple(begin_names(request.units))  # for its plans' tables
        self.units = list(request.modules)
        self.splittable = request.splittable
        self.forced = request.forced
        self.features = request.feature_units
        units = list(request.units)
        allocator = measured_by_allocator(world_size, device)
        self.meter = meter_name(device, allocator)  # what its plans' peaks count
        self.unsharded = [profile_units(units, torch.zeros(b, *input_shape, device=device), allocator=allocator, progress=progress, features=request.feature_units)
                          for b in PROFILE_BATCHES]
        self.full_grad_bytes = sum(self.unsharded[0].param_bytes)
        self.small = self._costs_for(world_size)
        self._searched: Dict[tuple, tuple] = {}  # (batch, budget, held) -> (peak model, cuts): a fit asks each many times

    def _costs_for(self, world_size: int) -> List[UnitCosts]:
        return [sharded_costs(c, self.units, world_size) for c in self.unsharded] if world_size > 1 else self.unsharded

    def sharded(self, world_size: int) -> "ScaledChain":
        """The same chain for one of ``world_size`` FSDP2 ranks, without profiling again."""
        chain = copy.copy(self)
        chain.small, chain._searched = self._costs_for(world_size), {}
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
            cuts = best_plan(peaks, self.splittable, self.forced, max_segments=self.request.num_splits, budget=budget)
            starts = (cuts or best_plan(peaks, self.splittable, self.forced, max_segments=self.request.num_splits)).starts
        return peaks.peak(starts), peaks.total_recompute(starts) / max(1, sum(peaks.costs.flops))

    def _peaks(self, batch: int, gradients: Optional[str] = None) -> PeakModel:
        """The trunk's peak model at ``batch``, for its gradient mode or ``gradients``."""
        return PeakModel(costs=scaled_costs(self.small, batch), feature_units=self.features, gradients=gradients or self.request.gradients,
                         update_temporaries=self.request.update_temporaries, reentrant=self.request.use_reentrant)

    def _fixed_starts(self, kind: str) -> List[int]:
        """Segment starts of "every unit" (a cut before each unit that may start a segment) or "none"."""
        return [0] + ([i for i in range(1, len(self.units)) if self.splittable[i]] if kind == "every unit" else [])

    def _cuts(self, batch: int, budget: Optional[int] = None, held: bool = False):
        """(peak model, cuts) of the least-recompute plan within ``budget`` (None: the lowest peak), for a call whose updates in
        backward are ``held`` or not (held: its backward keeps the gradients, as ``CheckpointedTrunk`` plans it: ``"allocated"``)."""
        key = (batch, budget, held)
        if key not in self._searched:
            peaks = self._peaks(batch, "allocated" if held else None)
            self._searched[key] = peaks, best_plan(peaks, self.splittable, self.forced, max_segments=self.request.num_splits, budget=budget)
        return self._searched[key]

    def lowest_peak(self, batch: int) -> int:
        """The lowest step peak any plan reaches at ``batch``."""
        peaks, cuts = self._cuts(batch)
        return peaks.peak(*cuts)

    def planned_peak(self, batch: int, budget: Optional[int] = None, gradients: Optional[str] = None, held: bool = False) -> int:
        """The step peak at ``batch`` of the least-recompute plan within ``budget`` (None: the
        lowest-peak plan) for a call whose updates in backward are ``held`` or not, priced as it is
        planned, or, with ``gradients``, that same plan run where the gradients are another mode's
        (``"kept"``: a second trunk call of a step finds the first one's gradients alive)."""
        peaks, cuts = self._chosen(batch, budget, held)
        if gradients is not None and gradients != peaks.gradients:
            peaks = self._peaks(batch, gradients)
        return peaks.peak(*cuts)

    def held_after_forward(self, batch: int, budget: Optional[int] = None) -> int:
        """What the plan of :meth:`planned_peak` holds from its forward until its backward, at most:
        every segment's input and what the last segment keeps (its peak, gradients aside)."""
        peaks, cuts = self._chosen(batch, budget)
        kept = self._peaks(batch, "kept")
        return kept.segment_peaks(*cuts)[-1]

    def _chosen(self, batch: int, budget: Optional[int] = None, held: bool = False):
        """(peak model, cuts) of the least-recompute plan within ``budget``; the lowest-peak plan where none fits, or for None."""
        peaks, cuts = self._cuts(batch, budget, held)
        return (peaks, cuts) if cuts is not None else self._cuts(batch, None, held)

    def plan(self, batch: int, budget: Optional[int], held: bool = False):
        """The least-recompute plan at ``batch`` whose peak fits ``budget`` (where none does, or for None: the lowest-peak plan),
        for a call whose updates in backward are ``held`` or not."""
        peaks, cuts = self._chosen(batch, budget, held)
        plan = plain_where_frozen(plan_from_cuts(self.names, cuts, self.request.stops, "budget", peaks), units_without_gradient(self.units))
        return replace(plan, meter=self.meter, begins=self.begins)



def scaled_costs(small: Sequence[UnitCosts], batch: int) -> UnitCosts:
    """Unit costs at ``batch``, each byte and FLOP count a line through the two profiled batches;
    everything that does not grow with the batch (names, parameters, FSDP2's gathered weights and
    its backend's copies) as profiled. At a profiled batch: that batch's costs.

    Sharp edge: a peak (``forward_peak``, ``rerun_peak``, ``first_peak``, ``backward_excess``, ``backward_fresh``) is the largest of
    lines, so its line through two small batches runs below it where a steeper moment overtakes
    (a weight gradient's bytes at 2 and 4 images, an activation's at 24): a lower bound there.
    ``fit`` and the launcher's fit check a real step and keep what it missed free."""
    (b0, b1), (c0, c1) = PROFILE_BATCHES, small

    def at(a, b):
        return round(a + (b - a) * (batch - b0) / (b1 - b0))

    def line(v0, v1):
        return tuple(max(0, at(a, b)) for a, b in zip(v0, v1))

    counts = ("output", "saved", "forward_peak", "rerun_peak", "rerun_gradient", "first_peak", "backward_excess", "backward_fresh", "fresh_while_input_held", "fresh_from_unpack", "released_fresh", "excess_while_input_held", "excess_from_unpack", "released_excess",
              "flops", "recompute_bytes", "light_flops", "beside_waiting", "beside_held_output")
    # a moment's bytes beyond what the forward left may be negative (freed by then): not clamped
    moments = tuple(tuple((at(m0[0], m1[0]), *m1[1:]) for m0, m1 in zip(u0, u1)) for u0, u1 in zip(c0.update_moments, c1.update_moments))
    return replace(c1, update_moments=moments, **{k: line(getattr(c0, k), getattr(c1, k)) for k in counts})
