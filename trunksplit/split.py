"""vissl's trunk splitting, exactly, and the :class:`SplitPlan` value it yields.

The trunk is a chain of *units*: every feature block, with the *stages*
expanded into their blocks. A plan cuts the chain into contiguous segments;
segment boundaries fall at least after every requested feature.

Which blocks are stages: those a :class:`FeatureBlocks` names in ``stages``
(what :func:`trunksplit.feature_blocks` returns says so for every family); in a
plain dict, vissl's rule, the names that start with ``res``.
"""
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

from tabulate import tabulate
from torch import nn

from .blocks import layer_splittable_before, stage_names
from .regions import REGION_POLICIES


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

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.segments]

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
        regions = self.regions
        rows = []
        for s in self.segments:
            first, last = (self.units[s.start], self.units[s.stop - 1]) if len(s) else ("-", "-")
            row = [s.name, f"{first} .. {last}", len(s), "yes" if s.checkpointed else "no"]
            if regions:
                row.append(policy_counts(s.regions) or "-")
            if with_costs:
                row += [_mib(s.predicted_bytes), _gflops(s.recompute_flops)]
            rows.append(row)
        headers = ["segment", "layers", "count", "checkpointed"]
        if regions:
            headers.append("regions")
        if with_costs:
            headers += ["predicted peak (MiB)", "recompute (GFLOP)"]
        count = len(self.segments)
        title = f"SplitPlan ({self.strategy}, {count} segment{'' if count == 1 else 's'}"
        if self.predicted_peak_bytes is not None:
            title += f", predicted peak {_mib(self.predicted_peak_bytes)} MiB"
        text = title + ")\n" + tabulate(rows, headers=headers, tablefmt="github")
        for policy, meaning in REGION_POLICIES.items():
            chosen = [self.units[r] if s - r == 1 else f"{self.units[r]}..{self.units[s - 1]}" for r, s, p in regions if p == policy]
            if chosen:
                text += f"\n{policy} regions ({meaning}): " + " ".join(chosen)
        return text


def policy_counts(regions: Sequence[Tuple[int, int, str]]) -> str:
    """How many regions run under each policy, in order of first use: "6 save_expensive, 1 save_heavy"."""
    policies = [g[2] for g in regions]
    return ", ".join(f"{policies.count(p)} {p}" for p in dict.fromkeys(policies))


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _gflops(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def expand_units(blocks: Mapping[str, nn.Module]) -> List[Tuple[str, nn.Module]]:
    """The chain of units: each block, with the stages expanded into their children."""
    units, stages = [], stage_names(blocks)
    for name, block in blocks.items():
        if name in stages:
            if not isinstance(block, Iterable):
                raise TypeError(f"feature block {name!r} is a stage so it must be an iterable of blocks, got {type(block).__name__}")
            child_names = {id(m): n for n, m in block.named_children()} if isinstance(block, nn.Module) else {}
            for i, child in enumerate(block):
                units.append((f"{name}.{child_names.get(id(child), i)}", child))
        else:
            units.append((name, block))
    return units


def feature_ends(blocks: Mapping[str, nn.Module], keys: Sequence[str]) -> "OrderedDict[str, int]":
    """For each requested feature in chain order: the unit index just past it."""
    _check_keys(blocks, keys)
    ends, n, stages = OrderedDict(), 0, stage_names(blocks)
    for name, block in blocks.items():
        n += len(block) if name in stages else 1
        if name in keys:
            ends[name] = n
    return ends


def _check_keys(blocks: Mapping[str, nn.Module], keys: Sequence[str]) -> None:
    if isinstance(keys, str):
        raise TypeError(f"feature keys must be a list of names, got the string {keys!r}")
    if len(keys) == 0:
        raise ValueError(f"no output feature requested; known keys: {list(blocks)}")
    unknown = [k for k in keys if k not in blocks]
    if unknown:
        raise ValueError(f"unknown feature key(s) {unknown}; known keys: {list(blocks)}")


def vissl_segments(splittable: Sequence[bool], ends: Mapping[str, int], num_splits: int) -> List[Segment]:
    """vissl's bucketing over a chain of units.

    First cut after every requested feature; then, until ``num_splits`` segments
    exist, cut the biggest segment in two near its middle, never before a unit
    that is not ``splittable`` (the new first half is named ``activation_split_N``,
    the second half keeps the old name). Where vissl's own +-1 step away from an
    unsplittable unit lands on another unsplittable unit (its TODO: "layer-relu-relu"),
    vissl cuts there anyway and backward fails; here the nearest valid cut is
    taken, or the next biggest segment. Everywhere else the result is vissl's.
    Warns when ``num_splits`` cannot be reached.
    """
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"the number of checkpoint splits must be an integer >= 1, got {num_splits!r}")
    segs, start = [], 0
    for name, stop in ends.items():
        segs.append(Segment(name, start, stop))
        start = stop
    if all(len(s) == 0 for s in segs):
        raise ValueError("every requested feature block is empty: nothing to split")
    split_times = 0
    while len(segs) < num_splits:
        choice = _vissl_cut(segs, splittable)
        if choice is None:
            warnings.warn(
                f"asked for {num_splits} checkpoint segments but only {len(segs)} can be made "
                "(every segment is a single layer or can only be cut before an in-place op)",
                UserWarning,
                stacklevel=3,
            )
            break
        i, cut = choice
        s = segs[i]
        segs[i : i + 1] = [Segment(f"activation_split_{split_times}", s.start, s.start + cut), replace(s, start=s.start + cut)]
        split_times += 1
    return segs


