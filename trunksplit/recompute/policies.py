"""What a checkpoint keeps for backward: the policies, each a type, chosen by name in one place.

A plan names a policy per region (``plan.regions``), ``checkpoint_wrapper(policy=...)`` per
module; everything else (how a region runs, how the planner prices it, what profiling
measures, what a compiled trunk compiles) reads the policy's attributes here. Saved plans
keep the names, so a plan written by an earlier release loads as it was.

Each policy keeps less than the one before it and runs more again:

- ``"save_expensive"``: its input and the outputs of its expensive ops (convolution, matmul,
  attention: :func:`trunksplit.recompute.checkpoint.is_expensive`); the cheap ops (norms,
  activations, pooling, adds) run again in backward, no convolution does.
- ``"save_heavy"``: only the heavy expensive ops' outputs (:func:`~trunksplit.recompute.checkpoint.is_heavy`);
  light convolutions run again too.
- ``"recompute"``: only its input; backward runs the region again, whole.
- ``"recompute_stages"``: only its input; backward runs the region again with each unit cut
  into stages (:mod:`trunksplit.recompute.stages`), then each stage once more as its backward
  reaches it, so that a block's activations are never all held at once.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from .checkpoint import is_expensive, is_heavy

# what a region of a policy runs again, as the planner counts it: the bytes its cheap ops write
# ("cheap"), and also the FLOPs of its light expensive ops ("light"), or everything it ran ("all")
REBUILDS = ("cheap", "light", "all")


@dataclass(frozen=True)
class Policy:
    """One checkpoint policy: what it keeps, how it runs nested, how it is priced.

    ``keeps``: ``"expensive"`` or ``"heavy"`` ops' outputs kept (torch's selective
    checkpointing), or None: only the input. ``staged``: backward rebuilds one conv/matmul
    stage at a time (its regions are single spans). ``rebuilds`` (one of :data:`REBUILDS`) and
    ``passes`` (how many times backward reruns that): what the planner prices it at.
    ``exact``: a step under it gives the plain step's gradients bit for bit (non-reentrant).
    ``stores``: where its saved tensors live (``"device"``; room for an offloading policy)."""

    name: str
    description: str  # one line, as a plan table says it
    keeps: Optional[str]
    staged: bool
    rebuilds: str
    passes: int
    exact: bool = True
    stores: str = "device"

    @property
    def selective(self) -> bool:
        """Keeps some ops' outputs: runs under torch's selective checkpointing (non-reentrant only)."""
        return self.keeps is not None

    @property
    def keep(self) -> Optional[Callable]:
        """``keep(func, args)``: whether an aten op's output is kept (None: nothing but the input)."""
        return {"expensive": is_expensive, "heavy": is_heavy, None: None}[self.keeps]

    @property
    def nested(self) -> "Policy":
        """What it runs as inside a checkpointed segment: a selective one as ``"recompute"``.

        A segment's backward reruns each nested region as the segment's first forward ran it
        (torch's nested checkpoints recompute with the function of the original forward). In
        that first forward torch's selective checkpoint would keep the outputs it saves outside
        the autograd graph, where the segment's checkpoint cannot drop them, from the forward to
        the backward; run as ``"recompute"`` instead, its backward recomputes it whole.
        A staged one nests as it is: its stages are plain checkpoints."""
        return RECOMPUTE if self.selective else self

    @property
    def reruns(self) -> int:
        """How many times at least its backward reruns its whole forward (a floor under its timed cost)."""
        return self.passes if self.rebuilds == "all" else 0


SAVE_EXPENSIVE = Policy("save_expensive", "keep conv/matmul outputs, recompute the rest", keeps="expensive", staged=False, rebuilds="cheap", passes=1)
SAVE_HEAVY = Policy("save_heavy", "keep heavy conv/matmul outputs, recompute light convs and the rest", keeps="heavy", staged=False, rebuilds="light", passes=1)
RECOMPUTE = Policy("recompute", "keep only the input", keeps=None, staged=False, rebuilds="all", passes=1)
RECOMPUTE_STAGES = Policy("recompute_stages", "keep only the input, rebuild one conv/matmul stage at a time", keeps=None, staged=True, rebuilds="all", passes=2)

# every policy by name, each keeping less than the one before
POLICIES: Dict[str, Policy] = {p.name: p for p in (SAVE_EXPENSIVE, SAVE_HEAVY, RECOMPUTE, RECOMPUTE_STAGES)}
# what checkpoint_wrapper takes (a module is one unit: nothing to stage)
WRAP_POLICIES: Tuple[str, ...] = (RECOMPUTE.name, *(p.name for p in POLICIES.values() if p.selective))


def policy(name: str, allowed: Tuple[str, ...] = tuple(POLICIES), what: str = "region policy") -> Policy:
    """The policy called ``name``; a ``ValueError`` naming the choices where it is not one of ``allowed``."""
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}; choose one of {allowed}")
    return POLICIES[name]
