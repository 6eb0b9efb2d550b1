"""Training a planned trunk on several processes: vissl's manual DDP helpers (``ddp.py``) and
FSDP2 sharding (``fsdp.py``)."""
from .agree import rank0_decides
from .ddp import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params
from .fsdp import shard_trunk

__all__ = ["manual_gradient_all_reduce", "manual_gradient_reduction", "manual_sync_params", "rank0_decides", "shard_trunk"]