def _vissl_cut(segs: List[Segment], splittable: Sequence[bool]) -> Optional[Tuple[int, int]]:
    """(segment index, cut offset) vissl would choose, or None where nothing can be cut."""
    longest = max(len(s) for s in segs)
    if longest <= 1:
        return None
    # Biggest first, earliest among equals: vissl's lengths.index(max(lengths)), and for
    # length 2 "the first splittable 2-element bucket".
    for i in sorted(range(len(segs)), key=lambda j: (-len(segs[j]), j)):
        s = segs[i]
        n = len(s)
        if n < 2:
            break
        ok = lambda c: 0 < c < n and splittable[s.start + c]  # noqa: E731
        if n == 2:
            if ok(1):
                return i, 1
            continue
        cut = n // 2
        if not ok(cut):
            cut = cut - 1 if cut == n - 1 else cut + 1
        if ok(cut):
            return i, cut
        valid = [c for c in range(1, n) if ok(c)]
        if valid:
            return i, min(valid, key=lambda c: (abs(c - n // 2), c))
    return None


def checkpoint_trunk(
    feature_blocks: Mapping[str, nn.Module],
    unique_out_feat_keys: Sequence[str],
    checkpointing_splits: int,
) -> "OrderedDict[str, nn.Sequential]":
    """vissl's ``checkpoint_trunk``: bucket the feature blocks into checkpoint segments.

    Returns the same buckets, names (the requested features, plus
    ``activation_split_N`` for the extra cuts) and member modules (the same
    objects, each bucket an ``nn.Sequential``) as vissl on every input vissl
    accepts. Blocks after the last requested feature are dropped. Unknown keys and
    ``checkpointing_splits < 1`` raise ``ValueError``.
    """
    units = expand_units(feature_blocks)
    ends = feature_ends(feature_blocks, unique_out_feat_keys)
    segs = vissl_segments([layer_splittable_before(m) for _, m in units], ends, checkpointing_splits)
    return OrderedDict((s.name, nn.Sequential(*[m for _, m in units[s.start : s.stop]])) for s in segs)


def vissl_plan(blocks: Mapping[str, nn.Module], out_feat_keys: Sequence[str], num_splits: int) -> SplitPlan:
    """The :class:`SplitPlan` of vissl's bucketing; its last segment is not checkpointed."""
    units = expand_units(blocks)
    segs = vissl_segments([layer_splittable_before(m) for _, m in units], feature_ends(blocks, out_feat_keys), num_splits)
    segs[-1] = replace(segs[-1], checkpointed=False)
    return SplitPlan(tuple(n for n, _ in units), tuple(segs), "vissl")
