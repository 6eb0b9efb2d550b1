"""tools/zoo_sweep.py's budget rows (docs/backbones.md): the budget plan, regions and all, checked
for exactness against the unsplit trunk, at the asked budget or at a model's floor where that is above it."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sweep():
    spec = importlib.util.spec_from_file_location("zoo_sweep_tool", ROOT / "tools" / "zoo_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_budget_sweep_checks_the_budget_plan_at_the_models_floor_where_the_budget_is_below_it(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"  # 0.1 is below SqueezeNet's floor at 2 x 64px
    assert _sweep().main(["--libraries", "torchvision", "--only", "squeezenet1_0", "--budget", "0.1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["result"] == "exact" and row["regions"], row  # regions: nested checkpoints checked too
    assert 0.1 < row["budget"] < 0.5  # the floor (tests/planning/test_planner.py: just under it, none fits)
    assert "| planned at their floor | median budget | with regions |" in capsys.readouterr().out


def test_a_peaks_sweep_predicts_the_step_with_the_optimizer_stepped_in_backward(tmp_path):
    """``--gradients in_backward``: SGD with momentum updates each parameter in backward, in the plain
    step and the balanced trunk's alike; the plan's prediction is checked against the measured step."""
    out = tmp_path / "rows.jsonl"
    assert _sweep().main(["--libraries", "torchvision", "--only", "squeezenet1_0", "--peaks", "--gradients", "in_backward", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["result"] == "planned", row
    assert row["measured_in_backward"] < row["plain_in_backward"]
    assert abs(row["predicted_vs_measured_in_backward"] - 1) <= 0.01, row


def test_a_peaks_sweep_with_features_predicts_the_step_that_returns_them_and_refuses_a_model_without_them(tmp_path):
    """``--features bn1 res5``: the trunks return both, the loss weighs each; ResNet-18's prediction is the measured
    step to the loss's scalars (bn1's copy before the in-place ReLU counted); ViT has no ``bn1`` and is refused, saying so."""
    out = tmp_path / "rows.jsonl"
    assert _sweep().main(["--libraries", "torchvision", "--only", "resnet18", "vit_b_16", "--peaks", "--features", "bn1", "res5", "--out", str(out)]) == 0
    rows = {r["model"]: r for r in map(json.loads, out.read_text().splitlines())}
    for gradients in ("kept", "allocated"):
        row = rows["resnet18"]
        assert row["measured_" + gradients] - 64 <= row["predicted_" + gradients] <= row["measured_" + gradients], row
    assert rows["vit_b_16"]["result"] == "refused" and "unknown feature key(s) ['bn1', 'res5']" in rows["vit_b_16"]["error"], rows["vit_b_16"]
