"""Compiled units and regions inside eager checkpoints: torch.compile's speed at a plan's memory.

Compiled as torch's checkpoint operator (``torch.compile`` over a whole planned trunk), AOT
autograd's partitioner decides what a checkpointed segment keeps, and it keeps far more than the
plan (docs/benchmarks.md#torchcompile). Here the opposite
nesting: the checkpoints stay eager, torch's own, and what runs inside them is compiled, once
per unit, the way torchtitan compiles each block under its activation checkpoint; a selective
region, whose policy names what it keeps, compiles whole (see ``CheckpointedTrunk.compile``).
"""
import functools
import types
import weakref
from typing import Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .checkpoint import run_checkpointed
from .policies import POLICIES, RECOMPUTE
from .regions import run_as, run_region, runs

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


def weight_groups(units: Sequence[nn.Module]) -> List[Tuple[nn.Module, ...]]:
    """``units`` in order, grouped so that each group holds at most one unit with trainable
    weights: a weightless unit (an activation, a pooling, a flatten) joins the group before it
    (the first ones, the group after them). Compiled one graph per group, no graph returns more
    than one unit's gradients, yet no weightless unit is a graph on its own: an in-place ReLU on its
    graph's input steps many times slower compiled alone than eagerly (tools/unit_compile_times.py)."""
    groups: List[List[nn.Module]] = []
    pending: List[nn.Module] = []  # weightless units before the first weighted one
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            groups.append(pending + [unit])
            pending = []
        elif groups:
            groups[-1].append(unit)
        else:
            pending.append(unit)
    if pending:
        groups.append(pending)
    return [tuple(g) for g in groups]


def weight_group_bounds(units: Sequence[nn.Module]) -> List[Tuple[int, int]]:
    """:func:`weight_groups` of ``units`` as index ranges ``[start, stop)`` into them."""
    bounds: List[Tuple[int, int]] = []
    for group in weight_groups(units):
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + len(group)))
    return bounds


def run_plain(x, *layers: nn.Module):
    """Units that run with nothing checkpointed: under ``torch.compile``, one graph.

    Its output leaves compiled code for eager code (a region, a segment) or another graph.
    There it is made contiguous, unless it is already in a dense layout: AOT autograd traces a
    graph's backward for gradients of its outputs' strides, and a ViT block's output is
    transposed in memory while the gradient handed back is not (the backward then fails on a
    view; torch 2.14)."""
    return dense(functools.reduce(lambda h, layer: layer(h), layers, x))


def run_units_apart(x, *layers: nn.Module):
    """Units run in order under ``torch.compile(trunk)``, one graph per :func:`weight_groups` group,
    as ``trunk.compile()`` compiles them: a graph's backward returns the gradients of all its
    weights together, and where gradients are kept (zeroed, not freed) they are held beside the
    kept ones until it returns, which the plan does not hold (docs/benchmarks.md#torchcompile)."""
    for group in weight_groups(layers):
        x = graph_break(run_plain(x, *group))
    return x


@torch.compiler.disable
def graph_break(x):
    """``x``; under ``torch.compile`` the graph ends here (a disabled function is a graph break)."""
    return x


def run_region_dense(layers: Sequence[nn.Module], x, policy: str):
    """A region compiled whole (``trunk.compile()``): its output leaves its graph as a unit's does."""
    return dense(run_region(layers, x, policy))


def dense(x):
    """``x``, contiguous under ``torch.compile`` unless already in a dense layout (see ``run_plain``)."""
    if torch.compiler.is_compiling() and isinstance(x, torch.Tensor):
        in_dense_layout = x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
        x = x if in_dense_layout else x.contiguous()
    return x


@torch.compiler.disable
def eager_segment(run: Callable, layers: Sequence[nn.Module], x, use_reentrant: bool):
    """A checkpointed segment, run eagerly even inside ``torch.compile`` (a graph break):
    compiled as torch's checkpoint operator, AOT autograd's backward keeps far more than the
    plan (docs/benchmarks.md#torchcompile)."""
    return run_checkpointed(run, layers, (x, *layers), use_reentrant=use_reentrant)


@torch.compiler.disable
def eager_region(layers: Sequence[nn.Module], x, policy: str):
    """A region, run eagerly even inside ``torch.compile``, as segments are: compiled as a
    checkpoint operator it keeps more than the plan, and a selective one cannot be traced."""
    return run_region(layers, x, policy)


