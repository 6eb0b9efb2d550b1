"""An SSL model: a checkpointed torchvision trunk, a projection head (SimCLR's, or DINO's with its
weight-normalised last layer), SwAV's prototypes."""
import contextlib
import copy
import math
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.sync_batchnorm import convert_sync_batchnorm
from ..in_backward import holding_updates
from ..planning.budget import BudgetTooLowError, MemoryBudget
from ..recompute.select import condition_from_config, wrap_selected
from ..recompute.wrapper import unwrap_checkpoint
from ..trunk import CheckpointedTrunk
from .backbones import build_backbone, feature_key
from .optim import gradient_mode


def build_trunk(cfg) -> CheckpointedTrunk:
    """The trunk the config asks for, checkpointed as it says (splits, a budget, or selective wrapping)."""
    model = build_backbone(cfg.MODEL.TRUNK.NAME, cfg.DATA.CROP_SIZES[0], cfg.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER)
    model = with_global_norms(cfg, model)  # before the trunk is built from the model's modules
    keys = [feature_key(cfg.MODEL.TRUNK.NAME, key) for key in cfg.MODEL.TRUNK.OUT_FEAT_KEYS]
    ac = cfg.MODEL.ACTIVATION_CHECKPOINTING
    if not ac.USE_ACTIVATION_CHECKPOINTING:
        return CheckpointedTrunk(model, keys, gradients=gradient_mode(cfg))
    if len(ac.SELECT):
        trunk = CheckpointedTrunk(model, keys, gradients=gradient_mode(cfg))  # one unsplit segment; the selected blocks checkpoint themselves
        wrap_selected(trunk, condition_from_config(dict(ac.SELECT)))
        return trunk
    return CheckpointedTrunk(
        model,
        keys,
        num_splits=ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS,
        strategy=ac.STRATEGY,
        memory_budget=MemoryBudget.parse(ac.MEMORY_BUDGET, "MEMORY_BUDGET"),
        use_reentrant=ac.USE_REENTRANT,
        gradients=gradient_mode(cfg),
    )


_NORMALIZE_EPS = 1e-12  # F.normalize's


class _UnitRowsLinear(torch.autograd.Function):
    """``F.linear(x, F.normalize(weight, dim=1))`` without the normalised weight.

    Autograd's version keeps the normalised weight (``weight``'s size) from forward to backward and
    makes four more of its size in the backward (DINO's 65536 x 256 last layer: 64 MiB each, the
    largest tensors of a multi-crop step's peak). Here the forward divides the product's columns
    by the row norms, and the backward writes the weight's gradient into one new tensor: the
    projection ``G - W (G . W) / n^2`` of ``G = (grad / n)^T x`` (its row dots taken by a batched
    product, no temporary). Exact to rounding, not bit for bit: the forward divides after the
    product instead of before it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        norms = weight.norm(dim=1)
        out = torch.mm(x, weight.t())
        out.div_(norms.clamp_min(_NORMALIZE_EPS))
        ctx.save_for_backward(x, weight, norms)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, norms = ctx.saved_tensors
        clamped = norms.clamp_min(_NORMALIZE_EPS)
        scaled = grad.to(clamped.dtype) / clamped
        grad_x = (scaled @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = scaled.t() @ x.to(scaled.dtype)
            along = torch.bmm(grad_weight.unsqueeze(1), weight.unsqueeze(2)).view(-1)  # each row's G . W
            along = torch.where(norms >= _NORMALIZE_EPS, along / clamped**2, 0)  # a clamped norm has no gradient
            grad_weight.addcmul_(weight, along.unsqueeze(1), value=-1)
        return grad_x, grad_weight


class DINOHead(nn.Module):
    """DINO's projection head: a 3-layer MLP with GELU (``hidden_dim`` wide, ending at
    ``bottleneck_dim``), L2-normalised, then a linear layer to ``out_dim`` whose weight rows are
    normalised: DINO's ``weight_norm`` last layer with its gain frozen at 1 (``norm_last_layer``)."""

    def __init__(self, in_dim: int, hidden_dim: int, bottleneck_dim: int, out_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        nn.init.kaiming_uniform_(self.last_layer, a=5**0.5)  # nn.Linear's initialisation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnitRowsLinear.apply(F.normalize(self.mlp(x), dim=-1), self.last_layer)


def projection_head(feature_dim: int, hidden_dim: int, output_dim: int) -> nn.Module:
    """SimCLR's (and SwAV's) projection head: Linear, BatchNorm, ReLU, Linear."""
    return nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, output_dim))


