"""Profiling: what each unit of a chain costs (``UnitCosts``), measured on private copies.

The peak model (:mod:`trunksplit.planning.peak`) plans from these figures; the tracker that counts the bytes is
:class:`trunksplit.planning.memory.PeakMemory`'s."""
import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..recompute.checkpoint import map_tensors
from ..recompute.policies import POLICIES
from ..recompute.regions import run_region
from ..recompute.stages import staged_graph
from .memory import StorageWeakRef, _TensorAccounting, allocator_meter, storage_bytes, tensors_in
from .param_bytes import largest_param_bytes, unit_param_bytes
from .timing import checkpoint_seconds, forward_seconds, rerun_seconds, time_span
from .unit_copies import private_copy, unit_input, unit_loss


@dataclass(frozen=True, kw_only=True)
class UnitCosts:
    """Measured costs of each unit of a chain, for one input shape.

    All byte counts are exact tensor-storage bytes (see :class:`PeakMemory`'s tracker), but
    where profiled with ``allocator=True`` (see :func:`profile_units`) the transient peaks
    (``forward_peak``, ``backward_excess``, ``backward_fresh``) are the allocator's:

    - ``output``: the storage the unit's output holds in the chain: a view (a ViT's class token,
      ``x[:, 0]``) holds its whole base, and so does a checkpoint or a caller keeping it.
    - ``saved``: what the unit's own forward creates and keeps for backward
      (its output too, when backward needs it, as ReLU's does).
    - ``saves_input``: whether the unit keeps its input for backward.
    - ``input_from``: the unit that allocated the storage of this unit's input
      (-1: the chain's input). In-place units pass their input's storage on, so
      two units may keep the same storage; the peak model counts it once.
    - ``keeps_output``: whether the unit's own backward needs its output.
    - ``forward_peak``: peak of the unit's forward, beyond its input; ``rerun_peak``: up to its last save (where
      a recompute stops); ``first_peak``: saving nothing (a checkpointed segment's first forward).
    - ``backward_excess``: peak of the unit's backward above what its forward
      left alive: the gradient arriving at its output (until backward frees it),
      gradient buffers of activations and transient weight gradients (weights
      already holding a ``.grad``, as from the second step on).
    - ``backward_fresh``: the same peak when the unit's parameters hold no gradient yet, so
      that each gradient its backward makes stays (as under FSDP2, whose gathered weights
      start every backward without one): ``backward_excess`` less the transient weight
      gradients, plus the unit's gradients as they appear, in the order backward makes them (the
      allocator's figure also holds a CPU convolution's weight-gradient scratch beside each).
    - ``flops``: forward FLOPs (a multiply-add counts 2).
    - ``param_bytes``: the unit's trainable parameters (each counted once, at the
      last unit that uses it): what its gradients take once backward allocates them.
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
      forward left, its new gradient already added into the kept one; the parameter's bytes). Stepped
      in backward, that gradient lives on through an update that makes ``k`` tensors of the
      parameter's size: the first plus ``1 + k`` times the second (``gradients="in_backward"``).
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
    update_moments: Tuple[Tuple[Tuple[int, int], ...], ...] = ()
    rerun_peak: Tuple[int, ...] = ()  # either empty: forward_peak
    first_peak: Tuple[int, ...] = ()
    reduce_scatter_copies: int = 0  # FSDP2: whole copies of a reduce-scatter's input its backend makes (gloo: 1)

    def __len__(self) -> int:
        return len(self.names)

    def under(self, policy: str) -> "UnitCosts":
        """The costs with each unit alone under the region ``policy``."""
        return self.policies[policy]


_MEASURED = ("output", "saved", "saves_input", "input_from", "keeps_output", "forward_peak", "rerun_peak", "first_peak", "backward_excess",
             "backward_fresh", "flops", "recompute_bytes", "light_flops", "update_moments")


def profile_units(units: Sequence[Tuple[str, nn.Module]], x: torch.Tensor, spans: Sequence[Tuple[int, int]] = (), timed: bool = False,
                  allocator: bool = False, progress: Optional[Callable[[str], None]] = None, use_reentrant: bool = False) -> UnitCosts:
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
    (a command line's progress bar: profiling a big trunk takes tens of seconds).
    """
    fields = {k: [] for k in _MEASURED + (("forward_seconds", "rerun_seconds") if timed else ())}
    span_stop = dict(spans)
    under_policy: Dict[str, Dict[Tuple[int, int], Optional[dict]]] = {p: {} for p in POLICIES}
    span = None  # (start, its input, private copies of its units so far) while inside a span
    source = -1  # the unit that allocated the storage of the current activation
    device = next(iter(tensors_in(x))).device
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        h = map_tensors(lambda t: t.detach().clone() if t.is_inference() else t.detach(), x)  # an inference tensor cannot enter autograd
        own = checkpoint_seconds(device, use_reentrant) if timed else 0.0
        for i, (_, unit) in enumerate(units):
            fields["input_from"].append(source)
            m = private_copy(unit, like=h)
            if i in span_stop:
                span = (i, h, [])
            tracker = _TensorAccounting()
            with torch.no_grad(), FlopCounterMode(display=False) as flops, tracker:
                next_h = m(h)
            cost = _measure_unit(m, h, input_needs_grad=i > 0, allocator=allocator)
            for key, value in cost.items():
                fields[key].append(value)
            fields["flops"].append(int(flops.get_total_flops()))
            fields["recompute_bytes"].append(tracker.cheap_bytes)
            fields["first_peak"].append(tracker.peak)  # that forward kept nothing for backward
            fields["light_flops"].append(tracker.light_flops)
            if timed:
                fields["forward_seconds"].append(forward_seconds(m, h, input_needs_grad=i > 0))
                fields["rerun_seconds"].append(rerun_seconds(m, h, i > 0, use_reentrant, own, fields["forward_seconds"][-1]))
            if span is not None:
                span[2].append(m)
                if i + 1 == span_stop[span[0]]:
                    _measure_span(span, under_policy, allocator, fields if timed else None)
                    span = None
            # a unit measured on a compact copy of a view returns a compact view: what the chain's holds is its base
            fields["output"][i] = max(fields["output"][i], storage_bytes(next_h))
            if not isinstance(next_h, torch.Tensor) or not isinstance(h, torch.Tensor) or next_h.untyped_storage().data_ptr() != h.untyped_storage().data_ptr():
                source = i  # a new activation; an in-place unit passes its input's storage on
            h = next_h
            if progress is not None:
                progress(units[i][0])
    plain = {k: tuple(v) for k, v in fields.items()}
    costs = UnitCosts(names=tuple(n for n, _ in units), param_bytes=unit_param_bytes([u for _, u in units]), largest_param=largest_param_bytes([u for _, u in units]),
                      checkpoint_seconds=own, **plain)
    if not spans:
        return costs
    return replace(costs, policies={p: _span_costs(costs, measured) for p, measured in under_policy.items()})


