#!/usr/bin/env python
"""Per-rank step peak under FSDP2, predicted from the unsharded model and measured on gloo ranks.

    torchrun --standalone --nproc_per_node=2 tools/fsdp_memory.py --arch resnet18 --input 4x3x64x64 --gradients allocated
    torchrun --standalone --nproc_per_node=2 tools/fsdp_memory.py --arch resnet18 --input 3x32x32 --fit 2.2e8

Each rank plans a balanced 4-segment trunk for one of N ranks from the unsharded model
(``trunksplit plan --world-size N`` does the same), shards a copy with ``shard_trunk``, gives it
that plan, and measures one training step's peak beyond what was live before it (gradients None
before the step, or kept as zeros), with two meters: the allocator's requests as torch.profiler's
memory events count them (``profiled_peak``), the truth, and the exact tensor tracker
(``PeakMemory``), which is blind to FSDP2's all-gathered parameters (FSDP2 frees and refills
their storage in place, by resizing it, and no op sees that). Rank 0 prints the prediction (the
per-rank peak model's step peak, gathered weights included) and every rank's measurements.
"""
import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torchvision

from trunksplit import CheckpointedTrunk, PeakMemory, fit, shard_trunk
from trunksplit.planning.budget import parse_memory_size
from trunksplit.planning.memory import profiled_peak
from trunksplit.planning.search import peak_model, plan_trunk


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--input", default="4x3x64x64", help="one rank's batch")
    p.add_argument("--gradients", choices=["allocated", "kept"], default="allocated")
    p.add_argument("--repeats", type=int, default=3, help="profiled steps per rank; the smallest reading counts")
    p.add_argument("--fit", default=None, help="memory per rank (bytes or 2GiB): fit the batch for it (SGD with momentum) and measure "
                                               "everything a rank then holds against it (--input's batch is ignored)")
    return p


def _step(trunk, x) -> None:
    trunk(x)[0].float().pow(2).mean().backward()


def measured_peaks(trunk, x, gradients: str, repeats: int):
    """The step's peak by the profiler's allocation events (the smallest of ``repeats`` steps),
    and by the tensor tracker.

    The profiler misses a free made on a thread it does not profile (gloo's worker thread, at
    random); ``ProfiledPeak`` puts back those of collectives' tensors, and any other missed free
    can only add to a reading, so the smallest reading of the same step is the closest to the
    truth."""
    _step(trunk, x)  # gradients exist, as from the second step on

    def clear():
        for p in trunk.parameters():
            if gradients == "allocated":
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    readings = []
    for _ in range(repeats):
        clear()
        readings.append(profiled_peak(lambda: _step(trunk, x)))
    allocated = min(readings)
    clear()
    with PeakMemory() as mem:
        _step(trunk, x)
    return allocated, mem.peak_bytes


def fitted(model, shape, memory: int, gradients: str, repeats: int) -> None:
    """Fit one rank's batch for ``memory`` (``trunksplit.fit``, per rank), shard the trunk it plans,
    and measure what a rank holds: its shards of parameters (and of gradients, if kept), buffers,
    SGD's momentum, and the step's peak (the smallest of ``repeats`` profiled steps)."""
    world = dist.get_world_size()
    found = fit(copy.deepcopy(model), shape, memory, optimizer="sgd", gradients=gradients, world_size=world, verify=False)
    trunk = shard_trunk(CheckpointedTrunk(model, ["flatten"], memory_budget=found.memory - found.resident_bytes, gradients=gradients))
    x = torch.randn(found.batch_size, *shape)
    trunk.plan_for(x)
    opt = torch.optim.SGD(trunk.parameters(), lr=0.01, momentum=0.9)
    _step(trunk, x)
    opt.step()  # the momentum buffers exist from here on
    local = [p.to_local() for p in trunk.parameters()]
    held = sum(t.numel() * t.element_size() for t in local + list(trunk.buffers()))
    held += sum(t.to_local().numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim())
    held += sum(t.numel() * t.element_size() for t in local) if gradients == "kept" else 0
    step_peak, _ = measured_peaks(trunk, x, gradients, repeats)
    everyone = [None] * world
    dist.all_gather_object(everyone, held + step_peak)
    if dist.get_rank() == 0:
        print(f"fit {memory / 2**20:.1f} MiB per rank of {world}: {found.batch_size} images per rank; measured "
              f"{', '.join(f'{m / 2**20:.1f}' for m in everyone)} MiB = {max(everyone) / memory:.3f} of the memory")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch)
    if args.fit:
        fitted(model, tuple(int(d) for d in args.input.split("x")[-3:]), parse_memory_size(args.fit, "--fit"), args.gradients, args.repeats)
        dist.destroy_process_group()
        return 0
    x = torch.randn(*(int(d) for d in args.input.split("x")))
    reference = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced", gradients=args.gradients)
    request = reference.plan_request()
    plan = plan_trunk(request, x, peak_model(request, x, world_size=world))
    predicted = plan.predicted_peak_bytes
    trunk = shard_trunk(CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced", gradients=args.gradients))
    trunk.store_plan(trunk.key_for(x), plan)  # the predicted plan, not the one rank 0 would measure and broadcast
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor([float(m) for m in measured_peaks(trunk, x, args.gradients, args.repeats)], dtype=torch.float64))
    if dist.get_rank() == 0:
        allocated, tracked = ([int(m[i].item()) for m in everyone] for i in range(2))
        print(f"{args.arch} {args.input} {args.gradients}, {world} ranks: predicted {predicted / 2**20:.1f} MiB "
              f"measured {', '.join(f'{m / 2**20:.1f}' for m in allocated)} MiB (tensor tracker {', '.join(f'{m / 2**20:.1f}' for m in tracked)}): "
              f"predicted / measured {predicted / max(allocated):.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
