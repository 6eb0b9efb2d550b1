"""FSDP2 (fully_shard) on real gloo processes: a sharded trunk's gradients are one process's.

Each rank trains on its own micro-batch; the reference is one process, unsharded and
unsplit, that runs every rank's micro-batch in turn and accumulates: each rank's full
gradient (``full_tensor()``) times the world size must equal that sum. Dropout and
stochastic depth draw from a seed per micro-batch on both sides.
"""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trunksplit import CheckpointedTrunk, shard_trunk
from trunksplit.planning.memory import profiled_peak
from trunksplit.planning.plan import Segment, SplitPlan
from trunksplit.planning.search import region_spans
from trunksplit.planning.sharding import rank_memory
from trunksplit.recompute.policies import POLICIES
from trunksplit.ssl.backbones import resnet_of_width

from distributed_harness import run_processes, threads_of_workers
from reference import loss_of
from zoo import small

WORLD = 2

# (model, how the trunk is planned, plan before sharding): vissl, balanced and budget plans with
# regions, planned after sharding (the first training forward) or before it (plan_for)
CASES = {
    "resnet18_vissl": ("resnet18", dict(num_splits=3), False),
    "resnet18_balanced_after": ("resnet18", dict(num_splits=3, strategy="balanced"), False),
    "resnet18_balanced_before": ("resnet18", dict(num_splits=3, strategy="balanced"), True),
    "resnet18_budget_regions": ("resnet18", dict(memory_budget=0.8, gradients="kept"), False),
    "resnet18_selective_regions": ("resnet18", dict(memory_budget=0.85, gradients="kept"), False),  # runs STORED's plan
    "vit_balanced": ("vit", dict(num_splits=3, strategy="balanced"), False),
    "traced_budget": ("traced", dict(memory_budget=0.7, gradients="kept"), False),  # 0.6 met once at 0.630 feasible, under load
}

# Plans stored, not measured (the budget planner's figures under FSDP2 vary from run to run): one unsplit segment of
# selective regions, the plan the planner gave at 0.85 here. Its first region (conv1 .. maxpool) is recomputed from
# maxpool's backward, before FSDP2's pre-backward hooks of conv1 and bn1 ran: the step failed in torch's replay, as
# CI's run of the budget cases above did (their measured plans vary; the error was this one).
STORED = {"resnet18_selective_regions": (Segment("flatten", 0, 14, checkpointed=False, regions=((0, 4, "save_heavy"), (4, 10, "save_heavy"), (10, 14, "save_heavy"))),)}