def _measure_span(span: tuple, under_policy: Dict[str, dict], allocator: bool, timings: Optional[Dict[str, list]]) -> None:
    """Measure a span ``(start, its input, its units)`` under each region policy into
    ``under_policy``, and where ``timings`` (the units' ``forward_seconds`` and ``rerun_seconds``
    so far) are given, time it (see :func:`~trunksplit.planning.timing.time_span`)."""
    start, span_input, members = span
    stop = start + len(members)
    for policy, measured in under_policy.items():
        measured[(start, stop)] = _measure_under(members, span_input, start > 0, policy, allocator)
    if timings is not None:
        forward, rerun = (sum(timings[k][start:stop]) for k in ("forward_seconds", "rerun_seconds"))
        time_span(members, span_input, start > 0, {p: m[(start, stop)] for p, m in under_policy.items()}, forward, rerun)


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


def _measure_under(members: Sequence[nn.Module], h: torch.Tensor, input_needs_grad: bool, policy: str, allocator: bool = False) -> Optional[dict]:
    """The costs of ``members`` run in order as one region under a policy, or None where they cannot run so.

    torch's selective checkpoint refuses (at backward) a region that changes a kept output
    in place, as EfficientNet's squeeze-excitation does with ``SiLU(inplace=True)`` after
    a convolution: such a span is not eligible for ``"save_expensive"``. A span none of
    whose units runs in stages (see :func:`trunksplit.recompute.stages.staged_graph`) is not
    eligible for ``"recompute_stages"``: it would be a ``"recompute"`` region."""
    copies = private_copy(nn.Sequential(*members))  # a deepcopy drops parameters' .grad: set them again
    if POLICIES[policy].staged and not any(staged_graph(m) for m in copies):
        return None
    try:
        return _measure_unit(copies, h, input_needs_grad, policy, allocator)
    except RuntimeError as e:
        if "mutated" not in str(e):
            raise
        return None


def _measure_unit(m: nn.Module, h: torch.Tensor, input_needs_grad: bool, policy: str = "keep", allocator: bool = False) -> dict:
    """One forward and backward of ``m`` on a copy of ``h``, run plainly (``"keep"``) or as one
    region under ``policy``: the figures of :class:`UnitCosts` for it (``allocator``: its
    transient peaks as the allocator's, see :func:`profile_units`)."""
    device = next(tensors_in(h)).device
    forward_meter, backward_meter = (allocator_meter(device) if allocator else contextlib.nullcontext() for _ in range(2))
    tracker, inp = _TensorAccounting(), unit_input(h, input_needs_grad)
    with forward_meter:
        out, kept = _forward_keeping(m, inp, tracker, policy)
    forward_peak, backward_excess, backward_fresh, moments = tracker.peak, 0, 0, ()
    loss = unit_loss(out)
    del out  # as in a chain, the output lives on only where its backward saved it, until that backward runs
    tracker._sweep()
    after_forward = tracker.current
    if loss is not None:
        seed = torch.ones_like(loss)  # made outside the window: only the real gradient is counted
        tracker.peak = tracker.peak_with_held = tracker.current
        with backward_meter, tracker, _held_when_fresh(m, tracker) as accumulations:
            loss.backward(seed)
        backward_excess = tracker.peak - after_forward
        backward_fresh = tracker.peak_with_held - after_forward
        moments = tuple((alive - after_forward, nbytes) for alive, nbytes in accumulations.moments)
    if allocator:
        forward_peak, backward_excess = forward_meter.peak_bytes, backward_meter.peak_bytes if loss is not None else 0
        kept["rerun_peak"] = forward_peak
        backward_fresh = _fresh_backward_peak(m, h, input_needs_grad, policy) if loss is not None else 0
    return dict(kept, forward_peak=forward_peak, backward_excess=backward_excess, backward_fresh=backward_fresh, update_moments=moments)


