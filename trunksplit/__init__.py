"""trunksplit: train vision trunks with less activation memory and the same gradients.

Layers, each importing only those below it:

    cli/          the trunksplit command (plan, bench, fit, bench-data)
    ssl/          the launcher: config, data, models, losses, the distributed strategy, the loop
    fit.py        the largest batch that fits a memory size
    in_backward.py the optimizer stepped in backward: each gradient freed at its update
    lars.py       the LARS optimizer (vissl's LARC)
    distributed/  several processes: vissl's manual DDP helpers, FSDP2 sharding, rank agreement
    trunk.py      CheckpointedTrunk: runs a plan
    planning/     where to cut: the plan request, budgets, vissl's bucketing, profiling, the peak model, the search
    recompute/    how a run of modules is recomputed: checkpointing, wrapper, regions, stages, compiled units
    chains/       what a trunk is: feature blocks of any model, and their names in the source model
"""
from .chains import feature_blocks, layer_splittable_before, register_trunk
from .distributed import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params, shard_trunk
from .fit import Fit, ScalingRow, fit, scaling
from .in_backward import InBackwardOptimizer, optimizer_in_backward
from .lars import LARS
from .planning.budget import MemoryBudget
from .planning.memory import PeakMemory
from .planning.request import PlanRequest
from .planning.plan import Segment, SplitPlan
from .planning.vissl import checkpoint_trunk
from .recompute.checkpoint import is_recomputing
from .planning.wrap import WrapPlan, apply_activation_checkpointing
from .recompute.select import by_name, by_type, condition_from_config, every_k
from .recompute.wrapper import checkpoint_wrapper, is_checkpoint_wrapped, unwrap_checkpoint
from .trunk import CheckpointedTrunk

__version__ = "0.1.0"

__all__ = [
    "CheckpointedTrunk",
    "Fit",
    "InBackwardOptimizer",
    "optimizer_in_backward",
    "LARS",
    "fit",
    "scaling",
    "ScalingRow",
    "MemoryBudget",
    "PeakMemory",
    "PlanRequest",
    "apply_activation_checkpointing",
    "by_name",
    "by_type",
    "condition_from_config",
    "every_k",
    "Segment",
    "WrapPlan",
    "SplitPlan",
    "checkpoint_trunk",
    "checkpoint_wrapper",
    "feature_blocks",
    "is_checkpoint_wrapped",
    "is_recomputing",
    "layer_splittable_before",
    "manual_gradient_all_reduce",
    "manual_gradient_reduction",
    "manual_sync_params",
    "register_trunk",
    "shard_trunk",
    "unwrap_checkpoint",
]
