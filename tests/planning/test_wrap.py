"""apply_activation_checkpointing with a memory budget: any nn.Module, traceable or not, wrapped in place."""
import copy
import gc
import weakref
from dataclasses import dataclass

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import BudgetTooLowError, CheckpointedTrunk, PeakMemory, WrapPlan, apply_activation_checkpointing, is_checkpoint_wrapped
from trunksplit.planning.budget import format_bytes
import trunksplit.planning.wrap as wrap_module
from trunksplit.planning.wrap import _cheapest_fit
from trunksplit.planning.wrap_blocks import measure_blocks

from reference import ForwardConvolutions


@dataclass
class Output:
    features: torch.Tensor
    logits: torch.Tensor


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.GELU(),
                                  nn.Conv2d(2 * width, width, 3, padding=1), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.body(x)


class Untraceable(nn.Module):
    """What torch.fx refuses: a branch on a tensor's value, a **kwargs forward, a dataclass output."""

    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x, **kwargs):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
            if x.mean() > 10:  # data-dependent: fx cannot follow it
                x = x / 2
        features = x.mean((2, 3))
        return Output(features, self.head(features) * kwargs.get("scale", 1.0))


def _second_step_peak(model, x):
    """An independent measurement: the second training step's peak, gradients kept (zeroed, not freed)."""
    def step():
        out = model(x)
        (out.features.sum() + out.logits.sum()).backward()
    torch.manual_seed(5)
    step()
    for p in model.parameters():
        p.grad.zero_()
    with PeakMemory() as mem:
        step()
    return mem.peak_bytes


def test_untraceable_model_is_refused_by_the_trunk_with_a_pointer_to_the_budget_api():
    with pytest.raises(TypeError, match=r"torch.fx said.*apply_activation_checkpointing\(model, memory_budget="):
        CheckpointedTrunk(Untraceable(), num_splits=2)


@pytest.mark.parametrize("budget", [0.6, 0.4])
def test_a_budget_is_met_as_measured_and_training_is_exact(budget):
    torch.manual_seed(0)
    plain = Untraceable()
    model = copy.deepcopy(plain)
    x = torch.randn(4, 3, 32, 32)
    unwrapped = _second_step_peak(copy.deepcopy(plain), x)
    keys = list(model.state_dict())
    plan = apply_activation_checkpointing(model, memory_budget=budget, example_inputs=(x,), gradients="kept")
    assert isinstance(plan, WrapPlan) and plan.names and len(plan.policies) == len(plan.names) and set(plan.policies) <= {"recompute", "save_expensive"}
    assert all(is_checkpoint_wrapped(model.get_submodule(n)) for n in plan.names)
    assert list(model.state_dict()) == keys  # the model's own state_dict, unchanged
    measured = _second_step_peak(copy.deepcopy(model), x)  # a copy: the model itself must stay as the plain one
    assert measured <= budget * unwrapped * 1.03, (measured / unwrapped, plan)
    assert abs(plan.peak_bytes - measured) <= 0.03 * measured  # what the plan reports is what a step measures
    # exact: the wrapped model trains as the plain one (dropout included: the checkpoint restores the RNG)
    for m in (plain, model):
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(7)
        out = m(x, scale=2.0)
        (out.features.pow(2).sum() + out.logits.sum()).backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), model.buffers()):
        assert torch.equal(a, b), name


def test_a_model_wrapped_for_a_budget_is_freed_once_the_loop_drops_it():
    """Planning runs one forward that never runs backward (which blocks save what): until 2026-11-28
    its ReLUs' saved outputs held their own graph through autograd's C++ side, and the parameters
    and activations of every model wrapped for a budget outlived it."""
    def wrap_and_drop():
        model = torchvision.models.resnet18()
        apply_activation_checkpointing(model, memory_budget=0.95, example_inputs=(torch.randn(2, 3, 64, 64),), gradients="kept")
        return [weakref.ref(p) for p in model.parameters()]

    refs = wrap_and_drop()
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_budget_that_kept_convolutions_meet_reruns_no_convolution():
    torch.manual_seed(0)
    plain = Untraceable()
    model = copy.deepcopy(plain)
    x = torch.randn(4, 3, 32, 32)
    unwrapped = _second_step_peak(copy.deepcopy(plain), x)
    plan = apply_activation_checkpointing(model, memory_budget=0.8, example_inputs=(x,), gradients="kept")
    assert "save_expensive" in plan.policies and plan.recompute_flops == 0, plan
    assert _second_step_peak(copy.deepcopy(model), x) <= 0.8 * unwrapped * 1.03
    out = model(x)
    with ForwardConvolutions() as convs:  # an independent count: the backward runs no forward convolution again
        (out.features.sum() + out.logits.sum()).backward()
    assert convs.count == 0


