"""A memory budget for any ``nn.Module``: which of its blocks to wrap with ``checkpoint_wrapper``.

A trunk is cut between units of a chain, which needs the model's feature blocks (a
registered family, or a ``torch.fx`` trace). Many models have neither: a forward
that branches on values, a ``**kwargs`` signature, a dict or dataclass output. Their
blocks can still be checkpointed in place, each under its own checkpoint, with the
model's forward, outputs and ``state_dict`` unchanged. :func:`wrap_for_budget` picks
which ones:

1. One training step on the example inputs measures each candidate block (a
   submodule with parameters whose first op is not in place, see
   :func:`trunksplit.layer_splittable_before`): the bytes its ops save for backward,
   its inputs (what a checkpoint keeps instead), the outputs of its expensive ops
   (convolutions, matmuls, attention), its FLOPs.
2. Each block can be wrapped under two policies: ``"recompute"`` keeps its inputs and
   reruns it whole; ``"save_expensive"`` also keeps its expensive ops' outputs and
   reruns only the cheap ops (frees less, runs no FLOP again). For a price on recompute
   (FLOPs, plus bytes written again) and a cap on what one block may rebuild at once in
   its backward, the best set of blocks that do not nest (a block inside a chosen one
   is covered by it), each under its better policy, maximises bytes freed less the price
   of running them again: a dynamic programme over the module tree. Over all prices
   and caps, the sets on the frontier of (recompute, estimated peak) form a ladder, from
   a few blocks keeping their convolutions to every block of the finest useful size
   rerun whole.
3. The ladder is searched with *measured* steps: each wrapping is applied, one real
   step is measured (the model's weights, gradients, buffers, modes and RNG are put
   back), and the wrapping is undone. So the reported peak is a measurement, not a
   model, and a budget is met as measured. The cheapest rung that meets the budget is
   found by bisection below the rung that measures lowest.

Sharp edges: the figure is the step's peak beyond what was live before it, for the
example inputs (another shape needs another plan); a block that is called several
times is wrapped for every call.
"""
import contextlib
import math
import warnings
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..recompute.policies import RECOMPUTE
from ..recompute.select import Condition, as_condition, wrap_selected
from ..recompute.wrapper import checkpoint_wrapped_names, checkpoint_wrapper, unwrap_checkpoint
from .budget import BudgetTooLowError, MemoryBudget, format_bytes
from .memory import PeakMemory, measuring_alone, tensors_in
from .request import GRADIENT_MODES, UPDATE_TEMPORARIES, in_backward_mark
from .wrap_blocks import Block, Choice, kept_as_it_was, measure_blocks


@dataclass(frozen=True)
class WrapPlan:
    """What :func:`wrap_for_budget` wrapped, and the step it measured."""

    names: Tuple[str, ...]  # the wrapped blocks, in named_modules() order
    policies: Tuple[str, ...]  # what each keeps: "recompute" (its inputs) or "save_expensive" (and its conv/matmul outputs)
    peak_bytes: int  # the measured step peak with them wrapped, beyond what was live before it
    unwrapped_peak_bytes: int  # the same without any wrapping
    recompute_flops: int  # FLOPs the wrapped blocks run again in backward
    forward_flops: int  # FLOPs of the model's forward

    def __str__(self) -> str:
        counts = ", ".join(f"{self.policies.count(p)} {p}" for p in dict.fromkeys(self.policies)) or "none"
        return (f"WrapPlan: {len(self.names)} block(s) wrapped ({counts}), measured step peak {self.peak_bytes / 2**20:.1f} MiB = "
                f"{self.peak_bytes / self.unwrapped_peak_bytes:.2f} of unwrapped ({self.unwrapped_peak_bytes / 2**20:.1f} MiB), "
                f"recompute {self.recompute_flops / max(1, self.forward_flops):.2f} of a forward\n  "
                + " ".join(n if p == RECOMPUTE.name else f"{n}[{p}]" for n, p in zip(self.names, self.policies)))


