"""Wall times, timed for real with pauses far beyond a shared machine's jitter: which units
trunk.compile() runs eagerly, and what the "time" objective prices a cut at."""
import time

import pytest
import torch
from torch import nn

from trunksplit import CheckpointedTrunk, is_recomputing
from trunksplit.planning import timing
from trunksplit.planning.peak import PeakModel
from trunksplit.planning.profile import profile_units
from trunksplit.planning.timing import added_seconds, faster_eagerly
from trunksplit.recompute.compiled import run_plain

PAUSE = 0.04  # far beyond the step of these tiny layers, and beyond a shared machine's jitter (at 0.02 a loaded run once priced 2.6 pauses for 2)


def pauses(seconds: float) -> int:
    """How many pauses a price holds, to the nearest: a price is a difference of timings less a
    checkpoint's measured cost, so it may come out a little under the pauses it holds."""
    return round(seconds / PAUSE)


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


class DearToRerun(nn.Module):
    """A layer whose recompute pauses, its forward not: what a cut costs beyond the forward it reruns
    (non-reentrant checkpoint's hooks on every saved tensor, on a GPU), made large enough to time."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        if is_recomputing():
            time.sleep(PAUSE)
        return torch.relu(self.fc(x))


def test_a_cut_is_priced_at_what_its_checkpoint_adds_to_the_step_not_at_the_forward_it_reruns():
    """The profile times each unit's step under a checkpoint against its plain step: a unit whose
    rerun costs far more than its forward is priced at the rerun, and so is a checkpointed segment
    holding it. A unit whose first op is in place is timed on a copy of its input (as a segment
    starting there runs it), not refused."""
    torch.manual_seed(0)
    units = [("fc0", nn.Linear(16, 16)), ("dear", DearToRerun(16)), ("fc2", nn.Linear(16, 16)), ("relu_", nn.ReLU(inplace=True)), ("fc4", nn.Linear(16, 16))]
    c = profile_units(units, torch.randn(8, 16), timed=True)
    assert pauses(c.forward_seconds[1]) == 0 and pauses(c.rerun_seconds[1]) == 1
    assert all(r < PAUSE / 2 for i, r in enumerate(c.rerun_seconds) if i != 1) and 0 <= c.checkpoint_seconds < PAUSE / 2
    traced = CheckpointedTrunk(nn.Sequential(*[m for _, m in units])).units  # its in-place unit a traced one, timed on a copy
    assert len(profile_units(traced, torch.randn(8, 16), timed=True).rerun_seconds) == len(traced)
    model = PeakModel(costs=c, feature_units=[len(units) - 1], gradients="kept", objective="time")
    for starts in ([0, 1], [0, 2], [0, 3], [0, 1, 3], [0, 2, 4]):  # a checkpointed segment holding "dear" reruns it
        seconds = [cost.seconds for _, cost in model.segments(starts)]
        reruns_dear = [a <= 1 < b and b < len(units) for a, b in zip(starts, starts[1:] + [len(units)])]
        assert [pauses(s) for s in seconds] == [int(r) for r in reruns_dear], (starts, seconds)


def test_a_step_difference_takes_the_fastest_of_each_step_timed_in_turn(monkeypatch):
    """A burst of other work slows the steps timed during it: alternating the steps compared, the
    fastest of each is an undisturbed one, and their difference what the run adds."""
    clock = iter([1.0, 9.0, 8.0, 1.0, 3.0, 2.5])  # plain, a, b; plain, a, b: the first round slowed
    calls = []

    def step_seconds(run, h, input_needs_grad, repeats):
        calls.append(run)
        return next(clock)

    monkeypatch.setattr(timing, "step_seconds", step_seconds)
    plain, a, b = (lambda x: x), (lambda x: x + 1), (lambda x: x + 2)
    assert added_seconds({"a": a, "b": b}, plain, torch.ones(1), False) == {"a": pytest.approx(2.0), "b": pytest.approx(1.5)}
    assert calls == [plain, a, b, plain, a, b]


def test_short_steps_are_timed_more_often_until_they_took_long_enough(monkeypatch):
    """A unit of a launch-bound step takes a millisecond, and the fastest of two such steps is at the
    mercy of a shared machine: short rounds go on until they took ``MIN_SECONDS`` together, at most
    ``MAX_REPEATS``; long ones stop at ``REPEATS``."""
    calls = []

    def step_seconds(seconds):
        def timed(run, h, input_needs_grad, repeats):
            calls.append(repeats)
            return seconds + 0.001 * (len(calls) == 1)  # the first step disturbed
        return timed

    plain, a = (lambda x: x), (lambda x: x + 1)
    monkeypatch.setattr(timing, "step_seconds", step_seconds(0.002))
    assert added_seconds({"a": a}, plain, torch.ones(1), False) == {"a": pytest.approx(0.0)}
    rounds = min(timing.MAX_REPEATS, -(-timing.MIN_SECONDS // 0.004))  # two steps of 2 ms a round
    assert len(calls) == 2 * rounds and set(calls) == {1}
    calls.clear()
    monkeypatch.setattr(timing, "step_seconds", step_seconds(0.5))
    added_seconds({"a": a}, plain, torch.ones(1), False)
    assert len(calls) == 2 * timing.REPEATS
    # fastest() alike: a 0.1 ms call runs MAX_REPEATS times, and once where asked for once
    ticks = []
    assert timing.fastest(lambda: ticks.append(1), torch.device("cpu")) >= 0 and len(ticks) == timing.MAX_REPEATS
    ticks.clear()
    timing.fastest(lambda: ticks.append(1), torch.device("cpu"), repeats=1)
    assert len(ticks) == 1


def test_benchmark_steps_take_turns_and_each_reports_the_median_of_its_timed_rounds(monkeypatch):
    """``interleaved_medians`` (every benchmark's step times): the steps alternate within each round, the
    warm-up rounds are run but not counted, and a step's figure is the median of its timed calls, so one
    disturbed call moves none. The clock is the test's: each call advances it by a duration chosen here."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    durations = {"plain": iter([50.0, 1.0, 9.0, 2.0]), "split": iter([70.0, 3.0, 3.5, 30.0])}  # a warm-up call, then 3 timed
    calls = []

    def step(name):
        def run():
            calls.append(name)
            now[0] += next(durations[name])
        return run

    medians = timing.interleaved_medians({"plain": step("plain"), "split": step("split")}, "cpu", repeats=3)
    assert calls == ["plain", "split"] * 4
    assert medians == {"plain": 2.0, "split": 3.5}  # sorted 1, 2, 9 and 3, 3.5, 30; the warm-ups (50, 70) left out
    calls.clear()
    assert timing.interleaved_medians({"plain": lambda: calls.append(1)}, torch.device("cpu"), repeats=2, warmup=0) == {"plain": 0.0}
    assert calls == [1, 1]


def test_a_region_nested_in_a_checkpointed_segment_is_priced_at_its_run_in_the_segments_recompute():
    """Nested in a checkpointed segment, a region runs in the segment's recompute too, where a later
    unit of the segment needs it (torch reruns a nested checkpoint as its first forward ran, hooks
    and all), and in its own: a layer that pauses whenever it is recomputed pauses twice there, once
    as a plain unit of the segment, in the last segment, or nested at the segment's end (the
    segment's recompute stops before it). The plan's price says so."""
    torch.manual_seed(0)
    units = [("fc0", nn.Linear(16, 16)), ("dear", DearToRerun(16)), ("fc2", nn.Linear(16, 16)), ("fc3", nn.Linear(16, 16))]
    c = profile_units(units, torch.randn(8, 16), spans=[(1, 2)], timed=True)
    model = PeakModel(costs=c, feature_units=[len(units) - 1], gradients="kept", spans=[(1, 2)], objective="time")
    seconds = lambda starts, regions: model.segments(starts, regions)[0][1].seconds  # noqa: E731  the first segment's
    nested = seconds([0, 3], [(1, 2, "recompute")])
    assert pauses(nested) == 2, nested
    # a selective region nests as "recompute": priced alike there
    assert pauses(seconds([0, 3], [(1, 2, "save_expensive")])) == 2
    once = {"as a unit": seconds([0, 3], []), "in the last segment": seconds([0], [(1, 2, "recompute")]), "nested at the end": seconds([0, 2], [(1, 2, "recompute")])}
    assert all(pauses(s) == 1 for s in once.values()), once
