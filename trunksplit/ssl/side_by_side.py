"""One step of the run's model with and without checkpointing, side by side, at the end of a run: what
the launcher's last line and ``summary.json`` (``memory_vs_plain``) report, and ``trunksplit report``
draws beside the run's step peaks."""
import contextlib
import functools
from typing import Callable, Optional

import torch

from ..in_backward import holding_updates
from .grouped import by_crop_group
from .model import same_size_runs
from .optim import build_optimizer


def side_by_side(cfg, model, optimizer, crops, autocast, kept: bool, strategy) -> Optional[dict]:
    """One step with and without checkpointing, each copy stepped in backward as the model is, if it
    is (:func:`compare_with_plain`); on rank 0, or under FSDP2 on every rank (the copies are sharded).
    None where :func:`not_run_because` says why."""
    if not_run_because(cfg, strategy) or not (strategy.sharded or strategy.rank == 0):
        return None
    stepping = _stepping_copies(cfg, optimizer) if cfg.OPTIM.IN_BACKWARD else None
    copies = functools.partial(strategy.comparison_copy, cfg, model)
    return compare_with_plain(copies, strategy.comparison_meter, crops, autocast, kept, stepping, by_crop_group(cfg, crops))


def not_run_because(cfg, strategy) -> str:
    """Why the run's last step is not set beside a step without checkpointing; empty where it is."""
    if cfg.TRAIN.MEMORY_LIMIT:  # on a CPU nothing stops the plain step but the host running out
        return "TRAIN.MEMORY_LIMIT is set, and a step without checkpointing would pass it"
    if strategy.sharded and strategy.device.type == "cuda":  # on one rank alone (DDP's), a GPU's error leaves the line out
        return "FSDP2 on a GPU: a rank without room for a step without checkpointing would leave the others waiting in a collective"
    return ""


def _stepping_copies(cfg, optimizer) -> Callable:
    """What steps a copy of the model in backward as ``optimizer`` steps the model: the same
    optimizer, its state loaded (so that the copy's first step makes none)."""

    def stepping(copy):
        copy_optimizer = build_optimizer(cfg, copy)
        copy_optimizer.load_state_dict(optimizer.state_dict())
        return copy_optimizer

    return stepping


def compare_with_plain(copy_of: Callable, meter: Callable, crops, autocast, kept_gradients: bool, stepping: Optional[Callable] = None,
                       grouped: bool = False) -> Optional[dict]:
    """Peak bytes of one step of the model and of a plain (never checkpointed) copy, side by side.

    ``copy_of(plain)`` makes each copy of the student, one at a time, so the real model is untouched
    (the strategy's: a deep copy; under FSDP2, one built and sharded afresh), and ``meter(copy)``
    meters its step (this process alone; under FSDP2 every rank's copy together). Both run the same
    surrogate loss on the same crops, their gradients where the loop leaves them between steps
    (None, or kept zeros); ``stepping(copy)``, where given, steps each copy's optimizer in backward.
    ``grouped``: both run each crop group's forward and backward in turn, as the training step does.
    None where a GPU has no room for a copy.
    """
    peaks = {}
    for name in ("checkpointed", "plain"):
        try:
            m = copy_of(plain=name == "plain")
            for p in m.parameters():  # put the gradients where the loop keeps them (a deep copy drops .grad)
                p.grad = torch.zeros_like(p) if kept_gradients and p.requires_grad else None
            steps = stepping(m) if stepping is not None else None
            with meter(m) as mem:
                runs = list(same_size_runs(crops)) if grouped else [(0, len(crops))]
                for k, (start, stop) in enumerate(runs):
                    with holding_updates(m) if k < len(runs) - 1 else contextlib.nullcontext():  # as the grouped step does (the trunk plans for it)
                        with autocast:  # the forward only, as in training: autocast keeps its casts of the weights until it exits
                            loss = sum(o.float().pow(2).mean() for o in m(crops[start:stop]))
                        loss.backward()
        except torch.cuda.OutOfMemoryError:
            return None
        peaks[name] = mem.peak_bytes
        del m, steps
    return peaks
