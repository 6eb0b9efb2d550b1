"""Global BatchNorm (trunksplit.SyncBatchNorm) in two real gloo processes: the whole batch's
statistics, checkpointed or not, and no collective while a rank plans alone."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trunksplit import CheckpointedTrunk, SyncBatchNorm, convert_sync_batchnorm
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_model

from distributed_harness import run_processes, threads_of_workers
from plans import _with_plan
from reference import build, loss_of, plain_features

QUICK = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0",
         "TRAIN.BATCH_SIZE_PER_RANK", "4"]
KEYS = ["flatten"]  # alone, the trunk is one unsplit segment by default: the plain step
# cuts and regions of every policy, in a checkpointed segment and in the last one (as test_ddp's)
PLAN = ([0, 6, 10], [(4, 5, "recompute_stages"), (5, 6, "save_expensive"), (6, 8, "recompute"), (10, 11, "recompute_stages"),
                     (11, 12, "save_heavy"), (12, 13, "save_expensive")])


def _images(rank):
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(100 + rank))


def _trained(model, x, rank, plan=None):
    """One DDP step's gradients and the buffers after it, by the trunk's names; without a plan, the
    trunk one unsplit segment: nothing checkpointed."""
    trunk = CheckpointedTrunk(model, KEYS, **({} if plan is None else dict(memory_budget=0.9)))  # cost-aware: it runs the plan stored
    ran = trunk.plan if plan is None else _with_plan(trunk, x, *plan)
    assert plan is None or trunk.plan_for(x) is ran
    ddp = DDP(trunk)  # held through backward: its reducer averages the gradients
    loss_of(ddp(x), seed=7 + rank).backward()
    return {n: p.grad for n, p in trunk.named_parameters()}, {n: b.clone() for n, b in trunk.named_buffers()}, ran


def _counting_collectives(step):
    """``step()``'s result and how many ``all_reduce`` calls it made."""
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    try:
        return step(), len(calls)
    finally:
        dist.all_reduce = all_reduce


def _global_norm_steps(rank, world_size, out):
    model = convert_sync_batchnorm(build("resnet18"))
    x = _images(rank)
    plain, plain_calls = _counting_collectives(lambda: _trained(copy.deepcopy(model), x, rank))
    # a checkpointed forward whose backward never runs (its statistics kept for a recompute that never comes), then the step
    trunk, buffers = CheckpointedTrunk(model, KEYS, memory_budget=0.9), [b.clone() for b in model.buffers()]
    _with_plan(trunk, x, *PLAN)
    trunk(x)
    with torch.no_grad():
        for b, before in zip(model.buffers(), buffers):
            b.copy_(before)
    planned, planned_calls = _counting_collectives(lambda: _trained(model, x, rank, PLAN))
    torch.save({"plain": plain, "planned": planned, "calls": (plain_calls, planned_calls)}, f"{out}/rank{rank}.pt")


def _whole_batch_reference():
    """One process, torch's BatchNorm2d over both ranks' images; DDP averages the ranks' gradients,
    so the loss is the mean of the ranks' losses."""
    model = build("resnet18")
    x = torch.cat([_images(0), _images(1)])
    features = plain_features(model, x, KEYS)
    (sum(loss_of([f[2 * r:2 * r + 2] for f in features], seed=7 + r) for r in range(2)) / 2).backward()
    trunk = CheckpointedTrunk(model, KEYS)  # the trunk's names for the plain model's tensors
    return {n: p.grad for n, p in trunk.named_parameters()}, dict(trunk.named_buffers())


def _close(got, want):
    return (got.float() - want.float()).abs().max() <= 2e-5 * want.float().abs().max() + 1e-6


def test_two_ranks_normalise_over_the_whole_batch_as_one_process_and_checkpointing_changes_no_bit(tmp_path):
    run_processes(_global_norm_steps, 2, (str(tmp_path),))
    with threads_of_workers(2):
        grads, buffers = _whole_batch_reference()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (plain_grads, plain_buffers, unsplit), (planned_grads, planned_buffers, plan) = got["plain"], got["planned"]
        assert not any(s.checkpointed for s in unsplit.segments)
        assert plan.regions and sum(s.checkpointed for s in plan.segments) == 2
        assert set(plain_grads) == set(grads) and set(plain_buffers) == set(buffers)
        for n in grads:  # the whole batch's statistics and their gradients, up to the order of float sums
            assert _close(plain_grads[n], grads[n]), n
            assert torch.equal(planned_grads[n], plain_grads[n]), n
        for n in buffers:  # running statistics moved once, from the whole batch (unbiased by its count)
            assert _close(plain_buffers[n], buffers[n]), n
            assert torch.equal(planned_buffers[n], plain_buffers[n]), n
        assert int(plain_buffers["bn1.num_batches_tracked"]) == 1
        # one collective per norm forward and one backward, checkpointed or not: a recompute reuses the forward's statistics
        assert got["calls"] == (2 * 20, 2 * 20)  # resnet18's 20 BatchNorms


