"""The ``trunksplit`` command: ``plan`` shows how a trunk would be cut, ``bench`` measures plans,
``fit`` finds the largest batch whose training step fits a memory size, ``bench-data`` measures
the recipes' input pipelines, ``knn`` evaluates a run's trunk by k-nearest neighbours, ``report``
draws a run's metrics."""
import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings
from typing import List, Optional

import torch

from tqdm import tqdm

from ..chains import expand_units, feature_blocks
from ..fit import NAMED_OPTIMIZERS, fit
from ..in_backward import update_temporaries
from ..planning.budget import MemoryBudget, parse_memory_size
from ..planning.request import GRADIENT_MODES, OBJECTIVES, PRICES
from ..planning.search import annotate, peak_model, plan_trunk
from ..planning.sharding import rank_memory
from ..ssl.backbones import build_backbone
from ..ssl.config import load_config
from ..ssl.fit_step import fit_step
from ..ssl.loop import step_for_fit
from ..trunk import CheckpointedTrunk
from .bench import run_benchmark
from .bench_data import run_data_benchmark
from .runs import add_run_parsers


OBJECTIVE_HELP = ("what cost-aware plans minimise: time (recompute priced from ops timed while profiling) or flops (FLOPs run again); "
                  "auto: time on a GPU, flops on a CPU")
GRADIENTS_HELP = ("allocated: zero_grad() sets gradients to None (torch's default); kept: zero_grad(set_to_none=False); "
                  "in_backward: the optimizer (--optimizer) steps in backward, each gradient freed at its update")


def _dims(text: str, count: int, example: str):
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != count or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected a shape like {example}, got {text!r}")
    return dims


def _shape(text: str):
    return _dims(text, 4, "8x3x224x224")


def _image_shape(text: str):
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


