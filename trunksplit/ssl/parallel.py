"""Processes and devices: one process, or many under ``torchrun``."""
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..distributed.ddp import manual_sync_params
from ..distributed.fsdp import shard_trunk


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
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE}: this machine has {torch.cuda.device_count()} GPU(s)")
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(cfg.DISTRIBUTED.BACKEND or ("nccl" if device.type == "cuda" else "gloo"), init_method="env://")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def wrap_for_processes(cfg, model: nn.Module, world: int) -> nn.Module:
    """The model as the step calls it: in DDP when there are several processes, or sharded with
    FSDP2 (the trunk unit by unit, then the whole model) under ``DISTRIBUTED.STRATEGY fsdp``."""
    if cfg.DISTRIBUTED.STRATEGY == "fsdp":
        if not dist.is_initialized():
            raise ValueError("DISTRIBUTED.STRATEGY fsdp shards the model across processes: run under torchrun --nproc_per_node=N (N >= 2)")
        shard_trunk(model.trunk)
        fully_shard(model)  # the root: the heads, and the trunk's group under it
        # the trunk and the model return views (flatten, chunk); the loop never writes into them in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return model
    manual = cfg.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION
    if world > 1 and not manual and model.trunk.use_reentrant and len(set(cfg.DATA.CROP_SIZES)) > 1:
        raise ValueError(
            "reentrant checkpointing under native DDP with several trunk forwards per step fails "
            "('marked ready twice'): set DISTRIBUTED.MANUAL_GRADIENT_REDUCTION True or USE_REENTRANT False"
        )
    return DDP(model) if world > 1 else model


def end_with_rank0_buffers(cfg, wrapped: nn.Module, model: nn.Module, world: int) -> None:
    """BatchNorm statistics of the last step differ per rank: end every rank with rank 0's, as saved."""
    if world == 1:
        return
    if cfg.DISTRIBUTED.STRATEGY == "fsdp":
        broadcast_buffers(model)
    else:
        manual_sync_params(wrapped)


def broadcast_buffers(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers. FSDP2 replicates buffers and each rank moves its own
    BatchNorm statistics; a sharded checkpoint saves a replicated tensor once, from whichever rank
    it picks, so the statistics are made one before each save (as DDP makes them one before each
    forward). Running statistics never change a training step's outputs."""
    for b in model.buffers():
        dist.broadcast(b, src=0)
