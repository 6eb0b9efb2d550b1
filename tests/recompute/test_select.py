"""apply_activation_checkpointing and its conditions."""
import copy
import re

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.resnet import Bottleneck

from trunksplit import CheckpointedTrunk, apply_activation_checkpointing, by_name, by_type, condition_from_config, every_k, is_checkpoint_wrapped, is_recomputing

from reference import loss_of


def _bottleneck_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, Bottleneck)]


def test_every_second_bottleneck_of_resnet50_counted_afresh_each_call():
    names = _bottleneck_names(torchvision.models.resnet50())
    assert len(names) == 16
    condition = every_k(2, Bottleneck)
    first = apply_activation_checkpointing(torchvision.models.resnet50(), condition)
    second = apply_activation_checkpointing(torchvision.models.resnet50(), condition)
    assert first == second == names[0::2]


@pytest.mark.parametrize("condition", [by_type(Bottleneck), every_k(3, Bottleneck), by_name(r"layer[24]\.\d+")])
def test_training_step_after_wrapping_gives_the_plain_gradients(condition):
    torch.manual_seed(0)
    plain = torchvision.models.resnet50(num_classes=10)
    model = copy.deepcopy(plain)
    wrapped = apply_activation_checkpointing(model, condition)
    assert wrapped and all(is_checkpoint_wrapped(model.get_submodule(n)) for n in wrapped)
    x = torch.randn(2, 3, 64, 64)
    loss_of([plain(x)]).backward()
    loss_of([model(x)]).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), n


