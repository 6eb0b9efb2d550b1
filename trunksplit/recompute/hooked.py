"""Non-reentrant checkpointing by saved-tensor hooks, at a fraction of torch's Python cost per
saved tensor.

torch's non-reentrant ``checkpoint`` runs Python on every tensor a checkpointed function saves:
in the forward (a holder object, a weak reference, a metadata record under ``no_grad``), at
the unpack (graph-task bookkeeping) and in the recompute (handles in weak dictionaries). Where
ops are small (a GPU at a few images) that costs as much as the ops. Here a saved tensor costs an
index in the forward and a list lookup at the unpack, and the recompute keeps what it saves in a
list: the cuts step as fast as under torch's reentrant mode (docs/benchmarks.md, "trunksplit's own
non-reentrant checkpoint").

What is exact: the same as torch's non-reentrant checkpoint without a ``context_fn``: outputs,
gradients, the RNG state (CPU and the inputs' device, restored for the recompute), autocast
(re-entered as the forward had it, device and CPU), the default device (``with torch.device(...)``),
``torch.autograd.grad`` and ``retain_graph`` (a second backward recomputes again), and nesting: the inputs are saved through the saved-tensor
hooks in force, so an enclosing checkpoint drops them as it drops its own. The recompute stops
once it has made the last tensor the forward saved, as torch's early stop does. What differs:
the determinism check compares shape and dtype (torch also compares devices) when a recomputed
tensor is used; selective checkpointing (torch's ``context_fn``) is not offered: the selective
regions run under torch's checkpoint (see :func:`trunksplit.recompute.checkpoint.run_checkpointed`).
"""
import contextlib
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states


class _Stop(Exception):
    """Raised by the recompute's pack hook once every tensor the forward saved is made again."""


class _SaveInputs(torch.autograd.Function):
    """Saves a checkpoint's tensor inputs as an autograd node does, through the saved-tensor
    hooks in force: under an enclosing checkpoint they are that checkpoint's to drop and
    remake. Its output only anchors the node; no backward ever reaches it."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty(0)  # an allocation of nothing, on the host: no kernel

    @staticmethod
    def backward(ctx, *grads):  # never called: the node's output is never used
        return (None,) * (1 + len(ctx.saved_tensors))


# What gives every _SaveInputs node a place in the graph (an input that requires grad), made once: no
# backward reaches it, so it never gets a gradient.
_ANCHOR = torch.empty(0, requires_grad=True)


def _device_type(tensors: Sequence[torch.Tensor]) -> str:
    return next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")


def _autocast_state(device_type: str):
    def state(kind: str):
        return dict(enabled=torch.is_autocast_enabled(kind), dtype=torch.get_autocast_dtype(kind),
                    cache_enabled=torch.is_autocast_cache_enabled())
    device = state(device_type) if torch.amp.is_autocast_available(device_type) else None  # none on the meta device
    return device, (state("cpu") if device_type != "cpu" else None)


class _Frame:
    """One checkpointed call: how to rerun it, and what its recompute made."""

    __slots__ = ("function", "skeleton", "saver", "device_type", "cpu_rng", "devices", "device_rng",
                 "autocast", "default_device", "metas", "values")

    def __init__(self, function: Callable, args: tuple):
        self.function = function
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors = [args[i] for i in positions]
        self.skeleton = ([None if isinstance(a, torch.Tensor) else a for a in args], positions)  # not the tensors: the saver holds them
        self.device_type = _device_type(tensors)
        self.cpu_rng = torch.get_rng_state()
        module = getattr(torch, self.device_type, None) if self.device_type != "cpu" else None  # torch.cuda, torch.xpu, ...
        initialized = getattr(module, "is_initialized", lambda: False)()  # not before its first use: its RNG state is not ours to start
        self.devices, self.device_rng = get_device_states(*tensors) if initialized else ([], [])
        self.autocast = _autocast_state(self.device_type)
        self.default_device = torch.get_default_device()  # where factory calls put tensors (`with torch.device(...)`)
        self.saver = _SaveInputs.apply(_ANCHOR, *tensors)  # the output, not its node: torch before 2.14 frees a custom node's saved tensors with its output
        self.metas: List = []  # (shape, dtype) of each tensor the forward saved, in order
        self.values: Optional[List] = None  # the recompute's tensors, each dropped once used

    def pack(self, tensor: torch.Tensor) -> int:
        self.metas.append((tensor.shape, tensor.dtype))
        return len(self.metas) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.values is None or self.values[index] is None:  # first use in this backward, or used by an earlier one (retain_graph)
            self.values = self._rerun()
        value, self.values[index] = self.values[index], None
        shape, dtype = self.metas[index]
        if value.shape != shape or value.dtype != dtype:
            raise RuntimeError(f"checkpoint: the recompute made tensor {index} as {tuple(value.shape)} {value.dtype}, the forward saved "
                               f"{tuple(shape)} {dtype}; the checkpointed function must run the same ops on the same inputs again "
                               f"(no data-dependent branches, no state it changes between calls)")
        return value

    def _rerun(self) -> List[torch.Tensor]:
        args, positions = self.skeleton
        args = list(args)
        for i, t in zip(positions, self.saver.grad_fn.saved_tensors):
            args[i] = t
        values, wanted = [], len(self.metas)

        def pack(tensor):
            values.append(tensor.detach() if tensor.requires_grad else tensor)
            if len(values) == wanted:
                raise _Stop
            return None  # the recompute's own graph is dropped

        device, cpu = self.autocast
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            if device is not None:
                stack.enter_context(torch.autocast(self.device_type, **device))
            if cpu is not None:
                stack.enter_context(torch.autocast("cpu", **cpu))
            if self.default_device.type != "cpu":  # a device context costs every op a dispatch: entered only where it was
                stack.enter_context(torch.device(self.default_device))
            stack.enter_context(saved_tensors_hooks(pack, _unused))
            stack.enter_context(torch.enable_grad())
            try:
                self.function(*args)
            except _Stop:
                pass
        if len(values) != wanted:
            raise RuntimeError(f"checkpoint: the recompute saved {len(values)} tensors for backward, the forward {wanted}; the checkpointed "
                               f"function must run the same ops again (no data-dependent branches, no state it changes between calls)")
        return values


def _unused(_):  # nothing unpacks what the recompute's own graph saved
    return None


def checkpoint_by_hooks(function: Callable, *args) -> Any:
    """``function(*args)``, its saved tensors dropped and made again in backward (non-reentrant).

    Positional tensors in ``args`` are kept (through the saved-tensor hooks in force) to rerun
    it; anything else ``function`` uses is closed over, as torch's non-reentrant checkpoint
    does. Under ``torch.no_grad()`` nothing is saved, and ``function`` simply runs.

    >>> y = checkpoint_by_hooks(block, x)   # like torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    """
    if not torch.is_grad_enabled():
        return function(*args)
    frame = _Frame(function, args)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args)