def _plan_alone(rank, world_size, out, group):
    """Rank 0 plans (profiles every unit, timed) while rank 1 waits for it: a layer that communicated
    while measured would meet nobody, and the run would hang. ``group``: the layers normalise over a
    group of their own (planning profiles private copies: a ProcessGroup cannot be copied)."""
    model = convert_sync_batchnorm(build("resnet18"), dist.new_group([0, 1]) if group else None)
    x = _images(rank)
    if rank == 0:
        trunk = CheckpointedTrunk(model, KEYS, num_splits=3, strategy="balanced", objective="time")
        torch.save(trunk.plan_for(x), f"{out}/plan.pt")
    dist.barrier()
    before = model.bn1.running_mean.clone()
    ddp = DDP(CheckpointedTrunk(model, KEYS))
    loss_of(ddp(x)).backward()  # then the ranks train together
    torch.save(model.bn1.running_mean - before, f"{out}/moved{rank}.pt")


@pytest.mark.parametrize("group", [False, True], ids=["world", "own_group"])
def test_a_rank_planning_alone_communicates_nothing_and_the_ranks_then_train_together(tmp_path, group):
    run_processes(_plan_alone, 2, (str(tmp_path), group), timeout=120)
    assert len(torch.load(tmp_path / "plan.pt", weights_only=False).segments) == 3
    moved = [torch.load(tmp_path / f"moved{rank}.pt") for rank in range(2)]
    assert moved[0].abs().sum() > 0 and torch.equal(moved[0], moved[1])  # the same global statistics on both ranks


def test_convert_keeps_the_parameters_and_buffers_and_one_process_is_batchnorm_bit_for_bit():
    torch.manual_seed(0)
    model = build("resnet18")
    plain, converted = copy.deepcopy(model), convert_sync_batchnorm(model)
    assert converted is model and isinstance(model.layer1[0].bn2, SyncBatchNorm)
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules())
    assert model.bn1.weight is converted.bn1.weight  # the same tensors, not copies: an optimizer built before steps them
    x = torch.randn(2, 3, 64, 64)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()  # no process group: nn.BatchNorm2d's forward
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), n


def test_an_input_without_channels_is_refused_saying_what_it_takes():
    norm = SyncBatchNorm(3)
    before = {n: b.clone() for n, b in norm.named_buffers()}
    with pytest.raises(ValueError, match=r"at least 2 dimensions \(N, C, \.\.\.\), got 1D"):
        norm(torch.randn(3))
    assert all(torch.equal(b, before[n]) for n, b in norm.named_buffers())


def test_the_launchers_vissl_key_makes_every_batchnorm_of_trunk_and_head_global():
    for convert in (False, True):
        model = build_model(load_config(QUICK, SMALL + ["MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN", str(convert)]))
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert len([m for m in model.head.modules() if m in norms]) == 1 and len(norms) == 21  # resnet18's 20, the head's 1
        assert all(isinstance(m, SyncBatchNorm) == convert for m in norms)
    with pytest.raises(ValueError, match=r"GROUP_SIZE -2: -1 \(one machine's ranks\), 0 \(every rank\) or a positive group size"):
        build_model(load_config(QUICK, SMALL + ["MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN", "True", "MODEL.SYNC_BN_CONFIG.GROUP_SIZE", "-2"]))


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3))


def _small_images(rank):
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(rank))


