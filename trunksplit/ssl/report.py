"""A picture of a run, or of several overlaid: their metrics against the step, one PNG, and a summary.

``trunksplit report RUN_DIR [RUN_DIR ...]`` reads each run's ``metrics.jsonl`` (what the launcher
logged), ``summary.json`` (what it measured at its end) and ``knn.jsonl`` (what ``trunksplit knn``
kept), and draws against the step: the loss, with the loss of a model that learned nothing; the
kNN top-1 accuracy on 0..1, from the untrained model's point at step 0, ``trunksplit knn``'s results
as crosses; images/s; the step's peak memory from zero, with one step without checkpointing
(measured side by side at the end); the seconds each step waited on its data loader.
"""
import os
import statistics
import warnings
from dataclasses import dataclass
from typing import List

from .metrics_log import images_per_second, offline_knn, read_summary
from .run_dir import METRICS, metrics_rows

REPORT = "report.png"
MiB = 2**-20


@dataclass
class Run:
    """What a run folder holds for the report: its logged steps (rows with a loss), its online kNN
    points (step 0, the untrained model, included), ``trunksplit knn``'s kept results, its summary
    (empty before the run ended)."""

    name: str
    steps: List[dict]
    knn: List[dict]
    offline: List[dict]
    summary: dict


def read_run(run_dir: str) -> Run:
    """A run folder's metrics; a ``ValueError`` where it has none to read."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} holds no {METRICS}: give the OUTPUT_DIR of a run of tools/train.py")
    whole, torn = metrics_rows(path, "trunksplit report")
    if torn is not None:  # a killed run's last line (--resume drops it too): draw what is whole
        warnings.warn(f"{path}: line {torn}, the last, is torn, as a killed run leaves it: drawn without it", UserWarning, stacklevel=2)
    rows = [row for _, row in whole]
    steps = [r for r in rows if "loss" in r]
    if not steps:
        raise ValueError(f"{path} holds no training step yet")
    name = os.path.basename(os.path.normpath(run_dir))
    return Run(name, steps, [r for r in rows if "knn_top1" in r], offline_knn(run_dir), read_summary(run_dir))


def summary(run: Run) -> str:
    """A few lines: steps, loss first and last (against chance), kNN top-1 untrained, best and last,
    ``trunksplit knn``'s results, median speed, the largest step peak (against the unsplit step),
    the median data wait."""
    steps, loss = [r["step"] for r in run.steps], [r["loss"] for r in run.steps]
    chance = run.summary.get("chance_loss")
    against = f" ({loss[-1] / chance:.2f} of chance, {chance:.4f})" if chance else ""
    lines = [f"{run.name}: steps {steps[0]}..{steps[-1]} ({len(run.steps)} rows): loss {loss[0]:.4f} -> {loss[-1]:.4f}{against}"]
    if run.knn:
        first, last = run.knn[0], run.knn[-1]
        best = max(run.knn, key=lambda r: r["knn_top1"])
        start = "untrained" if first["step"] == 0 else f"at step {first['step']}"
        lines.append(f"  kNN top-1: {first['knn_top1']:.3f} {start}, best {best['knn_top1']:.3f} at step {best['step']}, last {last['knn_top1']:.3f} at step {last['step']}")
    for r in run.offline:
        which = "untrained" if r.get("untrained") else f"step {r['step']}"
        lines.append(f"  trunksplit knn, {which}, val {r['val']}: top-1 {r['knn_top1']:.3f}")
    peak = max(r["peak_memory_bytes"] for r in run.steps)
    vs = run.summary.get("memory_vs_plain")
    plain = f" (one step side by side: {vs['checkpointed'] * MiB:.1f} MiB checkpointed, {vs['plain'] * MiB:.1f} MiB without)" if vs else ""
    lines.append(f"  median {images_per_second(statistics.median(r['images_per_sec'] for r in run.steps))} images/s, largest step peak {peak * MiB:.1f} MiB{plain}, "
                 f"median data wait {statistics.median(r.get('data_seconds', 0.0) for r in run.steps):.3f} s")
    return "\n".join(lines)


PANELS = [("loss", "loss", 1), ("knn_top1", "kNN top-1", 1), ("images_per_sec", "images/s", 1),
          ("peak_memory_bytes", "step peak (MiB)", MiB), ("data_seconds", "data wait (s)", 1)]


def report_figure(runs: List[Run]):
    """The panels, one line per run (each run its colour), as a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [p for p in PANELS if any(p[0] in r for run in runs for r in run.steps + run.knn + run.offline)]  # a kNN read afterwards too
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.1 * len(panels)), sharex=True, squeeze=False)
    for i, run in enumerate(runs):
        colour = f"C{i}"
        for ax, (key, _, scale) in zip(axes[:, 0], panels):
            rows = run.knn if key == "knn_top1" else run.steps
            points = [(r["step"], r[key] * scale) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), color=colour, marker="o" if len(points) < 30 else None, markersize=3, label=run.name)
            _references(ax, key, run, colour)
    for ax, (key, label, _) in zip(axes[:, 0], panels):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "knn_top1":
            ax.set_ylim(0, 1.02)  # a fraction: a 2-point change stays a 2-point change
        elif key in ("peak_memory_bytes", "images_per_sec", "data_seconds"):
            ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # from zero, and room above a reference line at the top
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # no step 2.5
    fig.suptitle(", ".join(run.name for run in runs))
    fig.tight_layout()
    return fig


def _references(ax, key: str, run: Run, colour: str) -> None:
    """What a panel's line is read against: chance for the loss, the unsplit step for memory, the
    offline kNN results."""
    if key == "loss" and run.summary.get("chance_loss"):
        ax.axhline(run.summary["chance_loss"], color=colour, linestyle=":", label=f"{run.name}: learned nothing (chance)")
    if key == "peak_memory_bytes" and run.summary.get("memory_vs_plain"):
        ax.axhline(run.summary["memory_vs_plain"]["plain"] * MiB, color=colour, linestyle="--", label=f"{run.name}: one step without checkpointing")
    if key == "knn_top1" and run.offline:
        ax.scatter([r["step"] for r in run.offline], [r["knn_top1"] for r in run.offline], color=colour, marker="x", s=40,
                   label=f"{run.name}: trunksplit knn", zorder=3)


def draw_report(runs: List[Run], path: str) -> str:
    """Draw the runs' panels into ``path`` (a PNG); returns it."""
    fig = report_figure(runs)
    import matplotlib.pyplot as plt  # after report_figure chose the file-only backend

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
