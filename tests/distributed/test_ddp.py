"""Two real gloo processes: both DDP paths average the per-rank gradients, as one process computes them."""

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trunksplit import CheckpointedTrunk, convert_sync_batchnorm, manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params

from distributed_harness import run_processes, threads_of_workers
from reference import build, loss_of, plain_features
from plans import _with_plan


def _views(rank):
    """Each rank's own data: two views, as SimCLR runs them."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 3, 64, 64, generator=g), torch.randn(2, 3, 64, 64, generator=g)


def _two_forward_step(rank, world_size, arch, manual, out, plan=None):
    model = build(arch)
    how = dict(num_splits=4) if plan is None else dict(memory_budget=0.9)
    trunk = CheckpointedTrunk(model, ["res4", "flatten"], use_reentrant=manual, **how)
    a, b = _views(rank)
    if plan is not None:  # cuts and regions of our choosing, the same on every rank
        _with_plan(trunk, a, *plan)
    ddp = DDP(trunk)
    if manual:
        assert manual_gradient_reduction(ddp, True)
        with ddp.no_sync():
            manual_sync_params(ddp)
            loss = loss_of(ddp(a)) + loss_of(ddp(b), seed=7)
            loss.backward()
        manual_gradient_all_reduce(ddp)
    else:
        loss = loss_of(ddp(a)) + loss_of(ddp(b), seed=7)
        loss.backward()
    torch.save({n: p.grad for n, p in trunk.named_parameters()}, f"{out}/rank{rank}.pt")
    torch.save(trunk.plan.regions, f"{out}/regions{rank}.pt")


def _reference_average(arch, world_size):
    """Single process: each rank's plain-model gradients, averaged."""
    total = None
    for rank in range(world_size):
        model = build(arch)
        a, b = _views(rank)
        (loss_of(plain_features(model, a, ["res4", "flatten"])) + loss_of(plain_features(model, b, ["res4", "flatten"]), seed=7)).backward()
        # trunk names are the feature-block names: map the plain model's names to them
        grads = {n: p.grad for n, p in CheckpointedTrunk(model, ["res4", "flatten"]).named_parameters()}
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
    return {n: g / world_size for n, g in total.items()}


# RegNet's (3.4 s for both paths) in the slow tier: the averaging is each path's own, checked fast on ResNet-18 here and
# on ConvNeXt and ViT below, and RegNet's blocks train exactly in tests/chains/test_families.py
@pytest.mark.parametrize("arch", ["resnet18", pytest.param("regnet_x_400mf", marks=pytest.mark.slow)])
@pytest.mark.parametrize("manual", [False, True], ids=["native_ddp", "manual_reentrant"])
def test_both_ddp_paths_average_per_rank_gradients(arch, manual, tmp_path):
    run_processes(_two_forward_step, 2, (arch, manual, str(tmp_path)))
    with threads_of_workers(2):
        want = _reference_average(arch, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(want)
        for n in want:
            # native path: exact; manual path runs reentrant checkpoint, whose summation order differs in the last bits
            assert got[n] is not None, n
            assert (got[n] - want[n]).abs().max() <= (0 if not manual else 1e-5 * want[n].abs().max()), n


def test_native_ddp_averages_gradients_through_regions(tmp_path):
    """Regions of every policy, nested in a checkpointed segment and in the last one, two forwards per step."""
    plan = ([0, 6, 10], [(4, 5, "recompute_stages"), (5, 6, "save_expensive"), (6, 8, "recompute"), (8, 9, "recompute_stages"),
                         (10, 11, "recompute_stages"), (11, 12, "save_heavy"), (12, 13, "save_expensive")])
    run_processes(_two_forward_step, 2, ("resnet18", False, str(tmp_path), plan))
    with threads_of_workers(2):
        want = _reference_average("resnet18", 2)
    for rank in range(2):
        assert torch.load(tmp_path / f"regions{rank}.pt")  # the plan has regions
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(want)
        for n in want:
            assert torch.equal(got[n], want[n]), n


def _diverged_buffers(rank, world_size, out):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ddp = DDP(model)  # DDP broadcasts rank 0's state here
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank + 1))
        model[1].num_batches_tracked.fill_(10 * (rank + 1))
    manual_sync_params(ddp)
    torch.save({n: b for n, b in model.named_buffers()}, f"{out}/rank{rank}.pt")


def test_manual_sync_params_restores_rank0_buffers(tmp_path):
    run_processes(_diverged_buffers, 2, (str(tmp_path),))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["1.running_mean"], torch.ones(4))
        assert int(got["1.num_batches_tracked"]) == 10


def _subgroup_step(rank, world_size, out):
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ddp = DDP(model, process_group=groups[rank])
    with ddp.no_sync():
        ddp(torch.full((1, 3), float(rank + 1))).sum().backward()
    manual_gradient_all_reduce(ddp)
    torch.save(model.weight.grad, f"{out}/rank{rank}.pt")


def test_a_subgroup_divides_by_its_own_size(tmp_path):
    run_processes(_subgroup_step, 2, (str(tmp_path),))
    for rank in range(2):
        # one rank per group: the average is the rank's own gradient (dividing by the world would halve it)
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), torch.full((2, 3), float(rank + 1)))


