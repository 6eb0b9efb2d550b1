"""The planner's named records of what a plan runs again: :class:`Cost`, :class:`RegionCosts`."""
from typing import NamedTuple, Optional, Tuple

from ..recompute.policies import Policy


class Cost(NamedTuple):
    """What a plan (a segment, a region) runs again in backward."""

    flops: int  # of its convolutions, matmuls and attention
    cheap_bytes: int  # written by its cheap (FLOP-free) ops: norms, activations, adds
    seconds: float  # measured, where the profile is timed (the "time" objective); else 0


class RegionCosts(NamedTuple):
    """What a region adds to a scan, whatever comes before it."""

    held: int  # bytes it keeps for backward
    forward: int  # its forward's peak, beyond what it keeps
    backward: int  # its backward's peak
    output_counted: Optional[bool]  # whether its output is counted as kept; None: its output is its input's storage
    again: Cost  # what its own backward runs again
    body: Cost  # what running it once costs (a checkpointed segment's recompute may run it)


NOTHING = Cost(0, 0, 0.0)


def add_costs(a: Cost, b: Cost) -> Cost:
    if b is NOTHING:  # the planner's inner loop adds nothing more often than anything
        return a
    if a is NOTHING:
        return b
    return tuple.__new__(Cost, (a[0] + b[0], a[1] + b[1], a[2] + b[2]))  # Cost(...), without a call: the planner's inner loop


def rebuilt(policy: Policy, as_far_as_needed: Tuple[int, int], whole: Tuple[int, int], light: int) -> Tuple[int, int]:
    """(FLOPs, cheap bytes) a region's backward runs again under ``policy``: its cheap ops, and its
    light expensive ones, or all it ran (as far as backward needs it; in stages, all of it each pass)."""
    flops, cheap = whole
    if policy.rebuilds == "cheap":
        return 0, cheap
    if policy.rebuilds == "light":
        return light, cheap
    return as_far_as_needed if policy.passes == 1 else (policy.passes * flops, policy.passes * cheap)
