"""Memory measurement: :class:`PeakMemory`, on CUDA and on CPU alike.

On CUDA the caching allocator's statistics; elsewhere :class:`_TensorAccounting`, a
dispatch mode that counts every tensor storage created and when it dies. The
profiler uses the same tracker to measure each unit. :class:`ProfiledPeak` reads
torch.profiler's allocation events instead, for what the tracker cannot see (compiled code,
FSDP2's gathered weights).
"""
import contextlib
import gc
import os
import weakref
from typing import Callable, Iterable, Optional, Union

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
        self._died = []  # ids of live storages freed since the last sweep: their weak refs' callbacks, on any thread
        self.current = 0
        self.peak = 0
        self.expensive = set()  # storages created by ops that cost FLOPs ("save_expensive" keeps them)
        self.heavy = set()  # those of them created by heavy ops ("save_heavy" keeps them)
        self.cheap_bytes = 0  # bytes created by all other ops: what recomputing them writes
        self.light_flops = 0  # FLOPs of the expensive ops that are not heavy: what "save_heavy" runs again
        self.held = 0  # bytes a caller says are held outside the storages seen here (see peak_with_held)
        self.peak_with_held = 0  # the peak of current + held

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
            key = StorageWeakRef(storage).cdata
            if key not in inputs and key not in self.live:
                # torch keeps a storage's Python object for as long as the storage lives, so a weak ref
                # to it dies with the storage: deaths come to the tracker instead of it polling every storage
                self.live[key] = (weakref.ref(storage, lambda _, key=key, died=self._died: died.append(key)), storage.nbytes())
                self.current += storage.nbytes()
                if is_expensive(func):
                    self.expensive.add(key)
                    if heavy:
                        self.heavy.add(key)
                else:
                    self.cheap_bytes += storage.nbytes()
        self.peak = max(self.peak, self.current)
        self.peak_with_held = max(self.peak_with_held, self.current + self.held)
        return out

    def current_bytes(self) -> int:
        """The bytes alive now (``current`` is brought up to date at each op)."""
        self._sweep()
        return self.current

    def _sweep(self):
        """Forget the storages freed since the last sweep; run before new ones are counted, as an id may be reused."""
        while self._died:
            k = self._died.pop()
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


def storage_bytes(tree) -> int:
    """Bytes of the storages the tensors in ``tree`` hold, each storage once (a view holds its whole base)."""
    return sum({StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in tensors_in(tree)}.values())


# a process-wide count, not a thread's: CUDA's backward runs its hooks and a checkpoint's recompute on threads of its own
_ALONE = [0]


def is_measuring_alone() -> bool:
    """True while this rank runs a step or a unit alone on purpose, to measure it (planning, ``fit``,
    a step's baseline, a probe): other ranks do not run the same, so a layer that communicates
    (:class:`trunksplit.SyncBatchNorm`) does not, and an update in backward is this rank's own."""
    return _ALONE[0] > 0


@contextlib.contextmanager
def measuring_alone():
    """Mark what runs inside as this rank's alone (:func:`is_measuring_alone`)."""
    _ALONE[0] += 1
    try:
        yield
    finally:
        _ALONE[0] -= 1


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

    def __init__(self, device: Optional[Union[str, torch.device]] = None, made_again: Optional[Callable[[], Iterable[torch.Tensor]]] = None):
        """``made_again()``, called at the block's end: tensors whose storages, where made inside it, replaced
        storages of their size made before it (DDP's gradient buckets, made anew as the second step starts).
        The CPU tracker cannot see storages made before it die, so it does not count those made again;
        exact where they were made before the block's peak. CUDA's statistics see both: unused there."""
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_bytes: Optional[int] = None
        self._mode = None
        self._made_again = made_again

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
            again = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in self._made_again()} if self._made_again else {}
            self.peak_bytes = self._mode.peak - sum(n for key, n in again.items() if key in self._mode.live)
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
    statistics see all of this already.

    Sharp edge, handled: the profiler records allocations and frees only on the threads it
    profiles. A collective's tensors (gloo's copy of a reduce-scatter's input, and the tensors
    handed to it, such as FSDP2's reduce-scatter output) are freed wherever the last reference
    dies, often on gloo's worker thread, so their frees go missing at random and they would seem
    to live on to the end. A collective's tensor never seen freed is counted as freed when the
    last op that used it on a profiled thread ended (the collective itself, or a later read such
    as FSDP2 adding the output into a kept gradient), unless a tensor still holds its storage at
    the end (FSDP2's new sharded gradient is that output). So the figure is the step's as if every
    holder let go when its caller did; on a loaded machine gloo's thread may let go later, and the
    real peak is that much higher. Any other allocation whose address is given out again was
    freed, unseen, before that; other unseen frees can still only add to a reading, so the
    smallest of several readings of one step is the closest to the truth.

    Quiet: unless ``KINETO_LOG_LEVEL`` is set, it sets it to 6 before a process first profiles, which
    keeps the profiler's own start and stop lines off stderr for the rest of the process (yours too)."""

    def __init__(self):
        self.peak_bytes: Optional[int] = None

    def __enter__(self) -> "ProfiledPeak":
        # kineto (the profiler's engine) prints a line to stderr at every start and stop, and an error
        # where no GPU is found: thousands of lines while FSDP2 ranks are planned. It reads its level
        # once, when a process first profiles; a level the user set is kept (6: errors and those lines off)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # record_shapes: the ops' tensor arguments (their storages) tell which tensors a collective used
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        # private: torch.profiler has no public list of allocation events with their sizes,
        # addresses, times and enclosing ops
        changes = _cpu_memory_changes(self._prof.profiler.kineto_results.experimental_event_tree())
        current = peak = 0
        for _, nbytes in sorted(changes):
            current += nbytes
            peak = max(peak, current)
        self.peak_bytes = peak


def host_bytes_available() -> Optional[int]:
    """Bytes this machine can still give without swapping (Linux's ``MemAvailable``); None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_bytes_available(device: Union[str, torch.device]) -> int:
    """Bytes a step on the GPU ``device`` can still be given: its free memory (``torch.cuda.mem_get_info``) and what
    this process's caching allocator holds, which it hands out again (the model's own tensors among it)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def meter_name(device: Union[str, torch.device], allocator: bool) -> str:
    """What a figure measured on ``device`` counts, as a plan says it: tensor storages (the tracker of
    :class:`PeakMemory` on CPU), the caching allocator (CUDA), or torch.profiler's allocation events."""
    if torch.device(device).type == "cuda":
        return "the CUDA allocator's bytes (max_memory_allocated)"
    return "allocations torch.profiler saw" if allocator else "tensor bytes"


