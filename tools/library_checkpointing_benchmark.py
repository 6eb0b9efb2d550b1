#!/usr/bin/env python
"""A library's own activation-checkpointing switch against trunksplit, side by side in one run.

    python tools/library_checkpointing_benchmark.py --against timm hf --input 4x3x224x224

timm's ``set_grad_checkpointing(True)`` (ResNet-50, ConvNeXt-T, ViT-B/16, Swin-T) and transformers'
``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before; ViT, DINOv2, ConvNeXt, base sizes, random weights) are one
setting each. For each model this measures the plain step, the switch's step, and trunksplit at
several budgets: a timm model as a ``CheckpointedTrunk`` (its chain cut, the budget planned from one
profile), a transformers model through ``apply_activation_checkpointing`` (its blocks wrapped, the
budget met by measured steps of the loss timed here, the mean square of the last output). Peaks are a training step's (the second; the tensor tracker on
CPU, the allocator on CUDA), gradients cleared before it; times are medians of ``--repeats``
interleaved steps. ``--gradients kept`` keeps the gradients allocated between steps (zeroed in
place, as ``zero_grad(set_to_none=False)`` does): peaks are then beyond parameters and gradients,
and trunksplit plans for that mode. Then, against the switch: trunksplit's plan at the same measured peak (or the
lowest below it) and its time, and trunksplit's lowest peak at no more than the switch's time.
Prints a markdown table; ``--plot PATH`` draws the (peak, time) curves.
"""
import argparse
import copy
import sys
import warnings

import torch

from trunksplit import CheckpointedTrunk, PeakMemory, apply_activation_checkpointing
from trunksplit.cli.parser import batch_shape
from trunksplit.planning.timing import interleaved_medians

TIMM = ("resnet50", "convnext_tiny", "vit_base_patch16_224", "swin_tiny_patch4_window7_224")
HF = ("vit", "dinov2", "convnext")
BUDGETS = (0.8, 0.6, 0.45, 0.3)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", nargs="+", choices=["timm", "hf"], default=["timm", "hf"], help="whose switch: timm's, transformers'")
    p.add_argument("--models", nargs="*", default=None, help="a subset of the models (timm names, or vit, dinov2, convnext)")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help="trunksplit's budgets, fractions of the plain step")
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each row; the median counts")
    p.add_argument("--gradients", choices=["allocated", "kept"], default="allocated",
                   help="allocated: set to None after each step (torch's default); kept: zeroed in place")
    p.add_argument("--plot", default="", help="where to draw the curves (a PNG); empty: no picture")
    return p


def _loss(out) -> torch.Tensor:
    if isinstance(out, (list, tuple)):
        out = out[-1]
    if hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    return out.float().pow(2).mean()


def _step(model, x, gradients: str) -> None:
    _loss(model(x)).backward()
    model.zero_grad(set_to_none=gradients == "allocated")


def _peak(model, x, gradients: str) -> int:
    _step(model, x, gradients)
    with PeakMemory(x.device) as mem:
        _step(model, x, gradients)
    return mem.peak_bytes


def _times(models: dict, x, repeats: int, gradients: str) -> dict:
    return interleaved_medians({name: (lambda m=model: _step(m, x, gradients)) for name, model in models.items()}, x.device, repeats)


def _timm(name: str, x, gradients: str):
    import timm

    torch.manual_seed(0)
    plain = timm.create_model(name, num_classes=0, **({"img_size": x.shape[-1]} if "vit" in name or "swin" in name else {}))
    switch = copy.deepcopy(plain)
    switch.set_grad_checkpointing(True)

    def trunk(budget):
        t = CheckpointedTrunk(copy.deepcopy(plain), memory_budget=budget, gradients=gradients)
        t.plan_for(x)
        return t

    return plain, switch, trunk


def _hf(name: str, x, gradients: str):
    import transformers

    size = x.shape[-1]
    config, model_class = {
        "vit": (transformers.ViTConfig(image_size=size), transformers.ViTModel),
        "dinov2": (transformers.Dinov2Config(image_size=size), transformers.Dinov2Model),
        "convnext": (transformers.ConvNextConfig(), transformers.ConvNextModel),
    }[name]
    torch.manual_seed(0)
    plain = model_class(config).train()
    switch = copy.deepcopy(plain)
    try:
        (getattr(switch, "activation_checkpointing_enable", None) or switch.gradient_checkpointing_enable)()  # the older name, where the transformers installed has no other
    except ValueError:  # "does not support activation checkpointing" (ConvNext): no switch to compare with
        switch = None

    def wrapped(budget):
        m = copy.deepcopy(plain)
        apply_activation_checkpointing(m, memory_budget=budget, example_inputs=(x,), gradients=gradients, loss_fn=_loss)  # the step measured here
        return m

    return plain, switch, wrapped


