"""``checkpoint_wrapper``: make one module run under activation checkpointing, fairscale's API
done so that names, ``state_dict`` keys, ``deepcopy`` and ``pickle`` all keep working.

Exactness (outputs, gradients, RNG, autocast, BatchNorm once) comes from
:func:`trunksplit.recompute.checkpoint.run_checkpointed`, which the wrapper calls.
"""
import copy
from typing import Callable, List

import torch
from torch import nn

from ..chains.blocks import layer_splittable_before
from .checkpoint import map_tree, run_checkpointed
from .policies import POLICIES, RECOMPUTE, WRAP_POLICIES


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
    _checkpoint_policy = RECOMPUTE.name

    def forward(self, *args, **kwargs):
        forward = super().forward
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self._checkpoint_offload_to_cpu:
            args, kwargs = _offload(args), _offload(kwargs)
            forward = _loading_back(forward)
        return run_checkpointed(forward, [self], args, kwargs, keep=POLICIES[self._checkpoint_policy].keep)

    def __reduce_ex__(self, protocol):
        if isinstance(self, torch.fx.GraphModule):  # fx's own reduce rebuilds the class it makes per instance
            rebuild, args, *rest = _as_plain(self, lambda plain: plain.__reduce_ex__(protocol))
            return (_rebuild_checkpointed_from, (rebuild, args), *rest)
        # Rebuild through the plain class so pickle never looks the generated class up by name.
        return (_rebuild_checkpointed, (self._checkpoint_base,), self.__dict__)

    def __deepcopy__(self, memo):
        # The plain module's copy (its class's own __deepcopy__ where it has one: fx's GraphModule builds
        # a class per instance, which a copy through the wrapped class would loop into), wrapped again.
        twin = _as_plain(self, lambda plain: copy.deepcopy(plain, memo))
        twin.__class__ = _checkpointed_class(type(twin))
        return twin


def _as_plain(module: "_Checkpointed", run: Callable):
    """``run(module)`` with ``module`` unwrapped for the call (its class restored after, whatever happens)."""
    wrapped = module.__class__
    module.__class__ = module._checkpoint_base
    try:
        return run(module)
    finally:
        module.__class__ = wrapped


_CHECKPOINTED_CLASSES: dict = {}


def _checkpointed_class(base: type) -> type:
    """The wrapped class of ``base``, made once per class; not kept for fx's GraphModules, whose classes are
    made one per instance (a traced trunk's units): kept, each would outlive its module."""
    cls = _CHECKPOINTED_CLASSES.get(base)
    if cls is None:
        cls = type(f"Checkpointed{base.__name__}", (_Checkpointed, base), {"_checkpoint_base": base})
        if not issubclass(base, torch.fx.GraphModule):
            _CHECKPOINTED_CLASSES[base] = cls
    return cls


def _rebuild_checkpointed(base: type) -> nn.Module:
    module = base.__new__(base)
    module.__class__ = _checkpointed_class(base)
    return module


def _rebuild_checkpointed_from(rebuild: Callable, args: tuple) -> nn.Module:
    """A wrapped module unpickled from its plain class's own reduce (fx's GraphModule); its settings are in its ``__dict__``."""
    module = rebuild(*args)
    module.__class__ = _checkpointed_class(type(module))
    return module


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False, *, policy: str = RECOMPUTE.name) -> nn.Module:
    """Make every later call of ``module`` run under activation checkpointing.

    Returns ``module`` itself (its class swapped for a checkpointed subclass), so
    names, ``state_dict`` keys and parameters of the module and its parents stay as
    they were. Handles keyword arguments, non-tensor and nested outputs, dropout
    (RNG restored), autocast (restored in the recompute, CPU bf16 included),
    BatchNorm (statistics updated once) and inputs that do not require grad. Under
    ``no_grad`` it runs the module once, with no checkpoint. Wrapping a wrapped
    module changes nothing. :func:`unwrap_checkpoint` undoes it. A module whose first
    op is in place (``ReLU(inplace=True)``, see :func:`layer_splittable_before`) is
    refused with a ``ValueError``: it would overwrite the input the recompute needs.

    ``offload_to_cpu`` moves the tensors the checkpoint keeps (the module's inputs)
    to CPU memory, pinned when CUDA is present, until backward needs them. On CPU
    tensors it is a no-op.

    ``policy`` says what the checkpoint keeps for backward, as a region's policy does
    (see :mod:`trunksplit.recompute.regions`): ``"recompute"`` (the default) keeps only
    the inputs and reruns the module whole; ``"save_expensive"`` also keeps the outputs
    of its convolutions, matmuls and attention, so backward reruns only the cheap ops
    (norms, activations, adds); ``"save_heavy"`` keeps only the heavy ones' outputs.
    Sharp edge: a selective policy must not run inside another checkpoint (a wrapped
    parent, a trunk's segment); there it keeps what it saves until the outer backward.
    Wrapping a wrapped module again changes only these two settings.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("checkpoint_wrapper cannot wrap a TorchScript module; wrap the eager module before scripting")
    if policy not in WRAP_POLICIES:
        raise ValueError(f"checkpoint_wrapper's policy must be one of {WRAP_POLICIES}, got {policy!r} (the module is left as it was)")
    if not isinstance(module, _Checkpointed) and not layer_splittable_before(module):
        raise ValueError(
            f"checkpoint_wrapper cannot wrap {type(module).__name__} with inplace=True: it overwrites its input, which "
            "the checkpoint keeps for the recompute, and backward would fail. Build it with inplace=False, or wrap "
            "the block that contains it (the module is left unwrapped)"
        )
    if not isinstance(module, _Checkpointed):
        module.__class__ = _checkpointed_class(type(module))
    module._checkpoint_offload_to_cpu = bool(offload_to_cpu)
    module._checkpoint_policy = policy
    return module


def is_checkpoint_wrapped(module: nn.Module) -> bool:
    return isinstance(module, _Checkpointed)


def checkpoint_wrapped_names(module: nn.Module) -> List[str]:
    """The names of ``module``'s checkpoint-wrapped submodules, in ``named_modules()`` order."""
    return [name for name, m in module.named_modules() if isinstance(m, _Checkpointed)]


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint_wrapper` in place; returns the module."""
    if isinstance(module, _Checkpointed):
        module.__class__ = module._checkpoint_base
        module.__dict__.pop("_checkpoint_offload_to_cpu", None)
        module.__dict__.pop("_checkpoint_policy", None)
    return module


class _Offloaded:
    """A CPU copy of an input tensor and the device it goes back to."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor):
        pin = torch.cuda.is_available()
        self.device = tensor.device
        # copy_ is differentiable, so gradients still reach the original tensor.
        self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin).copy_(tensor, non_blocking=pin)


def _offload(tree):
    return map_tree(lambda t: _Offloaded(t) if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t, tree)


def _onload(tree):
    return map_tree(lambda t: t.tensor.to(t.device, non_blocking=True) if isinstance(t, _Offloaded) else t, tree)


def _loading_back(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return forward(*_onload(args), **_onload(kwargs))

    return run
