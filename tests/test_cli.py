"""The trunksplit command: plan and bench."""
import pytest

from trunksplit.cli import main


def test_plan_prints_the_table_with_predicted_memory(capsys):
    assert main(["plan", "--arch", "resnet18", "--splits", "3", "--strategy", "balanced", "--input", "2x3x64x64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SplitPlan (balanced, 3 segments, predicted peak")
    assert "predicted peak (MiB)" in out and "of unsplit" in out


def test_plan_with_an_impossible_budget_says_so(capsys):
    assert main(["plan", "--arch", "resnet18", "--budget", "1000", "--input", "2x3x64x64"]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err


def test_plan_rejects_an_unknown_arch(capsys):
    assert main(["plan", "--arch", "resnet9000", "--input", "2x3x64x64"]) == 2
    assert "resnet9000" in capsys.readouterr().err


def test_plan_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--input", "2x3x64"])
    assert "8x3x224x224" in capsys.readouterr().err


def test_bench_writes_a_table_and_a_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--arch", "resnet18", "--batch", "2", "--resolution", "32", "--splits", "3", "--budgets", "0.9", "--repeats", "1", "--out", str(out)]) == 0
    table = (out / "benchmark.md").read_text()
    for row in ["plain", "checkpoint_sequential k=3", "vissl k=3", "balanced k=3", "budget 0.9", "wrap every block"]:
        assert f"| {row}" in table
    assert (out / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    assert table in capsys.readouterr().out
