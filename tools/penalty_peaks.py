#!/usr/bin/env python
"""A gradient penalty's step peak, plain and checkpointed: what plans do not predict.

    python tools/penalty_peaks.py --model resnet50 --input 4x3x224x224

A penalty (R1's: ``torch.autograd.grad(loss, images, create_graph=True)``, then one backward of the
loss plus the gradient's squared norm) keeps a graph of the first backward until the second, and
the second backward recomputes each checkpoint once more. Each row is one trunk: the plain model,
balanced cuts, budget plans (cuts and regions), every block under a ``checkpoint_wrapper``; its
predicted peak (one backward, as planned), and the measured peaks of a one-backward step and of a
penalty step, each beside the plain model's. Gradients kept (``zero_grad(set_to_none=False)``);
exact tensor bytes on a CPU, the allocator's peak on a GPU (``trunksplit.PeakMemory``).
"""
import argparse
import copy
import sys

import torch
import torchvision
from tabulate import tabulate

from trunksplit import CheckpointedTrunk, PeakMemory, checkpoint_wrapper
from trunksplit.cli.parser import batch_shape, shape_text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="a torchvision ResNet (the wrapped rows wrap its blocks)")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    return p


def step_peak(model: torch.nn.Module, x: torch.Tensor, penalty: bool) -> int:
    """Peak bytes of one step of ``model`` on ``x`` (which requires grad for a penalty), beyond what was
    live before it."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with PeakMemory(x.device) as mem:
        out = model(x)
        loss = (out[-1] if isinstance(out, list) else out).pow(2).mean()
        if penalty:
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            loss = loss + g.pow(2).sum()
        loss.backward()
    return mem.peak_bytes


def trunks(model: torch.nn.Module) -> dict:
    """label -> module: the plain trunk, balanced cuts, two budget plans, every block wrapped."""
    def planned(**kw):
        return CheckpointedTrunk(copy.deepcopy(model), ["flatten"], gradients="kept", **kw)

    wrapped = torch.nn.Sequential(*list(copy.deepcopy(model).children())[:-1], torch.nn.Flatten(1))
    for block in (m for m in wrapped.modules() if isinstance(m, (torchvision.models.resnet.BasicBlock, torchvision.models.resnet.Bottleneck))):
        checkpoint_wrapper(block)
    return {"plain": planned(), "balanced, 4 cuts": planned(num_splits=4, strategy="balanced"),
            "budget 0.7": planned(memory_budget=0.7, objective="flops"), "budget 0.5": planned(memory_budget=0.5, objective="flops"),
            "every block wrapped": wrapped}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().to(args.device)
    x = torch.randn(args.input, device=args.device)
    x_grad = x.clone().requires_grad_()  # a trunk plans apart for an input that requires grad
    rows, plain = [], None
    for label, trunk in trunks(model).items():
        print(f"penalty_peaks: {label}: measuring a one-backward step and a penalty step ...", file=sys.stderr, flush=True)
        predicted = None
        if isinstance(trunk, CheckpointedTrunk):  # planned before measuring
            predicted = trunk.plan_for(x).predicted_peak_bytes
            trunk.plan_for(x_grad)
        one, penalty = step_peak(trunk, x, False), step_peak(trunk, x_grad, True)
        plain = plain or (one, penalty)
        rows.append([label, "-" if predicted is None else f"{predicted / 2**20:.1f}", f"{one / 2**20:.1f}", f"{one / plain[0]:.2f}",
                     f"{penalty / 2**20:.1f}", f"{penalty / plain[1]:.2f}"])
    print(f"### A gradient penalty's step: {args.model}, {shape_text(args.input)}, {args.device}, gradients kept\n")
    print(tabulate(rows, headers=["trunk", "predicted (MiB)", "one backward (MiB)", "/ plain", "penalty (MiB)", "/ plain"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
