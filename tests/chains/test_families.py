"""Every torchvision family: feature blocks that run the model's own forward, and exact checkpointed training."""
import copy
import warnings

import pytest
import torch
import torchvision
from torchvision.models import vision_transformer

from trunksplit import CheckpointedTrunk, PeakMemory, feature_blocks
from trunksplit.chains.blocks import expand_units

from reference import held_feature_peaks, loss_of
from zoo import SMALL, input_for, small, without_head

HIERARCHICAL = [n for n in SMALL if n != "vit"]


@pytest.mark.parametrize("name", list(SMALL))
def test_flatten_is_the_models_own_forward_without_its_head(name):
    model = small(name).eval()
    reference = without_head(copy.deepcopy(model))
    blocks = feature_blocks(model)
    assert list(blocks)[-1] == "flatten"
    x = input_for(name)
    with torch.no_grad():
        got = CheckpointedTrunk(blocks, ["flatten"]).eval()(x)[0]
        want = reference(x)
    assert got.dim() == 2 and torch.equal(got, want)


@pytest.mark.parametrize("name", HIERARCHICAL)
def test_stages_res2_to_res5_have_strides_4_to_32(name):
    model = small(name).eval()
    x = input_for(name)
    with torch.no_grad():
        feats = CheckpointedTrunk(model, ["res2", "res3", "res4", "res5"]).eval()(x)
    channels_last = isinstance(model, torchvision.models.SwinTransformer)
    sizes = [f.shape[1:3] if channels_last else f.shape[2:] for f in feats]
    assert [tuple(s) for s in sizes] == [(64 // s, 64 // s) for s in (4, 8, 16, 32)]


@pytest.mark.parametrize("arch", ["convnext_tiny", "swin_t", "swin_v2_t", "maxvit_t", "vit_b_16", "efficientnet_b0", "vgg11_bn"])
def test_zoo_models_at_their_own_resolution(arch):
    # The default builders, not the small instances: the layout the zoo really has.
    torch.manual_seed(0)
    model = torchvision.models.get_model(arch).eval()
    reference = without_head(copy.deepcopy(model))
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(CheckpointedTrunk(model, ["flatten"]).eval()(x)[0], reference(x))
    assert len(expand_units(feature_blocks(model))) > 8


def _close(a, b, rtol=1e-4):
    return a.shape == b.shape and bool((a - b).abs().max() <= rtol * a.abs().max().clamp_min(1e-30))


PLANS = {"vissl4": dict(num_splits=4), "balanced4": dict(num_splits=4, strategy="balanced"), "budget0.8": dict(memory_budget=0.8, gradients="kept")}  # tiny inputs: gradients would dominate


# reentrant checkpointing runs a segment the same whatever placed its cuts: one plan per family
# checks it, vissl's, which always cuts (at these tiny inputs a reentrant segment's rerun output, held
# through its backward, can put every cost-aware cut above the unsplit step: the planner then runs
# unsplit); the reentrant path of every plan kind is in tests/test_trunk.py and tests/planning
CASES = [(p, False) for p in PLANS] + [("vissl4", True)]
# budget plans of families whose blocks another family's budget case runs fast (ResNet-18's for RegNet's,
# EfficientNetV2-S's inverted residuals for MobileNet's, MNASNet's and EfficientNet-B0's): slow, 1.3-1.6 s each here
SLOW_BUDGETS = {"regnet_x_400mf", "mobilenet_v2", "mobilenet_v3_small", "mnasnet0_5", "efficientnet_b0"}


def _family_cases():
    for name in SMALL:
        for plan, reentrant in CASES:
            slow = plan == "budget0.8" and name in SLOW_BUDGETS
            yield pytest.param(name, plan, reentrant, id=f"{name}-{plan}-{'reentrant' if reentrant else 'nonreentrant'}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name, plan, reentrant", list(_family_cases()))
def test_checkpointed_training_step_equals_the_plain_model(name, plan, reentrant):
    plain = small(name)
    reference = without_head(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, ["flatten"], use_reentrant=reentrant, **PLANS[plan])
    x = input_for(name)
    torch.manual_seed(7)  # stochastic depth and dropout draw the same masks in both
    want = reference(x)
    loss_of([want]).backward()
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = trunk(x)[0]
    loss_of([got]).backward()
    assert len(trunk.plan.segments) > 1 or trunk.plan.regions  # cuts, or regions (budget plans)
    assert torch.equal(want, got)
    # non-reentrant: the plain graph, op for op; reentrant: per-segment backward changes summation order
    same = torch.equal if not reentrant else _close
    ref_params = dict(reference.named_parameters())
    trunk_params = {id(p) for p in trunk.parameters()}
    for n, p in model.named_parameters():
        if id(p) in trunk_params:
            assert p.grad is not None and same(ref_params[n].grad, p.grad), n
    for (n, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.equal(a, b), n  # BatchNorm statistics and counters moved once


def _peak(run, x):
    run(x).backward()  # gradients exist, as from the second step on
    with PeakMemory() as mem:
        run(x).backward()
    return mem.peak_bytes


@pytest.mark.parametrize("name", list(SMALL))
def test_balanced_plans_cut_the_measured_peak_well_below_the_plain_one(name):
    # VGG has no blocks, only single layers: the floor is one full-resolution conv's backward
    # (0.61 of plain for vgg11_bn at 128px, 0.80 for the small one here).
    limit = 0.85 if name == "vgg" else 0.75
    model = small(name)
    x = input_for(name, batch=4)
    # measured with gradients kept between steps (_peak), so planned for that mode
    plain = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], gradients="kept")
    balanced = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced", gradients="kept")
    ratio = _peak(lambda x: balanced(x)[0].sum(), x) / _peak(lambda x: plain(x)[0].sum(), x)
    assert ratio < limit, ratio


def test_vit_at_another_resolution_resizes_its_position_embedding_as_dino_does():
    # Reference: torchvision's own ViT built for 48px, its position embedding set to DINO's
    # interpolate_pos_encoding of the 32px model's (bicubic over the patch grid, class token kept).
    model = small("vit").eval()
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    big = vision_transformer.VisionTransformer(48, 8, 3, 2, 32, 64).eval()
    big.load_state_dict({k: v for k, v in model.state_dict().items() if k != "encoder.pos_embedding"}, strict=False)
    pos = model.encoder.pos_embedding.detach()
    grid = pos[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid, size=(6, 6), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, 36, 32)
    with torch.no_grad():
        big.encoder.pos_embedding.copy_(torch.cat([pos[:, :1], grid], dim=1))
        want = without_head(big)(x)
        got = CheckpointedTrunk(model, ["flatten"], num_splits=2).eval()(x)[0]
        assert torch.equal(CheckpointedTrunk(small("vit"), ["flatten"]).eval()(input_for("vit"))[0], without_head(small("vit")).eval()(input_for("vit")))
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="8x8 patches; a 36x40 image"):
        CheckpointedTrunk(model, ["flatten"])(torch.randn(1, 3, 36, 40))


def test_a_vits_class_token_holds_one_token_per_image_not_the_token_map():
    """The model's own ``x[:, 0]`` is a view: a loop holding the pooled feature through backward (a head's
    input) holds the whole token map with it. The trunk's ``flatten`` is a copy of the token: the same values
    and gradients, and its step (unsplit, as the model's) peaks one token map less one token per image below
    the model's own, by hand."""
    batch, tokens, dim = 4, 17, 64  # 32px, 8px patches: 16 patches and the class token
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(32, 8, 2, 2, dim, 128)
    model.heads = torch.nn.Identity()
    twin = copy.deepcopy(model)
    trunk = CheckpointedTrunk(twin, ["flatten"], memory_budget=1.0)  # runs the twin's own modules
    x, w = torch.randn(batch, 3, 32, 32), torch.randn(batch, dim)
    peaks, feature = held_feature_peaks(model, twin, trunk, x, w)
    assert peaks[0] - peaks[1] == (batch * tokens * dim - batch * dim) * 4, peaks
    assert feature.untyped_storage().nbytes() == batch * dim * 4
