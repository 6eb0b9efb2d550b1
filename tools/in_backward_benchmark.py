#!/usr/bin/env python
"""The optimizer stepped in backward against torch's default gradient mode, side by side.

    python tools/in_backward_benchmark.py --arch resnet50 vit_b_16 --input 4x3x224x224

For each model, one profile of its units feeds both modes' peak models. In each mode it plans
the floor (the lowest peak any plan reaches) and the least-recompute plans at budgets of 0.5 and
0.3 of the default mode's plain step, then measures each plan's step (the second; the tensor
tracker on CPU, the allocator on CUDA): the default mode with gradients set to None before it
(``zero_grad()``), the in-backward mode with ``--optimizer`` stepped in backward. Step time:
each in-backward plan against the standard step with the same plan (forward, backward, then
``optimizer.step()``), interleaved over ``--repeats``, medians. Then ``trunksplit.fit``'s batch
in each ``--memory`` (verified by a real step). Prints a markdown table.
"""
import argparse
import copy
import sys
import warnings
from dataclasses import replace

import torch

from trunksplit import CheckpointedTrunk, PeakMemory, fit, optimizer_in_backward
from trunksplit.fit import NAMED_OPTIMIZERS
from trunksplit.in_backward import update_temporaries
from trunksplit.planning.budget import MemoryBudget, parse_memory_size
from trunksplit.planning.peak import PeakModel
from trunksplit.planning.search import best_plan, peak_model, plan_from_cuts, plan_trunk
from trunksplit.cli.parser import batch_shape, shape_text
from trunksplit.ssl.backbones import build_backbone
from trunksplit.planning.timing import interleaved_medians

BUDGETS = (0.5, 0.3)  # of the default mode's plain step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["resnet50", "vit_b_16"], help="torchvision model names")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--optimizer", choices=sorted(NAMED_OPTIMIZERS), default="sgd", help="stepped in backward (and after backward in the standard step)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each plan in each mode; the median counts")
    p.add_argument("--memory", nargs="*", default=["512MiB", "2GiB"], help="fit's memory sizes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    return p


def _step(trunk, x, optimizer=None) -> None:
    trunk(x)[-1].float().pow(2).mean().backward()
    if optimizer is not None:  # the standard step: the optimizer after backward
        optimizer.step()
        optimizer.zero_grad()


def _second_step_peak(trunk, x, optimizer=None) -> int:
    _step(trunk, x, optimizer)  # the first makes the optimizer's state
    for p in trunk.parameters():
        p.grad = None
    with PeakMemory(x.device) as mem:
        trunk(x)[-1].float().pow(2).mean().backward()
    return mem.peak_bytes


def _trunk_with(base, x, plan, gradients: str, optimizer: str):
    """A copy of ``base`` running ``plan`` for ``x``, and its optimizer: stepped in backward, or standard."""
    trunk = CheckpointedTrunk(copy.deepcopy(base), strategy="balanced", gradients=gradients)
    optimizer_class, kwargs = NAMED_OPTIMIZERS[optimizer]
    if gradients == "in_backward":
        stepping = optimizer_in_backward(trunk, optimizer_class, **kwargs)
    else:
        stepping = optimizer_class([p for p in trunk.parameters() if p.requires_grad], **kwargs)
    trunk.store_plan(trunk.key_for(x), plan)
    return trunk, stepping


def _plans(request, x, costs_model, gradients: str, temporaries: float, plain: int):
    """The floor plan and the budget plans of one gradient mode, from one profile."""
    model = PeakModel(costs=costs_model.costs, feature_units=request.feature_units, gradients=gradients, spans=costs_model.spans, update_temporaries=temporaries)
    request = replace(request, gradients=gradients, update_temporaries=temporaries)
    floor = plan_from_cuts(list(request.names), best_plan(model, request.splittable, request.forced), request.stops, "budget", model)
    plans = {"floor": floor}
    for fraction in BUDGETS:
        try:
            plans[f"budget {fraction}"] = plan_trunk(replace(request, budget=MemoryBudget.parse(int(fraction * plain))), x, model)
        except ValueError:
            plans[f"budget {fraction}"] = None  # below this mode's floor
    return plans


def _timed(pairs, x, repeats: int) -> dict:
    """Median seconds of each (trunk, optimizer-after-backward or None) pair's step, interleaved."""
    return interleaved_medians({name: (lambda t=trunk, a=after: _step(t, x, a)) for name, (trunk, after) in pairs.items()}, x.device, repeats)


def benchmark(arch: str, args) -> list:
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = build_backbone(arch, args.input[2]).to(device)
    x = torch.randn(args.input, device=device)
    optimizer_class, kwargs = NAMED_OPTIMIZERS[args.optimizer]
    temporaries = update_temporaries(optimizer_class, kwargs, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_trunk = CheckpointedTrunk(copy.deepcopy(base))
        plain = _second_step_peak(plain_trunk, x, optimizer_class([p for p in plain_trunk.parameters()], **kwargs))
        request = CheckpointedTrunk(copy.deepcopy(base), memory_budget=0.5).plan_request()
        profiled = peak_model(request, x, regions=True)
        rows = []
        for gradients in ("allocated", "in_backward"):
            for name, plan in _plans(request, x, profiled, gradients, temporaries, plain).items():
                if plan is None:
                    rows.append((arch, gradients, name, None, None, None))
                    continue
                trunk, stepping = _trunk_with(base, x, plan, gradients, args.optimizer)
                measured = _second_step_peak(trunk, x, None if gradients == "in_backward" else stepping)
                ratio = None
                if gradients == "in_backward":  # the same plan, stepped after backward
                    standard, after = _trunk_with(base, x, plan, "allocated", args.optimizer)
                    seconds = _timed({"in_backward": (trunk, None), "standard": (standard, after)}, x, args.repeats)
                    ratio = seconds["in_backward"] / seconds["standard"]
                rows.append((arch, gradients, name, plan.predicted_peak_bytes / plain, measured / plain, ratio))
    return rows, plain


def _fitted_batch(model, args, memory: int, gradients: str) -> int:
    """fit's batch (checked by a real step), or 0 where not one image fits."""
    try:
        return fit(model, args.input[1:], memory, optimizer=args.optimizer, gradients=gradients).batch_size
    except ValueError:
        return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    memories = [parse_memory_size(m) for m in args.memory]
    print("| model | gradients | plan | predicted / default plain step | measured / default plain step | step time / standard step, same plan |")
    print("|---|---|---|---|---|---|")
    fits = []
    for arch in args.arch:
        rows, plain = benchmark(arch, args)
        for arch_, gradients, name, predicted, measured, ratio in rows:
            if predicted is None:
                print(f"| {arch_} | {gradients} | {name} | below this mode's floor | - | - |")
            else:
                print(f"| {arch_} | {gradients} | {name} | {predicted:.3f} | {measured:.3f} | {'-' if ratio is None else f'{ratio:.3f}'} |")
        sys.stdout.flush()
        model = build_backbone(arch, args.input[2]).to(args.device)
        for memory, text in zip(memories, args.memory):
            fits.append((arch, text, *(_fitted_batch(model, args, memory, g) for g in ("allocated", "in_backward"))))
        print(f"\n{arch}: default plain step {plain / 2**20:.1f} MiB ({shape_text(args.input)}, {args.optimizer})\n")
    print("| model | memory | fit's batch, default | fit's batch, in backward | ratio |")
    print("|---|---|---|---|---|")
    for arch, text, default, stepped in fits:
        print(f"| {arch} | {text} | {default} | {stepped} | {f'{stepped / default:.2f}x' if default else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
