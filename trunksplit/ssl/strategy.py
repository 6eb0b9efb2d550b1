"""How the launcher runs on its processes: one :class:`Strategy`, chosen once from the config.

One process, DDP, vissl's manual DDP and FSDP2 differ in how the model is wrapped, how a
step's memory is metered, how gradients are reduced, how ranks agree on what each decided
alone, and how a checkpoint is written, read and finished. Each answer lives here, in one
class per strategy, as torchtitan's parallel dims answer every distributed question; the loop
asks the object and never tests a strategy's name.
"""
import contextlib
import os
import warnings
from typing import Callable, ContextManager, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..distributed.agree import rank0_decides
from ..distributed.ddp import manual_gradient_all_reduce, manual_sync_params
from ..distributed.fsdp import shard_trunk
from ..in_backward import standard_optimizer
from ..planning.memory import PeakMemory, ProfiledPeak, measuring_alone
from .fit_step import RankLayout
from .model import build_model, student_copy, without_checkpointing
from .optim import keep_gradients
from .run_dir import CHECKPOINT, drop_shards, load_sharded, load_whole_into_shards, save_atomically, save_sharded

NAMES = ("ddp", "fsdp")  # DISTRIBUTED.STRATEGY


class Strategy:
    """One process (the base): the model as it is, the allocator's or the tracker's meter,
    a whole checkpoint. Subclasses change what differs under several processes."""

    sharded = False  # parameters, gradients and optimizer state split across ranks

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device

    @staticmethod
    def check(cfg) -> None:
        """Refuse, before anything runs, what this strategy cannot train (a ``ValueError``)."""

    def configured(self, cfg):
        """The config as this strategy trains it (rank 0 says what it changed)."""
        return cfg

    @property
    def rank_layout(self) -> RankLayout:
        """One rank's memory as a fitted batch must count it (:class:`trunksplit.ssl.fit_step.RankLayout`)."""
        return RankLayout()

    @property
    def host_ranks(self) -> int:
        """Ranks whose steps fill this host's memory at once: on a CPU every rank torchrun started here."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.device.type == "cpu" else 1

    def agree(self, decision):
        """What every rank runs of what one decided alone (a plan, a fitted batch, eager units): rank 0's."""
        return rank0_decides(decision) if self.world > 1 else decision

    def largest(self, value: float) -> float:
        """The largest of every rank's ``value``: what one rank saw that all must act on (a stop signal)."""
        if self.world == 1:
            return value
        largest = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return largest.item()

    def wrap(self, cfg, model: nn.Module) -> nn.Module:
        """The model as the step calls it; its trunk's decisions agreed across ranks."""
        model.trunk.agreement = self.agree
        return model

    def meter(self, wrapped: nn.Module) -> ContextManager:
        """The step's memory meter: the allocator's on CUDA, the tensor tracker on CPU."""
        return PeakMemory(self.device)

    def comparison_copy(self, cfg, model: nn.Module, plain: bool) -> nn.Module:
        """The student that the run's last row steps beside a plain one (``plain``: checkpointing nothing),
        in this process alone: a deep copy (the model is untouched)."""
        return student_copy(model, plain)

    @contextlib.contextmanager
    def comparison_meter(self, copy: nn.Module):
        """The meter of a comparison copy's step, run by this rank alone (no collectives), as planning measures."""
        with PeakMemory(self.device) as mem, measuring_alone():
            yield mem

    def peak_beyond(self, cfg) -> str:
        """What the metered step peak is counted beyond: gradients are in it unless resident before the step."""
        if cfg.OPTIM.IN_BACKWARD:
            return "parameters (the optimizer stepped in backward: each gradient freed at its update)"
        return "parameters and kept gradients" if cfg.TRAIN.GRADIENTS == "kept" else "parameters (gradients included)"

    def step_also_holds(self, cfg) -> List[str]:
        """What the metered step holds beyond the student under a stand-in loss in one process (what the
        run's last line compares with and without checkpointing)."""
        return ["the method's loss"] + (["DINO's teacher"] if cfg.METHOD.NAME == "dino" else [])

    def forward_backward(self, wrapped: nn.Module, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``step()`` (forward, loss, backward), its gradients reduced across ranks."""
        return step()

    def accumulating(self, wrapped: nn.Module) -> ContextManager:
        """The context of a forward and backward whose gradients stay on this rank, to be reduced
        with the next backward's (every crop group of a step but the last); by default none: each
        backward reduces its own (FSDP2, so that they stay sharded)."""
        return contextlib.nullcontext()

    def save(self, cfg, model, optimizer, meta: dict) -> None:
        """Write the run's checkpoint (every rank calls it)."""
        if self.rank == 0:
            save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **meta}, os.path.join(cfg.OUTPUT_DIR, CHECKPOINT))
            drop_shards(cfg.OUTPUT_DIR)  # an FSDP2 run's, which this one went on from: the checkpoint no longer names them
        if self.world > 1:
            dist.barrier()

    def load(self, cfg, state: dict, model, optimizer) -> None:
        """Load a checkpoint's model and optimizer state: a whole one, or an FSDP2 run's shards, read
        whole (DCP reshards on load): an FSDP2 run goes on in one process or under DDP."""
        if "sharded" in state:
            load_sharded(os.path.join(cfg.OUTPUT_DIR, state["sharded"]), model, standard_optimizer(optimizer))
            return
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def whole_state(self, module: nn.Module) -> dict:
        """``module``'s ``state_dict`` whole, on the host, on rank 0 (empty on the others): every rank calls it."""
        return {k: v.cpu() for k, v in module.state_dict().items()} if self.rank == 0 else {}

    def finish(self, wrapped: nn.Module, model: nn.Module) -> None:
        """End every rank with the same BatchNorm statistics (rank 0's, as saved)."""


