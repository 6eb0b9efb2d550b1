"""Every region template of a segment scanned at once: the planner's inner loop as array arithmetic.

:meth:`RegionTemplates.options` needs, for each segment start, what each of a chain's region
templates gives at every boundary the segment could end at. Scanned one template at a time in
Python (:meth:`PeakModel._scan`) that was most of a long chain's planning time (timm's
MobileNetV3-small: 56 units, 3059 templates). Here all templates advance together, one unit or
one region at a time, with the arithmetic of :meth:`PeakModel._step` and
:meth:`PeakModel._step_region` on arrays: exact (integer bytes and FLOPs; seconds added in the
same order), and checked against the one-template scan (tests/planning/test_planner.py).
"""
from typing import List, NamedTuple, Sequence

import numpy as np

from .sharded_peak import fsdp_at_reduce, fsdp_in_backward
from .unit_terms import input_relief


class Yields(NamedTuple):
    """What the scans gave: one row per (template, boundary), as :meth:`PeakModel._scan` yields them."""

    template: np.ndarray  # the row of ``region_at`` scanned
    stop: np.ndarray  # the boundary: the segment [a, stop)
    local: np.ndarray  # its local peak
    flops: np.ndarray  # and its recompute
    cheap: np.ndarray
    seconds: np.ndarray


def region_table(regions: Sequence[tuple], n: int, templates: Sequence[Sequence[tuple]]) -> np.ndarray:
    """``region_at[t, i]``: the index in ``regions`` of template ``t``'s region starting at unit ``i``; -1: none."""
    index = {g: k for k, g in enumerate(regions)}
    region_at = np.full((len(templates), n), -1, dtype=np.int64)
    for t, template in enumerate(templates):
        for g in template:
            region_at[t, g[0]] = index[g]
    return region_at


class _Regions(NamedTuple):
    """Each region's figures as a scan reads them (``PeakModel._region_step``), one array per field."""

    forward: np.ndarray  # its forward's peak beyond what is kept, with FSDP2's largest gathered weights
    source: np.ndarray  # the unit that allocated its input's storage
    backward: np.ndarray  # its backward's peak beyond what is kept (its input included)
    held: np.ndarray  # what it keeps
    counted: np.ndarray  # whether its output is counted as kept: 1, 0, or -1 (its output is its input's storage)
    again: List[np.ndarray]  # what its own backward runs again: FLOPs, cheap bytes, seconds
    body: List[np.ndarray]  # what running it once costs
    stop: np.ndarray  # the unit after it


def region_arrays(model, regions: Sequence[tuple], last: bool) -> _Regions:
    """``regions``' figures as :func:`scan_templates` reads them, in a segment that is the last (``last``) or not."""
    steps = [model._region_step(region, last) for region in regions]
    gathered = [0 if last else s.gathered for s in steps]  # FSDP2: a recomputed segment holds its weights already
    ints = lambda values: np.array(list(values), dtype=np.int64)  # noqa: E731
    return _Regions(
        forward=ints(s.region.forward + s.largest for s in steps), source=ints(s.source for s in steps),
        backward=ints(s.region.backward - g for s, g in zip(steps, gathered)), held=ints(s.region.held + g for s, g in zip(steps, gathered)),
        counted=ints(-1 if s.region.output_counted is None else int(s.region.output_counted) for s in steps),
        again=[np.array([s.region.again[f] for s in steps]) for f in range(3)], body=[np.array([s.region.body[f] for s in steps]) for f in range(3)],
        stop=ints(region[1] for region in regions))


class _Scans(NamedTuple):
    """The state of every scan (``peak._Scan``), one array per field, a row per template."""

    kept: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    counted: np.ndarray
    cost: List[np.ndarray]  # FLOPs, cheap bytes, seconds
    pending: List[np.ndarray]
    ran: np.ndarray
    tail: np.ndarray
    rerun: np.ndarray
    first: np.ndarray
    unheld: np.ndarray
    input_held: np.ndarray
    ending_backward: np.ndarray  # ``peak._Scan.ending``
    ending_unheld: np.ndarray


