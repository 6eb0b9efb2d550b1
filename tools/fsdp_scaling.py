#!/usr/bin/env python
"""Per-rank memory and the largest per-rank batch under FSDP2, from 1 to 512 ranks: predicted.

    python tools/fsdp_scaling.py --arch regnet_y_16gf regnet_y_128gf vit_h_14 --memory 80GiB --optimizer adamw

For each model and world size: trunksplit's lowest-peak plan against a checkpoint around every
unit (torchtitan's default: each block) and no checkpoint, with one rank's bytes by part at the
largest batch that fits (``trunksplit.scaling``: the arithmetic of ``trunksplit fit --world-size N
--no-verify`` from one profile of the model at two small batches). These are predictions; the
measured check at 2 and 4 gloo ranks is ``tools/fsdp_memory.py`` (docs/distributed.md).
"""
import argparse
import time

import torch
from tabulate import tabulate

from trunksplit import scaling
from trunksplit.planning.sharding import gib
from trunksplit.cli.parser import image_shape
from trunksplit.ssl.backbones import build_backbone


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["regnet_y_16gf", "regnet_y_128gf", "vit_h_14"])
    p.add_argument("--input", type=image_shape, default=(3, 224, 224), help="one image, CxHxW (as trunksplit fit's --input)")
    p.add_argument("--memory", default="80GiB", help="per rank")
    p.add_argument("--optimizer", choices=["sgd", "lars", "adamw"], default="adamw")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--gradients", choices=["allocated", "kept"], default="allocated")
    return p


def table(arch: str, rows, seconds: float) -> str:
    body = [[r.world_size, r.plan, r.batch_size, f"{r.recompute:.2f}", gib(r.rank.parameters), gib(r.rank.gradients), gib(r.rank.optimizer),
             gib(r.rank.buffers), gib(r.rank.step_peak), gib(r.rank.total)] for r in rows]
    headers = ["ranks", "plan", "batch / rank", "recompute / forward", "parameters", "gradients", "optimizer", "buffers", "step peak (gathered weights in it)", "total"]
    return f"### {arch} (predicted; profiled in {seconds:.0f} s)\n\n" + tabulate(body, headers=headers, tablefmt="github")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    for arch in args.arch:
        model = build_backbone(arch, args.input[1])
        start = time.perf_counter()
        rows = scaling(model, args.input, args.memory, args.optimizer, args.world_sizes, args.gradients)
        print(table(arch, rows, time.perf_counter() - start) + "\n", flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