def apply_activation_checkpointing(model: nn.Module, condition: Optional[Condition] = None, offload_to_cpu: bool = False, *,
                                   memory_budget=None, example_inputs=None, gradients: str = "allocated",
                                   loss_fn: Optional[Callable[[Any], torch.Tensor]] = None, update_temporaries: Optional[float] = None):
    """Checkpoint submodules of ``model`` in place: those ``condition`` selects, or, with a
    ``memory_budget``, those that meet it with the least recompute.

    Without a budget: every submodule ``condition(name, module)`` selects is wrapped with
    :func:`trunksplit.checkpoint_wrapper` (see :func:`trunksplit.recompute.select.wrap_selected`);
    returns their names. ``condition`` is any ``(name, module) -> bool`` callable, torch's
    ``check_fn`` (``lambda module: isinstance(module, Block)``), or :class:`by_type`,
    :class:`by_name`, :class:`every_k`.

    With ``memory_budget`` (bytes, or a fraction in (0, 1] of the unwrapped step) and
    ``example_inputs`` (a tuple of positional inputs, or a lone tensor): works on any
    ``nn.Module``, traceable or not, and returns a :class:`WrapPlan` (see
    :func:`wrap_for_budget`, and its ``loss_fn`` and ``update_temporaries``); ``condition``, if given, limits the candidates.
    """
    memory_budget = MemoryBudget.parse(memory_budget)  # 0 is no budget, as everywhere
    condition = None if condition is None else as_condition(condition)
    if memory_budget is None:
        if condition is None:
            raise TypeError("apply_activation_checkpointing needs a condition (by_type(Block), ...), or memory_budget= with example_inputs=")
        return wrap_selected(model, condition, offload_to_cpu)
    if offload_to_cpu:
        raise ValueError("offload_to_cpu is not planned for: a memory budget is met on the device; drop one of the two")
    return wrap_for_budget(model, memory_budget, example_inputs, gradients, condition, loss_fn, update_temporaries)


def wrap_for_budget(model: nn.Module, memory_budget, example_inputs, gradients: str = "allocated",
                    condition: Optional[Condition] = None, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                    update_temporaries: Optional[float] = None) -> WrapPlan:
    """Wrap, in place, the blocks of ``model`` whose checkpointing meets ``memory_budget`` with the
    least recompute; returns the :class:`WrapPlan`.

    ``memory_budget``: bytes (int) or a fraction in (0, 1] of the unwrapped step's peak.
    ``example_inputs``: a tuple of positional inputs, as ``torch.export`` takes them (a lone
    tensor is taken as one input). ``gradients``: how the loop clears gradients (see
    :class:`trunksplit.CheckpointedTrunk`). ``condition``, where given, limits the candidates to
    the blocks it selects. ``loss_fn``: the training loss of the model's output (a scalar), run
    in every measured step; by default the sum of the output's tensors, which saves nothing for
    backward, so a loss that does (``out.pow(2).mean()`` keeps ``out`` and makes gradients the
    size of it) adds to your step what the search did not see: pass yours. A budget no wrapping
    meets raises ``ValueError`` naming the smallest measured peak; the model is then left as it was.
    ``update_temporaries``: with ``gradients="in_backward"``, tensors of a parameter's size that its
    optimizer's update allocates (``trunksplit.in_backward.update_temporaries(optimizer_class, kwargs)``:
    SGD's none, AdamW's for-loop form 2, the default). Wrap before ``optimizer_in_backward``: the
    measured steps would update parameters it already steps (refused). Sharp edge: the wrapping is
    fixed, so a call whose updates are held (``accumulating()``) keeps every gradient beside it, as
    ``"allocated"`` does, above an ``"in_backward"`` budget (a ``CheckpointedTrunk`` plans such calls apart).
    """
    if gradients not in GRADIENT_MODES:
        raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}")
    memory_budget = MemoryBudget.parse(memory_budget)
    if memory_budget is None:
        raise ValueError("wrap_for_budget needs a memory budget above 0: a fraction in (0, 1], bytes or a size (2GiB)")
    wrapped = checkpoint_wrapped_names(model)
    if wrapped:
        raise ValueError(
            f"{type(model).__name__} is already wrapped ({len(wrapped)} checkpointed blocks: {', '.join(wrapped[:3])}{' ...' if len(wrapped) > 3 else ''}): "
            "a budget is planned from the unwrapped model's step. Plan a fresh copy of the model, or unwrap these first "
            "(trunksplit.recompute.wrapper.unwrap_checkpoint on each); nothing was changed")
    if example_inputs is None:
        raise ValueError("a memory budget is measured on example inputs: pass example_inputs=(batch,) shaped as in training")
    _refuse_stepped_in_backward(model)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    step = _Step(model, inputs, gradients, loss_fn, UPDATE_TEMPORARIES if update_temporaries is None else update_temporaries)
    unwrapped = step.peak()
    budget = memory_budget.in_bytes(unwrapped)
    _refuse_below_the_gradients(model, gradients, budget, unwrapped, memory_budget.percent_hint())  # before the blocks are measured: minutes on a big model
    blocks, forward_flops = measure_blocks(model, inputs, condition)
    ladder = [[]] + _ladder(blocks)
    peaks: Dict[int, int] = {0: unwrapped}

    def peak_with(k: int) -> int:
        if k not in peaks:
            peaks[k] = step.peak_wrapped(ladder[k])
        return peaks[k]

    k = 0 if unwrapped <= budget else _cheapest_fit(peak_with, len(ladder), budget)
    if k is None:
        smallest = min(peaks.values())
        raise BudgetTooLowError(
            f"no wrapping of {type(model).__name__}'s blocks meets the memory budget of {format_bytes(budget)}{memory_budget.percent_hint()} ({budget / unwrapped:.2f} of the "
            f"unwrapped {format_bytes(unwrapped)}): the smallest feasible budget found is {format_bytes(smallest)} ({smallest / unwrapped:.3f} of unwrapped), "
            f"among {len(peaks)} measured wrappings of its {len(blocks)} candidate blocks",
            smallest, unwrapped)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    chosen = sorted(ladder[k], key=lambda c: order[c.name])
    for c in chosen:
        checkpoint_wrapper(c.block.module, policy=c.policy)
    recompute_flops = sum(c.block.flops for c in chosen if c.policy == RECOMPUTE.name)  # the selective ones rerun no counted FLOP
    return WrapPlan(tuple(c.name for c in chosen), tuple(c.policy for c in chosen), peaks[k], unwrapped, recompute_flops, forward_flops)