class DDP(Strategy):
    """A replica per rank under ``DistributedDataParallel``; gradients all-reduced in backward."""

    def wrap(self, cfg, model):
        if model.trunk.use_reentrant and len(set(cfg.DATA.CROP_SIZES)) > 1:
            raise ValueError(
                "reentrant checkpointing under native DDP with several trunk forwards per step fails "
                "('marked ready twice'): set DISTRIBUTED.MANUAL_GRADIENT_REDUCTION True or USE_REENTRANT False"
            )
        if cfg.TRAIN.GRADIENTS == "kept":  # made before DDP (configured), which makes them views into its buckets at once (after,
            keep_gradients(model)  # the first step would hold them beside the buckets until its synced backward)
        # the gradients are views into DDP's buckets: one copy of them, not two (stepped in backward too,
        # where its hook updates from them)
        return DistributedDataParallel(super().wrap(cfg, model), gradient_as_bucket_view=True)

    def configured(self, cfg):
        if cfg.TRAIN.GRADIENTS != "allocated" or cfg.OPTIM.IN_BACKWARD:
            return cfg
        kept = cfg.clone()
        kept.defrost()
        kept.TRAIN.GRADIENTS = "kept"
        kept.freeze()
        if self.rank == 0:
            print("TRAIN.GRADIENTS kept under DDP: the gradients are views into DDP's buckets, which hold them between steps "
                  "anyway; freed, a step backward by crop group would make them again beside the buckets", flush=True)
        return kept

    @property
    def rank_layout(self):
        return RankLayout(ranks=self.world, buckets="views", host_ranks=self.host_ranks)

    def accumulating(self, wrapped):
        return wrapped.no_sync()

    def peak_beyond(self, cfg):
        return "parameters and DDP's gradient buckets (the gradients are views into them)"

    def meter(self, wrapped):
        # DDP makes its buckets anew as the second step starts (in the order the first backward readied the
        # gradients), freeing the old ones first: the gradients are views into the new ones, not the step's
        return PeakMemory(self.device, made_again=lambda: [p.grad for p in wrapped.parameters() if p.grad is not None])

    def finish(self, wrapped, model):
        manual_sync_params(wrapped)


