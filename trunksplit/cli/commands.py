"""What ``trunksplit plan``, ``bench``, ``fit`` and ``bench-data`` run, once their arguments parse
(:mod:`trunksplit.cli.parser`); ``knn`` and ``report`` run in ``runs.py``."""
import contextlib
import os
import sys
import time
import warnings

import torch

from tqdm import tqdm

from ..chains import expand_units, feature_blocks
from ..fit import NAMED_OPTIMIZERS, fit
from ..in_backward import update_temporaries
from ..planning.budget import BudgetTooLowError
from ..planning.search import annotate, peak_model, plan_trunk
from ..planning.sharding import rank_memory
from ..planning.wrap import apply_activation_checkpointing
from ..ssl.backbones import HF, build_backbone, build_hf_model, check_resnet_width, hf_is_chain
from ..ssl.config import load_config
from ..ssl.data import image_dataset
from ..recompute.wrapper import checkpoint_wrapped_names
from ..ssl.fit_step import crop_groups, crop_shapes, fit_step
from ..ssl.grouped import backward_calls, held_calls
from ..ssl.loop import step_for_fit
from ..ssl.model import budget_refused, build_trunk, feature_width
from ..ssl.optim import optimizer_of
from ..ssl.parallel import autocast_for
from ..ssl.strategy import as_trained
from ..trunk import CheckpointedTrunk
from .bench import run_benchmark
from .bench_data import run_data_benchmark
from .runs import device_of

# the library's spellings in the messages it raises, and what a user of the command types instead
LIBRARY_TO_FLAGS = (
    ("MODEL.TRUNK.NAME", "--arch"),
    ('gradients="allocated"', "--gradients allocated, the default"),
    ('gradients="kept"', "--gradients kept"),
    ('gradients="in_backward"', "--gradients in_backward (with --optimizer)"),
    ("trunksplit.fit finds", "trunksplit fit --memory SIZE finds"),
    ("larger batch makes", "larger batch (--input) makes"),
)


def _library_error(e: Exception) -> None:
    """Print a refusal the library raised, in the command line's terms (see :data:`LIBRARY_TO_FLAGS`)."""
    said = str(e)
    for library, flags in LIBRARY_TO_FLAGS:
        said = said.replace(library, flags)
    print(f"error: {said}", file=sys.stderr)


def _input_or_library_error(e: Exception, arch: str, shape) -> None:
    """Print why a command stopped: the model failing to run the input (torch's error: channels, a size, or a
    BatchNorm given one value per channel, torch's ``ValueError``), or a refusal of trunksplit's in the flags' terms."""
    if isinstance(e, ValueError) and not _raised_in_torch(e):
        _library_error(e)
    else:
        print(f"error: {arch} cannot run an input of shape {'x'.join(map(str, shape))}: {str(e).splitlines()[0]}", file=sys.stderr)


def _raised_in_torch(e: Exception) -> bool:
    """Whether ``e`` was raised by torch's own code (its innermost frame), not by trunksplit's."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep)


def run_plan(args) -> int:
    try:
        device = device_of(args.device)  # before any model: a missing GPU is no fault of its input
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.config_file:
        return _plan_config(args, device)
    try:
        check_resnet_width(args.arch, args.width, "--width")  # before a transformers type is wrapped without it
    except ValueError as e:
        _library_error(e)
        return 2
    if _wrapped_only(args.arch):
        return _plan_wrapped(args, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = build_backbone(args.arch, args.input[-1], args.width).to(device)
            trunk = CheckpointedTrunk(model, args.features or list(feature_blocks(model))[-1:], num_splits=args.splits, strategy=args.strategy, memory_budget=args.budget, gradients=args.gradients,
                                     objective=args.objective)
            if args.gradients == "in_backward":
                trunk.update_temporaries = _update_temporaries(args.optimizer, device)
            plan, unsplit = _measured_plan(trunk, torch.randn(*args.input, device=device), args.world_size)
        except (RuntimeError, ValueError) as e:
            _input_or_library_error(e, args.arch, args.input)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    _print_plan(plan, unsplit, args.input)
    # the trunk, not the model: blocks after the last requested feature, and the classifier, are not trained
    print(rank_memory(trunk, list(trunk.plan_request().modules), args.world_size, None if args.optimizer == "none" else args.optimizer,
                      plan.predicted_peak_bytes, args.gradients))
    return 0


def _measured_plan(trunk: CheckpointedTrunk, x: torch.Tensor, world_size: int, held: bool = False):
    """The plan ``trunk`` makes for ``x`` (in a call whose updates in backward are ``held``), with the predicted
    peak of each segment, and the unsplit step's peak: its units measured once, for one of ``world_size`` FSDP2 ranks."""
    request = trunk.plan_request(held)
    with _progress(len(request.units), "profiling units") as step:
        costs = peak_model(request, x, regions=request.budget is not None, world_size=world_size, progress=step)
    _phase("searching the plan")
    plan = plan_trunk(request, x, costs, held=held) if request.cost_aware else annotate(trunk.plan_for(x), costs)
    return plan, costs.peak([0])


