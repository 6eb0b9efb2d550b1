"""FSDP2 sharding of a planned trunk: ``shard_trunk``.

torch's ``fully_shard`` shards a module's parameters across the ranks of a mesh and
all-gathers them around the module's forward and backward, through hooks on that module.
The trunk never calls its stages (``res2``), only their units (``res2.0``), so the units are
what is sharded, each on its own, and then the trunk itself (its root group holds what no
unit does). Checkpointed segments and regions recompute units, so a unit's weights are
all-gathered again for its recompute, as for its backward: the same as checkpointing every
block and sharding it, torchtitan's layout, with the cuts trunksplit plans.
"""
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..trunk import CheckpointedTrunk
from .agree import rank0_decides


def shard_trunk(trunk: CheckpointedTrunk, mesh=None, **fully_shard_kwargs) -> CheckpointedTrunk:
    """Shard ``trunk`` in place with FSDP2 (``torch.distributed.fsdp.fully_shard``) and return it.

    Every unit with parameters is sharded on its own, then the trunk (the root, last).
    ``mesh`` (a 1-D ``DeviceMesh``; a 2-D one for HSDP, replicas x shards, spanning every rank; None:
    every rank of the default group) and the other
    arguments (``mp_policy``, ``reshard_after_forward``, ``offload_policy``) go to each
    ``fully_shard`` call. Any strategy works, planned before or after sharding: after it,
    planning profiles full copies of the sharded units (all-gathered, on every rank at once)
    and counts each rank's gradient shards, and every rank takes rank 0's plan (``trunk.agreement``), since a
    different recompute on one rank would all-gather a different number of times.

    Exact: each rank's gradients are its shard of the mean over ranks, as under DDP;
    BatchNorm statistics are per rank (use SyncBatchNorm to synchronise them). Refused with
    a ``ValueError``: no process group, a trunk already sharded, ``use_reentrant=True``
    (FSDP2's hooks need non-reentrant checkpointing).
    """
    if not isinstance(trunk, CheckpointedTrunk):
        raise TypeError(f"shard_trunk takes a CheckpointedTrunk, got {type(trunk).__name__}; shard other models with fully_shard directly")
    if isinstance(trunk, FSDPModule):
        raise ValueError("this trunk is already sharded: shard_trunk once per trunk")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_trunk needs a process group: run under torchrun and call torch.distributed.init_process_group() first")
    if mesh is not None and mesh.ndim > 1 and mesh.size() != dist.get_world_size():
        raise ValueError(f"a {mesh.ndim}-D mesh must span every rank ({mesh.size()} of {dist.get_world_size()}): its ranks agree on one plan over the default group")
    if trunk.use_reentrant:
        raise ValueError("FSDP2 runs its hooks inside the checkpointed forward, which needs use_reentrant=False; build the trunk with it")
    if trunk.compile_options is not None:  # trunk.compile() stored the weights channels-last; FSDP2 shards contiguous ones
        trunk.to(memory_format=torch.contiguous_format)
    for _, unit in trunk.units:
        if not isinstance(unit, FSDPModule) and any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, **fully_shard_kwargs)  # a unit run twice (shared weights) is sharded once
    fully_shard(trunk, mesh=mesh, **fully_shard_kwargs)
    trunk.agreement = functools.partial(rank0_decides, group=mesh.get_group()) if mesh is not None and mesh.ndim == 1 else rank0_decides
    return trunk
