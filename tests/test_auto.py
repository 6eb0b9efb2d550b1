"""Automatic chains: any traceable model, cut where one tensor carries the state, trains exactly like itself."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from trunksplit import CheckpointedTrunk, PeakMemory, feature_blocks

from reference import loss_of


class ResidualNet(nn.Module):
    """A ModuleList of residual blocks, functional ops in forward, a parameter read directly."""

    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.Dropout(0.2)) for _ in range(depth))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width).view(1, width, 1, 1))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        x = x * self.scale
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


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


class TinyViT(nn.Module):
    """Tokens: a class-token parameter, attention with a residual, LayerNorm, dropout."""

    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(dim), attn=nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True), mlp=nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))))
            for _ in range(depth)
        )

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for layer in self.layers:
            h = layer["norm"](x)
            x = x + layer["attn"](h, h, h, need_weights=False)[0]
            x = x + layer["mlp"](x)
        return x[:, 0]


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


MODELS = {"norm_act": NormActNet, "residual": ResidualNet, "stages": Stages, "tiny_vit": TinyViT, "torchvision_resnet18": lambda: _untraced_resnet18()}


def _untraced_resnet18():
    """torchvision's ResNet-18, but as a class trunksplit has no registration for."""
    return type("MyResNet", (nn.Module,), {"__init__": lambda self: (nn.Module.__init__(self), setattr(self, "net", torchvision.models.resnet18(num_classes=7)))[0],
                                           "forward": lambda self, x: self.net(x)})()


def _build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def _loss(out):
    return loss_of(list(out.values()) if isinstance(out, dict) else [out])


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("how", [dict(num_splits=3), dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.95, gradients="kept")], ids=["vissl3", "balanced4", "budget"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_traced_chain_trains_exactly_like_the_model(name, how, reentrant):
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
    with pytest.raises(TypeError, match=r"could not trace Branchy.*branches on tensor values.*register_trunk.*OrderedDict") as info:
        CheckpointedTrunk(model, ["output"], num_splits=2)
    assert "Supported families" in str(info.value)
    assert list(model.named_modules()) == children and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_registered_families_keep_vissl_names():
    assert list(feature_blocks(torchvision.models.resnet18()))[:5] == ["conv1", "bn1", "conv1_relu", "maxpool", "res2"]
