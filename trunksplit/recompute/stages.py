"""Recompute below the block: a unit's forward cut into stages, each its own checkpoint.

A ``"recompute"`` region's backward rebuilds the whole region at once: torch's
checkpoint recomputes everything a region saved before the first of it is used.
For an early bottleneck at a large input that is most of the step's peak, on top of its
gradient buffers, and it sets the floor of block-level plans (docs/regions.md). The
``"recompute_stages"`` region policy (see :func:`trunksplit.recompute.regions.run_region`) runs
each unit of its region as the unit's ``torch.fx`` graph cut into *stages*: a stage
starts at each expensive op (a convolution, linear or attention module, or a
functional convolution, linear or matmul) and takes in the cheap ops after it that
read only what the stage computed (BatchNorm, ReLU, GELU, dropout). Each stage runs
as a nested checkpoint, so the region's recompute holds only the stages' inputs and
what the ops between stages save (a bottleneck's residual add and last ReLU), and
its backward rebuilds one stage at a time (docs/regions.md: what that saves for an
early bottleneck).

What is exact: the graph calls the unit's own submodules and functions, in the
unit's order, on the module as it is at run time (parameters, buffers and children
are looked up on each run). Dropout and stochastic depth replay (each checkpoint
restores the RNG), BatchNorm statistics move once (see
:func:`trunksplit.recompute.checkpoint.run_checkpointed`).

Sharp edges, each answered by running the unit whole (exact, without the saving):

- the graph is traced once per module and training mode, so Python control flow that
  depends on anything else (a global flag, a shape) would be frozen as traced. A
  unit ``torch.fx`` cannot trace, or whose forward takes more than one input, is run
  whole, and so is one that already runs under a checkpoint of its own.
- a unit with forward or backward hooks of its own (its submodules' hooks run as usual);
- a unit that changes a stage's input in place after the stage, which the stage's
  recompute would read changed (plain autograd refuses such code; a checkpoint
  would not notice).

In-place tensor arithmetic in the unit's code (``out += identity``) is traced as its
out-of-place form: the same values, one more buffer for a moment. The price: each
stage's expensive ops run twice more in backward (once in the region's recompute,
once in the stage's), where a ``"recompute"`` region runs them once.
"""
import copy
import operator
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.node import map_arg

from ..chains.blocks import hook_dicts
from .checkpoint import run_checkpointed
from .wrapper import is_checkpoint_wrapped

EXPENSIVE_MODULES = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.Bilinear, nn.MultiheadAttention,
)
EXPENSIVE_FUNCTIONS = {
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear, F.bilinear,
    F.scaled_dot_product_attention, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
}
EXPENSIVE_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm"}


class Step(NamedTuple):
    """Nodes of a unit's graph run together: a stage (``checkpointed``) or one node between stages."""

    nodes: Tuple[fx.Node, ...]
    inputs: Tuple[fx.Node, ...]  # values made before the step that it reads
    outputs: Tuple[fx.Node, ...]  # values it makes that later nodes read
    checkpointed: bool
    # after each node, the values inside the step read for the last time (a stage's own, freed as
    # eager code frees them, not held to its end); after the step, the unit's values last read by it
    done_inside: Tuple[Tuple[fx.Node, ...], ...]
    done: Tuple[fx.Node, ...]


class StagedGraph(NamedTuple):
    """A unit's traced graph as steps; see :func:`staged_graph`."""

    graph: fx.Graph
    steps: Tuple[Step, ...]

    @property
    def stages(self) -> int:
        return sum(step.checkpointed for step in self.steps)


_STAGED: "weakref.WeakKeyDictionary[nn.Module, Dict[bool, Optional[StagedGraph]]]" = weakref.WeakKeyDictionary()


def staged_graph(module: nn.Module) -> Optional[StagedGraph]:
    """``module``'s forward as stages, or None where it cannot run so (see the module's
    docstring) or would gain nothing (fewer than two stages).

    Traced once per module and training mode. The graph names submodules and
    attributes; it holds no reference to the module."""
    per_mode = _STAGED.setdefault(module, {})
    if module.training not in per_mode:
        per_mode[module.training] = _stage(module)
    return per_mode[module.training]


def run_in_stages(module: nn.Module, x: Any) -> Any:
    """``module(x)``, each stage of its graph a nested checkpoint; a unit that cannot
    run in stages (see :func:`staged_graph`, or with hooks of its own) runs whole."""
    staged = None if _has_hooks(module) else staged_graph(module)
    if staged is None:
        return module(x)
    env: Dict[fx.Node, Any] = {next(n for n in staged.graph.nodes if n.op == "placeholder"): x}
    for step in staged.steps:
        if step.checkpointed:
            function = _StepFunction(module, step)
            layers = [module.get_submodule(n.target) for n in step.nodes if n.op == "call_module"]
            env.update(zip(step.outputs, run_checkpointed(function, layers, tuple(env[n] for n in step.inputs))))
        else:
            env[step.nodes[0]] = _call(module, step.nodes[0], env)
        for node in step.done:
            del env[node]
    output = next(n for n in staged.graph.nodes if n.op == "output")
    return map_arg(output.args[0], lambda n: _value(module, env, n))


class _StepFunction:
    """A stage as a function of its inputs, returning its outputs (a tuple)."""

    def __init__(self, module: nn.Module, step: Step):
        self.module, self.step = module, step

    def __call__(self, *values):
        env = dict(zip(self.step.inputs, values))
        del values
        for node, done in zip(self.step.nodes, self.step.done_inside):
            env[node] = _call(self.module, node, env)
            for n in done:
                del env[n]
        return tuple(env[n] for n in self.step.outputs)


