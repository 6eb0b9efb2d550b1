"""The ``trunksplit`` command: ``plan`` shows how a trunk would be cut, ``bench`` measures plans."""
import argparse
import sys
import warnings
from typing import List, Optional


def _shape(text: str):
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected an input shape like 8x3x224x224, got {text!r}")
    return dims


def _budget(text: str):
    value = float(text)
    return int(value) if value > 1 else value


def _plan(args) -> int:
    import torch
    import torchvision

    from .planner import annotate, peak_model
    from .trunk import CheckpointedTrunk

    if not hasattr(torchvision.models, args.arch):
        print(f"error: torchvision has no model {args.arch!r}", file=sys.stderr)
        return 2
    model = getattr(torchvision.models, args.arch)()
    x = torch.randn(*args.input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trunk = CheckpointedTrunk(model, args.features, num_splits=args.splits, strategy=args.strategy, memory_budget=args.budget)
        try:
            plan = annotate(trunk.plan_for(x), peak_model(trunk, x))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    unsplit = peak_model(trunk, x).peak([0])
    print(plan)
    print(f"predicted step peak {plan.predicted_peak_bytes / 2**20:.1f} MiB = {plan.predicted_peak_bytes / unsplit:.2f} of unsplit ({unsplit / 2**20:.1f} MiB), input {'x'.join(map(str, args.input))}")
    return 0


def _bench(args) -> int:
    from .bench import run_benchmark

    print(
        run_benchmark(
            args.arch, batch=args.batch, resolution=args.resolution, splits=args.splits, budgets=args.budgets,
            repeats=args.repeats, device=args.device, out_dir=args.out, selective=not args.no_selective,
        )
    )
    print(f"\nwritten to {args.out}/benchmark.md and {args.out}/benchmark.png")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="trunksplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print how a torchvision trunk would be cut, with predicted memory")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--splits", type=int, default=None)
    p.add_argument("--strategy", choices=["vissl", "balanced"], default="vissl")
    p.add_argument("--budget", type=_budget, default=None, help="bytes, or a fraction of the unsplit peak")
    p.add_argument("--features", nargs="+", default=["flatten"])
    p.add_argument("--input", type=_shape, default=(8, 3, 224, 224), help="e.g. 8x3x224x224")
    p.set_defaults(fn=_plan)
    b = sub.add_parser("bench", help="measure plain, checkpoint_sequential, vissl, balanced and budget plans")
    b.add_argument("--arch", nargs="+", default=["resnet50"])
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--resolution", type=int, default=224)
    b.add_argument("--splits", type=int, nargs="+", default=[4, 6])
    b.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.45])
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--device", default="cuda" if _cuda() else "cpu")
    b.add_argument("--out", default="output/bench")
    b.add_argument("--no-selective", action="store_true", help="skip the selective-wrapping rows")
    b.set_defaults(fn=_bench)
    args = parser.parse_args(argv)
    return args.fn(args)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
