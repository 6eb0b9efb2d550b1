"""``SplitPlan``: how a trunk is cut, the value every strategy returns and ``print(trunk.plan)`` shows.

A plan cuts the trunk's chain of units into contiguous segments (see
:func:`trunksplit.chains.blocks.expand_units`); a segment may hold regions,
runs of units checkpointed again inside it (see :mod:`trunksplit.recompute.regions`).
"""
import dataclasses
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from tabulate import tabulate

from ..recompute.policies import POLICIES, policy as policy_named


@dataclass(frozen=True)
class Segment:
    """Units ``[start, stop)`` of the chain, run as one checkpoint segment."""

    name: str
    start: int
    stop: int
    checkpointed: bool = True
    predicted_bytes: Optional[int] = None  # the planner's estimate of the step peak while this segment runs backward
    recompute_flops: Optional[int] = None  # forward FLOPs run again in backward
    recompute_bytes: Optional[int] = None  # bytes the cheap (FLOP-free) ops write again in backward
    recompute_seconds: Optional[float] = None  # objective "time": what that, with its checkpoints' own cost, adds to a step (measured)
    # nested checkpoints inside the segment: (start, stop, policy), policy one of regions.REGION_POLICIES
    regions: Tuple[Tuple[int, int, str], ...] = ()

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SplitPlan:
    """How a trunk is cut: ``units`` are the chain's names, ``segments`` cover them in order."""

    units: Tuple[str, ...]
    segments: Tuple[Segment, ...]
    strategy: str = "vissl"
    predicted_peak_bytes: Optional[int] = None
    note: str = ""  # why the plan is what it is, where that is not obvious ("runs unsplit: ...")
    compiled: bool = False  # run by a trunk.compile()d trunk: each unit compiled inside eager checkpoints
    meter: str = ""  # what the predicted peaks count (memory.meter_name): the figure to compare them with
    begins: Tuple[str, ...] = ()  # where each unit begins (chains.begin_names), where a unit is named where it ends; () names

    def span(self, start: int, stop: int) -> str:
        """Units ``[start, stop)`` for a reader, ``"layer1.1 .. layer2"``: from where the first begins to the last's name
        (``"res2.1"``: one unit that begins where it is named)."""
        first, last = ((self.begins or self.units)[start], self.units[stop - 1]) if stop > start else ("-", "-")
        return first if first == last else f"{first} .. {last}"

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.segments]

    @property
    def headline(self) -> str:
        """The strategy and how many segments, ``"balanced, 4 segments"``: how ``print(plan)`` and the
        launcher's last line name a plan."""
        count = len(self.segments)
        return f"{self.strategy}, {count} segment{'' if count == 1 else 's'}"

    def state(self) -> dict:
        """The plan as plain containers (strings, numbers, tuples), which a ``weights_only``
        checkpoint holds: a resumed run trains on the plan it saved, not on one measured again."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "SplitPlan":
        segments = tuple(Segment(**{**s, "regions": tuple(tuple(r) for r in s["regions"])}) for s in state["segments"])
        return cls(**{**state, "units": tuple(state["units"]), "begins": tuple(state.get("begins", ())), "segments": segments})

    @property
    def regions(self) -> List[Tuple[int, int, str]]:
        """Every segment's regions: units ``[start, stop)`` run as one nested checkpoint
        under a policy of ``regions.REGION_POLICIES``, the one it runs under (in a checkpointed
        segment a selective region runs as ``"recompute"``, and up to three times)."""
        return [g for s in self.segments for g in s.regions]

    @property
    def boundaries(self) -> List[int]:
        """Unit indices where a new segment starts (the first one excluded)."""
        return [s.start for s in self.segments[1:]]

    def __str__(self) -> str:
        with_costs = any(s.predicted_bytes is not None for s in self.segments)
        timed = any(s.recompute_seconds is not None for s in self.segments)
        regions = self.regions
        rows = []
        for s in self.segments:
            row = [s.name, self.span(s.start, s.stop), len(s), "yes" if s.checkpointed else "no"]
            if regions:
                row.append(policy_counts(s.regions) or "-")
            if with_costs:
                row += [_mib(s.predicted_bytes), _gflops(s.recompute_flops)]
            if timed:
                row.append("-" if s.recompute_seconds is None else f"{s.recompute_seconds * 1e3:.1f}")
            rows.append(row)
        headers = ["segment", "layers", "count", "checkpointed"]
        if regions:
            headers.append("regions")
        if with_costs:
            headers += ["predicted peak (MiB)", "recompute (GFLOP)"]
        if timed:
            headers.append("recompute (ms)")
        title = f"SplitPlan ({self.headline}"
        if self.predicted_peak_bytes is not None:
            title += f", predicted peak {_mib(self.predicted_peak_bytes)} MiB" + (f" of {self.meter}" if self.meter else "")
        text = title + ")\n" + tabulate(rows, headers=headers, tablefmt="github")
        if self.note:
            text += f"\n{self.note}"
        if self.strategy == "vissl" and not with_costs:  # a newcomer's first print, which would not say why it lacks the columns
            text += ("\npredicted memory: not measured (vissl cuts by module count); trunksplit plan --features ... --input ... "
                     "measures this plan, and strategy='balanced' or a memory_budget plans from measurements")
        for policy in POLICIES.values():
            chosen = [self.units[r] if s - r == 1 else self.span(r, s).replace(" .. ", "..") for r, s, p in regions if p == policy.name]
            if chosen:
                text += f"\n{policy.name} regions ({policy.description}): " + " ".join(chosen)
        if self.compiled:
            text += "\ncompiled (trunk.compile()): each unit one graph inside eager checkpoints, the last segment's selective regions one graph each"
        return text


def check_plan(plan: SplitPlan, names: Sequence[str], splittable: Sequence[bool], forced: Sequence[int]) -> None:
    """Refuse, with a ``ValueError`` saying what to change, a plan (made by hand, or loaded) that would
    not run the chain ``names`` as the plain model does. Why: a trunk runs a plan's segments and
    regions as they are, so one that skipped units ran the model without them, an empty region never
    ended, and a region that overlapped the next was dropped, all without a word.

    The segments run every unit once, in order, each from where the one before stopped, and cut at
    each of ``forced`` (after a requested feature). A region lies inside its segment, after the region
    before it, and neither starts at a unit whose first op is in place (``splittable`` False there) nor
    is followed by one: the in-place op would overwrite the input its recompute needs, or an output it
    keeps (the planner's rule: :func:`trunksplit.planning.search.region_spans`)."""
    n = len(names)
    if tuple(plan.units) != tuple(names):
        raise ValueError(f"this plan cuts the units {list(plan.units)[:4]}..., not this trunk's {list(names)[:4]}...")
    stop = 0
    for s in plan.segments:
        if s.start != stop or s.stop <= s.start:
            raise ValueError(f"segment {s.name!r} runs units [{s.start}, {s.stop}): each segment must run at least one unit, from where the one "
                             f"before it stopped ({stop}), so that the segments run units 0 to {n} once each, in order")
        stop, stop_before = s.stop, s.start
        for region in sorted(s.regions):
            _check_region(region, s, stop_before, names, splittable)
            stop_before = region[1]
    if stop != n:
        raise ValueError(f"the segments stop at unit {stop} of {n}: the last must run to the chain's end ({names[-1]})")
    missing = [c for c in forced if c not in {s.start for s in plan.segments}]
    if missing:
        raise ValueError(f"no segment starts after the requested feature {names[missing[0] - 1]} (unit {missing[0] - 1}): a plan cuts after every requested feature")


def _check_region(region: Tuple[int, int, str], segment: Segment, stop_before: int, names: Sequence[str], splittable: Sequence[bool]) -> None:
    start, stop, name = region
    policy_named(name)  # a name no policy has is refused, naming those there are
    if not stop_before <= start < stop <= segment.stop:
        raise ValueError(f"region {region} must hold at least one unit inside its segment {segment.name!r} (units [{segment.start}, {segment.stop})), "
                         f"after the region before it (which stops at {stop_before})")
    if not splittable[start]:
        raise ValueError(f"region {region} starts at {names[start]}, whose first op is in place and would overwrite the input the region's "
                         f"recompute needs: start it a unit earlier or later")
    if stop < len(names) and not splittable[stop]:
        raise ValueError(f"region {region} is followed by {names[stop]}, whose first op is in place and would overwrite what the region "
                         f"keeps: end it a unit earlier or later")


def plain_where_frozen(plan: SplitPlan, frozen: int) -> SplitPlan:
    """``plan`` as it runs where no gradient reaches its first ``frozen`` units
    (:func:`trunksplit.planning.unit_copies.units_without_gradient`): a segment among them saves
    nothing for backward, so it runs plainly and recomputes nothing, and the table says so."""
    plain = [s for s in plan.segments if s.checkpointed and s.stop <= frozen]
    if not plain:
        return plan
    segments = tuple(replace(s, checkpointed=False, recompute_flops=s.recompute_flops and 0, recompute_bytes=s.recompute_bytes and 0)
                     if s in plain else s for s in plan.segments)
    why = f"{', '.join(s.name for s in plain)} run{'s' if len(plain) == 1 else ''} plainly: no gradient reaches {plan.span(0, frozen)} (frozen), so {'it saves' if len(plain) == 1 else 'they save'} nothing for backward"
    return replace(plan, segments=segments, note="\n".join(filter(None, [plan.note, why])))


def policy_counts(regions: Sequence[Tuple[int, int, str]]) -> str:
    """How many regions run under each policy, in order of first use: "6 save_expensive, 1 save_heavy"."""
    policies = [g[2] for g in regions]
    return ", ".join(f"{policies.count(p)} {p}" for p in dict.fromkeys(policies))


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _gflops(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"