class InPlaceAfterConv(nn.Module):
    """MobileNetV3's pattern: an activation that overwrites its convolution's output."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Hardswish(inplace=True)) for _ in range(depth)))

    def forward(self, x):
        return self.blocks(self.stem(x)).mean((2, 3))


def test_a_block_that_overwrites_a_convolutions_output_is_never_wrapped_keeping_it():
    # torch's selective checkpoint keeps the convolution's output and refuses, in backward, one that was
    # overwritten since: such a block may only be recomputed whole
    torch.manual_seed(0)
    plain = InPlaceAfterConv()
    model = copy.deepcopy(plain)
    x = torch.randn(2, 3, 32, 32)
    plan = apply_activation_checkpointing(model, memory_budget=0.8, example_inputs=(x,), gradients="kept")
    assert plan.names and "save_expensive" not in plan.policies, plan
    for m in (plain, model):
        m(x).pow(2).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_an_impossible_budget_names_the_smallest_feasible_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = Untraceable()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(BudgetTooLowError, match=r"smallest feasible budget found is [\d.]+ MiB \(\d+ bytes\) \(0\.\d+ of unwrapped\)") as info:
        apply_activation_checkpointing(model, memory_budget=0.01, example_inputs=torch.randn(4, 3, 32, 32), gradients="kept")
    assert f"found is {format_bytes(info.value.smallest_bytes)}" in str(info.value) and f"unwrapped {format_bytes(info.value.unsplit_bytes)}" in str(info.value)
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # measuring trained nothing
    assert all(p.grad is None for p in model.parameters())


def test_a_budget_below_the_gradients_the_step_allocates_is_refused_before_any_block_is_measured(monkeypatch):
    """torch's default zero_grad() leaves the gradients to the step, and no checkpoint frees them: a budget
    under their bytes is refused after one measured step, naming them and what would help, the model unchanged."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = []
    monkeypatch.setattr(wrap_module, "measure_blocks", lambda *a, **k: measured.append(a) or measure_blocks(*a, **k))
    with pytest.raises(BudgetTooLowError, match=r"gradients, which this step allocates .* are 44\.6 MiB .* no checkpoint frees them.*nothing was changed") as info:
        apply_activation_checkpointing(model, memory_budget=grads - 1, example_inputs=torch.randn(2, 3, 32, 32))
    assert info.value.smallest_bytes is None and info.value.unsplit_bytes > grads  # no floor searched for: refused before
    assert measured == []  # known from the one step: no block was measured
    assert not any(is_checkpoint_wrapped(m) for m in model.modules()) and all(p.grad is None for p in model.parameters())


class DenseOutput(nn.Module):
    """A dense prediction (a map per pixel), trained with a loss that saves its output."""

    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.out = nn.Conv2d(width, 16, 1)

    def forward(self, x):
        return self.out(self.blocks(self.stem(x)))


def _squared_error(out):
    return out.pow(2).mean()  # saves `out`; its backward makes gradients of out's size