def _uneven_step(rank, world_size, out):
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 1)})
    ddp = DDP(model, find_unused_parameters=True)
    x = torch.ones(1, 3)
    with ddp.no_sync():  # rank 0 uses head a only, rank 1 head b only
        (model["a"] if rank == 0 else model["b"])(x).sum().backward()
    manual_gradient_all_reduce(ddp)
    torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out}/rank{rank}.pt")


def test_gradients_missing_on_some_ranks_count_as_zeros_without_hanging(tmp_path):
    run_processes(_uneven_step, 2, (str(tmp_path),), timeout=120)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for head in "ab":
            assert torch.equal(got[f"{head}.weight"], torch.full((1, 3), 0.5))
            assert torch.equal(got[f"{head}.bias"], torch.full((1,), 0.5))


def test_manual_reduction_needs_the_flag_and_a_ddp_model():
    assert not manual_gradient_reduction(nn.Linear(2, 2), True)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        manual_gradient_all_reduce(nn.Linear(2, 2))


def _reentrant_native_ddp_two_forwards(rank, world_size):
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=3, use_reentrant=True)
    ddp = DDP(trunk)
    a, b = _views(rank)
    (loss_of(ddp(a)) + loss_of(ddp(b[:, :, :32, :32]))).backward()


def test_why_the_manual_path_exists_reentrant_native_ddp_fails_with_two_forwards():
    # The README and the training loop's guard rely on this: each reentrant segment runs its own
    # backward, so with two forwards DDP sees a parameter's hook fire twice.
    with pytest.raises(AssertionError, match="marked (as )?ready twice|mark a variable ready only once"):
        run_processes(_reentrant_native_ddp_two_forwards, 2, timeout=120)


def _count_collectives(rank, world_size, out):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])  # 100 parameters
    ddp = DDP(model)
    with ddp.no_sync():
        model(torch.full((2, 8), float(rank))).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        manual_gradient_all_reduce(ddp)
    finally:
        dist.all_reduce = real
    torch.save({"calls": len(calls), "grads": {n: p.grad for n, p in model.named_parameters()}, "own": want}, f"{out}/rank{rank}.pt")


def test_gradients_travel_in_a_few_flat_buckets_not_one_collective_per_parameter(tmp_path):
    run_processes(_count_collectives, 2, (str(tmp_path),))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["calls"] == r1["calls"] == 2  # one to agree on which gradients exist, one bucket
    for n in r0["grads"]:
        avg = (r0["own"][n] + r1["own"][n]) / 2
        assert torch.equal(r0["grads"][n], avg) and torch.equal(r1["grads"][n], avg), n


def _family_step(rank, world_size, name, manual, out):
    from zoo import input_for, small

    model = small(name)
    trunk = CheckpointedTrunk(model, num_splits=4, strategy="balanced", use_reentrant=manual)
    ddp = DDP(trunk)
    a, b = input_for(name) + rank, input_for(name) - rank
    torch.manual_seed(1000 + rank)  # dropout and stochastic depth masks, as the reference draws them
    if manual:
        with ddp.no_sync():
            manual_sync_params(ddp)
            (loss_of(ddp(a)) + loss_of(ddp(b), seed=7)).backward()
        manual_gradient_all_reduce(ddp)
    else:
        (loss_of(ddp(a)) + loss_of(ddp(b), seed=7)).backward()
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize(
    "manual,name",
    # each family and each path once in the fast suite; the other pairing in the slow one
    [(False, "convnext"), (True, "vit"), pytest.param(False, "vit", marks=pytest.mark.slow), pytest.param(True, "convnext", marks=pytest.mark.slow)],
    ids=["native_ddp-convnext", "manual_reentrant-vit", "native_ddp-vit", "manual_reentrant-convnext"],
)
def test_families_train_under_both_ddp_paths_like_one_process(name, manual, tmp_path):
    from zoo import input_for, small, without_head

    run_processes(_family_step, 2, (name, manual, str(tmp_path)))
    total = None
    for rank in range(2):  # single process: each rank's plain-model gradients, averaged
        model = without_head(small(name))
        torch.manual_seed(1000 + rank)
        with threads_of_workers(2):
            (loss_of([model(input_for(name) + rank)]) + loss_of([model(input_for(name) - rank)], seed=7)).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
    want = {n: g / 2 for n, g in total.items()}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(want)  # every trunk parameter has a gradient, the head none
        for n in want:
            assert torch.allclose(want[n], got[n], rtol=1e-5, atol=1e-6), n


def _conv_blocks():

    torch.manual_seed(0)  # no conv bias: before BatchNorm its gradient is zero but for rounding
    return OrderedDict(conv1=nn.Conv2d(3, 8, 3, padding=1, bias=False), bn1=nn.BatchNorm2d(8), relu1=nn.ReLU(),
                       conv2=nn.Conv2d(8, 8, 3, padding=1, bias=False), bn2=nn.BatchNorm2d(8))


