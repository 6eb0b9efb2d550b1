"""BatchNorm over every rank's batch (SimCLR's global BN, vissl's ``CONVERT_BN_TO_SYNC_BN``), exact
under checkpointing, on any backend.

torch's ``nn.SyncBatchNorm`` refuses a CPU tensor when more than one rank runs (its kernels are
CUDA's), so gloo runs, and this project's tests, could not use it. This one is built from public
ops: each rank's per-channel mean, variance and count, gathered in one ``all_reduce`` and combined
(Chan's parallel formula: stable where a channel's mean is large against its spread), then
torch's own fused ``batch_norm`` with those statistics. It saves what BatchNorm saves (the input,
the statistics), so a plan's memory holds for it; backward sums two per-channel totals over the
ranks, as torch's does. Under autocast (a bfloat16 or float16 input) its backward works in float32, as
torch's kernels sum: the statistics' terms nearly cancel the rest, and in bfloat16 the convolution before
the norm would get a bias gradient 30x torch's rounding; it costs float32 copies of the layer's input and
gradient for the moment (the plan, profiled through the same ops, counts them).

Under checkpointing the recompute normalises with the statistics the first forward gathered, kept
with the checkpoint (:func:`trunksplit.recompute.checkpoint.reused_in_recompute`: 2C + 1 floats a
layer until the recompute), so it communicates nothing, and the outputs come out bit for bit as in
the first forward: every rank takes part in the collective only in the forward and the backward,
checkpointed or not. The running statistics move once a step (:mod:`trunksplit.recompute.checkpoint`'s
guard sees this layer as a BatchNorm). While trunksplit measures a unit or a step on one rank alone (planning, ``fit``),
nothing is communicated: the layer normalises with its rank's statistics, through the same ops.
"""
import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..planning.memory import is_measuring_alone
from ..recompute.checkpoint import reused_in_recompute


class SyncBatchNorm(nn.BatchNorm2d):
    """``nn.SyncBatchNorm``'s behaviour (statistics over the ``process_group``'s whole batch, the
    running statistics from them, unbiased by the global count) on CPU and GPU alike; any input of
    at least two dimensions, channels second. In eval mode, without a process group, or with one
    rank, it is ``nn.BatchNorm2d``'s forward. Build one with :func:`convert_sync_batchnorm`.

    Exact: the gradients of the global loss (every rank's, summed), so DistributedDataParallel's
    average is one process's gradient over the whole batch, up to the order of float sums (about
    1e-6 relative); bit for bit the same whether the layer is checkpointed or not. Every rank must
    call it the same number of times with the same channel count (a collective)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Optional[dist.ProcessGroup] = None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    # A ProcessGroup cannot be copied or pickled, and planning profiles private copies of the trunk's
    # units (torch's own SyncBatchNorm with a group refuses deepcopy). The module holds a key to the group,
    # which copies share: a copy normalises over the same ranks. The key names this process's group: a
    # layer pickled whole (``torch.save(model)``) and loaded in another process finds no group under it
    # there, and must be given one rather than fall back to every rank (or take another group's key).
    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group the layer normalises over (None: every rank); None too where the layer was loaded from
        another process's pickle with a group of that process (``forward`` then refuses to train)."""
        return _GROUPS.get(self._group_key)

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        key = next((k for k, g in _GROUPS.items() if g is group), None)
        if group is not None and key is None:
            key = (os.getpid(), len(_GROUPS) + 1)
            _GROUPS[key] = group
        self._group_key = key

    def _group(self) -> Optional[dist.ProcessGroup]:
        """The group this training forward normalises over: the layer's, else every rank where torch.distributed runs."""
        running = dist.is_available() and dist.is_initialized()
        if self._group_key is not None and self._group_key not in _GROUPS and running:
            raise RuntimeError("this SyncBatchNorm was pickled with a process group of another process (torch.save(model) "
                               "whole, loaded here): groups do not cross processes, and normalising over every rank instead would change its statistics. "
                               "Give its layers this run's group: for m in model.modules(): if isinstance(m, "
                               "trunksplit.SyncBatchNorm): m.process_group = group (None: every rank)")
        group = self.process_group
        return dist.group.WORLD if group is None and running else group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        group = self._group()
        if group is None or dist.get_world_size(group) == 1:
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:  # as _BatchNorm.forward counts
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        group = None if is_measuring_alone() else group
        with torch.no_grad():  # the statistics' gradient is _GlobalNorm's backward
            # a recompute normalises with the first forward's statistics: no collective again (alone: none to save)
            mean, var, count = _statistics(input, None) if group is None else reused_in_recompute(self, lambda: _statistics(input, group))
            if self.track_running_stats:
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = var * (count / (count - 1).clamp(min=1))
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return _GlobalNorm.apply(input, self.weight, self.bias, mean, var, count, self.eps, group)


