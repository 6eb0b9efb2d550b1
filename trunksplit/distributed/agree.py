"""What one rank decides alone, every rank runs: the single place ranks agree.

A plan is measured, a batch is fitted and compiled units are timed on each rank, and the
figures differ between ranks (the allocator's, and wall times). Ranks that ran different
plans would issue a different number of collectives (FSDP2 all-gathers a unit's weights for
each recompute) and hang; ranks with different batches break a loss that gathers every
rank's embeddings. So rank 0 decides and the others take its decision.
"""
from typing import Optional, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank0_decides(decision: T, group: Optional[dist.ProcessGroup] = None) -> T:
    """``decision`` as the group's first rank made it, on every rank of ``group`` (the default
    group when None); the decision itself where no process group runs, or it has one rank.
    A collective: every rank calls it, in the same order. Any picklable object."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
