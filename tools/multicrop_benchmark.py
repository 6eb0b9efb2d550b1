#!/usr/bin/env python
"""The multi-crop step whole against backward by crop group, side by side in one run.

    python tools/multicrop_benchmark.py --batch 8 --repeats 3 --plot docs/bench_multicrop.png

For each recipe (DINO's crops, 2 x 224px + 8 x 96px, and SwAV's, 2 x 224px + 6 x 96px, on
ResNet-50, with each recipe's head and loss) and each trunk plan (unsplit, balanced 4 segments,
budget 0.5), one training step run whole (every crop's forward, one loss, one backward) and
grouped (``TRAIN.BACKWARD_BY_CROP_GROUP``: each resolution's forward and backward in turn): the
step's peak beyond the model and its gradients as the launcher measures it (the tensor tracker on
CPU, the allocator on CUDA), and its time, the median of ``--repeats`` interleaved steps. The
optimizer's step is not part of either. ``--plot`` draws each step's live tensor bytes over its
ops (unsplit trunk, whole and grouped), so the picture shows where the memory goes, and prints each step's
count of aten ops.
``--in-backward``: both steps with the recipe's optimizer stepped in backward (``OPTIM.IN_BACKWARD``;
grouped, every group but the last holds its updates), its state made by a first step.
``--bf16``: both forwards under bf16 autocast (``TRAIN.AUTOCAST bf16``).
"""
import argparse
import contextlib
import copy
import os
import sys
import warnings

import torch

from trunksplit import optimizer_in_backward
from trunksplit.planning.memory import PeakMemory, _TensorAccounting  # the tracker PeakMemory runs on CPU, to draw its curve
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_ssl_model
from trunksplit.ssl.grouped import grouped_step
from trunksplit.ssl.loop import whole_step_forward
from trunksplit.ssl.optim import optimizer_of
from trunksplit.ssl.parallel import autocast_for
from trunksplit.planning.timing import interleaved_medians

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"dino": "configs/recipes/dino.yaml", "swav": "configs/recipes/swav.yaml"}
PLANS = {
    "unsplit": ["MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING", "False"],
    "balanced 4": ["MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "4", "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "balanced"],
    "budget 0.5": ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.5"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=list(RECIPES), default=list(RECIPES), help="whose recipe crops, head and loss")
    p.add_argument("--arch", default="resnet50", help="the trunk (a torchvision name)")
    p.add_argument("--batch", type=int, default=8, help="images per step (each gives every crop)")
    p.add_argument("--plans", nargs="+", choices=list(PLANS), default=list(PLANS), help="the trunk's plans")
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each row; the median counts")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plot", default="", help="where to draw the memory over one step, whole and grouped (a PNG)")
    p.add_argument("--in-backward", action="store_true", help="step the recipe's optimizer in backward (OPTIM.IN_BACKWARD)")
    p.add_argument("--bf16", action="store_true", help="the forwards under bf16 autocast (TRAIN.AUTOCAST bf16)")
    return p


def _setup(method: str, plan: str, args):
    cfg = load_config(os.path.join(ROOT, RECIPES[method]), ["MODEL.TRUNK.NAME", args.arch, "TRAIN.BATCH_SIZE_PER_RANK", str(args.batch), *PLANS[plan],
                                                              "OPTIM.IN_BACKWARD", str(args.in_backward), "TRAIN.AUTOCAST", "bf16" if args.bf16 else ""])
    torch.manual_seed(0)
    model = build_ssl_model(cfg).to(args.device)
    g = torch.Generator().manual_seed(0)
    sizes = [s for s, c in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS) for _ in range(c)]
    crops = [torch.randn(args.batch, 3, s, s, generator=g).to(args.device) for s in sizes]
    return cfg, model, crops


def _step(cfg, model, crops, grouped: bool) -> None:
    autocast = autocast_for(cfg, crops[0].device)  # as the launcher: the forward under it, the backward after it
    if grouped:
        grouped_step(cfg, model, model, crops, 0, autocast, lambda part: part.backward(), contextlib.nullcontext)
    else:
        whole_step_forward(cfg, model, model, crops, 0, autocast).backward()
    model.zero_grad(set_to_none=True)


def measure(method: str, plan: str, args) -> list:
    """Rows (method, plan, whole peak, grouped peak, ratio, whole s, grouped s, ratio) for one recipe and plan."""
    cfg, model, crops = _setup(method, plan, args)
    models = {g: copy.deepcopy(model) for g in (False, True)}
    # stepped in backward: each copy's parameters updated by its own optimizer (held: they live as long as the copy)
    optimizer_class, optimizer_kwargs = optimizer_of(cfg)
    stand_ins = [optimizer_in_backward(m, optimizer_class, **optimizer_kwargs) for m in models.values()] if args.in_backward else []
    peaks = {}
    for grouped, m in models.items():
        _step(cfg, m, crops, grouped)  # plans each resolution, and warms up
        with PeakMemory(args.device) as mem:
            m.zero_grad(set_to_none=True)
            _step(cfg, m, crops, grouped)
        peaks[grouped] = mem.peak_bytes
    t = interleaved_medians({g: (lambda m=m, g=g: _step(cfg, m, crops, g)) for g, m in models.items()}, args.device, args.repeats, warmup=0)  # warmed above
    del stand_ins
    return [method, plan, f"{peaks[False] / 2**20:.0f}", f"{peaks[True] / 2**20:.0f}", f"{peaks[True] / peaks[False]:.3f}",
            f"{t[False]:.2f}", f"{t[True]:.2f}", f"{t[True] / t[False]:.3f}"]


class _LiveBytes(_TensorAccounting):
    """The tensor tracker, its live bytes recorded after each op: the curve the plot draws."""

    def __init__(self):
        super().__init__()
        self.curve = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.curve.append(self.current)
        return out


def plot(path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.methods), figsize=(6 * len(args.methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], args.methods):
        cfg, model, crops = _setup(method, "unsplit", args)
        for grouped, colour in ((False, "tab:red"), (True, "tab:blue")):
            m = copy.deepcopy(model)
            _step(cfg, m, crops, grouped)
            with _LiveBytes() as live:
                _step(cfg, m, crops, grouped)
            label = f"{'grouped' if grouped else 'whole step'} ({len(live.curve)} aten ops)"  # a GPU launches about one kernel each
            print(f"{method}, {label}")
            ax.plot([b / 2**20 for b in live.curve], color=colour, label=label)
        ax.set_title(f"{method}: {args.arch}, {args.batch} images, crops {list(cfg.DATA.CROP_COUNTS)} x {list(cfg.DATA.CROP_SIZES)}px")
        ax.set_xlabel("op")
        ax.set_ylabel("live tensors (MiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    from tabulate import tabulate

    args = build_parser().parse_args(argv)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in args.methods:
            for plan in args.plans:
                print(f"{method}, {plan} ...", file=sys.stderr, flush=True)  # minutes a row on CPU
                rows.append(measure(method, plan, args))
        headers = ["recipe", "trunk plan", "whole peak (MiB)", "grouped peak (MiB)", "grouped / whole", "whole s", "grouped s", "time ratio"]
        print(tabulate(rows, headers=headers, tablefmt="github"))
        if args.plot:
            plot(args.plot, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
