"""The optimizer stepped in backward: the parameters of a standard step, gradients never all alive,
and the trunk's plans for it met as measured."""
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import LARS, BudgetTooLowError, CheckpointedTrunk, PeakMemory, apply_activation_checkpointing, fit, optimizer_in_backward
from trunksplit.cli import main
from trunksplit.in_backward import update_temporaries
from trunksplit.planning.search import annotate, peak_model

from reference import build, loss_of, plain_features, second_step_peak

X = torch.randn(2, 3, 64, 64)

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
    "adamw_loop": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.05, foreach=False)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.05, foreach=True)),
    "lars": (LARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-6)),
}


def _groups(model, name):
    """Two groups, as the recipes make them: weights decayed (and LARS-scaled), biases and norms not."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0, **({"lars": False} if name == "lars" else {})}
    return [{"params": [p for n, p in named if p.dim() > 1]}, flat]


def _train(model, optimizer, steps=3):
    """``steps`` steps with a learning rate and weight decay set on the groups each step, as the launcher's schedules do."""
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 / (step + 1) if group["lr"] > 0.01 else 1e-3 / (step + 1)
            if group["weight_decay"]:
                group["weight_decay"] *= 1.5
        loss_of(model(X), seed=step).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpointed_trunk_stepped_in_backward_trains_the_plain_models_weights_bit_for_bit(name):
    optimizer_class, kwargs = OPTIMIZERS[name]
    plain = build("resnet18")
    standard = optimizer_class(_groups(plain, name), **kwargs)
    _train(lambda x: plain_features(plain, x, ["flatten"]), standard)
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=3, gradients="in_backward")
    stepping = optimizer_in_backward(_groups(trunk, name), optimizer_class, **kwargs)
    _train(trunk, stepping)
    trained = dict(trunk.model_state_dict())
    for key, value in plain.state_dict().items():
        if key in trained:
            assert torch.equal(trained[key], value), key
    assert all(p.grad is None for p in trunk.parameters())  # every gradient freed at its update


def test_the_state_dict_loads_into_the_standard_optimizer_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    stepping = optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2, foreach=False)
    standard = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(5, 8)
    for _ in range(2):
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
        standard.step()
        standard.zero_grad()
    saved = stepping.state_dict()
    assert saved["state"].keys() == standard.state_dict()["state"].keys()
    # carried across both ways: the in-backward state into a standard optimizer, the standard one into an in-backward one
    again, again_twin = copy.deepcopy(model), copy.deepcopy(twin)
    into_standard = torch.optim.AdamW(again.parameters(), lr=1e-2, foreach=False)
    into_standard.load_state_dict(saved)
    into_backward = optimizer_in_backward(again_twin, torch.optim.AdamW, lr=1e-2, foreach=False)
    into_backward.load_state_dict(standard.state_dict())
    again(x).square().sum().backward()
    into_standard.step()
    again_twin(x).square().sum().backward()
    for a, b in zip(again.parameters(), again_twin.parameters()):
        assert torch.equal(a, b)


def test_step_and_zero_grad_are_harmless_a_closure_is_refused_and_remove_stops_the_updates():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    stepping = optimizer_in_backward(model, torch.optim.SGD, lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    updated = [p.detach().clone() for p in model.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, updated)) and model.weight.grad is None
    stepping.step()
    stepping.zero_grad()
    assert all(torch.equal(a, p) for a, p in zip(updated, model.parameters()))
    with pytest.raises(ValueError, match="takes no closure"):
        stepping.step(lambda: model(torch.ones(2, 4)).sum())
    assert all(torch.equal(a, p) for a, p in zip(updated, model.parameters()))
    stepping.remove()
    model(torch.ones(2, 4)).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(updated, model.parameters()))
    assert torch.equal(model.bias.grad, torch.full((3,), 2.0))  # the gradient stays: no update ran


