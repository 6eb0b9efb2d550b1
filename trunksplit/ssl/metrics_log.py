"""Where a run's numbers go: ``metrics.jsonl`` (one JSON line per logged step: what ``--resume``
and ``trunksplit report`` read), TensorBoard scalars beside it with ``LOGGING.TENSORBOARD``, and
``summary.json`` (what the end of the run measured once: the loss of a model that learned nothing,
the plan, one step with and without checkpointing side by side).

The launcher writes these on rank 0; ``trunksplit knn`` keeps its results in ``knn.jsonl`` beside
them, so that the report draws every evaluation a run had.
"""
import importlib.util
import json
import os
from .run_dir import METRICS, metrics_rows
from .run_lock import release_output_dir

TENSORBOARD = "tensorboard"  # under OUTPUT_DIR: the event files
SUMMARY = "summary.json"
OFFLINE_KNN = "knn.jsonl"
# metrics row key -> (TensorBoard tag, scale): lightly's and solo-learn's names where they have one
SCALARS = {
    "loss": ("train/loss", 1.0), "lr": ("train/lr", 1.0), "images_per_sec": ("speed/images_per_sec", 1.0),
    "data_seconds": ("speed/data_wait_seconds", 1.0), "peak_memory_bytes": ("memory/step_peak_MiB", 2.0**-20),
    "knn_top1": ("eval/knn_top1", 1.0), "knn_top5": ("eval/knn_top5", 1.0),
}


def images_per_second(rate: float) -> str:
    """A speed as the launcher and ``trunksplit report`` print it: one decimal from 1 image/s up, two
    significant digits below, where one decimal read a slow step (bf16 emulated on a CPU) as 0.0."""
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"


def check_tensorboard(wanted: bool) -> None:
    """``LOGGING.TENSORBOARD True`` needs the optional package: refused, with the command, before
    anything is written."""
    if wanted and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("LOGGING.TENSORBOARD True writes TensorBoard scalars, which needs the tensorboard package: "
                         "pip install tensorboard (or pip install -e \".[tensorboard]\"), or set LOGGING.TENSORBOARD False")


class MetricsLog:
    """Appends a run's rows to ``metrics.jsonl`` and, with ``tensorboard``, each row's numbers as
    scalars at its step; ``finish`` writes ``summary.json``. ``first_step``: the first step this
    process logs; TensorBoard forgets the events from that step on that an earlier, interrupted
    process wrote (a resumed run logs those steps again, as metrics.jsonl does)."""

    def __init__(self, run_dir: str, tensorboard: bool = False, first_step: int = 0):
        self.run_dir, self.tensorboard, self.first_step = run_dir, tensorboard, first_step
        self.writer = None  # opened at the first row: a process that logs nothing leaves no event file

    def write(self, row: dict) -> None:
        _append(os.path.join(self.run_dir, METRICS), row)
        if not self.tensorboard:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # optional: imported only when asked for

            self.writer = SummaryWriter(os.path.join(self.run_dir, TENSORBOARD), purge_step=self.first_step)
        for key, (tag, scale) in SCALARS.items():
            if key in row:
                self.writer.add_scalar(tag, row[key] * scale, row["step"])
        self.writer.flush()  # a killed run keeps what it logged, as metrics.jsonl does

    def finish(self, summary: dict) -> None:
        """Write ``summary.json`` (a resumed run replaces it at its end), close the event file, and let go of
        the run's directory (another process may train into it now)."""
        with open(os.path.join(self.run_dir, SUMMARY), "w") as f:
            json.dump(summary, f, indent=1)
        if self.writer is not None:
            self.writer.close()
        release_output_dir(self.run_dir)


def read_summary(run_dir: str) -> dict:
    """The run's ``summary.json``; empty for a run that has not ended, or one of an earlier release."""
    path = os.path.join(run_dir, SUMMARY)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def keep_offline_knn(run_dir: str, row: dict) -> str:
    """Append one ``trunksplit knn`` result (its step, folders and accuracies) to the run's
    ``knn.jsonl``; returns the file's path."""
    path = os.path.join(run_dir, OFFLINE_KNN)
    _append(path, row)
    return path


def _append(path: str, row: dict) -> None:
    """One JSON line at the end of ``path`` (metrics.jsonl, knn.jsonl): what ``metrics_rows`` reads."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def offline_knn(run_dir: str) -> list:
    """Every kept ``trunksplit knn`` result of the run, in the order they were made (a torn last
    line, of a command killed while writing it, left out)."""
    path = os.path.join(run_dir, OFFLINE_KNN)
    return [row for _, row in metrics_rows(path, "trunksplit report")[0]] if os.path.isfile(path) else []