def _plan(args) -> int:
    x = torch.randn(*args.input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = build_backbone(args.arch, args.input[-1])
            trunk = CheckpointedTrunk(model, args.features, num_splits=args.splits, strategy=args.strategy, memory_budget=args.budget, gradients=args.gradients,
                                     objective=args.objective)
            if args.gradients == "in_backward":
                trunk.update_temporaries = _update_temporaries(args.optimizer)
            request = trunk.plan_request()
            # measured once, for the plan and its figures; for one of --world-size FSDP2 ranks
            with _progress(len(request.units), "profiling units") as step:
                costs = peak_model(request, x, regions=args.budget is not None, world_size=args.world_size, progress=step)
            _phase("searching the plan")
            plan = plan_trunk(request, x, costs) if request.cost_aware else annotate(trunk.plan_for(x), costs)
        except ValueError as e:
            print(f"error: {str(e).replace('MODEL.TRUNK.NAME', '--arch')}", file=sys.stderr)
            return 2
        except RuntimeError as e:  # the model cannot run this input (channels, size)
            print(f"error: {args.arch} cannot run an input of shape {'x'.join(map(str, args.input))}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    unsplit = costs.peak([0])
    print(plan)
    print(f"predicted step peak {plan.predicted_peak_bytes / 2**20:.1f} MiB = {plan.predicted_peak_bytes / unsplit:.2f} of unsplit ({unsplit / 2**20:.1f} MiB), input {'x'.join(map(str, args.input))}")
    optimizer = None if args.optimizer == "none" else args.optimizer
    # the trunk, not the model: blocks after the last requested feature, and the classifier, are not trained
    print(rank_memory(trunk, list(request.modules), args.world_size, optimizer, plan.predicted_peak_bytes, args.gradients))
    return 0


def _update_temporaries(optimizer: str) -> float:
    """What one parameter's update allocates, for ``--optimizer`` stepped in backward."""
    if optimizer == "none":
        raise ValueError("--gradients in_backward steps an optimizer in backward: name it with --optimizer (sgd, lars or adamw)")
    return update_temporaries(*NAMED_OPTIMIZERS[optimizer])


def _bench(args) -> int:
    for arch in args.arch:  # every name checked before an hour of measuring
        try:
            build_backbone(arch, args.resolution)
        except ValueError as e:
            print(f"error: {str(e).replace('MODEL.TRUNK.NAME', '--arch')}", file=sys.stderr)
            return 2

    try:
        table = run_benchmark(
            args.arch, batch=args.batch, resolution=args.resolution, splits=args.splits, budgets=args.budgets,
            repeats=args.repeats, device=args.device, out_dir=args.out, selective=not args.no_selective, gradients=args.gradients,
            objectives=args.objective,
        )
    except (RuntimeError, ValueError) as e:  # the model cannot run this batch or resolution
        print(f"error: cannot benchmark at batch {args.batch}, resolution {args.resolution}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(table)
    print(f"\nwritten to {args.out}/benchmark.md and {args.out}/benchmark.png")
    return 0


def _memory(text: str) -> int:
    try:
        return parse_memory_size(text, "--memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fit(args) -> int:
    if args.config_file:
        return _fit_config(args)
    if args.opts:
        print(f"error: config overrides {' '.join(args.opts[:2])} ... need --config-file", file=sys.stderr)
        return 2
    try:
        model = build_backbone(args.arch, args.input[-1]).to(args.device)
        _phase(f"fitting: profiling, then searching the largest batch{'' if args.no_verify else ', then one real step checks it'}")
        with _progress(2 * len(expand_units(feature_blocks(model))), "profiling units at two batches") as step:
            found = fit(model, args.input, args.memory, optimizer=None if args.optimizer == "none" else args.optimizer,
                        num_splits=args.splits, gradients=args.gradients, verify=not args.no_verify, world_size=args.world_size, progress=step)
    except ValueError as e:
        print(f"error: {str(e).replace('MODEL.TRUNK.NAME', '--arch')}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {args.arch} cannot run an input of shape {'x'.join(map(str, args.input))}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(found.plan)
    print(found)
    print(found.rank)
    print(f"the batch counts images of {'x'.join(map(str, args.input))} through the trunk alone, with a surrogate loss: for an SSL run "
          "(its views, crop groups, head, loss and teacher) fit its config: trunksplit fit --config-file CONFIG --memory SIZE")
    if args.world_size > 1:
        print(f"a prediction for one of {args.world_size} FSDP2 ranks: --memory and the batch are per rank (one process cannot run the sharded step to check it)")
    return 0


def _fit_config(args) -> int:
    """``fit --config-file``: the launcher's whole step (every crop group, head, loss, teacher, optimizer
    state), as ``TRAIN.BATCH_SIZE_PER_RANK 0`` fits it; one line per phase on stderr."""
    try:
        cfg = load_config(args.config_file, [*args.opts, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(args.memory))])
        found = fit_step(cfg, torch.device(args.device), step_for_fit(cfg, contextlib.nullcontext()), args.world_size,
                         lambda line: print(f"fit: {line}", file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(found)
    views = sum(cfg.DATA.CROP_COUNTS)
    print(f"images: each brings {views} crops ({' + '.join(f'{n} x {s}px' for s, n in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS))}); "
          f"train with TRAIN.BATCH_SIZE_PER_RANK 0 TRAIN.MEMORY_LIMIT {float(args.memory):.4g} (or BATCH_SIZE_PER_RANK {found.images})")
    return 0


@contextlib.contextmanager
def _progress(total: int, what: str):
    """A progress bar on stderr (the table goes to stdout), stepped once per call of what it yields;
    where stderr is not a terminal (a log file), a plain line as the phase starts and one as it ends."""
    start = time.perf_counter()
    with tqdm(total=total, desc=what, file=sys.stderr, leave=False, disable=None) as bar:
        if bar.disable:
            print(f"{what}: {total} ...", file=sys.stderr, flush=True)
        yield lambda _name: bar.update(1)
        if bar.disable:
            print(f"{what}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _phase(line: str) -> None:
    """One phase of a command, said on stderr, terminal or not."""
    print(line, file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


class _ParserWithDefaults(argparse.ArgumentParser):
    """A subcommand's parser whose ``--help`` shows every option's default beside its help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (``main`` runs what they ask; the docs test parses the documented calls)."""
    parser = argparse.ArgumentParser(prog="trunksplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ParserWithDefaults)
    p = sub.add_parser("plan", help="print how a torchvision trunk would be cut, with predicted memory")
    p.add_argument("--arch", default="resnet50", help="a torchvision classification model name")
    p.add_argument("--splits", type=_positive, default=None, help="checkpoint segments to make (an upper bound with --budget); none: cut after the features only")
    p.add_argument("--strategy", choices=["vissl", "balanced"], default="vissl", help="vissl: cut by module count, as vissl did; balanced: cut where the memory is")
    p.add_argument("--budget", type=_budget, default=None, help="the least recompute whose peak fits: a fraction of the unsplit peak (0.5), bytes (2e9) or a size (2GiB)")
    p.add_argument("--features", nargs="+", default=["flatten"], help="feature blocks the trunk returns (res4 res5 ...)")
    p.add_argument("--input", type=_shape, default=(8, 3, 224, 224), help="e.g. 8x3x224x224")
    p.add_argument("--gradients", choices=GRADIENT_MODES, default="allocated", help=GRADIENTS_HELP)
    p.add_argument("--world-size", type=_positive, default=1, help="plan for one of N FSDP2 ranks (--input is one rank's batch)")
    p.add_argument("--optimizer", choices=["sgd", "lars", "adamw", "none"], default="sgd", help="whose state the per-rank breakdown counts")
    p.add_argument("--objective", choices=OBJECTIVES, default="auto", help=OBJECTIVE_HELP)
    p.set_defaults(fn=_plan)
    b = sub.add_parser("bench", help="measure plain, checkpoint_sequential, vissl, balanced and budget plans")
    b.add_argument("--arch", nargs="+", default=["resnet50"], help="torchvision model names, one table row group each")
    b.add_argument("--batch", type=_positive, default=4, help="images per step")
    b.add_argument("--resolution", type=_positive, default=224, help="image height and width")
    b.add_argument("--splits", type=_positive, nargs="+", default=[4, 6], help="segment counts of the vissl and balanced rows")
    b.add_argument("--budgets", type=_budget, nargs="*", default=[0.5, 0.45], help="budget rows: fractions of the unsplit peak, bytes (2e9) or sizes (2GiB)")
    b.add_argument("--repeats", type=_positive, default=5, help="timed steps per row (the median is reported)")
    b.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu, cuda or cuda:N")
    b.add_argument("--out", type=_writable_dir, default="output/bench", help="where benchmark.md and benchmark.png are written")
    b.add_argument("--no-selective", action="store_true", help="skip the selective-wrapping rows")
    b.add_argument("--gradients", choices=GRADIENT_MODES[:2], default="allocated", help=GRADIENTS_HELP.split("; in_backward")[0])
    b.add_argument("--objective", choices=PRICES, nargs="+", default=["flops"], help=OBJECTIVE_HELP.split("; auto")[0] + "; several: budget rows for each")
    b.set_defaults(fn=_bench)
    f = sub.add_parser("fit", help="the largest batch whose whole training step fits a memory size, with its plan")
    f.add_argument("--arch", default="resnet50", help="a torchvision classification model name")
    f.add_argument("--input", type=_image_shape, default=(3, 224, 224), help="one image, e.g. 3x224x224")
    f.add_argument("--memory", type=_memory, required=True, help="everything resident during a step: 16GiB, 500MiB, 2e9")
    f.add_argument("--optimizer", choices=["sgd", "lars", "adamw", "none"], default="sgd", help="whose state is resident (sgd, lars: one buffer per parameter; adamw: two)")
    f.add_argument("--splits", type=_positive, default=None, help="at most this many segments")
    f.add_argument("--gradients", choices=GRADIENT_MODES, default="allocated", help=GRADIENTS_HELP)
    f.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu, cuda or cuda:N: where the checking step runs")
    f.add_argument("--no-verify", action="store_true", help="predict only: skip the one measured step at the batch found")
    f.add_argument("--world-size", type=_positive, default=1, help="fit one of N FSDP2 ranks (predicted, not measured)")
    f.add_argument("--config-file", default=None, help="fit the launcher's whole SSL step of this config (every crop group, head, loss, teacher); "
                   "--arch, --input, --optimizer, --splits and --gradients are then the config's")
    f.add_argument("opts", nargs=argparse.REMAINDER, help="with --config-file: config overrides, KEY VALUE ...")
    f.set_defaults(fn=_fit)
    _add_bench_data_parser(sub)
    add_run_parsers(sub)
    return parser


def _add_bench_data_parser(sub) -> None:
    d = sub.add_parser("bench-data", help="images/s of each SSL recipe's input pipeline at several loader worker counts")
    d.add_argument("--recipes", nargs="+", default=["simclr", "swav", "dino"], help="names of configs/recipes/*.yaml")
    d.add_argument("--workers", type=_non_negative, nargs="+", default=[0, 1, 2, 4], help="DataLoader worker counts, one table column each")
    d.add_argument("--steps", type=_positive, default=8, help="timed steps per run, after one untimed step per worker")
    d.add_argument("--batch", type=_positive, default=16, help="images per step")
    d.add_argument("--folder", default="", help="an ImageFolder root of JPEGs; default: synthetic images written as JPEGs")
    d.add_argument("--jpegs", type=_positive, default=64, help="how many JPEGs to write when --folder is not given")
    d.set_defaults(fn=_bench_data)


def _bench_data(args) -> int:
    try:
        run_data_benchmark(args.recipes, args.workers, args.steps, args.batch, args.folder, args.jpegs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _cuda() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
