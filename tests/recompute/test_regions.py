"""Regions: nested checkpoints under "save_expensive" or "recompute", below the block level."""
import copy
import json
import pathlib
from collections import OrderedDict
import functools
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # see every op run, to count FLOPs
from torch.utils.flop_counter import flop_registry

from trunksplit import CheckpointedTrunk
from trunksplit.chains.blocks import layer_splittable_before
from trunksplit.planning.memory import PeakMemory
from trunksplit.planning.peak import PeakModel
from trunksplit.planning.plan import SplitPlan
from trunksplit.planning.profile import profile_units
from trunksplit.planning.search import best_plan, peak_model, plan_from_cuts, plan_trunk
from trunksplit.recompute.checkpoint import is_expensive, is_heavy, is_recomputing, run_checkpointed
from trunksplit.recompute.regions import run_region

from plans import _with_plan
from reference import build, gradient_penalty, grads_by_name, loss_of, plain_features
from zoo import input_for, small, without_head

SE, SH, RC, RS = "save_expensive", "save_heavy", "recompute", "recompute_stages"
X = functools.partial(torch.randn, 2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _measured_peak(trunk, x):
    """The second step's peak beyond parameters and kept gradients."""
    loss_of(trunk(x)).backward()
    for p in trunk.parameters():
        p.grad.zero_()
    with PeakMemory() as mem:
        loss_of(trunk(x)).backward()
    return mem.peak_bytes


# resnet18 units: conv1 bn1 conv1_relu maxpool res2.0 res2.1 res3.0 res3.1 res4.0 res4.1 res5.0 res5.1 avgpool flatten
# layout: (features, segment starts, regions, the regions the plan runs where they differ: in a
# checkpointed segment a selective region runs as "recompute")
F1, F2 = ["flatten"], ["res3", "flatten"]  # with res3 requested, a segment ends after res3.1 (unit 8)
LAYOUTS = {
    "save_expensive in the last segment": (F1, [0], [(4, 6, SE), (6, 8, SE), (9, 10, SE)], None),
    "recompute in the last segment": (F1, [0], [(4, 5, RC), (6, 8, RC), (9, 12, RC)], None),
    "nested in checkpointed segments": (F2, [0, 4, 8], [(0, 1, SE), (4, 6, SE), (6, 7, RC), (8, 10, SE), (10, 12, RC)],
                                        [(0, 1, RC), (4, 6, RC), (6, 7, RC), (8, 10, SE), (10, 12, RC)]),
    "every unit its own region": (F2, [0, 6, 8], [(i, i + 1, SE if i % 2 else RC) for i in (0, 3, 4, 5, 6, 7, 8, 9, 10, 11)],
                                  [(i, i + 1, SE if i % 2 and i >= 8 else RC) for i in (0, 3, 4, 5, 6, 7, 8, 9, 10, 11)]),
    # regions across the stem's ReLU(inplace=True), in a checkpointed segment and in the last one
    "the stem as one region": (F2, [0, 4, 8], [(0, 4, RC), (4, 6, RC), (8, 12, SE)], None),
    "the stem's spans as regions": (F2, [0, 6, 8], [(0, 1, RC), (1, 3, RC), (3, 4, RC), (8, 9, SE)], None),
    "the stem in the last segment": (F1, [0], [(0, 4, RC), (4, 8, SE)], None),
    "the stem's spans in the last segment": (F1, [0], [(0, 1, SE), (1, 3, RC), (3, 4, SH)], None),
    "save_heavy in the last segment": (F1, [0], [(0, 4, SH), (4, 6, SH), (6, 7, SH), (9, 12, SH)], None),
    "recompute_stages in the last segment": (F2, [0, 8], [(8, 9, RS), (9, 10, RS), (11, 12, RS)], None),
    "recompute_stages nested in checkpointed segments": (F2, [0, 4, 8], [(4, 5, RS), (5, 6, RS), (6, 7, RS), (8, 9, RS)], None),
    "every policy in one segment": (F1, [0, 4], [(4, 5, RS), (5, 6, SE), (6, 7, RS), (8, 10, SH), (10, 11, RC)], None),
}


# gradients kept: annotated by another peak model, run eagerly as allocated is (apart only under torch.compile,
# tests/test_compile.py): fast for the layouts of every policy in one segment, the stem's and nesting, the rest slow
KEPT_FAST = {"every policy in one segment", "the stem in the last segment", "the stem's spans in the last segment", "nested in checkpointed segments"}


def _region_cases():
    for layout in LAYOUTS:
        for gradients in ("allocated", "kept"):
            slow = gradients == "kept" and layout not in KEPT_FAST
            yield pytest.param(layout, gradients, id=f"{layout}-{gradients}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("layout, gradients", list(_region_cases()))
def test_a_plan_with_regions_trains_exactly_like_the_plain_model(layout, gradients):
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    features, starts, regions, runs = LAYOUTS[layout]
    trunk = CheckpointedTrunk(model, features, memory_budget=0.9, gradients=gradients)
    x = X()
    plan = _with_plan(trunk, x, starts, regions)
    assert [s.start for s in plan.segments] == starts and plan.regions == sorted(runs or regions)
    want = plain_features(plain, x, features)
    loss_of(want).backward()
    got = trunk(x)
    loss_of(got).backward()
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    want_grads = grads_by_name(plain)
    for name, g in grads_by_name(model).items():
        if name.startswith("fc."):
            continue
        assert torch.equal(want_grads[name], g), name
    # BatchNorm statistics moved once, as in the plain step, though regions run their norms two to four times
    for (name, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name



@pytest.mark.parametrize("policy", [SE, SH])
def test_selective_regions_train_exactly_when_the_trunk_runs_twice_under_one_autocast(policy):
    """Two crop sizes in one autocast (DINO's whole step; a step stepped in backward is one): the second
    call's selective region found its weights cast by the first (autocast's cache), and torch's selective
    checkpoint, which replays only the ops its forward ran, failed in backward ("aten._to_copy encountered
    during backward but not found in storage", pytorch/pytorch#193338). Now the plain model's bf16 step,
    bit for bit, and its BatchNorm statistics."""
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["flatten"], memory_budget=0.9, gradients="kept")
    crops = [X(), torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x in crops:  # a cut after the stem; res2 and res3.0 as regions of the last segment
            _with_plan(trunk, x, [0, 4], [(4, 6, policy), (6, 7, policy)])
        want = [plain_features(plain, x, ["flatten"])[0] for x in crops]
        got = [trunk(x)[0] for x in crops]
    loss_of([w.float() for w in want]).backward()  # after the autocast, as torch's recipe has it: its casts' cache emptied
    loss_of([g.float() for g in got]).backward()
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    want_grads = grads_by_name(plain)
    for name, g in grads_by_name(model).items():
        assert name.startswith("fc.") or torch.equal(want_grads[name], g), name
    for (name, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name


def test_a_plan_saved_before_the_policies_were_types_still_runs_exactly():
    """tests/data/plan_before_policy_types.json was written by SplitPlan.state() before the policy registry
    (trunksplit/recompute/policies.py): every policy by name, nested in a checkpointed segment and not.
    Loaded as a checkpoint of an earlier run would be, it trains as the plain model, and its table names them all."""
    state = json.loads((pathlib.Path(__file__).parents[1] / "data" / "plan_before_policy_types.json").read_text())
    plan = SplitPlan.from_state(state)
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["flatten"], memory_budget=0.8, gradients="kept")
    x = X()
    trunk.store_plan(trunk.key_for(x), plan)
    want, got = plain_features(plain, x, ["flatten"]), trunk(x)
    loss_of(want).backward()
    loss_of(got).backward()
    assert trunk.plan is plan and torch.equal(want[0], got[0])
    want_grads = grads_by_name(plain)
    assert all(torch.equal(want_grads[name], g) for name, g in grads_by_name(model).items() if not name.startswith("fc."))
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), model.buffers()))
    table = str(plan)
    assert all(f"{name} regions (" in table for name in ("save_expensive", "save_heavy", "recompute", "recompute_stages")), table

