"""The optimizer stepped in backward on real gloo ranks: under DDP after each bucket's all-reduce,
under FSDP2 on the sharded parameter after its reduce-scatter. Each rank trains 3 steps both ways,
with the standard optimizer stepped after backward and stepped in backward; the parameters must
agree within 1e-6 relative (the reduction order differs: DDP's own reduction divides after its sum,
the hook before), and the in-backward ranks must leave no gradient behind."""
import os
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from trunksplit import LARS, CheckpointedTrunk, optimizer_in_backward, shard_trunk

from distributed_harness import run_processes
from reference import build, loss_of

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-4)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.05)),
    "lars": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)),
}


def _trunk(stepped: bool):
    return CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=3, strategy="vissl",
                             gradients="in_backward" if stepped else "allocated")


def _steps(model, optimizer, rank, steps=3):
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] *= 0.5  # a schedule, as the launcher sets it each step
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss_of(model(x), seed=step).backward()
        optimizer.step()
        optimizer.zero_grad()


def _ddp(rank, world_size, out, name):
    optimizer_class, kwargs = OPTIMIZERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        standard = DistributedDataParallel(_trunk(False))
        _steps(standard, optimizer_class(standard.parameters(), **kwargs), rank)
        stepped = DistributedDataParallel(_trunk(True), gradient_as_bucket_view=True)
        in_backward = optimizer_in_backward(stepped, optimizer_class, **kwargs)
        _steps(stepped, in_backward, rank)
    assert all(p.grad is None for p in stepped.parameters())
    assert stepped.module.update_temporaries == in_backward_temporaries(optimizer_class, kwargs)
    parameters = {how: {n: p.detach() for n, p in m.module.named_parameters()} for how, m in (("standard", standard), ("stepped", stepped))}
    torch.save(parameters, os.path.join(out, f"ddp_{name}_{rank}.pt"))


def in_backward_temporaries(optimizer_class, kwargs):
    from trunksplit.in_backward import update_temporaries

    return update_temporaries(optimizer_class, kwargs)


def _fsdp(rank, world_size, out, name):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    optimizer_class, kwargs = OPTIMIZERS[name]
    states = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for how in ("standard", "stepped"):
            trunk = _trunk(how == "stepped")
            shard_trunk(trunk)
            if how == "stepped":
                optimizer = optimizer_in_backward(trunk, optimizer_class, **kwargs)
            else:
                optimizer = optimizer_class(trunk.parameters(), **kwargs)
            _steps(trunk, optimizer, rank)
            if how == "stepped":
                assert all(p.grad is None for p in trunk.parameters())
            states[how] = get_model_state_dict(trunk, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(states, os.path.join(out, f"fsdp_{name}.pt"))


def _assert_close(standard, stepped):
    moved = 0
    for key, a in standard.items():
        b = stepped[key]
        if a.is_floating_point():
            scale = a.abs().max().clamp_min(1e-12)
            assert (a - b).abs().max() <= 1e-6 * scale, key
            moved += 1
    assert moved > 0


# AdamW's in the fast suite (two moments, a step counter); SGD and LARS (one momentum) in the slow one, as for FSDP2 below
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "adamw" else n for n in OPTIMIZERS])
def test_ddp_stepped_in_backward_after_each_buckets_all_reduce_trains_the_standard_weights(tmp_path, name):
    run_processes(_ddp, 2, (str(tmp_path), name))
    ranks = [torch.load(tmp_path / f"ddp_{name}_{r}.pt") for r in range(2)]
    _assert_close(ranks[0]["standard"], ranks[0]["stepped"])
    for key, value in ranks[0]["stepped"].items():  # the ranks stay replicas (BatchNorm statistics aside: parameters only)
        assert torch.equal(value, ranks[1]["stepped"][key]), key


@pytest.mark.parametrize("name", [pytest.param("sgd", marks=pytest.mark.slow), "adamw"])  # SGD: a second case, for the slow suite
def test_fsdp2_stepped_in_backward_on_the_sharded_parameters_trains_the_standard_weights(tmp_path, name):
    run_processes(_fsdp, 2, (str(tmp_path), name))
    states = torch.load(tmp_path / f"fsdp_{name}.pt")
    _assert_close(states["standard"], states["stepped"])


class _WithUnusedBranch(torch.nn.Module):
    """A trunk with a branch the forward never runs: under find_unused_parameters=True DDP reduces
    zeros for it, and the standard optimizer skips it (its gradient stays None)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def _unused(rank, world_size, out):
    kwargs = dict(lr=0.01, weight_decay=0.1)
    ends = {}
    for how in ("standard", "stepped"):
        model = DistributedDataParallel(_WithUnusedBranch(), find_unused_parameters=True, gradient_as_bucket_view=True)
        optimizer = optimizer_in_backward(model, torch.optim.AdamW, **kwargs) if how == "stepped" else torch.optim.AdamW(model.parameters(), **kwargs)
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        ends[how] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    torch.save(ends, os.path.join(out, f"unused_{rank}.pt"))


def test_parameters_no_rank_used_are_left_alone_as_ddp_leaves_them(tmp_path):
    """Stepped in backward they were updated from the bucket's zeros (weight decay and Adam's state
    moved them 1.9e-2 in 3 steps); now as the standard step: untouched."""
    run_processes(_unused, 2, (str(tmp_path),))
    for rank in range(2):
        ends = torch.load(tmp_path / f"unused_{rank}.pt")
        untouched = _WithUnusedBranch().unused
        for name, a in ends["standard"].items():
            assert ((a - ends["stepped"][name]).norm() / a.norm()).item() <= 1e-6, name
        assert torch.equal(ends["stepped"]["unused.weight"], untouched.weight) and torch.equal(ends["standard"]["unused.weight"], untouched.weight)


def _wrapped_after(rank, world_size, out):
    model = _WithUnusedBranch().used
    before = [p.detach().clone() for p in model.parameters()]
    optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    ddp = DistributedDataParallel(model)
    try:
        ddp(torch.randn(4, 8)).sum().backward()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    assert "wrap it in DDP first" in refused, refused
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no rank moved: the replicas stay one


def test_a_model_wrapped_in_ddp_after_the_optimizer_in_backward_is_refused_at_its_first_backward(tmp_path):
    run_processes(_wrapped_after, 2, (str(tmp_path),))
