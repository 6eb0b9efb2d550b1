"""What one unit of a chain costs, measured alone on a private copy: one forward and backward under the
tensor-accounting tracker (:mod:`trunksplit.planning.memory`), the figures of
:class:`trunksplit.planning.profile.UnitCosts` for it. :func:`trunksplit.planning.profile.profile_units` walks the chain."""
import contextlib
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..recompute.policies import POLICIES
from ..recompute.regions import run_region
from ..recompute.stages import staged_graph
from .memory import StorageWeakRef, _TensorAccounting, allocator_meter, tensors_in
from .unit_copies import GradientLayout, arriving_layout, gradient_layout, private_copy, unit_input, unit_loss


def measure_under(members: Sequence[nn.Module], h: torch.Tensor, input_needs_grad: bool, policy: str, allocator: bool = False) -> Optional[dict]:
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
        return measure_unit(copies, h, input_needs_grad, policy, allocator)
    except RuntimeError as e:
        if "mutated" not in str(e):
            raise
        return None


# the figures a unit's backward makes: what the layout of the gradient arriving at its output may change
# see _UntilSavesLetGo: the UnitCosts field of each (figure, phase)
_PHASE_FIELDS = {("fresh", "held"): "fresh_while_input_held", ("fresh", "from_unpack"): "fresh_from_unpack", ("fresh", "released"): "released_fresh",
                 ("excess", "held"): "excess_while_input_held", ("excess", "from_unpack"): "excess_from_unpack", ("excess", "released"): "released_excess"}
PHASES = tuple(_PHASE_FIELDS.values())
BACKWARD_FIGURES = ("backward_excess", "backward_fresh", *PHASES, "update_moments", "rerun_gradient", "fresh_gradient_surplus")


class _Unpacks:
    """What backward has unpacked of a unit's saved tensors: the tracker's bytes at the first unpack
    (where a recompute of the unit would start), and how many of its saves autograd still holds
    (none: its backward has let go of everything it saved, its input included). Each save is packed
    in a holder whose end (its node's release, after the node ran) says when."""

    def __init__(self):
        self.first: Optional[int] = None
        self.saves = 0

    def hold(self, t: torch.Tensor) -> "_Save":
        """A save of the unit, packed: counted until autograd lets it go."""
        self.saves += 1
        holder = _Save(t)
        weakref.finalize(holder, self._let_go)
        return holder

    def _let_go(self) -> None:
        self.saves -= 1

    def unpack(self, packed: "_Save", tracker: _TensorAccounting) -> torch.Tensor:
        """The unpack hook of the unit."""
        self.first = tracker.current_bytes() if self.first is None else self.first
        return packed.t


class _Save:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


