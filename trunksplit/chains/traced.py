"""Feature blocks for any traceable model, with no registration.

``torch.fx`` turns the model's forward into a graph of its own modules and
functional ops. A point of that graph where one tensor carries all the state
forward (an articulation point of the data flow: every value computed before it
that is still needed after it is that tensor) is a place to cut. The ops between
two such points become one unit, an ``fx.GraphModule`` that calls the model's own
modules and reads its own parameters and buffers, so training the units trains
the model and its ``state_dict`` stays valid.

Each unit is named after the cut that ends it: the qualified name of the
outermost module whose last call it contains (``layer3`` after ResNet's third
stage, ``layer3.2`` after a block inside it, ``stages.2`` in a timm ConvNeXt);
where no module completes there, the name of fx's last node. The last unit is
``output``: it ends with the model's own output, whatever its structure. A unit that
ends by selecting a small part of a tensor (a ViT's class token, ``x[:, 0]``) returns
it copied, so that holding the feature does not hold the whole token map.

Sharp edges (what tracing cannot see): control flow on tensor values cannot be
traced (a clear error quotes fx's); Python-level branches are frozen as they were
taken when tracing (``self.training``: trace in the mode you train in); a model
whose forward takes several inputs is refused; an in-place op that changes a
unit's *input* somewhere inside the unit (not as its first op) is not detected.
"""
import contextlib
import inspect
import operator
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase

from .blocks import FeatureBlocks, child_name, layer_splittable_before, small_view_copied

class ChainUnit(fx.GraphModule):
    """One unit of a traced chain: the model's ops between two cuts. ``inplace``: its first op
    writes its input (a segment must not start here: ``layer_splittable_before``);
    ``passes_input_on``: it returns its input's storage. A copy is the same unit: ``fx.GraphModule``'s
    own ``deepcopy`` rebuilds a module from its graph, which drops both flags (a copied trunk, an
    EMA teacher or a side-by-side run, would then cut before an in-place op) and registers the
    forward's tensor constants as buffers again (see :func:`_constants_not_buffers`)."""

    inplace = False
    passes_input_on = False

    def __deepcopy__(self, memo: dict) -> "ChainUnit":
        return _same_unit(super().__deepcopy__(memo), self.inplace, self.passes_input_on)

    def __reduce__(self):
        """Pickled (``torch.save`` of a whole trunk) as fx pickles a graph module, unpickled as a ChainUnit."""
        return _unpickled_unit, (super().__reduce__(), self.inplace, self.passes_input_on)


def _same_unit(rebuilt: fx.GraphModule, inplace: bool, passes_input_on: bool) -> ChainUnit:
    """``rebuilt`` (fx's copy of a unit) as the unit it copies: a ChainUnit with its flags, its tensor
    constants not buffers. The rebuilt module's own modules and parameters are kept."""
    unit = rebuilt if isinstance(rebuilt, ChainUnit) else ChainUnit(rebuilt, rebuilt.graph, class_name="ChainUnit")
    unit.inplace, unit.passes_input_on = inplace, passes_input_on
    _constants_not_buffers(unit)
    return unit


def _unpickled_unit(reduced, inplace: bool, passes_input_on: bool) -> ChainUnit:
    rebuild, args = reduced
    return _same_unit(rebuild(*args), inplace, passes_input_on)


_NOT_TENSORS = {"size", "dim", "numel", "ndimension", "__len__", "tolist", "item"}
_IN_PLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}
# ops whose result may share its input's storage: an in-place op on it writes the input too
_VIEW_METHODS = {"view", "view_as", "reshape", "flatten", "transpose", "permute", "expand", "expand_as", "contiguous",
                 "squeeze", "unsqueeze", "narrow", "select", "unflatten", "t", "__getitem__", "detach", "type_as", "to"}


