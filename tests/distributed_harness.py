"""Run a function in real processes on the gloo backend, with a timeout so a hang fails."""
import contextlib
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_threads(world_size: int) -> int:
    """Threads per worker: the test process's cores shared out. Each worker taking all of them
    oversubscribes the machine, and OpenMP kernels then run several times slower."""
    return max(1, torch.get_num_threads() // world_size)


@contextlib.contextmanager
def threads_of_workers(world_size: int):
    """Run a single-process reference with the workers' thread count: the same CPU kernels, with
    the same reduction order (a convolution's depends on it), so results compare bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(worker_threads(world_size))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _entry(fn, rank, world_size, port, args, errors, threads):
    try:
        torch.set_num_threads(threads)  # see worker_threads
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_processes(fn, world_size=2, args=(), timeout=240):
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; fail on error or hang.

    A run whose worker the C++ runtime aborted (SIGABRT, "terminate called without an active
    exception") without any Python error is run once more: seen once in a full suite on a
    loaded 2-core machine and not reproduced in ten runs since, under load too. A second abort
    fails."""
    try:
        _run_once(fn, world_size, args, timeout)
    except _Aborted:
        _run_once(fn, world_size, args, timeout)


class _Aborted(AssertionError):
    pass


# Workers start from a fork server that imported torch, trunksplit and torchvision once (per test
# process), not from a fresh interpreter each: a spawned worker spent seconds importing them. The
# server has run no kernel, so its children start with no OpenMP pool to inherit.
_PRELOAD = ["torch", "torch.distributed", "torchvision", "trunksplit.trunk", "trunksplit.distributed", "trunksplit.ssl.loop"]


def _run_once(fn, world_size, args, timeout):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, errors, worker_threads(world_size))) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s (hang)")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise (_Aborted if set(bad) == {-6} else AssertionError)(f"worker exit codes {bad}")