class ManualDDP(DDP):
    """vissl's path: forward and backward under ``no_sync``, buffers broadcast before the forward,
    gradients all-reduced by hand after backward (reentrant checkpointing with several crops)."""

    def wrap(self, cfg, model):
        return DistributedDataParallel(Strategy.wrap(self, cfg, model))

    def configured(self, cfg):
        return cfg  # the gradients are the parameters' own, not DDP's buckets: freed, they cost nothing in forward

    @property
    def rank_layout(self):
        return RankLayout(ranks=self.world, buckets="copy", host_ranks=self.host_ranks)  # DDP makes its buckets; the gradients are the parameters' own

    def meter(self, wrapped):
        return PeakMemory(self.device)  # the gradients are the parameters' own, made by the step

    def peak_beyond(self, cfg):
        return "parameters and DDP's buckets" + (", and kept gradients" if cfg.TRAIN.GRADIENTS == "kept" else " (gradients included)")

    def step_also_holds(self, cfg):
        return super().step_also_holds(cfg) + ["vissl's all-reduce (every gradient flattened at once)"]

    def forward_backward(self, wrapped, step):
        with wrapped.no_sync():
            manual_sync_params(wrapped)
            loss = step()
        manual_gradient_all_reduce(wrapped)
        return loss

    def accumulating(self, wrapped):
        return contextlib.nullcontext()  # the whole step runs under no_sync: one all-reduce after it


class FSDP(Strategy):
    """FSDP2: the trunk sharded unit by unit, then the whole model; checkpoints written sharded
    with ``torch.distributed.checkpoint`` (resharded on load).

    A step backward by crop group reduce-scatters each group's gradients, which add up sharded:
    one reduce-scatter per group. Held back to the last group (``set_requires_gradient_sync(False)``),
    every rank would keep the whole model's gradients unsharded until then, which sharding is for
    (torchtitan's and torch's own advice for accumulation under FSDP2 too)."""

    sharded = True

    @staticmethod
    def check(cfg):
        if cfg.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION:
            raise ValueError("DISTRIBUTED.MANUAL_GRADIENT_REDUCTION is DDP-only (vissl's no_sync path); FSDP reduce-scatters its own gradients: set it False")
        if cfg.MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT:
            raise ValueError("MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT True cannot run under FSDP (its hooks need non-reentrant checkpointing): set it False")

    @property
    def rank_layout(self):
        return RankLayout(world=self.world, ranks=self.world, host_ranks=self.host_ranks)

    def wrap(self, cfg, model):
        if model.teacher is not None:  # DINO's teacher, sharded as the student is, so that its EMA update is shard by shard
            _shard_teacher(model.teacher)
        shard_trunk(model.trunk)
        fully_shard(model)  # the root: the heads, and the trunk's group under it
        with torch.no_grad():  # FSDP2's root is the first module to run forward: the model, before the kNN monitor runs its trunk alone
            model([])
        model.reshard()  # the root stays unsharded after a forward: the optimizer must see the sharded parameters
        # the trunk and the model return views (flatten, chunk); the loop never writes into them in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return model

    def meter(self, wrapped):
        # the profiler's allocation events on CPU: the tracker cannot see the weights FSDP gathers
        return ProfiledPeak() if self.device.type == "cpu" else PeakMemory(self.device)

    def comparison_copy(self, cfg, model, plain):
        """FSDP2 refuses ``deepcopy``: the config's student built afresh and sharded as the run's is, running
        the run's plans (or, ``plain``, checkpointing nothing). Its weights are new (no byte count depends on
        them); every rank builds and steps its copy together, as it trains."""
        copy = build_model(cfg).to(self.device)
        copy.trunk.update_temporaries = model.trunk.update_temporaries  # what its plans were made for, stepped in backward
        for key, plan in model.trunk.plans.items():
            copy.trunk.store_plan(key, plan)
        return self.wrap(cfg, without_checkpointing(copy) if plain else copy)

    def comparison_meter(self, copy):
        return self.meter(copy)  # the ranks step together: the copies' collectives run, as in training

    def save(self, cfg, model, optimizer, meta):
        broadcast_buffers(model)
        save_sharded(cfg, model, standard_optimizer(optimizer), meta, self.rank, self.world)
        dist.barrier()

    def load(self, cfg, state, model, optimizer):
        if "sharded" not in state:  # a one-process or DDP run's: read whole by every rank, each keeping its shards
            load_whole_into_shards(state, model, standard_optimizer(optimizer))
            return
        super().load(cfg, state, model, optimizer)  # the shards, resharded to this world

    def whole_state(self, module):
        whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # gathered to rank 0
        return whole if self.rank == 0 else {}

    def finish(self, wrapped, model):
        broadcast_buffers(model)


