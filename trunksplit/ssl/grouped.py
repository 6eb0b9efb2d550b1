"""The multi-crop step one crop group at a time: each resolution's forward, its share of the loss
and its backward before the next resolution's forward, so that one group's activations are alive
at a time instead of every group's until one backward.

DINO's and SwAV's losses are sums of terms that each read one student crop, against targets that
carry no gradient: the teacher's sharpened outputs (DINO), the codes of the large crops' scores,
detached (SwAV). So the targets come first (the teacher's forward; SwAV's codes from the first
group, which holds the large crops), then for each group its forward, its terms divided by the
step's count of terms, and its backward. No extra compute. BatchNorm sees what it saw: the trunk
runs once per resolution in the whole step too.

Exact: the same gradients, summed in another order: a parameter's gradient is the groups' parts
added as each backward ends, where the whole step's backward adds them in reverse order. Two
groups add the same two numbers (bit for bit); three or more can round differently (float).
Under DDP gradients are reduced across ranks once, with the last group's backward: the strategy's
``accumulating`` context holds the earlier groups' gradients on each rank (``no_sync``); FSDP2
reduce-scatters each group's, which add up as shards (held unsharded, they would fill every rank
with the whole model's gradients; a sum of reduced parts rounds otherwise than a reduced sum).
An optimizer stepped in backward updates nothing
before the last group's backward (:func:`trunksplit.in_backward.holding_updates`), then each
parameter from its whole gradient, freeing it: the earlier groups' gradients wait, alive, as they
do in a whole step's one backward (there, the later calls' parts wait in autograd's buffers for the
first call's), but beside one group's activations instead of every group's.
"""
import contextlib
from typing import Callable, ContextManager, List

import torch

from ..in_backward import holding_updates
from .dino import teacher_outputs, teacher_temperature, update_center
from .losses import cross_entropy_terms, dino_targets, log_softmax_at
from .model import SSLModel, same_size_runs
from .swav import swav_codes


def by_crop_group(cfg, crops) -> bool:
    """Whether this step runs group by group: DINO or SwAV, ``TRAIN.BACKWARD_BY_CROP_GROUP`` and more than one resolution."""
    wanted = bool(cfg.TRAIN.BACKWARD_BY_CROP_GROUP) and cfg.METHOD.NAME in ("dino", "swav")
    return wanted and len(list(same_size_runs(crops))) > 1


def held_calls(cfg, crops) -> List[bool]:
    """For each of the step's trunk calls (a run of crops of one size), whether its backward runs
    with the updates of an optimizer stepped in backward held: every group but the last, grouped.
    Such a call keeps its gradients, and the trunk plans it so (``CheckpointedTrunk.updates_held``)."""
    runs = len(list(same_size_runs(crops)))
    held = by_crop_group(cfg, crops) and bool(cfg.OPTIM.IN_BACKWARD)
    return [held and k < runs - 1 for k in range(runs)]


def backward_calls(cfg, crops) -> List[bool]:
    """For each of the step's trunk calls (a run of crops of one size), whether a backward runs through it: every
    call but, grouped, a lone large crop's (``DATA.CROP_COUNTS [1, ...]``), its own target, read by no loss term."""
    runs = list(same_size_runs(crops))
    if not by_crop_group(cfg, crops):
        return [True] * len(runs)
    targets = cfg.DATA.CROP_COUNTS[0]
    return [any(j != i for i in range(targets) for j in range(start, stop)) for start, stop in runs]


def grouped_step(cfg, model: SSLModel, wrapped, crops, step: int, autocast: ContextManager, backward: Callable[[torch.Tensor], None],
                 accumulating: Callable[[], ContextManager]) -> torch.Tensor:
    """One training step's forward and backward, group by group; returns the step's loss (detached).

    ``wrapped``: what the loop calls (the model, or its DDP or FSDP2 wrapper); ``backward(part)``
    runs one group's backward (scaled, for fp16); ``accumulating()`` is the context in which every
    group but the last runs, its gradients kept on this rank for the last one's reduction (and by
    an optimizer stepped in backward for the last one's update)."""
    m, num_targets = cfg.METHOD, cfg.DATA.CROP_COUNTS[0]
    terms = num_targets * (len(crops) - 1)  # every (target crop, other crop) pair of the step
    targets, teacher_out = None, None
    if m.NAME == "dino":
        with autocast:
            teacher_out = teacher_outputs(cfg, model, crops)
            targets = dict(enumerate(dino_targets(teacher_out, model.center, teacher_temperature(cfg, step))))
    groups = list(same_size_runs(crops))
    total = torch.zeros((), device=crops[0].device)  # made where the loss is: a host scalar moved there would wait for the GPU's queue
    # a lone large crop's group, read by no term, runs without a graph: for the BatchNorm statistics its forward
    # moves in the whole step too, and SwAV's codes
    for k, ((start, stop), read) in enumerate(zip(groups, backward_calls(cfg, crops))):
        with contextlib.nullcontext() if k == len(groups) - 1 else _held(model, accumulating):
            with autocast, torch.set_grad_enabled(read and torch.is_grad_enabled()):
                if targets is None:  # SwAV: the large crops' codes, from the first group (it holds them)
                    outputs, embeddings = wrapped(crops[start:stop], embeddings=True)
                    targets = swav_codes(cfg, model, outputs, embeddings, step)
                else:
                    outputs = wrapped(crops[start:stop])
                log_probs = dict(zip(range(start, stop), log_softmax_at(outputs, m.TEMPERATURE)))
                part = cross_entropy_terms(targets, log_probs)[0] / terms
            if read:
                backward(part)
                total = total + part.detach()
    if teacher_out is not None:
        update_center(model.center, teacher_out, m.DINO.CENTER_MOMENTUM)
    return total


@contextlib.contextmanager
def _held(model: SSLModel, accumulating: Callable[[], ContextManager]):
    """An earlier group's backward: its gradients kept on this rank (``accumulating()``) and, stepped in backward, not updated yet."""
    with accumulating(), holding_updates(model):
        yield