class Stack(nn.Module):
    """Blocks in a ModuleList (never called itself), traced by fx into units whose paths to the
    blocks' layers are bare modules (never called either)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("traced", [False, True])
def test_containers_never_called_are_neither_selected_nor_counted(traced):
    """Every selected module is called in the step (its checkpoint then reruns its forward): a
    ModuleList, or the bare modules along a traced unit's paths, were selected and counted before,
    and wrapping them did nothing (a launcher run with SELECT every_k on a timm trunk measured as
    the plain step)."""
    torch.manual_seed(0)
    model = CheckpointedTrunk(Stack()) if traced else Stack()
    plain = copy.deepcopy(model)
    names = apply_activation_checkpointing(model, every_k(2))
    calls = {n: [] for n in names}
    for n in names:
        model.get_submodule(n).register_forward_pre_hook(lambda m, args, n=n: calls[n].append(is_recomputing()))
    x = torch.randn(4, 8)
    for m in (plain, model):
        out = m(x)
        loss_of(out if traced else [out]).backward()  # a trunk returns its features as a list
    assert names and all(calls[n] == [False] for n in names), calls
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_a_traced_trunks_block_class_is_refused_naming_its_units_and_its_units_select_by_name():
    """A traced trunk runs its model's blocks as units (fx traced through their classes): selecting the
    block class finds nothing, and the refusal says what to select instead, which works."""
    trunk = CheckpointedTrunk(Stack())
    with pytest.raises(ValueError, match=r"module types present: \[.*'ChainUnit'.*\]\. A traced trunk runs its model's blocks as ChainUnits.*by name"):
        apply_activation_checkpointing(trunk, by_type(nn.Sequential))
    assert not any(is_checkpoint_wrapped(m) for m in trunk.modules())  # nothing changed
    assert apply_activation_checkpointing(trunk, by_name(r"blocks_\d+")) == ["blocks_0", "blocks_1"]


def test_by_name_matches_the_whole_name():
    model = torchvision.models.resnet18()
    assert apply_activation_checkpointing(model, by_name(r"layer\d\.0")) == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]


def test_any_callable_is_a_condition_and_the_root_is_never_wrapped():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert apply_activation_checkpointing(model, lambda name, m: True) == ["0", "1", "2"]
    assert not is_checkpoint_wrapped(model)


def test_torchs_check_fn_of_the_module_alone_selects_as_by_type_does():
    """``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``
    takes ``check_fn(module)``: a condition written for it works here unchanged, budget or not."""
    names = apply_activation_checkpointing(torchvision.models.resnet50(), lambda m: isinstance(m, Bottleneck))
    assert names == _bottleneck_names(torchvision.models.resnet50())

    def check_fn(submodule, depth=0):  # a default does not count as a second parameter
        return isinstance(submodule, torchvision.models.resnet.BasicBlock) and depth == 0

    model = torchvision.models.resnet18()
    plan = apply_activation_checkpointing(model, check_fn, memory_budget=0.9, example_inputs=(torch.randn(2, 3, 64, 64),), gradients="kept")
    wrapped = [n for n, m in model.named_modules() if is_checkpoint_wrapped(m)]
    assert wrapped and list(plan.names) == wrapped and set(wrapped) <= set(_basic_block_names(model)), plan


def test_module_classes_select_their_instances_as_by_type_does_budget_or_not():
    """A class, or a tuple or set of them (FSDP's ``ModuleWrapPolicy({Block})`` spelling), selects as
    ``by_type`` (before: the class was called with (name, module), and its constructor failed)."""
    for condition in (Bottleneck, (Bottleneck,), {Bottleneck}):
        assert apply_activation_checkpointing(torchvision.models.resnet50(), condition) == _bottleneck_names(torchvision.models.resnet50())
    model = torchvision.models.resnet18()
    plan = apply_activation_checkpointing(model, torchvision.models.resnet.BasicBlock, memory_budget=0.9, example_inputs=(torch.randn(2, 3, 64, 64),), gradients="kept")
    assert plan.names and set(plan.names) <= set(_basic_block_names(model)), plan


@pytest.mark.parametrize("bad,message", [("layer1", "got the string 'layer1': to select by name, pass by_name('layer1')"),
                                         (nn.Linear(2, 2), "got a Linear module: to select it, pass by_name("),
                                         ((), "module classes (by_type), got ()"), ((Bottleneck, int), "got (")])
def test_a_string_a_module_or_no_classes_as_the_condition_are_refused_saying_what_to_pass(bad, message):
    model = torchvision.models.resnet18()
    with pytest.raises(TypeError, match=re.escape(message)):
        apply_activation_checkpointing(model, bad)
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())


def _basic_block_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, torchvision.models.resnet.BasicBlock)]


@pytest.mark.parametrize("condition,shown", [(by_type(Bottleneck), "by_type(Bottleneck)"), (by_name("layer9"), "by_name('layer9')"),
                                             (every_k(2, Bottleneck), "every_k(2, Bottleneck)")])
def test_a_condition_that_selects_nothing_is_named_as_it_was_written(condition, shown):
    with pytest.raises(ValueError, match=re.escape(f"the condition {shown} selected no submodule")):
        apply_activation_checkpointing(torchvision.models.resnet18(), condition)


def test_already_wrapped_modules_and_their_insides_are_left_alone():
    model = torchvision.models.resnet18()
    assert apply_activation_checkpointing(model, by_name(r"layer1")) == ["layer1"]
    # layer1's blocks are inside a wrapped module: only the other stages' blocks are new
    again = apply_activation_checkpointing(model, by_type(torchvision.models.resnet.BasicBlock))
    assert again == ["layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]


def test_nothing_selected_lists_the_types_present_and_changes_nothing():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match=r"selected no submodule.*\['Linear', 'ReLU'\]"):
        apply_activation_checkpointing(model, by_type(Bottleneck))
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())


@pytest.mark.parametrize("bad,message", [(lambda: every_k(0, Bottleneck), "every_k needs a whole number k >= 1, got 0"),
                                         (lambda: every_k(2.5, Bottleneck), "every_k needs a whole number k >= 1, got 2.5"),
                                         (lambda: by_type(), "by_type needs one or more nn.Module classes"),
                                         (lambda: by_type(int), "by_type needs one or more nn.Module classes")])
def test_bad_conditions_are_refused(bad, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        bad()


def test_selection_from_config_equals_the_python_condition():
    select = {"every_k": 2, "types": ["torchvision.models.resnet.Bottleneck"]}
    a = apply_activation_checkpointing(torchvision.models.resnet50(), condition_from_config(select))
    assert a == _bottleneck_names(torchvision.models.resnet50())[0::2]
    b = apply_activation_checkpointing(torchvision.models.resnet50(), condition_from_config({"name_regex": r"layer3\.\d+", "types": ["torchvision.models.resnet.Bottleneck"]}))
    assert b == [f"layer3.{i}" for i in range(6)]


@pytest.mark.parametrize("select,match", [({"every": 2}, "unknown selection key"), ({"types": ["torchvision.models.Nope"]}, "cannot import"), ({}, "empty selection")])
def test_bad_config_selection_is_refused(select, match):
    with pytest.raises(ValueError, match=match):
        condition_from_config(select)


def test_in_place_modules_alone_are_refused_and_nothing_is_wrapped():
    model = torchvision.models.resnet18()
    with pytest.raises(ValueError, match=r"first operation is in-place \(relu, layer1\.0\.relu"):
        apply_activation_checkpointing(model, by_type(nn.ReLU))
    assert not any(is_checkpoint_wrapped(m) for m in model.modules())


def test_in_place_matches_are_skipped_with_a_warning_and_the_step_stays_exact():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3))
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match=r"not checkpointing 2 selected module\(s\) whose first operation is in-place \(1, 3\)"):
        names = apply_activation_checkpointing(model, every_k(1))  # every module, no types
    assert names == ["0", "2", "4"]
    x = torch.randn(2, 3, 12, 12)
    loss_of([plain(x)]).backward()
    loss_of([model(x)]).backward()
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


def _recomputed(trunk, names):
    """How many times each named module ran while a training step recomputed (0: not checkpointed; a
    wrapper recomputes its module's forward, so name a module inside it)."""
    counts = dict.fromkeys(names, 0)
    hooks = [trunk.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: counts.__setitem__(n, counts[n] + is_recomputing()))
             for n in names]
    loss_of(trunk(torch.randn(2, 3, 32, 32))).backward()
    for h in hooks:
        h.remove()
    return counts


def test_a_trunks_stage_is_never_selected_its_blocks_are_and_they_recompute():
    """A CheckpointedTrunk runs a stage's blocks one by one, never the stage's own forward: a wrapper on
    ``res4`` would never run, and selecting it (by name, a Sequential's type, every_k counting it) left
    the stage unchecked, silently. Its blocks are selectable and recompute in backward."""
    trunk = CheckpointedTrunk(torchvision.models.resnet18())
    with pytest.raises(ValueError, match=re.escape("not checkpointing 1 selected module(s) that a trunk runs block by block (res4): the trunk never "
                                                   "calls a stage itself, so a wrapper on one would never run; nothing else was selected. "
                                                   r"Select their blocks instead (by_name(r'res4\.\d+')")):
        apply_activation_checkpointing(trunk, by_name("res4"))
    assert not any(is_checkpoint_wrapped(m) for m in trunk.modules())
    with pytest.warns(UserWarning, match=re.escape("that a trunk runs block by block (res2, res3, res4, res5)")):
        assert apply_activation_checkpointing(trunk, by_type(nn.Sequential)) == ["res3.0.downsample", "res4.0.downsample", "res5.0.downsample"]
    trunk = CheckpointedTrunk(torchvision.models.resnet18())
    assert apply_activation_checkpointing(trunk, by_name(r"res4\.\d+")) == ["res4.0", "res4.1"]
    assert _recomputed(trunk, ["res3.1.conv1", "res4.0.conv1", "res4.1.conv1"]) == {"res3.1.conv1": 0, "res4.0.conv1": 1, "res4.1.conv1": 1}
    with pytest.raises(ValueError, match=re.escape("A trunk's modules are named by its feature blocks (a ResNet's res4.0 is torchvision's layer3.0)")):
        apply_activation_checkpointing(CheckpointedTrunk(torchvision.models.resnet18()), by_name(r"layer3\.\d+"))


def test_applying_the_same_counting_condition_again_selects_the_same_modules():
    model = torchvision.models.resnet50()
    condition = every_k(2, Bottleneck)
    first = apply_activation_checkpointing(model, condition)
    assert apply_activation_checkpointing(model, condition) == first == _bottleneck_names(torchvision.models.resnet50())[0::2]


@pytest.mark.parametrize(
    "select,match",
    [
        ({"every_k": 0, "types": ["torchvision.models.resnet.Bottleneck"]}, "every_k must be an integer >= 1"),
        ({"every_k": "2"}, "every_k must be an integer >= 1"),
        ({"name_regex": "layer[1"}, "not a valid regular expression"),
        ({"types": [3]}, "list of dotted class paths"),
        ({"types": ["torch.nn.functional.relu"]}, "not an nn.Module class"),
    ],
)
def test_more_bad_config_selections_are_refused(select, match):
    with pytest.raises(ValueError, match=match):
        condition_from_config(select)


def test_types_written_as_one_string_select_that_class():
    one = condition_from_config({"types": "torchvision.models.resnet.Bottleneck"})
    assert apply_activation_checkpointing(torchvision.models.resnet50(), one) == _bottleneck_names(torchvision.models.resnet50())
