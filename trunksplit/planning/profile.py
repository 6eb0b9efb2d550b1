"""Profiling: what each unit of a chain costs (``UnitCosts``), measured on private copies.

The peak model (:mod:`trunksplit.planning.peak`) plans from these figures; the tracker that counts the bytes is
:class:`trunksplit.planning.memory.PeakMemory`'s."""
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..chains.blocks import layer_splittable_before
from ..recompute.checkpoint import map_tensors
from ..recompute.policies import POLICIES, SAVE_EXPENSIVE, SAVE_HEAVY
from .memory import _TensorAccounting, measuring_alone, storage_bytes, tensors_in
from .param_bytes import largest_param_bytes, unit_param_bytes
from .same_units import measured_once, measurement_key
from .timing import checkpoint_seconds, forward_seconds, rerun_seconds, time_span
from .unit_copies import first_input_with_gradient, private_copy
from .unit_measure import feature_figures, measure_again_where_gradients_arrive_otherwise, measure_under, measure_unit


@dataclass(frozen=True, kw_only=True)
class UnitCosts:
    """Measured costs of each unit of a chain, for one input shape.

    All byte counts are exact tensor-storage bytes (see :class:`PeakMemory`'s tracker), but
    where profiled with ``allocator=True`` (see :func:`profile_units`) the transient peaks
    (``forward_peak``, ``backward_excess``, ``backward_fresh``) are the allocator's:

    - ``output``: the storage the unit's output holds in the chain: a view (a ResNet's ``flatten``,
      a registered unit's ``x[:, 0]``) holds its whole base, and so does a checkpoint or a caller keeping it.
    - ``saved``: what the unit's own forward creates and keeps for backward
      (its output too, when backward needs it, as ReLU's does).
    - ``saves_input``: whether the unit keeps its input for backward.
    - ``input_from``: the unit that allocated the storage of this unit's input
      (-1: the chain's input). In-place units pass their input's storage on, so
      two units may keep the same storage; the peak model counts it once.
      ``output_from``: the same for each unit's output (a view, a ResNet's ``flatten``, passes its input's storage
      on: the caller holding it and the feature before holds one storage). Empty (costs made by hand): each unit's own.
    - ``keeps_output``: whether the unit's own backward needs its output.
    - ``beside_waiting``: for each unit whose input is a requested feature (``profile_units``' ``features``), how much
      higher its backward peaks beside the loss's gradient of that feature, waiting from the start of backward;
      ``beside_held_output``: for each unit but the last whose output is one and which saves it, how much higher where
      the caller holds that output (:func:`trunksplit.planning.unit_measure.feature_figures`); 0 for the others. Empty
      (costs made by hand): none.
    - ``starts_in_place``: whether the unit's first op is in place (:func:`trunksplit.layer_splittable_before`): a
      segment starting there (a cut forced after a feature, ``bn1`` before ``ReLU(inplace=True)``) runs on a copy
      of its input (``run_units``' ``copy_input``), a storage of its own. Empty: none.
    - ``forward_peak``: peak of the unit's forward, beyond its input; ``rerun_peak``: up to its last save (where
      a recompute stops); ``first_peak``: saving nothing (a checkpointed segment's first forward).
    - ``rerun_gradient``: the gradient bytes held while a checkpointed segment ending at the unit recomputes:
      torch recomputes at the first saved tensor backward needs, so the unit's backward ops before it have
      run; the gradient arriving at its output, and what those ops made of it (a ``reshape`` copying a
      gradient made non-contiguous by a window's ``permute``). Empty, or 0 for a unit that saves nothing:
      its output's bytes.
    - ``backward_excess``: peak of the unit's backward above what its forward
      left alive: the gradient arriving at its output (until backward frees it),
      gradient buffers of activations and transient weight gradients (weights
      already holding a ``.grad``, as from the second step on).
    - ``backward_fresh``: the same peak when the unit's parameters hold no gradient yet, so
      that each gradient its backward makes stays (as under FSDP2, whose gathered weights
      start every backward without one): ``backward_excess`` less the transient weight
      gradients, plus the unit's gradients as they appear, in the order backward makes them (the
      allocator's figure also holds a CPU convolution's weight-gradient scratch beside each).
      ``fresh_while_input_held`` and ``released_fresh``: the same peak split where the unit's backward
      has let go of all it saved, its input included (the node of its last save has run), before and
      after; the peak model adds the input beside the second only where something else holds it (a
      checkpoint holds its input until the last save of its segment goes). A block whose branches' input
      gradients are summed after the last convolution let the input go (FastViT's, Inception's) peaks
      at that sum, with the input gone; so does a weight gradient copied into its weight's layout
      (``unit_measure._held_when_fresh``). ``fresh_from_unpack``: the first part from the unit's first
      unpack on, where a checkpoint whose segment it ends recomputes (the ops before run beside no
      recompute). ``excess_while_input_held``, ``excess_from_unpack`` and ``released_excess``: the same
      split of ``backward_excess``.
    - ``flops``: forward FLOPs (a multiply-add counts 2).
    - ``param_bytes``: the unit's trainable parameters (each counted once, at the
      last unit that uses it): what its gradients take once backward allocates them.
      ``fresh_gradient_surplus``: what they take beyond that, where a fresh gradient arrives as a view
      into a larger storage laid out as its parameter, which torch keeps whole (EVA's and BEiT's q and
      v biases, sliced from their fused qkv bias's gradient: see ``unit_measure._held_when_fresh``).
    - ``recompute_bytes``: bytes the unit's cheap ops (all but convolution, matmul,
      attention) write in a forward: what running them again costs, in traffic.
    - ``light_flops``: FLOPs of the unit's light expensive ops (see
      :func:`trunksplit.recompute.checkpoint.is_heavy`): what the ``"save_heavy"`` policy runs again.
    - ``forward_seconds``, ``rerun_seconds``, ``checkpoint_seconds``, for the ``"time"`` objective
      only (``profile_units(..., timed=True)``; :mod:`trunksplit.planning.timing`): the wall time of
      the unit's forward (with autograd, warm, the fastest of two or more runs); what the unit adds
      to a step in a checkpointed segment (its rerun and the checkpoint's hooks on what it saves, in
      both passes); and what one checkpoint costs beyond its units, once per checkpointed segment.
    - ``again_seconds``: under a region policy, what running a span so adds to its
      training step (forward and backward, against the units run plainly), at the
      span's first unit: the recompute, and the policy's own overhead (a selective
      checkpoint intercepts every op in both passes, which costs more than the cheap
      ops it reruns on small ones). ``nested_forward_seconds``: what a checkpointed segment's
      recompute adds where it runs a region nested in it (measured so: see
      :func:`~trunksplit.planning.timing.time_span`), at its first unit.
    - ``policies``: per region policy (see :func:`trunksplit.recompute.regions.run_region`),
      the chain with each measured span run as one region under it: only
      ``saved``, ``keeps_output``, ``forward_peak`` and ``backward_excess`` (the
      region's whole backward, its recompute included) differ (laid out per unit
      so that they add up over whole spans, see :func:`_span_costs`), units not
      measured so repeat the plain figures, and ``eligible`` says which units
      belong to a span that can run so.
    - ``update_moments``: for each parameter of the unit, at the moment its backward has made its
      gradient whole (when an optimizer stepped in backward updates it): (bytes alive beyond what the
      forward left, its new gradient already added into the kept one; the parameter's bytes; whether the
      unit has let go of all it saved by then, see ``released_fresh``). Stepped
      in backward, that gradient lives on through an update that makes ``k`` tensors of the
      parameter's size: the first plus ``1 + k`` times the second (``gradients="in_backward"``). A
      gradient laid out otherwise than its parameter adds the moment it is copied (see ``backward_fresh``), with 0.
    - ``largest_param``: bytes of each unit's largest trainable parameter (this rank's shard under
      FSDP2): what an optimizer stepped in backward updates at most at once (``gradients="in_backward"``).
    - ``gathered``: under FSDP2, the bytes of each unit's whole parameters, which a rank
      all-gathers to run it (see :mod:`trunksplit.planning.sharding`); empty unsharded.
    - ``reduce_scatter_copies``: under FSDP2, how many whole copies of a reduce-scatter's
      input the collective's backend makes while it runs (gloo clones it: 1; NCCL: 0).
    """

    names: Tuple[str, ...]
    output: Tuple[int, ...]
    saved: Tuple[int, ...]
    saves_input: Tuple[bool, ...]
    input_from: Tuple[int, ...]
    keeps_output: Tuple[bool, ...]
    forward_peak: Tuple[int, ...]
    backward_excess: Tuple[int, ...]
    flops: Tuple[int, ...]
    param_bytes: Tuple[int, ...]
    backward_fresh: Tuple[int, ...] = ()
    fresh_while_input_held: Tuple[int, ...] = ()
    fresh_from_unpack: Tuple[int, ...] = ()
    released_fresh: Tuple[int, ...] = ()
    excess_while_input_held: Tuple[int, ...] = ()
    excess_from_unpack: Tuple[int, ...] = ()
    released_excess: Tuple[int, ...] = ()
    fresh_gradient_surplus: Tuple[int, ...] = ()
    recompute_bytes: Tuple[int, ...] = ()
    light_flops: Tuple[int, ...] = ()
    forward_seconds: Tuple[float, ...] = ()
    rerun_seconds: Tuple[float, ...] = ()
    checkpoint_seconds: float = 0.0
    again_seconds: Tuple[float, ...] = ()
    nested_forward_seconds: Tuple[float, ...] = ()
    policies: Optional[Dict[str, "UnitCosts"]] = None
    eligible: Tuple[bool, ...] = ()  # costs under a region policy: the units that can run under it
    gathered: Tuple[int, ...] = ()  # FSDP2: each unit's whole parameters, all-gathered to run it
    largest_param: Tuple[int, ...] = ()
    update_moments: Tuple[Tuple[Tuple[int, int, bool], ...], ...] = ()
    rerun_peak: Tuple[int, ...] = ()  # either empty: forward_peak
    rerun_gradient: Tuple[int, ...] = ()  # empty: output
    first_peak: Tuple[int, ...] = ()
    starts_in_place: Tuple[bool, ...] = ()
    beside_waiting: Tuple[int, ...] = ()
    beside_held_output: Tuple[int, ...] = ()
    output_from: Tuple[int, ...] = ()
    reduce_scatter_copies: int = 0  # FSDP2: whole copies of a reduce-scatter's input its backend makes (gloo: 1)

    def __len__(self) -> int:
        return len(self.names)

    def under(self, policy: str) -> "UnitCosts":
        """The costs with each unit alone under the region ``policy``."""
        return self.policies[policy]