def test_a_model_and_its_optimizer_stepped_in_backward_are_freed_once_the_loop_drops_them():
    """As a model and its standard optimizer are. Until 2026-11-28 each parameter's hook held the
    stand-in, which holds the parameter through its optimizer: autograd keeps hooks where Python's
    garbage collector cannot see them, and every model and optimizer ever stepped in backward stayed
    alive (a zoo sweep in that mode grew by a model's weights and state per model)."""
    def train_and_drop():
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=2, gradients="in_backward")
        stand_in = optimizer_in_backward(trunk, torch.optim.SGD, lr=0.1, momentum=0.9)
        loss_of(trunk(X)).backward()
        return [weakref.ref(o) for o in (trunk, stand_in, stand_in.optimizer, next(trunk.parameters()))]

    refs = train_and_drop()
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_the_updates_go_on_while_the_model_lives_though_the_loop_keeps_no_stand_in():
    """A loop that calls ``optimizer_in_backward`` for its effect alone (torch's own in-backward helper
    returns nothing) still trains: the parameters hold their stand-in."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    optimizer_in_backward(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    gc.collect()
    _linear_steps(model)
    _linear_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def test_a_whole_model_saved_while_stepped_in_backward_loads_as_a_plain_model(tmp_path):
    """``torch.save(model)`` pickles the model whole; the stand-in stays behind, as its hooks do (the
    file once loaded into a half-made stand-in and failed). The loaded model's backward updates
    nothing, and a new optimizer steps it in backward without taking it over from anyone."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    reference = copy.deepcopy(loaded)
    _linear_steps(loaded)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), loaded.parameters()))
    loaded.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no earlier stand-in's hooks to remove
        optimizer_in_backward(loaded, torch.optim.SGD, lr=0.1)
    _linear_steps(loaded)
    _linear_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), loaded.parameters()))


def test_the_stand_in_itself_is_refused_by_pickle_and_copy_saying_what_to_save(tmp_path):
    """Pickled as a torch optimizer (its state dict's fields) it wrote a file that failed to load: a stand-in
    with no optimizer and no hooks."""
    model = nn.Linear(4, 3)
    stand_in = optimizer_in_backward(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    _linear_steps(model, stand_in)
    for save in (lambda: torch.save(stand_in, tmp_path / "stand_in.pt"), lambda: copy.deepcopy(stand_in)):
        with pytest.raises(TypeError, match=r"save stand_in.state_dict\(\)"):
            save()
    standard = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    standard.load_state_dict(stand_in.state_dict())  # what to save instead: the standard optimizer's format
    assert torch.equal(standard.state[model.weight]["momentum_buffer"], stand_in.state[model.weight]["momentum_buffer"])


def test_a_trunk_planned_for_another_gradient_mode_is_refused_and_left_alone():
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=2)
    with pytest.raises(ValueError, match=r"gradients='allocated'.*gradients=\"in_backward\""):
        optimizer_in_backward(trunk, torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in trunk.parameters()]
    loss_of(trunk(X)).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, trunk.parameters()))  # no hook was left behind
    assert all(p.grad is not None for p in trunk.parameters())


def test_update_temporaries_count_what_the_update_allocates():
    # by the optimizers' arithmetic: SGD's momentum updates in place; weight decay makes grad + wd * p
    # (one tensor); AdamW's for-loop form makes sqrt(v) and sqrt(v) / c at once (two), its foreach form
    # one list of sqrt(v), divided in place
    assert update_temporaries(torch.optim.SGD, dict(lr=0.1, momentum=0.9)) == 0
    assert update_temporaries(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)) == 1
    assert update_temporaries(torch.optim.AdamW, dict(lr=1e-3, foreach=False)) == 2
    assert update_temporaries(torch.optim.AdamW, dict(lr=1e-3, foreach=True)) == 1
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.5, gradients="in_backward")
    optimizer_in_backward(trunk, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert trunk.update_temporaries == 1 and trunk.plan_request().update_temporaries == 1
    with pytest.raises(ValueError, match="update_temporaries is a number >= 0"):
        trunk.update_temporaries = -1
    assert trunk.update_temporaries == 1


@pytest.mark.parametrize("name", [pytest.param("sgd", marks=pytest.mark.slow), "adamw_loop"])  # sgd: one temporary per update where adamw_loop has two
@pytest.mark.parametrize("arch", ["resnet18", pytest.param("regnet_x_400mf", marks=pytest.mark.slow)])
def test_predicted_peaks_are_within_5_percent_of_the_measured_step_and_budgets_are_met(arch, name):
    optimizer_class, kwargs = OPTIMIZERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for how in [dict(num_splits=1), dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.6), dict(memory_budget=0.4)]:
            trunk = CheckpointedTrunk(build(arch), ["flatten"], gradients="in_backward", **how)
            optimizer_in_backward(trunk, optimizer_class, **kwargs)
            model = peak_model(trunk.plan_request(), X, regions="memory_budget" in how)
            try:
                predicted = annotate(trunk.plan_for(X), model).predicted_peak_bytes
            except ValueError as e:  # a budget below the floor: said so, with the floor
                assert "smallest feasible budget" in str(e)
                continue
            measured = second_step_peak(trunk, X)
            assert abs(predicted / measured - 1) <= 0.05, (how, predicted, measured)
            if "memory_budget" in how:
                assert measured <= how["memory_budget"] * model.peak([0]) * 1.02, (how, measured)


