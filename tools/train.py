#!/usr/bin/env python
"""Train a self-supervised model on a checkpointed trunk.

    python tools/train.py --config-file configs/quickstart.yaml [KEY VALUE ...] [--resume]
    torchrun --standalone --nproc_per_node=2 tools/train.py --config-file configs/quickstart.yaml
"""
import argparse
import os
import signal
import sys

from trunksplit.cli.parser import parse_with_overrides, warnings_as_lines
from trunksplit.ssl.config import load_config
from trunksplit.ssl.loop import train
from trunksplit.ssl.metrics_log import images_per_second
from trunksplit.ssl.stopping import Stopped, interrupted_note


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", default="", help="YAML file that overrides the defaults in trunksplit/ssl/config.py")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt")
    parser.add_argument("overrides", nargs="*", help="KEY VALUE pairs, e.g. TRAIN.STEPS 5")
    return parser


def main(argv=None) -> int:
    args = parse_with_overrides(build_parser(), argv, "overrides")
    if not args.config_file and os.environ.get("RANK", "0") == "0":  # one line, from one process under torchrun
        print("no --config-file: training the defaults of trunksplit/ssl/config.py and the overrides given "
              "(the quick start: --config-file configs/quickstart.yaml; all configs: configs/)", flush=True)
    cfg = None
    try:
        with warnings_as_lines():
            cfg = load_config(args.config_file, args.overrides)
            _, last = train(cfg, resume=args.resume)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: where the run can go on from, not a traceback
        if cfg is not None and os.environ.get("RANK", "0") == "0":
            print(f"\n{interrupted_note(cfg.OUTPUT_DIR, cfg.TRAIN.CHECKPOINT_EVERY)}", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)
    if last is not None:
        chance = last["chance_loss"]
        learned = f" ({last['loss'] / chance:.2f} of {chance:.4f}, the loss of a model that learned nothing)" if chance else ""
        print(
            f"done: step {last['step']}, loss {last['loss']:.4f}{learned}, {images_per_second(last['images_per_sec'])} images/s, "
            f"step peak {last['peak_memory_bytes'] / 2**20:.1f} MiB beyond {last['peak_beyond']} "
            f"(trunk plan: {last['plan']})"
        )
        side_by_side = _side_by_side(last["memory_vs_plain"], last["memory_vs_plain_not_run"], last["peak_memory_bytes"], last["step_also_holds"])
        if side_by_side:
            print(side_by_side)
        print(f"metrics: {cfg.OUTPUT_DIR}/metrics.jsonl")
        whose = "the teacher's trunk weights" if cfg.METHOD.NAME == "dino" else "the trunk's weights"
        print(f"{whose}, under {cfg.MODEL.TRUNK.NAME}'s names: {cfg.OUTPUT_DIR}/trunk.pt")
    return 0


def _side_by_side(vs, not_run: str, step_peak: int, also_holds: list) -> str:
    """The summary's line on one step with and without checkpointing, or why it was not run (``not_run``). Both
    copies run the student under a stand-in loss: where the step holds more
    (``also_holds``: DINO's teacher, vissl's all-reduce), the line says why it reads below the step peak."""
    if vs:
        line = (f"memory, one step side by side: checkpointed {vs['checkpointed'] / 2**20:.1f} MiB, "
                f"without checkpointing {vs['plain'] / 2**20:.1f} MiB ({vs['checkpointed'] / vs['plain']:.2f}x)")
        if vs["checkpointed"] < 0.99 * step_peak:
            held = also_holds[0] if len(also_holds) == 1 else f"{', '.join(also_holds[:-1])} and {also_holds[-1]}"
            line += f" (the student alone under a stand-in loss: the step peak above also holds {held})"
        return line
    return f"memory, one step side by side: not run ({not_run})" if not_run else ""


if __name__ == "__main__":
    sys.exit(main())
