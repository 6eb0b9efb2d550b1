"""Which units trunk.compile() runs eagerly: the groups whose step is faster so, timed for real."""
import time

import torch
from torch import nn

from trunksplit.planning.timing import faster_eagerly
from trunksplit.recompute.compiled import run_plain

PAUSE = 0.02  # far beyond the step of these tiny layers, and beyond a shared machine's jitter


class SlowEagerConv(nn.Module):
    """A convolution whose eager forward pauses: its "compiled" form below runs the same math without."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        time.sleep(PAUSE)
        return self.conv(x)


def _compiled_conv(x, conv, *rest):
    return run_plain(conv.conv(x), *rest)


def _compiled_slower(x, *layers):
    time.sleep(PAUSE)
    return run_plain(x, *layers)


def test_the_groups_slower_compiled_are_the_ones_run_eagerly_and_nothing_is_touched():
    torch.manual_seed(0)
    units = [SlowEagerConv(3, 4), nn.BatchNorm2d(4), nn.ReLU(), SlowEagerConv(4, 4), nn.BatchNorm2d(4)]
    before = [{k: v.clone() for k, v in u.state_dict().items()} for u in units]
    with torch.inference_mode():  # planning up front under inference mode works too
        x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    compiled = lambda a, b: _compiled_conv if isinstance(units[a], SlowEagerConv) else _compiled_slower  # noqa: E731
    assert faster_eagerly(units, x, [(0, 1), (1, 3), (3, 4), (4, 5)], compiled) == [(1, 3), (4, 5)]
    assert all(p.grad is None for u in units for p in u.parameters())  # measured on private copies
    assert all(torch.equal(v, old[k]) for u, old in zip(units, before) for k, v in u.state_dict().items())  # statistics unmoved
    assert torch.equal(torch.get_rng_state(), rng)