def budget_refused(cfg, trunk: CheckpointedTrunk, e: BudgetTooLowError) -> str:
    """The planner's refusal of the config's MEMORY_BUDGET for ``trunk``, in the config's terms: what to change in it
    (the launcher and ``trunksplit plan --config-file`` say it)."""
    ac, mib = cfg.MODEL.ACTIVATION_CHECKPOINTING, lambda n: f"{n / 2**20:.1f} MiB"
    said = f"MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET {ac.MEMORY_BUDGET:g} cannot be met at this run's crops"
    least = e.smallest_bytes / e.unsplit_bytes if e.smallest_bytes is not None else None
    if least is not None:
        said += (f": the least the trunk's step reaches is {least:.3f} of its unsplit peak ({mib(e.smallest_bytes)} of {mib(e.unsplit_bytes)})"
                 + f" in at most {ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS} segment{'s' if ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS > 1 else ''} (NUM_ACTIVATION_CHECKPOINTING_SPLITS)"
                 + (f". Set it to {e.smallest_bytes} bytes or more" if ac.MEMORY_BUDGET > 1 else f". Set it to {math.ceil(least * 100) / 100:g} or more"
                    if least <= 0.99 else ". No plan saves even 1% of the unsplit step at these crops: remove it (0), or set it to 1"))
    gradients = sum(p.numel() * p.element_size() for p in trunk.parameters() if p.requires_grad)
    if e.held:
        said += (f"; an earlier crop group's backward runs with the updates held until the last group's (OPTIM.IN_BACKWARD, "
                 f"TRAIN.BACKWARD_BY_CROP_GROUP), so it keeps every gradient of the trunk ({mib(gradients)}), which no checkpoint frees")
    if cfg.TRAIN.GRADIENTS == "allocated" and not cfg.OPTIM.IN_BACKWARD and (least is None or gradients >= 0.25 * e.smallest_bytes):
        said += (f"; no checkpoint frees the trunk's gradients ({mib(gradients)}), which this step makes: keep them out of it with TRAIN.GRADIENTS "
                 "kept, or free each at its update with OPTIM.IN_BACKWARD True")  # as the planner says it (planning/search.py)
    return said + "; or let the run fit its batch and budget to a memory size (TRAIN.BATCH_SIZE_PER_RANK 0 and TRAIN.MEMORY_LIMIT)"


class SSLModel(nn.Module):
    """Runs the trunk once per crop resolution (crops of one size are batched), then the head.

    For DINO it also holds the EMA teacher (``teacher``, never checkpointed, no gradients) and the
    centre of the teacher's outputs (the ``center`` buffer); see :mod:`trunksplit.ssl.dino`."""

    teacher: Optional["SSLModel"]
    queue: Optional[torch.Tensor]

    def __init__(self, trunk: CheckpointedTrunk, head: nn.Module, num_prototypes: int = 0):
        super().__init__()
        self.trunk = trunk
        self.head = head
        self.prototypes = nn.Linear(head[-1].out_features, num_prototypes, bias=False) if num_prototypes else None
        self.teacher = None
        self.register_buffer("queue", None)  # SwAV's queue of earlier embeddings, where the config keeps one: trunksplit/ssl/swav.py
        self.queue_rows = 0  # how many of its rows hold one, counted on the host: a step never reads the queue to know

    def forward(self, crops: List[torch.Tensor], embeddings: bool = False):
        """Embeddings (SimCLR) or prototype scores (SwAV), one tensor per crop. With ``embeddings``, also
        SwAV's unit embeddings the scores were taken of, detached (none without prototypes): ``(outputs, embeddings)``."""
        out, units = [], []
        for i, j in same_size_runs(crops):
            feature = self.trunk(torch.cat(crops[i:j]))[-1]
            if feature.dim() == 4:
                feature = feature.mean(dim=(2, 3))
            z = self.head(feature)
            if self.prototypes is not None:
                unit = F.normalize(z, dim=1)
                units += list(unit.detach().chunk(j - i))
                z = self.prototypes(unit)
            out += list(z.chunk(j - i))
        return (out, units) if embeddings else out

    def plan_for(self, crops: List[torch.Tensor], autocast, held: Sequence[bool], read: Sequence[bool]) -> None:
        """Make the trunk's cost-aware plans for these crops now (one per resolution), not in the first step;
        ``held``: for each resolution, whether its call runs with the updates in backward held (``grouped.held_calls``);
        ``read``: whether a backward runs through it (``grouped.backward_calls``): one that runs without a graph is not planned."""
        for (i, j), holding, planned in zip(same_size_runs(crops), held, read):
            if not planned:
                continue
            with holding_updates(self) if holding else contextlib.nullcontext(), autocast:
                self.trunk.plan_for(torch.cat(crops[i:j]))

    @torch.no_grad()
    def normalize_prototypes(self) -> None:
        if self.prototypes is not None:
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight, dim=1))