def _print_plan(plan, unsplit: int, shape) -> None:
    print(plan)
    print(f"predicted step peak {plan.predicted_peak_bytes / 2**20:.1f} MiB = {plan.predicted_peak_bytes / unsplit:.2f} of unsplit "
          f"({unsplit / 2**20:.1f} MiB), input {'x'.join(map(str, shape))}")


def _plan_config(args, device: str) -> int:
    """``plan --config-file``: the plan the launcher's trunk makes for each crop group's call, before a run."""
    try:
        cfg, layout = as_trained(load_config(args.config_file, args.opts), args.world_size)
        if cfg.TRAIN.BATCH_SIZE_PER_RANK == 0:
            raise ValueError("TRAIN.BATCH_SIZE_PER_RANK 0 fits the batch when the run starts: trunksplit fit --config-file CONFIG --memory SIZE "
                             "prints that batch and each crop group's plan")
        trunk = build_trunk(cfg)
        feature_width(trunk, cfg)  # every crop size runs
        trunk.to(device)
        if len(cfg.MODEL.ACTIVATION_CHECKPOINTING.SELECT):
            wrapped = checkpoint_wrapped_names(trunk)
            print(f"MODEL.ACTIVATION_CHECKPOINTING.SELECT wraps {len(wrapped)} blocks, each its own checkpoint (no segments to plan): {' '.join(wrapped)}")
            return 0
        if trunk.gradients == "in_backward":
            trunk.update_temporaries = update_temporaries(*optimizer_of(cfg), device)  # the run's optimizer, as it builds it
        batch, groups = cfg.TRAIN.BATCH_SIZE_PER_RANK, crop_groups(cfg)
        crops = crop_shapes(cfg)
        held, read = held_calls(cfg, crops), backward_calls(cfg, crops)
        for k, (size, count) in enumerate(groups):
            shape = (batch * count, 3, size, size)
            print(f"{'' if k == 0 else chr(10)}group {k + 1}: {count} x {size}px crops per image, the trunk on {batch * count} per rank"
                  + (", updates held until the last group's: its backward keeps every gradient" if held[k] else "")
                  + ("" if read[k] else ", without a graph (a lone large crop, read by no loss term): nothing saved, no plan"))
            if not read[k]:
                continue
            try:
                _print_plan(*_measured_plan(trunk, torch.randn(*shape, device=device), layout.world, held[k]), shape)
            except BudgetTooLowError as e:
                raise ValueError(budget_refused(cfg, trunk, e)) from None
        print("\neach peak is the trunk's own step; the whole SSL step (head, loss, teacher, every crop group) is what "
              "trunksplit fit --config-file CONFIG --memory SIZE fits")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _wrapped_only(arch: str) -> bool:
    """``hf:TYPE`` that trunksplit cannot cut (a type transformers lacks is refused as any unknown name is)."""
    try:
        return arch.startswith(HF) and not hf_is_chain(arch)
    except ValueError:
        return False


