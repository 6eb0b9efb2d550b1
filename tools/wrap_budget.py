#!/usr/bin/env python
"""Measure apply_activation_checkpointing(model, memory_budget=...) on torchvision models.

    python tools/wrap_budget.py --arch resnet50 vit_b_16 --input 4x3x128x128 --budgets 0.6 0.4

For each model and budget: the blocks wrapped (how many keep their convolution/matmul
outputs, "save_expensive"), the measured step peak as a share of the unwrapped step (gradients
kept between steps), the recompute, and the seconds the choice took.
"""
import argparse
import copy
import sys
import time

import torch
import torchvision

from trunksplit import BudgetTooLowError, apply_activation_checkpointing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--input", default="2x3x224x224", help="a batch shape, e.g. 4x3x128x128")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.6, 0.4])
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    shape = tuple(int(d) for d in args.input.split("x"))
    print("| model | budget | wrapped blocks (save_expensive) | measured peak / unwrapped | recompute / forward | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arch in args.arch:
        torch.manual_seed(0)
        base = torchvision.models.get_model(arch, **({"image_size": shape[-1]} if arch.startswith("vit_") else {}))
        x = torch.randn(*shape)
        for budget in args.budgets:
            model = copy.deepcopy(base)
            start = time.perf_counter()
            try:
                plan = apply_activation_checkpointing(model, memory_budget=budget, example_inputs=(x,), gradients="kept")
                row = [f"{len(plan.names)} ({plan.policies.count('save_expensive')})", f"{plan.peak_bytes / plan.unwrapped_peak_bytes:.2f}", f"{plan.recompute_flops / plan.forward_flops:.2f}"]
            except BudgetTooLowError as e:  # the smallest budget met, in the peak column
                row = ["-", f"floor {e.smallest_bytes / e.unsplit_bytes:.2f}" if e.smallest_bytes else str(e), "-"]
            print(f"| {arch} | {budget} | {row[0]} | {row[1]} | {row[2]} | {time.perf_counter() - start:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