def same_size_runs(crops: List[torch.Tensor]):
    """(start, stop) of each run of consecutive crops of one size: they are batched through the trunk together."""
    i = 0
    while i < len(crops):
        j = i
        while j < len(crops) and crops[j].shape[-2:] == crops[i].shape[-2:]:
            j += 1
        yield i, j
        i = j


def build_ssl_model(cfg) -> SSLModel:
    """The model the config trains: the student (:func:`build_model`), and for DINO its teacher (see
    :func:`add_teacher`), for SwAV its queue where it keeps one (:func:`add_queue`)."""
    model = build_model(cfg)
    return add_teacher(model) if cfg.METHOD.NAME == "dino" else add_queue(model, cfg)


def add_teacher(model: SSLModel) -> SSLModel:
    """Give ``model`` (the student) DINO's teacher, equal to it, and a zero centre; returns ``model``.
    What they do in a step is :mod:`trunksplit.ssl.dino`'s."""
    teacher = student_copy(model, plain=True)
    teacher.requires_grad_(False)
    model.teacher = teacher
    out_dim = model.head.last_layer.shape[0]
    model.register_buffer("center", torch.zeros(1, out_dim, device=model.head.last_layer.device))
    return model


def add_queue(model: SSLModel, cfg) -> SSLModel:
    """Give ``model`` SwAV's queue where the config keeps one (``METHOD.SWAV.QUEUE_LENGTH`` > 0), empty; returns
    ``model``. How a step uses and fills it is :mod:`trunksplit.ssl.swav`'s."""
    length = cfg.METHOD.SWAV.QUEUE_LENGTH
    if cfg.METHOD.NAME == "swav" and length:
        model.queue = torch.zeros(cfg.DATA.CROP_COUNTS[0], length, model.prototypes.in_features, device=model.prototypes.weight.device)
        model.register_load_state_dict_post_hook(_count_queue_rows)
    return model


def _count_queue_rows(model: SSLModel, incompatible_keys) -> None:
    """A queue loaded (a resumed run's): its filled rows counted once, here (the newest first, none of them zero)."""
    model.queue_rows = int(model.queue[0].any(dim=-1).sum())


def build_model(cfg) -> SSLModel:
    """The student the config asks for, without DINO's teacher or SwAV's queue (:func:`build_ssl_model` adds them)."""
    trunk = build_trunk(cfg)
    dim, h = feature_width(trunk, cfg), cfg.MODEL.HEAD
    if cfg.METHOD.NAME == "dino":
        return SSLModel(trunk, DINOHead(dim, h.HIDDEN_DIM, h.OUTPUT_DIM, cfg.METHOD.NUM_PROTOTYPES))
    prototypes = cfg.METHOD.NUM_PROTOTYPES if cfg.METHOD.NAME == "swav" else 0
    return SSLModel(trunk, with_global_norms(cfg, projection_head(dim, h.HIDDEN_DIM, h.OUTPUT_DIM)), prototypes)


def with_global_norms(cfg, module: nn.Module) -> nn.Module:
    """``module`` with its BatchNorms over ``MODEL.SYNC_BN_CONFIG.GROUP_SIZE``'s ranks where the config asks for it."""
    sync = cfg.MODEL.SYNC_BN_CONFIG
    return convert_sync_batchnorm(module, norm_group(sync.GROUP_SIZE)) if sync.CONVERT_BN_TO_SYNC_BN else module