LADDER_PROBES = 6  # rungs measured across the ladder to find where it measures lowest
LADDER_CAPS = 12  # region sizes tried as caps on what one wrapped block may rebuild at once
LADDER_PATIENCE = 3  # rungs walked past the last lower one, each way, where the lowest probe does not fit


def _cheapest_fit(peak_with: Callable[[int], int], n: int, budget: int) -> Optional[int]:
    """The first rung in ``range(1, n)`` whose measured peak fits ``budget``, or None.

    Rungs free more as they go; a few probes find the one that measures lowest, then
    bisection finds the first rung before it that fits. Where that rung does not fit, the
    rungs on either side of it are walked (see :func:`_lowest_near`): the estimates that
    order the ladder are not the measured peaks, and a ladder's lowest rung can sit between
    two probes (a ViT's: its last layer's backward, which runs first, rebuilds less in parts
    than whole)."""
    if n < 2:
        return None
    probes = sorted({1, n - 1} | {round(1 + i * (n - 2) / (LADDER_PROBES - 1)) for i in range(LADDER_PROBES)})
    lowest = min(probes, key=lambda k: (peak_with(k), k))
    if peak_with(lowest) > budget:
        lowest = _lowest_near(peak_with, n, lowest)
        if peak_with(lowest) > budget:
            return None
    lo, hi = 0, lowest  # peak_with(0) does not fit (the caller checked), peak_with(hi) does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if peak_with(mid) <= budget else (mid, hi)
    return hi


def _lowest_near(peak_with: Callable[[int], int], n: int, start: int) -> int:
    """The rung measuring lowest on a walk from ``start`` each way, which goes on while a rung
    lower than the best so far turns up within ``LADDER_PATIENCE`` rungs (peaks plateau where
    rungs differ by a layer norm)."""
    best = start
    for step in (-1, 1):
        k, since = start + step, 0
        while 1 <= k < n and since < LADDER_PATIENCE:
            if peak_with(k) < peak_with(best):
                best, since = k, 0
            else:
                since += 1
            k += step
    return best