def traced_blocks(model: nn.Module) -> FeatureBlocks:
    """The model's chain of units between the articulation points of its traced forward."""
    optional = _optional_arguments(model)
    graph = _trace(model, optional)
    # Optional arguments are traced at their defaults: fx keeps a placeholder for each (renamed
    # name_1) used only by a check that it holds the default; drop both.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for n in placeholders[1:]:
        if n.target.rsplit("_", 1)[0] in optional or n.target in optional:
            _erase_if_only_checked(graph, n)
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise TypeError(
            f"{type(model).__qualname__}.forward takes {len(inputs)} tensor inputs; an automatic chain needs exactly one "
            "(register the family with trunksplit.register_trunk instead)"
        )
    units, start = [], 0
    for index, carried in _articulation_points(nodes) + [(len(nodes) - 1, None)]:
        span = [n for n in nodes[start : index + 1] if n.op != "placeholder"]
        if carried is not None and carried not in span:
            continue  # the span computes nothing the rest needs (attribute reads, dead code): merge on
        start = index + 1
        source = units[-1][2] if units else inputs[0]
        units.append((span, source, carried))
    blocks = []
    taken: Set[str] = {"output"}  # as module names: '.' written '_', so that no two units collide as children
    for span, source, carried in units:
        unit = _unit_module(model, span, source, carried)
        name = "output" if carried is None else _cut_name(span, nodes, taken)
        taken.add(child_name(name))
        blocks.append((name, unit))
    for name in [n for n in vars(model) if n.startswith("_tensor_constant")]:
        delattr(model, name)  # fx's tracer left its constants on the model; the units hold them now
    # a unit that passes its input through (Identity) exposes it to the next unit's in-place op
    for (_, unit), (_, after) in reversed(list(zip(blocks, blocks[1:]))):
        unit.inplace = unit.inplace or (unit.passes_input_on and after.inplace)
    return FeatureBlocks(blocks, stages=())


def _trace(model: nn.Module, optional: dict) -> fx.Graph:
    """The model's forward as an fx graph whose buffer reads are nodes, so that units read the
    model's buffers when they run (fx's default runs an op on a buffer once, at trace time, and
    bakes its result into the graph: an in-place update of an EMA would vanish, a view of a
    buffer become a frozen constant). A forward that uses a buffer as a Python value
    (``int(self.count)``) cannot be traced so; it is traced with buffers as they are now,
    which is exact while they do not change. The model is left as it was either way."""
    errors = []
    for proxy_buffers in (True, False):
        with _buffers_kept(model) as written:
            try:
                graph = _ChainTracer(proxy_buffers).trace(model, concrete_args=optional)
            except Exception as e:  # fx raises TraceError, TypeError, NotImplementedError ... for what it cannot follow
                errors.append(e)
                continue
        if written:
            raise TypeError(
                f"{type(model).__qualname__}.forward writes its buffer(s) {written} in a way a traced chain cannot replay "
                "(reassigned, or written while tracing): trunksplit cannot cut it by itself. Register the family with "
                "trunksplit.register_trunk(ModelClass, fn), or checkpoint its blocks in place with "
                "trunksplit.apply_activation_checkpointing(model, memory_budget=0.5, example_inputs=(x,))."
            )
        return graph
    e = errors[0]
    raise TypeError(
        f"trunksplit could not trace {type(model).__qualname__} with torch.fx, so it cannot find its blocks by itself. "
        f"torch.fx said: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Register the family with "
        "trunksplit.register_trunk(ModelClass, fn), pass CheckpointedTrunk an OrderedDict of its blocks in execution "
        "order, or checkpoint its blocks in place for a memory budget with "
        "trunksplit.apply_activation_checkpointing(model, memory_budget=0.5, example_inputs=(x,))."
    ) from None


@contextlib.contextmanager
def _buffers_kept(model: nn.Module):
    """Put every buffer back as it was after tracing, and list (in the yielded list) those the
    trace reassigned or wrote: a forward's ``self.ema = ...`` would leave a Proxy in the model,
    and an op on an unproxied buffer runs for real while tracing."""
    slots = [(m, prefix, name, b, b._version, b.detach().clone())
             for prefix, m in model.named_modules() for name, b in m.named_buffers(recurse=False)]
    written: List[str] = []
    try:
        yield written
    finally:
        for m, prefix, name, b, version, value in slots:
            if getattr(m, name, None) is not b or b._version != version:
                written.append(f"{prefix}.{name}" if prefix else name)
                with torch.no_grad():
                    b.copy_(value)
                setattr(m, name, b)


