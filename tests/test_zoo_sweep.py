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