class _ForwardFlops(TorchDispatchMode):
    """FLOPs of the forward convolutions and matmuls run (in backward: run again), by torch's own formulas."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.addmm.default):
            self.flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_says_how_many_flops_backward_runs_again(layout):
    """Counted as the step runs: torch reruns a nested region as the segment's first forward
    ran it, and stops a recompute once it has what backward needs (a region ending a segment
    is not run by the segment's recompute; a lone convolution keeps only its input)."""
    features, starts, regions, _ = LAYOUTS[layout]
    trunk = CheckpointedTrunk(build("resnet18"), features, memory_budget=0.9, gradients="kept")
    x = X()
    plan = _with_plan(trunk, x, starts, regions)
    out = trunk(x)
    with _ForwardFlops() as counted:
        loss_of(out).backward()
    assert counted.flops == sum(s.recompute_flops for s in plan.segments)


@pytest.mark.parametrize("name", ["vit", "convnext", "efficientnet_b0", "swin"])
def test_regions_replay_dropout_and_stochastic_depth(name):
    """Nested regions restore the RNG as checkpoints do: the same masks as the plain model."""
    plain = small(name)
    reference = without_head(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["flatten"], memory_budget=0.9)
    x = input_for(name)
    costs = peak_model(trunk.plan_request(), x, regions=True)
    spans = costs.spans
    # EfficientNet's squeeze-excitation changes a conv output in place: such spans cannot run under
    # SE; a span with no convolution or matmul has no stages
    can = {p: costs.costs.under(p).eligible for p in (SE, SH, RS)}
    cut = spans[len(spans) // 2][0]  # a checkpointed segment [0, cut) and the last one, both with regions
    first_staged = next(r for r, s in spans if can[RS][r] and s != cut)
    rotation = [SE, SH, RC, RS]
    policy = lambda k, r: RS if r == first_staged else rotation[k % 4] if rotation[k % 4] == RC or can[rotation[k % 4]][r] else RC  # noqa: E731
    regions = [(r, s, policy(k, r)) for k, (r, s) in enumerate(spans) if s != cut]
    _with_plan(trunk, x, [0, cut], regions)
    torch.manual_seed(7)
    want = reference(x)
    loss_of([want]).backward()
    torch.manual_seed(7)
    got = trunk(x)[0]
    loss_of([got]).backward()
    assert len(trunk.plan.segments) == 2 and all(s.regions for s in trunk.plan.segments)
    assert torch.equal(want, got)
    ref_params = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        if n in ref_params:
            assert p.grad is not None and torch.equal(ref_params[n].grad, p.grad), n
    for (n, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.equal(a, b), n


def test_a_budget_below_the_block_level_floor_is_met_with_regions():
    """The smallest peak cuts alone reach is beaten, as measured, and the model predicts it."""
    model = build("resnet50")
    x = torch.randn(2, 3, 96, 96)  # at 64 pixels the fixed part of the floor leaves regions little to win
    kw = dict(gradients="kept")
    blocks_only = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], **kw)
    costs = peak_model(blocks_only.plan_request(), x)  # no regions
    units = blocks_only.units
    splittable = [layer_splittable_before(m) for _, m in units]
    floor = costs.peak(best_plan(costs, splittable, []).starts)
    budget = int(0.9 * floor)
    trunk = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=budget, **kw)
    plan = trunk.plan_for(x)
    assert plan.regions and plan.predicted_peak_bytes <= budget
    measured = _measured_peak(trunk, x)
    assert measured <= budget * 1.01
    assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes
    # reentrant checkpointing has no selective form: the same budget is refused, and the message says why
    with pytest.raises(ValueError, match="smallest feasible budget.*use_reentrant=False"):
        CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=budget, use_reentrant=True, **kw).plan_for(x)


