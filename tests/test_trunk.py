"""CheckpointedTrunk: one training step equals the plain model's, exactly."""
import copy
import warnings

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import CheckpointedTrunk, feature_blocks
from trunksplit.planning.plan import Segment, SplitPlan

from reference import build, check_step, close, gradient_penalty, loss_of, plain_features, step_both

# ResNeXt-50's chain is ResNet-50's (torchvision's Bottleneck, grouped): the slow suite runs it too
ARCHS = ["resnet18", "resnet50", pytest.param("resnext50_32x4d", marks=pytest.mark.slow), "regnet_x_400mf", "regnet_y_400mf"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("keys", [["res3", "res4"], ["res3", "flatten"]])
def test_training_step_equals_plain_model(arch, splits, reentrant, keys):
    plain, model, trunk, want, got, _ = step_both(arch, keys, splits, reentrant)
    check_step(plain, model, trunk, want, got, reentrant)
    assert len(trunk.plan.segments) == max(splits, len(keys))


@pytest.mark.parametrize("reentrant", [False, True])
def test_input_that_requires_grad_gets_the_plain_gradient(reentrant):
    plain, model, trunk, want, got, (xp, xt) = step_both("resnet18", ["flatten"], 4, reentrant, input_grad=True)
    check_step(plain, model, trunk, want, got, reentrant)
    assert xt.grad is not None and (torch.equal if not reentrant else close)(xp.grad, xt.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_frozen_stem_trains_the_rest_exactly(reentrant):
    """Fine-tuning with the first layers frozen: a segment where neither the input nor any parameter
    needs a gradient has nothing to recompute (torch's reentrant checkpoint would fail in backward:
    "none of output has requires_grad=True"); the rest gets the plain model's gradients."""
    plain = build("resnet18")
    for p in [*plain.conv1.parameters(), *plain.bn1.parameters(), *plain.layer1.parameters()]:
        p.requires_grad_(False)
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["flatten"], num_splits=6, use_reentrant=reentrant)
    assert trunk.plan.segments[0].stop <= 5 and not trunk.plan.segments[0].checkpointed  # the stem's own segment, run plainly
    x = torch.randn(2, 3, 64, 64)
    want = plain_features(plain, x, ["flatten"])
    loss_of(want).backward()
    got = trunk(x)
    loss_of(got).backward()
    assert torch.equal(want[0], got[0])
    same = torch.equal if not reentrant else close
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        if name.startswith("fc."):
            continue
        assert (a.grad is None) == (b.grad is None) == (not a.requires_grad), name
        assert a.grad is None or same(a.grad, b.grad), name


def test_batchnorm_counts_one_batch_per_step():
    plain, model, trunk, *_ = step_both("resnet18", ["flatten"], 8, False)
    counts = {int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert counts == {1}


def _count_calls(module):
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


class _StemBodyPool(nn.Module):
    """A model fx traces through its ``body`` container, calling body's layers one by one."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))

    def forward(self, x):
        return self.body(self.stem(x)).mean((2, 3))


def test_hooks_on_a_module_whose_blocks_the_trunk_runs_itself_are_said_not_to_fire():
    """A forward hook on a stage (a feature capture on ``layer2``) or on the model never fires in a trunk,
    which runs the stage's blocks one by one: the trunk says so when built, naming them (before: silence,
    and the capture stayed empty). Hooks on the blocks it runs fire, and warn of nothing."""
    model, fired = build("resnet18"), []
    model.layer2.register_forward_hook(lambda m, i, o: fired.append("layer2"))
    model.register_forward_pre_hook(lambda m, i: fired.append("model"))
    model.layer2[0].register_forward_hook(lambda m, i, o: fired.append("layer2.0"))
    with pytest.warns(UserWarning, match=r"hooks on the model itself \(ResNet\), layer2 will not fire: the trunk runs the blocks inside"):
        trunk = CheckpointedTrunk(model, ["flatten"], num_splits=2)
    with torch.no_grad():
        trunk(torch.randn(2, 3, 32, 32))
    assert fired == ["layer2.0"]
    traced = _StemBodyPool()
    traced.body.register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match=r"hooks on body will not fire"):
        CheckpointedTrunk(traced)
    quiet = build("resnet18")
    quiet.layer2[0].register_forward_hook(lambda m, i, o: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointedTrunk(quiet, ["flatten"], num_splits=2)
        CheckpointedTrunk(_StemBodyPool())


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_eval_and_no_grad_run_plain_without_recompute(mode):
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["res3", "flatten"], num_splits=4)
    first_conv = _count_calls(model.conv1)
    x = torch.randn(2, 3, 64, 64)
    if mode == "eval":
        plain.eval(), trunk.eval()
        got = trunk(x)
        loss_of(got).backward()  # backward in eval mode must not re-run anything either
    else:
        with torch.no_grad():
            got = trunk(x)
    with torch.no_grad():
        want = plain_features(plain, x, ["res3", "flatten"])
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert len(first_conv) == 1


def test_training_step_recomputes_checkpointed_segments_only():
    model = build("resnet18")
    trunk = CheckpointedTrunk(model, ["flatten"], num_splits=2)
    first, last = _count_calls(model.conv1), _count_calls(model.layer4[1])
    assert trunk.plan.segments[0].start == 0 and not trunk.plan.segments[-1].checkpointed
    loss_of(trunk(torch.randn(2, 3, 64, 64))).backward()
    assert len(first) == 2  # first segment: forward + recompute
    assert len(last) == 1  # last segment: never checkpointed


@pytest.mark.parametrize("arch", ["resnet50", "regnet_x_400mf"])
def test_trunk_owns_only_the_modules_it_runs(arch):
    model = build(arch)
    head = model.fc
    trunk = CheckpointedTrunk(model, ["res4"])
    owned = {id(p) for p in trunk.parameters()}
    last_stage = model.layer4 if arch.startswith("resnet") else model.trunk_output.block4
    assert not owned & {id(p) for p in head.parameters()}
    assert not owned & {id(p) for p in last_stage.parameters()}
    everything_else = {id(p) for p in model.parameters()} - {id(p) for p in head.parameters()} - {id(p) for p in last_stage.parameters()}
    assert owned == everything_else


def test_state_dict_keys_do_not_depend_on_the_plan():
    a = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=2)
    b = CheckpointedTrunk(build("resnet18", seed=5), ["flatten"], num_splits=7)
    assert list(a.state_dict()) == list(b.state_dict())
    assert "res2.0.conv1.weight" in a.state_dict()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 64, 64)
    a.eval(), b.eval()
    assert torch.equal(a(x)[0], b(x)[0])


def test_ordered_dict_of_blocks_is_a_trunk():
    model = build("resnet18")
    blocks = feature_blocks(model)
    trunk = CheckpointedTrunk(blocks, ["res5", "res3"], num_splits=3)
    x = torch.randn(2, 3, 64, 64)
    got = trunk(x)
    want = plain_features(model, x, ["res5", "res3"])
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_unreachable_split_count_warns_with_count_reached():
    with pytest.warns(UserWarning, match=r"asked for 500 checkpoint segments but only \d+ can be made") as caught:
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=500)
    # resnet18: 14 units, and no cut may fall before the stem's in-place ReLU
    assert len(trunk.plan.segments) == 13
    assert "only 13 can be made" in str(caught[0].message)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(out_feat_keys=["res6"]), ValueError, r"res6.*known keys"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(strategy="magic"), ValueError, "strategy"),
        (dict(memory_budget=1.5), ValueError, "memory_budget"),
    ],
)
def test_bad_arguments_are_refused_and_the_model_is_untouched(kwargs, error, match):
    model = build("resnet18")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        CheckpointedTrunk(model, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.fc, nn.Linear)


def test_an_unregistered_model_is_traced_and_its_last_block_is_its_output():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 3))
    trunk = CheckpointedTrunk(model)
    assert trunk.out_feat_keys == ("output",) and trunk.plan.units == ("0", "1", "output")
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(trunk(x)[0], model(x))


def _bf16_step(keys, reentrant):
    """One bf16-autocast step of resnet18, plain and through a 4-segment trunk, and the plain float32 step."""
    plain = build("resnet18")
    model, exact = copy.deepcopy(plain), copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, keys, num_splits=4, use_reentrant=reentrant)
    x = torch.randn(2, 3, 64, 64)
    loss_of(plain_features(exact, x, keys)).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain_features(plain, x, keys)
        got = trunk(x)
        assert got[-1].dtype == torch.bfloat16
        loss_of([w.float() for w in want]).backward()
        loss_of([g.float() for g in got]).backward()
    return plain, model, trunk, want, got, exact


@pytest.mark.parametrize("reentrant", [False, True])
def test_bf16_autocast_step_equals_the_plain_model_under_the_same_autocast(reentrant):
    plain, model, trunk, want, got, _ = _bf16_step(["flatten"], reentrant)
    check_step(plain, model, trunk, want, got, reentrant=False)  # bit for bit, reentrant or not


def test_reentrant_bf16_step_with_a_feature_at_a_cut_is_as_accurate_as_the_plain_bf16_step():
    """A cut at a requested feature (res3) gives its output three gradients: the loss's and the next
    block's two branches. The plain step adds them in one order; reentrant checkpointing adds the
    branches inside the next segment's backward, then the loss's. In bf16 (8 bits of mantissa) the
    two orders round apart by up to 2% of a gradient, where cancellation leaves it small: so, against
    the float32 step, the reentrant step must be as accurate as the plain one, and exact wherever a
    gradient does not pass through that sum."""
    plain, model, trunk, want, got, exact = _bf16_step(["res3", "flatten"], reentrant=True)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    after_the_cut = ("layer3.", "layer4.")
    for (name, p), q, r in zip(model.named_parameters(), plain.parameters(), exact.parameters()):
        if name.startswith(after_the_cut):
            assert torch.equal(p.grad, q.grad), name
        elif name.startswith(("conv1", "bn1", "layer1.", "layer2.")):
            scale = r.grad.abs().max()
            ours, theirs = (p.grad - r.grad).abs().max() / scale, (q.grad - r.grad).abs().max() / scale
            assert ours <= 1.25 * theirs, (name, float(ours), float(theirs))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", [dict(num_splits=4), dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.85, gradients="kept")])
def test_a_feature_followed_by_an_in_place_op_trains_exactly(reentrant, how):
    # The cut forced after bn1 starts a segment with ReLU(inplace=True): the segment must
    # not overwrite its checkpointed input, and the feature is bn1's output, unmodified.
    plain, model, trunk, want, got, _ = step_both("resnet18", ["bn1", "flatten"], how.pop("num_splits", None), reentrant, **how)
    assert "conv1_relu" in [trunk.plan.units[s.start] for s in trunk.plan.segments]
    assert got[0].min() < 0  # pre-ReLU values: not overwritten by the in-place ReLU
    check_step(plain, model, trunk, want, got, reentrant)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_planning_under_no_grad_measures_the_training_step(mode):
    x = torch.randn(2, 3, 64, 64)
    reference = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=4, strategy="balanced").plan_for(x)
    for how in [dict(num_splits=4, strategy="balanced"), dict(memory_budget=int(reference.predicted_peak_bytes))]:
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], **how)
        with mode():
            plan = trunk.plan_for(x)
        with_grad = CheckpointedTrunk(build("resnet18"), ["flatten"], **how).plan_for(x)
        assert plan.boundaries == with_grad.boundaries and plan.predicted_peak_bytes == with_grad.predicted_peak_bytes
        assert plan.regions == with_grad.regions
        assert len(plan.segments) > 1 or plan.regions  # a byte budget below the unsplit peak needs cuts or regions
        loss_of(trunk(x)).backward()  # the cached plan trains


@pytest.mark.fresh_profile  # no user hook fires: what ran, not a remembered figure
def test_planning_does_not_run_the_users_hooks():
    model = build("resnet18")
    calls = []
    model.layer1[0].register_forward_hook(lambda *a: calls.append("forward"))
    model.layer1[0].conv1.register_forward_pre_hook(lambda *a: calls.append("pre"))
    trunk = CheckpointedTrunk(model, ["flatten"], num_splits=3, strategy="balanced")
    trunk.plan_for(torch.randn(2, 3, 64, 64))
    assert calls == []
    loss_of(trunk(torch.randn(2, 3, 64, 64))).backward()
    assert calls.count("forward") >= 1  # the real forward still runs them


@pytest.mark.parametrize("reentrant", [False, True])
def test_instance_norm_running_stats_move_once_per_step(reentrant):
    def blocks(seed):
        torch.manual_seed(seed)
        layers = [nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True, track_running_stats=True), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                  nn.InstanceNorm2d(8, track_running_stats=True, momentum=0.3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)]
        return layers

    plain = nn.Sequential(*blocks(0))
    mine = nn.Sequential(*blocks(0))
    from collections import OrderedDict

    trunk = CheckpointedTrunk(OrderedDict((f"b{i}", m) for i, m in enumerate(mine)), ["b7"], num_splits=4, use_reentrant=reentrant)
    x = torch.randn(2, 3, 16, 16)
    for _ in range(2):
        plain(x).pow(2).sum().backward()
        trunk(x)[0].pow(2).sum().backward()
    for (name, a), b in zip(plain.named_buffers(), mine.buffers()):
        assert torch.equal(a, b), name
    assert not torch.equal(mine[4].running_mean, torch.zeros(8))  # the statistics did move


def test_model_state_dict_loads_strictly_into_a_fresh_torchvision_model():
    import torchvision

    trunk = CheckpointedTrunk(build("resnet18"), ["res4"], num_splits=3)
    loss_of(trunk(torch.randn(2, 3, 64, 64))).backward()
    with torch.no_grad():
        for p in trunk.parameters():
            p.add_(torch.randn_like(p))  # trained weights, unlike any fresh model's
    fresh = torchvision.models.resnet18()
    fc = fresh.fc.weight.clone()
    fresh.load_state_dict(trunk.model_state_dict(fresh))  # strict
    assert torch.equal(fresh.layer3[1].conv2.weight, trunk.res4[1].conv2.weight)
    assert torch.equal(fresh.bn1.running_mean, trunk.bn1.running_mean)
    assert torch.equal(fresh.fc.weight, fc) and torch.equal(fresh.layer4[0].conv1.weight, fresh.state_dict()["layer4.0.conv1.weight"])
    names = trunk.model_state_dict()
    assert "layer3.1.conv2.weight" in names and not any(k.startswith(("layer4", "fc")) for k in names)


def test_model_state_dict_refuses_a_different_architecture():
    import torchvision

    trunk = CheckpointedTrunk(build("resnet50"), ["flatten"])
    with pytest.raises(ValueError, match="not the trunk's architecture"):
        trunk.model_state_dict(torchvision.models.regnet_x_400mf())
    with pytest.raises(ValueError, match="built from feature blocks"):
        CheckpointedTrunk(feature_blocks(build("resnet18")), ["flatten"]).model_state_dict()


class _TwoInputs(nn.Module):
    """A model whose input is a list of tensors (traced: the list is the first unit's input)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, xs):
        return self.b(self.a(xs[0] + 2 * xs[1])).mean((2, 3))


@pytest.mark.parametrize("how", [dict(num_splits=2), dict(num_splits=2, strategy="balanced"), dict(memory_budget=0.9, gradients="kept")])
def test_a_list_input_is_planned_on_the_tensors_inside_it(how):
    torch.manual_seed(0)
    plain = _TwoInputs()
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, **how)
    xs = [torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)]
    plain(xs).pow(2).sum().backward()
    (got,) = trunk(xs)
    got.pow(2).sum().backward()
    assert torch.equal(got, plain(xs))
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    if trunk.cost_aware:
        assert trunk.plan.predicted_peak_bytes is not None
        first = trunk.plan
        assert trunk.plan_for([torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)]) is not first  # keyed by the shapes inside


