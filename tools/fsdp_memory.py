#!/usr/bin/env python
"""Per-rank step peak under FSDP2, predicted from the unsharded model and measured on gloo ranks.

    torchrun --standalone --nproc_per_node=2 tools/fsdp_memory.py --arch resnet18 --input 4x3x64x64 --gradients allocated

Each rank plans a balanced 4-segment trunk for one of N ranks from the unsharded model
(``trunksplit plan --world-size N`` does the same), shards a copy with ``shard_trunk``, gives it
that plan, and measures one training step's peak beyond what was live before it (exact tensor
bytes; gradients None before the step, or kept as zeros). Rank 0 prints the prediction (the
planner's step peak plus the in-flight estimate) and every rank's measurement.
"""
import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torchvision

from trunksplit import CheckpointedTrunk, PeakMemory, shard_trunk
from trunksplit.chains import expand_units
from trunksplit.planning.search import peak_model, plan_trunk
from trunksplit.planning.sharding import in_flight_bytes, per_rank


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--input", default="4x3x64x64", help="one rank's batch")
    p.add_argument("--gradients", choices=["allocated", "kept"], default="allocated")
    return p


def _step(trunk, x) -> None:
    trunk(x)[0].float().pow(2).mean().backward()


def measured_peak(trunk, x, gradients: str) -> int:
    _step(trunk, x)  # gradients exist, as from the second step on
    for p in trunk.parameters():
        if gradients == "allocated":
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    with PeakMemory() as mem:
        _step(trunk, x)
    return mem.peak_bytes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch)
    x = torch.randn(*(int(d) for d in args.input.split("x")))
    reference = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced", gradients=args.gradients)
    units = [m for _, m in expand_units(reference._blocks())]
    plan = plan_trunk(reference, x, per_rank(peak_model(reference, x), units, world))
    predicted = plan.predicted_peak_bytes + in_flight_bytes(units, world)
    trunk = shard_trunk(CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced", gradients=args.gradients))
    trunk._plans[trunk._plan_key(x)] = plan  # the predicted plan, not the one rank 0 would measure and broadcast
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor([float(measured_peak(trunk, x, args.gradients))], dtype=torch.float64))
    if dist.get_rank() == 0:
        measured = [int(m.item()) for m in everyone]
        print(f"{args.arch} {args.input} {args.gradients}, {world} ranks: predicted {predicted / 2**20:.1f} MiB "
              f"(step {plan.predicted_peak_bytes / 2**20:.1f} + in flight {in_flight_bytes(units, world) / 2**20:.1f}), "
              f"measured {', '.join(f'{m / 2**20:.1f}' for m in measured)} MiB: predicted / measured {predicted / max(measured):.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
