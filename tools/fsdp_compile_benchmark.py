#!/usr/bin/env python
"""A sharded trunk's training step, eager and under ``trunk.compile()``, side by side on each rank.

    torchrun --standalone --nproc_per_node=2 tools/fsdp_compile_benchmark.py --arch resnet18 --input 8x3x64x64

Each rank builds the same balanced 4-segment trunk twice, shards both with ``shard_trunk`` and
compiles one (``trunk.compile()``, inductor; after sharding, the weights stay contiguous). Both
plan for the same input, take one untimed step (the compiled one compiles there), then the
steps are timed alternately, ``--repeats`` each; rank 0 prints the medians and their ratio, and
the largest relative difference of a gradient between the two (they must train alike).
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torchvision

from trunksplit import CheckpointedTrunk, shard_trunk


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet18", help="a torchvision model name")
    p.add_argument("--input", default="8x3x64x64", help="one rank's batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each trunk; the median counts")
    return p


def _step(trunk, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    trunk(x)[-1].float().pow(2).mean().backward()
    dist.barrier()
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group("gloo")
    x = torch.randn(*(int(d) for d in args.input.split("x")), generator=torch.Generator().manual_seed(dist.get_rank()))
    trunks = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        trunks[name] = shard_trunk(CheckpointedTrunk(torchvision.models.get_model(args.arch), ["flatten"], num_splits=4, strategy="balanced"))
        if name == "compiled":
            trunks[name].compile()
    compile_seconds = {name: _step(trunk, x) for name, trunk in trunks.items()}  # plans, and compiles
    grads = {name: [p.grad.full_tensor() for p in trunk.parameters()] for name, trunk in trunks.items()}
    differ = max(float((a - b).norm() / (a.norm() + 1e-12)) for a, b in zip(grads["eager"], grads["compiled"]))
    times = {name: [] for name in trunks}
    for _ in range(args.repeats):
        for name, trunk in trunks.items():
            for p in trunk.parameters():
                p.grad = None
            times[name].append(_step(trunk, x))
    if dist.get_rank() == 0:
        eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
        print(f"{args.arch}, {dist.get_world_size()} ranks, input {args.input} per rank, balanced 4 segments")
        print(f"eager sharded step {eager:.3f} s, compiled sharded step {compiled:.3f} s: {compiled / eager:.2f}x "
              f"(medians of {args.repeats}; first compiled step {compile_seconds['compiled']:.1f} s)")
        print(f"largest relative gradient difference, compiled vs eager: {differ:.2e}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