def test_an_input_without_tensors_is_a_clear_error_for_a_cost_aware_plan():
    trunk = CheckpointedTrunk(_TwoInputs(), num_splits=2, strategy="balanced")
    with pytest.raises(TypeError, match="holds no tensor"):
        trunk.plan_for([1.0, 2.0])


def test_a_plain_models_checkpoint_loads_strictly_into_the_trunk_even_inside_a_wrapper():
    """Checkpointing turned on mid-project: what the plain model saved loads, strict, into a model that
    holds the trunk (the model's names are mapped as model_state_dict maps them out), also where the
    trunk stands in for lightly's ``nn.Sequential(*children)`` backbone."""
    torch.manual_seed(0)
    plain = torchvision.models.resnet18()
    saved = {k: v for k, v in plain.state_dict().items() if not k.startswith("fc.")}
    torch.manual_seed(1)
    trunk = CheckpointedTrunk(torchvision.models.resnet18())
    trunk.load_state_dict(saved)  # strict
    out = trunk.model_state_dict()
    assert set(out) == set(saved) and all(torch.equal(out[k], v) for k, v in saved.items())

    class Wrapper(nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.backbone, self.head = backbone, nn.Linear(512, 4)

    def children():
        return nn.Sequential(*list(torchvision.models.resnet18().children())[:-1])

    torch.manual_seed(2)
    before = Wrapper(children())
    torch.manual_seed(3)
    after = Wrapper(CheckpointedTrunk(children()))
    after.load_state_dict(before.state_dict())  # strict
    x = torch.randn(2, 3, 64, 64)
    before.eval(), after.eval()
    assert torch.equal(before.backbone(x).flatten(1), after.backbone(x)[0].flatten(1))
    with pytest.raises(RuntimeError, match="Unexpected key"):  # the classifier is not the trunk's: strict says so
        CheckpointedTrunk(torchvision.models.resnet18()).load_state_dict(plain.state_dict())


def test_a_vissl_checkpoints_trunk_weights_load_strictly_into_the_trunk():
    """vissl's ResNet trunk holds torchvision's modules under ``_feature_blocks.``: its checkpoint's
    ``["classy_state_dict"]["base_model"]["model"]["trunk"]`` loads as it is (users stripped the prefix and
    loaded a torchvision ResNet with ``fc = Identity()`` by hand), and the trunk then computes what that model does."""
    torch.manual_seed(0)
    vissl_trained = torchvision.models.resnet18()
    vissl_trained.fc = nn.Identity()
    checkpoint = {"classy_state_dict": {"base_model": {"model": {
        "trunk": {f"_feature_blocks.{k}": v.clone() for k, v in vissl_trained.state_dict().items()}, "heads": {}}}}}
    torch.manual_seed(1)
    trunk = CheckpointedTrunk(torchvision.models.resnet18(), ["res4", "flatten"], num_splits=3)
    trunk.load_state_dict(checkpoint["classy_state_dict"]["base_model"]["model"]["trunk"])  # strict
    x = torch.randn(2, 3, 64, 64)
    trunk.eval(), vissl_trained.eval()
    assert torch.equal(trunk(x)[1], vissl_trained(x))
    wrong = {f"_feature_blocks.{k}": v for k, v in torchvision.models.resnet34().state_dict().items() if not k.startswith("fc.")}
    with pytest.raises(RuntimeError, match="Unexpected key.*_feature_blocks.layer1.2.conv1.weight"):  # another depth: strict says which
        CheckpointedTrunk(torchvision.models.resnet18()).load_state_dict(wrong)


def test_an_unplanned_cost_aware_trunk_says_so_and_prints_its_plan_once_planned_up_front_or_by_a_forward():
    for how, kind in ((dict(num_splits=3, strategy="balanced"), "balanced"), (dict(memory_budget=0.9, gradients="kept"), "budget")):
        trunk = CheckpointedTrunk(build("resnet18"), **how)
        before = str(trunk.plan)
        assert before.startswith(f"SplitPlan ({kind}, 1 segment") and "not planned yet" in before, before
        loss_of(trunk(torch.randn(2, 3, 64, 64))).backward()
        after = str(trunk.plan)
        assert after.startswith(f"SplitPlan ({kind}, ") and "not planned yet" not in after and "predicted peak" in after
        up_front = CheckpointedTrunk(build("resnet18"), **how)
        planned = up_front.plan_for(torch.randn(2, 3, 64, 64))  # no forward: print(trunk.plan) shows what was planned
        assert up_front.plan is planned and str(planned) == after
        small = up_front.plan_for(torch.randn(1, 3, 64, 64))  # the last one made...
        assert up_front.plan is small and small.predicted_peak_bytes < planned.predicted_peak_bytes
        up_front.train()
        up_front(torch.randn(2, 3, 64, 64))  # ...or run
        assert up_front.plan is planned
    vissl = CheckpointedTrunk(build("resnet18"), num_splits=3)
    assert str(vissl.plan).startswith("SplitPlan (vissl, 3 segments") and "not planned yet" not in str(vissl.plan)


@pytest.mark.parametrize("given, match", [("resnet18", r"got str 'resnet18': build it first, e\.g\. torchvision\.models\.get_model\('resnet18'\)"),
                                          (None, r"takes a model \(an nn\.Module\), got NoneType None")])
def test_a_model_that_is_not_a_module_is_refused_saying_what_is_taken(given, match):
    with pytest.raises(TypeError, match=match):
        CheckpointedTrunk(given, ["flatten"], num_splits=2)


def test_a_cost_aware_trunk_on_meta_tensors_gives_the_plain_models_shapes_without_planning():
    """Shape inference (a FLOP count, deferred init) runs on meta tensors, which hold no memory to plan."""
    with torch.device("meta"):
        plain = build("resnet18")
    trunk = CheckpointedTrunk(copy.deepcopy(plain), ["res4", "flatten"], num_splits=3, strategy="balanced")
    x = torch.empty(2, 3, 64, 64, device="meta")
    got = trunk(x)
    sum(g.sum() for g in got).backward()
    want = plain_features(plain, x, ["res4", "flatten"])
    assert [g.shape for g in got] == [w.shape for w in want] and all(g.is_meta for g in got)
    assert trunk.plans == {} and all(p.grad is not None and p.grad.is_meta for p in trunk.parameters())


def test_a_gradient_penalty_through_stochastic_depth_is_the_plain_models():
    """A second backward reruns each checkpointed segment again (torch restores the random state for every rerun):
    ConvNeXt's stochastic depth drops the blocks the forward dropped each time, so a gradient penalty
    (R1's: the squared norm of the loss's gradient with respect to the images) gives the plain model's
    parameter gradients, bit for bit."""
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(stochastic_depth_prob=0.9)  # block k of 18 dropped with probability 0.9 k / 17
    plain = copy.deepcopy(model)
    trunk = CheckpointedTrunk(model, ["flatten"], num_splits=8, strategy="balanced")
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    trunk.plan_for(x.requires_grad_(True))  # planned (profiled) before the seed below
    body = nn.Sequential(plain.features, plain.avgpool, plain.classifier[0], nn.Flatten(1))  # flatten: the classifier's norm and flatten
    for features_of in (lambda t: trunk(t)[0], body):
        torch.manual_seed(3)
        gradient_penalty(lambda images: [features_of(images)], x.detach().requires_grad_(True))
    assert trunk.plan.strategy == "balanced" and sum(s.checkpointed for s in trunk.plan.segments) >= 6, trunk.plan
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


def test_a_stored_plan_runs_on_a_trunk_that_plans_by_input_and_one_running_vissls_fixed_plan_refuses_it():
    """``store_plan`` runs a plan made elsewhere in place of planning; a vissl trunk runs its fixed plan on
    every input and never looked at the stored one (it was kept silently): refused, saying how to build one that runs it."""
    x = torch.randn(2, 3, 64, 64)
    plan = CheckpointedTrunk(build("resnet18"), num_splits=3, strategy="balanced").plan_for(x)
    budgeted = CheckpointedTrunk(build("resnet18"), memory_budget=0.9)
    budgeted.store_plan(budgeted.key_for(x), plan)
    assert budgeted.plan_for(x) is plan and sum(s.checkpointed for s in plan.segments) == 2
    vissl = CheckpointedTrunk(build("resnet18"), num_splits=3)
    with pytest.raises(ValueError, match=r"runs vissl's fixed plan on every input, never a stored one: build it with strategy=\"balanced\" or a memory_budget"):
        vissl.store_plan(vissl.key_for(x), plan)
    assert vissl.plans == {} and vissl.plan_for(x).strategy == "vissl"


def _plan(trunk, *segments):
    return SplitPlan(units=tuple(n for n, _ in trunk.units), segments=segments, strategy="budget")


@pytest.mark.parametrize("segments, says", [
    ((Segment("a", 0, 5), Segment("b", 6, 14, checkpointed=False)), r"segment 'b' runs units \[6, 14\).*from where the one before it stopped \(5\)"),
    ((Segment("a", 0, 7), Segment("b", 5, 14, checkpointed=False)), r"segment 'b' runs units \[5, 14\).*stopped \(7\)"),
    ((Segment("a", 0, 5), Segment("b", 5, 10, checkpointed=False)), r"stop at unit 10 of 14: the last must run to the chain's end \(flatten\)"),
    ((), r"stop at unit 0 of 14"),
    ((Segment("a", 0, 5, regions=((3, 3, "recompute"),)), Segment("b", 5, 14, checkpointed=False)), r"region \(3, 3, 'recompute'\) must hold at least one unit"),
    ((Segment("a", 0, 5, regions=((4, 7, "recompute"),)), Segment("b", 5, 14, checkpointed=False)), r"inside its segment 'a' \(units \[0, 5\)\)"),
    ((Segment("a", 0, 5, regions=((1, 4, "recompute"), (3, 5, "recompute"))), Segment("b", 5, 14, checkpointed=False)),
     r"region \(3, 5, 'recompute'\).*after the region before it \(which stops at 4\)"),
    ((Segment("a", 0, 5, regions=((1, 3, "recompute"), (1, 4, "save_heavy"))), Segment("b", 5, 14, checkpointed=False)),
     r"region \(1, 4, 'save_heavy'\).*after the region before it \(which stops at 3\)"),
    ((Segment("a", 0, 5), Segment("b", 5, 14, checkpointed=False, regions=((6, 8, "bogus"),))), r"unknown region policy 'bogus'; choose one of"),
    ((Segment("a", 0, 5, regions=((2, 4, "save_expensive"),)), Segment("b", 5, 14, checkpointed=False)),
     r"starts at conv1_relu, whose first op is in place .* start it a unit earlier or later"),
    ((Segment("a", 0, 5), Segment("b", 5, 14, checkpointed=False, regions=((0, 2, "save_expensive"),))), r"inside its segment 'b'"),
    ((Segment("a", 0, 5, regions=((0, 2, "save_heavy"),)), Segment("b", 5, 14, checkpointed=False)), r"is followed by conv1_relu, whose first op is in place"),
])
def test_a_stored_plan_that_would_not_run_the_chain_as_the_plain_model_is_refused_saying_what_to_change(segments, says):
    """A plan made by hand or loaded runs as it is: one that skipped a unit ran the model without it (the step
    went on, wrong), an empty region never ended (memory grew until the process was killed), a region
    overlapping the next was dropped, one before an in-place op failed in backward naming an autograd
    variable. Each is refused when stored, and the trunk keeps planning for itself."""
    x = torch.randn(2, 3, 64, 64)
    trunk = CheckpointedTrunk(build("resnet18"), memory_budget=0.9)
    assert len(trunk.units) == 14
    with pytest.raises(ValueError, match=says):
        trunk.store_plan(trunk.key_for(x), _plan(trunk, *segments))
    assert trunk.plans == {}


def test_a_stored_plan_must_cut_after_every_requested_feature():
    x = torch.randn(2, 3, 64, 64)
    plain = build("resnet18")
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, out_feat_keys=["res4", "res5"], memory_budget=0.9)
    names = [n for n, _ in trunk.units]
    after_res4 = names.index("res4.1") + 1
    with pytest.raises(ValueError, match=r"no segment starts after the requested feature res4.1 \(unit 9\)"):
        trunk.store_plan(trunk.key_for(x), _plan(trunk, Segment("a", 0, 6), Segment("b", 6, len(names), checkpointed=False)))
    assert trunk.plans == {}
    plan = _plan(trunk, Segment("a", 0, after_res4), Segment("b", after_res4, len(names), checkpointed=False))
    trunk.store_plan(trunk.key_for(x), plan)  # with the cut after res4 it runs: the plain model's features
    want = plain_features(plain, x, ["res4", "res5"])
    got = trunk(x)
    assert trunk.plan is plan and all(torch.equal(w, g) for w, g in zip(want, got))