def test_regions_meet_a_budget_with_fewer_convolution_flops_run_again():
    model = build("resnet50")
    x = X()
    budgets = [0.7, 0.5]
    recompute = {}
    for regions in (False, True):
        profiled = None  # one measurement serves both budgets
        for b in budgets:
            trunk = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=b, gradients="kept", use_reentrant=not regions)
            profiled = profiled or peak_model(trunk.plan_request(), x, regions=regions)
            plan = plan_trunk(trunk.plan_request(), x, profiled)
            trunk.store_plan(trunk.key_for(x), plan)
            recompute[regions, b] = sum(s.recompute_flops for s in plan.segments)
            if regions:
                assert _measured_peak(trunk, x) <= 1.02 * plan.predicted_peak_bytes
    for b in budgets:
        assert recompute[True, b] < recompute[False, b], b


def test_a_save_expensive_region_nested_in_a_checkpointed_segment_costs_no_memory():
    """torch keeps a selective checkpoint's saved outputs outside the graph, where the outer
    checkpoint cannot drop them: run as such in the segment's first forward, they would be held
    from the forward to the backward. The measured peak must not grow by nesting them."""
    x = X()
    peaks = {}
    for regions in ([], [(4, 6, SE), (6, 8, SE)]):
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.9, gradients="kept")
        plan = _with_plan(trunk, x, [0, 8], regions)
        peaks[bool(regions)] = _measured_peak(trunk, x)
        assert peaks[bool(regions)] <= 1.02 * plan.predicted_peak_bytes
    assert peaks[True] <= peaks[False]


