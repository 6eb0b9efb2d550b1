"""Automatic chains: any traceable model, cut where one tensor carries the state, trains exactly like itself."""
import copy
import io
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from trunksplit import CheckpointedTrunk, PeakMemory, feature_blocks
from trunksplit.planning.plan import SplitPlan

from reference import held_feature_peaks, loss_of
from zoo import ResidualNet, TinyViT


class Stages(nn.Module):
    """timm's layout: stages.i = downsample + blocks, a buffer read in forward, several outputs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1))
        chans = [3, 8, 16, 16]
        self.stages = nn.ModuleList(
            nn.ModuleDict(dict(down=nn.Conv2d(a, b, 3, stride=2, padding=1), blocks=nn.Sequential(*[nn.Sequential(nn.BatchNorm2d(b), nn.GELU(), nn.Conv2d(b, b, 1)) for _ in range(2)])))
            for a, b in zip(chans, chans[1:])
        )

    def forward(self, x):
        x = x - self.mean
        for stage in self.stages:
            x = stage["down"](x)
            for block in stage["blocks"]:
                x = x + block(x)
        return {"pooled": x.mean((2, 3)), "map": x}


class BatchNormAct(nn.BatchNorm2d):
    """timm's layout: a BatchNorm subclass that calls F.batch_norm itself, then Identity, then an in-place act."""

    def __init__(self, channels):
        super().__init__(channels, momentum=0.3)
        self.drop = nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps)
        return self.act(self.drop(x))


class NormActNet(nn.Module):
    """Conv, BatchNormAct, Identity between blocks, and a forward with optional arguments."""

    def __init__(self):
        super().__init__()
        # conv, Identity, in-place ReLU: a cut before the Identity would hand the ReLU the checkpoint's input
        self.layers = nn.Sequential(*[m for i in range(4) for m in (nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.Identity(), nn.ReLU(inplace=True), BatchNormAct(8))])
        self.pre = nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x, mask=None, scale: float = 1.0):
        if mask is not None:
            x = x * mask
        return self.act(self.pre(self.layers(x))).mean((2, 3)) * scale


class FunctionalInPlace(nn.Module):
    """In-place ops called as functions (torch.sigmoid_, F.relu_), each right after a conv."""

    def __init__(self, width=8, depth=6):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else width, width, 3, padding=1) for i in range(depth))

    def forward(self, x):
        for i, conv in enumerate(self.convs):
            x = torch.sigmoid_(conv(x)) if i % 2 else F.relu_(conv(x))
        return x.mean((2, 3))


class SharedWeights(nn.Module):
    """One block called twice (its gradients sum over both uses), beside modules whose names look like fx's."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.shared_0 = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = self.shared_0(x)
        x = self.shared(x)
        x = self.shared(x)
        return self.head(x).mean((2, 3))


class RunningMean(nn.Module):
    """Keeps an EMA of its output's channel means in a buffer (timm's EvoNorm keeps running_var so);
    with ``reads`` its output also uses the buffer, read before it is updated."""

    def __init__(self, width, reads):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.register_buffer("ema", torch.zeros(width))
        self.reads = reads

    def forward(self, x):
        y = self.conv(x)
        out = y + self.ema.view(1, -1, 1, 1) if self.reads else y
        self.ema.mul_(0.9).add_(0.1 * y.detach().mean((0, 2, 3)))
        return torch.relu(out)


class BufferWriter(nn.Module):
    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(RunningMean(width, reads=i % 2 == 1) for i in range(depth))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.mean((2, 3))


class CrossStage(nn.Module):
    """timm's CSP layout: ``x.split`` into halves, one through a block, concatenated: the only cut
    inside a stage carries the tuple of halves."""

    def __init__(self, width=8, depth=3):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width // 2, width // 2, 3, padding=1), nn.BatchNorm2d(width // 2), nn.ReLU()) for _ in range(depth))
        self.mix = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(depth))

    def forward(self, x):
        x = self.stem(x)
        for block, mix in zip(self.blocks, self.mix):
            a, b = x.split(x.shape[1] // 2, dim=1)
            x = mix(torch.cat([block(a), b], dim=1))
        return x.mean((2, 3))


MODELS = {"norm_act": NormActNet, "residual": ResidualNet, "stages": Stages, "tiny_vit": TinyViT, "torchvision_resnet18": lambda: _untraced_resnet18(),
          "functional_in_place": FunctionalInPlace, "shared_weights": SharedWeights, "buffer_writer": BufferWriter, "cross_stage": CrossStage}


def _untraced_resnet18():
    """torchvision's ResNet-18, but as a class trunksplit has no registration for."""
    return type("MyResNet", (nn.Module,), {"__init__": lambda self: (nn.Module.__init__(self), setattr(self, "net", torchvision.models.resnet18(num_classes=7)))[0],
                                           "forward": lambda self, x: self.net(x)})()