_MEASURED = ("output", "saved", "saves_input", "input_from", "keeps_output", "forward_peak", "rerun_peak", "rerun_gradient", "first_peak", "backward_excess",
             "backward_fresh", "fresh_while_input_held", "fresh_from_unpack", "released_fresh", "excess_while_input_held", "excess_from_unpack", "released_excess", "fresh_gradient_surplus", "flops", "recompute_bytes", "light_flops", "update_moments")


@measuring_alone()  # each rank profiles on its own (a timed unit runs until its time settles): no layer may communicate
def profile_units(units: Sequence[Tuple[str, nn.Module]], x: torch.Tensor, spans: Sequence[Tuple[int, int]] = (), timed: bool = False,
                  allocator: bool = False, progress: Optional[Callable[[str], None]] = None, use_reentrant: bool = False, features: Sequence[int] = ()) -> UnitCosts:
    """Measure every unit of a chain at the input it gets from ``x``.

    Each unit runs on a private copy (the model's parameters, gradients,
    BatchNorm statistics and RNG stay untouched, and neither users' module hooks
    nor those of wrappers such as DDP fire): one forward and one backward with
    weights that already hold gradients. Costs about one training step plus one
    forward of the chain, and one more step per region policy for the units in
    ``spans``: runs of units ``[start, stop)`` each also measured as one region under
    each policy (``UnitCosts.policies``). A span is measured whole because its units
    may not run alone under a checkpoint: the stem's ``ReLU(inplace=True)`` would
    overwrite the input its recompute needs.
    Measures with autograd on whatever the caller's mode: a plan made under
    ``no_grad`` or ``inference_mode`` is the training plan. ``timed``: also the wall
    times the ``"time"`` objective plans from (see :mod:`trunksplit.planning.timing`;
    about seven more steps, and two per region policy), cuts timed under checkpoints
    of the trunk's kind (``use_reentrant``).

    ``allocator``: measure the transient peaks (``forward_peak``, ``backward_excess`` and
    ``backward_fresh``, by a backward of its own with no gradients yet) as the allocator's
    requests (:func:`trunksplit.planning.memory.allocator_meter`), not as tensor storages: kernels'
    scratch counts (cuDNN's workspaces; oneDNN's reordered weights, im2col buffers: docs/distributed.md),
    and what backward frees of the forward's saved tensors counts against it. The figures a step
    measured by the allocator needs (CUDA; FSDP2 on CPU); about twice the profiling. ``progress(name)`` is called as each unit is done
    (a command line's progress bar: profiling a big trunk takes tens of seconds). ``features``: the units whose
    outputs are requested features, measured with the caller's hold on them where they save them, the units after
    them beside their waiting gradients (``UnitCosts.beside_waiting``, ``beside_held_output``).
    """
    fields = {k: [] for k in _MEASURED + ("input_gradient", "beside_waiting", "beside_held_output", "output_from") + (("forward_seconds", "rerun_seconds") if timed else ())}
    inputs = []  # the first unit's input, then each unit's as a meta tensor: see measure_again_where_gradients_arrive_otherwise
    span_stop = dict(spans)
    under_policy: Dict[str, Dict[Tuple[int, int], Optional[dict]]] = {p: {} for p in POLICIES}
    span, before = None, {}  # span: (start, its input, copies of its units so far, its input carries a gradient) inside one; before: see _unit_figures
    source = -1  # the unit that allocated the storage of the current activation
    carries = first_input_with_gradient([u for _, u in units], x)  # units before it get no gradient: frozen, on the images
    device = next(iter(tensors_in(x))).device
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        h = map_tensors(lambda t: t.detach().clone() if t.is_inference() else t.detach(), x)  # an inference tensor cannot enter autograd
        own = checkpoint_seconds(device, use_reentrant) if timed else 0.0
        for i, (_, unit) in enumerate(units):
            fields["input_from"].append(source)
            m = private_copy(unit, like=h)
            inputs.append(h if i == 0 or not isinstance(h, torch.Tensor) else torch.empty_like(h, device="meta"))
            if i in span_stop:
                span = (i, h, [], i >= carries)
            next_h, forward = _forward_figures(m, h)
            measured = {**_unit_figures(before, m, h, i >= carries, allocator), **forward}
            for key, value in {**measured, **feature_figures(m, h, i >= carries, i - 1 in features and i >= carries, i in features and i + 1 < len(units) and measured["keeps_output"])}.items():
                fields[key].append(value)
            if timed:
                for key, value in _unit_seconds(before, m, h, i >= carries, use_reentrant, own).items():
                    fields[key].append(value)
            if span is not None:
                span[2].append(m)
                if i + 1 == span_stop[span[0]]:
                    _measure_span(span, under_policy, allocator, fields if timed else None, before, sum(fields["light_flops"][span[0]:i + 1]) > 0)
                    span = None
            # a unit measured on a compact copy of a view returns a compact view: what the chain's holds is its base
            fields["output"][i] = max(fields["output"][i], storage_bytes(next_h))
            if not isinstance(next_h, torch.Tensor) or not isinstance(h, torch.Tensor) or next_h.untyped_storage().data_ptr() != h.untyped_storage().data_ptr():
                source = i  # a new activation; an in-place unit passes its input's storage on
            h = next_h
            fields["output_from"].append(source)
            if progress is not None:
                progress(units[i][0])
        measure_again_where_gradients_arrive_otherwise([u for _, u in units], inputs, fields, allocator, device, carries)
    del fields["input_gradient"]
    plain = {k: tuple(v) for k, v in fields.items()}
    costs = UnitCosts(names=tuple(n for n, _ in units), param_bytes=unit_param_bytes([u for _, u in units]), largest_param=largest_param_bytes([u for _, u in units]),
                      starts_in_place=tuple(not layer_splittable_before(u) for _, u in units), checkpoint_seconds=own, **plain)
    if not spans:
        return costs
    return replace(costs, policies={p: _span_costs(costs, measured) for p, measured in under_policy.items()})


