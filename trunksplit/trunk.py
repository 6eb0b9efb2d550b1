"""`CheckpointedTrunk`: run a trunk as a plan of checkpoint segments."""
import functools
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .chains.names import from_source_names, source_names, to_source_names
from .chains import FeatureBlocks, child_name, expand_units, feature_blocks, feature_ends, layer_splittable_before, stage_names, warn_of_hooks_bypassed
from .planning.budget import MemoryBudget
from .planning.memory import tensors_in
from .planning.plan import SplitPlan, check_plan, plain_where_frozen
from .planning.request import STRATEGIES, UPDATE_TEMPORARIES, PlanRequest, frozen_parameters, plan_key, planned_temporaries, updates_held, warn_of_many_plans
from .planning.search import plan_trunk
from .planning.sharding import sharded_world_size
from .planning.timing import run_eagerly
from .planning.unit_copies import units_without_gradient
from .planning.vissl import vissl_plan
from .recompute.compiled import CompiledUnits, default_compile_options, eager_region, eager_segment, run_plain, run_units_apart
from .recompute.regions import run_units

__all__ = ["CheckpointedTrunk", "STRATEGIES", "plan_key"]


class CheckpointedTrunk(nn.Module):
    """A trunk that trains with checkpointed segments and returns the requested features.

    Args:
        trunk: a model (any torchvision classification family, transformers' ViT,
            DeiT, DINOv2, ConvNeXt or ResNet (``chains/hugging_face.py``), a registered family, or any model
            ``torch.fx`` can trace), or an ordered dict of feature blocks in execution order.
        out_feat_keys: feature blocks to return, in this order, from ``forward``;
            None: the last one (``flatten`` for torchvision families, ``output`` for
            a traced model).
        num_splits: how many checkpoint segments to make (vissl's
            ``NUM_ACTIVATION_CHECKPOINTING_SPLITS``); ``None`` cuts only after
            the requested features. A count that cannot be reached warns.
        strategy: ``"vissl"`` cuts as vissl did (by module count);
            ``"balanced"`` places the cuts from measured per-layer memory.
        memory_budget: a fraction in (0, 1] of the unsplit step's peak, bytes, or a size
            (``"2GiB"``; read by :class:`trunksplit.planning.budget.MemoryBudget`, 0 is none):
            the plan with the least recompute whose predicted peak fits. Non-reentrant
            trunks may also run regions of units under a nested checkpoint that keeps less
            (``plan.regions``; the policies: :mod:`trunksplit.recompute.regions`).
        use_reentrant: torch's reentrant checkpoint (vissl's, for manual DDP), or not: the plain step bit for bit (reentrant sums a cut feature's gradients in another order).
        gradients: how the training loop clears gradients, which cost-aware plans
            must know: ``"allocated"`` (torch's default ``zero_grad()`` sets them to
            None, so every step allocates them during backward) or ``"kept"``
            (``zero_grad(set_to_none=False)``: they stay allocated between steps) or
            ``"in_backward"`` (:func:`trunksplit.optimizer_in_backward` updates each parameter
            and frees its gradient as soon as it is whole; a call whose updates are held,
            ``accumulating()``, keeps its gradients and is planned as ``"allocated"``). Budgets
            and fractions are of what the step allocates beyond what was live before it, in that mode.
        objective: what cost-aware plans minimise among those that fit: ``"time"``, recompute
            in seconds timed while profiling (machine-dependent), ``"flops"``, FLOPs run again,
            then cheap bytes (the same plan everywhere); ``"auto"``: time for inputs on a GPU
            (a small op costs its launch there), FLOPs on a CPU (see ``request.priced_in``).

    Exact: a training step gives the plain model's outputs, every parameter's
    gradient and BatchNorm buffers, and so does a second backward of one forward (a gradient
    penalty, ``retain_graph=True``), selective regions included (docs/regions.md).
    The last segment is never checkpointed, and in eval mode, under ``no_grad`` or on meta
    tensors nothing is. The trunk holds only the blocks up to the last requested feature (a
    classifier head is not among its parameters, so plain ``DDP(trunk)`` needs no ``find_unused_parameters``). Its ``state_dict``
    keys are the feature block names (``res2.0.conv1.weight``) and do not depend
    on the plan.

    Under ``torch.compile(trunk)`` planning and checkpoints run eagerly (graph breaks), keeping the plan's
    memory; :meth:`compile` compiles each unit inside them too (docs/benchmarks.md#torchcompile).
    """

    def __init__(
        self,
        trunk: Union[nn.Module, Mapping[str, nn.Module]],
        out_feat_keys: Optional[Sequence[str]] = None,
        num_splits: Optional[int] = None,
        strategy: str = "vissl",
        memory_budget: Union[None, int, float, str, MemoryBudget] = None,
        use_reentrant: bool = False,
        gradients: str = "allocated",
        objective: str = "auto",
    ):
        super().__init__()
        source = None if isinstance(trunk, Mapping) else trunk
        blocks = trunk if isinstance(trunk, Mapping) else feature_blocks(trunk)
        if out_feat_keys is None:
            out_feat_keys = [next(reversed(blocks))] if len(blocks) else []
        ends = feature_ends(blocks, out_feat_keys)  # validates the keys
        last = list(blocks).index(next(reversed(ends)))
        self._stages = stage_names(blocks)
        self._keys = list(blocks)[: last + 1]
        children = {child_name(k) for k in self._keys}
        if len(children) != len(self._keys):
            raise ValueError(f"feature block names {self._keys} collide once '.' is written '_' (module names cannot hold dots)")
        self.out_feat_keys, self.num_splits, self.strategy = tuple(out_feat_keys), num_splits, strategy
        self.memory_budget: Optional[MemoryBudget] = MemoryBudget.parse(memory_budget)
        self.use_reentrant = bool(use_reentrant)
        self.gradients, self.objective, self._ends = gradients, objective, ends
        self._update_temporaries = UPDATE_TEMPORARIES  # in_backward: see update_temporaries
        PlanRequest(units=(), feature_stops=tuple(ends.items()), num_splits=num_splits, strategy=strategy, budget=self.memory_budget,
                    gradients=gradients, objective=objective, use_reentrant=use_reentrant, compiled=False, world_size=1, update_temporaries=UPDATE_TEMPORARIES)  # validates, before any change
        for name in self._keys:
            self.add_module(child_name(name), blocks[name])
        # trunk state_dict key -> the source model's, for model_state_dict(); names only, no reference
        self._model_keys = source_names(self, source) if source is not None else {}
        warn_of_hooks_bypassed(source, [m for _, m in self.units])  # a hook on a stage or on the model would silently never fire
        self.register_load_state_dict_pre_hook(_load_model_names)
        self._plans: Dict[Hashable, SplitPlan] = {}
        # vissl's plan needs no measurement; cost-aware ones start from the cuts after the features
        self._fixed_plan = vissl_plan(self.feature_blocks, list(ends), 1 if self.cost_aware else (num_splits or 1))
        self._plan: SplitPlan = self._fixed_plan
        self._compiled: Optional[CompiledUnits] = None  # see compile()
        self.agreement: Callable = _alone  # what every rank runs of what one decided: set by shard_trunk and the launcher

    @property
    def feature_blocks(self) -> FeatureBlocks:
        """The feature blocks the trunk runs (the model's own modules), in execution order."""
        return FeatureBlocks([(k, self._modules[child_name(k)]) for k in self._keys], stages=self._stages & set(self._keys))

    @property
    def units(self) -> List[Tuple[str, nn.Module]]:
        """The chain of units a plan cuts: the blocks, with the stages expanded into their blocks."""
        return expand_units(self.feature_blocks)

    @property
    def cost_aware(self) -> bool:
        """Planned from measurements at the first training forward (balanced, or a budget), not by module count."""
        return self.strategy != "vissl" or self.memory_budget is not None

    def plan_request(self, held: Optional[bool] = None) -> PlanRequest:
        """What the planner is asked for a call made now, or one whose updates are ``held`` or not (:meth:`updates_held`)."""
        units = tuple(self.units)
        held = self.updates_held() if held is None else held and self.gradients == "in_backward"
        return PlanRequest(units=units, feature_stops=tuple(self._ends.items()), num_splits=self.num_splits, strategy=self.strategy,
                           budget=self.memory_budget, gradients="allocated" if held else self.gradients, objective=self.objective,
                           use_reentrant=self.use_reentrant, compiled=self._compiled is not None, world_size=sharded_world_size([m for _, m in units]),
                           update_temporaries=planned_temporaries(self.parameters(), self._update_temporaries))  # its optimizer's, where one steps in backward

    def model_state_dict(self, model: Optional[nn.Module] = None, state: Optional[Mapping] = None) -> "OrderedDict[str, torch.Tensor]":
        """The trunk's weights and buffers (or ``state``, a trunk's of the same blocks: an EMA teacher's, an
        FSDP2 trunk's gathered whole) under the names of the model it was built from (``layer1.0.conv1.weight``,
        not ``res2.0.conv1.weight``); with ``model`` (the same architecture) its other entries too (the classifier),
        so that it loads strictly. The other way needs nothing: ``trunk.load_state_dict`` takes the model's names
        as well as its own. A trunk built from an ordered dict of blocks has no model names: ``ValueError``."""
        if not self._model_keys:
            raise ValueError("this trunk was built from feature blocks, not a model: there are no model names to map to")
        return to_source_names(self.state_dict() if state is None else state, self._model_keys, model)

    @property
    def plan(self) -> SplitPlan:
        """The plan last made or run (:meth:`plan_for`, a training forward); "not planned yet" before."""
        if self._plan is self._fixed_plan and self.cost_aware:
            kind = "budget" if self.memory_budget is not None else "balanced"
            return replace(self._plan, strategy=kind, note=f"not planned yet: the first training forward measures the {kind} plan, or plan_for(x) for inputs like x")
        if self._plan is self._fixed_plan:  # vissl's, as it runs on images
            return plain_where_frozen(self._plan, units_without_gradient([m for _, m in self.units]))
        return self._plan

    @property
    def plans(self) -> Mapping[Hashable, SplitPlan]:  # a copy: add one with store_plan
        """The plans made so far, by :func:`plan_key`."""
        return dict(self._plans)

    def store_plan(self, key: Hashable, plan: SplitPlan) -> None:
        """Run ``plan`` (made elsewhere: ``fit`` plans batches it never allocates) for inputs of ``key`` (:func:`plan_key`, or :meth:`key_for`
        of a sample) instead of planning, on a trunk that plans by input (:attr:`cost_aware`); one not cut as the planner cuts is refused (:func:`check_plan`)."""
        if not self.cost_aware and self._compiled is None:  # it would never be run: vissl's plan runs on every input
            raise ValueError("this trunk runs vissl's fixed plan on every input, never a stored one: build it with strategy=\"balanced\" or a memory_budget")
        request = self.plan_request()
        check_plan(plan, request.names, request.splittable, request.forced)
        self._plans[key] = plan

    @torch.compiler.disable  # planning runs eagerly: it measures tensors, which dynamo cannot trace
    def plan_for(self, x: torch.Tensor) -> SplitPlan:
        """The plan used for an input like ``x``.

        Cost-aware plans are measured once per input shape, dtype, device and autocast
        dtype, apart for calls whose updates in backward are held (:meth:`key_for`), and
        cached. Call it with a sample batch to plan up front (before wrapping in DDP, say;
        inside ``accumulating()`` for a held call); otherwise the first training forward does. Under
        ``torch.compile`` it runs eagerly (a graph break), so a compiled trunk plans as an
        eager one does. After :meth:`compile` it also times the units here, once per input
        key, vissl's plan too. Under several processes every rank runs what
        ``self.agreement`` returns of its plan (rank 0's, under :func:`trunksplit.shard_trunk`)."""
        if not self.cost_aware and self._compiled is None:
            return self._fixed_plan
        key = self.key_for(x)
        if key not in self._plans:
            held = self.updates_held()
            plan = self.agreement(plan_trunk(self.plan_request(held), x, held=held)) if self.cost_aware else plain_where_frozen(self._fixed_plan, units_without_gradient([m for _, m in self.units], x))
            if self._compiled is not None:
                self._compiled.eager[key] = run_eagerly(self._compiled, [m for _, m in self.units], plan.segments, x, self.agreement)
                plan = replace(plan, compiled=True)
            self._plans[key] = plan
            warn_of_many_plans(len(self._plans))
        self._plan = self._plans[key]  # what print(trunk.plan) shows, planned up front or not
        return self._plan

    def key_for(self, x) -> Tuple:
        """What a cost-aware plan depends on besides the trunk: the shape and dtype of each tensor in the input (a
        tensor, or a list, tuple or dict of them), its device, autocast, whether the call's updates in backward are
        held (:meth:`updates_held`), which parameters are frozen, and whether the input requires grad."""
        tensors = list(tensors_in(x))
        if not tensors:
            raise TypeError(f"a cost-aware plan measures the trunk on its input, and this {type(x).__name__} holds no tensor")
        return plan_key([(tuple(t.shape), t.dtype) for t in tensors], tensors[0].device, self.updates_held(), frozen_parameters(self.parameters()), any(t.requires_grad for t in tensors))

    def updates_held(self) -> bool:
        """Stepped in backward, whether updates are held now (``accumulating()``, ``holding_updates``): a call's
        backward then keeps every gradient, so it is planned (as ``"allocated"``) and keyed apart."""
        return self.gradients == "in_backward" and updates_held(self.parameters())

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        # a meta tensor holds no memory (shape inference, a FLOP count): nothing to plan or to save
        checkpointing = self.training and torch.is_grad_enabled() and not any(t.is_meta for t in tensors_in(x))
        units, plan = [m for _, m in self.units], (self.plan_for(x) if checkpointing else self._fixed_plan)
        if checkpointing and self._compiled is not None:
            self._compiled.select(self.key_for(x))
        stops, features = {stop: name for name, stop in self._ends.items()}, {}
        kept_budget = self.memory_budget is not None and self.gradients != "allocated" and self.training and torch.is_grad_enabled()
        for seg in plan.segments:
            layers = units[seg.start : seg.stop]
            # nested checkpoints (training only: in eval nothing is checkpointed)
            regions = tuple((r - seg.start, s - seg.start, p) for r, s, p in seg.regions) if checkpointing else ()
            # a cut forced after a requested feature may fall before an in-place op: see run_units
            copy_input = seg.start > 0 and not layer_splittable_before(layers[0])
            checkpointed = checkpointing and seg.checkpointed
            run = _segment_body(self._compiled, regions, copy_input, checkpointed, apart=kept_budget and not checkpointed)
            x = eager_segment(run, layers, x, self.use_reentrant) if checkpointed else run(x, *layers)
            if seg.stop in stops:
                features[stops[seg.stop]] = x
        return [features[k] for k in self.out_feat_keys]

    def compile(self, **options) -> None:
        """Compile the trunk for speed and keep its plan's memory: each unit is compiled with
        ``torch.compile(**options)`` (inductor by default) and runs inside torch's own eager
        checkpoints, which keep only their inputs as planned; the last segment's selective regions
        compile whole, their cheap recompute fused into their backward (see
        :class:`trunksplit.recompute.compiled.CompiledUnits`). The next training forward plans
        again (on CPU from the allocator's figures, which measure a compiled step) and, with
        inductor, runs eagerly the units measured faster so.

        Sharp edges (why: ``default_compile_options``): with inductor and no ``mode`` nor
        ``layout_optimization`` option, the convolution weights are stored channels-last, in place;
        ``dynamic=False`` unless given. Unlike ``nn.Module.compile``, the forward stays Python.

        Exact as eager checkpoints are, within float tolerance of the compiled plain model:
        BatchNorm statistics move once, and a recompute draws its forward's random masks."""
        options, channels_last = default_compile_options(options)
        if channels_last and sharded_world_size([m for _, m in self.units]) == 1:  # FSDP2 shards contiguous weights only
            self.to(memory_format=torch.channels_last)
        self._compiled = CompiledUnits(options)
        self._plans.clear()
        self._plan = self._fixed_plan

    @property
    def update_temporaries(self) -> float:
        """In backward: tensors of a parameter's size an update allocates (:func:`trunksplit.optimizer_in_backward` measures it); a change replans."""
        return self._update_temporaries

    @update_temporaries.setter
    def update_temporaries(self, value: float) -> None:
        replace(self.plan_request(), update_temporaries=value)  # validates, before any change
        if value != self._update_temporaries:  # the same (a copy's optimizer) keeps the plans
            self._update_temporaries, self._plans, self._plan = value, {}, self._fixed_plan

    @property
    def compile_options(self) -> Optional[dict]:
        """What :meth:`compile` compiles units with; None while the trunk runs eagerly."""
        return None if self._compiled is None else dict(self._compiled.options)

    def extra_repr(self) -> str:
        budget = f", memory_budget={self.memory_budget}" if self.memory_budget is not None else ""
        return f"out_feat_keys={self.out_feat_keys}, strategy={self.strategy!r}, num_splits={self.num_splits}{budget}, use_reentrant={self.use_reentrant}, gradients={self.gradients!r}"


def _segment_body(compiled: Optional[CompiledUnits], regions, copy_input: bool, checkpointed: bool, apart: bool) -> Callable:
    """What runs the units of one segment: compiled as ``CheckpointedTrunk.compile`` says after it (but under
    an outer ``torch.compile``, which traces it; ``apart``: a budget's promise with gradients kept, see run_units_apart)."""
    body = functools.partial(run_units, copy_input, regions, checkpointed)
    if torch.compiler.is_compiling():
        return functools.partial(body, plain=run_units_apart if apart else run_plain, region=eager_region)
    if compiled is None:
        return functools.partial(body, region=eager_region)
    return functools.partial(body, plain=compiled.units, region=compiled.region)


def _alone(decision):
    """A decision as this process made it: what one process, or ranks that may differ, run."""
    return decision



def _load_model_names(trunk: "CheckpointedTrunk", state_dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: the source model's names load as the trunk's (see trunksplit.chains.names)."""
    from_source_names(state_dict, prefix, trunk._model_keys)