def default_compile_options(options: dict) -> Tuple[dict, bool]:
    """(the options ``CheckpointedTrunk.compile`` compiles units with, whether to store the
    weights channels-last first): inductor's layout optimisation is done once, ahead of time,
    where no ``mode`` nor ``layout_optimization`` says otherwise, for inductor's own saves a
    channels-last copy of every convolution weight for backward, which no plan holds; and
    ``dynamic=False`` unless given, for dynamo learns dynamic sizes per function name, which all
    units share."""
    options = dict(options)
    ahead = options.get("backend", "inductor") == "inductor" and "mode" not in options and "layout_optimization" not in options.get("options", {})
    if ahead:
        options["options"] = {"layout_optimization": False, **options.get("options", {})}
    return {"dynamic": False, **options}, ahead


def compiled_apart(segments, units: Sequence[nn.Module]) -> List[Tuple[int, int]]:
    """The unit groups ``[start, stop)`` that a plan's ``segments`` run compiled one by one
    (:meth:`CompiledUnits.units`): outside regions, and in ``"recompute"`` regions (a selective
    region nested in a checkpointed segment runs so); not selective regions, compiled whole."""
    groups = []
    for seg in segments:
        for a, b, policy in runs(len(seg), [(r - seg.start, s - seg.start, p) for r, s, p in seg.regions]):
            if policy is None or run_as(policy, seg.checkpointed) == RECOMPUTE.name:
                first = seg.start + a
                groups += [(first + i, first + j) for i, j in weight_group_bounds(units[first : seg.start + b])]
    return groups


class CompiledUnits:
    """How a compiled trunk runs what its segments hold (see ``CheckpointedTrunk.compile``).

    ``options``: what ``torch.compile`` gets. ``eager``: per plan key, the unit groups (ids of
    their units) that run eagerly, for they step faster so; ``select(key)`` picks a key's set
    before a forward. Compiled functions are made once per group and kept for this object's
    life (see :func:`compiled_once`)."""

    def __init__(self, options: dict):
        self.options = options
        self.eager: Dict[Hashable, FrozenSet[Tuple[int, ...]]] = {}
        self.eagerly: FrozenSet[Tuple[int, ...]] = frozenset()

    @property
    def times_units(self) -> bool:
        """Inductor only: another backend (``"aot_eager"``, a custom one) is there to be run as given."""
        return self.options.get("backend", "inductor") == "inductor"

    def select(self, key: Optional[Hashable]) -> None:
        self.eagerly = self.eager.get(key, frozenset())

    def group(self, group: Sequence[nn.Module]) -> Callable:
        """The compiled function of one group of units (called ``f(x, *group)``)."""
        return compiled_once(self, ("units", tuple(map(id, group))), run_plain, self.options)

    def units(self, x, *layers: nn.Module):
        """``layers`` run in order, one compiled graph per :func:`weight_groups` group: a graph's
        backward returns the gradients of all its weights together, so one such unit per graph
        holds no more of them at once than eager autograd does (a unit's own, briefly)."""
        for group in weight_groups(layers):
            ids = tuple(map(id, group))
            x = run_plain(x, *group) if ids in self.eagerly else self.group(group)(x, *group)
        return x

    def region(self, layers: Sequence[nn.Module], x, policy: str):
        """A region: a ``"recompute"`` one (and a selective one nested in a checkpointed segment,
        which runs so) as torch's eager checkpoint around compiled units, as a segment runs, for a
        compiled ``"recompute"`` region would leave what it saves to AOT autograd's partitioner; a
        selective one of the last segment compiled whole, as torch's checkpoint operator under its
        policy; ``"recompute_stages"`` eagerly, for it rebuilds its stages op by op. Under dynamo's
        ``"eager"`` backend, which runs a graph without AOT autograd, nothing would keep a compiled
        region's recompute from moving BatchNorm's statistics again: selective regions run eagerly there."""
        if policy == RECOMPUTE.name:
            return run_region(layers, x, policy, run=self.units)
        if not POLICIES[policy].selective or self.options.get("backend") == "eager":
            return eager_region(layers, x, policy)
        return compiled_once(self, ("region", tuple(map(id, layers)), policy), run_region_dense, self.options)(tuple(layers), x, policy)
