"""vissl's trunk splitting, exactly: ``checkpoint_trunk`` and the :class:`SplitPlan` of its buckets.

The trunk is a chain of *units*: every feature block, with the *stages*
expanded into their blocks (:func:`trunksplit.chains.blocks.expand_units`).
vissl cuts after every requested feature, then splits the biggest segment again
and again, never right before an in-place op.
"""
import warnings
from collections import OrderedDict
from dataclasses import replace
from typing import List, Mapping, Optional, Sequence, Tuple

from torch import nn

from ..chains.blocks import expand_units, feature_ends, layer_splittable_before
from ..chains.traced import begin_names
from .plan import Segment, SplitPlan


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
    return SplitPlan(tuple(n for n, _ in units), tuple(segs), "vissl", begins=tuple(begin_names(units)))
