"""``trunksplit knn`` and ``trunksplit report``: what a launcher run learned, after it ran."""
import sys

import torch

from ..ssl.knn import knn_of_run
from ..ssl.report import draw_report, read_metrics, summary


def add_run_parsers(sub) -> None:
    k = sub.add_parser("knn", help="kNN accuracy of a run's trunk on labelled image folders (DINO's weighted kNN)")
    k.add_argument("run_dir", help="a run's OUTPUT_DIR (its config.yaml and checkpoint.pt)")
    k.add_argument("--train", required=True, help="an ImageFolder root (a folder per class): the neighbours")
    k.add_argument("--val", required=True, help="an ImageFolder root with the same classes: the images classified")
    k.add_argument("--untrained", action="store_true", help="evaluate the model the run started from (its config and seed): a baseline")
    k.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    k.set_defaults(fn=_knn)
    r = sub.add_parser("report", help="draw a run's loss, kNN accuracy, speed, memory and data wait into RUN_DIR/report.png")
    r.add_argument("run_dir", help="a run's OUTPUT_DIR (its metrics.jsonl)")
    r.set_defaults(fn=_report)


def _knn(args) -> int:
    try:
        step, accuracies = knn_of_run(args.run_dir, args.train, args.val, args.untrained, args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    which = "untrained (its config and seed)" if args.untrained else f"at step {step}"
    top5 = f", top-5 {accuracies['knn_top5']:.4f}" if "knn_top5" in accuracies else ""
    print(f"kNN of {args.run_dir} {which}: top-1 {accuracies['knn_top1']:.4f}{top5}")
    return 0


def _report(args) -> int:
    try:
        rows = read_metrics(args.run_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(rows))
    print(f"picture: {draw_report(args.run_dir, rows)}")
    return 0
