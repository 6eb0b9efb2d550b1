"""Region policies at work: how a run of units runs as one checkpoint nested in a segment.

The planner picks, per region, what its checkpoint keeps for backward (a policy of
:data:`trunksplit.recompute.policies.POLICIES`, each keeping less than the one before and
running more again); this module runs it so.
"""
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .stages import run_in_stages
from .checkpoint import map_tensors, run_checkpointed
from .policies import RECOMPUTE, policy as policy_named


def run_region(layers: Sequence[nn.Module], x: Any, policy: str, run: Optional[Callable] = None) -> Any:
    """``layers`` run in order on ``x`` as one checkpoint that keeps, for backward, what
    ``policy`` says (see the module docstring). Inside another checkpoint's function it
    nests (give it ``run_as(policy, True)`` there): the outer recompute holds only the
    region's input, the region's own backward the rest.

    ``run(x, *layers)``, where given, runs the layers of a ``"recompute"`` region (compiled
    units: see ``CheckpointedTrunk.compile``); the other policies must see every op run."""
    chosen = policy_named(policy)
    if run is not None and chosen is not RECOMPUTE:
        raise ValueError(f"only a {RECOMPUTE.name!r} region runs its layers with a function of its own, not {policy!r}")
    run = run or (_run_in_stages if chosen.staged else _run)
    return run_checkpointed(run, layers, (x, *layers), keep=chosen.keep)


def run_as(policy: str, in_checkpoint: bool) -> str:
    """The name of the policy a region of ``policy`` runs under: inside a checkpointed segment
    (``in_checkpoint``) what it nests as (see :attr:`trunksplit.recompute.policies.Policy.nested`)."""
    return policy_named(policy).nested.name if in_checkpoint else policy


def runs(n: int, regions: Sequence[Tuple[int, int, str]]) -> List[Tuple[int, int, Optional[str]]]:
    """Units ``[0, n)`` as the consecutive runs a segment executes: each region ``(start, stop,
    policy)`` as it is, and the units between two regions as one run ``(start, stop, None)``."""
    starting = {r: (s, p) for r, s, p in regions}
    out, i = [], 0
    while i < n:
        stop, policy = starting.get(i, (min([r for r in starting if r > i] + [n]), None))
        out.append((i, stop, policy))
        i = stop
    return out


def _run(x: Any, *layers: nn.Module) -> Any:
    return functools.reduce(lambda h, layer: layer(h), layers, x)


def _run_in_stages(x: Any, *layers: nn.Module) -> Any:
    return functools.reduce(lambda h, layer: run_in_stages(layer, h), layers, x)


def run_units(copy_input: bool, regions: Sequence[Tuple[int, int, str]], in_checkpoint: bool, x: Any, *layers: nn.Module,
              plain: Callable = _run, region: Callable = run_region) -> Any:
    """Run ``layers`` in order; each region ``(start, stop, policy)`` of them as one nested
    checkpoint (``region(layers, x, policy)``), the units between them as ``plain(x, *layers)``:
    the body of one segment of a plan.

    ``copy_input``: run on a copy of ``x``, for a segment whose first op is in place (a cut
    forced after a requested feature, such as ``bn1`` before ``ReLU(inplace=True)``): the feature
    stays as its block left it, and a checkpoint's input stays intact for the recompute.
    ``in_checkpoint``: this runs as a checkpointed segment's function, where a selective
    region runs as ``"recompute"`` (see :func:`run_as`), in the first forward and in the
    recompute alike."""
    if copy_input:
        x = map_tensors(torch.clone, x)
    for start, stop, policy in runs(len(layers), regions):
        if policy is not None:
            x = region(layers[start:stop], x, run_as(policy, in_checkpoint))
        else:  # the units up to the next region: one graph under torch.compile(trunk), not one per unit
            x = plain(x, *layers[start:stop])
    return x
