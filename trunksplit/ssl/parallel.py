"""Processes and devices: one process, or many under ``torchrun`` (what runs on them: ``strategy.py``)."""
import contextlib
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..planning.timing import keep_freed_host_memory


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


HALF_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}  # TRAIN.AUTOCAST's values


def autocast_for(cfg, device: torch.device):
    """The autocast ``TRAIN.AUTOCAST`` asks for on ``device`` (a fresh context each call), or none."""
    if not cfg.TRAIN.AUTOCAST:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=HALF_PRECISIONS[cfg.TRAIN.AUTOCAST])


SLOW = 2.0  # a half precision whose convolutions take more than this many times fp32's is warned of


def warn_of_slow_half_precision_on_a_cpu(cfg, device: torch.device) -> None:
    """``TRAIN.AUTOCAST bf16`` or ``fp16`` on a CPU trains, but where the CPU has no arithmetic for it (most
    have none for fp16, x86 CPUs without AVX-512 mostly none for bf16) torch emulates it and its convolutions
    run many times slower than fp32 (docs/config.md has figures). Measured at start, not guessed from the CPU's
    name: a warning with the slowdown and what runs faster here; nothing where the CPU runs it fast."""
    asked = cfg.TRAIN.AUTOCAST
    if asked not in HALF_PRECISIONS or device.type != "cpu":
        return
    slowdown = convolution_slowdown(HALF_PRECISIONS[asked])
    if slowdown <= SLOW:
        return
    other = next(name for name in HALF_PRECISIONS if name != asked)
    other_slowdown = convolution_slowdown(HALF_PRECISIONS[other])
    faster = f", or in {other} (TRAIN.AUTOCAST {other}: it ran {other_slowdown:.1f}x)" if other_slowdown <= SLOW else ""
    warnings.warn(f"TRAIN.AUTOCAST {asked} on this CPU: its {asked} convolutions ran {slowdown:.0f}x as long as fp32's in a check at start "
                  f"(the CPU has no {asked} arithmetic: torch emulates it), so the run trains several times slower than in fp32, if in less "
                  f"memory. Train in fp32 (TRAIN.AUTOCAST \"\"){faster}", UserWarning, stacklevel=3)


def convolution_slowdown(dtype: torch.dtype) -> float:
    """How many times as long a 3x3 convolution's forward and backward take on this CPU under autocast to
    ``dtype`` as in fp32: medians of three, after a first call each (where oneDNN picks its kernel). One small
    ResNet layer (4 images, 32 channels, 28x28): milliseconds in fp32, emulated many times that."""
    g = torch.Generator().manual_seed(0)  # not torch's: the run's randomness stays the run's
    weight, x = (torch.randn(32, 32, 3, 3, generator=g) * 0.05).requires_grad_(), torch.randn(4, 32, 28, 28, generator=g)

    def seconds(dtype_or_none) -> float:
        times = []
        for _ in range(4):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=dtype_or_none or torch.bfloat16, enabled=dtype_or_none is not None):
                y = nn.functional.conv2d(x, weight, padding=1)
            y.float().sum().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    return seconds(dtype) / seconds(None)