def _forward_figures(m: nn.Module, h) -> Tuple[object, dict]:
    """``m(h)`` without autograd, and what it tells: ``flops``, ``recompute_bytes``, ``light_flops``, and
    ``first_peak`` (a forward that keeps nothing for backward: a checkpointed segment's first)."""
    tracker = _TensorAccounting()
    with torch.no_grad(), FlopCounterMode(display=False) as flops, tracker:
        out = m(h)
    return out, dict(flops=int(flops.get_total_flops()), recompute_bytes=tracker.cheap_bytes, first_peak=tracker.peak, light_flops=tracker.light_flops)


def _unit_figures(before: Dict[tuple, dict], m: nn.Module, h, input_needs_grad: bool, allocator: bool) -> dict:
    """:func:`measure_unit`'s figures of ``m`` on ``h``, or those of a unit alike measured ``before``."""
    key = None if allocator else measurement_key([m], h, input_needs_grad)
    return measured_once(before, key, lambda: measure_unit(m, h, input_needs_grad=input_needs_grad, allocator=allocator))


def _unit_seconds(before: Dict[tuple, dict], m: nn.Module, h, input_needs_grad: bool, use_reentrant: bool, own: float) -> dict:
    """``m``'s ``forward_seconds`` and ``rerun_seconds`` on ``h``, or those of a unit alike timed ``before``: wall
    times do not depend on what the allocator holds, so alike units share them on CUDA too (where the ``"time"``
    objective is the default: a ViT's twelve layers are timed once)."""
    def timed():
        forward = forward_seconds(m, h, input_needs_grad=input_needs_grad)
        return {"forward_seconds": forward, "rerun_seconds": rerun_seconds(m, h, input_needs_grad, use_reentrant, own, forward)}

    key = measurement_key([m], h, input_needs_grad)
    return measured_once(before, None if key is None else (key, "unit seconds"), timed)


