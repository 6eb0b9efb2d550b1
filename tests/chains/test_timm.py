"""timm models (an optional test dependency: ``pip install timm``; skipped without it).

The models that crashed the balanced planner (cuts after ``x.split(...)`` carried a tuple) and
one whose forward builds tensors from Python values (fx constants): traced chains, exact
against the unsplit trunk and the model's own forward, and nothing but the model's tensors.
"""
import copy

import pytest
import torch

from trunksplit import CheckpointedTrunk

timm = pytest.importorskip("timm")


def _two_steps(module, x):
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        out = module(x)[-1]
        out.float().pow(2).mean().backward()
        outs.append(out.detach())
        opt.step()
        opt.zero_grad(set_to_none=False)
    return outs


@pytest.mark.parametrize("name", ["cspresnet50", "cs3darknet_s", "mixnet_s"])
def test_models_whose_cuts_follow_a_split_train_exactly(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = copy.deepcopy(model).eval()(x)
        assert torch.equal(own, CheckpointedTrunk(copy.deepcopy(model)).eval()(x)[-1])  # the chain is the model's forward
    plain = CheckpointedTrunk(copy.deepcopy(model))
    trunk = CheckpointedTrunk(copy.deepcopy(model), num_splits=4, strategy="balanced")
    want, got = _two_steps(plain, x), _two_steps(trunk, x)
    assert len(trunk.plan.segments) > 1
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for (n, a), b in zip(plain.named_parameters(), trunk.parameters()):
        assert torch.equal(a, b), n
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), trunk.buffers()))


def test_a_traced_swin_holds_only_the_models_own_buffers():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=64, window_size=2)
    own = {n for n, _ in model.named_buffers()}
    trunk = CheckpointedTrunk(model, num_splits=3)
    assert set(trunk.model_state_dict(model)) == set(model.state_dict())
    assert {id(b) for b in trunk.buffers()} <= {id(b) for b in model.buffers()}, "a trunk buffer that is not the model's"
    assert own  # swin's relative position index: a real buffer, read by the units
