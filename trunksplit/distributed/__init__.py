"""Training a planned trunk on several processes: vissl's manual DDP helpers (``ddp.py``)."""
from .ddp import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params

__all__ = ["manual_gradient_all_reduce", "manual_gradient_reduction", "manual_sync_params"]
