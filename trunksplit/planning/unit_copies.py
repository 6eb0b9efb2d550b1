"""Private copies of a chain's units, which the profiler runs instead of the units themselves (the
model's parameters, gradients, BatchNorm statistics and hooks stay untouched), and what a copy is
given when measured alone: its input, and the gradient arriving at its output, as in a chain."""
import copy
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..recompute.checkpoint import map_tensors
from ..chains.blocks import HOOK_DICT_NAMES, hook_dicts
from .memory import tensors_in


def private_copy(unit: nn.Module, like=None) -> nn.Module:
    """A copy of ``unit`` with no hooks, whose trainable parameters hold zero gradients (as from
    a training's second step on).

    ``like``: the unit's input. A sharded unit whose input is of another floating dtype than its
    weights runs under FSDP2's mixed precision (``MixedPrecisionPolicy(param_dtype=...)``: the
    root casts the input, each unit gathers its weights in that dtype), so its copy's parameters
    are cast to the input's dtype, and the profile is of the step that will run. Under autocast
    the input's dtype is autocast's doing (a bf16 convolution's output into a BatchNorm whose
    weights and statistics stay fp32): the copy keeps its weights' dtypes."""
    m = _unsharded_copy(unit) if _is_sharded(unit) else copy.deepcopy(unit)
    dtype = _floating_dtype(like)
    if dtype is not None and _is_sharded(unit) and not _under_autocast(like):
        for p in m.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    for sub in m.modules():
        _drop_hooks(sub)
    for p in m.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    return m


def _under_autocast(like) -> bool:
    """Whether autocast is on for the device of ``like``'s first tensor."""
    device = next((t.device for t in tensors_in(like)), None)
    return device is not None and torch.is_autocast_enabled(device.type)


def _floating_dtype(like):
    """The dtype of the first floating tensor in ``like`` (a tensor, or a tuple, list or dict of them)."""
    return next((t.dtype for t in tensors_in(like) if t.is_floating_point()), None)


def _drop_hooks(module: nn.Module) -> None:
    """Remove the module hooks that ``deepcopy`` carried over to a private copy.

    A user's hook (logging, feature capture) must not fire on the profiler's
    copies (see :func:`trunksplit.chains.blocks.hook_dicts`)."""
    for hooks in hook_dicts(module):
        hooks.clear()


def _is_sharded(unit: nn.Module) -> bool:
    return isinstance(unit, FSDPModule) or any(isinstance(p, DTensor) for p in unit.parameters())


def _unsharded_copy(module: nn.Module) -> nn.Module:
    """A plain copy of a module that FSDP2 has sharded (which refuses ``deepcopy``): the module's
    own class, its attributes, full weights and fresh hook dicts, so profiling it touches nothing.

    ``full_tensor()`` all-gathers each sharded weight: every rank profiles the same units in the
    same order, as every rank plans at the same first training forward. FSDP2 swaps a module's
    class for a subclass of ``FSDPModule`` and the original class; the copy takes the original
    back (an implementation detail of ``fully_shard``, relied on here and nowhere else)."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    clone = object.__new__(cls)  # not cls.__new__: fx's GraphModule.__new__ makes a new class, without the unit's forward
    # FSDP2's own state lives in the module's __dict__ too (keys below); the copy leaves it behind
    clone.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith(("__composable_api_state_key", "_fsdp", "_is_fsdp"))})
    for name in HOOK_DICT_NAMES:  # the copy must not share (nor clear) the original's hooks
        if name in module.__dict__:
            clone.__dict__[name] = type(module.__dict__[name])()
    clone._parameters = {n: None if p is None else nn.Parameter((p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(), p.requires_grad)
                         for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else b.detach().clone() for n, b in module._buffers.items()}
    clone._modules = {n: None if m is None else _unsharded_copy(m) for n, m in module._modules.items()}
    return clone


def first_input_with_gradient(units: Sequence[nn.Module], x=None) -> int:
    """The index of the first unit whose input carries a gradient in a training step on ``x``: 0 where ``x``
    requires grad (an input gradient: saliency, adversarial steps), else the one after the first unit with a
    trainable parameter. Images carry none, nor does what frozen units make of them (a fine-tuned trunk's
    frozen stem and first stage): those units save nothing for backward, and no backward runs for them.
    ``len(units)`` where nothing trains."""
    if any(t.requires_grad for t in tensors_in(x)):
        return 0
    return min(units_without_gradient(units) + 1, len(units))


def units_without_gradient(units: Sequence[nn.Module], x=None) -> int:
    """How many units lead the chain that no gradient reaches in a training step on ``x`` (``None``: images):
    the frozen units before the first one with a trainable parameter, none where ``x`` requires grad,
    all where nothing trains. They save nothing for backward, so a segment among them runs plainly
    (:func:`trunksplit.recompute.checkpoint.run_checkpointed`)."""
    if any(t.requires_grad for t in tensors_in(x)):
        return 0
    return next((i for i, u in enumerate(units) if any(p.requires_grad for p in u.parameters())), len(units))


def unit_input(h, input_needs_grad: bool):
    """A unit's input as in a chain: a non-leaf copy where it needs a gradient (so that an
    in-place first op is allowed); the chain's input (a list or dict of tensors, maybe) as it is."""
    leaf = map_tensors(lambda t: t.detach().requires_grad_(input_needs_grad), h)
    return map_tensors(torch.clone, leaf) if input_needs_grad else leaf