def _build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def _loss(out):
    return loss_of(list(out.values()) if isinstance(out, dict) else [out])


HOWS = {"vissl3": dict(num_splits=3), "balanced4": dict(num_splits=4, strategy="balanced"), "budget": dict(memory_budget=0.95, gradients="kept")}
# reentrant: on vissl's cuts, which always cut. A reentrant segment holds its rerun output through its
# backward, so at these sizes a cost-aware reentrant plan may rightly find no cut below the unsplit step
# (tests/planning/test_planner.py checks that figure; reentrant cost-aware plans train there and in tests/test_trunk.py)
TRACED_CASES = [(h, False) for h in HOWS] + [("vissl3", True)]


@pytest.mark.parametrize("how, reentrant", TRACED_CASES, ids=[f"{h}-{'reentrant' if r else 'nonreentrant'}" for h, r in TRACED_CASES])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_traced_chain_trains_exactly_like_the_model(name, how, reentrant):
    how = HOWS[how]
    plain = _build(name)
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["output"], use_reentrant=reentrant, **how)
    assert not (set(map(id, trunk.parameters())) - set(map(id, model.parameters())))  # the model's own objects
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(3)
    want = plain(x)
    _loss(want).backward()
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (got,) = trunk(x)
    _loss(got).backward()
    assert len(trunk.plan.segments) > 1 or trunk.plan.regions  # the budget is met by cuts or by regions
    if isinstance(want, dict):
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    else:
        assert torch.equal(want, got)
    close = torch.equal if not reentrant else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6))
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), n
        assert a.grad is None or close(a.grad, b.grad), n
    for (n, a), b in zip(plain.named_buffers(), model.buffers()):
        assert torch.equal(a, b), n
    assert list(model.state_dict()) == list(plain.state_dict())  # still the model's own state_dict
    # only the model's own tensors: no fx-made constant among the trunk's buffers or state
    assert {id(b) for b in trunk.buffers()} <= {id(b) for b in model.buffers()}


def test_cut_points_are_named_after_the_modules_that_end_there():
    names = list(feature_blocks(_build("stages")))
    assert names[-1] == "output"
    assert "stages.0" in names and "stages.1" in names and "stages.2" not in names  # stage 2 ends in the output unit
    resnet = list(feature_blocks(_untraced_resnet18()))
    assert {"net.layer1", "net.layer2", "net.layer3", "net.maxpool"} <= set(resnet)
    trunk = CheckpointedTrunk(_untraced_resnet18(), ["net.layer3", "output"], num_splits=4)
    assert [f.shape for f in trunk(torch.randn(2, 3, 64, 64))] == [torch.Size([2, 256, 4, 4]), torch.Size([2, 7])]


def test_balanced_plans_cut_the_measured_peak_of_a_traced_model():
    torch.manual_seed(0)
    model = ResidualNet(width=16, depth=10)
    x = torch.randn(4, 3, 48, 48)

    def peak(trunk):
        trunk(x)[0].sum().backward()
        with PeakMemory() as mem:
            trunk(x)[0].sum().backward()
        return mem.peak_bytes

    plain = peak(CheckpointedTrunk(copy.deepcopy(model), gradients="kept"))
    balanced = peak(CheckpointedTrunk(copy.deepcopy(model), num_splits=4, strategy="balanced", gradients="kept"))
    assert balanced < 0.6 * plain


class _Tokens(TinyViT):
    """TinyViT returning ``x[pick]`` of its last token map (``x[:, 0]``: its own class token)."""

    def __init__(self, pick):
        super().__init__(dim=32, depth=2)
        self.pick = pick

    def forward(self, x):
        return self.tokens(x)[self.pick]


