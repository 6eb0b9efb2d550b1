"""Where a run's numbers go besides metrics.jsonl (summary.json: tests/ssl/test_knn.py's report test):
TensorBoard scalars with ``LOGGING.TENSORBOARD`` (read back with TensorBoard's own reader; a killed and resumed run shows
each step once), refused before anything is written where the package is missing."""
import json
import os
import sys

import pytest

from trunksplit.cli import main
from trunksplit.ssl import loop
from trunksplit.ssl.config import load_config
from trunksplit.ssl.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4",
         "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0"]


def test_tensorboard_without_the_package_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as on a machine without it: find_spec answers None
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"needs the tensorboard package: pip install tensorboard"):
        train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "1", "OUTPUT_DIR", str(out), "LOGGING.TENSORBOARD", "True"]))
    assert not out.exists()


@pytest.mark.clients  # tensorboard is an optional extra: pip install -e ".[tensorboard]"
def test_tensorboard_scalars_equal_the_metrics_rows_and_a_resumed_run_shows_each_step_once(tmp_path, monkeypatch):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    save = loop._save_checkpoint

    def killed_after_step_3(cfg, strategy, model, optimizer, scaler, steps_done, skipped):
        if steps_done <= 2:  # the process dies after logging step 3, before its checkpoint
            save(cfg, strategy, model, optimizer, scaler, steps_done, skipped)

    config = [*SMALL, "TRAIN.STEPS", "3", "TRAIN.CHECKPOINT_EVERY", "2", "OUTPUT_DIR", str(out), "LOGGING.TENSORBOARD", "True"]
    with monkeypatch.context() as m:
        m.setattr(loop, "_save_checkpoint", killed_after_step_3)
        train(load_config(QUICK, config))
    train(load_config(QUICK, config), resume=True)  # from step 2: step 3 again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key, tag, scale in (("loss", "train/loss", 1), ("lr", "train/lr", 1), ("images_per_sec", "speed/images_per_sec", 1),
                            ("peak_memory_bytes", "memory/step_peak_MiB", 2**-20)):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3], tag  # step 3 once: the killed process's step 3 forgotten
        assert [s.value for s in scalars] == pytest.approx([r[key] * scale for r in rows], rel=1e-6), tag  # float32 in the event file


def test_a_slow_runs_speed_reads_in_significant_digits_not_as_zero(tmp_path, capsys):
    """A step of 100 s over 2 images (bf16 emulated on a CPU) printed "0.0 images/s": the report, as the launcher's
    lines, gives two significant digits below 1 image/s and one decimal above."""
    for rate, printed in ((2 / 94.0, "0.021"), (0.96, "0.96"), (7.63, "7.6"), (123.45, "123.5")):
        run = tmp_path / str(rate)
        run.mkdir()
        row = {"step": 1, "loss": 4.0, "images_per_sec": rate, "peak_memory_bytes": 2**20, "data_seconds": 0.01}
        (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        assert main(["report", str(run)]) == 0
        assert f"median {printed} images/s" in capsys.readouterr().out
