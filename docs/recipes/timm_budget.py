#!/usr/bin/env python
"""A timm model trained at a memory budget, in place of ``set_grad_checkpointing``: runnable as it is.

    pip install -e ".[clients]"
    python docs/recipes/timm_budget.py --model convnext_atto --budget 0.6 --batch 8 --size 128 --steps 5

One changed line (marked ``# changed``): ``trunksplit.apply_activation_checkpointing`` measures the
model's blocks on a sample batch and checkpoints those that meet the budget with the least recompute,
where timm's switch checkpoints every block. Random weights and generated images (nothing is
downloaded); the loss is a stand-in (the features' mean square). It prints the plan (the blocks it wrapped, its peak
against the unwrapped step's), then a training step's peak measured both ways (the plain copy is trained
beside it, so the two runs' weights can be compared: they are equal).
"""
import argparse
import copy

import timm
import torch

import trunksplit


def train(model, batches, lr):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x in batches:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach().item()


def step_peak(model, x) -> int:
    """One step's peak beyond the model (the allocator on CUDA, tensor bytes on a CPU); gradients freed after."""
    with trunksplit.PeakMemory(x.device) as mem:
        model(x).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="convnext_atto", help="a timm model name")
    p.add_argument("--budget", type=float, default=0.6, help="a fraction of the unwrapped step's peak")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=0).to(device)
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device) for _ in range(args.steps)]
    plan = trunksplit.apply_activation_checkpointing(model, memory_budget=args.budget, example_inputs=(batches[0],))  # changed: was model.set_grad_checkpointing(True)
    print(plan)
    measured, unwrapped = step_peak(model, batches[0]), step_peak(plain, batches[0])
    print(f"measured step peak {measured / 2**20:.1f} MiB = {measured / unwrapped:.2f} of the unwrapped step's {unwrapped / 2**20:.1f} MiB")
    losses = train(model, batches, args.lr), train(plain, batches, args.lr)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    print(f"trained {args.steps} steps; last loss {losses[0]:.6f} (unwrapped: {losses[1]:.6f}); weights equal to the unwrapped run's: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
