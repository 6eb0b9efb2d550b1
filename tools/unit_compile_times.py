#!/usr/bin/env python
"""Is a unit faster compiled on its own than eagerly, on this machine? One row per unit of a trunk.

    python tools/unit_compile_times.py --arch resnet50 --repeats 7

``trunk.compile()`` compiles each unit on its own inside eager checkpoints, so a plan that
recomputes much (budget 0.3) runs mostly per-unit compiled code: this prints each unit's training
step (forward and backward, on the input the trunk hands it) eagerly and compiled with inductor
as ``trunk.compile()`` compiles it (static shapes, no layout optimisation), medians of interleaved
repeats, and the sum over the trunk beside the whole trunk compiled as one graph.
"""
import argparse
import warnings

import torch
from tabulate import tabulate

from trunksplit import CheckpointedTrunk
from trunksplit.cli.parser import batch_shape
from trunksplit.planning.timing import interleaved_medians
from trunksplit.ssl.backbones import build_backbone

OPTIONS = dict(dynamic=False, options={"layout_optimization": False})  # as trunk.compile() compiles


def _step(fn, x) -> None:
    out = fn(x * 1)  # x * 1: a unit's input is a non-leaf, as in the trunk
    sum(o.float().sum() for o in (out if isinstance(out, list) else [out])).backward()  # a trunk returns its features


def _median_times(fns, x, repeats: int):
    """Median seconds of a step of each of ``fns``, interleaved, after two untimed rounds."""
    medians = interleaved_medians({i: (lambda fn=fn: _step(fn, x)) for i, fn in enumerate(fns)}, x.device, repeats, warmup=2)
    return [medians[i] for i in range(len(fns))]


def unit_rows(arch: str, x: torch.Tensor, repeats: int, memory_format=torch.contiguous_format):
    """(name, eager s, compiled s) per unit, and (eager s, whole-compiled s) for the whole trunk."""
    torch.manual_seed(0)
    trunk = CheckpointedTrunk(build_backbone(arch, x.shape[-1]).to(memory_format=memory_format), gradients="kept")
    rows, h = [], x
    for name, unit in trunk.units:
        inp = h.detach().requires_grad_()
        eager, compiled = _median_times([unit, torch.compile(unit, **OPTIONS)], inp, repeats)
        rows.append((name, eager, compiled))
        with torch.no_grad():
            h = unit(h)
    whole = _median_times([trunk, torch.compile(trunk, **OPTIONS)], x.requires_grad_(), repeats)
    return rows, whole


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--channels-last", action="store_true", help="weights and input channels-last, as trunk.compile() stores convolution weights")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("ignore")
    torch._dynamo.config.recompile_limit = 64  # private: every unit is a module of its own, some of one class
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(0))
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    rows, (eager_whole, compiled_whole) = unit_rows(args.arch, x.contiguous(memory_format=fmt), args.repeats, fmt)
    body = [[n, f"{e * 1e3:.1f}", f"{c * 1e3:.1f}", f"{c / e:.2f}"] for n, e, c in rows]
    eager, compiled = sum(r[1] for r in rows), sum(r[2] for r in rows)
    body.append(["sum over units", f"{eager * 1e3:.1f}", f"{compiled * 1e3:.1f}", f"{compiled / eager:.2f}"])
    body.append(["whole trunk, one graph", f"{eager_whole * 1e3:.1f}", f"{compiled_whole * 1e3:.1f}", f"{compiled_whole / eager_whole:.2f}"])
    print(f"### {args.arch}, input {tuple(x.shape)}{', channels-last' if args.channels_last else ''}, training step per unit, {torch.get_num_threads()} threads\n")
    print(tabulate(body, headers=["unit", "eager ms", "compiled ms", "compiled / eager"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