def test_stepping_in_backward_lowers_the_step_below_the_default_modes_floor():
    """A larger input, where activations and gradients both count: the in-backward floor sits below
    the default mode's, by about the gradients it never holds at once."""
    x = torch.randn(2, 3, 128, 128)
    floors = {}
    for gradients in ("allocated", "in_backward"):
        trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.01, gradients=gradients)
        if gradients == "in_backward":
            optimizer_in_backward(trunk, torch.optim.SGD, lr=0.1, momentum=0.9)
        with pytest.raises(BudgetTooLowError, match=r"smallest feasible budget is [\d.]+ MiB \((\d+) bytes\)") as info:
            trunk.plan_for(x)
        floors[gradients] = info.value.smallest_bytes
    gradient_bytes = sum(p.numel() * p.element_size() for p in trunk.parameters())
    assert floors["allocated"] - floors["in_backward"] >= 0.5 * gradient_bytes, floors


@pytest.mark.slow  # AdamW's update planned by default; the SGD case below checks the budget met as measured in the fast suite
def test_a_budget_wrapped_model_stepped_in_backward_meets_its_budget_as_measured():
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(4, 3, 128, 128)
    plan = apply_activation_checkpointing(model, memory_budget=0.85, example_inputs=(x,), gradients="in_backward")
    optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3, foreach=False)
    for _ in range(2):
        with PeakMemory() as mem:
            model(x).sum().backward()
    assert mem.peak_bytes <= plan.peak_bytes * 1.02 and plan.peak_bytes <= 0.85 * plan.unwrapped_peak_bytes
    assert all(p.grad is None for p in model.parameters())



