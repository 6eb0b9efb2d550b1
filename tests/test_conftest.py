"""The suite's own shortcut (``conftest.py``) changes nothing but time: a torchvision model built again
from the same random state is the model a fresh build makes, and leaves the random state it would."""
import torch
import torchvision


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
