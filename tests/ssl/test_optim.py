"""The recipes' optimizers: LARS against its formula by hand, parameter groups, schedules, and fit's state bytes."""
import math
import os

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import LARS
from trunksplit.planning.sharding import rank_memory
from trunksplit.ssl.config import load_config
from trunksplit.ssl.optim import build_optimizer, set_schedules, weight_decay

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")


def _lars_by_hand(w, grads, lr, momentum, wd, eta, eps=1e-8):
    """vissl's LARC + SGD, written out: trust = eta |w| / (|g| + wd |w| + eps), applied to g + wd w."""
    buf = None
    for g in grads:
        w_norm, g_norm = w.norm().item(), g.norm().item()
        d = (g + wd * w) * (eta * w_norm / (g_norm + wd * w_norm + eps))
        buf = d if buf is None else momentum * buf + d
        w = w - lr * buf
    return w


def test_lars_takes_the_trust_ratio_step_of_its_formula():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 4, generator=g)
    grads = [torch.randn(6, 4, generator=g) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = LARS([p], lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    assert torch.allclose(p.detach(), _lars_by_hand(w0, grads, 0.5, 0.9, 1e-4, 0.001), rtol=1e-6, atol=1e-7)
    assert list(opt.state[p]) == ["momentum_buffer"]  # one buffer, as SGD's


def test_lars_groups_without_trust_ratio_take_plain_sgd_steps():
    g = torch.Generator().manual_seed(1)
    a, b = nn.Parameter(torch.randn(5, generator=g)), nn.Parameter(torch.randn(5, generator=g))
    grads = [torch.randn(5, generator=g) for _ in range(2)]
    lars = LARS([{"params": [a], "lars": False, "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    sgd = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    b.data.copy_(a.data)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        lars.step()
        sgd.step()
    assert torch.allclose(a, b, atol=1e-7)


def test_bias_and_norm_parameters_get_no_weight_decay_and_no_trust_ratio():
    cfg = load_config(QUICK, ["OPTIM.NAME", "lars", "OPTIM.EXCLUDE_BIAS_AND_NORM", "True", "OPTIM.WEIGHT_DECAY", "0.01"])
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(2, 3, 8, 8))
    opt = build_optimizer(cfg, model)
    by_id = {id(p): group for group in opt.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        excluded = name.endswith("bias") or name.startswith("1.")  # biases, and BatchNorm's weight
        group = by_id[id(p)]
        assert (group["weight_decay"], group["lars"]) == ((0.0, False) if excluded else (0.01, True)), name


def test_weight_decay_follows_a_cosine_on_the_decayed_group_only():
    cfg = load_config(QUICK, ["OPTIM.NAME", "adamw", "OPTIM.EXCLUDE_BIAS_AND_NORM", "True", "OPTIM.WEIGHT_DECAY", "0.04",
                              "OPTIM.WEIGHT_DECAY_END", "0.4", "TRAIN.STEPS", "5"])
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    opt = build_optimizer(cfg, model)
    assert isinstance(opt, torch.optim.AdamW)
    seen = []
    for step in range(5):
        set_schedules(cfg, opt, step)
        seen.append([g["weight_decay"] for g in opt.param_groups])
    middle = 0.4 + 0.5 * (0.04 - 0.4) * (1 + math.cos(math.pi * 2 / 4))  # by hand: 0.22
    assert [round(s[0], 9) for s in seen][::2] == [0.04, round(middle, 9), 0.4]
    assert all(s[1] == 0.0 for s in seen)
    assert weight_decay(load_config(QUICK, []), 3) == 1e-6  # no end: constant


@pytest.mark.parametrize("name", ["sgd", "lars", "adamw"])
def test_fit_counts_each_optimizers_state_exactly(name):
    # reference: the real optimizer's state after a step, on the model's own parameters
    trunk = torchvision.models.resnet18()
    params = [p for p in trunk.parameters() if p.requires_grad]
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9), "lars": lambda: LARS(params, lr=0.1),
           "adamw": lambda: torch.optim.AdamW(params)}[name]()
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    real = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values() if torch.is_tensor(t))
    units = list(trunk.children())
    assert rank_memory(trunk, units, 1, name, 0, "allocated").optimizer == real


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="OPTIM.NAME must be one of sgd, lars, adamw"):
        load_config(QUICK, ["OPTIM.NAME", "lamb"])
