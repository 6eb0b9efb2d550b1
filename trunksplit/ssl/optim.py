"""The recipes' optimizers and schedules: SGD, LARS (SimCLR and SwAV at large batch), AdamW with
a weight-decay schedule (DINO), and the parameter groups that leave biases and norms alone.

``OPTIM.NAME`` picks the optimizer. ``OPTIM.EXCLUDE_BIAS_AND_NORM`` puts biases and every
one-dimensional parameter (BatchNorm, LayerNorm and GroupNorm weights) in a group with no weight
decay and, for LARS, no trust ratio: what vissl's ``exclude_bias_and_norm`` and DINO's
``get_params_groups`` do. The learning rate warms up linearly and then follows a cosine to zero;
the weight decay follows a cosine from ``OPTIM.WEIGHT_DECAY`` to ``OPTIM.WEIGHT_DECAY_END``.
"""
import math
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..in_backward import InBackwardOptimizer, optimizer_in_backward
from ..lars import LARS

OPTIMIZERS = ("sgd", "lars", "adamw")


def is_bias_or_norm(name: str, p: torch.Tensor) -> bool:
    """A bias, or a one-dimensional parameter (the weights of BatchNorm, LayerNorm, GroupNorm)."""
    return name.endswith(".bias") or p.dim() <= 1