def _ladder(blocks: List[Block]) -> List[List[Choice]]:
    """Wrappings worth measuring, least recompute first, each estimated to peak lower than the last.

    A wrapped block keeps its inputs (and, under "save_expensive", its expensive ops'
    outputs) instead of what it saved, but its backward rebuilds the rest at once: a
    wrapping's peak is estimated as the unwrapped one, less what its blocks free, plus the
    largest rebuild. The candidates are the best non-nesting sets (see
    :func:`_best_antichain`) for every price on recompute, under every cap on a block's
    rebuild; the ladder is their frontier of (recompute, estimated peak)."""
    choices = [c for b in blocks for c in b.choices()]
    if not choices:
        return []
    useful = list({id(c.block): c.block for c in choices}.values())
    ancestors = {b.name: sorted((c for c in useful if b.name.startswith(c.name + ".")), key=lambda c: -len(c.name)) for b in useful}
    sizes = sorted({c.rebuild for c in choices})
    caps = sorted({sizes[round(i * (len(sizes) - 1) / (LADDER_CAPS - 1))] for i in range(LADDER_CAPS)})
    options = {}
    for cap in caps:
        allowed = [c for c in choices if c.rebuild <= cap]
        for price in sorted({c.freed / c.cost for c in allowed}, reverse=True) + [0.0]:
            chosen = _best_antichain(allowed, price * 0.999, ancestors)  # just below a choice's own ratio: it is worth taking
            key = frozenset((c.name, c.policy) for c in chosen)
            if chosen and key not in options:
                estimate = max(c.rebuild for c in chosen) - sum(c.freed for c in chosen)
                options[key] = (sum(c.cost for c in chosen), estimate, chosen)
    ladder, lowest = [], None
    for cost, estimate, chosen in sorted(options.values(), key=lambda o: (o[0], o[1])):
        if lowest is None or estimate < lowest:
            ladder += _steps_between(ladder[-1] if ladder else [], chosen)
            lowest = estimate
    return ladder


def _steps_between(before: List[Choice], after: List[Choice]) -> List[List[Choice]]:
    """Rungs from ``before`` to ``after``: the choices new in ``after`` join one at a time (those
    that free most first), each replacing the choices of ``before`` it covers (the same block
    under another policy included). Identical layers (a ViT's) join at one price, and a budget
    between none and all of them needs some of them."""
    old = {(c.name, c.policy) for c in before}
    new = sorted((c for c in after if (c.name, c.policy) not in old), key=lambda c: -c.freed)
    steps = []
    for j in range(1, len(new) + 1):
        joined = new[:j]
        kept = [c for c in before if not any(_nested(c.name, n.name) for n in joined)]
        steps.append(kept + joined)
    steps[-1] = after
    return steps


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _best_antichain(allowed: List[Choice], price: float, ancestors: Dict[str, List[Block]]) -> List[Choice]:
    """The choices of ``allowed``, at most one per block and no block inside another, that maximise
    sum(freed - price * cost): over the module tree, a block is worth taking (under its better
    policy) where its own value beats the best of those inside it."""
    own: Dict[str, Choice] = {}
    for c in allowed:
        if c.name not in own or c.freed - price * c.cost > own[c.name].freed - price * own[c.name].cost:
            own[c.name] = c
    children: Dict[Optional[str], List[Choice]] = {}
    for c in own.values():
        parent = next((a.name for a in ancestors[c.name] if a.name in own), None)
        children.setdefault(parent, []).append(c)

    def best(c: Optional[Choice]) -> Tuple[float, List[Choice]]:
        inner_value, inner = 0.0, []
        for child in children.get(None if c is None else c.name, []):
            value, chosen = best(child)
            if value > 0:
                inner_value, inner = inner_value + value, inner + chosen
        value = -math.inf if c is None else c.freed - price * c.cost
        return (value, [c]) if value > inner_value else (inner_value, inner)

    return best(None)[1]


