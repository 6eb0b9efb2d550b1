"""Hugging Face transformers vision models (an optional test dependency: ``pip install transformers``;
skipped without it) that trunksplit does not cut (those it cuts: tests/chains/test_hugging_face.py):
torch.fx cannot trace them, so the trunk refuses them, quoting fx, and the memory-budget wrapper plans
them instead, exact. Tiny configs; the full-size sweep is
``python tools/zoo_sweep.py --libraries transformers --wrap 0.6 --size 224``."""
import copy

import pytest
import torch

from trunksplit import CheckpointedTrunk, PeakMemory, apply_activation_checkpointing

transformers = pytest.importorskip("transformers")


def _beit():
    torch.manual_seed(0)
    config = transformers.BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.1)
    return transformers.BeitModel(config, add_pooling_layer=False)


def _step(model, x):
    torch.manual_seed(3)  # the same dropout masks, if the checkpoint restores the RNG
    model(pixel_values=x).last_hidden_state.pow(2).sum().backward()


def test_a_transformers_beit_is_refused_by_the_trunk_and_wrapped_to_a_budget_exactly():
    plain = _beit().train()
    with pytest.raises(TypeError, match=r"torch.fx said: .*apply_activation_checkpointing"):
        CheckpointedTrunk(copy.deepcopy(plain))
    model = copy.deepcopy(plain)
    x = torch.randn(4, 3, 32, 32)
    plan = apply_activation_checkpointing(model, memory_budget=0.6, example_inputs=(x,), gradients="kept")
    assert plan.names  # the encoder layers, found in a ModuleList of a **kwargs forward with a dataclass output
    peaks = []
    for m in (plain, model):
        _step(m, x)  # gradients exist; the second step is measured with them kept
        for p in m.parameters():
            p.grad.zero_()
        with PeakMemory() as mem:
            _step(m, x)
        peaks.append(mem.peak_bytes)
    assert peaks[1] <= 0.6 * peaks[0] * 1.03
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
