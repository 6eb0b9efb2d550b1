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
``output``: it ends with the model's own output, whatever its structure.

Sharp edges (what tracing cannot see): control flow on tensor values cannot be
traced (a clear error says so); Python-level branches are frozen as they were
taken when tracing (``self.training``: trace in the mode you train in); a model
whose forward takes several inputs is refused; an in-place op that changes a
unit's *input* somewhere inside the unit (not as its first op) is not detected.
"""
import operator
from typing import Dict, List, Optional, Set

from torch import fx, nn

from .blocks import FeatureBlocks, layer_splittable_before

_NOT_TENSORS = {"size", "dim", "numel", "ndimension", "__len__", "tolist", "item"}
_IN_PLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def traced_blocks(model: nn.Module) -> FeatureBlocks:
    """The model's chain of units between the articulation points of its traced forward."""
    try:
        graph = fx.Tracer().trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, NotImplementedError ... for what it cannot follow
        raise TypeError(
            f"trunksplit could not trace {type(model).__qualname__} with torch.fx, so it cannot find its blocks by itself: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. A forward that branches on tensor values "
            "cannot be traced. Register the family with trunksplit.register_trunk(ModelClass, fn), or pass "
            "CheckpointedTrunk an OrderedDict of its blocks in execution order."
        ) from None
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise TypeError(
            f"{type(model).__qualname__}.forward takes {len(inputs)} inputs; an automatic chain needs exactly one "
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
    taken: Set[str] = set()
    for span, source, carried in units:
        unit = _unit_module(model, span, source, carried)
        name = "output" if carried is None else _cut_name(span, nodes, taken)
        taken.add(name)
        blocks.append((name, unit))
    return FeatureBlocks(blocks, stages=())


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
    g = fx.Graph()
    env = {source: g.placeholder("x")}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:  # a parameter or buffer read in an earlier unit: read it again here
            if a.op != "get_attr":
                raise AssertionError(f"fx node {a.name} crosses a cut")
            env[a] = g.get_attr(a.target)
        return env[a]

    for n in span:
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], arg))
        else:
            env[n] = g.node_copy(n, arg)
    if carried is not None:
        g.output(env[carried])
    unit = fx.GraphModule(model, g, class_name="ChainUnit")  # holds the model's own modules and parameters
    unit.inplace = _starts_in_place(model, span)  # read by layer_splittable_before
    return unit


def _starts_in_place(model: nn.Module, span: List[fx.Node]) -> bool:
    first = next(n for n in span if n.op != "get_attr")
    if first.op == "call_module":
        return not layer_splittable_before(model.get_submodule(first.target))
    if first.op == "call_method":
        return first.target.endswith("_") and not first.target.endswith("__")
    if first.op == "call_function":
        return first.kwargs.get("inplace") is True or first.target in _IN_PLACE_FUNCTIONS
    return False


def _cut_name(span: List[fx.Node], nodes: List[fx.Node], taken: Set[str]) -> str:
    """The outermost module whose last call falls in ``span``; else fx's name of the span's last node."""
    called = [n.target for n in span if n.op == "call_module"]
    later = {n.target for n in nodes[nodes.index(span[-1]) + 1 :] if n.op == "call_module"}
    if called:
        parts = called[-1].split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in taken and not any(t == prefix or t.startswith(prefix + ".") for t in later):
                return prefix
    name = span[-1].name
    while name in taken:
        name += "_"
    return name
