"""fit: the largest batch whose whole training step fits, checked by a real step with a real optimizer."""
import copy
import importlib
import math

import pytest
import torch
import torchvision

from trunksplit import PeakMemory, fit, optimizer_in_backward, scaling
from trunksplit.cli import main
from trunksplit.planning.budget import parse_memory_size

SHAPE = (3, 96, 96)


def _model():
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(width_mult=0.5)


def _live_bytes(*groups):
    """Bytes of the distinct storages of the given tensors: what is resident."""
    storages = {}
    for group in groups:
        for t in group:
            if torch.is_tensor(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _measured_total(model, trunk, batch, optimizer, gradients):
    """Everything resident during a real training step at ``batch``: the model's tensors, the optimizer's
    state and the gradients, summed from the live tensors, plus the measured peak of forward, backward and
    the optimizer's step."""
    params = [p for p in trunk.parameters() if p.requires_grad]
    made = {"sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9)), "adamw": (torch.optim.AdamW, dict(lr=1e-4))}.get(optimizer)
    if made is None:
        opt = None
    elif gradients == "in_backward":  # each parameter updated in backward, as the trunk was planned for
        opt = optimizer_in_backward(trunk, made[0], **made[1])
    else:
        opt = made[0](params, **made[1])
    x = torch.randn(batch, *SHAPE)

    def step():
        sum(f.sum() for f in trunk(x)).backward()
        if opt is not None:
            opt.step()
        for p in params:
            if gradients == "kept":
                p.grad.zero_()
            else:
                p.grad = None

    step()  # the optimizer's state exists from the first step on
    state = [t for s in (opt.state.values() if opt else []) for t in s.values()]
    grads = [p.grad for p in params]
    before = _live_bytes(model.parameters(), model.buffers(), state, grads)
    with PeakMemory() as mem:
        step()
    return before + mem.peak_bytes


@pytest.mark.parametrize("gradients,optimizer", [("allocated", "adamw"), ("kept", None), ("in_backward", "adamw")]
                         + [pytest.param(g, o, marks=pytest.mark.slow) for g, o in (("allocated", "sgd"), ("allocated", None), ("kept", "sgd"), ("kept", "adamw"), ("in_backward", "sgd"))])
def test_a_real_step_at_the_fitted_batch_fills_90_to_100_percent_of_memory(optimizer, gradients):
    model = _model().eval()
    before = copy.deepcopy(model.state_dict())
    memory = 120 * 2**20
    found = fit(model, SHAPE, memory, optimizer=optimizer, gradients=gradients)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # fit trains nothing
    assert all(p.grad is None for p in model.parameters())
    assert not any(m.training for m in model.modules())  # nor changes the model's mode
    found.trunk.train()
    total = _measured_total(model, found.trunk, found.batch_size, optimizer, gradients)
    assert 0.90 * memory <= total <= memory, (found, total)
    assert found.measured_total_bytes <= memory and found.batch_size > 8
    assert found.measured_total_bytes <= found.predicted_total_bytes, found  # never under the step it checked
    # one image more than fits would, by the same prediction, not fit
    assert fit(model, SHAPE, memory, optimizer=optimizer, gradients=gradients, verify=False).batch_size >= found.batch_size


def test_more_memory_fits_a_larger_batch_and_adamw_a_smaller_one():
    model = _model()
    sizes = [fit(model, SHAPE, m, verify=False).batch_size for m in ("80MiB", "120MiB", "160MiB")]
    assert sizes == sorted(sizes) and sizes[0] < sizes[2]
    assert fit(model, SHAPE, "120MiB", optimizer="adamw", verify=False).batch_size <= sizes[1]


def test_too_little_memory_names_the_smallest_that_fits():
    model = _model()
    with pytest.raises(ValueError, match=r"too small for a batch of 1: the smallest that fits is [\d.]+ MiB \((\d+) bytes\)") as info:
        fit(model, SHAPE, "5MiB")
    smallest = int(info.value.args[0].split("smallest that fits is ")[1].split("(")[1].split()[0])
    assert fit(model, SHAPE, smallest, verify=False).batch_size == 1


@pytest.mark.parametrize("bad,match", [(dict(optimizer="lamb"), "optimizer must be"), (dict(input_shape=(96, 96)), r"input_shape .*\(3, 224, 224\), got \(96, 96\)"),
                                       (dict(input_shape=(8, 3, 96, 96)), r"one image's \(C, H, W\).* got \(8, 3, 96, 96\)"),
                                       (dict(input_shape="3x96x96"), "got '3x96x96'"), (dict(memory="lots"), "memory size")])
def test_bad_arguments_are_refused(bad, match):
    kwargs = {"input_shape": SHAPE, "memory": "100MiB", **bad}
    with pytest.raises(ValueError, match=match):
        fit(_model(), **kwargs)


def test_fit_command_prints_the_batch_the_plan_and_the_check(capsys):
    assert main(["fit", "--arch", "mobilenet_v2", "--input", "3x64x64", "--memory", "150MiB", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (budget") and "fits 150.0 MiB" in out and "measured" in out and "of memory)" in out
    assert "images of 3x64x64 through the trunk alone" in out and "--config-file" in out  # what the batch counts, and where SSL runs fit
    assert main(["fit", "--arch", "mobilenet_v2", "--input", "3x64x64", "--memory", "1MiB"]) == 2
    assert "too small for a batch of 1" in capsys.readouterr().err


def test_a_huge_memory_is_planned_without_allocating_the_batch():
    """1 TiB fits hundreds of thousands of 32px images: the plan is keyed by shape, and nothing that size is allocated."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    with PeakMemory() as mem:
        found = fit(model, (3, 32, 32), "1TiB", verify=False)
    input_bytes = found.batch_size * 3 * 32 * 32 * 4
    assert found.batch_size > 100_000 and mem.peak_bytes < input_bytes / 100
    assert found.measured_total_bytes is None and found.predicted_total_bytes <= 2**40
    assert found.predicted_peak_bytes >= found.plan.predicted_peak_bytes
    key = next(iter(found.trunk.plans))
    assert key[0] == (((found.batch_size, 3, 32, 32), torch.float32),)  # the trunk will use this plan at that batch


def test_the_hosts_available_memory_is_read_as_the_kernel_reports_it():
    import os

    from trunksplit.planning.memory import host_bytes_available

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # an independent bound: all the RAM there is
    assert 0 < host_bytes_available() <= physical


def test_a_checked_fit_larger_than_the_host_can_give_on_cpu_is_refused_before_profiling(monkeypatch, capsys):
    """The checking step fills ``memory`` on the host: past what it has, the kernel kills the process, saying nothing."""
    fit_module = importlib.import_module("trunksplit.fit")  # the module: trunksplit.fit is the function

    monkeypatch.setattr(fit_module, "host_bytes_available", lambda: 200 * 2**20)
    monkeypatch.setattr(fit_module, "ScaledChain", None)  # profiling would call it: refused before
    model = torchvision.models.resnet18()
    with pytest.raises(ValueError, match=r"memory 300.0 MiB .* is more than this machine has available \(200.0 MiB .*predict only \(verify=False"):
        fit(model, (3, 32, 32), "300MiB")
    assert main(["fit", "--arch", "resnet18", "--input", "3x32x32", "--memory", "300MiB"]) == 2
    assert "trunksplit fit --no-verify" in capsys.readouterr().err


def test_a_checked_fit_larger_than_a_gpu_can_give_is_refused_naming_the_gpu(monkeypatch):
    """On a GPU the checking step ran out of memory after the profiling, with the allocator's error: refused up front
    as on the host (what the GPU can give is read from the driver in the CUDA tier, tests/cuda; here it is set)."""
    fit_module = importlib.import_module("trunksplit.fit")

    monkeypatch.setattr(fit_module, "gpu_bytes_available", lambda device: 200 * 2**20)
    monkeypatch.setattr(fit_module, "host_bytes_available", lambda: 2**50)  # the host has room: the GPU is what is checked
    with pytest.raises(ValueError, match=r"memory 300.0 MiB .* is more than cuda:1 can give \(free, and held by this process's allocator\) "
                                         r"\(200.0 MiB .*on the GPU would run out of GPU memory.*predict only"):
        fit_module.check_room(300 * 2**20, torch.device("cuda", 1), "memory", "predict only")
    fit_module.check_room(200 * 2**20, torch.device("cuda", 1), "memory", "predict only")  # what it can give: no error


def test_fit_command_can_predict_without_the_checking_step(capsys):
    assert main(["fit", "--arch", "resnet18", "--input", "3x32x32", "--memory", "1TiB", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (budget") and "fits 1024.000 GiB" in out and "measured -" in out


class _Traced(torch.nn.Module):
    """A model no family knows: its chain is traced, and its last block is 'output', not 'flatten'."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x):
        return self.body(x).mean((2, 3))


def test_fit_defaults_to_the_last_block_as_the_trunk_does():
    found = fit(_Traced(), (3, 16, 16), "20MiB", verify=False)
    assert found.trunk.out_feat_keys == ("output",) and found.batch_size >= 1


def test_fit_for_one_of_many_fsdp_ranks_counts_shards_and_predicts_a_larger_batch(capsys):
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    one = fit(copy.deepcopy(model), (3, 64, 64), "300MiB", optimizer="adamw", verify=False)
    many = fit(copy.deepcopy(model), (3, 64, 64), "300MiB", optimizer="adamw", world_size=8)
    # by hand: FSDP2 gives the first rank ceil(rows / 8) rows of each trunk parameter; the classifier (not trained) stays whole
    trunk_params = [p for n, p in model.named_parameters() if not n.startswith("fc.")]
    shards = sum(math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0]) * 4 for p in trunk_params)
    fc = sum(p.numel() * 4 for p in model.fc.parameters())
    assert many.rank.parameters == shards + fc and many.rank.gradients == shards
    assert many.rank.optimizer == 2 * shards + 4 * len(trunk_params)  # AdamW: two moments and a step counter each
    assert one.rank.parameters == sum(p.numel() * 4 for p in model.parameters())
    assert many.measured_total_bytes is None  # a prediction: one process cannot run 8 ranks
    # the step gathers each unit's whole weights: at its backward, its weights and its whole gradients at least
    largest = max(sum(p.numel() * 4 for p in m.parameters()) for m in [*model.layer4, *model.layer3])
    assert many.rank.step_peak >= 2 * largest
    assert many.batch_size > one.batch_size
    assert main(["fit", "--arch", "resnet18", "--input", "3x64x64", "--memory", "300MiB", "--world-size", "8", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "per rank at world size 8" in out and "one of 8 FSDP2 ranks" in out


def test_scaling_compares_plans_per_rank_with_shards_counted_by_hand():
    """``trunksplit.scaling`` (tools/fsdp_scaling.py): per world size, trunksplit's plan fits at
    least the batch of a checkpoint around every unit, with less recompute, and both more than no
    checkpoint; parameters are each rank's ceil(rows / N) rows, AdamW's state twice the gradients' and its step counts."""
    model = _model()
    rows = scaling(model, SHAPE, "300MiB", "adamw", world_sizes=(1, 4))
    trained = [p for p in model.features.parameters()]  # the trunk: everything up to the pooled feature
    head = sum(p.numel() * 4 for p in model.classifier.parameters())
    for n in (1, 4):
        by_plan = {r.plan: r for r in rows if r.world_size == n}
        shards = sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * 4 for p in trained)
        for r in by_plan.values():
            assert r.rank.parameters == shards + head and r.rank.gradients == shards
            assert r.rank.optimizer == 2 * shards + 4 * len(trained)  # exp_avg, exp_avg_sq, and a float32 step per weight
            assert r.rank.total <= parse_memory_size("300MiB")
        ours, every, none = by_plan["trunksplit"], by_plan["every unit"], by_plan["none"]
        assert ours.batch_size >= every.batch_size > none.batch_size > 0
        assert none.recompute == 0 < ours.recompute <= every.recompute
    # one rank: the batch fit() finds and checks with a real step
    assert rows[0].batch_size == fit(copy.deepcopy(model), SHAPE, "300MiB", "adamw", verify=False).batch_size


def test_costs_scaled_to_a_profiled_batch_are_that_batchs_costs(monkeypatch):
    """fit plans any batch from two profiles by lines through them; at a profiled batch the line gives that
    profile back, every field the planner prices included (one dropped: gloo's copy of a reduce-scatter's
    input, which fit's per-rank predictions lost)."""
    from trunksplit import CheckpointedTrunk
    from trunksplit.planning import sharding
    from trunksplit.planning.scaled import PROFILE_BATCHES, ScaledChain, scaled_costs

    monkeypatch.setattr(sharding, "reduce_scatter_copies", lambda: 1)  # as under a gloo process group
    chain = ScaledChain(CheckpointedTrunk(torchvision.models.resnet18(num_classes=10), num_splits=3, strategy="balanced").plan_request(), (3, 32, 32), torch.device("cpu")).sharded(2)
    assert chain.small[0].reduce_scatter_copies == 1
    for batch, costs in zip(PROFILE_BATCHES, chain.small):
        assert scaled_costs(chain.small, batch) == costs
