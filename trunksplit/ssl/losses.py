"""SimCLR's NT-Xent, SwAV's swapped prediction (both across ranks) and DINO's distillation loss."""
import contextlib
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..planning.memory import measuring_alone

_ALONE: List[int] = []  # world sizes of the open alone_as_one_of() contexts: process-wide, as CUDA runs backward on its own threads


@contextlib.contextmanager
def alone_as_one_of(world: int):
    """Steps run in this context issue no collective: this process plays the first of ``world`` ranks
    alone. A gather returns its own tensor ``world`` times (the real step's shapes and bytes), a
    reduction leaves its tensor as it is: the values are not the real step's, its memory is. For
    measuring one rank's step in one process (``TRAIN.BATCH_SIZE_PER_RANK 0``), where ranks whose
    measurements differed would otherwise run different collectives, and hang (the model's layers too:
    :func:`trunksplit.planning.memory.measuring_alone`)."""
    _ALONE.append(world)
    try:
        with measuring_alone():
            yield
    finally:
        _ALONE.pop()


def step_ranks() -> Tuple[int, int, bool]:
    """(this rank, the world size, whether collectives run) for the losses' gathers and reductions."""
    if _ALONE:
        return 0, _ALONE[-1], False
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """``t`` reduced over the ranks (summed by default), in place (as it is alone)."""
    if step_ranks()[2]:
        dist.all_reduce(t, op=op)


class _Gather(torch.autograd.Function):
    """all_gather whose backward sends each rank the gradient of its own part, summed over ranks."""

    @staticmethod
    def forward(ctx, x):
        _, world, live = step_ranks()
        parts = [torch.empty_like(x) for _ in range(world)]
        if live:
            dist.all_gather(parts, x.contiguous())
        else:  # alone_as_one_of: its own tensor in every part
            for part in parts:
                part.copy_(x)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        rank, _, _ = step_ranks()
        grad = torch.stack(grads)
        all_reduce_(grad)
        return grad[rank]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' ``x``, concatenated; gradients flow back to every rank's own part."""
    if step_ranks()[1] == 1:
        return x
    return torch.cat(_Gather.apply(x), dim=0)


def chance_loss(method: str, views: int) -> Optional[float]:
    """The loss of a model that cannot tell a view's partner from the other ``views - 1`` (all ranks'
    views: twice the total batch): SimCLR's ln(views - 1), what a run that learned nothing ends at.
    None for SwAV and DINO, whose targets move with the model (no fixed chance level)."""
    return math.log(views - 1) if method == "simclr" and views > 1 else None


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss: each view must pick its partner among all views of all ranks."""
    z1, z2 = F.normalize(z1.float(), dim=1), F.normalize(z2.float(), dim=1)
    b = z1.shape[0]
    rank = step_ranks()[0]
    everyone = torch.cat([gather_with_grad(z1), gather_with_grad(z2)], dim=0)  # [2 * world * b, d]
    n = everyone.shape[0] // 2
    mine = torch.cat([z1, z2], dim=0)
    logits = mine @ everyone.t() / temperature
    own = torch.cat([torch.arange(b) + rank * b, torch.arange(b) + rank * b + n]).to(z1.device)
    logits[torch.arange(2 * b), own] = float("-inf")  # a view is not its own positive
    partner = torch.cat([own[b:], own[:b]])
    return F.cross_entropy(logits, partner)


@torch.no_grad()
def sinkhorn(scores: torch.Tensor, iterations: int, epsilon: float) -> torch.Tensor:
    """SwAV's equal-partition soft assignment of a (global) batch to prototypes."""
    scores = scores.float()
    top = scores.max().reshape(1)  # every rank's: a constant over the whole batch cancels in the sums, one per rank would not
    all_reduce_(top, dist.ReduceOp.MAX)
    q = torch.exp((scores - top) / epsilon).t()  # [K, B]
    world = step_ranks()[1]
    total_b = q.shape[1] * world
    k = q.shape[0]
    total = q.sum().reshape(1)
    all_reduce_(total)
    q /= total
    for _ in range(iterations):
        rows = q.sum(dim=1, keepdim=True)
        all_reduce_(rows)
        q /= rows * k
        q /= q.sum(dim=0, keepdim=True) * total_b
    return (q * total_b).t()


def swav_loss(scores: List[torch.Tensor], codes: Dict[int, torch.Tensor], temperature: float) -> torch.Tensor:
    """SwAV's swapped prediction: each large crop's code (``codes``, by crop index; :func:`sinkhorn` of its
    scores, or :func:`trunksplit.ssl.swav.swav_codes`) predicted from every other crop's ``scores``."""
    total, terms = cross_entropy_terms(codes, dict(enumerate(log_softmax_at(scores, temperature))))
    return total / terms


def dino_targets(teacher_out: List[torch.Tensor], center: torch.Tensor, teacher_temperature: float) -> List[torch.Tensor]:
    """The teacher's centred and sharpened distributions, ``softmax((t - center) / teacher_temperature)``, no gradient."""
    return [F.softmax((t.detach().float() - center) / teacher_temperature, dim=-1) for t in teacher_out]


def dino_loss(student_out: List[torch.Tensor], teacher_out: List[torch.Tensor], center: torch.Tensor, student_temperature: float, teacher_temperature: float) -> torch.Tensor:
    """DINO's loss: for each global crop, the cross-entropy between the teacher's centred and
    sharpened distribution (:func:`dino_targets`) and the student's
    (``log_softmax(s / student_temperature)``) on every other crop, averaged over
    those pairs. ``teacher_out`` holds the global crops, which lead ``student_out``."""
    targets = dict(enumerate(dino_targets(teacher_out, center, teacher_temperature)))
    total, terms = cross_entropy_terms(targets, dict(enumerate(log_softmax_at(student_out, student_temperature))))
    return total / terms


def log_softmax_at(outputs: List[torch.Tensor], temperature: float) -> List[torch.Tensor]:
    """Each crop's ``log_softmax(output / temperature)``, in float32."""
    return [F.log_softmax(o.float() / temperature, dim=-1) for o in outputs]


def cross_entropy_terms(targets: Dict[int, torch.Tensor], log_probs: Dict[int, torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """The sum, over target crops ``i`` and predicting crops ``j != i`` (crop indices as keys), of
    ``-(targets[i] * log_probs[j]).sum(-1).mean()``, and how many terms that is. DINO's and SwAV's
    losses are this sum over all crops divided by its count; any subset of ``log_probs`` gives its
    share, which is what lets a multi-crop step run one crop group at a time (:mod:`trunksplit.ssl.grouped`)."""
    total, terms = 0.0, 0
    for i, q in targets.items():
        for j, log_p in log_probs.items():
            if j != i:
                total = total - (q * log_p).sum(dim=-1).mean()
                terms += 1
    return total, terms