class _UntilSavesLetGo(_TensorAccounting):
    """The tracker, its backward's peaks also split where the unit has let go of every tensor it saved
    (``unpacks.saves`` falls to 0), before (``"held"``) and after (``"released"``), and the first part from
    the first unpack on (``"from_unpack"``): of ``current + held`` (``"fresh"``, its gradients fresh) and of
    ``current`` (``"excess"``, into gradients kept): :data:`PHASES`. Its input is alive beside the first
    only, where the unit alone held it (see ``UnitCosts.fresh_while_input_held``): a block whose branches'
    input gradients are summed after the last convolution let it go (FastViT's, Inception's) was predicted
    with it. Every save, not the input's alone: a checkpoint keeps its input until its segment's last save
    goes (torch's ``_CheckpointFrame`` is held by the hooks of each), so the same moment serves a segment's
    first unit. A checkpoint recomputes its segment at the first unpack: the ops before it run beside
    no recompute (ShuffleNet's channel shuffle copies the gradient)."""

    def __init__(self, unpacks: _Unpacks):
        super().__init__()
        self.unpacks = unpacks
        self.start_backward()

    def start_backward(self) -> None:
        """Start every peak at what is alive now, where a backward starts."""
        self.peak = self.peak_with_held = self.current
        self._peaks = {(figure, phase): self.current if phase == "held" else 0 for figure, phase in _PHASE_FIELDS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.phase_peak(self.current + self.held)
        self.phase_peak(self.current, "excess")
        return out

    def phase_peak(self, alive: int, figure: str = "fresh") -> None:
        phases = ("held", "from_unpack") if self.unpacks.first is not None else ("held",)
        for phase in phases if self.unpacks.saves else ("released",):
            self._peaks[figure, phase] = max(self._peaks[figure, phase], alive)

    def phases(self, start: int) -> Dict[str, int]:
        """The backward's peaks beyond ``start`` (what the forward left), as :data:`PHASES` names them."""
        return {name: self._peaks[key] - start if key[1] == "held" else max(0, self._peaks[key] - start) for key, name in _PHASE_FIELDS.items()}


def measure_again_where_gradients_arrive_otherwise(units: Sequence[nn.Module], inputs: list, figures: Dict[str, list], allocator: bool,
                                                   device: torch.device, carries: int = 1) -> None:
    """Measure again, last unit first, each unit whose output's gradient the next unit's backward lays out
    otherwise than :func:`arriving_layout` supposed (``figures["input_gradient"]``: what each unit's backward
    gave its input), with that layout; what its own backward gives its input may change in turn, and so on
    down the chain. A ConvNeXt's last block gets a contiguous gradient from the pooling, not a channels-last
    one; a Sequencer's stage, a permuted one from the convolution after it, which each block's backward
    copies. Only the figures of :data:`BACKWARD_FIGURES` change.

    ``inputs``: the first unit's input, then each unit's input as a meta tensor (its shape and strides); a
    unit is measured again on random values of that layout, as bytes do not depend on values. ``carries``: the
    first unit whose input carries a gradient (:func:`~trunksplit.planning.unit_copies.first_input_with_gradient`)."""
    given = figures["input_gradient"]
    for i in range(len(units) - 1, 0, -1):
        output, source = inputs[i], inputs[i - 1]
        if given[i] is None or not isinstance(output, torch.Tensor) or given[i] == arriving_layout(output):
            continue
        if i > 1 and not (isinstance(source, torch.Tensor) and source.is_floating_point()):
            continue
        h = source if i == 1 else torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=device).normal_()
        cost = measure_unit(private_copy(units[i - 1], like=h), h, input_needs_grad=i - 1 >= carries, allocator=allocator, layout=given[i])
        for key in BACKWARD_FIGURES:
            figures[key][i - 1] = cost[key]
        given[i - 1] = cost["input_gradient"]


def measure_unit(m: nn.Module, h: torch.Tensor, input_needs_grad: bool, policy: str = "keep", allocator: bool = False,
                 layout: Optional[GradientLayout] = None) -> dict:
    """One forward and backward of ``m`` on a copy of ``h``, run plainly (``"keep"``) or as one
    region under ``policy``: the figures of :class:`UnitCosts` for it (``allocator``: its
    transient peaks as the allocator's, see :func:`profile_units`), and ``input_gradient``: the
    layout of the gradient its backward gives its input (:func:`gradient_layout`; None: none given).
    ``layout``: that of the gradient arriving at a tensor output (see :func:`unit_loss`)."""
    device = next(tensors_in(h)).device
    forward_meter, backward_meter = (allocator_meter(device) if allocator else contextlib.nullcontext() for _ in range(2))
    unpacked, given = _Unpacks(), []  # what backward unpacks; the input's gradient layout
    tracker, inp = _UntilSavesLetGo(unpacked), unit_input(h, input_needs_grad)
    if isinstance(inp, torch.Tensor) and inp.requires_grad:
        inp.register_hook(lambda g: given.append(gradient_layout(g)))
    with forward_meter:
        out, kept = _forward_keeping(m, inp, tracker, policy, unpacked)
    forward_peak, backward_excess, backward_fresh, moments, surplus, phases = tracker.peak, 0, 0, (), 0, dict.fromkeys(PHASES, 0)
    loss = unit_loss(out, layout)
    del out  # as in a chain, the output lives on only where its backward saved it, until that backward runs
    tracker._sweep()
    after_forward = tracker.current
    if loss is not None:
        seed = torch.ones_like(loss)  # made outside the window: only the real gradient is counted
        tracker.start_backward()
        with backward_meter, tracker, _held_when_fresh(m, tracker, unpacked) as accumulations:
            loss.backward(seed)
        backward_excess, backward_fresh = tracker.peak - after_forward, tracker.peak_with_held - after_forward
        moments = tuple((alive - after_forward, nbytes, released) for alive, nbytes, released in accumulations.moments)
        phases, surplus = tracker.phases(after_forward), accumulations.surplus
    kept["rerun_gradient"] = unpacked.first - after_forward if unpacked.first is not None else 0
    if allocator:  # the allocator's peaks, not split: each holds the input
        forward_peak, backward_excess = forward_meter.peak_bytes, backward_meter.peak_bytes if loss is not None else 0
        kept["rerun_peak"] = forward_peak
        backward_fresh = _fresh_backward_peak(m, h, input_needs_grad, policy, layout) if loss is not None else 0
        phases = {name: 0 if phase == "released" else backward_fresh if figure == "fresh" else backward_excess for (figure, phase), name in _PHASE_FIELDS.items()}
    return dict(kept, forward_peak=forward_peak, backward_excess=backward_excess, backward_fresh=backward_fresh, update_moments=moments,
                fresh_gradient_surplus=surplus, input_gradient=given[0] if given else None, **phases)


