"""MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER: vissl's wide ResNets (SimCLR's ResNet-50 (2x), (4x)) and narrow ones."""
import math
import os
import re

import pytest
import torch
import torchvision

from trunksplit import CheckpointedTrunk
from trunksplit.ssl.backbones import resnet_of_width
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_trunk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")


def _trunk_parameters(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("fc."))


@pytest.mark.parametrize("width, millions", [(1, 24), (2, 94), (4, 375)])
def test_wide_resnet50s_have_the_parameters_simclr_gives_them(width, millions):
    """SimCLR's Table 6 (Chen et al. 2020): ResNet-50 24M parameters, (2x) 94M, (4x) 375M, the classifier left out."""
    with torch.device("meta"):  # its shapes only: the 4x model holds 1.5 GB
        model = resnet_of_width("resnet50", width)
    assert round(_trunk_parameters(model) / 1e6) == millions


def test_at_width_1_a_resnet_is_torchvisions_and_narrowed_it_is_initialised_as_torchvision_initialises_one():
    """Every stage's width times the multiplier, the rest as torchvision builds and initialises a ResNet:
    its convolutions He-normal over their fan-out (std sqrt(2 / fan_out)), BatchNorm ones and zeros."""
    ours, theirs = resnet_of_width("resnet50", 1).state_dict(), torchvision.models.resnet50().state_dict()
    assert [(k, v.shape) for k, v in ours.items()] == [(k, v.shape) for k, v in theirs.items()]
    torch.manual_seed(0)
    narrow = resnet_of_width("resnet18", 0.25)
    assert [narrow.conv1.out_channels, *(getattr(narrow, f"layer{k}")[-1].conv2.out_channels for k in range(1, 5))] == [16, 16, 32, 64, 128]
    assert narrow(torch.randn(2, 3, 32, 32)).shape == (2, 1000) and narrow.fc.in_features == 128
    conv = narrow.layer3[0].conv1  # 32 -> 64 channels, 3x3: fan-out 64 * 9
    assert abs(conv.weight.std().item() / math.sqrt(2 / (64 * 9)) - 1) < 0.05
    assert torch.equal(narrow.layer3[0].bn1.weight, torch.ones(64)) and torch.equal(narrow.layer3[0].bn1.bias, torch.zeros(64))


def test_a_narrow_resnet_is_cut_into_vissls_blocks_and_its_checkpointed_step_is_the_plain_ones():
    cfg = load_config(QUICK, ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]"])
    torch.manual_seed(0)
    trunk = build_trunk(cfg)  # the quick start's plan: balanced, 4 segments
    plain = CheckpointedTrunk(resnet_of_width("resnet18", 0.25))
    plain.load_state_dict(trunk.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for model in (trunk, plain):
        model(x)[0].pow(2).sum().backward()
    assert len(trunk.plan.segments) == 4 and trunk.plan.strategy == "balanced"
    assert list(trunk.feature_blocks) == ["conv1", "bn1", "conv1_relu", "maxpool", "res2", "res3", "res4", "res5", "avgpool", "flatten"]
    for (name, p), q in zip(trunk.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("overrides, message", [
    (["MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.3"], "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER must be > 0 with 64 x it a whole number of channels"),
    (["MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0"], "must be > 0"),
    (["MODEL.TRUNK.NAME", "vit_b_16", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "2"],
     "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER 2.0 sets the width of torchvision's ResNets (resnet18 to resnet152, resnext, wide_resnet); "
     "vit_b_16 is not one: leave it at 1"),
    (["MODEL.TRUNK.TRUNK_PARAMS.RESNETS.WIDTH_MULTIPLIER", "2"], "that is vissl's key: here, MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER"),
])
def test_a_width_no_resnet_can_take_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(QUICK, overrides)


def test_a_config_file_gives_the_multiplier_as_vissls_files_do_a_whole_number(tmp_path):
    """vissl's files say ``WIDTH_MULTIPLIER: 2``; yacs refused an int for a float key ("Type mismatch"), as it did
    ``LR: 1``. A file's whole number for a float key is read as the command line reads it; a bool is still refused."""
    wide = tmp_path / "wide.yaml"
    wide.write_text(f"_BASE_: {QUICK}\nMODEL:\n  TRUNK:\n    RESNETS:\n      WIDTH_MULTIPLIER: 2\nOPTIM:\n  LR: 1\n")
    cfg = load_config(str(wide))
    assert cfg.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER == 2.0 and cfg.OPTIM.LR == 1.0 and isinstance(cfg.OPTIM.LR, float)
    with torch.device("meta"):
        assert round(_trunk_parameters(resnet_of_width(cfg.MODEL.TRUNK.NAME, cfg.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER)) / 1e6) == 94
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("OPTIM:\n  LR: true\n")
    with pytest.raises(ValueError, match="Type mismatch"):
        load_config(str(wrong))