def _autocast_step(rank, world_size, out):
    model = convert_sync_batchnorm(_small())
    ddp = DDP(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ddp(_small_images(rank))
    y.float().square().sum().backward()
    torch.save((y.detach(), {n: p.grad for n, p in model.named_parameters()}), f"{out}/rank{rank}.pt")


def test_under_bfloat16_autocast_the_gradients_are_batchnorms_to_its_rounding(tmp_path):
    """The input gradient's statistics terms nearly cancel the rest: summed in bfloat16 they would leave
    the convolution before the norm a bias gradient 30x torch's rounding (it is 0: the norm removes the mean)."""
    run_processes(_autocast_step, 2, (str(tmp_path),))
    model = _small()
    with threads_of_workers(2), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(torch.cat([_small_images(0), _small_images(1)]))
    (want.float().square().sum() / 2).backward()
    got, grads = torch.load(tmp_path / "rank0.pt")
    assert got.dtype == want.dtype == torch.bfloat16 and torch.allclose(got.float(), want[:2].float(), rtol=2 ** -7, atol=2 ** -7)
    for n in ("0.weight", "1.weight", "1.bias"):
        assert _close_to_bfloat16(grads[n], model.get_submodule(n[0]).get_parameter(n[2:]).grad), n
    rounding = model[0].bias.grad.abs().max()  # torch's own, from zero
    assert grads["0.bias"].abs().max() <= max(4 * rounding, 1e-3 * grads["0.weight"].abs().max())


def _close_to_bfloat16(got, want):
    return (got - want).abs().max() <= 2 ** -6 * want.abs().max()


def _launcher_runs(rank, world_size, out):
    from trunksplit.ssl.loop import train  # the launcher's loop, in this gloo process group

    for name, strategy, convert in (("ddp", "ddp", True), ("fsdp", "fsdp", True), ("per_rank", "ddp", False)):
        train(load_config(QUICK, ["OUTPUT_DIR", f"{out}/{name}", *SMALL, "TRAIN.STEPS", "3", "DISTRIBUTED.STRATEGY", strategy,
                                  "MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN", str(convert), "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "balanced"]))


@pytest.mark.slow
def test_the_launcher_trains_global_batchnorm_under_fsdp2_to_the_ddp_runs_weights(tmp_path):
    run_processes(_launcher_runs, 2, (str(tmp_path),), timeout=600)
    ddp, fsdp, per_rank = (torch.load(tmp_path / name / "trunk.pt", weights_only=True) for name in ("ddp", "fsdp", "per_rank"))
    assert set(ddp) == set(fsdp) and all(torch.equal(ddp[k], fsdp[k]) for k in ddp)
    assert not torch.allclose(ddp["conv1.weight"], per_rank["conv1.weight"], rtol=0.1)  # each rank's statistics: another run


def _groups_of(rank, world_size, out):
    results = {}
    for size, machine in ((0, "2"), (-1, "2"), (-1, "1"), (1, "2"), (3, "2")):
        os.environ["LOCAL_WORLD_SIZE"] = machine  # torchrun's: the ranks on this machine
        try:
            model = build_model(load_config(QUICK, SMALL + ["MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN", "True", "MODEL.SYNC_BN_CONFIG.GROUP_SIZE", str(size)]))
        except ValueError as e:
            results[size, machine] = str(e)
            continue
        norm = model.trunk.get_submodule("bn1")
        assert all(m.process_group is norm.process_group for m in model.modules() if isinstance(m, SyncBatchNorm))  # the head's too
        norm(torch.randn(2, norm.num_features, 4, 4, generator=torch.Generator().manual_seed(rank)))
        spans = dist.get_world_size(norm.process_group) if norm.process_group is not None else world_size
        results[size, machine] = (spans, norm.running_mean.clone())
    torch.save(results, f"{out}/groups{rank}.pt")


def test_group_size_spans_vissls_groups_of_ranks_and_a_size_that_cannot_divide_the_world_is_refused(tmp_path):
    run_processes(_groups_of, 2, (str(tmp_path),))
    ranks = [torch.load(tmp_path / f"groups{rank}.pt") for rank in range(2)]
    for key, spans in {(0, "2"): 2, (-1, "2"): 2, (-1, "1"): 1, (1, "2"): 1}.items():  # 0: every rank; -1: one machine's
        (a, mean_a), (b, mean_b) = ranks[0][key], ranks[1][key]
        assert a == b == spans, key
        assert torch.equal(mean_a, mean_b) == (spans == 2), key  # statistics over both ranks' images, or each its own
    assert "groups of 3 ranks cannot divide the 2 ranks of this run" in ranks[0][3, "2"]


def _pickled_with_own_group(rank, world_size, out):
    """A run saves its model whole (``torch.save(model)``): rank r's layer normalises over a group of its own rank."""
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group
    torch.save(convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), groups[rank]), f"{out}/model{rank}.pt")


def _loaded_in_another_run(rank, world_size, out):
    """Another pair of processes loads it, having made groups of its own (the first takes the number the saved
    layer's group had in its process): training refuses, saying what to give it; given one, it trains."""
    mine = SyncBatchNorm(3, process_group=dist.new_group([0, 1]))
    model = torch.load(f"{out}/model{rank}.pt", weights_only=False)
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(rank))
    before = model[0].running_mean.clone()
    with pytest.raises(RuntimeError, match=r"pickled with a process group of another process .* m\.process_group = group"):
        model(x)
    assert torch.equal(model[0].running_mean, before)  # nothing moved
    model[0].process_group = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank makes every group
    reference = nn.BatchNorm2d(3)  # its own rank's batch: torch's BatchNorm
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(model[0].running_var, reference.running_var, rtol=0, atol=1e-6)
    mine(x)  # the layer made here trains over its group (no refusal)


def test_a_layer_pickled_with_its_processes_group_is_refused_in_another_processes_run_until_given_one(tmp_path):
    run_processes(_pickled_with_own_group, 2, (str(tmp_path),))
    run_processes(_loaded_in_another_run, 2, (str(tmp_path),))
