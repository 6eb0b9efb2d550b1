"""SwAV (Caron et al. 2020): each large crop's code, an equal partition of the batch among the
prototypes (Sinkhorn-Knopp over every rank's scores), predicted from every other crop.

At small batches an equal partition of the batch alone is a weak target (a few images a
prototype). SwAV's answer, at 256 images a step and fewer, is a queue: the unit
embeddings of the last ``METHOD.SWAV.QUEUE_LENGTH`` large crops of every rank (SwAV: 3840 at a
total batch of 256, filling from epoch 15), scored against the current prototypes and partitioned
with the batch; only the batch's own codes are kept. It fills from ``QUEUE_START_STEP`` on and is
used once full. The other stabiliser, the prototypes left alone for the first
``METHOD.SWAV.FREEZE_PROTOTYPES_STEPS`` steps (SwAV: ``freeze_prototypes_niters``), is a gradient
rule: :func:`trunksplit.ssl.optim.gradient_rule`.

Sharp edges: the queue is the same on every rank: each step every rank's embeddings join it,
gathered, and each rank scores its share (``QUEUE_LENGTH / world`` rows, so the length divides by
the number of ranks) with its own batch. The ranks' shares are the whole queue, as SwAV's queues,
one per rank, are; the codes are the same. The queue is a buffer of the model, so checkpoints save
and resume it (DDP's broadcast of rank 0's buffers before a forward copies the same values).
"""
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from .losses import gather_with_grad, sinkhorn, step_ranks
from .model import SSLModel


def check_queue_shares(cfg, world: int) -> None:
    """Refuse a queue that ``world`` ranks cannot share equally (each scores ``QUEUE_LENGTH / world`` rows)."""
    length = cfg.METHOD.SWAV.QUEUE_LENGTH
    if cfg.METHOD.NAME == "swav" and length % world:
        raise ValueError(f"METHOD.SWAV.QUEUE_LENGTH {length} cannot be shared by this run's {world} ranks (each scores an equal part of "
                         f"it): give a multiple of {world}, such as {length - length % world or world}")


def queue_is_full(model: SSLModel) -> bool:
    """Whether the model has a queue and every row of it holds an embedding: then it is used. Counted on the
    host (``model.queue_rows``), not read from the queue: on a GPU a read waits for every kernel queued."""
    return model.queue is not None and model.queue_rows >= model.queue.shape[1]


@torch.no_grad()
def swav_codes(cfg, model: SSLModel, scores: List[torch.Tensor], embeddings: Optional[List[torch.Tensor]], step: int) -> Dict[int, torch.Tensor]:
    """The codes of the step's large crops (the first ``DATA.CROP_COUNTS[0]`` of ``scores``, by crop index):
    Sinkhorn over every rank's batch and, once full, the queue; then, from ``QUEUE_START_STEP`` on, the
    large crops' ``embeddings`` (every rank's) join the queue, its oldest rows leaving."""
    m, large = cfg.METHOD, cfg.DATA.CROP_COUNTS[0]
    queue = model.queue
    if queue is not None and embeddings is None:
        raise ValueError("SwAV with a queue needs the step's embeddings: call the model with embeddings=True")
    full, codes = queue_is_full(model), {}
    if full:
        rank, world, _ = step_ranks()
        weight = model.prototypes.weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight  # FSDP2 holds a shard outside forward
        shares = [q.chunk(world)[rank] @ weight.t() for q in queue]
    for i in range(large):
        batch = scores[i].detach().float()
        both = torch.cat([shares[i].float(), batch]) if full else batch
        codes[i] = sinkhorn(both, m.SINKHORN_ITERATIONS, m.SINKHORN_EPSILON)[-batch.shape[0]:]
    if queue is not None and step >= m.SWAV.QUEUE_START_STEP:
        for i in range(large):
            rows = gather_with_grad(embeddings[i])
            _push(queue[i], rows)
        model.queue_rows = min(model.queue_rows + rows.shape[0], queue.shape[1])  # every large crop's queue took as many rows
    return codes


def _push(queue: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` at the front of ``queue`` (in place), its last rows dropped."""
    n = min(rows.shape[0], queue.shape[0])
    if n < queue.shape[0]:
        queue[n:] = queue[:-n].clone()
    queue[:n] = rows[:n]


@torch.no_grad()
def fill_queue(model: SSLModel) -> SSLModel:
    """Fill the model's queue, where it has one, with unit rows: a step measured now uses it, as a run's steps do
    once it is full (the memory a batch is fitted to). Returns ``model``."""
    if model.queue is not None:
        rows = torch.randn(model.queue.shape, generator=torch.Generator().manual_seed(0))
        model.queue.copy_(torch.nn.functional.normalize(rows, dim=-1))
        model.queue_rows = model.queue.shape[1]
    return model