def allocator_meter(device: Union[str, torch.device]):
    """The allocator's meter for ``device`` (its ``peak_bytes``: beyond what was live at its start):
    on CUDA the caching allocator's statistics (:class:`PeakMemory`), which see cuDNN's workspaces;
    elsewhere torch.profiler's allocation events (:class:`ProfiledPeak`), which see oneDNN's
    scratch. A step measured so is planned from units profiled so (``profile_units(allocator=True)``).

    Sharp edge: on CUDA each reading resets the allocator's peak statistics, so a reading of your own
    around a first training step that plans inside it (a cost-aware trunk profiling its units) starts
    again at the last unit profiled: plan up front (``trunk.plan_for(sample)``), as the launcher does."""
    return PeakMemory(device) if torch.device(device).type == "cuda" else ProfiledPeak()


def _cpu_memory_changes(roots) -> list:
    """(time, bytes) of every CPU allocation (+) and free (-) under ``roots``, with the missing
    frees put back (see :class:`ProfiledPeak`)."""
    allocations, uses = _allocations_and_uses(roots)
    changes, live = [], {}
    for e in sorted(allocations, key=lambda e: e.start_time_ns):
        alloc = e.typed[1]
        if alloc.alloc_size > 0:
            if alloc.ptr in live:  # the address is given out again: the last holder was freed unseen
                last = live[alloc.ptr]
                changes.append((_freed_at(last, uses, before=e.start_time_ns), -last.typed[1].alloc_size))
            live[alloc.ptr] = e
        else:
            live.pop(alloc.ptr, None)
        changes.append((e.start_time_ns, alloc.alloc_size))
    freed = [(ptr, _freed_at(e, uses), e.typed[1].alloc_size) for ptr, e in live.items()]
    freed = [f for f in freed if f[1] is not None]  # collectives' tensors, never seen freed
    held = _live_storages() if freed else set()  # a scan of every Python object: only when needed
    changes += [(when, -size) for ptr, when, size in freed if ptr not in held]
    return changes


def _allocations_and_uses(roots) -> tuple:
    """The CPU allocation events under ``roots``, and for each storage address the ops that took
    it as an argument: ``{address: [(start, end, op is a collective)]}``."""
    allocations, uses, stack = [], {}, list(roots)
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        kind, fields = e.typed
        if kind.name == "Allocation" and fields.device.type == "cpu":
            allocations.append(e)
        elif kind.name == "TorchOp":
            for ptr in _storage_addresses(fields.inputs):
                uses.setdefault(ptr, []).append((e.start_time_ns, e.end_time_ns, e.name.startswith("c10d::")))
    return allocations, uses


def _storage_addresses(inputs) -> set:
    """The storage addresses of an op's tensor arguments, lists of tensors included."""
    found = set()
    for arg in inputs:
        for item in arg if isinstance(arg, list) else (arg,):
            if getattr(item, "storage_data_ptr", None):
                found.add(item.storage_data_ptr)
    return found


def _collective(allocation):
    """The ``c10d::`` op an allocation was made in, if any."""
    op = allocation.parent
    while op is not None and not op.name.startswith("c10d::"):
        op = op.parent
    return op


def _freed_at(allocation, uses: dict, before: Optional[int] = None) -> Optional[int]:
    """When an allocation whose free the profiler missed was freed: a collective's tensor (made in
    one or handed to one) when the last op that used it ended, anything else just before its
    address was given out again (``None`` if it was not)."""
    born = allocation.start_time_ns
    used = [u for u in uses.get(allocation.typed[1].ptr, ()) if born <= u[0] and (before is None or u[0] < before)]
    collective = _collective(allocation)
    when = before
    if collective is not None or any(is_collective for _, _, is_collective in used):
        when = max([end for _, end, _ in used] + [collective.end_time_ns if collective is not None else born])
        when = min(when, before) if before is not None else when
    return when


def _live_storages() -> set:
    """The addresses of the storages Python's tensors hold now (wrapper subclasses such as DTensor
    hold none: their inner tensors are counted themselves)."""
    return {t.untyped_storage().data_ptr() for t in gc.get_objects()
            if issubclass(type(t), torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
            and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__}


def profiled_peak(fn) -> int:
    """``fn()``'s peak as :class:`ProfiledPeak` measures it."""
    with ProfiledPeak() as meter:
        fn()
    return meter.peak_bytes