def _call(module: nn.Module, node: fx.Node, env: Dict[fx.Node, Any]) -> Any:
    """Run one node on the values in ``env`` (see :func:`_value`)."""

    def value(n: fx.Node) -> Any:
        return _value(module, env, n)

    args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
    if node.op == "call_module":
        return module.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise RuntimeError(f"unexpected graph node {node.op} {node.target}")


def _value(module: nn.Module, env: Dict[fx.Node, Any], node: fx.Node) -> Any:
    """A node's value: computed (in ``env``), or an attribute (``layer_scale``) read from the module now."""
    return _attribute(module, node.target) if node.op == "get_attr" else env[node]


def _attribute(module: nn.Module, target: str) -> Any:
    return operator.attrgetter(target)(module)


def _stage(module: nn.Module) -> Optional[StagedGraph]:
    if is_checkpoint_wrapped(module) or any(is_checkpoint_wrapped(m) for m in module.modules()):
        return None  # a checkpoint of its own inside a stage would nest a third time for nothing
    try:
        # Traced on a shallow copy: the tracer stores tensor constants it meets as new
        # attributes of the module it traces, and the unit must stay as it was.
        graph = fx.Tracer().trace(copy.copy(module))
    except Exception:  # noqa: BLE001 - tracing runs arbitrary user code; any failure means "run it whole"
        return None
    if sum(n.op == "placeholder" for n in graph.nodes) != 1:
        return None
    for node in graph.nodes:
        if node.op == "get_attr":
            try:
                _attribute(module, node.target)
            except AttributeError:  # a constant the tracer made: not part of the unit
                return None
    steps = _steps(module, graph)
    if sum(s.checkpointed for s in steps) < 2 or _changes_stage_inputs(module, steps):
        return None
    return StagedGraph(graph, tuple(steps))


def _steps(module: nn.Module, graph: fx.Graph) -> List[Step]:
    """Stages (an expensive node and the nodes after it that read only the stage's
    values) and the single nodes between them, in graph order."""
    groups: List[Tuple[List[fx.Node], bool]] = []
    current: Optional[List[fx.Node]] = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if _is_expensive(module, node):
            current = [node]
            groups.append((current, True))
            continue
        reads = [n for n in node.all_input_nodes if n.op != "get_attr"]
        if current is not None and reads and all(n in current for n in reads):
            current.append(node)
            continue
        current = None
        groups.append(([node], False))
    step_of = {node: k for k, (nodes, _) in enumerate(groups) for node in nodes}
    last_step: Dict[fx.Node, int] = {}  # value passed between steps -> the last step that reads it (the output: none)
    for node in graph.nodes:
        for n in node.all_input_nodes:
            reader = step_of.get(node, len(groups))
            if n.op != "get_attr" and step_of.get(n) != reader:
                last_step[n] = max(last_step.get(n, -1), reader)
    steps = []
    for k, (nodes, checkpointed) in enumerate(groups):
        inside = set(nodes)
        inputs = tuple(dict.fromkeys(n for node in nodes for n in node.all_input_nodes if n not in inside and n.op != "get_attr"))
        outputs = tuple(n for n in nodes if any(u not in inside for u in n.users))
        done = tuple(n for n, last in last_step.items() if last == k)
        steps.append(Step(tuple(nodes), inputs, outputs, checkpointed, _done_inside(nodes, outputs), done))
    return steps


def _done_inside(nodes: List[fx.Node], outputs: Tuple[fx.Node, ...]) -> Tuple[Tuple[fx.Node, ...], ...]:
    """For each of a step's nodes, the step's values (inputs included) it reads for the last
    time inside the step, less the step's outputs."""
    last: Dict[fx.Node, int] = {}
    for k, node in enumerate(nodes):
        for n in node.all_input_nodes:
            if n.op != "get_attr":
                last[n] = k
    return tuple(tuple(n for n, at in last.items() if at == k and n not in outputs) for k in range(len(nodes)))


def _is_expensive(module: nn.Module, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(module.get_submodule(node.target), EXPENSIVE_MODULES)
    if node.op == "call_function":
        return node.target in EXPENSIVE_FUNCTIONS
    return node.op == "call_method" and node.target in EXPENSIVE_METHODS


def _changes_stage_inputs(module: nn.Module, steps: List[Step]) -> bool:
    """Whether a node after a stage may change one of the stage's inputs in place."""
    read_by_stages = set()
    for step in steps:
        if step.checkpointed:
            read_by_stages.update(step.inputs)
        for node in step.nodes:
            if any(v in read_by_stages for value in _changed_in_place(module, node) for v in _aliases(value)):
                return True
    return False


def _changed_in_place(module: nn.Module, node: fx.Node) -> List[fx.Node]:
    """The graph values ``node`` may write to: the first argument of an in-place method
    (``x.add_``), of a module built with ``inplace=True`` or of a function called so."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None:
        return []
    if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
        return [first]
    if node.op == "call_module" and getattr(module.get_submodule(node.target), "inplace", False):
        return [first]
    if node.op == "call_function" and (node.kwargs.get("inplace") or getattr(node.target, "__name__", "").endswith("_")):
        return [first]
    return []


def _aliases(node: fx.Node) -> List[fx.Node]:
    """``node`` and the values it may be a view of, through cheap single-input nodes (views, reshapes)."""
    found = [node]
    while node.op in ("call_method", "call_function") and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
        found.append(node)
    return found


def _has_hooks(module: nn.Module) -> bool:
    return any(hook_dicts(module))