def test_a_budget_wrapped_model_plans_for_its_optimizers_update_and_an_already_stepped_one_is_refused():
    """SGD's update allocates nothing: wrapped for it (``update_temporaries``), the plan's measured peak is the
    real step's within 2%, where the default (AdamW's two tensors per update) plans a step that much higher. A
    model whose parameters an optimizer already steps in backward is refused: measuring would train it."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(4, 3, 128, 128)
    sgd = update_temporaries(torch.optim.SGD, dict(lr=0.1))
    assert sgd == 0
    plan = apply_activation_checkpointing(model, memory_budget=0.85, example_inputs=(x,), gradients="in_backward", update_temporaries=sgd)
    optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    for _ in range(2):
        with PeakMemory() as mem:
            model(x).sum().backward()
    assert abs(mem.peak_bytes / plan.peak_bytes - 1) <= 0.02, (mem.peak_bytes, plan.peak_bytes)
    assert plan.peak_bytes <= 0.85 * plan.unwrapped_peak_bytes and all(p.grad is None for p in model.parameters())  # met; each gradient freed
    stepped = torchvision.models.resnet18()
    optimizer_in_backward(stepped, torch.optim.SGD, lr=0.1)
    before = copy.deepcopy(stepped.state_dict())
    with pytest.raises(ValueError, match="stepped in backward by optimizer_in_backward.*Wrap first.*nothing was changed"):
        apply_activation_checkpointing(stepped, memory_budget=0.85, example_inputs=(x,), gradients="in_backward")
    assert all(torch.equal(v, stepped.state_dict()[k]) for k, v in before.items())


def test_a_call_whose_updates_are_held_is_planned_for_the_gradients_it_keeps_and_meets_its_budget():
    """Inside ``accumulating()`` (an earlier crop group of a multi-crop step, gradient accumulation) a
    backward keeps every gradient, as torch's default mode does: the call is planned as that mode's
    step, apart from the updating calls, and meets its budget as measured. Before, it ran the plan made
    for freeing each gradient: ResNet-50 at 16 x 96 px, budget 0.5, predicted 127 MiB and measured 196."""
    x = torch.randn(8, 3, 96, 96)
    trunk = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.92, gradients="in_backward")
    stand_in = optimizer_in_backward(trunk, torch.optim.SGD, lr=0.1, momentum=0.9)
    loss_of(trunk(x)).backward()  # an updating call: planned, and the momentum made
    with stand_in.accumulating():
        held = trunk.plan_for(x)
        with PeakMemory() as mem:
            loss_of(trunk(x)).backward()
    assert all(p.grad is not None for p in trunk.parameters()) and len(trunk.plans) == 2  # kept; planned apart
    # the reference: the same step in torch's default mode, every gradient allocated and kept
    unsplit = second_step_peak(CheckpointedTrunk(build("resnet18"), ["flatten"]), x)
    default_mode = second_step_peak(CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.92), x)
    assert mem.peak_bytes <= 0.92 * unsplit and abs(mem.peak_bytes / default_mode - 1) <= 0.01, (mem.peak_bytes, default_mode, unsplit)
    assert abs(held.predicted_peak_bytes / mem.peak_bytes - 1) <= 0.02, (held.predicted_peak_bytes, mem.peak_bytes)
    # a budget only the updating call meets: the held call is refused, saying why, and nothing runs
    tight = CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.6, gradients="in_backward")
    stand_in = optimizer_in_backward(tight, torch.optim.SGD, lr=0.1, momentum=0.9)
    with stand_in.accumulating(), pytest.raises(BudgetTooLowError, match=r"updates in backward are held .* keeps every gradient") as info:
        tight(x)
    assert info.value.held and not tight.plans and all(p.grad is None for p in tight.parameters())
    CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.6, gradients="in_backward").plan_for(x)  # the updating call meets it: no error


def test_a_trunk_handed_over_as_its_parameters_plans_for_its_optimizers_update():
    """``optimizer_in_backward(trunk.parameters(), ...)`` tells the trunk what an update allocates, as
    handing over the trunk itself does: the same request, the same plan."""
    x = torch.randn(2, 3, 64, 64)
    trunks = [CheckpointedTrunk(build("resnet18"), ["flatten"], memory_budget=0.8, gradients="in_backward") for _ in range(2)]
    optimizer_in_backward(trunks[0], torch.optim.SGD, lr=0.1)
    optimizer_in_backward(trunks[1].parameters(), torch.optim.SGD, lr=0.1)
    assert trunks[0].plan_request().update_temporaries == trunks[1].plan_request().update_temporaries == 0
    assert trunks[0].plan_for(x) == trunks[1].plan_for(x)

def test_fit_in_backward_fits_at_least_the_default_batch_and_needs_an_optimizer():
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    default = fit(model, (3, 64, 64), "300MiB", optimizer="adamw", verify=False)
    stepped = fit(model, (3, 64, 64), "300MiB", optimizer="adamw", gradients="in_backward")
    assert stepped.batch_size > default.batch_size and stepped.measured_total_bytes <= 300 * 2**20
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="name it"):
        fit(model, (3, 64, 64), "300MiB", optimizer=None, gradients="in_backward")


def test_plan_command_plans_in_backward_for_the_named_optimizer(capsys):
    assert main(["plan", "--arch", "resnet18", "--input", "2x3x64x64", "--gradients", "in_backward", "--optimizer", "none"]) == 2
    assert "name it with --optimizer" in capsys.readouterr().err
    assert main(["plan", "--arch", "resnet18", "--input", "2x3x128x128", "--budget", "0.7", "--gradients", "in_backward", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "each freed at its update in backward" in out and "budget" in out


def test_a_learning_rate_set_after_the_optimizer_behind_it_loads_a_state_reaches_the_updates():
    """torch.distributed.checkpoint loads into the optimizer behind the stand-in, which replaces its
    group dicts: the learning rate a schedule sets afterwards is the one the updates use."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    stepping = optimizer_in_backward(model, torch.optim.SGD, lr=0.5)
    stepping.optimizer.load_state_dict(stepping.state_dict())
    for group in stepping.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _linear_steps(model, optimizer=None):
    """Two steps of a small regression, as a loop with ``optimizer`` (a standard one or a stand-in) runs
    them; None: backward alone."""
    for x in (torch.ones(2, 4), torch.full((2, 4), 0.5)):
        model(x).pow(2).sum().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()


def test_a_second_optimizer_stepped_in_backward_takes_the_parameters_over_from_the_first():
    """A new training phase builds a new optimizer: the old one's hooks go (with a warning), the new
    one alone updates, as a standard loop that replaced its optimizer would."""
    torch.manual_seed(0)
    model, reference = nn.Linear(4, 3), None
    reference = copy.deepcopy(model)
    first = optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    plain_first = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(torch.ones(1, 4)).sum().backward()
    plain_first.step()
    plain_first.zero_grad()
    with pytest.warns(UserWarning, match="hooks are removed"):
        second = optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    _linear_steps(model, second)
    _linear_steps(reference, torch.optim.AdamW(reference.parameters(), lr=0.01))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert second.state_dict()["state"] and not first.state_dict()["state"]


