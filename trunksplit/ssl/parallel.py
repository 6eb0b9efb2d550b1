"""Processes and devices: one process, or many under ``torchrun`` (what runs on them: ``strategy.py``)."""
import contextlib
import ctypes
import ctypes.util
import os
import sys
import warnings

import torch
import torch.distributed as dist


def setup_distributed(cfg):
    """(rank, world size, device); joins the process group that torchrun describes, if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.TRAIN.DEVICE:
        try:
            device = torch.device(cfg.TRAIN.DEVICE)
        except RuntimeError:
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE!r} is not a device; use cpu, cuda, cuda:1, or leave it empty") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("TRAIN.DEVICE asks for cuda but this machine has no usable GPU; use cpu, or leave it empty to pick")
        if device.type == "cuda" and device.index is None:  # "cuda": this process's GPU, as torchrun numbers them
            device = torch.device("cuda", local_rank)
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE}: this machine has {torch.cuda.device_count()} GPU(s)")
        if no_such_device(device):  # mps, xpu, meta: said here, not as a traceback from moving the model
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE}: torch has no usable {device.type} device on this machine; use cpu, or leave it empty to pick")
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_host_memory()
    if world > 1 and not dist.is_initialized():
        if cfg.DISTRIBUTED.BACKEND == "nccl" and device.type != "cuda":
            raise ValueError(f"DISTRIBUTED.BACKEND nccl runs on GPUs, and this run is on {device.type}: use gloo, or leave it empty (gloo on CPU)")
        dist.init_process_group(cfg.DISTRIBUTED.BACKEND or ("nccl" if device.type == "cuda" else "gloo"), init_method="env://")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def no_such_device(device: torch.device) -> bool:
    """Whether this machine lacks ``device``: torch's module for its type (``torch.cuda``, ``torch.mps``,
    ``torch.xpu``) says it is not available, or has no device of its index; a type without one (meta)
    holds no data to train on. The CPU is always there."""
    if device.type == "cpu":
        return False
    backend = getattr(torch, device.type, None)
    if not hasattr(backend, "is_available") or not backend.is_available():
        return True
    return device.index is not None and device.index >= backend.device_count()


def autocast_for(cfg, device: torch.device):
    """The autocast ``TRAIN.AUTOCAST`` asks for on ``device`` (a fresh context each call), or none."""
    if not cfg.TRAIN.AUTOCAST:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if cfg.TRAIN.AUTOCAST == "bf16" else torch.float16)


def warn_of_fp16_on_a_cpu(cfg, device: torch.device) -> None:
    """``TRAIN.AUTOCAST fp16`` on a CPU trains, but most CPUs have no fp16 arithmetic and torch runs fp16
    convolutions there far slower than fp32 (docs/config.md has a figure); bf16 is the CPU's fast half precision.
    A warning, not a refusal: a CPU with fp16 units (AMX-FP16) may run it well."""
    if cfg.TRAIN.AUTOCAST == "fp16" and device.type == "cpu":
        warnings.warn("TRAIN.AUTOCAST fp16 on a CPU: most CPUs have no fp16 arithmetic, and torch runs fp16 convolutions there many "
                      "times slower than fp32. bf16 is what a CPU runs fast (TRAIN.AUTOCAST bf16), or train in fp32 (TRAIN.AUTOCAST \"\")",
                      UserWarning, stacklevel=3)


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep the blocks a step frees for the next step, as CUDA's caching allocator
    does, where by default it hands blocks above its mmap threshold (128 KiB, raised as blocks are freed, so
    how many varies run to run) back to the system and the next step page-faults them in again: the step
    runs faster and the ``"time"`` objective's prices hold (measured: docs/benchmarks.md). Blocks above
    32 MiB (glibc's ceiling) are still returned. Linux's glibc only; where the user set any ``MALLOC_*``
    variable, theirs win. True if set."""
    if any(k.startswith("MALLOC_") for k in os.environ) or not sys.platform.startswith("linux"):
        return False
    try:  # glibc's mallopt, by ctypes: torch has no say over the host's allocator
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    return all([mallopt(m_mmap_threshold, 32 * 2**20), mallopt(m_trim_threshold, 2**31 - 1), mallopt(m_top_pad, 64 * 2**20)])