def scan_templates(model, a: int, region_at: np.ndarray, table: _Regions, last: bool) -> Yields:
    """Scan a segment starting at unit ``a`` under each row of ``region_at`` (see :func:`region_table`)
    at once: (template, b, local peak, recompute) at each boundary b it could end at (``last``: only
    b = n), as :meth:`PeakModel._scan` yields them one template at a time. ``table``: the regions'
    figures (:func:`region_arrays`, for the same ``last``), made once for every start."""
    n, rows = model.n, len(region_at)
    output = np.asarray(model.costs.output, dtype=np.int64)
    held_after = np.asarray(model._features_held, dtype=np.int64)
    at_recompute = np.asarray(model._grads_at_recompute, dtype=np.int64)  # gradients beside a recompute (PeakModel._local)
    rerun_output_held = np.asarray(model._rerun_output_held, dtype=np.int64)
    rerun_gradient = np.asarray(model._rerun_gradient, dtype=np.int64)
    before_recompute = np.asarray([model.before_recompute(i) for i in range(n)], dtype=np.int64)
    zeros = lambda: [np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64), np.zeros(rows)]  # noqa: E731
    ints = lambda: np.zeros(rows, dtype=np.int64)  # noqa: E731
    relief = input_relief(model, a, last)
    own = model._own_from[a]  # storages from this unit on are the segment's own (PeakModel._step)
    state = _Scans(ints(), ints(), ints(), np.full(rows, own == a), zeros(), zeros(), ints(), ints(), ints(), ints(), ints(), np.full(rows, not relief), ints(), ints())
    if not last:  # a checkpointed segment pays its checkpoint's own cost once (PeakModel._checkpointed_start)
        state.cost[2][:] = model._checkpointed_start.cost.seconds
    position = np.full(rows, a, dtype=np.int64)
    found: List[tuple] = []
    for i in range(a, n):
        here = np.flatnonzero(position == i)
        if not here.size:
            continue
        region = region_at[here, i]
        units, inside = here[region < 0], here[region >= 0]
        if units.size:
            _step_units(model, a, own, i, last, units, state)
            position[units] = i + 1
        if inside.size:
            _step_regions(own, last, inside, region[region >= 0], state, table, output)
            position[inside] = table.stop[region[region >= 0]]
        ends = here[position[here] == n] if last else here[position[here] < n]
        if ends.size:  # PeakModel._local
            b = position[ends]
            forward, backward = state.forward[ends], state.backward[ends]
            recompute = at_recompute[b - 1] + rerun_gradient[b - 1] + state.rerun[ends]
            checkpointed = np.maximum(np.maximum(recompute, state.first[ends]), np.maximum(state.ending_backward[ends] + rerun_output_held[b], before_recompute[b - 1]))
            checkpointed = np.maximum(checkpointed, state.ending_unheld[ends] - relief)
            local = held_after[b] + np.where(b == n, np.maximum(np.maximum(forward, backward), state.unheld[ends] - relief), checkpointed)
            found.append((ends, b, local, *(c[ends] for c in state.cost)))
    if not found:
        empty = np.zeros(0, dtype=np.int64)
        return Yields(empty, empty, empty, empty, empty, np.zeros(0))
    return Yields(*(np.concatenate(column) for column in zip(*found)))


def _step_regions(own: int, last: bool, rows: np.ndarray, k: np.ndarray, state: _Scans, table: _Regions, output: np.ndarray) -> None:
    """:meth:`PeakModel._step_region` for the scans at ``rows``, each entering region ``k`` (in place)."""
    kept, counted = state.kept[rows], state.counted[rows]
    source = table.source[k]
    here = kept + np.where(counted | (source < own), 0, output[np.maximum(source, 0)]) + table.forward[k]
    state.forward[rows] = np.maximum(state.forward[rows], here)
    state.first[rows] = np.maximum(state.first[rows], np.where(source >= own, output[np.maximum(source, 0)], 0) + table.forward[k])
    if not last:  # a region saves (its input at least): the recompute runs it whole
        ran = np.maximum(state.ran[rows], state.tail[rows])
        state.ran[rows], state.tail[rows], state.rerun[rows] = ran, here, np.maximum(ran, here)
    takes = (source >= own) & ~counted  # the region keeps its input
    kept = kept + np.where(takes, output[np.maximum(source, 0)], 0)
    held = state.input_held[rows] | (not last) | (source < own)  # it saves its input: the segment's too where that is its input
    state.backward[rows], state.unheld[rows] = _routed(state.backward[rows], state.unheld[rows], held, kept + table.backward[k])
    state.ending_backward[rows], state.ending_unheld[rows] = state.backward[rows], state.unheld[rows]
    state.input_held[rows] = held
    state.kept[rows] = kept + table.held[k]
    state.counted[rows] = np.where(table.counted[k] < 0, counted | takes, table.counted[k] == 1)
    for f in range(3):
        if not last:  # the segment's recompute runs the region only if a later unit needs it
            state.cost[f][rows] = state.cost[f][rows] + state.pending[f][rows]
            state.pending[f][rows] = table.body[f][k]
        state.cost[f][rows] = state.cost[f][rows] + table.again[f][k]