def parameter_groups(model: nn.Module, exclude_bias_and_norm: bool) -> List[dict]:
    """The trainable parameters in groups: ``{"params", "weight_decay_scheduled", "lars"}``; with
    ``exclude_bias_and_norm`` the biases and norms form a second group with neither."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not exclude_bias_and_norm:
        return [{"params": [p for _, p in named], "weight_decay_scheduled": True, "lars": True}]
    plain = [p for n, p in named if not is_bias_or_norm(n, p)]
    excluded = [p for n, p in named if is_bias_or_norm(n, p)]
    return [
        {"params": plain, "weight_decay_scheduled": True, "lars": True},
        {"params": excluded, "weight_decay_scheduled": False, "lars": False, "weight_decay": 0.0},
    ]


def build_optimizer(cfg, model: nn.Module, wrapped: Optional[nn.Module] = None):
    """``OPTIM.NAME`` over the model's trainable parameters (a DINO teacher has none); with
    ``OPTIM.IN_BACKWARD``, stepped in backward on ``wrapped`` (the model as the strategy wrapped it:
    DDP updates after each bucket's all-reduce, FSDP2 after each reduce-scatter)."""
    o = cfg.OPTIM
    optimizer_class, kwargs = optimizer_of(cfg)
    groups = parameter_groups(model, o.EXCLUDE_BIAS_AND_NORM)
    groups = groups if o.NAME == "lars" else _without_lars(groups)
    if o.IN_BACKWARD:
        return optimizer_in_backward(model if wrapped is None else wrapped, optimizer_class, param_groups=groups, **kwargs)
    return optimizer_class(groups, **kwargs)


def optimizer_of(cfg) -> Tuple[Callable[..., torch.optim.Optimizer], dict]:
    """``OPTIM.NAME``'s class and the arguments the run builds it with: what a fit prices (its state, what
    one update allocates) and steps, as the run will."""
    o = cfg.OPTIM
    if o.NAME == "sgd":
        return torch.optim.SGD, dict(lr=o.LR, momentum=o.MOMENTUM, weight_decay=o.WEIGHT_DECAY)
    if o.NAME == "lars":
        return LARS, dict(lr=o.LR, momentum=o.MOMENTUM, weight_decay=o.WEIGHT_DECAY, trust_coefficient=o.LARS_TRUST_COEFFICIENT)
    return torch.optim.AdamW, dict(lr=o.LR, betas=tuple(o.BETAS), weight_decay=o.WEIGHT_DECAY)


def gradient_rule(cfg, model: nn.Module, step: int) -> Optional[Callable[[torch.Tensor], bool]]:
    """DINO's two stabilisers (and SwAV's one) as one rule run on each parameter's whole (reduced) gradient
    before its update, or None where none applies: the gradient's norm clipped to ``OPTIM.CLIP_GRAD``
    (scaled by ``clip / (norm + 1e-6)`` where that is below 1: DINO's ``clip_gradients``; under FSDP2 the
    whole gradient's norm, every rank's shard counted: a collective, run by every rank in one order), and the
    last layer left alone in the first steps: DINO's head's for ``METHOD.DINO.FREEZE_LAST_LAYER_STEPS``, SwAV's
    prototypes for ``METHOD.SWAV.FREEZE_PROTOTYPES_STEPS`` (its gradient dropped: no update, no weight decay,
    no optimizer state, as DINO's ``cancel_gradients_last_layer`` and SwAV's ``freeze_prototypes_niters``).
    The rule returns whether to update the parameter."""
    clip = cfg.OPTIM.CLIP_GRAD
    frozen = _frozen_last_layer(cfg, model, step)
    if not clip and frozen is None:
        return None

    def rule(p: torch.Tensor) -> bool:
        if p is frozen:
            p.grad = None
            return False
        if clip and p.grad is not None:
            norm = torch.linalg.vector_norm(p.grad)
            sharded = isinstance(norm, DTensor)  # FSDP2: this rank's shard of the gradient; the whole one's norm, all-reduced
            # at most 1, no branch: "if scale < 1" (DINO's) made the host wait for the GPU at every parameter, and x * 1 is x
            scale = (clip / ((norm.full_tensor() if sharded else norm) + 1e-6)).clamp(max=1.0)
            (p.grad.to_local() if sharded else p.grad).mul_(scale)
        return True

    return rule


def _frozen_last_layer(cfg, model: nn.Module, step: int) -> Optional[torch.Tensor]:
    """The parameter left alone at ``step``: DINO's last layer, SwAV's prototypes, in their first steps; else None."""
    last_layer = getattr(model.head, "last_layer", None)
    if last_layer is not None and step < cfg.METHOD.DINO.FREEZE_LAST_LAYER_STEPS:
        return last_layer
    prototypes = getattr(model, "prototypes", None)
    if prototypes is not None and step < cfg.METHOD.SWAV.FREEZE_PROTOTYPES_STEPS:
        return prototypes.weight
    return None


def apply_gradient_rule(rule: Optional[Callable[[torch.Tensor], bool]], optimizer) -> None:
    """Run ``rule`` on every parameter before the optimizer's step (stepped in backward, before
    each parameter's update instead)."""
    if isinstance(optimizer, InBackwardOptimizer):
        optimizer.before_update = rule
        return
    if rule is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    rule(p)


def gradient_mode(cfg) -> str:
    """How the step leaves gradients, which the trunk plans for: ``"in_backward"`` where the
    optimizer steps in backward, else ``TRAIN.GRADIENTS``."""
    return "in_backward" if cfg.OPTIM.IN_BACKWARD else cfg.TRAIN.GRADIENTS


def keep_gradients(model: nn.Module) -> None:
    """``TRAIN.GRADIENTS kept``: every trained parameter's gradient allocated now (zeros: backward adds
    into them exactly), where it is not yet."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _without_lars(groups: Iterable[dict]) -> List[dict]:
    return [{k: v for k, v in g.items() if k != "lars"} for g in groups]


def with_scaled_lr(cfg, world: int, rank: int):
    """``OPTIM.LR_BATCH_SIZE`` N > 0: the config with ``OPTIM.LR`` (the rate at N images a step)
    scaled to this run's total batch, ``BATCH_SIZE_PER_RANK`` x ``world`` (the linear scaling rule),
    said once (rank 0); the config as it is where N is 0. The run's saved config holds the rate applied."""
    n = cfg.OPTIM.LR_BATCH_SIZE
    if not n:
        return cfg
    batch = cfg.TRAIN.BATCH_SIZE_PER_RANK * world
    scaled = cfg.clone()
    scaled.defrost()
    scaled.OPTIM.LR, scaled.OPTIM.LR_BATCH_SIZE = cfg.OPTIM.LR * batch / n, 0
    scaled.freeze()
    if rank == 0:
        print(f"OPTIM.LR {cfg.OPTIM.LR:g} at {n} images a step is {scaled.OPTIM.LR:.4g} at this run's {batch} (linear scaling rule)")
    return scaled


def learning_rate(cfg, step: int) -> float:
    """Linear warmup over ``OPTIM.WARMUP_STEPS``, then cosine decay to zero over TRAIN.STEPS."""
    base, warmup, total = cfg.OPTIM.LR, cfg.OPTIM.WARMUP_STEPS, cfg.TRAIN.STEPS
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def weight_decay(cfg, step: int) -> float:
    """Cosine from ``OPTIM.WEIGHT_DECAY`` at step 0 to ``OPTIM.WEIGHT_DECAY_END`` at the last step
    (DINO: 0.04 to 0.4); constant where the end is None (the default)."""
    start, end = cfg.OPTIM.WEIGHT_DECAY, cfg.OPTIM.WEIGHT_DECAY_END
    if end is None:
        return start
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * step / max(1, cfg.TRAIN.STEPS - 1)))


def set_schedules(cfg, optimizer: torch.optim.Optimizer, step: int) -> None:
    """This step's learning rate, and weight decay on the groups that take it."""
    lr, wd = learning_rate(cfg, step), weight_decay(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
        if group["weight_decay_scheduled"]:
            group["weight_decay"] = wd
