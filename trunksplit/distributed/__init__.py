"""Training a planned trunk on several processes: vissl's manual DDP helpers (``ddp.py``),
FSDP2 sharding (``fsdp.py``), BatchNorm over every rank's batch (``sync_batchnorm.py``)."""
from .agree import rank0_decides
from .ddp import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params
from .fsdp import shard_trunk
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "manual_gradient_all_reduce", "manual_gradient_reduction", "manual_sync_params",
           "rank0_decides", "shard_trunk"]