@pytest.mark.parametrize("pick, copied", [((slice(None), 0), True), ((slice(None), slice(1, None)), False)], ids=["class_token", "patch_tokens"])
def test_a_traced_class_token_holds_one_token_per_image_and_the_patch_tokens_stay_a_view(pick, copied):
    """The model's own ``x[:, 0]`` (timm's ViTs take their class token so) is a view: a loop holding the feature
    through backward (a head's input) holds the whole token map with it. The traced unit returns a copy of a
    selection at most half its source: the same values and gradients, and the unsplit trunk's step peaks one token
    map less one token per image below the model's own, by hand. The patch tokens (most of the map) stay a view:
    the same peak as the model's."""
    batch, tokens, dim = 4, 17, 32  # 32px, 8px patches: 16 patches and the class token
    torch.manual_seed(0)
    model = _Tokens(pick)
    for layer in model.layers:
        layer["attn"].dropout = 0.0  # the two runs draw no masks
    twin = copy.deepcopy(model)
    trunk = CheckpointedTrunk(twin, memory_budget=1.0)  # runs the twin's own modules
    x = torch.randn(batch, 3, 32, 32)
    w = torch.randn_like(model(x))
    peaks, feature = held_feature_peaks(model, twin, trunk, x, w)
    map_bytes = batch * tokens * dim * 4
    if copied:
        assert peaks[0] - peaks[1] == map_bytes - batch * dim * 4, peaks
        assert feature.untyped_storage().nbytes() == batch * dim * 4
    else:
        assert peaks[0] == peaks[1], peaks
        assert feature.untyped_storage().nbytes() == map_bytes
    saved = io.BytesIO()
    torch.save(trunk, saved)
    saved.seek(0)
    for other in (copy.deepcopy(trunk), torch.load(saved, weights_only=False)):  # a copy; a trunk saved whole (fx traces its code again)
        again = other(x)[0]
        assert torch.equal(again, feature) and again.untyped_storage().nbytes() == feature.untyped_storage().nbytes()


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot follow it
            return self.conv(x)
        return -self.conv(x)


def test_an_untraceable_model_is_a_clear_error_and_nothing_is_built():
    model = Branchy()
    before = copy.deepcopy(model.state_dict())
    children = list(model.named_modules())
    with pytest.raises(TypeError, match=r"could not trace Branchy.*torch.fx said: TraceError.*register_trunk.*OrderedDict.*apply_activation_checkpointing") as info:
        CheckpointedTrunk(model, ["output"], num_splits=2)
    assert "Supported families" in str(info.value)
    assert list(model.named_modules()) == children and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_registered_families_keep_vissl_names():
    assert list(feature_blocks(torchvision.models.resnet18()))[:5] == ["conv1", "bn1", "conv1_relu", "maxpool", "res2"]


