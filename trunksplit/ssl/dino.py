"""DINO (Caron et al. 2021): a student and its EMA teacher, centred and sharpened teacher outputs.

The student is the checkpointed trunk with DINO's head; it sees every crop, one trunk run (and
one plan) per resolution. The teacher is a plain copy of the student (the trunk one unsplit
segment: under ``no_grad`` there is nothing to recompute), sees the global crops only, and follows
the student's weights by an exponential moving average whose momentum rises from
``METHOD.DINO.TEACHER_MOMENTUM`` to 1 on a cosine. The teacher's outputs are centred by a running
mean of them (``METHOD.DINO.CENTER_MOMENTUM``, over every rank's batch) and sharpened by a
temperature that warms up linearly from ``WARMUP_TEACHER_TEMPERATURE`` to ``TEACHER_TEMPERATURE``;
the student's temperature is ``METHOD.TEMPERATURE``.

Sharp edge: the teacher is held by the model (``model.teacher``) so that checkpoints save and
resume it, but it has no trainable parameters: optimizers and DDP leave it alone.
"""
import math

import torch
import torch.distributed as dist

from .losses import dino_loss, step_ranks
from .model import SSLModel


def teacher_temperature(cfg, step: int) -> float:
    """Linear from ``WARMUP_TEACHER_TEMPERATURE`` to ``TEACHER_TEMPERATURE`` over the warm-up steps, then constant."""
    d = cfg.METHOD.DINO
    if step >= d.TEACHER_TEMPERATURE_WARMUP_STEPS:
        return d.TEACHER_TEMPERATURE
    return d.WARMUP_TEACHER_TEMPERATURE + (d.TEACHER_TEMPERATURE - d.WARMUP_TEACHER_TEMPERATURE) * step / d.TEACHER_TEMPERATURE_WARMUP_STEPS


def teacher_momentum(cfg, step: int) -> float:
    """The EMA momentum after ``step``: a cosine from ``TEACHER_MOMENTUM`` to 1 over TRAIN.STEPS."""
    base = cfg.METHOD.DINO.TEACHER_MOMENTUM
    return 1 - (1 - base) * (math.cos(math.pi * step / max(1, cfg.TRAIN.STEPS - 1)) + 1) / 2


def teacher_outputs(cfg, model: SSLModel, crops) -> list:
    """The teacher's outputs of the step's global crops (the first ``DATA.CROP_COUNTS[0]``), without a graph.

    Run before the student's forward, as DINO's own loop does: the teacher's forward then holds a unit's
    input and output beside nothing of the student's; run after it, that sat on every activation the
    student keeps for backward, above the whole step's peak at large batches (docs/planning.md, "Fit the whole SSL step")."""
    with torch.no_grad():
        return model.teacher(crops[: cfg.DATA.CROP_COUNTS[0]])


def dino_step_loss(cfg, model: SSLModel, student_out, teacher_out, step: int) -> torch.Tensor:
    """The step's DINO loss against ``teacher_out`` (:func:`teacher_outputs`); moves the centre towards them
    (after the loss used it)."""
    loss = dino_loss(student_out, teacher_out, model.center, cfg.METHOD.TEMPERATURE, teacher_temperature(cfg, step))
    update_center(model.center, teacher_out, cfg.METHOD.DINO.CENTER_MOMENTUM)
    return loss


@torch.no_grad()
def update_center(center: torch.Tensor, teacher_out, momentum: float) -> None:
    """``center <- momentum * center + (1 - momentum) * mean of the teacher's outputs`` over every crop of every rank."""
    total = torch.cat(teacher_out).float().sum(dim=0, keepdim=True)
    count = sum(t.shape[0] for t in teacher_out)
    _, world, live = step_ranks()
    if live:  # alone_as_one_of: this rank's mean
        dist.all_reduce(total)
        count *= world
    center.mul_(momentum).add_(total / count, alpha=1 - momentum)


@torch.no_grad()
def update_teacher(model: SSLModel, momentum: float) -> None:
    """``teacher <- momentum * teacher + (1 - momentum) * student``, parameter by parameter (by name)."""
    student = dict(model.named_parameters())
    for name, t in model.teacher.named_parameters():
        t.mul_(momentum).add_(student[name].detach(), alpha=1 - momentum)
