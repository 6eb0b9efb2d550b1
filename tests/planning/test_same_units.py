"""A profile measures a repeated block once (trunksplit.planning.same_units): its figures must be those of
measuring every unit, which is the reference here (the key disabled), on every family whose blocks repeat
and on units that differ only where the key has to look."""
import pytest
import torch
import torchvision
from torch import nn

import trunksplit.planning.profile as profile
from trunksplit import CheckpointedTrunk
from trunksplit.planning.profile import profile_units
from trunksplit.planning.search import peak_model

from zoo import input_for, small


def _each_unit_measured(monkeypatch):
    monkeypatch.setattr(profile, "measurement_key", lambda *args: None)


def _counted_measurements(monkeypatch):
    calls = []
    real = profile.measure_unit
    monkeypatch.setattr(profile, "measure_unit", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("name", ["regnet_x_400mf", "vit", "swin", "convnext", "densenet", pytest.param("efficientnet_b0", marks=pytest.mark.slow),
                                  pytest.param("maxvit", marks=pytest.mark.slow)])  # slow: 7 s each here, blocks as the others
def test_a_profile_measuring_repeated_blocks_once_gives_the_figures_of_measuring_every_unit(name, monkeypatch):
    """Every family with blocks alike (RegNet's stages, ViT's layers, Swin's shifted and unshifted windows, which
    differ only in an attribute, DenseNet's layers, each wider by its growth), with regions: the whole profile, every
    policy's figures included, equals the one that measured each unit."""
    trunk = CheckpointedTrunk(small(name), None, memory_budget=0.5)
    x = input_for(name)
    once = peak_model(trunk.plan_request(), x, regions=True).costs
    with monkeypatch.context() as patched:
        _each_unit_measured(patched)
        every = peak_model(trunk.plan_request(), x, regions=True).costs
    assert once == every


@pytest.mark.parametrize("kind, config", [
    ("dinov2", dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, mlp_ratio=2, hidden_dropout_prob=0.1)),
    pytest.param("convnext", dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 3, 1, 1], drop_path_rate=0.0), marks=pytest.mark.slow),  # 8 s here
])
def test_transformers_layers_alike_holding_their_config_are_measured_once_as_measured_each(kind, config, monkeypatch):
    """A transformers layer holds its model's config (unhashable): compared by its class and state, the layers of
    one model are alike, and the profile equals the one that measured each."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    trunk = CheckpointedTrunk(transformers.AutoModel.from_config(transformers.AutoConfig.for_model(kind, **config)), None, memory_budget=0.5)
    x = torch.randn(2, 3, 32, 32)
    calls = _counted_measurements(monkeypatch)
    once = peak_model(trunk.plan_request(), x, regions=True).costs
    measured_once = len(calls)
    _each_unit_measured(monkeypatch)
    every = peak_model(trunk.plan_request(), x, regions=True).costs
    assert once == every and measured_once < len(calls) - measured_once, (measured_once, len(calls) - measured_once)


class _Scaled(nn.Module):
    """A block whose allocation follows a plain attribute and a function it holds, neither in ``extra_repr``."""

    def __init__(self, copies: int, act):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.copies, self.act = copies, act

    def forward(self, x):
        y = self.act(self.conv(x))
        return sum(y * k for k in range(1, self.copies + 1))


def _wide(x):
    return torch.cat([x, x], 1)[:, :4].sigmoid()


def test_units_alike_but_for_an_attribute_or_a_function_are_measured_each_and_units_alike_once(monkeypatch):
    units = [("a", _Scaled(1, torch.relu)), ("b", _Scaled(3, torch.relu)), ("c", _Scaled(3, _wide)), ("d", _Scaled(3, _wide)), ("e", _Scaled(3, _wide))]
    x = torch.randn(2, 4, 8, 8)
    calls = _counted_measurements(monkeypatch)
    once = profile_units(units, x)
    assert len(calls) == 3  # d and e are c's copies: measured once
    frozen = [("a", _Scaled(2, torch.relu)), ("b", _Scaled(2, torch.relu).requires_grad_(False))]
    calls.clear()
    frozen_once = profile_units(frozen, x)
    assert len(calls) == 2  # a frozen block keeps no weight gradient: not the trained one's figures
    _each_unit_measured(monkeypatch)
    assert once == profile_units(units, x) and frozen_once == profile_units(frozen, x)


class _Residual(nn.Module):
    """A residual block whose branch stochastic depth drops (torchvision's or timm's, at ``rate``)."""

    def __init__(self, drop):
        super().__init__()
        self.conv, self.drop = nn.Conv2d(4, 4, 3, padding=1), drop

    def forward(self, x):
        return x + self.drop(self.conv(x).relu())


def _torchvision_drop(rate):
    from torchvision.ops import StochasticDepth
    return StochasticDepth(rate, "row")


def _timm_drop(rate):
    return pytest.importorskip("timm.layers").DropPath(rate)


def _transformers_drop(rate):  # one of the copies each model's file holds
    pytest.importorskip("transformers")
    from transformers.models.convnext.modeling_convnext import ConvNextDropPath
    return ConvNextDropPath(rate)


@pytest.mark.parametrize("drop", [_torchvision_drop, _timm_drop, _transformers_drop], ids=["torchvision", "timm", "transformers"])
def test_blocks_whose_stochastic_depth_rates_differ_above_0_are_measured_once_and_a_block_at_0_apart(drop, monkeypatch):
    """Deep trunks raise the drop rate block by block (ConvNeXt, EfficientNet, Swin, timm's drop_path_rate): every
    rate above 0 allocates the same mask, and 0 none (the input passes), so the rates above 0 share one measurement,
    and the profile equals measuring each."""
    units = [(name, _Residual(drop(rate))) for name, rate in (("a", 0.0), ("b", 0.1), ("c", 0.25), ("d", 1.0))]
    x = torch.randn(2, 4, 8, 8)
    calls = _counted_measurements(monkeypatch)
    once = profile_units(units, x)
    assert len(calls) == 2  # a; then b, whose figures c and d share
    _each_unit_measured(monkeypatch)
    assert once == profile_units(units, x)


def _block(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 4, 1))


@pytest.mark.parametrize("allocator", [False, True])
def test_the_time_objective_times_units_and_spans_alike_once_on_either_meter(allocator, monkeypatch):
    """Wall times do not depend on what the allocator holds: units alike share one timing, and spans alike
    one timing of each region policy, under the tensor tracker and under the allocator's meter (CUDA's,
    where ``"time"`` is the default objective) alike; a block of another width is timed apart. Before,
    each unit and span was timed: ViT-B/16's twelve layers twelve times (docs/benchmarks.md)."""
    timed_units, timed_spans = [], []
    real_forward, real_span = profile.forward_seconds, profile.time_span
    monkeypatch.setattr(profile, "forward_seconds", lambda *a, **k: timed_units.append(1) or real_forward(*a, **k))
    monkeypatch.setattr(profile, "time_span", lambda *a, **k: timed_spans.append(1) or real_span(*a, **k))
    torch.manual_seed(0)
    units = [("stem", nn.Conv2d(3, 4, 3, padding=1)), ("a", _block(8)), ("b", _block(8)), ("c", _block(8)), ("wide", _block(16))]
    costs = profile_units(units, torch.randn(2, 3, 8, 8), spans=[(1, 2), (2, 3), (3, 4), (4, 5)], timed=True, allocator=allocator)
    assert (len(timed_units), len(timed_spans)) == (3, 2)  # stem, the 8-wide block, the 16-wide one; two kinds of span
    assert costs.forward_seconds[1] == costs.forward_seconds[2] == costs.forward_seconds[3] > 0
    assert costs.rerun_seconds[1] == costs.rerun_seconds[2] == costs.rerun_seconds[3] > 0
    for policy, under in costs.policies.items():
        assert under.again_seconds[1] == under.again_seconds[2] == under.again_seconds[3] > 0, policy


