"""vissl's manual DDP helpers, on public ``torch.distributed`` API.

Why manual: reentrant checkpointing runs each segment's backward inside the
outer backward, so DDP's autograd hooks fire for a parameter once per forward of
the segment; with several forwards per step (two SimCLR views, multi-crop) DDP
fails with "marked ready twice". vissl's answer, kept here: run forward and
backward under ``ddp.no_sync()``, broadcast buffers before the forward
(:func:`manual_sync_params`), and all-reduce gradients after backward
(:func:`manual_gradient_all_reduce`). With non-reentrant checkpointing plain DDP
works and is the default path.
"""
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def manual_gradient_reduction(model: nn.Module, config_flag: bool) -> bool:
    """Whether to reduce gradients by hand: the config asks for it and the model is DDP-wrapped."""
    return bool(config_flag) and isinstance(model, DistributedDataParallel)


def manual_sync_params(model: DistributedDataParallel) -> None:
    """Broadcast the module's buffers from the first rank of the model's process group.

    What DDP's forward does when ``broadcast_buffers`` is on, done by hand for a
    forward that runs under ``no_sync``. vissl called ``DDP._sync_params``, which
    torch removed in 1.11. Buffers are sent in a few flat buckets.
    """
    _require_ddp(model)
    if not model.broadcast_buffers:
        return
    group = model.process_group
    src = dist.get_global_rank(group, 0)
    for bucket in _buckets(list(model.module.buffers())):
        flat = _flatten(bucket)
        dist.broadcast(flat, src, group=group)
        _unflatten_into(flat, bucket)


def manual_gradient_all_reduce(model: DistributedDataParallel) -> None:
    """Average every parameter's gradient over the model's process group.

    Gradients travel in a few flat buckets per device and dtype, all in flight at
    once, and are divided by the size of the model's process group (not of the
    whole world). A gradient that is ``None`` on some ranks and not on others is
    taken as zeros, so every rank makes the same calls and the result is the
    same everywhere; one that is ``None`` on every rank stays ``None``.
    """
    _require_ddp(model)
    group = model.process_group
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    grads = []
    for p, somewhere in zip(params, has_grad.tolist()):
        if somewhere:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise NotImplementedError("manual_gradient_all_reduce does not reduce sparse gradients")
            grads.append(p.grad)
    size = dist.get_world_size(group)
    pending = []
    for bucket in _buckets(grads):
        flat = _flatten(bucket)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        flat.div_(size)
        _unflatten_into(flat, bucket)


def _require_ddp(model):
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(model).__name__}")


def _buckets(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Tensors grouped by (device, dtype), in order, each group cut at BUCKET_BYTES."""
    groups: Dict[Tuple, List[List]] = {}
    for t in tensors:
        chunks = groups.setdefault((t.device, t.dtype), [])
        nbytes = t.numel() * t.element_size()
        if not chunks or (chunks[-1][0] and chunks[-1][1] + nbytes > BUCKET_BYTES):
            chunks.append([[], 0])
        chunks[-1][0].append(t)
        chunks[-1][1] += nbytes
    return [members for chunks in groups.values() for members, _ in chunks]


def _flatten(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
