"""Region policies: how a run of units runs as one checkpoint nested in a segment.

The planner picks, per region, what its checkpoint keeps for backward; this module
runs it so. Each policy keeps less than the one before and runs more again:

- ``"save_expensive"``: its input and the outputs of its expensive ops (convolution,
  matmul, attention: see :func:`trunksplit.recompute.checkpoint.is_expensive`); the cheap ops
  (norms, activations, pooling, adds) run again in backward, no convolution does.
- ``"save_heavy"``: only the heavy expensive ops' outputs (see
  :func:`trunksplit.recompute.checkpoint.is_heavy`); light convolutions run again too.
- ``"recompute"``: only its input; backward runs the region again, whole.
- ``"recompute_stages"``: only its input; backward runs the region again with each
  unit cut into stages (see :mod:`trunksplit.recompute.stages`), then each stage once more as
  its backward reaches it, so that a block's activations are never all held at once.
"""
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .stages import run_in_stages
from .checkpoint import SELECTIVE_KEEPS, map_tensors, run_checkpointed

# the region policies and what each keeps, as a plan table says it
REGION_POLICIES = {
    "save_expensive": "keep conv/matmul outputs, recompute the rest",
    "save_heavy": "keep heavy conv/matmul outputs, recompute light convs and the rest",
    "recompute": "keep only the input",
    "recompute_stages": "keep only the input, rebuild one conv/matmul stage at a time",
}


def run_region(layers: Sequence[nn.Module], x: Any, policy: str, run: Optional[Callable] = None) -> Any:
    """``layers`` run in order on ``x`` as one checkpoint that keeps, for backward, what
    ``policy`` says (see the module docstring). Inside another checkpoint's function it
    nests (give it ``nested_policy(policy)`` there): the outer recompute holds only the
    region's input, the region's own backward the rest.

    ``run(x, *layers)``, where given, runs the layers of a ``"recompute"`` region (compiled
    units: see ``CheckpointedTrunk.compile``); the other policies must see every op run."""
    if policy not in REGION_POLICIES:
        raise ValueError(f"unknown region policy {policy!r}; choose one of {tuple(REGION_POLICIES)}")
    if run is not None and policy != "recompute":
        raise ValueError(f"only a 'recompute' region runs its layers with a function of its own, not {policy!r}")
    run = run or (_run_in_stages if policy == "recompute_stages" else _run)
    return run_checkpointed(run, layers, (x, *layers), keep=SELECTIVE_KEEPS.get(policy))


def nested_policy(policy: str) -> str:
    """The policy a region runs under inside a checkpointed segment: a selective one runs
    as ``"recompute"`` there.

    A segment's backward reruns each nested region as the segment's first forward ran
    it (torch's nested checkpoints recompute with the function of the original forward).
    In that first forward torch's selective checkpoint would keep the outputs it saves
    outside the autograd graph, where the segment's checkpoint cannot drop them, from the
    forward to the backward; run as ``"recompute"`` instead, its backward recomputes it
    whole. ``"recompute_stages"`` nests as it is: its stages are plain checkpoints."""
    return "recompute" if policy in SELECTIVE_KEEPS else policy


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
    region runs as ``"recompute"`` (see :func:`nested_policy`), in the first forward and in the
    recompute alike."""
    if copy_input:
        x = map_tensors(torch.clone, x)
    for start, stop, policy in runs(len(layers), regions):
        if policy is not None:
            x = region(layers[start:stop], x, nested_policy(policy) if in_checkpoint else policy)
        else:  # the units up to the next region: one graph under torch.compile(trunk), not one per unit
            x = plain(x, *layers[start:stop])
    return x
