"""feature_blocks, register_trunk, layer_splittable_before."""
import re
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops.misc import Conv2dNormActivation

from trunksplit import CheckpointedTrunk, feature_blocks, layer_splittable_before, register_trunk
from trunksplit.planning import vissl as vissl_module


@pytest.mark.parametrize("arch", ["resnet18", "resnext50_32x4d", "wide_resnet50_2"])
def test_resnet_family_blocks_are_the_models_own_modules(arch):
    model = getattr(torchvision.models, arch)()
    blocks = feature_blocks(model)
    assert list(blocks) == ["conv1", "bn1", "conv1_relu", "maxpool", "res2", "res3", "res4", "res5", "avgpool", "flatten"]
    assert blocks["conv1"] is model.conv1 and blocks["conv1_relu"] is model.relu
    assert [blocks[f"res{i}"] for i in range(2, 6)] == [model.layer1, model.layer2, model.layer3, model.layer4]
    assert blocks["avgpool"] is model.avgpool and isinstance(blocks["flatten"], nn.Flatten)


@pytest.mark.parametrize("arch", ["regnet_x_400mf", "regnet_y_400mf"])
def test_regnet_family_blocks(arch):
    model = getattr(torchvision.models, arch)()
    blocks = feature_blocks(model)
    assert list(blocks) == ["conv1", "res2", "res3", "res4", "res5", "avgpool", "flatten"]
    assert blocks["conv1"] is model.stem
    assert [blocks[f"res{i}"] for i in range(2, 6)] == list(model.trunk_output.children())


def test_feature_blocks_run_in_order_give_the_model_features():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    h = x
    for block in feature_blocks(model).values():
        h = block(h)
    model.fc = nn.Identity()
    assert torch.equal(h, model(x))


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.stage = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3))
        self.head = nn.Linear(4, 2)


def test_register_trunk_teaches_a_new_family():
    register_trunk(TinyNet, lambda m: OrderedDict(conv1=m.stem, res2=m.stage, flatten=nn.Flatten(1)))
    model = TinyNet()
    trunk = CheckpointedTrunk(model, ["res2"], num_splits=3)
    assert {id(p) for p in trunk.parameters()} == {id(p) for p in list(model.stem.parameters()) + list(model.stage.parameters())}
    # no cut before the in-place ReLU (unit 3 of conv1, res2.0, res2.1, res2.2, res2.3)
    assert 3 not in trunk.plan.boundaries
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(trunk(x)[0], model.stage(model.stem(x)))


def test_a_data_parallel_wrapper_is_refused_naming_the_model_inside_it():
    with pytest.raises(TypeError, match=r"DataParallel wraps the model: give the model it holds \(.module\).*DataParallel\(CheckpointedTrunk\(model"):
        feature_blocks(nn.DataParallel(torchvision.models.resnet18()))  # traced, it failed on a Proxy iterated, naming nothing


def test_a_compiled_model_is_refused_naming_the_model_before_compiling():
    model = torchvision.models.resnet18()
    with pytest.raises(TypeError, match=r"a torch.compile'd model: give the model before compiling \(model._orig_mod\).*\.compile\(\)"):
        CheckpointedTrunk(torch.compile(model), ["flatten"], num_splits=2)  # fx failed on it, naming a missing forward
    assert list(feature_blocks(torch.compile(model)._orig_mod)) == list(feature_blocks(model))  # what the message says works


def test_register_trunk_refuses_non_modules():
    with pytest.raises(TypeError):
        register_trunk(int, lambda m: m)


@pytest.mark.parametrize(
    "module,splittable",
    [
        (nn.ReLU(inplace=True), False),
        (nn.ReLU(), True),
        (nn.SiLU(inplace=True), False),
        (nn.Hardswish(inplace=True), False),
        (nn.ReLU6(inplace=True), False),
        (nn.LeakyReLU(inplace=True), False),
        (nn.Dropout(inplace=True), False),
        (nn.Conv2d(1, 1, 1), True),
        (nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(1, 1, 1)), False),
        (nn.Sequential(nn.Sequential(nn.SiLU(inplace=True)), nn.Conv2d(1, 1, 1)), False),
        (Conv2dNormActivation(1, 1), True),  # conv first; its in-place ReLU is last
        (nn.Sequential(), True),
    ],
)
def test_layer_splittable_before(module, splittable):
    assert layer_splittable_before(module) is splittable