def _routed(backward: np.ndarray, unheld: np.ndarray, held, term) -> tuple:
    """``peak._routed`` on arrays: a backward term into ``backward`` where the segment's input is ``held``, else ``unheld``."""
    return np.where(held, np.maximum(backward, term), backward), np.where(held, unheld, np.maximum(unheld, term))


def _step_units(model, a: int, own: int, i: int, last: bool, rows: np.ndarray, state: _Scans) -> None:
    """:meth:`PeakModel._step` for the scans at ``rows``, all at unit ``i`` (in place)."""
    c, g = model.costs, model._gathered
    kept, counted = state.kept[rows], state.counted[rows] & (not (last and i > a and model._copied_inside[i]))
    peak = max(c.forward_peak[i] + g[i], 2 * g[i])
    live = kept + np.where(counted | (c.input_from[i] < own), 0, c.output[c.input_from[i]])  # its input is alive, kept or not
    here = live + peak
    state.forward[rows] = np.maximum(state.forward[rows], here)
    state.first[rows] = np.maximum(state.first[rows], (c.output[c.input_from[i]] if c.input_from[i] >= own else 0) + max(model._first_peak[i] + g[i], 2 * g[i]))
    if not last and model._packs[i]:  # the recompute runs the units before whole, this one to its last save
        ran = np.maximum(state.ran[rows], state.tail[rows])
        state.ran[rows], state.tail[rows], state.rerun[rows] = ran, here, np.maximum(ran, live + max(model._rerun_peak[i] + g[i], 2 * g[i]))
    elif not last:
        state.tail[rows] = np.maximum(state.tail[rows], here)
    reduce, in_backward = fsdp_at_reduce(model, a, i, last), fsdp_in_backward(model, a, i, last)
    reduced = kept + reduce
    source = c.input_from[i]
    took = np.where(counted, 0, c.output[source]) if c.saves_input[i] and source >= own else 0  # held by this unit alone
    if c.saves_input[i] and source >= own:
        kept = kept + took
        counted = np.ones_like(counted)
    kept = kept + (c.saved[i] + (0 if last else g[i]))
    counted = np.full(len(rows), bool(c.keeps_output[i])) if model._allocates[i] else counted
    if last and model._caller_keeps[i]:  # held to the step's end, where no unit keeps it
        kept, counted = kept + np.where(counted, 0, c.output[i]), np.ones_like(counted)
    saver = bool(c.saves_input[i] and source < own) if last else model._packs[i]
    held, grads = state.input_held[rows], (model._grads_in_last if last else model._grads_after)[i]
    parts = state.backward[rows], state.unheld[rows]
    state.ending_backward[rows], state.ending_unheld[rows] = _routed(*_routed(*parts, held, np.maximum(reduced, kept - took + (model._released_last[i] + grads))),
                                                                     held | saver, kept + (model._running_last[i] + grads + in_backward))
    state.backward[rows], state.unheld[rows] = _routed(*_routed(*parts, held, np.maximum(reduced, kept - took + (model._released[i] + grads))),
                                                       held | saver, kept + (model._backward_excess[i] + grads + in_backward))
    state.input_held[rows] = held | saver
    state.kept[rows] = kept
    state.counted[rows] = counted
    if last:
        return
    unit = model._unit_costs[i]
    for f in range(3):
        cost, pending = state.cost[f], state.pending[f]
        if c.saves_input[i]:
            cost[rows] = cost[rows] + pending[rows]
            pending[rows] = 0
        pending[rows] = pending[rows] + unit[f]
        if c.saved[i] or c.keeps_output[i]:
            cost[rows] = cost[rows] + pending[rows]
            pending[rows] = 0
