"""trunksplit: train vision trunks with less activation memory and the same gradients."""
from .blocks import feature_blocks, layer_splittable_before, register_trunk
from .fit import Fit, fit
from .distributed import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params
from .profile import PeakMemory
from .selective import apply_activation_checkpointing, by_name, by_type, condition_from_config, every_k
from .split import Segment, SplitPlan, checkpoint_trunk
from .trunk import CheckpointedTrunk
from .wrapper import checkpoint_wrapper, is_checkpoint_wrapped, is_recomputing, unwrap_checkpoint

__version__ = "0.1.0"

__all__ = [
    "CheckpointedTrunk",
    "Fit",
    "fit",
    "PeakMemory",
    "apply_activation_checkpointing",
    "by_name",
    "by_type",
    "condition_from_config",
    "every_k",
    "Segment",
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
    "unwrap_checkpoint",
]