def feature_figures(m: nn.Module, h, input_needs_grad: bool, after_feature: bool, held: bool) -> Dict[str, int]:
    """What a requested feature adds to ``m``'s backward peak, measured (``UnitCosts.beside_waiting`` and
    ``beside_held_output``): where ``m``'s input is a feature (``after_feature``), the loss's gradient of it,
    made before ``m``'s backward, which accumulates its input's gradient into it: between none (a residual
    block's branches meet in it at the block's peak) and the input's bytes (a pooling's, or a peak inside the
    unit: all extra there; its input needs a gradient); where ``m``'s output is one that it saves (``held``), the
    caller's hold on it, which ``m``'s own backward would have let go (a block ending in ReLU saves its output:
    alone, it is freed before the block's convolutions run backward). 0 where not asked or not measurable (no
    tensor input, no gradient)."""
    if not isinstance(h, torch.Tensor):
        return {"beside_waiting": 0, "beside_held_output": 0}
    alone = _backward_peak(m, h, input_needs_grad) if after_feature or held else 0
    return {"beside_waiting": max(0, _backward_peak(m, h, input_needs_grad, waiting=True) - alone) if after_feature else 0,
            "beside_held_output": max(0, _backward_peak(m, h, input_needs_grad, holding=True) - alone) if held else 0}


def _backward_peak(m: nn.Module, h: torch.Tensor, input_needs_grad: bool, waiting: bool = False, holding: bool = False) -> int:
    """The peak of one backward of ``m`` beyond what its forward left, under the tracker; the input a non-leaf
    as in a chain (its gradient's pieces meet in autograd's buffer). ``waiting``: beside the loss's gradient of
    its input, made first; ``holding``: its output held through it, as a caller holds a feature."""
    inp, tracker = unit_input(h, input_needs_grad or waiting), _TensorAccounting()
    weight = torch.ones_like(inp) if waiting else None  # made before: its gradient's bytes are the step's
    with tracker:  # what the forward keeps counts: backward frees it as it goes, as in the step
        out = m(inp)
        roots = [r for r in [unit_loss(out)] + ([(inp * weight).sum()] if waiting else []) if r is not None]  # made last, the waiting term's backward runs first
    if not holding:
        del out
    if not roots:
        return 0
    seeds = [torch.ones_like(r) for r in roots]
    after_forward = tracker.current_bytes()
    tracker.peak = after_forward
    with tracker:
        torch.autograd.backward(roots, seeds)
    return tracker.peak - after_forward


def _fresh_backward_peak(m: nn.Module, h, input_needs_grad: bool, policy: str, layout: Optional[GradientLayout]) -> int:
    """The allocator's peak of ``m``'s backward beyond what its forward left, with its parameters
    holding no gradient yet (``UnitCosts.backward_fresh``): one more forward and backward."""
    grads = [(p, p.grad) for p in m.parameters()]
    for p, _ in grads:
        p.grad = None
    out, _ = _forward_keeping(m, unit_input(h, input_needs_grad), _TensorAccounting(), policy, _Unpacks())
    loss = unit_loss(out, layout)
    seed = torch.ones_like(loss)
    with allocator_meter(seed.device) as meter:
        loss.backward(seed)
    for p, g in grads:
        p.grad = g
    return meter.peak_bytes