def test_save_heavy_on_a_span_without_light_ops_gets_save_expensives_figures_as_measured(monkeypatch):
    """A span none of whose expensive ops is light (ResNet-18's basic blocks, but the first of a stage with its 1x1
    downsampling convolution) keeps under "save_heavy" what it keeps under "save_expensive", op for op: the profile
    takes the one's figures for the other without running it. Against the profile that runs both on every span: the
    same figures, every policy's, from fewer "save_heavy" runs."""
    trunk = CheckpointedTrunk(torchvision.models.resnet18(), None, memory_budget=0.5)
    x = torch.randn(2, 3, 64, 64)
    runs, real_run, real_span = [], profile.measure_under, profile._measure_span
    monkeypatch.setattr(profile, "measure_under", lambda members, h, needs_grad, policy, allocator=False: runs.append(policy) or real_run(members, h, needs_grad, policy, allocator))
    shortcut = peak_model(trunk.plan_request(), x, regions=True).costs
    taken = runs.count("save_heavy")
    runs.clear()
    monkeypatch.setattr(profile, "_measure_span", lambda *args: real_span(*args[:-1], True))  # light ops said in every span: each measured
    measured = peak_model(trunk.plan_request(), x, regions=True).costs
    assert shortcut == measured
    assert 0 < taken < runs.count("save_heavy"), (taken, runs.count("save_heavy"))