_NORM_GROUPS: dict = {}  # GROUP_SIZE's process group, made once a process: making one is a collective


def norm_group(size: int) -> Optional[dist.ProcessGroup]:
    """``MODEL.SYNC_BN_CONFIG.GROUP_SIZE``'s group (vissl's values): -1 the ranks of one machine
    (torchrun's ``LOCAL_WORLD_SIZE``), 0 every rank, N consecutive ranks N at a time. None (every rank)
    where it spans the world, or one process runs."""
    if size < -1:
        raise ValueError(f"MODEL.SYNC_BN_CONFIG.GROUP_SIZE {size}: -1 (one machine's ranks), 0 (every rank) or a positive group size")
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if size == -1 else size or world
    if world % ranks:
        raise ValueError(f"MODEL.SYNC_BN_CONFIG.GROUP_SIZE {size}: groups of {ranks} ranks cannot divide the {world} ranks of this run; "
                         "give a divisor of the world size, or 0 for every rank")
    if ranks == world:
        return None
    if ranks not in _NORM_GROUPS:
        _NORM_GROUPS[ranks] = dist.new_subgroups(ranks)[0]
    return _NORM_GROUPS[ranks]


def feature_width(trunk: CheckpointedTrunk, cfg) -> int:
    """The width of the trunk's last feature, what the head takes, from one image at each crop size: a
    trunk that cannot run one of them is refused now, in the config's terms, rather than in the step."""
    was_training, shapes = trunk.training, []
    try:
        with torch.no_grad():
            trunk.eval()
            for size in dict.fromkeys(cfg.DATA.CROP_SIZES):
                try:
                    shapes.append(trunk(torch.zeros(1, 3, size, size))[-1].shape)
                except (RuntimeError, AssertionError, ValueError) as e:  # a model built for one input size asserts it (timm's ViTs)
                    raise ValueError(f"MODEL.TRUNK.NAME {cfg.MODEL.TRUNK.NAME} cannot run the {size}px crops of DATA.CROP_SIZES "
                                     f"{list(cfg.DATA.CROP_SIZES)}: {str(e).splitlines()[0].rstrip('.')}. Give DATA.CROP_SIZES sizes it runs; "
                                     "a ViT of torchvision's (vit_s_16, vit_b_16) runs any multiple of its patch size") from None
    finally:
        trunk.train(was_training)
    if len(shapes[0]) not in (2, 4):  # SSLModel.forward averages a feature map; tokens have no one pooling
        raise ValueError(f"MODEL.TRUNK.OUT_FEAT_KEYS: the head takes the last feature, {trunk.out_feat_keys[-1]}, of shape "
                         f"{tuple(shapes[0])} for one image: give a pooled feature (flatten, the default) or a feature map "
                         "(N, C, H, W, averaged over H and W)")
    return shapes[0][1]


def student_copy(model: SSLModel, plain: bool) -> SSLModel:
    """A deep copy of ``model`` without its DINO teacher (none is copied); with ``plain``, one that
    checkpoints nothing: the trunk one unsplit segment, selective wrappers removed. The same
    parameter names and values either way."""
    teacher, model.teacher = model.teacher, None
    try:
        m = copy.deepcopy(model)
    finally:
        model.teacher = teacher
    return without_checkpointing(m) if plain else m


def without_checkpointing(model: SSLModel) -> SSLModel:
    """``model`` checkpointing nothing: its trunk one unsplit segment, selective wrappers removed (in place;
    the same parameters, under the same names)."""
    for sub in model.modules():
        unwrap_checkpoint(sub)
    model.trunk = CheckpointedTrunk(model.trunk.feature_blocks, model.trunk.out_feat_keys, gradients=model.trunk.gradients)
    return model


def with_batch(cfg, batch: int, budget: float, rank: int, why: str):
    """The config with this batch per rank and trunk budget, said once (rank 0)."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.BATCH_SIZE_PER_RANK = batch
    cfg.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET = float(budget)
    cfg.freeze()
    if rank == 0:
        print(f"{why} {batch} images per rank ({batch * sum(cfg.DATA.CROP_COUNTS)} crops through the trunk), trunk budget {budget:.0f} bytes")
    return cfg