def _fresh_backward_peak(m: nn.Module, h, input_needs_grad: bool, policy: str) -> int:
    """The allocator's peak of ``m``'s backward beyond what its forward left, with its parameters
    holding no gradient yet (``UnitCosts.backward_fresh``): one more forward and backward."""
    grads = [(p, p.grad) for p in m.parameters()]
    for p, _ in grads:
        p.grad = None
    out, _ = _forward_keeping(m, unit_input(h, input_needs_grad), _TensorAccounting(), policy)
    loss = unit_loss(out)
    seed = torch.ones_like(loss)
    with allocator_meter(seed.device) as meter:
        loss.backward(seed)
    for p, g in grads:
        p.grad = g
    return meter.peak_bytes


class _held_when_fresh:
    """While a backward runs into gradients that exist already (accumulated in place, each new
    one freed after), count each parameter's gradient as ``tracker.held`` from its first
    accumulation on: what the same backward would hold had the gradients not existed.

    Tensor storages only, as the tracker that measures a step on CPU counts them: a CPU
    convolution's weight-gradient scratch (oneDNN's), which the allocator holds beside each new
    gradient for a moment, is in the allocator's figures (``profile_units(allocator=True)``,
    what FSDP2 ranks and compiled trunks on CPU plan from), not here.

    Also records, at each accumulation, the bytes alive and the parameter's (``moments``): where
    an optimizer stepped in backward would update it (``UnitCosts.update_moments``)."""

    def __init__(self, m: nn.Module, tracker: _TensorAccounting):
        self.params = [p for p in m.parameters() if p.requires_grad]
        self.tracker = tracker
        self.moments: List[Tuple[int, int]] = []

    def __enter__(self):
        seen = set()
        t = self.tracker

        def accumulated(p):
            nbytes = p.numel() * p.element_size()
            self.moments.append((t.current_bytes(), nbytes))
            if id(p) not in seen:
                seen.add(id(p))
                t.held += nbytes

        self.handles = [p.register_post_accumulate_grad_hook(accumulated) for p in self.params]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.tracker.held = 0
        return False


def _forward_keeping(m: nn.Module, inp: torch.Tensor, tracker: _TensorAccounting, policy: str):
    """``m(inp)`` under ``tracker``; returns the output and what the forward keeps for backward:
    ``output``, ``saved``, ``saves_input`` and ``keeps_output`` of :class:`UnitCosts`."""
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in m.parameters()}
    in_keys = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors_in(inp)}  # a tuple's tensors too
    packed, peak_at_pack = [], [0]  # torch stops a recompute at the last pack: the peak up to it is the rerun's

    def pack(t):
        packed.append(t)
        peak_at_pack[0] = tracker.peak
        return t

    checkpointed = policy != "keep"
    if checkpointed:
        # A checkpoint keeps its tensors out of saved-tensor hooks: what it keeps is its
        # input and (save_expensive) the expensive ops' outputs, all alive after the forward.
        with tracker:
            out = run_region(list(m), inp, policy)
    else:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m(inp)
    tracker._sweep()  # storages freed as the forward returned (its locals) are not alive after it
    # a chain's last unit may return any structure (a traced model's own output): count all its tensors
    out_keys = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in tensors_in(out)}
    if checkpointed:
        # what is alive after the forward is kept for backward, but for outputs: those only
        # where a selective policy caches them (a convolution's, say)
        saves_input = True
        keeps = POLICIES[policy].keeps if policy in POLICIES else None  # "keep": a unit run plainly
        cached = getattr(tracker, keeps) if keeps else set()  # the tracker's storages of the ops it keeps: .expensive, .heavy
        keeps_output = any(k in cached for k in out_keys)
        saved = {k: n for k, (_, n) in tracker.live.items() if k not in params and (k not in out_keys or k in cached)}
        peak_at_pack[0] = tracker.peak  # a region as a whole: its forward's peak
    else:
        saved, saves_input, keeps_output = {}, False, False
        for t in packed:
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key in in_keys:
                saves_input = True
            elif key not in params and key in tracker.live:
                saved[key] = t.untyped_storage().nbytes()
                keeps_output |= key in out_keys
        packed.clear()  # release the saved tensors' extra references before backward
    return out, dict(output=sum(out_keys.values()), saved=sum(saved.values()), saves_input=saves_input, keeps_output=keeps_output,
                     rerun_peak=peak_at_pack[0])
