"""The suite's own shortcuts (``conftest.py``) change nothing but time: a torchvision model built again
from the same random state is the model a fresh build makes, and leaves the random state it would; a chain
profiled again (``profile_memo.py``) gets the figures profiling it gives."""
import os

import torch
import torchvision

import profile_memo


def _fresh(seed):
    torch.manual_seed(seed)
    model = torchvision.models.resnet18.__wrapped__(num_classes=10)  # the builder itself, never remembered
    return model, torch.rand(3)


def _remembered(seed):
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    return model, torch.rand(3)


def test_a_remembered_build_is_a_fresh_build_and_leaves_the_same_random_state():
    first, after_first = _remembered(0)
    first.fc.weight.data.zero_()  # what a test does to its model must not reach the next build
    again, after_again = _remembered(0)
    fresh, after_fresh = _fresh(0)
    assert again is not first and torch.equal(after_again, after_fresh) and torch.equal(after_first, after_fresh)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh.state_dict().values()))
    again.fc.weight.data.zero_()  # nor what it does to a remembered one
    third, _ = _remembered(0)
    assert torch.equal(third.fc.weight, fresh.fc.weight)
    other, _ = _remembered(1)  # another seed: another model
    assert not torch.equal(other.conv1.weight, fresh.conv1.weight)


def test_a_model_built_by_name_as_the_launcher_builds_it_is_a_fresh_build_too():
    """``torchvision.models.get_model`` (trunksplit/ssl/backbones.py's path) is remembered as the builders are."""
    def by_name(seed, name="resnet18"):
        torch.manual_seed(seed)
        return torchvision.models.get_model(name, num_classes=10), torch.rand(3)

    first, after_first = by_name(0)
    first.fc.weight.data.zero_()
    again, after_again = by_name(0)
    fresh, after_fresh = _fresh(0)
    assert torch.equal(after_again, after_fresh) and torch.equal(after_first, after_fresh)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh.state_dict().values()))
    assert torchvision.models.get_model.__wrapped__ is not None  # and it is the remembering builder that served them
    assert type(by_name(0, "resnet34")[0].layer1[2]).__name__ == "BasicBlock"  # another name: another model


def _chain(seed, inplace=False):
    torch.manual_seed(seed)
    return [("conv", torch.nn.Conv2d(3, 8, 3)), ("bn", torch.nn.BatchNorm2d(8)), ("relu", torch.nn.ReLU(inplace=inplace)), ("pool", torch.nn.AdaptiveAvgPool2d(1))]


def test_a_remembered_profile_is_the_profile_and_a_changed_chain_or_setting_is_profiled_again():
    x = torch.randn(2, 3, 16, 16)
    profile_memo.memo_off[0] = False  # this file is one of the profiler's own: off unless a test says so
    try:
        first = profile_memo.profile_units(_chain(0), x, spans=[(0, 2)])
        again = profile_memo.profile_units(_chain(1), x, spans=[(0, 2)])  # other weights, the same storages
        assert again is first and again == profile_memo.REAL(_chain(1), x, spans=[(0, 2)])
        changed = {"in place": lambda: profile_memo.profile_units(_chain(0, inplace=True), x, spans=[(0, 2)]),
                   "another input": lambda: profile_memo.profile_units(_chain(0), torch.randn(4, 3, 16, 16), spans=[(0, 2)]),
                   "no spans": lambda: profile_memo.profile_units(_chain(0), x),
                   "progress said": lambda: profile_memo.profile_units(_chain(0), x, spans=[(0, 2)], progress=lambda name: None)}
        for what, profiled in changed.items():
            assert profiled() is not first, what
        by_allocator = profile_memo.profile_units(_chain(0), x, allocator=True)
        assert profile_memo.profile_units(_chain(0), x, allocator=True) is not by_allocator  # its figures follow its cache: each measured
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = profile_memo.profile_units(_chain(0), x, spans=[(0, 2)])
            assert under_autocast is not first and under_autocast == profile_memo.REAL(_chain(0), x, spans=[(0, 2)])
        assert under_autocast.output != first.output  # bf16 activations: the figures did change
    finally:
        profile_memo.memo_off[0] = True
    assert profile_memo.profile_units(_chain(1), x, spans=[(0, 2)]) is not first  # off: profiled for real


def test_a_profile_another_test_process_made_is_read_from_the_shared_folder_as_it_was_measured():
    """Two xdist workers profile many of the same chains: the second reads the first's figures (``SHARED_ENV``)."""
    x, spans = torch.randn(2, 3, 12, 12), [(1, 3)]
    measured = profile_memo.REAL(_chain(2), x, spans=spans)
    profile_memo.memo_off[0] = False
    real = profile_memo.REAL
    try:
        profile_memo.profile_units(_chain(2), x, spans=spans)  # this process profiles it, or reads what another wrote
        profile_memo._FIGURES.clear()  # as if another process: only the folder remembers it
        profile_memo.REAL = None  # it must not profile again
        assert profile_memo.profile_units(_chain(3), x, spans=spans) == measured
    finally:
        profile_memo.REAL = real
        profile_memo.memo_off[0] = True
    assert os.path.isdir(os.environ[profile_memo.SHARED_ENV])