@pytest.mark.parametrize("splits", [6, 12])
def test_cuts_stay_off_functional_in_place_ops(splits):
    """torch.sigmoid_(x) overwrites its input as ReLU(inplace=True) does: no segment may start with it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trunk = CheckpointedTrunk(FunctionalInPlace(), num_splits=splits)
    assert [str(w.message) for w in caught if "can be made" in str(w.message)] == ([] if splits <= 7 else [
        f"asked for {splits} checkpoint segments but only 7 can be made (every segment is a single layer or can only be cut before an in-place op)"])
    starts = {trunk.plan.units[s.start] for s in trunk.plan.segments[1:]}
    assert starts and not any(name.startswith(("relu_", "sigmoid_")) for name in starts), starts
    (got,) = trunk(torch.randn(2, 3, 16, 16))
    got.sum().backward()  # raised "modified by an inplace operation" when a cut fell before sigmoid_


@pytest.mark.parametrize("strategy", ["vissl", "balanced"])
def test_a_copied_trunk_keeps_its_cuts_off_in_place_ops_and_trains_exactly(strategy):
    """A copy of a traced trunk (an EMA teacher, the launcher's side-by-side step) plans as the trunk
    does: fx's own deepcopy of a unit rebuilt it from its graph and forgot which units start in place,
    and the copy cut before them (backward: "modified by an inplace operation")."""
    torch.manual_seed(0)
    model = FunctionalInPlace()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    with pytest.warns(UserWarning, match="only 7 can be made"):  # 6 convs, each followed by an in-place op: as the model's trunk
        copied = copy.deepcopy(CheckpointedTrunk(model, num_splits=12, strategy=strategy))
        plan = copied.plan_for(x)
    saved = io.BytesIO()
    torch.save(copied, saved)  # and one saved whole, then loaded
    saved.seek(0)
    assert [u.inplace for _, u in torch.load(saved, weights_only=False).units] == [u.inplace for _, u in copied.units]
    starts = {plan.units[s.start] for s in plan.segments[1:]}
    assert starts and not any(name.startswith(("relu_", "sigmoid_")) for name in starts), starts
    loss_of(copied(x)).backward()
    loss_of([plain(x)]).backward()
    for (name, a), b in zip(plain.named_parameters(), copied.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_module_called_twice_gets_names_that_cannot_collide():
    model = SharedWeights()
    trunk = CheckpointedTrunk(model, num_splits=3)
    children = [n.replace(".", "_") for n in trunk.plan.units]
    assert len(set(children)) == len(children)
    # the shared block's parameters are the model's, once each, though two units run them
    assert sorted(id(p) for p in trunk.parameters()) == sorted(id(p) for p in model.parameters())


def test_the_models_checkpoint_loads_strictly_where_two_units_run_one_module():
    """The shared block's tensors are the trunk's under two names (one per unit that runs it, as a
    traced timm ViT's position embedding): the model's state_dict fills both, and the trunk then
    computes what the model that saved it does."""
    torch.manual_seed(0)
    saved = SharedWeights()
    torch.manual_seed(1)
    trunk = CheckpointedTrunk(SharedWeights(), num_splits=3)
    trunk.load_state_dict(saved.state_dict())  # strict
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(trunk(x)[-1], saved(x))
    back = trunk.model_state_dict()
    assert set(back) == set(saved.state_dict()) and all(torch.equal(back[k], v) for k, v in saved.state_dict().items())


def test_buffer_reads_are_traced_not_frozen_at_trace_time():
    """fx's default would run ``self.ema.mul_(0.9)`` once while tracing and bake ``self.ema.view(...)``
    into a constant; the chain's units read and write the model's own buffer when they run."""
    model = BufferWriter()
    blocks = feature_blocks(model)
    assert all(torch.equal(b, torch.zeros(8)) for b in model.buffers())  # tracing wrote nothing
    code = "".join(unit.code for unit in blocks.values())
    assert "mul_" in code and "_tensor_constant" not in code


class Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.conv(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean((0, 2, 3))
        return y.mean((2, 3))


def test_a_forward_that_reassigns_a_buffer_is_refused_and_the_model_left_as_it_was():
    model = Reassigns()
    buffer = model.ema
    with pytest.raises(TypeError, match=r"writes its buffer\(s\) \['ema'\].*register_trunk.*apply_activation_checkpointing"):
        CheckpointedTrunk(model, num_splits=2)
    assert model.ema is buffer and torch.equal(buffer, torch.zeros(4))
    model(torch.randn(2, 3, 8, 8))  # still a working model, not one holding an fx Proxy


def test_a_cut_that_carries_a_tuple_is_planned_and_measured():
    """After ``x.split`` the chain carries a tuple: a balanced plan profiles it (it crashed on ``h.detach()``)."""
    trunk = CheckpointedTrunk(CrossStage(), num_splits=4, strategy="balanced", gradients="kept")
    x = torch.randn(2, 3, 16, 16)
    plan = trunk.plan_for(x)
    assert any(isinstance(out, tuple) for out in _unit_outputs(trunk, x))  # the chain really carries a tuple
    assert len(plan.segments) == 4 and plan.predicted_peak_bytes > 0


def _unit_outputs(trunk, x):
    outs = []
    with torch.no_grad():
        for _, unit in trunk.units:
            x = unit(x)
            outs.append(x)
    return outs


class BuildsATensor(nn.Module):
    """A forward that makes a tensor from Python values: fx computes it once and keeps a constant."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        mask = torch.ones(8, 8).tril()
        return (y * mask).relu().mean((2, 3))


def test_tensors_the_forward_builds_are_neither_buffers_nor_state_dict_entries():
    model = BuildsATensor()
    own = dict(model.state_dict())
    trunk = CheckpointedTrunk(model, num_splits=2)
    saved = io.BytesIO()
    torch.save(trunk, saved)
    saved.seek(0)
    unpickled = torch.load(saved, weights_only=False)
    for t in (trunk, copy.deepcopy(trunk), unpickled):  # a copy and a saved trunk too (their state loads into the trunk)
        assert [n for n, _ in t.named_buffers() if "_tensor_constant" in n] == []
        assert set(t.model_state_dict(model)) == set(own) and not [k for k in t.state_dict() if "_tensor_constant" in k]
    assert not [n for n in vars(model) if n.startswith("_tensor_constant")]  # tracing left nothing on the model
    x = torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(model)
    want, got = reference(x), trunk(x)[-1]
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(want, got) and torch.equal(reference.conv.weight.grad, model.conv.weight.grad)


def _entered(model, x, units=()):
    """Modules entered, in order, by pre-hooks on all of ``model``'s modules, while ``model(x)`` runs; with
    ``units`` (a trunk's, run one by one) each call is tagged with the unit running it."""
    calls, running = [], [None]
    hooks = [m.register_forward_pre_hook(lambda m, i, n=n: calls.append((n, running[0]))) for n, m in model.named_modules() if n]
    for i, (_, unit) in enumerate(units):
        hooks.append(unit.register_forward_pre_hook(lambda m, a, i=i: running.__setitem__(0, i)))
    with torch.no_grad():
        for (_, unit) in units:
            x = unit(x)
        if not units:
            model(x)
    for h in hooks:
        h.remove()
    return calls


def _timm_vit():
    return pytest.importorskip("timm").create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2)  # timm is optional


@pytest.mark.parametrize("build", [_untraced_resnet18, _timm_vit])
def test_a_traced_plan_names_where_each_segment_begins_as_the_model_runs(build):
    """A traced unit is named where it ends: a ResNet block's body ``layer1.1.bn2``, ViT's second half of a
    block ``blocks.1``. The table read "layer1.1.bn2 .. layer2" for a segment from layer1.1 to layer2's end.
    It now begins each segment where its first unit begins. The reference is the plain model's own calls
    (pre-hooks on every module, containers included): a unit begins at the first module entered after the
    previous unit's last call, e.g. ``layer1.1`` entered before ``layer1.1.conv1``, timm ViT's ``norm2`` (which fx
    traces through) before its ``mlp``."""
    torch.manual_seed(0)
    model = build().eval()
    trunk = CheckpointedTrunk(model, num_splits=4).eval()
    x = torch.randn(1, 3, 32, 32)
    plain = [n for n, _ in _entered(model, x)]
    by_unit = _entered(model, x, trunk.units)  # the modules the units call: in plain's order, without what fx traced through
    at, j = [], 0
    for n, _ in by_unit:
        j = plain.index(n, j)
        at.append(j)
        j += 1
    checked = 0
    for i, (unit_name, _) in enumerate(trunk.units):
        mine = [p for p, (_, u) in zip(at, by_unit) if u == i]
        previous = [p for p, (_, u) in zip(at, by_unit) if u == i - 1]
        if not mine or not previous:
            continue  # it or the one before calls no module (fx names a unit of functions), or it is the first
        assert trunk.plan.begins[i] == plain[previous[-1] + 1], (unit_name, trunk.plan.begins[i], plain[previous[-1] : mine[0] + 1])
        checked += 1
    assert checked >= 8 and any(b != n for b, (n, _) in zip(trunk.plan.begins, trunk.units))
    state = trunk.plan.state()  # what a checkpoint holds; one saved before begins were kept still loads
    assert SplitPlan.from_state(state) == trunk.plan
    assert SplitPlan.from_state({k: v for k, v in state.items() if k != "begins"}) == replace(trunk.plan, begins=())
    first = trunk.plan.segments[1]
    assert str(trunk.plan).count(f"| {trunk.plan.begins[first.start]} .. {trunk.plan.units[first.stop - 1]} ") == 1
