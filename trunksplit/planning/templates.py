"""Which regions to try: a few ranked templates of nested checkpoints, evaluated exactly.

Choosing a region policy per span multiplies past what a plan can afford to
search, so the peak model (:mod:`trunksplit.planning.peak`) offers each segment
the Pareto-best of a few region assignments (templates), each scanned exactly.
The search over cuts stays exact; the one over regions is as good as its templates.
"""
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..recompute.policies import POLICIES, RECOMPUTE
from ..recompute.regions import run_as
from .costs import Cost
from .template_scan import region_arrays, region_table, scan_templates

Region = Tuple[int, int, str]  # units [start, stop) run as one nested checkpoint under a policy


class RegionTemplates:
    """The region templates of one :class:`~trunksplit.planning.peak.PeakModel`, and the
    choices they give each segment (both computed once, then cached)."""

    def __init__(self, model):
        self.model = model
        # what a region runs again under each policy (as prefix sums over the units), the measure its templates are ranked by
        measures = {"cheap": model._cheap_prefix, "light": model._light_prefix, "all": model._flops_prefix}
        self.prices = {p.name: [p.passes * v for v in measures[p.rebuilds]] for p in POLICIES.values()}
        self._options: Dict[int, Dict[int, list]] = {}
        self._templates: Optional[List[List[Region]]] = None
        self._table = None  # (region_at, each region's figures when not last and last): see region_table, region_arrays

    def options(self, a: int, b: int) -> List[Tuple[int, tuple, FrozenSet[Region]]]:
        """The choices of regions for segment [a, b) worth considering: (local peak,
        recompute (FLOPs, cheap bytes, seconds), regions), none worse in both than another
        (of equals, the first template's).

        The choices are the model's templates (see :meth:`templates`) restricted to the
        segment (a region it cuts through is dropped), each evaluated exactly: the templates
        that differ from ``a`` on are scanned together (:func:`scan_templates`)."""
        if a not in self._options:
            templates = self.templates()
            if self._table is None:
                regions = sorted({g for template in templates for g in template})
                nests_whole = np.array([POLICIES[g[2]].nested is RECOMPUTE for g in regions], dtype=bool)
                self._table = region_table(regions, self.model.n, templates), [region_arrays(self.model, regions, last) for last in (False, True)], nests_whole
            region_at, figures, nests_whole = self._table
            _, first = np.unique(region_at[:, a:], axis=0, return_index=True)  # one template per set of regions from a on
            rows = np.sort(first)
            scans = [scan_templates(self.model, a, region_at[rows], figures[last], last) for last in (False, True)]
            t, stop, local, flops, cheap, seconds = (np.concatenate(column) for column in zip(*scans))
            t = rows[t]
            # A region run as "recompute" over the whole of a checkpointed segment is that segment's own
            # checkpoint once more: the same memory, one checkpoint dearer; only noise in two prices of
            # the same runs could make it look cheaper. Its option is the segment without it.
            starting = region_at[t, a]
            redundant = np.zeros(len(t), dtype=bool)
            if figures[0].stop.size:
                g = np.maximum(starting, 0)
                redundant = (starting >= 0) & (stop < self.model.n) & (figures[0].stop[g] == stop) & nests_whole[g]
            key = (flops, cheap) if self.model.objective == "flops" else (seconds, flops, cheap)  # PeakModel.cost_key
            order = np.lexsort((t, local, *reversed(key), stop))
            order = order[~redundant[order]]
            self._options[a] = {}
            for group in np.split(order, np.flatnonzero(np.diff(stop[order])) + 1):
                lowest = np.minimum.accumulate(local[group])
                kept = group[np.concatenate(([True], local[group][1:] < lowest[:-1]))]  # by cost: only strictly lower peaks
                end = int(stop[group[0]])
                self._options[a][end] = [
                    (int(local[k]), Cost(int(flops[k]), int(cheap[k]), float(seconds[k])),
                     frozenset(_as_run(g, end == self.model.n) for g in templates[t[k]] if a <= g[0] and g[1] <= end))
                    for k in kept]
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
        shapes = [(size, offset) for size in (1, 2, 3, 4, 6, None) for offset in range(size or 1)] if self.model.spans else []
        names = list(POLICIES)  # each keeps less than the one before
        eligible = {policy: self._eligible(policy) for policy in names} if self.model.spans else {}
        grouped = [p for p in names if not POLICIES[p].staged]  # the policies a region of several spans may have
        for size, offset in shapes:
            chunks = {policy: _chunks(eligible[policy], size, offset) for policy in grouped}
            if size not in (1, None) and all(len(chunks[p]) == len(eligible[p]) for p in grouped):
                continue  # no run is longer than one span: the same as size 1
            chunks.update({p: eligible[p] if size == 1 else [] for p in names if POLICIES[p].staged})
            found = []
            for policy in names:
                ranked = self._ranked(chunks[policy], policy)
                found += [[(r, s, policy) for r, s in ranked[:j]] for j in range(1, len(ranked) + 1)]
            # upgrades to a policy that keeps less: selective regions of the shape, else single spans
            upgrades = [(base, policy, chunks[policy] if POLICIES[policy].selective else eligible[policy])
                        for j, policy in enumerate(names) for base in names[:j]]
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
        price = self.prices[policy]

        def worth(chunk):
            freed = self._freed(chunk, policy) - (self._freed(chunk, base) if base else 0)
            return -freed / max(1, price[chunk[1]] - price[chunk[0]])

        return sorted(chunks, key=worth)

    def _freed(self, chunk: Tuple[int, int], policy: str) -> int:
        """Bytes the units of ``chunk`` keep for backward, less what they keep under ``policy``;
        for ``"recompute_stages"``, also what its backward's peak falls below a ``"recompute"`` region's."""
        r, s = chunk
        freed = sum(self.model.costs.saved[r:s]) - sum(self.model.costs.under(policy).saved[r:s])
        if POLICIES[policy].staged:  # against the same span rebuilt at once
            freed += max(0, self.model._region((r, s, RECOMPUTE.name)).backward - self.model._region((r, s, policy)).backward)
        return freed

    def _eligible(self, policy: str) -> List[Tuple[int, int]]:
        """Spans that ran under ``policy`` when profiled."""
        eligible = self.model.costs.under(policy).eligible
        return [(r, s) for r, s in self.model.spans if not eligible or eligible[r]]


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


def _as_run(region: Region, last: bool) -> Region:
    """``region`` with the policy it runs under in the last segment (``last``) or a checkpointed one (see :func:`nested_policy`)."""
    r, s, policy = region
    return (r, s, run_as(policy, not last))
