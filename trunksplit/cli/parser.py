"""The ``trunksplit`` command's arguments: ``plan`` shows how a trunk would be cut, ``bench`` measures
plans, ``fit`` finds the largest batch whose training step fits a memory size, ``bench-data`` measures
the recipes' input pipelines, ``knn`` evaluates a run's trunk by k-nearest neighbours, ``report``
draws a run's metrics.

This module imports no torch: ``--help`` and an argument error answer in a fraction of a second. The
module that runs a command (``COMMANDS``) is loaded once its arguments parse."""
import argparse
import contextlib
import importlib
import importlib.metadata
import os
import re
import sys
import tempfile
import warnings
from typing import List, Optional

from ..planning.budget import MemoryBudget, parse_memory_size
from ..planning.choices import GRADIENT_MODES, OBJECTIVES

# what ``trunksplit --help`` says: the module's docstring speaks to its readers, this to whoever runs it
DESCRIPTION = ("Plan activation checkpointing for a vision trunk and check it: see how a trunk would be cut (plan), measure plans (bench), "
               "find the largest batch that fits a memory size (fit), measure input pipelines (bench-data), evaluate a training run's trunk "
               "(knn) and draw its metrics (report). Training runs with python tools/train.py --config-file CONFIG in a clone.")

# each command and the module of this package that runs it, as ``run_<command>(args)``
COMMANDS = {"plan": "commands", "bench": "commands", "fit": "commands", "bench-data": "commands", "knn": "runs", "report": "runs"}

OBJECTIVE_HELP = ("what cost-aware plans minimise: time (recompute priced from ops timed while profiling) or flops (FLOPs run again); "
                  "auto: time on a GPU, flops on a CPU")
GRADIENTS_HELP = ("allocated: zero_grad() sets gradients to None (torch's default); kept: zero_grad(set_to_none=False); "
                  "in_backward: the optimizer (--optimizer) steps in backward, each gradient freed at its update")
ARCH_HELP = ("a torchvision classification model name (resnet50), timm:NAME (timm:convnext_atto) where timm is installed, "
             "or hf:TYPE (hf:vit, hf:deit, hf:dinov2, hf:convnextv2, hf:resnet, ...), a transformers model type's default config")
BENCH_ARCH_HELP = ("models, one table row group each: torchvision names (resnet50 vit_b_16), timm:NAME where timm is installed, "
                   "hf:TYPE (hf:vit, hf:resnet, ...: a transformers type trunksplit cuts)")
PLAN_ARCH_HELP = ARCH_HELP + "; another transformers type (hf:swin) is wrapped to --budget"
WIDTH_HELP = ("a torchvision ResNet's stages this many times as wide, as vissl's WIDTH_MULTIPLIER builds them: 2 and 4 are SimCLR's "
              "ResNet-50 (2x) and (4x); a fraction narrows it (0.25: 16 channels in the stem)")
OVERRIDES_HELP = "with --config-file: config overrides, KEY VALUE ..., before or after the flags"
DEVICE_HELP = "cpu, cuda, cuda:N, or auto: cuda where there is one, else cpu"
PLAN_WORLD_HELP = ("plan for one of N FSDP2 ranks (--input is one rank's batch); with --config-file, one of N ranks of its "
                   "DISTRIBUTED.STRATEGY (a DDP rank plans its whole trunk)")
FIT_WORLD_HELP = ("fit one of N FSDP2 ranks (predicted, not measured); with --config-file, one of N ranks of its DISTRIBUTED.STRATEGY "
                  "(DDP: its gradient buckets counted, checked by a real step)")


def main(argv: Optional[List[str]] = None) -> int:
    """Parse, then load the module that runs the command and run it."""
    parser = build_parser()
    args = parse_with_overrides(parser, argv, "opts")
    if args.command in ("plan", "fit") and args.config_file:
        _refuse_what_the_config_says(parser, args)
    if getattr(args, "opts", None) and not args.config_file:
        print(f"error: {_overrides_without_config(args.opts)}", file=sys.stderr)
        return 2
    runner = importlib.import_module(f"{__package__}.{COMMANDS[args.command]}")
    try:
        with warnings_as_lines():
            return getattr(runner, "run_" + args.command.replace("-", "_"))(args)
    except KeyboardInterrupt:  # Ctrl-C: a traceback would only say which line was running
        print(f"interrupted: trunksplit {args.command} stopped before it finished and kept nothing; run it again", file=sys.stderr)
        return 130  # a shell's code for a command ended by SIGINT