class _held_when_fresh:
    """While a backward runs into gradients that exist already (accumulated in place, each new
    one freed after), count each parameter's gradient as ``tracker.held`` from its first
    accumulation on: what the same backward would hold had the gradients not existed. A new gradient
    laid out otherwise than its parameter (a convolution's weight gradient, channels-last after a
    channels-last input: ConvNeXt's downsampling) is then copied into the parameter's layout, both
    alive for a moment (torch's ``AccumulateGrad``), where an existing one adds it in place. Where the
    unit's backward has let its input go by then (a lone convolution's), that moment is ``released``:
    the peak model adds the input only where something else holds it.

    Tensor storages only, as the tracker that measures a step on CPU counts them: a CPU
    convolution's weight-gradient scratch (oneDNN's), which the allocator holds beside each new
    gradient for a moment, is in the allocator's figures (``profile_units(allocator=True)``,
    what FSDP2 ranks and compiled trunks on CPU plan from), not here.

    A fresh gradient laid out as its parameter is kept as it arrives, a view included: where it
    lies in a larger storage (EVA's and BEiT's q and v biases, sliced by ``torch.cat``'s backward from
    their fused qkv bias's gradient), the whole storage stays, counted once; ``surplus``: what the
    unit's fresh gradients so hold beyond their parameters' bytes (``UnitCosts.fresh_gradient_surplus``).

    Also records, at each accumulation, the bytes alive, the parameter's, and whether the unit has let go
    of all it saved by then (``moments``): where an optimizer stepped in backward would update it
    (``UnitCosts.update_moments``); and where a fresh gradient would be copied, the bytes alive then and 0
    (no update runs beside the copy)."""

    def __init__(self, m: nn.Module, tracker: _UntilSavesLetGo, unpacks: _Unpacks):
        self.params = [p for p in m.parameters() if p.requires_grad]
        self.tracker, self.unpacks, self.surplus = tracker, unpacks, 0
        self.moments: List[Tuple[int, int, bool]] = []

    def __enter__(self):
        seen, storages, fresh = set(), {}, {}  # fresh: id(p) -> the bytes its fresh gradient holds that none before it held
        t = self.tracker

        def accumulated(p):
            nbytes = p.numel() * p.element_size()
            self.moments.append((t.current_bytes(), nbytes, not self.unpacks.saves))
            if id(p) not in seen:
                seen.add(id(p))
                t.held += fresh.get(id(p), nbytes)
                self.surplus += fresh.get(id(p), nbytes) - nbytes

        def arriving(p):
            def copied_if_fresh(g):
                if id(p) in seen:
                    return
                if not any(a != b for a, b, n in zip(g.stride(), p.stride(), p.shape) if n > 1):
                    ref = StorageWeakRef(g.untyped_storage())  # a storage freed since may have left its address to this one
                    fresh[id(p)] = 0 if ref.cdata in storages and not storages[ref.cdata].expired() else g.untyped_storage().nbytes()
                    storages[ref.cdata] = ref
                else:
                    copy_made = t.current_bytes() + p.numel() * p.element_size()
                    self.moments.append((copy_made, 0, not self.unpacks.saves))  # stepped in backward, the gradient is fresh too: a fixed moment
                    alive = copy_made + t.held
                    if self.unpacks.saves:
                        t.peak_with_held = max(t.peak_with_held, alive)
                    t.phase_peak(alive)
            return copied_if_fresh

        self.handles = [p.register_post_accumulate_grad_hook(accumulated) for p in self.params] + [p.register_hook(arriving(p)) for p in self.params]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.tracker.held = 0
        return False


def _forward_keeping(m: nn.Module, inp: torch.Tensor, tracker: _TensorAccounting, policy: str, unpacked: _Unpacks):
    """``m(inp)`` under ``tracker``; returns the output and what the forward keeps for backward:
    ``output``, ``saved``, ``saves_input`` and ``keeps_output`` of :class:`UnitCosts`. Run plainly,
    ``unpacked`` follows what backward unpacks (:class:`_Unpacks`)."""
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in m.parameters()}
    in_keys = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors_in(inp)}  # a tuple's tensors too
    packed, peak_at_pack = [], [0]  # torch stops a recompute at the last pack: the peak up to it is the rerun's

    def pack(t):
        packed.append(t)
        peak_at_pack[0] = tracker.peak
        return unpacked.hold(t)

    checkpointed = policy != "keep"
    if checkpointed:
        # A checkpoint keeps its tensors out of saved-tensor hooks: what it keeps is its input and (save_expensive) the expensive ops' outputs
        with tracker:
            out = run_region(list(m), inp, policy)
    else:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: unpacked.unpack(t, tracker)):
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