def test_regions_across_an_in_place_relu_are_measured_whole_and_predicted():
    """The stem's units cannot each be a region (the ReLU would overwrite bn1's output, which
    a region ending at bn1 returns), but runs ending before a splittable unit can: the
    profiler measures such spans whole, and the model predicts the peak they give."""
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.9, gradients="kept")
    x = X()
    model = peak_model(trunk.plan_request(), x, regions=True)
    names = [n for n, _ in trunk.units]
    assert [names[r:s] for r, s in model.spans[:5]] == [["conv1"], ["bn1", "conv1_relu"], ["maxpool"], ["res2.0"], ["res2.1"]]
    assert all(model.costs.under(p).eligible[:4] == (True,) * 4 for p in (SE, RC))
    peaks = {}
    for stem in ([], [(1, 3, RC)], [(0, 4, RC)], [(0, 4, SE)]):
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.9, gradients="kept")
        plan = _with_plan(trunk, x, [0], stem + [(6, 8, SE)])
        peaks[str(stem)] = measured = _measured_peak(trunk, x)
        assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, stem
    # bn1 + ReLU as a region keeps conv1's output, and maxpool keeps the ReLU's: that frees
    # nothing but bn1's batch mean and inverse std (64 floats each)
    assert peaks["[]"] - peaks["[(1, 3, 'recompute')]"] == 2 * 64 * 4
    assert peaks["[(0, 4, 'recompute')]"] <= peaks["[(0, 4, 'save_expensive')]"] < peaks["[]"]


def test_save_heavy_keeps_the_heavy_convolutions_and_reruns_the_light_one():
    """A torchvision bottleneck (256 -> 64 -> 64 -> 256 channels): its 1x1 reduce (256
    multiply-adds per output) and 3x3 (576) convolutions are heavy, the expanding 1x1 (64)
    is light. Hand-computed bytes and FLOPs at input 2x256x16x16, float32."""
    block = build("resnet50").layer1[1]
    x = torch.randn(2, 256, 16, 16)
    costs = profile_units([("block", block)], x, spans=[(0, 1)])
    narrow, wide = 2 * 64 * 16 * 16 * 4, 2 * 256 * 16 * 16 * 4  # bytes of a 64- and a 256-channel activation
    assert costs.under(SE).saved[0] == 2 * narrow + wide  # the three convolutions' outputs
    assert costs.under(SH).saved[0] == 2 * narrow  # all but the expanding 1x1's
    assert costs.under(RC).saved[0] == 0  # the input only, which is not counted as saved
    assert costs.light_flops[0] == 2 * (64 * 256) * (2 * 16 * 16)  # the expanding 1x1: 2 FLOPs per multiply-add
    conv = torch.ops.aten.convolution.default
    assert is_expensive(conv) and not is_expensive(torch.ops.aten.relu.default)
    assert is_heavy(conv, (x, block.conv1.weight)) and is_heavy(conv, (x, block.conv2.weight))
    assert not is_heavy(conv, (x, block.conv3.weight))
    assert not is_heavy(torch.ops.aten.mm.default, (torch.randn(4, 255), torch.randn(255, 8)))
    assert is_heavy(torch.ops.aten.mm.default, (torch.randn(4, 256), torch.randn(256, 8)))


