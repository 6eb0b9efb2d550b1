#!/usr/bin/env python
"""The "time" objective's prices against measured steps, for each kind of thing a plan prices.

    python tools/price_check.py --narrow 16 --input 4x3x64x64 --repeats 41             # the CPU's launch-bound stand-in
    python tools/price_check.py --device cuda --input 4x3x224x224 --repeats 21          # ResNet-50 on a GPU

One timed profile of ResNet-50 (``--narrow``: every width divided, see ``eager_overhead.build``), then
five hand-made plans over its first ``--units`` units (the stem and res2 by default), each run as a trunk
beside the plain one, interleaved (median of ``--repeats``): those units as one checkpointed segment (a
cut); the same with each region span in it nested as a ``"recompute"`` region; with only its last two
spans nested; no cut, those two spans as regions of the last segment; and the units as three cuts.
Each row gives the extra time over the plain step, measured and predicted (the plan's segments'
``recompute_seconds``), and their ratio: a planner ranks plans right where the ratios agree.
"""
import argparse
import copy
import pathlib
import sys

import torch
from tabulate import tabulate

from trunksplit import CheckpointedTrunk
from trunksplit.cli.parser import batch_shape, shape_text
from trunksplit.planning.search import Cuts, peak_model, plan_from_cuts

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # eager_overhead.py, beside this one, builds the models and runs the steps
import eager_overhead  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--narrow", type=int, default=1, metavar="D", help="every width divided by D (see eager_overhead.py)")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--units", type=int, default=7, help="the first units the plans checkpoint (ResNet-50: 7 is the stem and res2)")
    p.add_argument("--repeats", type=int, default=21, help="steps timed per plan, interleaved; the median is reported")
    return p


def plans(model, x, units: int) -> dict:
    """The five plans (label -> plan, priced by one timed profile) over the first ``units`` units."""
    request = CheckpointedTrunk(copy.deepcopy(model), memory_budget=1.0, objective="time").plan_request()
    measured = peak_model(request, x, regions=True)
    spans = [(r, s, "recompute") for r, s in measured.spans if s <= units]
    if len(spans) < 2:
        raise SystemExit(f"error: --units {units} holds {len(spans)} region span(s); the plans need two")
    shapes = {"a cut": ([0, units], []), "the cut, every span nested": ([0, units], spans), "the cut, its last two spans nested": ([0, units], spans[-2:]),
              "no cut, the two spans as last-segment regions": ([0], spans[-2:]), "three cuts": ([0, spans[-2][0], spans[-1][0], units], [])}
    return {label: plan_from_cuts(measured.costs.names, Cuts(starts, frozenset(regions)), request.stops, "budget", measured)
            for label, (starts, regions) in shapes.items()}


def rows(model, x, units: int, repeats: int) -> list:
    print("price_check: profiling (timed) ...", file=sys.stderr, flush=True)
    chosen = plans(model, x, units)
    print(f"price_check: timing {len(chosen)} plans and the plain step, {repeats} steps each ...", file=sys.stderr, flush=True)
    steps = {"plain": CheckpointedTrunk(copy.deepcopy(model))}
    steps.update({label: eager_overhead._with_plan(model, x, plan) for label, plan in chosen.items()})
    ms = eager_overhead._median_ms(steps, x, repeats)
    out = []
    for label, plan in chosen.items():
        predicted = sum(s.recompute_seconds for s in plan.segments) * 1e3
        extra = ms[label] - ms["plain"]
        out.append([label, f"{extra:.2f}", f"{predicted:.2f}", f"{predicted / extra:.2f}" if extra > 0 else "-"])
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no GPU here; on CPU: --narrow 16 --input 4x3x64x64", file=sys.stderr)
        return 2
    model = eager_overhead.build("resnet50", args.narrow, args.input[2]).to(device)
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(0)).to(device)
    print(f"### Prices against steps: resnet50{'' if args.narrow == 1 else f' / {args.narrow}'}, {shape_text(args.input)}, {device}, median of {args.repeats}\n")
    print(tabulate(rows(model, x, args.units, args.repeats), headers=["plan over the first units", "extra ms", "predicted ms", "predicted / measured"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