def _peak_with_loss(model, x, loss_fn):
    """The second training step's peak with the user's loss, gradients kept: measured here, independently."""
    model = copy.deepcopy(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with PeakMemory() as mem:
            loss_fn(model(x)).backward()
    return mem.peak_bytes


def test_a_budget_is_met_as_the_users_loss_measures_it_when_given():
    torch.manual_seed(0)
    plain, x = DenseOutput().train(), torch.randn(4, 3, 32, 32)
    budget = int(0.7 * _peak_with_loss(plain, x, _squared_error))  # bytes: the same budget for both searches
    summed = copy.deepcopy(plain)
    apply_activation_checkpointing(summed, memory_budget=budget, example_inputs=(x,), gradients="kept")
    assert _peak_with_loss(summed, x, _squared_error) > budget  # searched with the sum of the output, it misses
    model = copy.deepcopy(plain)
    plan = apply_activation_checkpointing(model, memory_budget=budget, example_inputs=(x,), gradients="kept", loss_fn=_squared_error)
    measured = _peak_with_loss(model, x, _squared_error)
    assert measured <= budget and plan.peak_bytes == measured, (measured / budget, plan)
    for m in (plain, model):  # still exact (dropout's draws included)
        torch.manual_seed(7)
        _squared_error(m(x)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_a_loss_that_is_no_training_loss_is_refused_and_nothing_is_changed():
    torch.manual_seed(0)
    model = DenseOutput()
    before = copy.deepcopy(model.state_dict())
    for loss_fn, said in ((lambda out: out.pow(2), r"shape \(2, 16, 8, 8\)"), (lambda out: out.detach().sum(), "requires no grad"),
                          (lambda out: 1.0, "float")):
        with pytest.raises(ValueError, match=f"loss_fn must return a one-element tensor that requires grad, got .*{said}"):
            apply_activation_checkpointing(model, memory_budget=0.5, example_inputs=torch.randn(2, 3, 8, 8), loss_fn=loss_fn)
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and all(p.grad is None for p in model.parameters())


def test_bytes_a_lone_tensor_and_a_condition_are_taken():
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 64, 64)
    plan = apply_activation_checkpointing(model, lambda name, m: name.startswith("layer1."), memory_budget=10**12, example_inputs=x)
    assert plan.names == ()  # the budget is above the unwrapped step: nothing needs wrapping
    with pytest.raises(ValueError, match="smallest feasible"):
        apply_activation_checkpointing(model, lambda name, m: name.startswith("layer1."), memory_budget=0.2, example_inputs=x, gradients="kept")


def test_bad_arguments_are_clear_errors():
    model = Untraceable()
    with pytest.raises(ValueError, match="example_inputs"):
        apply_activation_checkpointing(model, memory_budget=0.5)
    with pytest.raises(ValueError, match=r"fraction.*\(0, 1\]"):
        apply_activation_checkpointing(model, memory_budget=1.5, example_inputs=torch.randn(2, 3, 16, 16))
    with pytest.raises(TypeError, match="needs a condition"):
        apply_activation_checkpointing(model)
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())


def test_a_model_already_wrapped_is_named_and_left_as_it_was():
    """Budget wrapping plans from the unwrapped step: on a model it already wrapped it would call the
    wrapped peak "unwrapped" and name 1.000 as the smallest feasible budget. It says so instead."""
    torch.manual_seed(0)
    model = Untraceable()
    x = torch.randn(2, 3, 32, 32)
    first = apply_activation_checkpointing(model, memory_budget=0.8, example_inputs=x, gradients="kept")
    assert first.names
    wrapped = [n for n, m in model.named_modules() if is_checkpoint_wrapped(m)]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=rf"already wrapped \({len(wrapped)} checkpointed blocks: {wrapped[0]}.*nothing was changed"):
        apply_activation_checkpointing(model, memory_budget=0.5, example_inputs=x, gradients="kept")
    assert [n for n, m in model.named_modules() if is_checkpoint_wrapped(m)] == wrapped
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _FreedScores(nn.Module):
    """An expensive op whose output nothing saves (it is summed, then freed), then a cheap op of the
    same size whose output is saved: the allocator tends to hand it the freed address."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        total = (x @ self.w).sum()
        gate = torch.sigmoid(x)  # saves its output for backward
        return gate * total


def test_a_cheap_output_at_a_freed_expensive_outputs_address_is_not_taken_for_expensive():
    """What "save_expensive" would keep is told apart by storage; a storage freed mid-forward must
    not lend its identity to a later one (planning the same model twice then gave two ladders)."""
    x = torch.randn(32, 64, requires_grad=True)
    model = nn.Sequential(_FreedScores())
    for _ in range(3):  # the address is reused on some calls and not others: each must read the same
        (block,) = [b for b in measure_blocks(model, (x,), None)[0] if b.name == "0"]
        assert block.expensive_out == 32 * 64 * 4  # the matmul's output
        assert block.saved_expensive == 0  # none of it is saved: the sigmoid's output is cheap
        assert block.saved == 2 * 32 * 64 * 4 + 4  # x (the matmul saves it), the sigmoid's output, the sum


def test_the_lowest_rung_is_found_where_it_sits_between_the_probes():
    """Peaks measured along a ladder are not monotone (a ViT's: its last layer rebuilt in parts
    peaks lower than whole, one rung before the end). A budget only that rung meets is met."""
    peaks = {k: 100 - 3 * k for k in range(20)}  # falls as rungs free more ...
    peaks[19] = peaks[18] + 5  # ... but the last rung, a probe, measures above the one before it
    peak_with = peaks.__getitem__
    assert _cheapest_fit(peak_with, 20, peaks[18]) == 18  # met by rung 18 alone
    assert _cheapest_fit(peak_with, 20, peaks[18] - 1) is None  # below every rung: refused
    assert _cheapest_fit(peak_with, 20, peaks[10]) == 10  # the first rung that fits, as before
