#!/usr/bin/env python
"""How long a budget plan takes to make: profiling and search, per model, with the plan it makes.

    python tools/plan_time.py                                   # timm's MobileNetV3-small and EfficientNet-B0, ResNet-50
    python tools/plan_time.py --fit 300MiB                      # and how long fit takes to find its batch in 300 MiB
    python tools/plan_time.py --objective time                  # plans that minimise measured time (a GPU's default)
    PYTHONPATH=path/to/older/checkout python tools/plan_time.py # the same with another version of trunksplit

A ``CheckpointedTrunk`` with a memory budget plans at its first training forward; on a long
traced chain (tens of units, thousands of region templates) the search, not the profiling, was
most of that wait. Prints a markdown table: units, seconds to plan, where the segments start
and how many regions (so two versions can be seen to make the same plan).
"""
import argparse
import sys
import time

import torch
import torchvision
from tabulate import tabulate

import trunksplit
from trunksplit import CheckpointedTrunk, fit

MODELS = ("timm:mobilenetv3_small_100", "timm:efficientnet_b0", "resnet50")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), help="torchvision names, or timm:NAME (needs timm)")
    p.add_argument("--input", default="8x3x160x160", help="the batch planned for")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--gradients", default="kept", choices=["allocated", "kept", "in_backward"])
    p.add_argument("--objective", default="auto", choices=["auto", "flops", "time"], help="what the plan minimises (auto: time on a GPU, FLOPs on a CPU)")
    p.add_argument("--fit", default="", help="also time trunksplit.fit (no checking step) for one image of --input's shape in this memory")
    return p


def _model(name: str) -> torch.nn.Module:
    if name.startswith("timm:"):
        import timm  # an optional extra: only the timm rows need it

        return timm.create_model(name[len("timm:"):])
    return getattr(torchvision.models, name)()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    x = torch.randn(*map(int, args.input.split("x")))
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        trunk = CheckpointedTrunk(_model(name), memory_budget=args.budget, gradients=args.gradients, objective=args.objective)
        start = time.perf_counter()
        plan = trunk.plan_for(x)
        row = [name, len(trunk.units), f"{time.perf_counter() - start:.1f}", " ".join(str(s.start) for s in plan.segments), len(plan.regions)]
        if args.fit:
            start = time.perf_counter()
            fitted = fit(_model(name), tuple(x.shape[1:]), args.fit, gradients=args.gradients, verify=False)
            row += [f"{time.perf_counter() - start:.1f}", fitted.batch_size]
        rows.append(row)
    print(f"trunksplit from {trunksplit.__file__}, input {args.input}, budget {args.budget}, gradients {args.gradients}, objective {args.objective}, {torch.get_num_threads()} threads\n")
    headers = ["model", "units", "seconds to plan", "segments start at", "regions"] + (["seconds to fit", "fitted batch"] if args.fit else [])
    print(tabulate(rows, headers=headers, tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