class _Step:
    """One measured training step of the model on the inputs, leaving no trace (see :func:`kept_as_it_was`)."""

    def __init__(self, model: nn.Module, inputs: Tuple, gradients: str, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                 temporaries: float = UPDATE_TEMPORARIES):
        self.model, self.inputs, self.gradients, self.loss_fn, self.temporaries = model, inputs, gradients, loss_fn, temporaries
        self.device = next((t.device for t in tensors_in(inputs)), torch.device("cpu"))

    def peak(self) -> int:
        params = [p for p in self.model.parameters() if p.requires_grad]
        with kept_as_it_was(self.model), _updated_in_backward(params if self.gradients == "in_backward" else [], self.temporaries), measuring_alone():
            for p in params:
                p.grad = torch.zeros_like(p) if self.gradients == "kept" else None
            self._step()  # the first step allocates what later steps reuse (lazy state); measure the second
            for p in params:
                p.grad = torch.zeros_like(p) if self.gradients == "kept" else None
            with PeakMemory(self.device) as mem:
                self._step()
        return mem.peak_bytes

    def peak_wrapped(self, choices: Sequence[Choice]) -> int:
        for c in choices:
            checkpoint_wrapper(c.block.module, policy=c.policy)
        try:
            return self.peak()
        finally:
            for c in choices:
                unwrap_checkpoint(c.block.module)

    def _step(self) -> None:
        self.model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model(*self.inputs)
        self._loss(out).backward()

    def _loss(self, out: Any) -> torch.Tensor:
        """The user's loss of ``out``, or the sum of its tensors (which saves nothing for backward)."""
        if self.loss_fn is not None:
            loss = self.loss_fn(out)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError(f"loss_fn must return a one-element tensor that requires grad, got {_described(loss)}: there is no training step to measure")
            return loss
        leaves = [t for t in tensors_in(_as_tree(out)) if t.requires_grad]
        if not leaves:
            raise ValueError(f"{type(self.model).__name__}'s output holds no tensor that requires grad: there is no training step to measure")
        return sum(t.float().sum() for t in leaves)


@contextlib.contextmanager
def _updated_in_backward(params: Sequence[torch.Tensor], temporaries: float):
    """Each of ``params`` as an optimizer stepped in backward leaves it, without changing it: its
    gradient freed once whole, after ``temporaries`` tensors of its size were made (its update's)."""

    def update(p):
        scratch = torch.empty(int(temporaries * p.numel()), dtype=p.dtype, device=p.device)
        del scratch
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(update) for p in params]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _refuse_below_the_gradients(model: nn.Module, gradients: str, budget: int, unwrapped: int, hint: str = "") -> None:
    """A budget below the gradients that the step allocates: no wrapping meets it, and that is known
    from one measured step, before any block is measured. ``hint``: :meth:`MemoryBudget.percent_hint`."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if gradients == "allocated" and budget < grads:
        raise BudgetTooLowError(
            f"no wrapping of {type(model).__name__}'s blocks meets the memory budget of {format_bytes(budget)}{hint} ({budget / unwrapped:.2f} of the "
            f"unwrapped {format_bytes(unwrapped)}): the parameters' gradients, which this step allocates (gradients=\"allocated\"), are "
            f"{format_bytes(grads)} ({grads / unwrapped:.2f} of the step at this input) and no checkpoint frees them. A larger batch makes "
            "activations the larger share; gradients=\"kept\" (zero_grad(set_to_none=False)) or gradients=\"in_backward\" "
            "(trunksplit.optimizer_in_backward) leaves them out of the step; nothing was changed", None, unwrapped)


def _refuse_stepped_in_backward(model: nn.Module) -> None:
    """Measuring a budget runs training steps: refuse a model whose parameters an optimizer already
    updates in backward (:func:`trunksplit.optimizer_in_backward` marks them), which those steps would train."""
    if any(in_backward_mark(p) is not None for p in model.parameters()):
        raise ValueError(f"{type(model).__name__}'s parameters are stepped in backward by optimizer_in_backward: the steps that measure a "
                         "budget would update them. Wrap first, then call optimizer_in_backward (give its update's size with "
                         "update_temporaries=trunksplit.in_backward.update_temporaries(optimizer_class, kwargs)); nothing was changed")


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}{'' if value.requires_grad else ' that requires no grad'}"
    return type(value).__name__


def _as_tree(out: Any) -> Any:
    """A dataclass output (transformers' outputs are dicts already) as a dict of its fields."""
    if is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in fields(out)}
    return out
