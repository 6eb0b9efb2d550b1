"""trunksplit: train vision trunks with less activation memory and the same gradients.

Layers, each importing only those below it:

    cli/          the trunksplit command (plan, bench, fit, bench-data, knn, report)
    ssl/          the launcher: config, data, models, losses, the distributed strategy, the loop
    fit.py        the largest batch that fits a memory size
    in_backward.py the optimizer stepped in backward: each gradient freed at its update
    lars.py       the LARS optimizer (vissl's LARC)
    distributed/  several processes: vissl's manual DDP helpers, FSDP2 sharding, global BatchNorm, rank agreement
    trunk.py      CheckpointedTrunk: runs a plan
    planning/     where to cut: the plan request, budgets, vissl's bucketing, profiling, the peak model, the search
    recompute/    how a run of modules is recomputed: checkpointing, wrapper, regions, stages, compiled units
    chains/       what a trunk is: feature blocks of any model, and their names in the source model
"""
# underscored: dir(trunksplit) lists the package's names, not the ones it imports
import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING

# Each public name and the module that defines it. They load on first use (PEP 562), so that
# ``trunksplit --help`` and an argument error answer without importing torch.
PUBLIC = {
    "CheckpointedTrunk": "trunk",
    "Fit": "fit", "ScalingRow": "fit", "fit": "fit", "scaling": "fit",
    "InBackwardOptimizer": "in_backward", "optimizer_in_backward": "in_backward",
    "LARS": "lars",
    "BudgetTooLowError": "planning.budget", "MemoryBudget": "planning.budget",
    "PeakMemory": "planning.memory",
    "PlanRequest": "planning.request",
    "Segment": "planning.plan", "SplitPlan": "planning.plan",
    "checkpoint_trunk": "planning.vissl",
    "WrapPlan": "planning.wrap", "apply_activation_checkpointing": "planning.wrap",
    "is_recomputing": "recompute.checkpoint",
    "by_name": "recompute.select", "by_type": "recompute.select", "condition_from_config": "recompute.select", "every_k": "recompute.select",
    "checkpoint_wrapper": "recompute.wrapper", "is_checkpoint_wrapped": "recompute.wrapper", "unwrap_checkpoint": "recompute.wrapper",
    "feature_blocks": "chains", "layer_splittable_before": "chains", "register_trunk": "chains",
    "manual_gradient_all_reduce": "distributed", "manual_gradient_reduction": "distributed", "manual_sync_params": "distributed",
    "shard_trunk": "distributed", "SyncBatchNorm": "distributed", "convert_sync_batchnorm": "distributed",
}

__version__ = "0.1.0"
__all__ = list(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'trunksplit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(n for n in set(globals()) | set(PUBLIC) if not n.startswith("_") or n == "__version__")


class _Package(_types.ModuleType):
    """Importing a submodule binds it on its package: ``trunksplit.fit`` would become the module
    ``fit.py`` once anything imported it. Public names stay what ``PUBLIC`` says they are."""

    def __setattr__(self, name, value):
        if not (name in PUBLIC and isinstance(value, _types.ModuleType)):
            super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


if _TYPE_CHECKING:  # what editors and type checkers read
    from .chains import feature_blocks, layer_splittable_before, register_trunk  # noqa: F401
    from .distributed import SyncBatchNorm, convert_sync_batchnorm, manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params, shard_trunk  # noqa: F401
    from .fit import Fit, ScalingRow, fit, scaling  # noqa: F401
    from .in_backward import InBackwardOptimizer, optimizer_in_backward  # noqa: F401
    from .lars import LARS  # noqa: F401
    from .planning.budget import BudgetTooLowError, MemoryBudget  # noqa: F401
    from .planning.memory import PeakMemory  # noqa: F401
    from .planning.plan import Segment, SplitPlan  # noqa: F401
    from .planning.request import PlanRequest  # noqa: F401
    from .planning.vissl import checkpoint_trunk  # noqa: F401
    from .planning.wrap import WrapPlan, apply_activation_checkpointing  # noqa: F401
    from .recompute.checkpoint import is_recomputing  # noqa: F401
    from .recompute.select import by_name, by_type, condition_from_config, every_k  # noqa: F401
    from .recompute.wrapper import checkpoint_wrapper, is_checkpoint_wrapped, unwrap_checkpoint  # noqa: F401
    from .trunk import CheckpointedTrunk  # noqa: F401