def parse_with_overrides(parser: argparse.ArgumentParser, argv: Optional[List[str]], overrides: str) -> argparse.Namespace:
    """``parser.parse_args(argv)`` where the positional ``overrides`` takes config overrides, KEY VALUE ...:
    they may come before, between and after the flags (``C KEY VALUE --memory 1GiB KEY VALUE``), and a
    value in exponent form is a value (``OPTIM.LR -1e-4``: argparse alone takes it for a flag it does not
    know). A word after the first flag that is neither is still a usage error, exit status 2."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, overrides, None) is None or any(t.startswith("-") and not _number(t) for t in extra):
            hint = f" (give a model with --arch {extra[0]})" if _is_model_name(extra[0]) else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        setattr(args, overrides, getattr(args, overrides) + extra)
    return args


def _overrides_without_config(opts: List[str]) -> str:
    """Why words after the flags are refused without ``--config-file``: they are config overrides (KEY VALUE) and
    need one; a model's name there (``trunksplit plan resnet50``) is pointed to ``--arch``."""
    if _is_model_name(opts[0]):
        return f"give the model with --arch {opts[0]} (words after the flags are config overrides, KEY VALUE, with --config-file)"
    return f"config overrides {' '.join(opts[:2])} ... need --config-file"


def _is_model_name(word: str) -> bool:
    """Whether ``word`` reads as a model ``--arch`` takes (resnet50, timm:NAME, hf:TYPE) rather than a config key
    (upper case, TRAIN.STEPS): a new user's first guess puts the model where the flags end (``trunksplit plan
    resnet50``). By its form, not torchvision's list: this module imports no torch."""
    return word.startswith(("timm:", "hf:")) or re.fullmatch(r"[a-z][a-z0-9_]*", word) is not None


@contextlib.contextmanager
def warnings_as_lines():
    """Within it, a warning prints as one line, ``warning: skipping unreadable image a.jpg``, with its kind
    where it is not a UserWarning. A command's warnings speak to whoever runs it: Python's form adds the
    file and line that warned and that line's source, which point into the library (or, by stacklevel, at the
    tool's call of it), not at what to change. Recording (``pytest.warns``) is untouched: it does not format."""
    before = warnings.formatwarning

    def as_line(message, category, filename, lineno, line=None):
        kind = "" if category is UserWarning else f" ({category.__name__})"
        return f"warning{kind}: {message}\n"

    warnings.formatwarning = as_line
    try:
        yield
    finally:
        warnings.formatwarning = before


# plan's and fit's flags that a config file sets instead: given with --config-file, they would be ignored
CONFIG_SAYS = {"arch": "MODEL.TRUNK.NAME", "width": "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "input": "DATA.CROP_SIZES", "optimizer": "OPTIM.NAME",
               "splits": "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "gradients": "TRAIN.GRADIENTS",
               "strategy": "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "budget": "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET",
               "features": "MODEL.TRUNK.OUT_FEAT_KEYS", "objective": None}  # the launcher plans with objective="auto"


def _refuse_what_the_config_says(parser: argparse.ArgumentParser, args) -> None:
    """``plan`` or ``fit`` with ``--config-file`` and ``--arch`` (say): refused, naming the config key to set instead."""
    defaults = parser.parse_args([args.command, "--memory", "1GiB"] if args.command == "fit" else [args.command])
    usage = f"trunksplit {args.command} --config-file CONFIG" + (" --memory SIZE" if args.command == "fit" else "")
    for dest, key in CONFIG_SAYS.items():
        if hasattr(defaults, dest) and getattr(args, dest) != getattr(defaults, dest):
            fix = f"set {key} after it ({usage} {key} VALUE)" if key else "the launcher plans with objective auto (time on a GPU, flops on a CPU)"
            parser.exit(2, f"trunksplit {args.command}: error: with --config-file the config says what --{dest} would: {fix}\n")


class _ParserWithDefaults(argparse.ArgumentParser):
    """A subcommand's parser whose ``--help`` shows each option's default beside its help as one would
    type it (``8x3x224x224``, ``0.5 0.45``); nothing where there is none (argparse's own formatter
    printed ``(default: None)``, ``(default: False)`` and a shape as a tuple) or the help says it."""

    def add_argument(self, *args, **kwargs):
        default, text = kwargs.get("default"), kwargs.get("help")
        if text and default not in (None, False, "", argparse.SUPPRESS) and "default:" not in text:
            kwargs["help"] = f"{text} (default: {_as_typed(default)})"
        return super().add_argument(*args, **kwargs)


def _as_typed(default) -> str:
    """A default as the command line spells it: a shape joined by x, a list by spaces."""
    if isinstance(default, tuple):
        return shape_text(default)
    return " ".join(map(str, default)) if isinstance(default, list) else str(default)


