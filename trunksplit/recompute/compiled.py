"""Compiled units and regions inside eager checkpoints: torch.compile's speed at a plan's memory.

Compiled as torch's checkpoint operator (``torch.compile`` over a whole planned trunk), AOT
autograd's partitioner decides what a checkpointed segment keeps, and on ResNet-50 it kept far
more than the plan (budget 0.3: 0.64 of the plain eager step; the plan, 0.29). Here the opposite
nesting: the checkpoints stay eager, torch's own, and what runs inside them is compiled, once
per unit, the way torchtitan compiles each block under its activation checkpoint; a selective
region, whose policy names what it keeps, compiles whole (see ``CheckpointedTrunk.compile``).
"""
import types
import weakref
from typing import Callable, Dict, Hashable

import torch

# owner (a trunk) -> {key: compiled function}; weak, so a trunk's compiled code dies with it
_COMPILED: "weakref.WeakKeyDictionary[object, Dict[Hashable, Callable]]" = weakref.WeakKeyDictionary()


def compiled_once(owner: object, key: Hashable, fn: Callable, options: dict) -> Callable:
    """``torch.compile(fn, **options)``, made once per ``owner`` and ``key`` and reused.

    Sharp edge: dynamo keeps the graphs it compiles per code object, at most
    ``torch._dynamo.config.recompile_limit`` (8) of them, and past that runs the code eagerly,
    silently but for a log line. Every unit of a trunk runs the same Python function on other
    modules, and once more for its recompute (BatchNorm's momentum is 0 there: a guard fails), so
    one shared code object would pass the limit on any trunk of more than a few units. Each
    compiled function gets a code object of its own."""
    compiled = _COMPILED.setdefault(owner, {})
    if key not in compiled:
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        compiled[key] = torch.compile(own, **options)
    return compiled[key]
