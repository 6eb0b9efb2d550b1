"""``trunksplit knn`` and ``trunksplit report``: what a launcher run learned, after it ran."""
import os
import sys

import torch

from ..planning.timing import keep_freed_host_memory
from ..ssl.knn import knn_of_run
from ..ssl.metrics_log import keep_offline_knn
from ..ssl.parallel import no_such_device
from ..ssl.report import REPORT, draw_report, read_run, summary


def device_of(text: str) -> str:
    """``--device``: ``auto`` is cuda where there is one, else cpu; a device this machine lacks is a
    ``ValueError`` (said before any work, not as the model failing to run its input). On a CPU the
    command then keeps the host memory a step frees, as the launcher does there: with glibc's default each
    step faults its activations' pages in again, a cost that grows with the step's peak, so ``bench``
    timed a wide ResNet-50's plain step slower than its checkpointed ones (docs/benchmarks.md)."""
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a device: cpu, cuda, cuda:N, or auto") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: torch sees {torch.cuda.device_count()} GPU(s) on this machine; use cpu, or auto")
    if no_such_device(device):
        raise ValueError(f"--device {text}: torch has no usable {device.type} device on this machine; use cpu, or auto")
    if device.type == "cpu":
        keep_freed_host_memory()
    return text


def run_knn(args) -> int:
    try:
        step, accuracies = knn_of_run(args.run_dir, args.train, args.val, args.untrained, device_of(args.device))
    except ValueError as e:  # the folders said as this command takes them
        said = str(e).replace("EVAL.KNN.TRAIN_PATH and VAL_PATH", "--train and --val").replace("EVAL.KNN.TRAIN_PATH", "--train")
        print(f"error: {said.replace('EVAL.KNN.VAL_PATH', '--val')}", file=sys.stderr)
        return 2
    which = "untrained (its config and seed)" if args.untrained else f"at step {step}"
    top5 = f", top-5 {accuracies['knn_top5']:.4f}" if "knn_top5" in accuracies else ""
    print(f"kNN of {args.run_dir} {which}: top-1 {accuracies['knn_top1']:.4f}{top5}")
    row = {"step": step, "untrained": args.untrained, "train": os.path.abspath(args.train), "val": os.path.abspath(args.val), **accuracies}
    try:
        print(f"kept for trunksplit report: {keep_offline_knn(args.run_dir, row)}")
    except OSError as e:  # a run folder one may read but not write: the result is printed above
        print(f"not kept ({e}): trunksplit report will not draw it", file=sys.stderr)
    return 0


def run_report(args) -> int:
    try:
        runs = [read_run(run_dir) for run_dir in args.run_dirs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary(run) for run in runs))
    output = args.output or (os.path.join(args.run_dirs[0], REPORT) if len(runs) == 1 else REPORT)
    print(f"picture: {draw_report(runs, output)}")
    return 0