def _compiled_under_ddp(rank, world_size, out, backend, global_norm=False):
    """trunk.compile() under plain DDP, two forwards per step, against the eager DDP trunk; ``global_norm``:
    its BatchNorms trunksplit.SyncBatchNorm (a collective in each forward, recompute and backward)."""
    views = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    grads = {}
    for compiled in (False, True):
        blocks = _conv_blocks()
        if global_norm:
            blocks = OrderedDict((name, convert_sync_batchnorm(m)) for name, m in blocks.items())
        trunk = CheckpointedTrunk(blocks, num_splits=2, strategy="balanced")
        if compiled:
            trunk.compile(backend=backend)
        ddp = DDP(trunk)
        for _ in range(2):  # two steps: the second runs compiled code already made
            ddp.zero_grad()
            sum(loss_of(ddp(v)) for v in views).backward()
        grads[compiled] = {n: p.grad.clone() for n, p in trunk.named_parameters()}
        grads[f"{compiled} buffers"] = {n: b.clone() for n, b in trunk.named_buffers()}
    if rank == 0:
        torch.save(grads, f"{out}/compiled.pt")


# inductor: its code generation (20-30 s in two processes with a cold cache) and its channels-last
# weights in DDP's buckets; aot_eager (dynamo and AOT autograd, as tests/test_compile.py) in the fast suite
@pytest.mark.parametrize("backend, global_norm", [pytest.param("inductor", False, marks=pytest.mark.slow), ("aot_eager", False),
                                                  pytest.param("aot_eager", True, marks=pytest.mark.slow)], ids=["inductor", "aot_eager", "aot_eager-global_norm"])
def test_a_compiled_trunk_trains_under_ddp_as_the_eager_one(tmp_path, backend, global_norm):
    torch._dynamo.reset()
    run_processes(_compiled_under_ddp, 2, (str(tmp_path), backend, global_norm), timeout=400)
    grads = torch.load(tmp_path / "compiled.pt")
    for n, ref in grads[False].items():
        assert torch.linalg.vector_norm(grads[True][n] - ref) <= 1e-4 * torch.linalg.vector_norm(ref) + 1e-7, n
    for n, ref in grads["False buffers"].items():
        assert torch.allclose(grads["True buffers"][n].float(), ref.float(), rtol=1e-4, atol=1e-6), n


FIT_SHAPE = (3, 96, 96)
FIT_MEMORY = 120 * 2**20


def _fitted_ddp_total(rank, world_size, out, gradients):
    """``trunksplit.fit`` as its docstring tells a DDP user, then three steps of the DDP trunk: rank 0 writes
    everything resident during the last (the model, SGD's momentum, DDP's buckets, the gradients) plus its
    measured peak. Kept, ``gradient_as_bucket_view``: the gradients are the buckets, fitted to the whole
    memory; freed, DDP's defaults: fitted to the memory less one gradient copy (the buckets beside them)."""
    import json
    import torchvision

    from trunksplit import PeakMemory, fit

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(width_mult=0.5)
    trained = [p for p in CheckpointedTrunk(model).parameters() if p.requires_grad]  # what fit's trunk trains: not the classifier
    gradient_bytes = sum(p.numel() * p.element_size() for p in trained)
    memory = FIT_MEMORY if gradients == "kept" else FIT_MEMORY - gradient_bytes
    found = fit(model, FIT_SHAPE, memory, optimizer="sgd", gradients=gradients)
    trunk = found.trunk.train()
    params = [p for p in trunk.parameters() if p.requires_grad]
    if gradients == "kept":  # zeros before DDP, which makes them views into its buckets at once
        for p in params:
            p.grad = torch.zeros_like(p)
    ddp = DDP(trunk, gradient_as_bucket_view=gradients == "kept")  # freed: DDP's default, the gradients beside its buckets
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    x = torch.randn(found.batch_size, *FIT_SHAPE)
    for _ in range(3):  # DDP makes its buckets anew at the second step
        with PeakMemory() as mem:
            sum(f.sum() for f in ddp(x)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=gradients != "kept")
    storages = {}
    tensors = [*model.parameters(), *model.buffers(), *(t for s in optimizer.state.values() for t in s.values())]
    for t in [*tensors, *(p.grad for p in params if p.grad is not None)]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    buckets = 0 if gradients == "kept" else gradient_bytes  # beside freed gradients, the buckets are no tensor left to count
    if rank == 0:
        with open(f"{out}/total.json", "w") as f:
            json.dump(sum(storages.values()) + buckets + mem.peak_bytes, f)


@pytest.mark.parametrize("gradients", ["kept", pytest.param("allocated", marks=pytest.mark.slow)])  # allocated: slow, for the fast suite's time
def test_fit_as_its_docstring_tells_a_ddp_user_fits_the_ddp_step(tmp_path, gradients):
    import json

    run_processes(_fitted_ddp_total, 2, (str(tmp_path), gradients))
    total = json.loads((tmp_path / "total.json").read_text())
    assert 0.85 * FIT_MEMORY <= total <= FIT_MEMORY, total / FIT_MEMORY