def test_save_heavy_meets_a_budget_with_fewer_convolution_flops_than_save_expensive_alone():
    """Under a budget that save_expensive regions alone cannot meet, the planner reruns the
    light convolutions before it reruns whole blocks; the measured peak fits."""
    model = build("resnet50")
    x = torch.randn(2, 3, 96, 96)
    plans = {}
    profiled = peak_model(CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=0.5, gradients="kept").plan_request(), x, regions=True)
    for allowed in ((SE, RC), (SE, SH, RC)):
        trunk = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=0.5, gradients="kept")
        model_ = _only(profiled, allowed)
        plans[allowed] = plan = plan_trunk(trunk.plan_request(), x, model_)
        trunk.store_plan(trunk.key_for(x), plan)
        assert _measured_peak(trunk, x) <= 1.02 * plan.predicted_peak_bytes <= 1.02 * 0.5 * model_.peak([0])
    flops = {k: sum(s.recompute_flops for s in p.segments) for k, p in plans.items()}
    assert any(p == SH for _, _, p in plans[(SE, SH, RC)].regions)
    assert flops[(SE, SH, RC)] < 0.6 * flops[(SE, RC)]


def _only(model: PeakModel, policies) -> PeakModel:
    """The same measurements with every other region policy made unavailable."""
    costs = model.costs
    never = {p: replace(costs.under(p), eligible=(False,) * len(costs)) for p in costs.policies if p not in policies}
    return PeakModel(costs=replace(costs, policies={**costs.policies, **never}), feature_units=model.features, gradients=model.gradients, spans=model.spans)


def test_recompute_stages_goes_below_the_floor_of_whole_block_recompute():
    """A recompute region's backward rebuilds a whole bottleneck; in stages it holds one stage
    at a time. That lowers the smallest feasible peak, as measured, and the model predicts it."""
    model = build("resnet50")
    x = torch.randn(2, 3, 160, 160)  # smaller, a floor is set by what every plan keeps, not by a block's backward
    floors = {}
    profiled = peak_model(CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=1.0, gradients="kept").plan_request(), x, regions=True)
    for allowed in ((SE, SH, RC), (SE, SH, RC, RS)):
        trunk = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], memory_budget=1.0, gradients="kept")
        costs = _only(profiled, allowed)
        units = trunk.units
        lowest = best_plan(costs, [layer_splittable_before(m) for _, m in units], [])
        names = [n for n, _ in units]
        plan = plan_from_cuts(names, lowest, trunk.plan_request().stops, "budget", costs)
        trunk.store_plan(trunk.key_for(x), plan)
        floors[allowed] = measured = _measured_peak(trunk, x)
        assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes, allowed
        assert (RS in allowed) == any(p == RS for _, _, p in plan.regions)
    assert floors[(SE, SH, RC, RS)] < 0.9 * floors[(SE, SH, RC)]


def test_the_plan_table_names_every_region():
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.9)
    plan = _with_plan(trunk, X(), [0, 6], [(4, 6, RC), (8, 9, SE), (9, 10, RS)])
    text = str(plan)
    assert "regions" in text and "1 save_expensive" in text and "1 recompute" in text and "1 recompute_stages" in text
    assert "save_expensive regions (keep conv/matmul outputs, recompute the rest): res4.0" in text
    assert "recompute regions (keep only the input): res2.0..res2.1" in text
    assert "recompute_stages regions (keep only the input, rebuild one conv/matmul stage at a time): res4.1" in text


