"""`CheckpointedTrunk`: run a trunk as a plan of checkpoint segments."""
import functools
from collections import OrderedDict
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .chains import FeatureBlocks, expand_units, feature_blocks, feature_ends, layer_splittable_before, stage_names
from .planning.memory import tensors_in
from .planning.peak import GRADIENT_MODES, OBJECTIVES
from .planning.plan import SplitPlan
from .planning.search import plan_trunk
from .planning.timing import faster_eagerly
from .planning.vissl import vissl_plan
from .recompute.checkpoint import SELECTIVE_KEEPS, map_tensors, run_checkpointed
from .recompute.compiled import compiled_once, run_plain, run_region_dense, run_units_apart, weight_group_bounds, weight_groups
from .recompute.regions import nested_policy, run_region, runs

STRATEGIES = ("vissl", "balanced")


@torch.compiler.disable
def _run_segment(run, layers: Sequence[nn.Module], x, use_reentrant: bool):
    """A checkpointed segment, run eagerly even inside ``torch.compile`` (a graph break).

    Compiled as torch's checkpoint operator, AOT autograd's backward kept far more than the
    plan: ResNet-50 at 224px, budget 0.3, held 0.64 of the plain eager step (the plan: 0.29);
    with its segments and regions run eagerly between compiled code, 0.31
    (tools/compile_benchmark.py, docs/benchmarks.md#torchcompile)."""
    return run_checkpointed(run, layers, (x, *layers), use_reentrant=use_reentrant)


@torch.compiler.disable
def _run_region(layers: Sequence[nn.Module], x, policy: str):
    """A region, run eagerly even inside ``torch.compile``, as segments are: compiled as
    checkpoint operators, the regions of ResNet-50's budget-0.5 plan held 0.81 of the plain
    eager step (the plan: 0.49), and selective ones cannot be traced at all."""
    return run_region(layers, x, policy)