def strategy_for(cfg, rank: int, world: int, device: torch.device) -> Strategy:
    """The one strategy object of a run: FSDP2, vissl's manual DDP, DDP, or one process."""
    if cfg.DISTRIBUTED.STRATEGY == "fsdp" and (world < 2 or not dist.is_initialized()):
        raise ValueError("DISTRIBUTED.STRATEGY fsdp shards the model across processes: run under torchrun --nproc_per_node=N (N >= 2)")
    return _strategy_class(cfg, world)(rank, world, device)


def as_trained(cfg, world: int) -> Tuple[object, RankLayout]:
    """The config as one of ``world`` ranks of its strategy trains it, and that rank's memory layout, before
    any process starts (``trunksplit plan --config-file`` and ``fit --config-file`` with ``--world-size``)."""
    strategy = _strategy_class(cfg, world)(0, world, torch.device("cpu"))
    return strategy.configured(cfg), strategy.rank_layout


def _strategy_class(cfg, world: int) -> type:
    if cfg.DISTRIBUTED.STRATEGY == "fsdp":
        return FSDP
    if world == 1:
        return Strategy
    return ManualDDP if cfg.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION else DDP


def check_strategy(cfg) -> None:
    """The config's DISTRIBUTED.STRATEGY is known and can train what the rest of the config asks."""
    if cfg.DISTRIBUTED.STRATEGY not in NAMES:
        raise ValueError(f"DISTRIBUTED.STRATEGY must be {' or '.join(NAMES)}, got {cfg.DISTRIBUTED.STRATEGY!r}")
    (FSDP if cfg.DISTRIBUTED.STRATEGY == "fsdp" else Strategy).check(cfg)


def broadcast_buffers(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers. FSDP2 replicates buffers and each rank moves its own
    BatchNorm statistics; a sharded checkpoint saves a replicated tensor once, from whichever rank
    it picks, so the statistics are made one before each save (as DDP makes them one before each
    forward). Running statistics never change a training step's outputs."""
    for b in model.buffers():
        dist.broadcast(b, src=0)


def _shard_teacher(teacher: nn.Module) -> None:
    """DINO's teacher sharded unit by unit, then whole, as ``shard_trunk`` and the root shard the student:
    each parameter's shard on a rank is the same slice of it as the student's, so that ``teacher <- m *
    teacher + (1 - m) * student`` runs on the shards. It has no gradients: nothing is reduce-scattered
    (and ``shard_trunk`` itself shards only units that train, gathering a frozen trunk whole)."""
    for _, unit in teacher.trunk.units:
        if not isinstance(unit, FSDPModule) and list(unit.parameters()):  # a unit run twice is sharded once
            fully_shard(unit)
    fully_shard(teacher.trunk)
    fully_shard(teacher)
