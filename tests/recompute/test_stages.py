"""Stages: a unit's torch.fx graph cut at its convolutions and matmuls, each stage a nested checkpoint."""
import copy

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import checkpoint_wrapper
from trunksplit.planning.memory import PeakMemory, _TensorAccounting
from trunksplit.recompute.checkpoint import run_checkpointed
from trunksplit.recompute.regions import run_region
from trunksplit.recompute.stages import run_in_stages, staged_graph

from reference import build
from zoo import small

# a block of each family that runs in stages, and an input for it
BLOCKS = {
    "resnet bottleneck": (lambda: build("resnet50").layer1[0], (2, 64, 16, 16)),
    "resnet basic block": (lambda: build("resnet18").layer2[0], (2, 64, 16, 16)),
    "regnet_y (squeeze-excitation)": (lambda: torchvision.models.regnet_y_400mf().trunk_output.block1[0], (2, 32, 16, 16)),
    "convnext (stochastic depth)": (lambda: small("convnext").features[5][1], (2, 64, 8, 8)),
    "efficientnet (in-place SiLU, stochastic depth)": (lambda: small("efficientnet_b0").features[2][1], (2, 24, 16, 16)),
    "mobilenet_v2": (lambda: small("mobilenet_v2").features[3], (2, 16, 16, 16)),
    "swin_v2": (lambda: small("swin_v2").features[1][0], (2, 16, 16, 16)),
    "vit (dropout)": (lambda: small("vit").encoder.layers[0], (2, 17, 32)),
    "densenet block": (lambda: small("densenet").features.denseblock1, (2, 16, 16, 16)),
}


def _step(module, x, run, seed=3):
    """Output, parameter gradients and buffers after one training step of ``run(module, x)``."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = run(module, x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, x.grad, [p.grad for p in module.parameters()], [b.clone() for b in module.buffers()]


def _same(a, b):
    out_a, xg_a, grads_a, bufs_a = a
    out_b, xg_b, grads_b, bufs_b = b
    assert torch.equal(out_a, out_b) and torch.equal(xg_a, xg_b)
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(grads_a, grads_b))
    assert all(torch.equal(g, h) for g, h in zip(bufs_a, bufs_b))  # BatchNorm statistics moved once


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_block_in_stages_trains_exactly_like_the_plain_block(name):
    make, shape = BLOCKS[name]
    torch.manual_seed(0)
    plain = make().train()
    mine, nested = copy.deepcopy(plain), copy.deepcopy(plain)
    assert staged_graph(mine).stages >= 2  # it really runs in stages
    x = torch.randn(*shape)
    want = _step(plain, x, lambda m, x: m(x))
    _same(want, _step(mine, x, lambda m, x: run_region([m], x, "recompute_stages")))
    # nested in an outer checkpoint, as in a checkpointed segment: the same again
    _same(want, _step(nested, x, lambda m, x: run_checkpointed(lambda x: run_region([m], x, "recompute_stages"), [m], (x,))))


def test_a_bottleneck_is_cut_at_its_convolutions():
    staged = staged_graph(build("resnet50").layer1[0])
    stages = [[n.name for n in s.nodes] for s in staged.steps if s.checkpointed]
    between = [s.nodes[0].name for s in staged.steps if not s.checkpointed]
    assert stages == [["conv1", "bn1", "relu"], ["conv2", "bn2", "relu_1"], ["conv3", "bn3"], ["downsample_0", "downsample_1"]]
    assert between == ["add", "relu_2"]  # the residual add reads two stages; the last ReLU reads the add


def test_in_stages_a_bottleneck_keeps_only_its_stage_inputs():
    """Run in stages (no outer checkpoint), a bottleneck without downsample keeps, beyond its
    input: the inputs of its 2nd and 3rd stages (two 64-channel activations) and its last
    ReLU's output (256 channels, which ReLU's backward needs). Plain, it keeps 4 of 64 and 3
    of 256 channels, and BatchNorm's statistics. Hand-computed at 2x256x16x16, float32."""
    block = build("resnet50").layer1[1].train()
    x = torch.randn(2, 256, 16, 16, requires_grad=True).clone()
    narrow, wide = 2 * 64 * 16 * 16 * 4, 2 * 256 * 16 * 16 * 4
    for run, want in ((run_in_stages, 2 * narrow + wide), (lambda m, x: m(x), 4 * narrow + 2 * wide + 2 * wide)):
        tracker = _TensorAccounting()
        with tracker:
            out = run(block, x)
        tracker._sweep()
        kept = tracker.current  # the output among them
        if run is run_in_stages:
            assert kept == want
        else:  # conv1..3 and bn1..2 outputs, bn3's, the add's (= the ReLU's), and 3 BatchNorms' mean and inverse std
            assert kept == 4 * narrow + 2 * wide + 2 * (64 + 64 + 256) * 4
        del out