def _installed_version() -> str:
    """The installed distribution's version (``pip install -e .`` records it), read without importing the package."""
    try:
        return importlib.metadata.version("trunksplit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH, never installed
        return "(not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (``main`` runs what they ask; the docs test parses the documented calls)."""
    parser = argparse.ArgumentParser(prog="trunksplit", description=DESCRIPTION, epilog="trunksplit COMMAND --help: a command's flags")
    parser.add_argument("--version", action="version", version=f"trunksplit {_installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ParserWithDefaults)
    _add_plan_parser(sub)
    b = sub.add_parser("bench", help="measure plain, checkpoint_sequential, vissl, balanced and budget plans")
    b.add_argument("--arch", nargs="+", default=["resnet50"], help=BENCH_ARCH_HELP)
    b.add_argument("--width", type=float, default=1.0, help=WIDTH_HELP + "; every --arch must be a ResNet then")
    b.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every row steps, NxCxHxW, as plan's --input")
    b.add_argument("--splits", type=_positive, nargs="+", default=[4, 6], help="segment counts of the vissl and balanced rows")
    b.add_argument("--budgets", type=_budget, nargs="*", default=[0.5, 0.45], help="budget rows: fractions of the unsplit peak, bytes (2e9) or sizes (2GiB)")
    b.add_argument("--repeats", type=_positive, default=5, help="timed steps per row (the median is reported)")
    b.add_argument("--device", default="auto", help=DEVICE_HELP)
    b.add_argument("--out", type=_writable_dir, default="output/bench", help="where benchmark.md and benchmark.png are written")
    b.add_argument("--no-selective", action="store_true", help="skip the selective-wrapping rows")
    b.add_argument("--gradients", choices=GRADIENT_MODES, default="allocated", help=GRADIENTS_HELP + "; every row's, the plain trunk's too")
    b.add_argument("--optimizer", choices=["sgd", "lars", "adamw"], default="sgd", help="the optimizer each row steps in backward with --gradients in_backward")
    b.add_argument("--objective", choices=OBJECTIVES, nargs="+", default=["auto"], help=OBJECTIVE_HELP + " (the trunk's default); several: budget rows for each")
    f = sub.add_parser("fit", help="the largest batch whose whole training step fits a memory size, with its plan")
    f.add_argument("--arch", default="resnet50", help=ARCH_HELP)
    f.add_argument("--width", type=float, default=1.0, help=WIDTH_HELP)
    f.add_argument("--input", type=image_shape, default=(3, 224, 224), help="one image, CxHxW")
    f.add_argument("--memory", type=_memory, required=True, help="everything resident during a step: 16GiB, 500MiB, 2e9")
    f.add_argument("--optimizer", choices=["sgd", "lars", "adamw", "none"], default="sgd", help="whose state is resident (sgd, lars: one buffer per parameter; adamw: two)")
    f.add_argument("--splits", type=_positive, default=None, help="at most this many segments")
    f.add_argument("--gradients", choices=GRADIENT_MODES, default="allocated", help=GRADIENTS_HELP)
    f.add_argument("--device", default="auto", help=DEVICE_HELP + ": where the checking step runs")
    f.add_argument("--no-verify", action="store_true", help="predict only: skip the one measured step at the batch found")
    f.add_argument("--world-size", type=_positive, default=1, help=FIT_WORLD_HELP)
    f.add_argument("--config-file", default=None, help="fit the launcher's whole SSL step of this config (every crop group, head, loss, teacher); "
                   "--arch, --input, --optimizer, --splits and --gradients are then the config's to say (given too, refused)")
    f.add_argument("opts", nargs="*", help=OVERRIDES_HELP)
    _add_bench_data_parser(sub)
    _add_run_parsers(sub)
    return parser


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="print how a trunk (torchvision, timm:, hf:) would be cut, with predicted memory")
    p.add_argument("--arch", default="resnet50", help=PLAN_ARCH_HELP)
    p.add_argument("--width", type=float, default=1.0, help=WIDTH_HELP)
    p.add_argument("--splits", type=_positive, default=None, help="checkpoint segments to make (an upper bound with --budget); none: cut after the features only")
    p.add_argument("--strategy", choices=["vissl", "balanced"], default="vissl", help="vissl: cut by module count, as vissl did; balanced: cut where the memory is")
    p.add_argument("--budget", type=_budget, default=None, help="the least recompute whose peak fits: a fraction of the unsplit peak (0.5), bytes (2e9) or a size (2GiB)")
    p.add_argument("--features", nargs="+", default=None, help="feature blocks the trunk returns (res4 res5 ...); default: its last block (flatten for torchvision's)")
    p.add_argument("--input", type=batch_shape, default=(8, 3, 224, 224), help="the batch planned for, NxCxHxW")
    p.add_argument("--gradients", choices=GRADIENT_MODES, default="allocated", help=GRADIENTS_HELP)
    p.add_argument("--world-size", type=_positive, default=1, help=PLAN_WORLD_HELP)
    p.add_argument("--optimizer", choices=["sgd", "lars", "adamw", "none"], default="sgd", help="whose state the per-rank breakdown counts")
    p.add_argument("--objective", choices=OBJECTIVES, default="auto", help=OBJECTIVE_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP + ": where the units are measured, as the trunk there plans (on a GPU by the allocator)")
    p.add_argument("--config-file", default=None, help="the plan the launcher trains this config with, one per crop group, before a run; "
                   "its other flags but --world-size and --device are then the config's to say (given too, refused)")
    p.add_argument("opts", nargs="*", help=OVERRIDES_HELP)


def _add_bench_data_parser(sub) -> None:
    d = sub.add_parser("bench-data", help="images/s of each SSL recipe's input pipeline at several loader worker counts")
    d.add_argument("--recipes", nargs="+", default=["simclr", "swav", "dino"], help="names of configs/recipes/*.yaml (a clone's), or YAML files' paths")
    d.add_argument("--workers", type=_non_negative, nargs="+", default=[0, 1, 2, 4], help="DataLoader worker counts, one table column each")
    d.add_argument("--steps", type=_positive, default=8, help="timed steps per run, after one untimed step per worker")
    d.add_argument("--batch", type=_positive, default=16, help="images per step")
    d.add_argument("--folder", default="", help="an ImageFolder root of JPEGs; default: synthetic images written as JPEGs")
    d.add_argument("--jpegs", type=_positive, default=64, help="how many JPEGs to write when --folder is not given")


def _add_run_parsers(sub) -> None:
    k = sub.add_parser("knn", help="kNN accuracy of a run's trunk on labelled image folders (DINO's weighted kNN)")
    k.add_argument("run_dir", help="a run's OUTPUT_DIR (its config.yaml and checkpoint.pt)")
    k.add_argument("--train", required=True, help="an ImageFolder root (a folder per class): the neighbours")
    k.add_argument("--val", required=True, help="an ImageFolder root with the same classes: the images classified")
    k.add_argument("--untrained", action="store_true", help="evaluate the model the run started from (its config and seed, or its MODEL.WEIGHTS_INIT file): a baseline")
    k.add_argument("--device", default="auto", help=DEVICE_HELP)
    r = sub.add_parser("report", help="draw runs' loss, kNN accuracy, speed, memory and data wait, overlaid, into one PNG")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's OUTPUT_DIR (its metrics.jsonl); several: drawn over one another")
    r.add_argument("--output", help="the PNG to write (default: RUN_DIR/report.png for one run, report.png here for several)")


def _dims(text: str, count: int, example: str):
    """``8x3x224x224``, or as torch prints a shape: ``8,3,224,224``, ``(8, 3, 224, 224)``."""
    try:
        dims = tuple(int(d) for d in text.strip("() ").lower().replace(",", "x").split("x"))
    except ValueError:
        dims = ()
    if len(dims) != count or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected a shape of {count} sizes, each at least 1, like {example}, got {text!r}")
    return dims


def batch_shape(text: str):
    """``--input``'s NxCxHxW (``8x3x224x224``) as a tuple of four sizes, each at least 1."""
    return _dims(text, 4, "8x3x224x224")


def shape_text(shape) -> str:
    """A shape as ``--input`` spells it: ``(8, 3, 224, 224)`` is ``8x3x224x224`` (what :func:`batch_shape` reads)."""
    return "x".join(map(str, shape))


def image_shape(text: str):
    """``fit --input``'s CxHxW (``3x224x224``), one image, as a tuple of three sizes, each at least 1."""
    return _dims(text, 3, "3x224x224 (one image)")


def _budget(text: str) -> MemoryBudget:
    try:
        value = MemoryBudget.parse(text, "a budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value is None:
        raise argparse.ArgumentTypeError("a budget must be above 0: a fraction in (0, 1], bytes (2e9) or a size (2GiB)")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def _non_negative(text: str) -> int:
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return value


def _writable_dir(path: str) -> str:
    """Checked before a long run, not after it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write to {path!r}: {e.strerror or e}") from None
    return path


def _memory(text: str) -> int:
    try:
        return parse_memory_size(text, "--memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number(text: str) -> bool:
    """Whether ``text`` is a number (an override's value, ``-1e-4``), not a flag."""
    try:
        float(text)
    except ValueError:
        return False
    return True