def test_run_region_is_exact_alone_and_nested():
    torch.manual_seed(0)
    block = build("resnet18").layer1
    x = torch.randn(2, 64, 16, 16)
    ref = copy.deepcopy(block)
    want = ref(x)
    loss_of([want]).backward()
    for nested in (False, True):
        for policy in (SE, SH, RC, RS):
            mine = copy.deepcopy(block).train()
            mine.load_state_dict(build("resnet18").layer1.state_dict())
            calls = []

            def region(x, *layers, policy=policy):
                calls.append(is_recomputing())
                return run_region(list(layers), x, policy)

            if nested:
                got = run_checkpointed(region, mine, (x, *mine))
            else:
                got = region(x, *mine)
            loss_of([got]).backward()
            assert torch.equal(want, got)
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(mine.parameters(), ref.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(mine.buffers(), ref.buffers())), (nested, policy)


def test_run_region_refuses_what_it_cannot_do():
    block = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="unknown region policy 'all'"):
        run_region([block], torch.randn(2, 3), "all")
    with pytest.raises(ValueError, match="only a 'recompute' region runs its layers with a function of its own, not 'save_expensive'"):
        run_region([block], torch.randn(2, 3), "save_expensive", run=lambda x, *layers: x)  # selective: it must see every op
    with pytest.raises(ValueError, match="needs non-reentrant checkpointing.*use_reentrant=False"):
        run_checkpointed(block, [], (torch.randn(2, 3),), use_reentrant=True, keep=is_expensive)


def test_regions_over_weight_heavy_units_are_predicted_from_the_second_step_on():
    """Where weights outweigh activations (a small batch through wide linear layers), what a
    region's backward allocates depends on whether the weights already hold gradients: they
    do from the second step on (kept mode), and the profiler measures so for every policy."""
    torch.manual_seed(0)
    blocks = OrderedDict((f"b{i}", torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))) for i in range(4))
    x = torch.randn(4, 256)
    for regions in ([(1, 2, RS), (2, 3, RS)], [(1, 2, RC), (2, 3, SE)], [(1, 3, SH)]):
        trunk = CheckpointedTrunk(copy.deepcopy(blocks), ["b3"], memory_budget=0.9, gradients="kept")
        plan = _with_plan(trunk, x, [0], regions)
        measured = _measured_peak(trunk, x)
        assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * measured, regions


def _backward_twice(features_of, x):
    """Two losses of one forward, each backwarded alone (``retain_graph=True``)."""
    loss = loss_of(features_of(x))
    loss.backward(retain_graph=True)
    (2 * loss).backward()


AGAIN = {"whole segments": (F2, [0, 4, 8], []), "recompute_stages regions": LAYOUTS["recompute_stages nested in checkpointed segments"][:3],
         "every policy": LAYOUTS["every policy in one segment"][:3], "save_expensive in the last segment": (F1, [0], [(4, 6, SE), (9, 10, SE)])}


@pytest.mark.parametrize("again", [gradient_penalty, _backward_twice], ids=["gradient penalty", "retain_graph"])
@pytest.mark.parametrize("layout", list(AGAIN))
def test_a_second_backward_of_one_forward_is_the_plain_models(layout, again):
    """A second backward through one forward reruns each checkpoint again, and a selective region,
    whose kept outputs went to the first backward (torch's selective checkpointing refuses a second:
    "Trying to backward an extra time"), whole: the plain model's gradients bit for bit, its BatchNorm
    statistics moved once. A selective region failed with an ``AttributeError`` naming nothing."""
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    features, starts, regions = AGAIN[layout]
    trunk = CheckpointedTrunk(model, features, memory_budget=0.9, gradients="kept")
    x = X().requires_grad_(True)
    _with_plan(trunk, x, starts, regions)  # planned for images that take a gradient, as the penalty's do
    again(lambda t: plain_features(plain, t, features), x.detach().requires_grad_(True))
    again(trunk, x)
    assert trunk.plan.regions == sorted(regions) and [s.start for s in trunk.plan.segments] == starts
    want_grads = grads_by_name(plain)
    for name, g in grads_by_name(model).items():
        assert name.startswith("fc.") or torch.equal(want_grads[name], g), name
    for (name, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name
