"""Memory measurement: :class:`PeakMemory`, on CUDA and on CPU alike.

On CUDA the caching allocator's statistics; elsewhere :class:`_TensorAccounting`, a
dispatch mode that counts every tensor storage created and when it dies. The
profiler uses the same tracker to measure each unit. :class:`ProfiledPeak` reads
torch.profiler's allocation events instead, for what the tracker cannot see (compiled code,
FSDP2's gathered weights).
"""
from typing import Optional, Union

import torch
from torch.utils.flop_counter import flop_registry

from ..recompute.checkpoint import is_expensive, is_heavy

# The CPU tracker needs to see every tensor an op creates and to know when its
# storage dies. torch has no public API for either, so the two private imports
# live here and nowhere else.
from torch.multiprocessing.reductions import StorageWeakRef  # private: storage liveness
from torch.utils._python_dispatch import TorchDispatchMode  # private: see every op's outputs


class _TensorAccounting(TorchDispatchMode):
    """Counts the bytes of every storage created under it, and when each dies.

    The count is exact for tensor storages (views are counted once); it does not
    see allocator rounding or caching, nor a kernel's internal scratch memory.
    """

    def __init__(self):
        super().__init__()
        self.live = {}  # storage id -> (weak ref, bytes)
        self.current = 0
        self.peak = 0
        self.expensive = set()  # storages created by ops that cost FLOPs ("save_expensive" keeps them)
        self.heavy = set()  # those of them created by heavy ops ("save_heavy" keeps them)
        self.cheap_bytes = 0  # bytes created by all other ops: what recomputing them writes
        self.light_flops = 0  # FLOPs of the expensive ops that are not heavy: what "save_heavy" runs again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._sweep()
        # Outputs that share an input's storage (views, in-place ops, detach) allocate nothing.
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors_in((args, kwargs))}
        heavy = is_heavy(func, args)
        if is_expensive(func) and not heavy:
            self.light_flops += flop_registry[getattr(func, "overloadpacket", func)](*args, **kwargs, out_val=out)
        for t in tensors_in(out):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata not in inputs and ref.cdata not in self.live:
                self.live[ref.cdata] = (ref, storage.nbytes())
                self.current += storage.nbytes()
                if is_expensive(func):
                    self.expensive.add(ref.cdata)
                    if heavy:
                        self.heavy.add(ref.cdata)
                else:
                    self.cheap_bytes += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def _sweep(self):
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]
            self.expensive.discard(k)  # a new storage may reuse the id
            self.heavy.discard(k)


def tensors_in(tree):
    """Every tensor in ``tree`` (nested tuples, lists and dict values), in order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for t in tree:
            yield from tensors_in(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from tensors_in(t)


class PeakMemory:
    """Measure the peak bytes allocated inside a ``with`` block, beyond what was live at entry.

    On a CUDA device it reads the caching allocator's statistics
    (``max_memory_allocated``); elsewhere it counts tensor storages created under
    it (a dispatch mode: slower, exact for tensors, blind to a kernel's internal
    scratch and to storage resized in place, as FSDP2 frees and refills its gathered
    weights: :func:`profiled_peak` sees those). Use it around a training step whose parameters already hold
    gradients to get the step's peak beyond parameters and gradients.

        with PeakMemory(device) as mem:
            loss = model(x).sum(); loss.backward()
        print(mem.peak_bytes)
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_bytes: Optional[int] = None
        self._mode = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _TensorAccounting()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
            self._mode = None


class ProfiledPeak:
    """Peak bytes allocated inside a ``with`` block, beyond what was live at its start, as
    ``torch.profiler``'s memory events count them (``peak_bytes``).

    The meter for what the tensor tracker cannot see on CPU: compiled code (a dispatch-mode
    tracker around a ``torch.compile``d model makes dynamo skip compiling it, while the
    profiler sees inductor's own allocations) and FSDP2's gathered weights (their storage is
    freed and refilled in place). Its figure is the allocator's requests, kernels' scratch
    buffers included, so it reads a few percent above the tensor tracker on eager code;
    compare it only with itself. CPU memory only: on CUDA, :class:`PeakMemory`'s allocator
    statistics see all of this already."""

    def __init__(self):
        self.peak_bytes: Optional[int] = None

    def __enter__(self) -> "ProfiledPeak":
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        # private: torch.profiler has no public list of allocation events with their sizes and times
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        current = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            current += e.nbytes()
            peak = max(peak, current)
        self.peak_bytes = peak


def profiled_peak(fn) -> int:
    """``fn()``'s peak as :class:`ProfiledPeak` measures it."""
    with ProfiledPeak() as meter:
        fn()
    return meter.peak_bytes