class Traced(nn.Module):
    """A model no family knows: its chain is traced (units are fx GraphModules)."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.GELU()) for _ in range(depth))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return x.mean((2, 3))


def _model(name):
    if name == "traced":
        torch.manual_seed(0)
        return Traced()
    if name == "resnet18":  # a quarter as wide: vissl's blocks, a fourteenth of the weights to shard and compare
        torch.manual_seed(0)
        return resnet_of_width("resnet18", 0.25)
    return small(name)


def _micro_batch(name, rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(2, 3, 64 if name == "resnet18" else 32, 64 if name == "resnet18" else 32, generator=g)


def _sharded_steps(rank, world_size, out):
    for case, (name, how, plan_first) in CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trunk = CheckpointedTrunk(_model(name), **how)
            x = _micro_batch(name, rank)
            if plan_first:
                trunk.plan_for(x)
            if case in STORED:
                trunk.store_plan(trunk.key_for(x), SplitPlan(units=tuple(n for n, _ in trunk.units), segments=STORED[case], strategy="budget"))
            shard_trunk(trunk)
            torch.manual_seed(7 + rank)
            loss_of(trunk(x)).backward()
        plans = [None] * world_size
        dist.all_gather_object(plans, trunk.plan)
        grads = {n: p.grad.full_tensor() * world_size for n, p in trunk.named_parameters()}  # every rank all-gathers
        if rank == 0:
            assert plans[0] == plans[1], case  # every rank runs rank 0's plan
            torch.save({"grads": grads, "plan": trunk.plan}, os.path.join(out, f"{case}.pt"))
    _held_bytes(trunk, rank, out)


def _held_bytes(trunk, rank, out):
    """What this rank really holds of the last case's trunk: parameter and gradient shards, AdamW's state."""
    opt = torch.optim.AdamW(trunk.parameters())
    opt.step()
    local = [p.to_local() for p in trunk.parameters()]
    state = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    held = {"parameters": sum(t.numel() * t.element_size() for t in local),
            "gradients": sum(p.grad.to_local().numel() * p.grad.element_size() for p in trunk.parameters()), "optimizer": state}
    torch.save(held, os.path.join(out, f"held{rank}.pt"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run_processes(_sharded_steps, WORLD, (str(out),), timeout=400)
    return out


@pytest.mark.xdist_group("fsdp_sharded")  # one worker runs the fixture's ranks (11-17 s) once for every case
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_gradients_equal_one_process_accumulating_every_micro_batch(sharded, case):
    name, how, _ = CASES[case]
    saved = torch.load(sharded / f"{case}.pt", weights_only=False)
    plan = saved["plan"]
    if case in STORED:
        assert plan.segments == STORED[case]  # every rank ran the stored plan
    else:
        assert plan.predicted_peak_bytes is not None or how.get("num_splits") and plan.strategy == "vissl"
    if how.get("memory_budget"):
        assert plan.strategy == "budget" and plan.regions  # nested regions run under FSDP too
    reference = CheckpointedTrunk(_model(name))  # one process: unsharded, one unsplit segment
    for rank in range(WORLD):
        torch.manual_seed(7 + rank)
        with threads_of_workers(WORLD):  # the ranks' CPU kernels, so only sharding differs
            loss_of(reference(_micro_batch(name, rank))).backward()
    want = dict(reference.named_parameters())
    assert set(want) == set(saved["grads"])
    for n, got in saved["grads"].items():
        ref = want[n].grad
        assert torch.linalg.vector_norm(got - ref) <= 1e-6 * torch.linalg.vector_norm(ref) + 1e-12, (case, n)


def _region_plans(trunk):
    """Every region the planner may place on the trunk of runs of one to three of its smallest spans, as
    the one region of an unsplit plan under each policy, and nested in a checkpointed segment."""
    names = tuple(n for n, _ in trunk.units)
    spans = region_spans(trunk.units)
    regions = [(spans[i][0], spans[j][1]) for i in range(len(spans)) for j in range(i, min(i + 3, len(spans)))]
    whole = [(Segment("flatten", 0, len(names), checkpointed=False, regions=((a, b, p.name),)),)
             for p in POLICIES.values() for a, b in regions]
    nested = [(Segment("a", 0, len(names) - 1, regions=((a, b, "save_expensive"),)), Segment("flatten", len(names) - 1, len(names), checkpointed=False))
              for a, b in regions if b < len(names)]
    return [SplitPlan(units=names, segments=segments, strategy="budget") for segments in whole + nested]


def _every_region_steps(rank, world_size, out):
    plans = _region_plans(CheckpointedTrunk(_model("resnet18"), memory_budget=0.85))
    grads = []
    for plan in plans:
        trunk = CheckpointedTrunk(_model("resnet18"), memory_budget=0.85, gradients="kept")
        x = _micro_batch("resnet18", rank)
        trunk.store_plan(trunk.key_for(x), plan)
        shard_trunk(trunk)
        loss_of(trunk(x)).backward()
        grads.append({n: p.grad.full_tensor() * world_size for n, p in trunk.named_parameters()})
    if rank == 0:
        torch.save({"plans": plans, "grads": grads}, os.path.join(out, "regions.pt"))


@pytest.mark.slow  # 177 sharded steps: 40 s on 2 cores
def test_every_region_the_planner_may_place_runs_under_fsdp2_with_one_process_gradients(tmp_path):
    """The budget planner's figures under FSDP2 vary from run to run, and so do its plans: every plan it may make
    must run. A region holding several sharded units whose backward begins before their pre-backward hooks
    (conv1 .. maxpool) failed in torch's selective replay; the fast suite's cases run one such plan."""
    run_processes(_every_region_steps, WORLD, (str(tmp_path),), timeout=400)
    saved = torch.load(tmp_path / "regions.pt", weights_only=False)
    reference = CheckpointedTrunk(_model("resnet18"))
    for rank in range(WORLD):
        with threads_of_workers(WORLD):
            loss_of(reference(_micro_batch("resnet18", rank))).backward()
    assert len(saved["plans"]) == len(_region_plans(reference)) > 60
    for plan, grads in zip(saved["plans"], saved["grads"]):
        for n, p in reference.named_parameters():
            assert torch.linalg.vector_norm(grads[n] - p.grad) <= 1e-6 * torch.linalg.vector_norm(p.grad) + 1e-12, (plan.regions, n)


def test_sharding_without_a_process_group_twice_or_reentrant_is_a_clear_error():
    trunk = CheckpointedTrunk(_model("resnet18"), num_splits=2)
    with pytest.raises(ValueError, match="needs a process group"):
        shard_trunk(trunk)
    with pytest.raises(TypeError, match="takes a CheckpointedTrunk"):
        shard_trunk(nn.Linear(2, 2))


def _refusals(rank, world_size):
    trunk = CheckpointedTrunk(_model("resnet18"), num_splits=2)
    shard_trunk(trunk)
    with pytest.raises(ValueError, match="already sharded"):
        shard_trunk(trunk)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        shard_trunk(CheckpointedTrunk(_model("resnet18"), num_splits=2, use_reentrant=True))


def test_sharding_twice_or_with_reentrant_checkpointing_is_refused():
    run_processes(_refusals, WORLD)


@pytest.mark.xdist_group("fsdp_sharded")  # with the cases above: the fixture runs once
def test_a_rank_holds_the_shards_the_per_rank_model_predicts(sharded):
    # predicted from the unsharded model alone (no process group): FSDP2's dim-0 chunks, the first rank's the largest
    name, how, _ = CASES[list(CASES)[-1]]
    model = _model(name)
    units = [m for _, m in CheckpointedTrunk(model, **how).units]
    predicted = rank_memory(model, units, WORLD, "adamw", 0, "kept")
    first = torch.load(sharded / "held0.pt")
    assert first == {"parameters": predicted.parameters, "gradients": predicted.gradients, "optimizer": predicted.optimizer}
    assert torch.load(sharded / "held1.pt")["parameters"] <= first["parameters"]


def _measured_step_peak(rank, world_size, gradients, out):
    """This rank's step peak, by the allocator's events (the smallest of three readings, see
    tools/fsdp_memory.py), under the plan the sharded trunk makes for itself."""
    trunk = shard_trunk(CheckpointedTrunk(small("resnet18"), num_splits=3, strategy="balanced", gradients=gradients))
    torch.save(_planned_and_measured(trunk, gradients), os.path.join(out, f"peak{rank}_{gradients}.pt"))


def _planned_and_measured(trunk, gradients="allocated") -> dict:
    """The sharded trunk's own plan's predicted peak, and the smallest of three allocator readings of its step."""
    x = _micro_batch("resnet18", 0)
    plan = trunk.plan_for(x)
    step = lambda: loss_of(trunk(x)).backward()  # noqa: E731
    step()
    readings = []
    for _ in range(3):
        for p in trunk.parameters():
            if gradients == "allocated":
                p.grad = None
            else:
                p.grad.zero_()
        readings.append(profiled_peak(step))
    return {"predicted": plan.predicted_peak_bytes, "measured": min(readings)}


@pytest.mark.parametrize("gradients", ["kept", pytest.param("allocated", marks=pytest.mark.slow)])  # allocated: slow, for the fast suite's time (7 s)
def test_a_ranks_measured_step_peak_is_what_the_per_rank_model_predicts(tmp_path, gradients):
    # the prediction knows nothing of the ranks' run: only the units' profile (unsharded copies), the world size
    # and FSDP2's schedule (gathered weights, reduce-scatter buffers, gloo's copy of them); the measurement is the
    # allocator's, which sees what the tensor tracker cannot (FSDP2's refilled storage, kernels' scratch)
    run_processes(_measured_step_peak, WORLD, (gradients, str(tmp_path)), timeout=400)
    for rank in range(WORLD):
        peak = torch.load(tmp_path / f"peak{rank}_{gradients}.pt")
        assert abs(peak["predicted"] / peak["measured"] - 1) <= 0.05, (gradients, peak)


def _mixed_precision_steps(rank, world_size, out):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    trunk = CheckpointedTrunk(_model("vit"), num_splits=3, strategy="balanced")
    shard_trunk(trunk, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = _micro_batch("vit", rank)
    trunk.plan_for(x.to(torch.bfloat16))  # planning draws no random number: the step's draws are the reference's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(7 + rank)
        loss_of(trunk(x)).backward()
    grads = {n: p.grad.full_tensor() * world_size for n, p in trunk.named_parameters()}
    # autocast instead: the weights stay fp32 and a bf16 convolution's output meets a fp32 BatchNorm (its planning crashed)
    autocast = shard_trunk(CheckpointedTrunk(_model("resnet18"), num_splits=3, strategy="balanced"))
    x = _micro_batch("resnet18", rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast.plan_for(x)
        features = autocast(x)
    loss_of(features).backward()
    autocast_grads = {n: p.grad.full_tensor() * world_size for n, p in autocast.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "plan": trunk.plan, "autocast_grads": autocast_grads, "autocast_plan": autocast.plan}, os.path.join(out, "mixed.pt"))


def test_a_sharded_trunk_plans_in_the_dtype_it_runs_in_under_mixed_precision_or_autocast(tmp_path):
    """FSDP2 with param_dtype bf16 casts the trunk's input and gathers its weights in bf16: planning
    profiles its units in bf16 too (it used to run fp32 copies on the bf16 input and crash). Under bf16
    autocast the weights stay fp32: planning keeps them so (it cast them to the input's bf16, and a
    BatchNorm's fp32 statistics crashed the launcher's FSDP2 bf16 runs). Each step's gradients are those
    of the model run so in one process."""
    run_processes(_mixed_precision_steps, WORLD, (str(tmp_path),))
    saved = torch.load(tmp_path / "mixed.pt", weights_only=False)
    for plan in (saved["plan"], saved["autocast_plan"]):
        assert plan.strategy == "balanced" and plan.predicted_peak_bytes
    reference = CheckpointedTrunk(_model("vit")).to(torch.bfloat16)  # one process, unsharded, unsplit, in bf16
    autocast_reference = CheckpointedTrunk(_model("resnet18"))  # under autocast, in fp32
    for rank in range(WORLD):
        torch.manual_seed(7 + rank)
        with threads_of_workers(WORLD):
            loss_of(reference(_micro_batch("vit", rank).to(torch.bfloat16))).backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = autocast_reference(_micro_batch("resnet18", rank))
            loss_of(out).backward()
    for model, grads in ((reference, saved["grads"]), (autocast_reference, saved["autocast_grads"])):
        for n, p in model.named_parameters():
            ref, got = p.grad.float(), grads[n].float()
            assert torch.linalg.vector_norm(got - ref) <= 0.05 * torch.linalg.vector_norm(ref) + 1e-6, n


def _conv_blocks():
    from collections import OrderedDict

    torch.manual_seed(0)  # no conv bias: before BatchNorm its gradient is zero but for rounding
    return OrderedDict(conv1=nn.Conv2d(3, 8, 3, padding=1, bias=False), bn1=nn.BatchNorm2d(8), relu1=nn.ReLU(),
                       conv2=nn.Conv2d(8, 8, 3, padding=1, bias=False), bn2=nn.BatchNorm2d(8))


def _compiled_and_sharded(rank, world_size, out, backend):
    """trunk.compile() and shard_trunk, in either order, train as the eager sharded trunk."""
    x = _micro_batch("traced", rank)[:, :, :8, :8]
    grads = {}
    for order in ("eager", "compile_first", "shard_first"):
        trunk = CheckpointedTrunk(_conv_blocks(), num_splits=2, strategy="balanced")
        if order == "compile_first":
            trunk.compile(backend=backend)
        shard_trunk(trunk)
        if order == "shard_first":
            trunk.compile(backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_of(trunk(x)).backward()
        grads[order] = {n: p.grad.full_tensor() for n, p in trunk.named_parameters()}
        grads[order + " layout"] = all(p.to_local().is_contiguous() for p in trunk.parameters())
    if rank == 0:
        torch.save(grads, os.path.join(out, "compiled.pt"))


# inductor: its code generation (about 15 s with a cold cache) and the contiguous weights FSDP2 shards
# (inductor alone would store them channels-last); aot_eager in the fast suite
@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.slow), "aot_eager"])
def test_a_compiled_trunk_shards_and_a_sharded_trunk_compiles_and_both_train_as_the_eager_one(tmp_path, backend):
    torch._dynamo.reset()
    run_processes(_compiled_and_sharded, WORLD, (str(tmp_path), backend), timeout=400)
    grads = torch.load(tmp_path / "compiled.pt")
    for order in ("compile_first", "shard_first"):
        assert grads[order + " layout"]  # FSDP2 shards contiguous weights: no channels-last copy on a sharded trunk
        for n, ref in grads["eager"].items():
            assert torch.linalg.vector_norm(grads[order][n] - ref) <= 1e-4 * torch.linalg.vector_norm(ref) + 1e-7, (order, n)


def _hsdp_step_peak(rank, world_size, out):
    """HSDP: a 2 x 2 mesh, each trunk replicated over the first dimension and sharded over the second."""
    from torch.distributed.device_mesh import init_device_mesh

    from trunksplit.planning.sharding import sharded_world_size

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    trunk = shard_trunk(CheckpointedTrunk(small("resnet18"), num_splits=3, strategy="balanced"), mesh=mesh)
    peaks = _planned_and_measured(trunk)
    torch.save({"shards": sharded_world_size([m for _, m in trunk.units]), **peaks}, os.path.join(out, f"hsdp{rank}.pt"))


@pytest.mark.slow  # four processes; the one-dimensional per-rank prediction stays in the fast suite (test_a_ranks_measured_step_peak_is_what_the_per_rank_model_predicts)
def test_under_hsdp_a_rank_plans_for_the_ranks_it_shards_over_not_the_whole_mesh(tmp_path):
    """A 2-D mesh (2 replicas x 2 shards) shards each parameter over 2 ranks, not 4: planned for 4, a
    rank would expect half the weights it gathers and holds, and its plan would be too low."""
    run_processes(_hsdp_step_peak, 4, (str(tmp_path),), timeout=400)
    for rank in range(4):
        peak = torch.load(tmp_path / f"hsdp{rank}.pt")
        assert abs(peak["predicted"] / peak["measured"] - 1) <= 0.05, peak
        assert peak["shards"] == 2
