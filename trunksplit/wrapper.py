"""Checkpointed execution shared by the trunk and :func:`checkpoint_wrapper`.

Everything that runs a function under ``torch.utils.checkpoint`` goes through
:func:`run_checkpointed`, so BatchNorm, RNG, autocast and the reentrant-mode
input quirk are handled once.

What is exact: outputs, every gradient, dropout masks (torch restores the RNG
state), autocast (torch re-enters the forward's autocast state, CPU bf16
included) and BatchNorm buffers (running stats and ``num_batches_tracked`` move
once per training step, as without checkpointing). What is not: the recompute
costs one more forward of the checkpointed part, and code that has side effects
other than BatchNorm's sees them twice (ask :func:`is_recomputing`).

The selective region policy ``"save_expensive"`` (see :func:`trunksplit.regions.run_region`) keeps
the outputs of the ops that cost FLOPs (convolution, matmul, attention: exactly the
ops torch's FLOP counter counts) and recomputes the rest (norms, activations,
pooling, adds) in backward, with no convolution run twice. What it saves depends on
the layout: a torchvision bottleneck alone keeps 83% of what it kept (its in-place
ReLU already shares BatchNorm's output, and its input and convolution outputs stay);
a region of several blocks also drops the blocks' outputs, rebuilt from the kept
convolutions. ``"save_heavy"`` also recomputes the light convolutions (see
:func:`is_heavy`): a bottleneck's expanding 1x1, whose output is its biggest, at a
quarter of the block's FLOPs.
"""
import contextlib
import math
import threading
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase  # BatchNorm, SyncBatchNorm, InstanceNorm: the norms with running stats
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

_local = threading.local()


def is_recomputing() -> bool:
    """True only while a checkpointed forward is being run again for backward."""
    return getattr(_local, "depth", 0) > 0


def batchnorms(modules: Iterable[nn.Module]) -> List[_NormBase]:
    """Every norm layer with running statistics inside ``modules`` (each once).

    BatchNorm is the common case; InstanceNorm with ``track_running_stats=True``
    moves its statistics the same way and needs the same care."""
    seen, found = set(), []
    for top in modules:
        for m in top.modules():
            if isinstance(m, _NormBase) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found


@contextlib.contextmanager
def _recomputing(bns: List[_NormBase]):
    """Mark a recompute and keep BatchNorm buffers as the first forward left them.

    The recompute must normalise with the batch statistics, exactly as the first
    forward did, but must not move the running statistics again. vissl flipped
    ``track_running_stats``, which changes which tensors BatchNorm saves and trips
    non-reentrant checkpoint's determinism check. Instead the momentum is set to 0
    (``(1 - 0) * running + 0 * batch`` is ``running``, bit for bit, and the op
    saves the same tensors) and ``num_batches_tracked``, which BatchNorm bumps in
    Python, is put back afterwards. Restoring in ``finally`` matters: non-reentrant
    checkpoint may stop a recompute early, in the middle of a BatchNorm.
    """
    tracked = [m for m in bns if m.training and m.track_running_stats]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in tracked]
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        for m in tracked:
            m.momentum = 0.0
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)
        _local.depth -= 1


def is_expensive(func, args: Sequence = ()) -> bool:  # args: the signature of a selective policy's choice
    """Whether an aten op is one whose output the selective policy keeps: one that
    torch's FLOP counter counts (convolution, mm/addmm/bmm, attention), so that
    "recomputed FLOPs" and "what the policy recomputes" mean the same ops."""
    return getattr(func, "overloadpacket", func) in flop_registry


HEAVY_MACS = 256  # multiply-adds per output element from which "save_heavy" keeps an op's output


def is_heavy(func, args: Sequence) -> bool:
    """Whether an expensive op (see :func:`is_expensive`) does at least ``HEAVY_MACS``
    multiply-adds per output element: rebuilding its output costs much per byte kept.

    The light ones write much and compute little: a bottleneck's last 1x1 convolution,
    which expands 64 channels to 256 (64 per element), depthwise 7x7 convolutions (49),
    the ResNet stem (147). Judged from the arguments' shapes, as a selective policy
    must (it runs before the op); an op whose count is not known here counts as heavy."""
    if not is_expensive(func):
        return False
    macs = _macs_per_output(getattr(func, "overloadpacket", func).__name__, args)
    return macs is None or macs >= HEAVY_MACS