def _plan_wrapped(args, device: str) -> int:
    """``plan --arch hf:TYPE``: a model trunksplit cannot cut, wrapped block by block to ``--budget``."""
    if args.budget is None:
        print(f"error: {args.arch} is wrapped block by block to a memory budget, not cut into segments: pass --budget (0.5, 2GiB)", file=sys.stderr)
        return 2
    try:
        model = build_hf_model(args.arch, args.input[-1]).to(device)
        x = torch.randn(*args.input, device=device)
        _phase(f"measuring {args.arch}'s blocks, then wrapping those that meet the budget with the least recompute")
        plan = apply_activation_checkpointing(model, memory_budget=args.budget, example_inputs=(x,), gradients=args.gradients,
                                              update_temporaries=_update_temporaries(args.optimizer, device) if args.gradients == "in_backward" else None)
    except ValueError as e:
        _library_error(e)
        return 2
    print(plan)
    print(f"in your code: trunksplit.apply_activation_checkpointing(model, memory_budget=..., example_inputs=(batch,)), input {'x'.join(map(str, args.input))}")
    return 0


def _update_temporaries(optimizer: str, device) -> float:
    """What one parameter's update on ``device`` allocates, for ``--optimizer`` stepped in backward."""
    if optimizer == "none":
        raise ValueError("--gradients in_backward steps an optimizer in backward: name it with --optimizer (sgd, lars or adamw)")
    return update_temporaries(*NAMED_OPTIMIZERS[optimizer], device)


def run_bench(args) -> int:
    try:  # the device and every name checked before an hour of measuring
        device = device_of(args.device)
        for arch in args.arch:
            check_resnet_width(arch, args.width, "--width")
            build_backbone(arch, args.input[-1])
    except ValueError as e:
        _library_error(e)
        return 2

    try:
        table = run_benchmark(
            args.arch, input_shape=args.input, splits=args.splits, budgets=args.budgets,
            repeats=args.repeats, device=device, out_dir=args.out, selective=not args.no_selective, gradients=args.gradients,
            objectives=args.objective, optimizer=args.optimizer, width=args.width,
        )
    except (RuntimeError, ValueError) as e:  # the model cannot run this input
        print(f"error: cannot benchmark an input of shape {'x'.join(map(str, args.input))}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(table)
    print(f"\nwritten to {args.out}/benchmark.md and {args.out}/benchmark.png")
    return 0


def run_fit(args) -> int:
    if args.config_file:
        return _fit_config(args)
    try:
        device = device_of(args.device)  # before the model: a missing GPU is no fault of its input
        check_resnet_width(args.arch, args.width, "--width")
        model = build_backbone(args.arch, args.input[-1], args.width).to(device)
        _phase(f"fitting: profiling, then searching the largest batch{'' if args.no_verify else ', then one real step checks it'}")
        with _progress(2 * len(expand_units(feature_blocks(model))), "profiling units at two batches") as step:
            found = fit(model, args.input, args.memory, optimizer=None if args.optimizer == "none" else args.optimizer,
                        num_splits=args.splits, gradients=args.gradients, verify=not args.no_verify, world_size=args.world_size, progress=step)
    except (RuntimeError, ValueError) as e:
        _input_or_library_error(e, args.arch, args.input)
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
        cfg, layout = as_trained(load_config(args.config_file, [*args.opts, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(args.memory))]),
                                 args.world_size)
        device = torch.device(device_of(args.device))
        found = fit_step(cfg, device, step_for_fit(cfg, autocast_for(cfg, device)), layout,
                         lambda line: print(f"fit: {line}", file=sys.stderr, flush=True), len(image_dataset(cfg)) // args.world_size,
                         verify=not args.no_verify)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(found)
    views = sum(cfg.DATA.CROP_COUNTS)
    print(f"images: each brings {views} crops ({' + '.join(f'{n} x {s}px' for s, n in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS))}); "
          f"train with TRAIN.BATCH_SIZE_PER_RANK 0 TRAIN.MEMORY_LIMIT {args.memory} (or BATCH_SIZE_PER_RANK {found.images})")
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


def run_bench_data(args) -> int:
    try:
        run_data_benchmark(args.recipes, args.workers, args.steps, args.batch, args.folder, args.jpegs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