def benchmark(library: str, name: str, args) -> dict:
    print(f"{library} {name}: measuring the plain step, the switch, then trunksplit's budgets ...", file=sys.stderr, flush=True)  # minutes a model on CPU
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(0))
    g = args.gradients
    plain, switch, ours = (_timm if library == "timm" else _hf)(name, x, g)
    plain_peak = _peak(plain, x, g)
    switch_peak = _peak(switch, x, g) if switch is not None else None
    models = {"plain": plain, **({"switch": switch} if switch is not None else {})}
    budgets = sorted(set(args.budgets) | ({switch_peak / plain_peak} if switch is not None else set()))  # the switch's own peak among them
    for b in budgets:
        try:
            models[f"trunksplit {b:.3f}"] = ours(int(b * plain_peak))
        except ValueError:  # below the floor
            continue
    peaks = {k: (plain_peak if k == "plain" else switch_peak if k == "switch" else _peak(m, x, g)) for k, m in models.items()}
    times = _times(models, x, args.repeats, g)
    return {"library": library, "model": name, "peaks": peaks, "times": times}


def compare(row: dict) -> dict:
    """trunksplit against the switch: at its peak (the lowest time among plans at or below it), and at its time."""
    peaks, times = row["peaks"], row["times"]
    plain_p, plain_t = peaks["plain"], times["plain"]
    ours = [k for k in peaks if k.startswith("trunksplit")]
    curve = sorted((peaks[k] / plain_p, times[k] / plain_t) for k in ours)
    if "switch" not in peaks:  # the library has none: trunksplit's curve alone
        return {"switch": None, "at its peak": None, "at its time": None, "curve": curve}
    at_peak = [k for k in ours if peaks[k] <= peaks["switch"] * 1.01]
    at_time = [k for k in ours if times[k] <= times["switch"] * 1.02]
    best_time = min(at_peak, key=lambda k: times[k]) if at_peak else None
    best_peak = min(at_time, key=lambda k: peaks[k]) if at_time else None
    return {
        "switch": (peaks["switch"] / plain_p, times["switch"] / plain_t),
        "at its peak": None if best_time is None else (peaks[best_time] / plain_p, times[best_time] / plain_t),
        "at its time": None if best_peak is None else (peaks[best_peak] / plain_p, times[best_peak] / plain_t),
        "curve": curve,
    }


def _cell(pair) -> str:
    return "-" if pair is None else f"{pair[0]:.3f} / {pair[1]:.2f}x"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    jobs = [("timm", n) for n in TIMM if "timm" in args.against] + [("hf", n) for n in HF if "hf" in args.against]
    unknown = sorted(set(args.models or []) - {name for _, name in jobs})
    if unknown:  # measured nothing for them before, and said nothing
        parser.error(f"--models {' '.join(unknown)}: not a model of --against {' '.join(args.against)}; those are {', '.join(n for _, n in jobs)}")
    if args.models:
        jobs = [j for j in jobs if j[1] in args.models]
    print("| library | model | plain step (MiB) | switch: peak / time | trunksplit at the switch's peak | trunksplit at the switch's time | trunksplit's curve (peak / time) |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for library, name in jobs:
        row = benchmark(library, name, args)
        c = compare(row)
        results.append((row, c))
        curve = ", ".join(_cell(p) for p in c["curve"])
        print(f"| {library} | {name} | {row['peaks']['plain'] / 2**20:.1f} | {_cell(c['switch'])} | {_cell(c['at its peak'])} | {_cell(c['at its time'])} | {curve} |")
        sys.stdout.flush()
    if args.plot:
        _plot(results, args.plot)
    return 0


def _plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.2), squeeze=False)
    for ax, (row, c) in zip(axes[0], results):
        ax.plot(*zip(*c["curve"]), "o-", label="trunksplit budgets")
        if c["switch"] is not None:
            ax.plot(*c["switch"], "s", color="C3", markersize=8, label="the library's switch")
        ax.plot(1, 1, "x", color="k", label="plain")
        ax.set_title(f"{row['library']} {row['model']}", fontsize=8)
        ax.set_xlabel("peak / plain step")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("step time / plain step")
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