class CheckpointedTrunk(nn.Module):
    """A trunk that trains with checkpointed segments and returns the requested features.

    Args:
        trunk: a model (any torchvision classification family, a registered
            family, or any model ``torch.fx`` can trace), or an ordered dict of
            feature blocks in execution order.
        out_feat_keys: feature blocks to return, in this order, from ``forward``;
            None: the last one (``flatten`` for torchvision families, ``output`` for
            a traced model).
        num_splits: how many checkpoint segments to make (vissl's
            ``NUM_ACTIVATION_CHECKPOINTING_SPLITS``); ``None`` cuts only after
            the requested features. A count that cannot be reached warns.
        strategy: ``"vissl"`` cuts as vissl did (by module count);
            ``"balanced"`` places the cuts from measured per-layer memory.
        memory_budget: bytes (int), or a fraction in (0, 1] of the unsplit peak:
            the plan with the least recompute whose predicted peak fits. With
            ``use_reentrant=False`` the plan may also run regions of units under
            their own nested checkpoint, keeping only their convolution/matmul
            outputs (``"save_expensive"``), only the heavy ones (``"save_heavy"``:
            light 1x1 expansions and depthwise convolutions run again) or only their
            input (``"recompute"``, and ``"recompute_stages"``, whose backward
            rebuilds a block one convolution stage at a time), which reaches below
            what cuts between blocks can (``plan.regions``).
        use_reentrant: torch's reentrant checkpoint (vissl's, for manual DDP) or not.
        gradients: how the training loop clears gradients, which cost-aware plans
            must know: ``"allocated"`` (torch's default ``zero_grad()`` sets them to
            None, so every step allocates them during backward) or ``"kept"``
            (``zero_grad(set_to_none=False)``: they stay allocated between steps).
            Budgets and fractions are of what the step allocates beyond what was
            live before it, in that mode.
        objective: what cost-aware plans minimise among those that fit: ``"time"``
            prices recompute in seconds from the ops timed while profiling (one byte of
            cheap ops such as BatchNorm is worth so many convolution FLOPs on this
            device), ``"flops"`` counts FLOPs run again, then cheap bytes. Timings make a
            ``"time"`` plan depend on the machine; ``"flops"`` plans are the same everywhere.

    Exact: a training step gives the plain model's outputs, every parameter's
    gradient and BatchNorm buffers. The last segment is never checkpointed, and in
    eval mode or under ``no_grad`` nothing is. The trunk holds only the blocks up to
    the last requested feature (a classifier head is not among its parameters, so
    plain ``DDP(trunk)`` needs no ``find_unused_parameters``). Its ``state_dict``
    keys are the feature block names (``res2.0.conv1.weight``) and do not depend
    on the plan.

    Under ``torch.compile(trunk)`` planning, checkpointed segments and regions run eagerly
    (graph breaks) and each run of units between them compiles as one graph (one per unit with weights
    under a ``memory_budget`` with ``gradients="kept"``, whose gradients one graph would hold
    together): the plan's memory is kept (compiled as torch's checkpoint operator, recompute
    kept more), and the step equals the compiled plain model's within float tolerance.
    :meth:`compile` compiles each unit inside the checkpoints too, and the selective regions whole.
    """

    def __init__(
        self,
        trunk: Union[nn.Module, Mapping[str, nn.Module]],
        out_feat_keys: Optional[Sequence[str]] = None,
        num_splits: Optional[int] = None,
        strategy: str = "vissl",
        memory_budget: Optional[Union[int, float]] = None,
        use_reentrant: bool = False,
        gradients: str = "allocated",
        objective: str = "flops",
    ):
        super().__init__()
        source = None if isinstance(trunk, Mapping) else trunk
        blocks = trunk if source is None else feature_blocks(trunk)
        if out_feat_keys is None:
            out_feat_keys = [next(reversed(blocks))] if len(blocks) else []
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"num_splits must be an integer >= 1 or None, got {num_splits!r}")
        memory_budget = _check_budget(memory_budget)
        if gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES} (how zero_grad leaves them), got {gradients!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        ends = feature_ends(blocks, out_feat_keys)  # validates the keys
        last = list(blocks).index(next(reversed(ends)))
        self._stages = stage_names(blocks)
        self._keys = list(blocks)[: last + 1]
        children = {_child_name(k) for k in self._keys}
        if len(children) != len(self._keys):
            raise ValueError(f"feature block names {self._keys} collide once '.' is written '_' (module names cannot hold dots)")
        for name in self._keys:
            self.add_module(_child_name(name), blocks[name])
        # trunk state_dict key -> the source model's, for model_state_dict(); names only, no reference
        self._model_keys = _key_map(self, source) if source is not None else {}
        self.out_feat_keys = tuple(out_feat_keys)
        self.num_splits = num_splits
        self.strategy = strategy
        self.memory_budget = memory_budget
        self.use_reentrant = bool(use_reentrant)
        self.gradients = gradients
        self.objective = objective
        self._ends = ends
        self._plans: Dict[Tuple, SplitPlan] = {}
        # vissl's plan needs no measurement; cost-aware ones start from the cuts after the features
        self._fixed_plan = vissl_plan(self._blocks(), list(ends), 1 if self._cost_aware else (num_splits or 1))
        self._plan: SplitPlan = self._fixed_plan
        self._compile_options: Optional[dict] = None  # see compile()
        self._eager_groups: Dict[Tuple, FrozenSet[Tuple[int, ...]]] = {}  # plan key -> compiled groups (ids) run eagerly: see compile()
        self._eagerly: FrozenSet[Tuple[int, ...]] = frozenset()  # those of the last training forward

    def _blocks(self) -> FeatureBlocks:
        return FeatureBlocks([(k, self._modules[_child_name(k)]) for k in self._keys], stages=self._stages & set(self._keys))

    def model_state_dict(self, model: Optional[nn.Module] = None) -> "OrderedDict[str, torch.Tensor]":
        """The trunk's weights and buffers under the names of the model it was built from.

        ``state_dict()`` keys are feature-block names (``res2.0.conv1.weight``); this
        gives the torchvision names (``layer1.0.conv1.weight``). The trunk does not
        hold the classifier; pass a model of the same architecture to fill in its
        other entries from it, so that ``model.load_state_dict(trunk.model_state_dict(model))``
        loads strictly. A trunk built from an ordered dict of blocks has no source
        names and raises ``ValueError``.
        """
        if not self._model_keys:
            raise ValueError("this trunk was built from feature blocks, not a model: there are no model names to map to")
        mine = self.state_dict()
        out = OrderedDict((self._model_keys[k], v) for k, v in mine.items() if k in self._model_keys)
        if model is not None:
            theirs = model.state_dict()
            extra = sorted(set(out) - set(theirs))
            if extra:
                raise ValueError(f"the model has no entries {extra[:5]}{' ...' if len(extra) > 5 else ''}: it is not the trunk's architecture")
            out = OrderedDict((k, out.get(k, v)) for k, v in theirs.items())
        return out

    @property
    def _cost_aware(self) -> bool:
        return self.strategy != "vissl" or self.memory_budget is not None

    @property
    def plan(self) -> SplitPlan:
        """The plan of the last training forward (a cost-aware trunk: only the feature cuts before one)."""
        return self._plan

    @torch.compiler.disable  # planning runs eagerly: it measures tensors, which dynamo cannot trace
    def plan_for(self, x: torch.Tensor) -> SplitPlan:
        """The plan used for an input like ``x``.

        Cost-aware plans are measured once per input shape, dtype, device and autocast
        dtype, and cached. Call it with a sample batch to plan up front (before wrapping
        in DDP, say); otherwise the first training forward does. Under ``torch.compile`` it
        runs eagerly (a graph break), so a compiled trunk plans as an eager one does. After
        :meth:`compile` it also times the units here, once per input key, vissl's plan too."""
        if not self._cost_aware and self._compile_options is None:
            return self._fixed_plan
        key = self._plan_key(x)
        if key not in self._plans:
            plan = _agreed(plan_trunk(self, x), sharded=isinstance(self, FSDPModule)) if self._cost_aware else self._fixed_plan
            if self._compile_options is not None:
                self._eager_groups[key] = self._faster_eagerly(plan, x)
            self._plans[key] = plan
        return self._plans[key]

    @staticmethod
    def _plan_key(x) -> Tuple:
        """What a cost-aware plan depends on besides the trunk: the shape and dtype of each tensor
        in the input (a tensor, or a list, tuple or dict of them), its device and autocast."""
        tensors = list(tensors_in(x))
        if not tensors:
            raise TypeError(f"a cost-aware plan measures the trunk on its input, and this {type(x).__name__} holds no tensor")
        return plan_key([(tuple(t.shape), t.dtype) for t in tensors], tensors[0].device)

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        checkpointing = self.training and torch.is_grad_enabled()
        units = [m for _, m in expand_units(self._blocks())]
        plan = self._fixed_plan
        if checkpointing:
            plan = self._plan = self.plan_for(x)
            self._eagerly = self._eager_groups.get(self._plan_key(x), frozenset()) if self._compile_options is not None else frozenset()
        stops = {stop: name for name, stop in self._ends.items()}
        features = {}
        for seg in plan.segments:
            layers = units[seg.start : seg.stop]
            # nested checkpoints (training only: in eval nothing is checkpointed)
            regions = tuple((r - seg.start, s - seg.start, p) for r, s, p in seg.regions) if checkpointing else ()
            # A cut forced after a requested feature may fall before an in-place op (bn1 then
            # ReLU(inplace=True)). Running it on a copy keeps the feature as its block left it
            # and, inside a checkpoint, keeps the checkpoint's input intact for the recompute.
            copy_input = seg.start > 0 and not layer_splittable_before(layers[0])
            checkpointed = checkpointing and seg.checkpointed
            run = self._body((seg.start, seg.stop, regions, copy_input, checkpointed))
            if checkpointed:
                x = _run_segment(run, layers, x, self.use_reentrant)
            else:
                x = run(x, *layers)
            if seg.stop in stops:
                features[stops[seg.stop]] = x
        return [features[k] for k in self.out_feat_keys]

    def compile(self, **options) -> None:
        """Compile the trunk for speed and keep its plan's memory: each unit is compiled with
        ``torch.compile(**options)`` (inductor by default) on its own (a weightless one with a unit
        beside it) and runs so inside torch's own eager checkpoints, which keep only their inputs
        as planned; each selective region of the last segment is compiled whole as torch's
        checkpoint operator under its policy, so that the cheap ops it runs again fuse into its
        backward's kernels. A ``"recompute"`` region is an eager checkpoint around compiled units,
        as a segment is; ``"recompute_stages"`` runs eagerly. The next training forward plans
        again (plans made before are dropped: a compiled region's backward returns its weights'
        gradients together), on CPU from the allocator's figures, which are what a compiled step's
        memory is measured by, and with inductor times each unit's step compiled and eagerly, and
        runs eagerly those faster so (on CPU, inductor's batch-norm kernels make most ResNet-50
        bottlenecks slower compiled alone: tools/unit_compile_times.py).

        With inductor and no ``mode`` nor ``layout_optimization`` option, inductor's layout
        optimisation is done once, ahead of time: the trunk's convolution weights are stored
        channels-last (``self.to(memory_format=torch.channels_last)``, the model's own parameters,
        in place) and ``options={"layout_optimization": False}`` is passed. Inductor's own saves
        a channels-last copy of every convolution weight for backward, which no plan holds
        (compiled plain ResNet-50: 1.17 of the eager step's memory). ``dynamic=False`` unless
        given: dynamo learns dynamic sizes per function name, which all units share (MaxViT's
        symbolic window reshapes never finished compiling). Unlike ``nn.Module.compile``, the
        trunk's forward stays Python; under ``torch.compile(trunk)`` dynamo traces the forward
        and the checkpointed segments and regions run eagerly at graph breaks.

        Exact as eager checkpoints are, within float tolerance of the compiled plain model:
        BatchNorm statistics move once (a recompute compiles once more, with momentum 0; a
        compiled region's recompute never writes them), and a recompute draws the random masks
        its forward drew (the RNG state is restored before an eager recompute; a compiled
        region saves a random op's output). Measured: docs/benchmarks.md#torchcompile."""
        if options.get("backend", "inductor") == "inductor" and "mode" not in options and "layout_optimization" not in options.get("options", {}):
            options["options"] = {"layout_optimization": False, **options.get("options", {})}
            self.to(memory_format=torch.channels_last)
        self._compile_options = {"dynamic": False, **options}
        self._plans.clear()
        self._eager_groups.clear()
        self._plan = self._fixed_plan

    def _body(self, key: Tuple) -> Callable:
        """What runs the units of a segment ``key = (start, stop, regions, copy_input, checkpointed)``:
        compiled as :meth:`compile` says after it (but under an outer ``torch.compile``, which traces it)."""
        _, _, regions, copy_input, checkpointed = key
        if torch.compiler.is_compiling():
            # a budget's promise with gradients kept: see run_units_apart
            apart = self.memory_budget is not None and self.gradients == "kept" and not checkpointed and self.training and torch.is_grad_enabled()
            return functools.partial(_run_layers, copy_input, regions, checkpointed, plain=run_units_apart if apart else run_plain)
        if self._compile_options is None:
            return functools.partial(_run_layers, copy_input, regions, checkpointed)
        return functools.partial(_run_layers, copy_input, regions, checkpointed, plain=self._compiled_units, region=self._compiled_region)

    def _compiled_units(self, x, *layers: nn.Module):
        """``layers`` run in order, one compiled graph per unit with weights (and the weightless
        units beside it: see :func:`weight_groups`): a graph's backward returns the gradients of all
        its weights together, so one such unit per graph holds no more of them at once than eager
        autograd does (a unit's own, briefly)."""
        for group in weight_groups(layers):
            ids = tuple(map(id, group))
            x = run_plain(x, *group) if ids in self._eagerly else self._compiled_group(group)(x, *group)
        return x

    def _compiled_group(self, group: Sequence[nn.Module]) -> Callable:
        return compiled_once(self, ("units", tuple(map(id, group))), run_plain, self._compile_options)

    def _faster_eagerly(self, plan: SplitPlan, x) -> FrozenSet[Tuple[int, ...]]:
        """The unit groups that ``plan`` runs compiled one by one (see :meth:`_compiled_units`) and
        that step faster eagerly, measured on ``x``: they run eagerly (ids of their units). Inductor
        only: another backend (``"aot_eager"``, a custom one) is there to be run as given."""
        if self._compile_options.get("backend", "inductor") != "inductor":
            return frozenset()
        units = [m for _, m in expand_units(self._blocks())]
        groups = []
        for seg in plan.segments:
            for a, b, policy in runs(len(seg), [(r - seg.start, s - seg.start, p) for r, s, p in seg.regions]):
                if policy is None or (nested_policy(policy) if seg.checkpointed else policy) == "recompute":
                    first = seg.start + a
                    groups += [(first + i, first + j) for i, j in weight_group_bounds(units[first : seg.start + b])]
        slower = _agreed(faster_eagerly(units, x, groups, lambda a, b: self._compiled_group(units[a:b])), isinstance(self, FSDPModule))
        return frozenset(tuple(map(id, units[a:b])) for a, b in slower)

    def _compiled_region(self, layers: Sequence[nn.Module], x, policy: str):
        """A region: a ``"recompute"`` one (and a selective one nested in a checkpointed segment,
        which runs so) as torch's eager checkpoint around compiled units, as a segment runs, for a
        compiled ``"recompute"`` region would leave what it saves to AOT autograd's partitioner; a
        selective one of the last segment compiled whole, as torch's checkpoint operator under its
        policy; ``"recompute_stages"`` eagerly, for it rebuilds its stages op by op. Under dynamo's
        ``"eager"`` backend, which runs a graph without AOT autograd, nothing would keep a compiled
        region's recompute from moving BatchNorm's statistics again: selective regions run eagerly there."""
        if policy == "recompute":
            return run_region(layers, x, policy, run=self._compiled_units)
        if policy not in SELECTIVE_KEEPS or self._compile_options.get("backend") == "eager":
            return _run_region(layers, x, policy)
        return compiled_once(self, ("region", tuple(map(id, layers)), policy), run_region_dense, self._compile_options)(tuple(layers), x, policy)

    def extra_repr(self) -> str:
        return f"out_feat_keys={self.out_feat_keys}, strategy={self.strategy!r}, num_splits={self.num_splits}, use_reentrant={self.use_reentrant}, gradients={self.gradients!r}"


def _agreed(plan, sharded: bool):
    """Under FSDP every rank runs rank 0's plan (and its choice of units run eagerly: timings differ
    between ranks): a unit's recompute all-gathers its weights, so ranks whose plans differ would
    all-gather a different number of times and hang. (Profiling a sharded trunk is exact tensor
    accounting on CPU, but a CUDA allocator's figures may differ.)"""
    if not sharded or not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def plan_key(shapes: Sequence[Tuple[Tuple[int, ...], torch.dtype]], device: torch.device) -> Tuple:
    """The key of a cost-aware plan for inputs of these (shape, dtype) on ``device``, in the
    current autocast state: what :meth:`CheckpointedTrunk.plan_for` caches a plan under. It
    needs no tensor, so a plan for a batch too big to allocate can be stored (``fit``)."""
    device = torch.device(device).type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return (tuple((tuple(s), d) for s, d in shapes), device, autocast)


def _child_name(key: str) -> str:
    """A block's module name: traced blocks are named ``layer3.1``, and module names cannot hold dots."""
    return key.replace(".", "_")


def _run_layers(copy_input: bool, regions: Sequence[Tuple[int, int, str]], in_checkpoint: bool, x: torch.Tensor, *layers: nn.Module,
                plain: Callable = run_plain, region: Callable = _run_region) -> torch.Tensor:
    """Run ``layers`` in order; each region ``(start, stop, policy)`` of them as one nested
    checkpoint (``region(layers, x, policy)``), the units between them as ``plain(x, *layers)``.

    ``in_checkpoint``: this runs as a checkpointed segment's function, where a selective
    region runs as ``"recompute"`` (see :func:`trunksplit.recompute.regions.nested_policy`), in the
    first forward and in the recompute alike."""
    if copy_input:
        x = map_tensors(torch.clone, x)
    for start, stop, policy in runs(len(layers), regions):
        if policy is not None:
            x = region(layers[start:stop], x, nested_policy(policy) if in_checkpoint else policy)
        else:  # the units up to the next region: one graph under torch.compile(trunk), not one per unit
            x = plain(x, *layers[start:stop])
    return x


def _key_map(trunk: nn.Module, model: nn.Module) -> Dict[str, str]:
    """Trunk state_dict key -> model state_dict key, matched by tensor identity."""
    names = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), name)
    tensors = dict(trunk.named_parameters(remove_duplicate=False))
    tensors.update(trunk.named_buffers(remove_duplicate=False))
    return {k: names[id(t)] for k, t in tensors.items() if id(t) in names}


def _check_budget(budget):
    if budget is None or budget == 0:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget must be bytes (int) or a fraction (float), got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"a fractional memory_budget must be in (0, 1], got {budget}")
    if budget < 0:
        raise ValueError(f"memory_budget must be positive, got {budget}")
    return budget
