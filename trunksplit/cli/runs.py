"""``trunksplit knn`` and ``trunksplit report``: what a launcher run learned, after it ran."""
import sys

import torch

from ..ssl.knn import knn_of_run
from ..ssl.report import draw_report, read_metrics, summary


def device_of(text: str) -> str:
    """``--device``: ``auto`` is cuda where there is one, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if text == "auto" else text


def run_knn(args) -> int:
    try:
        step, accuracies = knn_of_run(args.run_dir, args.train, args.val, args.untrained, device_of(args.device))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    which = "untrained (its config and seed)" if args.untrained else f"at step {step}"
    top5 = f", top-5 {accuracies['knn_top5']:.4f}" if "knn_top5" in accuracies else ""
    print(f"kNN of {args.run_dir} {which}: top-1 {accuracies['knn_top1']:.4f}{top5}")
    return 0


def run_report(args) -> int:
    try:
        rows = read_metrics(args.run_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(rows))
    print(f"picture: {draw_report(args.run_dir, rows)}")
    return 0