def test_frozen_parameters_are_left_to_themselves_as_a_standard_optimizer_leaves_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    stand_in = optimizer_in_backward(list(model.parameters()), torch.optim.SGD, lr=0.1, momentum=0.9)  # torch's optimizers take frozen ones
    _linear_steps(model, stand_in)
    _linear_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


def test_an_optimizer_that_needs_a_closure_or_is_not_one_is_refused_before_anything_changes():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="LBFGS steps with a closure"):
        optimizer_in_backward(model, torch.optim.LBFGS, lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer_class is what builds the optimizer .*got 'SGD'"):
        optimizer_in_backward(model, "SGD", lr=0.1)  # the name, not the class
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):  # torch's own words, nothing taken over yet
        optimizer_in_backward(model, torch.optim.SGD, lrr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    assert model.weight.grad is not None and not model.weight._backward_hooks  # no hook was left: the gradient stays


def test_muon_steps_a_trunks_matrices_in_backward():
    """Muon takes only 2-D parameters; what the trunk is told an update allocates is measured on a
    matrix, so a trunk whose matrices Muon steps plans and trains as Muon's standard step does."""
    from collections import OrderedDict

    torch.manual_seed(0)
    blocks = OrderedDict((f"fc{i}", nn.Sequential(nn.Linear(16, 16), nn.GELU())) for i in range(4))
    reference = copy.deepcopy(nn.Sequential(*blocks.values()))
    trunk = CheckpointedTrunk(blocks, num_splits=2, gradients="in_backward")
    stand_in = optimizer_in_backward(trunk, torch.optim.Muon, param_groups=[{"params": [p for p in trunk.parameters() if p.dim() == 2]}], lr=0.02)
    muon = torch.optim.Muon([p for p in reference.parameters() if p.dim() == 2], lr=0.02)
    x = torch.randn(8, 16)
    for model, optimizer in ((trunk, stand_in), (reference, muon)):
        out = model(x)
        (out[-1] if isinstance(out, list) else out).pow(2).sum().backward()
        optimizer.step()
    assert trunk.update_temporaries >= 0 and stand_in.state_dict()["state"]
    for a, b in zip(reference.parameters(), trunk.parameters()):
        assert torch.equal(a, b)


def test_reentrant_checkpointing_cannot_step_in_backward_and_says_what_to_use():
    """Reentrant segments run their own backwards: a trunk called at two resolutions gets each
    gradient in two parts, and an optimizer in backward would step twice (2e3 off after two SGD steps)."""
    with pytest.raises(ValueError, match="use use_reentrant=False"):
        CheckpointedTrunk(build("resnet18"), ["flatten"], num_splits=2, use_reentrant=True, gradients="in_backward")


SCHEDULERS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e),
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2), torch.optim.lr_scheduler.CosineAnnealingLR(o, 8)], milestones=[2]),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torchs_learning_rate_schedulers_drive_the_stand_in_as_they_drive_the_optimizer(name):
    """The scheduler given the stand-in: the learning rates and the weights of the same schedule on
    the standard optimizer, bit for bit (torch's schedulers accept only a torch.optim.Optimizer)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    stand_in = optimizer_in_backward(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    schedules = [SCHEDULERS[name](o) for o in (stand_in, optimizer)]
    for step in range(4):
        x = torch.full((2, 4), 1.0 / (step + 1))
        for m, o, schedule in ((model, stand_in, schedules[0]), (reference, optimizer, schedules[1])):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
            schedule.step()
        assert schedules[0].get_last_lr() == schedules[1].get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


class _GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients divided by their norm over the whole group, as Lamb's and Adan's clipping read every parameter at once."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in group["params"] if p.grad is not None))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


class _GroupCounterSGD(torch.optim.Optimizer):
    """SGD whose step size falls with a counter kept per group, not per parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["count"])


@pytest.mark.parametrize("optimizer_class", [_GlobalNormSGD, _GroupCounterSGD])
def test_an_optimizer_that_steps_parameters_together_is_named_in_a_warning(optimizer_class):
    """Stepped one parameter at a time it is not its standard step (the weights after two steps differ,
    as the test shows); torch's built-in optimizers step each parameter alone and pass silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=f"{optimizer_class.__name__} does not step each parameter on its own"):
        stand_in = optimizer_in_backward(model, optimizer_class, lr=0.1)
    _linear_steps(model, stand_in)
    _linear_steps(reference, optimizer_class(reference.parameters(), lr=0.1))
    assert not all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))  # the warning was right
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for builtin in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adagrad, LARS):
            optimizer_in_backward(copy.deepcopy(reference), builtin, lr=0.1)
