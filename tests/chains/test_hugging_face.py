"""transformers' vision models cut as chains (an optional test dependency: ``pip install transformers``;
skipped without it). Each is compared with the model's own forward: the pooled feature its classifier
takes, every gradient and buffer after a training step, dropout and drop-path included."""
import copy
import os
import re

import pytest
import torch

from trunksplit import CheckpointedTrunk, feature_blocks
from trunksplit.cli import main
from trunksplit.ssl.config import load_config
from trunksplit.ssl.loop import train

from reference import close

transformers = pytest.importorskip("transformers")

QUICK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "quickstart.yaml")

SMALL = {  # the architectures at toy widths, with dropout or drop-path where they have one
    "vit": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.1),
    "deit": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.1),
    "dinov2": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, mlp_ratio=2, hidden_dropout_prob=0.1),
    "vit_msn": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.1),
    "dinov2_with_registers": dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, mlp_ratio=2, hidden_dropout_prob=0.1),
    "convnext": dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 2, 1, 1], drop_path_rate=0.2),
    "convnextv2": dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 2, 1, 1], drop_path_rate=0.2),
    "resnet": dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 2, 1, 1], embedding_size=8),
}
POOLED = {  # the model's own pooled feature, read from its output
    "vit": lambda out: out.last_hidden_state[:, 0],  # what ViTForImageClassification's classifier takes
    "deit": lambda out: out.last_hidden_state[:, 0],
    "dinov2": lambda out: out.pooler_output,
    "vit_msn": lambda out: out.last_hidden_state[:, 0],
    "dinov2_with_registers": lambda out: out.pooler_output,
    "convnext": lambda out: out.pooler_output,
    "convnextv2": lambda out: out.pooler_output,
    "resnet": lambda out: out.pooler_output.flatten(1),
}


def _model(kind, cls=None):
    config = transformers.AutoConfig.for_model(kind, **SMALL[kind])
    torch.manual_seed(0)
    return cls(config) if cls else transformers.AutoModel.from_config(config)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(SMALL))
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_training_step_of_the_cut_model_equals_the_models_own(kind, reentrant):
    plain = _model(kind)
    model = copy.deepcopy(plain)
    trunk = CheckpointedTrunk(model, num_splits=3, use_reentrant=reentrant)
    assert sum(s.checkpointed for s in trunk.plan.segments) == 2
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    want = POOLED[kind](plain(x))
    want.square().mean().backward()
    torch.manual_seed(2)
    (got,) = trunk(x)
    got.square().mean().backward()
    assert torch.equal(want, got)
    same = torch.equal if not reentrant else close  # reentrant sums a reused tensor's gradients in another order
    want_grads, got_grads = _grads(plain), _grads(model)
    for name, g in got_grads.items():
        assert (g is None) == (want_grads[name] is None) and (g is None or same(want_grads[name], g)), name
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), model.buffers()))  # ResNet's BatchNorm statistics


@pytest.mark.parametrize("kind, cls", [("vit", "ViTForImageClassification"), ("deit", "DeiTForImageClassification"), ("vit_msn", "ViTMSNForImageClassification"),
                                       ("convnext", "ConvNextForImageClassification"), ("convnextv2", "ConvNextV2ForImageClassification"),
                                       ("resnet", "ResNetForImageClassification")])
def test_an_image_classifier_gives_the_feature_its_classifier_takes(kind, cls):
    model = _model(kind, getattr(transformers, cls)).eval()
    x = torch.randn(2, 3, 32, 32)
    trunk = CheckpointedTrunk(model, num_splits=2).eval()
    assert list(feature_blocks(model))[-1] == "flatten" and "classifier" not in dict(trunk.named_children())
    with torch.no_grad():
        assert torch.equal(model.classifier(trunk(x)[0]), model(x).logits)


@pytest.mark.parametrize("kind", ["vit", "deit"])
def test_a_vit_at_another_size_interpolates_its_position_embeddings_as_the_model_does_when_asked(kind):
    model = _model(kind).eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        want = model(x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
        assert torch.equal(CheckpointedTrunk(model).eval()(x)[0], want)


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_the_trunks_weights_load_strictly_into_a_fresh_model_under_its_own_names(kind):
    model = _model(kind)
    trunk = CheckpointedTrunk(model, num_splits=2)
    with torch.no_grad():
        for p in trunk.parameters():
            p.add_(1.0)
    fresh = _model(kind)
    fresh.load_state_dict(trunk.model_state_dict(fresh))  # strict
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_plan_and_fit_cut_a_transformers_type_and_wrap_one_they_cannot_cut(capsys):
    assert main(["plan", "--arch", "hf:resnet", "--input", "2x3x32x32", "--splits", "3", "--strategy", "balanced"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (balanced, 3 segments") and re.search(r"\| conv1( \.\. \S+)? +\|", out)
    assert main(["fit", "--arch", "hf:resnet", "--input", "3x32x32", "--memory", "350MiB"]) == 0
    assert "fits 350.0 MiB" in capsys.readouterr().out
    assert main(["fit", "--arch", "hf:beit", "--input", "3x32x32", "--memory", "1GiB"]) == 2
    assert "not a chain trunksplit can cut (it cuts hf:convnext, hf:convnextv2, hf:deit, hf:dinov2, hf:dinov2_with_registers, hf:resnet, hf:vit, hf:vit_msn)" in capsys.readouterr().err


def test_the_launcher_trains_a_transformers_trunk(tmp_path):
    cfg = load_config(QUICK, ["MODEL.TRUNK.NAME", "hf:resnet", "OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.STEPS", "2",
                                                  "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4"])
    model, last = train(cfg)
    assert type(model.trunk.feature_blocks["res2"][0]).__module__.startswith("transformers.models.resnet")
    assert last["step"] == 2 and torch.isfinite(torch.tensor(last["loss"]))
    assert any(s.checkpointed for s in model.trunk.plan.segments)
