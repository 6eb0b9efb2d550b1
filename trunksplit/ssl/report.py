"""A picture of a run: its metrics against the step, one PNG in the run folder, and a short summary.

``trunksplit report RUN_DIR`` reads ``metrics.jsonl`` (what the launcher logged) and draws the
loss, the kNN top-1 accuracy (where the run evaluated it), images/s, the step's peak memory and
the seconds each step waited on its data loader, each against the step.
"""
import os
import statistics
import warnings
from typing import List

from .run_dir import METRICS, metrics_rows

REPORT = "report.png"


def read_metrics(run_dir: str) -> List[dict]:
    """The run's metrics rows; a ``ValueError`` where there are none to read."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} holds no {METRICS}: give the OUTPUT_DIR of a run of tools/train.py")
    whole, torn = metrics_rows(path, "trunksplit report")
    if torn is not None:  # a killed run's last line (--resume drops it too): draw what is whole
        warnings.warn(f"{path}: line {torn}, the last, is torn, as a killed run leaves it: drawn without it", UserWarning, stacklevel=2)
    rows = [row for _, row in whole]
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step yet")
    return rows


def summary(rows: List[dict]) -> str:
    """A few lines: steps, loss first and last, kNN top-1 first, best and last, median speed, the
    largest step peak, the median data wait."""
    steps, loss = [r["step"] for r in rows], [r["loss"] for r in rows]
    lines = [f"steps {steps[0]}..{steps[-1]} ({len(rows)} rows): loss {loss[0]:.4f} -> {loss[-1]:.4f}"]
    knn = [(r["step"], r["knn_top1"]) for r in rows if "knn_top1" in r]
    if knn:
        best = max(knn, key=lambda s: s[1])
        lines.append(f"kNN top-1: {knn[0][1]:.3f} at step {knn[0][0]}, best {best[1]:.3f} at step {best[0]}, last {knn[-1][1]:.3f} at step {knn[-1][0]}")
    lines.append(f"median {statistics.median(r['images_per_sec'] for r in rows):.1f} images/s, largest step peak "
                 f"{max(r['peak_memory_bytes'] for r in rows) / 2**20:.1f} MiB, median data wait {statistics.median(r.get('data_seconds', 0.0) for r in rows):.3f} s")
    return "\n".join(lines)


def draw_report(run_dir: str, rows: List[dict]) -> str:
    """Draw the panels into ``RUN_DIR/report.png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = [("loss", "loss", 1), ("knn_top1", "kNN top-1", 1), ("images_per_sec", "images/s", 1),
              ("peak_memory_bytes", "step peak (MiB)", 2**-20), ("data_seconds", "data wait (s)", 1)]
    panels = [p for p in panels if any(p[0] in r for r in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, label, scale) in zip(axes[:, 0], panels):
        points = [(r["step"], r[key] * scale) for r in rows if key in r]
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    path = os.path.join(run_dir, REPORT)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