def test_vissl_plan_is_made_once_not_on_every_forward(monkeypatch):
    trunk = CheckpointedTrunk(torchvision.models.resnet18(), ["flatten"], num_splits=4)
    calls = []
    monkeypatch.setattr(vissl_module, "vissl_segments", lambda *a, **k: calls.append(1))
    for _ in range(2):
        sum(f.sum() for f in trunk(torch.randn(2, 3, 32, 32))).backward()
    assert calls == []


def test_stages_are_what_feature_blocks_name_not_a_res_prefix():
    from trunksplit.chains.blocks import FeatureBlocks

    model = TinyNet()
    named = FeatureBlocks([("stem", model.stem), ("body", model.stage), ("flatten", nn.Flatten(1))], stages=["body"])
    trunk = CheckpointedTrunk(named, ["flatten"], num_splits=3)
    assert trunk.plan.units == ("stem", "body.0", "body.1", "body.2", "body.3", "flatten")
    # a plain dict keeps vissl's rule: "res*" expands, anything else is one unit
    plain = CheckpointedTrunk(OrderedDict(stem=model.stem, body=model.stage, flatten=nn.Flatten(1)), ["flatten"])
    assert plain.plan.units == ("stem", "body", "flatten")
    with pytest.raises(ValueError, match=r"stages \['nope'\] are not among the feature blocks"):
        FeatureBlocks([("stem", model.stem)], stages=["nope"])


@pytest.mark.parametrize("arch", ["alexnet", "squeezenet1_0"])
def test_unregistered_torchvision_models_are_traced_into_chains(arch):
    torch.manual_seed(0)
    model = torchvision.models.get_model(arch).eval()
    blocks = feature_blocks(model)
    assert list(blocks)[-1] == "output" and len(blocks) > 5
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        assert torch.equal(CheckpointedTrunk(blocks).eval()(x)[0], model(x))


@pytest.mark.parametrize("keys,hint", [(["layer4"], "did you mean res5 for layer4?"), (["res4", "Flatten"], "did you mean flatten for Flatten?"),
                                       (["layer1", "avgpol"], "did you mean res2 for layer1, avgpool for avgpol?")])
def test_a_torchvision_layer_name_or_a_misspelt_key_is_refused_with_the_key_meant(keys, hint):
    with pytest.raises(ValueError, match="unknown feature key") as e:
        CheckpointedTrunk(torchvision.models.resnet18(), keys, num_splits=2)
    assert hint in str(e.value) and "known keys: ['conv1', 'bn1'" in str(e.value)


def test_vissls_feature_names_that_are_not_blocks_here_are_refused_naming_the_block_and_its_conv1_is_conv1_relu():
    """vissl's ResNet maps the feature names its configs ask for to blocks: conv1 -> conv1_relu, res1 -> maxpool,
    res5avg -> avgpool. Here the names are the blocks': res1 and res5avg are refused naming the block, and
    vissl's conv1 (the stem after its ReLU) is conv1_relu, the plain model's relu(bn1(conv1(x)))."""
    with pytest.raises(ValueError, match=re.escape("did you mean maxpool for res1 (vissl's name of that block's output), "
                                                   "avgpool for res5avg (vissl's name of that block's output)?")):
        CheckpointedTrunk(torchvision.models.resnet18(), ["res1", "res5avg"])
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    stem, maxpool, pooled = CheckpointedTrunk(model, ["conv1_relu", "maxpool", "avgpool"]).eval()(x)
    with torch.no_grad():
        assert torch.equal(stem, model.relu(model.bn1(model.conv1(x))))
        assert torch.equal(maxpool, model.maxpool(stem))
        assert torch.equal(pooled, model.avgpool(model.layer4(model.layer3(model.layer2(model.layer1(maxpool))))))


def test_vissls_stage_names_on_a_trunk_named_as_its_model_are_refused_with_the_stage_meant():
    """A vissl config's ``res4`` on a trunk whose stages keep the model's names (timm's ResNets, traced: ``layer3``;
    a dict of blocks named so) was refused with no hint."""
    model = torchvision.models.resnet18()
    blocks = OrderedDict((name, getattr(model, name)) for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"))
    with pytest.raises(ValueError, match=r"did you mean layer3 for res4, layer4 for res5\?"):
        CheckpointedTrunk(blocks, ["res4", "res5"], num_splits=2)
