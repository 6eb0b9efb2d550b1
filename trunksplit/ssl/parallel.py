"""Processes and devices: one process, or many under ``torchrun`` (what runs on them: ``strategy.py``)."""
import os

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
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(cfg.DISTRIBUTED.BACKEND or ("nccl" if device.type == "cuda" else "gloo"), init_method="env://")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device