def test_a_stage_region_backward_peaks_below_a_whole_recompute():
    block = build("resnet50").layer1[0].train()
    x = torch.randn(2, 64, 32, 32, requires_grad=True)
    peaks = {}
    for policy in ("recompute", "recompute_stages"):
        with PeakMemory() as mem:
            out = run_region([block], x, policy)
            out.sum().backward()
        peaks[policy] = mem.peak_bytes
    wide = 2 * 256 * 32 * 32 * 4
    # a whole recompute holds conv3's and the downsample's outputs (256 channels each) at once
    # with the last ReLU's; in stages one of them is rebuilt only once the other is done
    assert peaks["recompute_stages"] <= peaks["recompute"] - wide


class _ChoosesByValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            return self.b(self.a(x))
        return self.a(self.b(x))


class _ChangesAStageInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.a.requires_grad_(False)  # frozen: nothing saves h, so plain autograd allows the change below

    def forward(self, x):
        h = x * 2
        y = torch.tanh(self.a(h))  # a stage reads h (and its tanh keeps its output) ...
        h.mul_(2)  # ... which then changes: the stage's recompute would read the changed values
        return self.b(y) + h


_CONSTANT = torch.ones(4)


class _UsesAGlobalTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) + _CONSTANT)


@pytest.mark.parametrize("module", [_ChoosesByValue, _ChangesAStageInput, _UsesAGlobalTensor])
def test_a_unit_that_cannot_run_in_stages_runs_whole_and_exactly(module):
    torch.manual_seed(0)
    plain = module()
    before = set(vars(plain))
    mine = copy.deepcopy(plain)
    assert staged_graph(mine) is None
    assert set(vars(plain)) == before  # tracing left the module as it was
    x = torch.randn(3, 4)
    _same(_step(plain, x, lambda m, x: m(x)), _step(mine, x, lambda m, x: run_region([m], x, "recompute_stages")))


def test_a_unit_with_hooks_of_its_own_runs_whole_so_they_fire():
    block = build("resnet18").layer1[0].train()
    seen = []
    block.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(2, 64, 8, 8)
    out = run_in_stages(block, x)
    assert seen == [out.shape]
    # a checkpoint-wrapped unit would nest a checkpoint in each stage for nothing: it runs whole
    assert staged_graph(checkpoint_wrapper(build("resnet18").layer1[0])) is None


def test_the_graph_follows_the_module_and_its_mode():
    """Traced once per training mode; weights are read from the module on each run."""
    block = build("resnet18").layer1[0].train()
    first = staged_graph(block)
    assert staged_graph(block) is first
    assert staged_graph(block.eval()) is not first
    block.train()
    x = torch.randn(2, 64, 8, 8)
    with torch.no_grad():
        block.conv1.weight.mul_(-1)  # changed after tracing
        assert torch.equal(run_in_stages(block, x), block(x))


def test_a_block_in_stages_under_cpu_autocast_is_exact():
    """Each stage's recompute re-enters the forward's autocast state (bf16 on CPU)."""
    torch.manual_seed(0)
    plain = build("resnet50").layer1[0].train()
    mine = copy.deepcopy(plain)
    x = torch.randn(2, 64, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _step(plain, x, lambda m, x: m(x))
        got = _step(mine, x, lambda m, x: run_region([m], x, "recompute_stages"))
    assert want[0].dtype == torch.bfloat16
    _same(want, got)
