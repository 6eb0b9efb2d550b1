"""Units a profile need not measure twice: a deep trunk repeats its blocks (ResNet-50's res4 runs five
alike after its first, a ViT-B twelve encoder layers), and two units of the same structure, run on
inputs of the same layout, count the same tensor bytes. :func:`trunksplit.planning.profile.profile_units`
measures the first and reuses its figures for the others (what that saves: docs/benchmarks.md, "A repeated
block measured once").

Exact, not approximate: the tensor-accounting tracker counts the storages ops allocate, which depend on
shapes, strides, dtypes and the ops a forward runs, not on values. So the key holds everything those
can depend on: each submodule's class, mode, ``extra_repr`` and attributes, each parameter's and
buffer's layout and ``requires_grad``, and the input's layout. An attribute it cannot compare by value
(nor by its class and plain state, as a transformers config) it compares as itself: a function is the
same function in every unit, any other object is each private copy's own (``deepcopy``), so units
holding one are measured each; so is a unit whose input is not one tensor (a traced chain's tuples).
A stochastic-depth rate (torchvision's ``StochasticDepth``, timm's and transformers' ``DropPath``) counts by whether it
is 0: above 0 it allocates the same mask whatever its value, so blocks whose rates rise one by one are alike.
The allocator's figures (CUDA; ``allocator=True``) depend on what its cache holds: always measured. Wall times
(the ``"time"`` objective's) do not: shared on either meter (``profile._unit_seconds``).
The sharp edge: an op whose output size follows values (``nonzero``, boolean indexing; no vision trunk
here runs one) makes a profile's figures those of its random input anyway, and two blocks alike share them.

    key = measurement_key([unit], h, input_needs_grad)   # None: measure it
"""
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import nn

_MODULE_OWN = frozenset(vars(nn.Module()))  # what every module's __dict__ holds (parameters, buffers, hooks...)
# Stochastic depth (a block's residual branch dropped per sample) allocates the same tensors at every rate
# above 0 (its mask, scaled in place) and none at 0 (it returns its input): a rate counts by whether it is 0.
# Deep trunks raise it block by block (torchvision's ConvNeXt, EfficientNet, Swin; timm's and transformers'
# drop_path_rate), and by value no two blocks would be alike. The modules' own ``extra_repr`` shows the rate only.
# transformers copies one ``XDropPath`` into each model's file (43 alike in transformers 5): matched by that name.
_RATE_ONLY = {("torchvision.ops.stochastic_depth", "StochasticDepth"): "p", ("timm.layers.drop", "DropPath"): "drop_prob"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def measurement_key(modules: Sequence[nn.Module], h, *settings) -> Optional[tuple]:
    """What two measurements of ``modules`` on ``h`` with ``settings`` (hashable) share where they
    give the same figures, or None where that cannot be told (see the module's docstring)."""
    if not isinstance(h, torch.Tensor):
        return None
    keys = tuple(_module_key(m) for m in modules)
    return None if None in keys else (keys, _layout(h), h.requires_grad, settings)


def measured_once(memo: Dict[tuple, dict], key: Optional[tuple], measure: Callable[[], Optional[dict]]) -> Optional[dict]:
    """``measure()``, or a copy of what it returned for ``key`` before (a ``None`` key: always measured)."""
    if key is None:
        return measure()
    if key not in memo:
        memo[key] = measure()
    return None if memo[key] is None else dict(memo[key])


def _module_key(module: nn.Module) -> Optional[tuple]:
    try:
        parts = []
        for name, sub in module.named_modules():
            rate = _rate_attribute(type(sub))
            attrs = tuple((k, v == 0 if k == rate else _value(v)) for k, v in sorted(vars(sub).items()) if k not in _MODULE_OWN)
            parts.append((name, type(sub), sub.training, "" if rate else sub.extra_repr(), attrs))
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            parts.append((name, _layout(t), t.requires_grad))
        key = tuple(parts)
        hash(key)
    except (TypeError, RuntimeError, ValueError):  # an attribute neither plain nor hashable, a tensor without storage: measured each time
        return None
    return key


def _rate_attribute(cls: type) -> Optional[str]:
    """The attribute holding a stochastic-depth module's rate (see ``_RATE_ONLY``), None for any other module."""
    if cls.__module__.startswith("transformers.models.") and cls.__qualname__.endswith("DropPath"):
        return "drop_prob"
    return _RATE_ONLY.get((cls.__module__, cls.__qualname__))


def _value(v, depth: int = 0):
    """An attribute as the key holds it: by value where plain (numbers, strings, their lists and dicts), a
    tensor by its layout, an object of plain state (a transformers config each layer holds) by its class and
    that state, anything else as itself (by identity, for most objects: never another copy's)."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(x, depth) for x in v))
    if isinstance(v, dict) and all(isinstance(k, _PLAIN) for k in v):
        return (dict, tuple((k, _value(x, depth)) for k, x in sorted(v.items(), key=lambda item: (type(item[0]).__name__, repr(item[0])))))
    if isinstance(v, torch.Tensor):
        return _layout(v)
    if depth < 3 and hasattr(v, "__dict__") and not isinstance(v, (nn.Module, type)) and not callable(v):
        return (type(v), _value(vars(v), depth + 1))
    return v


def _layout(t: torch.Tensor) -> tuple:
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().nbytes() if t.device.type != "meta" else 0)
