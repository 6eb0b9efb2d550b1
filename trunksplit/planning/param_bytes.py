"""What a unit's parameters take: their gradients' bytes per unit, and the largest one, unsharded or
as one rank's shards (FSDP2: :mod:`trunksplit.planning.sharding`)."""
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def unit_param_bytes(units: Sequence[nn.Module], nbytes: Optional[Callable[[torch.Tensor], int]] = None) -> Tuple[int, ...]:
    """Bytes of each unit's trainable parameters (``nbytes`` of each; default: this rank's part of
    it, the whole of an unsharded one); a shared one counts at its last unit (first in backward)."""
    nbytes = nbytes or (lambda p: _local(p).numel() * p.element_size())  # a sharded weight's gradient is this rank's shard
    seen, out = set(), []
    for unit in reversed(units):
        fresh = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in fresh)
        out.append(sum(nbytes(p) for p in fresh))
    return tuple(reversed(out))


def largest_param_bytes(units: Sequence[nn.Module], nbytes: Optional[Callable[[torch.Tensor], int]] = None) -> Tuple[int, ...]:
    """Bytes of each unit's largest trainable parameter (``nbytes`` as :func:`unit_param_bytes` takes it)."""
    nbytes = nbytes or (lambda p: _local(p).numel() * p.element_size())
    return tuple(max((nbytes(p) for p in u.parameters() if p.requires_grad), default=0) for u in units)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