def _macs_per_output(name: str, args: Sequence) -> Optional[float]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("convolution", "_convolution") and len(tensors) >= 2:
        if len(args) > 6 and args[6]:  # transposed: not judged here
            return None
        return math.prod(tensors[1].shape[1:])  # the weight's input channels per group x kernel size
    if name in ("mm", "bmm") and tensors:
        return tensors[0].shape[-1]
    if name in ("addmm", "baddbmm") and len(tensors) >= 2:
        return tensors[1].shape[-1]
    if "scaled_dot_product" in name and len(tensors) >= 3:
        q, k, v = tensors[:3]
        return k.shape[-2] * (q.shape[-1] + v.shape[-1]) / v.shape[-1]  # scores, then the weighted sum of values
    return None


def _selective_contexts(bns: List[_NormBase], keep: Callable) -> Callable:
    """torch's selective-checkpoint contexts keeping the outputs of the ops ``keep(func,
    args)`` picks, with the BatchNorm guard entered around the recompute.

    The guard's own ops (saving and restoring ``num_batches_tracked``) must run
    outside torch's recompute mode, which replays only the ops the forward ran."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if keep(func, args) else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        forward, recompute = create_selective_checkpoint_contexts(policy)
        return forward, _both(_recomputing(bns), recompute)

    return contexts


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


def run_checkpointed(
    function: Callable,
    bns: List[_NormBase],
    args: Tuple = (),
    kwargs: Optional[dict] = None,
    use_reentrant: bool = False,
    keep: Optional[Callable] = None,
) -> Any:
    """``function(*args, **kwargs)`` under activation checkpointing.

    ``bns`` are the norm layers with running stats that ``function`` runs (see
    :func:`batchnorms`). ``args`` and ``kwargs`` are passed as a tuple and a dict,
    never spread into this call or torch's, so a module's own keyword named
    ``debug``, ``use_reentrant`` or ``function`` reaches the module unchanged.
    Non-reentrant mode (the default) takes keyword arguments (closed over: torch's
    non-reentrant checkpoint follows any tensor the function uses) and any output
    structure. Reentrant mode takes positional tensors only; where no input
    requires grad, torch's reentrant checkpoint would silently give the
    parameters no gradient, so a zero-size input that requires grad is added.

    ``keep(func, args)``, where given, picks the aten ops whose outputs are kept (as
    :func:`is_expensive` does): the others are recomputed (torch's selective
    checkpointing; non-reentrant only). Do not nest it in another checkpoint: torch
    reruns a nested checkpoint as the outer one's first forward ran it, and there it
    would keep its saved outputs outside the autograd graph, where the outer
    checkpoint cannot drop them, from that forward to the backward (see
    :func:`trunksplit.regions.nested_policy`).
    """
    kwargs = kwargs or {}
    if keep is not None and use_reentrant:
        raise ValueError("keeping some ops' outputs needs non-reentrant checkpointing (torch's selective checkpointing); pass use_reentrant=False")
    calls = 0

    def run(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*a, **kw)
        with _recomputing(bns):
            return function(*a, **kw)

    if keep is not None:
        return checkpoint(lambda *a: function(*a, **kwargs), *args, use_reentrant=False, context_fn=_selective_contexts(bns, keep))
    if not use_reentrant:
        return checkpoint(lambda *a: run(*a, **kwargs), *args, use_reentrant=False)
    if kwargs:
        raise TypeError("reentrant checkpointing takes positional arguments only; use use_reentrant=False to pass keywords")
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(run, *args, use_reentrant=True)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    anchor = torch.empty(0, device=device, requires_grad=True)  # same device: torch infers the RNG device from the inputs
    return checkpoint(lambda _anchor, *a: run(*a), anchor, *args, use_reentrant=True)


class _Checkpointed:
    """Mixed in front of a module's own class by :func:`checkpoint_wrapper`.

    Swapping ``__class__`` (rather than patching ``forward`` on the instance as
    fairscale and fairseq do) leaves parameter names and ``state_dict`` keys alone,
    makes no reference cycle (a bound method stored on the instance is one),
    and survives ``copy.deepcopy`` and ``pickle``: a copy runs its own forward,
    not the original's.
    """

    _checkpoint_base: type  # the module's class before wrapping
    # A class default, not only an instance attribute: containers build new instances of
    # their own class (``wrapped_sequential[1:]``), and those must run too.
    _checkpoint_offload_to_cpu = False

    def forward(self, *args, **kwargs):
        forward = super().forward
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self._checkpoint_offload_to_cpu:
            args, kwargs = _offload(args), _offload(kwargs)
            forward = _loading_back(forward)
        return run_checkpointed(forward, batchnorms([self]), args, kwargs)

    def __reduce_ex__(self, protocol):
        # Rebuild through the plain class so pickle never looks the generated class up by name.
        return (_rebuild_checkpointed, (self._checkpoint_base,), self.__dict__)


_CHECKPOINTED_CLASSES: dict = {}


def _checkpointed_class(base: type) -> type:
    cls = _CHECKPOINTED_CLASSES.get(base)
    if cls is None:
        cls = type(f"Checkpointed{base.__name__}", (_Checkpointed, base), {"_checkpoint_base": base})
        _CHECKPOINTED_CLASSES[base] = cls
    return cls


def _rebuild_checkpointed(base: type) -> nn.Module:
    module = base.__new__(base)
    module.__class__ = _checkpointed_class(base)
    return module


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Make every later call of ``module`` run under activation checkpointing.

    Returns ``module`` itself (its class swapped for a checkpointed subclass), so
    names, ``state_dict`` keys and parameters of the module and its parents stay as
    they were. Handles keyword arguments, non-tensor and nested outputs, dropout
    (RNG restored), autocast (restored in the recompute, CPU bf16 included),
    BatchNorm (statistics updated once) and inputs that do not require grad. Under
    ``no_grad`` it runs the module once, with no checkpoint. Wrapping a wrapped
    module changes nothing. :func:`unwrap_checkpoint` undoes it.

    ``offload_to_cpu`` moves the tensors the checkpoint keeps (the module's inputs)
    to CPU memory, pinned when CUDA is present, until backward needs them. On CPU
    tensors it is a no-op.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("checkpoint_wrapper cannot wrap a TorchScript module; wrap the eager module before scripting")
    if isinstance(module, _Checkpointed):
        return module
    module.__class__ = _checkpointed_class(type(module))
    module._checkpoint_offload_to_cpu = bool(offload_to_cpu)
    return module


def is_checkpoint_wrapped(module: nn.Module) -> bool:
    return isinstance(module, _Checkpointed)


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_wrapper` in place; returns the module."""
    if isinstance(module, _Checkpointed):
        module.__class__ = module._checkpoint_base
        module.__dict__.pop("_checkpoint_offload_to_cpu", None)
    return module


class _Offloaded:
    """A CPU copy of an input tensor and the device it goes back to."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor):
        pin = torch.cuda.is_available()
        self.device = tensor.device
        # copy_ is differentiable, so gradients still reach the original tensor.
        self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin).copy_(tensor, non_blocking=pin)


def _map_tree(fn: Callable, tree):
    if isinstance(tree, (list, tuple)):
        items = [_map_tree(fn, t) for t in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return {k: _map_tree(fn, v) for k, v in tree.items()}
    return fn(tree)


def _offload(tree):
    return _map_tree(lambda t: _Offloaded(t) if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t, tree)


def _onload(tree):
    return _map_tree(lambda t: t.tensor.to(t.device, non_blocking=True) if isinstance(t, _Offloaded) else t, tree)


def _loading_back(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return forward(*_onload(args), **_onload(kwargs))

    return run