def _measure_span(span: tuple, under_policy: Dict[str, dict], allocator: bool, timings: Optional[Dict[str, list]], before: Dict[tuple, dict],
                  light: bool) -> None:
    """Measure a span ``(start, its input, its units)`` under each region policy into
    ``under_policy`` (where a span alike was measured, ``before``, its figures), and where ``timings``
    (the units' ``forward_seconds`` and ``rerun_seconds`` so far) are given, time it (see
    :func:`~trunksplit.planning.timing.time_span`). ``light``: whether the span's forward runs a light
    expensive op (``UnitCosts.light_flops``); where none, ``"save_heavy"`` keeps what ``"save_expensive"``
    keeps, op for op, and gets its figures without running (a ResNet's basic block, but its first of a stage)."""
    start, span_input, members, input_needs_grad = span
    stop = start + len(members)
    alike = measurement_key(members, span_input, input_needs_grad)  # the span's, for every policy
    for policy, measured in under_policy.items():
        same = under_policy[SAVE_EXPENSIVE.name].get((start, stop)) if policy == SAVE_HEAVY.name and not light else None
        if same is not None:
            measured[(start, stop)] = dict(same)
            continue
        key = None if alike is None or allocator else (alike, policy)  # the allocator's figures depend on its cache
        measured[(start, stop)] = measured_once(before, key, lambda: measure_under(members, span_input, input_needs_grad, policy, allocator))
    if timings is not None:  # times alike on CUDA too (see _unit_seconds)
        forward, rerun = (sum(timings[k][start:stop]) for k in ("forward_seconds", "rerun_seconds"))
        policies = [p for p, m in under_policy.items() if m[(start, stop)] is not None]
        seconds = measured_once(before, None if alike is None else (alike, "span seconds"),  # a span of one unit is not that unit timed alone
                                lambda: time_span(members, span_input, input_needs_grad, policies, forward, rerun))
        for policy, added in seconds.items():
            under_policy[policy][(start, stop)].update(added)


