"""One rule for every way a memory budget or size is written, tested once as a table, and
every entry point (trunk, apply_activation_checkpointing, fit, the CLI, the config) held to it."""
import math

import pytest
import torch
import torchvision
from torch import nn

import trunksplit
from trunksplit.cli.parser import build_parser
from trunksplit.planning.budget import MemoryBudget, format_bytes, parse_memory_size
from trunksplit.ssl.config import load_config

GiB, MiB = 2**30, 2**20

# value -> (fraction, bytes); None: no budget
READ = [
    (None, None), (0, None), (0.0, None), ("0", None), (" 0 ", None),
    (0.5, (0.5, None)), ("0.5", (0.5, None)), (1.0, (1.0, None)), ("1", (1.0, None)), (1e-3, (1e-3, None)),
    (1, (None, 1)), (2048, (None, 2048)), (2e9, (None, 2 * 10**9)), ("2e9", (None, 2 * 10**9)), (2.0e9, (None, 2 * 10**9)),
    ("2GiB", (None, 2 * GiB)), ("500 MiB", (None, 500 * MiB)), ("2GB", (None, 2 * 10**9)), ("1.5GiB", (None, 3 * GiB // 2)),
    ("64KiB", (None, 64 * 2**10)), ("100B", (None, 100)),
]
# value -> the error and a word its message must hold
REFUSED = [
    (-1, ValueError, "must be 0 (off)"), (-0.5, ValueError, "must be 0 (off)"), ("-1GiB", ValueError, "must be 0 (off)"),
    (float("nan"), ValueError, "nan"), ("nan", ValueError, "nan"), (float("inf"), ValueError, "inf"), ("inf", ValueError, "inf"),
    (-math.inf, ValueError, "inf"), (1.5, ValueError, "did you mean 0.015"), (50.5, ValueError, "neither a fraction"),
    (True, TypeError, "bool"), (False, TypeError, "bool"), ([0.4], TypeError, "list"), ("abc", ValueError, "cannot read"),
    ("12XB", ValueError, "cannot read"), ("2gb", ValueError, "cannot read"), ("", ValueError, "cannot read"),
    ("50%", ValueError, "(50% is 0.5)"), ("37.5 %", ValueError, "(37.5% is 0.375)"),  # a percentage: the fraction to write
]


@pytest.mark.parametrize("value,expected", READ, ids=[repr(v) for v, _ in READ])
def test_a_budget_is_read_by_one_rule(value, expected):
    budget = MemoryBudget.parse(value)
    if expected is None:
        assert budget is None
    else:
        assert (budget.fraction, budget.bytes) == expected


@pytest.mark.parametrize("value,error,says", REFUSED, ids=[repr(v) for v, _, _ in REFUSED])
def test_a_bad_budget_is_refused_with_what_to_write(value, error, says):
    with pytest.raises(error, match="memory_budget") as info:
        MemoryBudget.parse(value)
    assert says in str(info.value)


def test_a_fraction_resolves_against_the_unsplit_peak_and_bytes_stand():
    assert MemoryBudget.parse(0.25).in_bytes(400 * MiB) == 100 * MiB
    assert MemoryBudget.parse("64MiB").in_bytes(400 * MiB) == 64 * MiB
    assert format_bytes(512 * MiB) == f"512.0 MiB ({512 * MiB} bytes)"
    assert format_bytes(3 * GiB) == f"3.000 GiB ({3 * GiB} bytes)"


def test_a_memory_size_is_a_budget_in_bytes_only():
    assert parse_memory_size("16GiB") == 16 * GiB
    assert parse_memory_size(2e9) == 2 * 10**9
    for bad in ("0", 0, 0.5, "-1GiB", -3, "nan", "12XB", True):
        with pytest.raises((ValueError, TypeError), match="memory") as refused:
            parse_memory_size(bad)
        # a memory size has no "off", and no fraction to offer
        assert "(off)" not in str(refused.value) and "0 for none" not in str(refused.value) and "fraction" not in str(refused.value), refused.value


def _blocks():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))


@pytest.mark.parametrize("value", ["2GiB", 0.5, 2048])
def test_every_entry_point_reads_a_budget_alike(value):
    expected = MemoryBudget.parse(value)
    trunk = trunksplit.CheckpointedTrunk(torchvision.models.resnet18(), memory_budget=value)
    assert trunk.memory_budget == expected == trunk.plan_request().budget
    args = build_parser().parse_args(["plan", "--budget", str(value)])
    assert args.budget == MemoryBudget.parse(str(value))
    cfg = load_config("configs/quickstart.yaml", ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", str(value)])
    assert MemoryBudget.parse(cfg.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET) == MemoryBudget.parse(str(value))


@pytest.mark.parametrize("value", [-1, float("nan"), True, "abc", 1.5])
def test_every_entry_point_refuses_a_bad_budget_and_changes_nothing(value):
    error = TypeError if isinstance(value, bool) else ValueError
    model = torchvision.models.resnet18()
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(error, match="memory_budget"):
        trunksplit.CheckpointedTrunk(model, memory_budget=value)
    blocks = _blocks()
    with pytest.raises(error, match="memory_budget"):
        trunksplit.apply_activation_checkpointing(blocks, memory_budget=value, example_inputs=torch.randn(1, 3, 8, 8))
    assert [n for n, _ in model.named_modules()] == names and not any("Checkpointed" in type(m).__name__ for m in blocks.modules())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--budget", str(value)])
    with pytest.raises(ValueError, match="MEMORY_BUDGET"):
        load_config("configs/quickstart.yaml", ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", str(value)])


def test_zero_is_no_budget_everywhere():
    assert trunksplit.CheckpointedTrunk(torchvision.models.resnet18(), memory_budget=0).memory_budget is None
    with pytest.raises(TypeError, match="needs a condition"):  # no budget and no condition: nothing to do
        trunksplit.apply_activation_checkpointing(_blocks(), memory_budget=0, example_inputs=torch.randn(1, 3, 8, 8))
    cfg = load_config("configs/quickstart.yaml", ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0"])
    assert MemoryBudget.parse(cfg.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--budget", "0"])  # a command asked for a budget: 0 is no answer


@pytest.mark.parametrize("gradients", ["allocated", "kept"])
def test_a_budget_of_a_few_bytes_is_refused_saying_it_was_read_as_bytes_and_how_to_write_a_percentage(gradients):
    """``memory_budget=50`` is 50 bytes by the one rule (whole numbers are bytes); no step fits in
    100 bytes, so the refusal says how it was read and what 50% is written as. 2048 bytes gets no such note."""
    x = torch.randn(2, 3, 16, 16)
    for value, noted in ((50, True), (2048, False)):
        trunk = trunksplit.CheckpointedTrunk(_blocks(), memory_budget=value, gradients=gradients)
        with pytest.raises(trunksplit.BudgetTooLowError) as refused:
            trunk(x)
        assert ("50 is read as bytes, as every whole number is: for 50% of the unsplit step write 0.5" in str(refused.value)) == noted
        assert ("read as bytes" in str(refused.value)) == noted
        blocks = _blocks()
        with pytest.raises(trunksplit.BudgetTooLowError) as refused:
            trunksplit.apply_activation_checkpointing(blocks, memory_budget=value, example_inputs=x, gradients=gradients)
        assert ("for 50% of the unsplit step write 0.5" in str(refused.value)) == noted
        assert not any("Checkpointed" in type(m).__name__ for m in blocks.modules())  # nothing changed