def _erase_if_only_checked(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and everything computed from it, where none of that reaches the output."""
    found, todo = [], [node]
    while todo:
        n = todo.pop()
        if n.op == "output":
            return
        if n not in found:
            found.append(n)
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(found, key=order.get, reverse=True):
        graph.erase_node(n)


class _ChainTracer(fx.Tracer):
    """fx's tracer, keeping norm layers with running statistics whole.

    Traced through, a BatchNorm subclass (timm's BatchNormAct2d) becomes a functional
    batch_norm whose momentum is a constant in the graph, and the recompute could no
    longer keep its statistics from moving twice; as a module call it can."""

    def __init__(self, proxy_buffers: bool):
        super().__init__()
        self.proxy_buffer_attributes = proxy_buffers

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _NormBase) or super().is_leaf_module(m, qualname)


def _optional_arguments(model: nn.Module) -> dict:
    """forward's arguments after the first that have defaults: traced as those constants (a mask of None)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD}


def _articulation_points(nodes: List[fx.Node]) -> List[tuple]:
    """(index, node) for each position after which exactly one tensor value is still needed."""
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=-1) for n in nodes}
    non_tensor = _non_tensors(nodes)
    live: Dict[fx.Node, int] = {}
    cuts = []
    last_compute = max(i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output"))
    for i, n in enumerate(nodes[:last_compute]):  # the last unit holds the last op and the output
        if n.op != "get_attr" and last_use[n] > i:  # attribute reads are repeated wherever needed
            live[n] = last_use[n]
        for dead in [m for m, last in live.items() if last <= i]:
            del live[dead]
        if len(live) == 1:
            (carried,) = live
            if carried not in non_tensor and carried.op != "placeholder":
                cuts.append((i, carried))
    return cuts


def _non_tensors(nodes: List[fx.Node]) -> Set[fx.Node]:
    """Nodes whose value is a size, a number or a Python container of them, not a tensor (as far as fx shows)."""
    found: Set[fx.Node] = set()
    for n in nodes:
        if n.op == "call_method" and n.target in _NOT_TENSORS:
            found.add(n)
        elif n.op == "call_function" and n.target is getattr and len(n.args) > 1 and n.args[1] in ("shape", "dtype", "device", "ndim"):
            found.add(n)
        elif n.op == "call_function" and any(isinstance(a, fx.Node) and a in found for a in n.args):
            found.add(n)  # arithmetic on sizes, indexing a shape
    return found


def _unit_module(model: nn.Module, span: List[fx.Node], source: fx.Node, carried: Optional[fx.Node]) -> fx.GraphModule:
    """A GraphModule running ``span`` on the value of ``source``; it returns ``carried`` (or the model's output)."""
    g = fx.Graph(tracer_cls=_UnitTracer)  # the tracer a pickled unit's code is loaded with
    env = {source: g.placeholder("x")}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter or buffer read in an earlier unit: read it again here
            if a.op != "get_attr":
                raise AssertionError(f"fx node {a.name} crosses a cut")
            env[a] = g.get_attr(a.target)
        return env[a]

    for n in span:
        if n.op == "output":
            g.output(_owning(g, n.args[0], env) if isinstance(n.args[0], fx.Node) else fx.map_arg(n.args[0], arg))
        else:
            env[n] = g.node_copy(n, arg)
    if carried is not None:
        g.output(_owning(g, carried, env))
    unit = ChainUnit(model, g, class_name="ChainUnit")  # holds the model's own modules and parameters
    _constants_not_buffers(unit)
    # read by layer_splittable_before: a segment must not start with a unit that overwrites its input
    aliases = _input_aliases(model, span, source)
    unit.inplace = aliases is None
    unit.passes_input_on = aliases is not None and carried in aliases
    return unit


_SELECTIONS = {("call_function", operator.getitem), ("call_function", torch.select), ("call_function", torch.narrow),
               ("call_method", "__getitem__"), ("call_method", "select"), ("call_method", "narrow")}


def _owning(g: fx.Graph, returned: fx.Node, env: Dict[fx.Node, fx.Node]) -> fx.Node:
    """The node a unit returns for ``returned``: through :func:`small_view_copied` where it selects from a tensor
    (a ViT's class token, ``x[:, 0]``), as is."""
    if (returned.op, returned.target) in _SELECTIONS and returned.args and isinstance(returned.args[0], fx.Node) and returned.args[0] in env:
        return g.call_function(small_view_copied, (env[returned], env[returned.args[0]]))
    return env[returned]


class _UnitTracer(fx.Tracer):
    """The tracer fx runs again over a unit's code when it loads a pickled unit: it keeps
    :func:`small_view_copied` a call (fx's default would trace through it, and see no tensor)."""

    def __init__(self):
        super().__init__(autowrap_functions=(small_view_copied,))


def _constants_not_buffers(unit: fx.GraphModule) -> None:
    """Hold fx's ``_tensor_constant*`` tensors as plain attributes, not buffers.

    A tensor that the forward builds from Python values (``torch.ones(4, 4).tril()``) is
    computed once while tracing and read as a constant. ``GraphModule`` registers such a copy
    as a buffer, so it would appear among the trunk's buffers and in its ``state_dict`` though
    the model has no such tensor. As a plain attribute it is what the forward's own tensor was:
    not saved, not moved by ``.to()`` (the forward built it on the default device, too)."""
    for name in [n for n in unit._buffers if n.startswith("_tensor_constant")]:
        tensor = unit._buffers.pop(name)
        setattr(unit, name, tensor)


def _input_aliases(model: nn.Module, span: List[fx.Node], source: fx.Node) -> Optional[Set[fx.Node]]:
    """The nodes of ``span`` that may share the unit input's storage (``Identity``, ``reshape`` ...),
    or None where an op writes one of them in place (then ``ReLU(inplace=True)``), as far as the graph shows."""
    aliases = {source}
    for n in span:
        first = n.args[0] if n.args else None
        on_alias = isinstance(first, fx.Node) and first in aliases
        if not on_alias:
            continue
        if n.op == "call_module":
            module = model.get_submodule(n.target)
            if not layer_splittable_before(module):
                return None
            if isinstance(module, nn.Identity):
                aliases.add(n)
        elif n.op == "call_method":
            if n.target.endswith("_") and not n.target.endswith("__"):
                return None
            if n.target in _VIEW_METHODS:
                aliases.add(n)
        elif n.op == "call_function":
            if n.kwargs.get("inplace") is True or n.target in _IN_PLACE_FUNCTIONS or _is_in_place_function(n.target):
                return None
            if n.target is operator.getitem or getattr(n.target, "__name__", "") in _VIEW_METHODS:
                aliases.add(n)
    return aliases


def _is_in_place_function(fn) -> bool:
    """``torch.sigmoid_``, ``F.relu_``, ``torch.Tensor.add_``: a function whose name ends in one
    underscore writes its first argument, as an in-place method does."""
    name = getattr(fn, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def begin_names(units: Sequence[Tuple[str, nn.Module]]) -> List[str]:
    """Where each unit of a chain begins, for a plan's table: a traced unit is named after the cut that
    ends it (:func:`_cut_name`), so timm's ResNet block body ``layer1.1.bn2`` begins at ``layer1.1``, and
    ViT's second half of a block ``blocks.1`` at ``blocks.1.norm2``: the outermost module whose first call
    the unit holds, else fx's name of its first op. Any other unit begins where it is named."""
    used_before: Set[str] = set()
    begins = []
    for name, unit in units:
        nodes = [n for n in unit.graph.nodes if n.op not in ("placeholder", "output")] if isinstance(unit, ChainUnit) else []
        # the modules the unit calls or reads a weight of (timm's LayerNorm is traced through: norm2's weight)
        used = [n.target if n.op == "call_module" else n.target.rpartition(".")[0] for n in nodes if n.op in ("call_module", "get_attr")]
        used = [u for u in used if u]
        ops = [n for n in nodes if n.op != "get_attr"]
        begin = ops[0].name if ops else name
        if used:
            parts = used[0].split(".")
            prefixes = [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
            begin = next((p for p in prefixes if not any(u == p or u.startswith(p + ".") for u in used_before)), used[0])
        used_before.update(used)
        begins.append(begin)
    return begins


def _cut_name(span: List[fx.Node], nodes: List[fx.Node], taken: Set[str]) -> str:
    """The outermost module whose last call falls in ``span``; else fx's name of the span's last node.

    ``taken`` holds the names already given, as module names (see :func:`child_name`): a module
    called twice (shared weights) gives fx node names such as ``shared_0`` beside the module
    name ``shared.0``, and the two must not collide as the trunk's children."""
    called = [n.target for n in span if n.op == "call_module"]
    later = {n.target for n in nodes[nodes.index(span[-1]) + 1 :] if n.op == "call_module"}
    if called:
        parts = called[-1].split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if child_name(prefix) not in taken and not any(t == prefix or t.startswith(prefix + ".") for t in later):
                return prefix
    name = span[-1].name
    while child_name(name) in taken:
        name += "_"
    return name