class GradientLayout(NamedTuple):
    """Where a gradient lies in its storage: its strides, its offset, and the storage's elements. A
    slice of a larger gradient (``torch.cat``'s backward gives each input one) keeps the whole alive,
    and a ``view`` of it cannot be taken without a copy."""

    stride: Tuple[int, ...]
    offset: int
    storage: int


def unit_loss(out, layout: Optional[GradientLayout] = None) -> Optional[torch.Tensor]:
    """A scalar whose backward makes the gradient arriving at each of ``out``'s tensors inside the measured
    window, held by nobody else (freed once consumed, as in a step), laid out as in a step: ``layout``,
    what the next unit's backward gives a tensor output where measured (see :func:`gradient_layout`),
    else :func:`arriving_layout`. None where no output needs a gradient."""
    outs = [t for t in tensors_in(out) if t.requires_grad]
    given = layout if layout is not None and len(outs) == 1 and len(layout.stride) == outs[0].dim() else None
    return sum(_Arriving.apply(t, given or arriving_layout(t)).sum() for t in outs) if outs else None


class _Arriving(torch.autograd.Function):
    """Identity forward; its backward makes the gradient of ``layout`` afresh (ones, as bytes do not depend
    on values), whatever the gradient given to it, as the next unit's backward would."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, layout: GradientLayout) -> torch.Tensor:
        ctx.layout, ctx.like = layout, (t.shape, t.dtype, t.device)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, _):
        (stride, offset, storage), (shape, dtype, device) = ctx.layout, ctx.like
        return torch.ones(storage, dtype=dtype, device=device).as_strided(shape, stride, offset), None


def arriving_ones(t: torch.Tensor) -> torch.Tensor:
    """Ones laid out as the gradient that arrives at ``t`` in a step, where not measured: made by the next
    unit's backward (or the loss's), it is contiguous, or channels-last where ``t`` is (a convolution's
    input gradient follows its input's format), whatever ``t``'s own strides. torchvision's ViT layers
    return a transposed layout (their attention runs sequence-first); a gradient with those strides would
    be copied where a view needs it contiguous: one activation more than a step holds."""
    return torch.ones_like(t, memory_format=_arriving_format(t))


def arriving_layout(t: torch.Tensor) -> GradientLayout:
    """The layout of :func:`arriving_ones` for ``t`` (nothing is allocated)."""
    return GradientLayout(torch.empty_like(t, device="meta", memory_format=_arriving_format(t)).stride(), 0, t.numel())


def _arriving_format(t: torch.Tensor) -> torch.memory_format:
    channels_last = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if channels_last else torch.contiguous_format


def gradient_layout(g: torch.Tensor) -> GradientLayout:
    """How ``g`` lies in its storage, which :func:`unit_loss` makes again: a ConvNeXt block's output gets
    a contiguous gradient from the pooling after the last one, where the others get a channels-last one; a
    Sequencer's stage, a permuted one from the convolution after it; VOLO's last block, a slice of the
    gradient of the class token's ``cat``."""
    return GradientLayout(tuple(g.stride()), g.storage_offset(), g.untyped_storage().nbytes() // g.element_size())