def convert_sync_batchnorm(module: nn.Module, process_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """``module`` with every BatchNorm (1d, 2d, 3d, torch's ``SyncBatchNorm``) replaced by a
    :class:`SyncBatchNorm` that holds the same parameters and buffers (not copies), so an optimizer
    built before still steps them; a BatchNorm passed itself comes back converted. Convert before
    building the trunk and before wrapping in DDP, as with ``nn.SyncBatchNorm.convert_sync_batchnorm``::

        model = trunksplit.convert_sync_batchnorm(torchvision.models.resnet50())
        trunk = DistributedDataParallel(trunksplit.CheckpointedTrunk(model, ["flatten"], memory_budget=0.5))
    """
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group)
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(converted, name, getattr(module, name))
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module


_GROUPS: Dict[Tuple[int, int], dist.ProcessGroup] = {}  # this process's groups that SyncBatchNorm layers normalise over, by (pid, number)


def _statistics(x: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """The per-channel mean and biased variance (float32) of ``x`` over ``group``'s ranks' batches,
    and their count of values; this rank's alone where ``group`` is None (measured alone)."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
    count = torch.full_like(mean[:1], x.numel() // x.shape[1])
    if group is None:
        return mean, var, count
    # every rank's (mean, var, count) in one row of its own, summed: an all-gather that gloo runs too
    rows = torch.zeros(dist.get_world_size(group), 2 * mean.numel() + 1, dtype=mean.dtype, device=mean.device)
    rows[dist.get_rank(group)] = torch.cat([mean, var, count])
    dist.all_reduce(rows, group=group)
    means, variances, counts = rows[:, :mean.numel()], rows[:, mean.numel():-1], rows[:, -1:]
    count = counts.sum(0)
    mean = (counts * means).sum(0) / count
    return mean, (counts * (variances + (means - mean) ** 2)).sum(0) / count, count


class _GlobalNorm(torch.autograd.Function):
    """BatchNorm with the statistics given (``group``'s, or this rank's where None, as measured), its
    input gradient through the totals over ``group``. Saves the input and the statistics, as BatchNorm does."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, count, eps, group):
        ctx.save_for_backward(x, weight, mean, var, count)
        ctx.eps, ctx.group = eps, group
        return F.batch_norm(x, mean, var, weight, bias, training=False, eps=eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var, count = ctx.saved_tensors
        # torch's fused BatchNorm backward as in eval mode, with the global statistics: the input gradient
        # without the statistics' terms, and this rank's per-channel sums of dy and dy * x_hat (the
        # affine gradients). aten's op: torch has no public function for it.
        affine = weight is not None
        half = x.dtype in (torch.float16, torch.bfloat16)  # the statistics' terms nearly cancel the rest: in float32, as torch's kernels sum
        dx, dxhat_sum, dy_sum = torch.ops.aten.native_batch_norm_backward(  # the sums come without a weight too
            dy.float() if half else dy, x.float() if half else x, weight, mean, var, None, None, False, ctx.eps, [True, True, True])
        totals = torch.cat([dy_sum, dxhat_sum]).float()
        if ctx.group is not None:
            dist.all_reduce(totals, group=ctx.group)
        invstd = torch.rsqrt(var + ctx.eps)
        scale = (weight.float() * invstd if affine else invstd) / count
        shape = [1, -1] + [1] * (x.dim() - 2)
        slope = (scale * invstd * totals[mean.numel():]).view(shape)  # dx -= scale * (sum_dy + x_hat * sum_dy_xhat)
        dx = dx.sub_((scale * totals[:mean.numel()] - slope.flatten() * mean).view(shape).to(dx.dtype))
        dx = dx.addcmul_(x, slope.to(dx.dtype), value=-1).to(x.dtype)
        grads = (dxhat_sum, dy_sum) if affine else (None, None)
        return dx, *grads, None, None, None, None, None