def _span_costs(costs: UnitCosts, measured: Dict[Tuple[int, int], Optional[dict]]) -> UnitCosts:
    """``costs`` with each measured span's figures under a policy laid onto its units, so
    that sums and running maxima over a region of whole spans come out right: what the
    span keeps, its forward peak and its backward's excess (recompute included) at its
    first unit, whether it keeps its output at its last, zeros between. A span that
    cannot run under the policy keeps the plain figures."""
    fields = ("saved", "forward_peak", "backward_excess", "keeps_output")
    values = {k: list(getattr(costs, k)) for k in fields}
    values["again_seconds"], values["nested_forward_seconds"] = [0.0] * len(costs), [0.0] * len(costs)
    eligible = [False] * len(costs)
    for (r, s), cost in measured.items():
        if cost is None:
            continue
        for i in range(r, s):
            values["saved"][i], values["forward_peak"][i], values["backward_excess"][i], values["keeps_output"][i], eligible[i] = 0, 0, 0, False, True
        for k in ("saved", "forward_peak", "backward_excess"):
            values[k][r] = cost[k]
        values["again_seconds"][r] = cost.get("again_seconds", 0.0)
        values["nested_forward_seconds"][r] = cost.get("nested_forward_seconds", 0.0)
        values["keeps_output"][s - 1] = cost["keeps_output"]
    return replace(costs, eligible=tuple(eligible), **{k: tuple(v) for k, v in values.items()})
