"""The training loop: one process or many (``torchrun``), either DDP path, resumable.

:func:`train` is the recipe; the config (``config.py``), the model (``model.py``), the
processes (``parallel.py``), the data (``data.py``) and the run's directory (``run_dir.py``)
live beside it.
"""
import contextlib
import os
import sys
import time
import warnings
from typing import Callable, Optional, Tuple

import torch
from tqdm import tqdm

from ..in_backward import update_temporaries
from ..planning.budget import BudgetTooLowError, format_bytes
from ..planning.plan import SplitPlan
from ..planning.timing import synchronize
from ..recompute.wrapper import checkpoint_wrapped_names
from .cpu_bf16 import refuse_wrong_bf16_convolutions
from .data import check_images_a_step, image_dataset, num_workers, step_loader, step_views
from .knn import KnnMonitor, evaluated_trunk
from .dino import dino_step_loss, teacher_momentum, teacher_outputs, update_teacher
from .fit_step import crop_groups, crop_shapes, fitted_batch
from .grouped import backward_calls, by_crop_group, grouped_step, held_calls
from .losses import chance_loss, nt_xent, swav_loss
from .metrics_log import MetricsLog, check_tensorboard, images_per_second
from .model import SSLModel, budget_refused, build_ssl_model, with_batch
from .optim import apply_gradient_rule, build_optimizer, gradient_rule, keep_gradients, optimizer_of, set_schedules, with_scaled_lr
from .parallel import autocast_for, setup_distributed, warn_of_slow_half_precision_on_a_cpu
from .side_by_side import not_run_because, side_by_side
from .run_dir import CHECKPOINT, Resumed, check_output_dir, resume_from, rng_states, save_trunk_weights, saved_batch, start_run_dir
from .stopping import EvaluationStopped, StopSignals, next_unless_stopping, stop_between_steps, stop_if_asked, until_stopped
from .strategy import strategy_for
from .swav import check_queue_shares, swav_codes
from .weights_init import check_weights_file, start_from_weights


def train(cfg, resume: bool = False) -> Tuple[SSLModel, Optional[dict]]:
    """Train as ``cfg`` says; returns the model and, on rank 0, the last logged metrics."""
    rank, world, device = setup_distributed(cfg)
    strategy = strategy_for(cfg, rank, world, device)
    _check_before_start(cfg, resume, device, strategy)
    dataset = image_dataset(cfg)  # fails early on a bad DATA.PATH, before anything is written; its images bound a step's
    cfg, fitted_plans = _batch_to_train(strategy.configured(cfg), device, strategy, resume, len(dataset) // world)
    check_images_a_step(cfg, world, len(dataset))
    cfg = with_scaled_lr(cfg, world, rank)
    monitor = KnnMonitor(cfg) if cfg.EVAL.KNN.TRAIN_PATH else None  # and on bad kNN folders
    torch.manual_seed(cfg.SEED)
    model = _build_model(cfg, device, fitted_plans, resume, rank)
    wrapped = strategy.wrap(cfg, model)
    optimizer = build_optimizer(cfg, model, wrapped)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.TRAIN.AUTOCAST == "fp16")
    resumed = resume_from(cfg, model, optimizer, scaler, rank, world, strategy.load) if resume else Resumed()
    start, skipped = resumed.step, resumed.skipped
    autocast, kept = autocast_for(cfg, device), cfg.TRAIN.GRADIENTS == "kept"
    # planned before anything is written: an infeasible MEMORY_BUDGET leaves no run directory behind
    setup_seconds = _set_up_before_timing(cfg, model, optimizer, dataset, start, rank, world, device, autocast)
    log = _start_logging(cfg, resumed, rank)  # rank 0's; None on the others
    if monitor is not None and start == 0:  # the untrained point each kNN curve starts from
        _log_untrained_knn(log, _evaluate(monitor, strategy, wrapped, model, cfg, device, autocast))
    bar = tqdm(range(start, cfg.TRAIN.STEPS), initial=start, total=cfg.TRAIN.STEPS, disable=rank != 0 or not sys.stderr.isatty(), desc="train")  # a log file: plain lines
    batches, last = iter(step_loader(dataset, cfg, rank, world, start, pin_memory=device.type == "cuda")), None
    with stop_between_steps(say=rank == 0) as signals:  # Ctrl-C, SIGTERM, SIGHUP: every rank stops between the same two steps
        for step in bar:
            crops, data = _next_step_views(batches, device, skipped, signals)
            stop_if_asked(strategy.largest(signals.signum), step, start, lambda: _save_checkpoint(cfg, strategy, model, optimizer, scaler, step, skipped, now=True))
            rule = _begin_step(cfg, model, optimizer, step)
            evaluating = monitor is not None and monitor.due(step + 1, cfg.TRAIN.STEPS)
            logging = step % cfg.TRAIN.LOG_EVERY == 0 or step == cfg.TRAIN.STEPS - 1 or evaluating
            start_time = time.perf_counter()
            with strategy.meter(wrapped) if logging else contextlib.nullcontext() as mem:
                loss = strategy.forward_backward(wrapped, lambda: _forward_backward(cfg, wrapped, model, crops, step, autocast, scaler, lambda: strategy.accumulating(wrapped)))
            _stop_unless_finite(cfg, loss, step, strategy.largest, scaler)
            _optimizer_step(cfg, model, optimizer, scaler, step, device, rule)
            seconds = time.perf_counter() - start_time
            _save_checkpoint(cfg, strategy, model, optimizer, scaler, step + 1, skipped)  # first: an evaluation never costs the training
            if evaluating:  # cut short by a stop signal: none, and the run stops before its next step
                data.update(_evaluate(monitor, strategy, wrapped, model, cfg, device, autocast, signals))
            if logging and rank == 0:
                last = _log_row(cfg, log, bar, step, loss, optimizer, seconds, mem.peak_bytes, world, setup_seconds if step == start else None, data)
    _finish(cfg, strategy, wrapped, model)
    if start < cfg.TRAIN.STEPS:  # a step ran, on every rank (under FSDP2 every rank steps the side-by-side copies)
        _summarise(cfg, log, last, model, optimizer, crops, autocast, kept, strategy, world)
    return model, last


def _finish(cfg, strategy, wrapped, model) -> None:
    """Every rank ends alike; then the trained trunk (DINO: its teacher, what DINO evaluates) is written for use elsewhere."""
    strategy.finish(wrapped, model)
    save_trunk_weights(cfg.OUTPUT_DIR, model.trunk, strategy.whole_state(evaluated_trunk(model)), strategy.rank)


def _check_before_start(cfg, resume: bool, device, strategy) -> None:
    """What can be refused before anything is run or written: the output directory, the logging, a bf16
    run on a CPU whose convolutions torch computes wrong (every rank takes rank 0's answer); and, said by
    rank 0, a half precision this CPU runs slowly."""
    check_output_dir(cfg.OUTPUT_DIR, resume, strategy.agree)
    if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE and not resume:
        check_weights_file(cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE)
    check_tensorboard(cfg.LOGGING.TENSORBOARD)
    check_queue_shares(cfg, strategy.world)
    refuse_wrong_bf16_convolutions(cfg, device, strategy.agree)
    if strategy.rank == 0:
        warn_of_slow_half_precision_on_a_cpu(cfg, device)


def _start_logging(cfg, resumed: Resumed, rank: int) -> Optional[MetricsLog]:
    """Rank 0, once everything is checked: the run's directory, its config and the rows logged up to
    the resumed step, then the log the steps go to; None on the other ranks."""
    if rank != 0:
        return None
    start_run_dir(cfg, resumed.rows)
    return MetricsLog(cfg.OUTPUT_DIR, cfg.LOGGING.TENSORBOARD, first_step=resumed.step + 1 if resumed.step else 0)


def _log_untrained_knn(log: Optional[MetricsLog], accuracies: dict) -> None:
    """A new run's step-0 row: the kNN accuracies of the model before its first step (every rank
    evaluated; rank 0 writes): the baseline each kNN curve starts from."""
    if log is None:
        return
    log.write({"step": 0, **accuracies})
    print(f"step 0 (untrained)  kNN top-1 {accuracies['knn_top1']:.3f}", flush=True)


def _build_model(cfg, device, fitted_plans: list, resume: bool, rank: int) -> SSLModel:
    """The model to train, from the weights file the config names (resumed, the checkpoint's instead); its
    trunk runs the plans a whole-step fit checked (not ones measured again)."""
    model = build_ssl_model(cfg)
    if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE and not resume:
        said = start_from_weights(model, cfg)
        if rank == 0:
            print(f"trunk weights: {said}", flush=True)
    model.to(device)
    if cfg.OPTIM.IN_BACKWARD:  # what the run's optimizer will mark: set now, the fitted plans (made for it) are kept then
        model.trunk.update_temporaries = update_temporaries(*optimizer_of(cfg), device)
    for key, plan in fitted_plans:
        model.trunk.store_plan(key, SplitPlan.from_state(plan))
    return model


def _begin_step(cfg, model, optimizer, step: int):
    """Set this step's schedules (learning rate, weight decay), and DINO's stabilisers for it
    (``gradient_rule``), run on each reduced gradient before its update: stepped in backward,
    handed to the optimizer now, before backward (returns None); else returned, for the optimizer
    step after backward."""
    set_schedules(cfg, optimizer, step)
    rule = gradient_rule(cfg, model, step)
    if not cfg.OPTIM.IN_BACKWARD:
        return rule
    apply_gradient_rule(rule, optimizer)
    return None


def _evaluate(monitor, strategy, wrapped, model, cfg, device, autocast, signals: Optional[StopSignals] = None) -> dict:
    """The kNN accuracies of the evaluated trunk (DINO's teacher's) as the checkpoint holds it (rank 0's BatchNorm
    statistics on every rank: each moves its own, and evaluates in eval mode with them), and the seconds they took;
    none where a stop signal reached a rank (``signals``) before the evaluation was done."""
    start = time.perf_counter()
    strategy.finish(wrapped, model)
    batches = iter if signals is None else lambda loader: until_stopped(loader, signals, strategy.largest)
    try:
        accuracies = monitor.evaluate(evaluated_trunk(model), device, num_workers(cfg), strategy.rank, strategy.world, autocast, batches=batches)
    except EvaluationStopped:
        return {}
    return {**accuracies, "knn_seconds": time.perf_counter() - start}


def _batch_to_train(cfg, device, strategy, resume: bool, images_at_most: int):
    """``TRAIN.BATCH_SIZE_PER_RANK 0``: the config with the batch and trunk budget the resumed run
    trained with (its checkpoint holds its plans), or, on a new run, with those the whole-step fit
    finds (:mod:`trunksplit.ssl.fit_step`) up to ``images_at_most`` per rank (the data set's share of
    a step), agreed across ranks, and the fit's trunk plans. Another batch: the config as it is, no plans."""
    if cfg.TRAIN.BATCH_SIZE_PER_RANK != 0:
        return cfg, []
    saved = saved_batch(cfg) if resume else None
    if saved is not None:
        return with_batch(cfg, *saved, strategy.rank, "resumed with its checkpoint's batch:"), []
    say = (lambda line: print(f"fit: {line}", flush=True)) if strategy.rank == 0 else None
    images, budget, plans = strategy.agree(fitted_batch(cfg, device, step_for_fit(cfg, autocast_for(cfg, device)), strategy.rank_layout, say, images_at_most))
    return with_batch(cfg, images, budget, strategy.rank, f"TRAIN.MEMORY_LIMIT {format_bytes(int(cfg.TRAIN.MEMORY_LIMIT))} fits"), plans


def step_for_fit(cfg, autocast) -> Callable:
    """The launcher's forward and backward of one step, as :func:`trunksplit.ssl.fit_step.fit_step`
    measures it: ``run(model, crops)``, in this process alone, unscaled."""
    scaler = torch.amp.GradScaler(enabled=False)
    return lambda model, crops: _forward_backward(cfg, model, model, crops, 0, autocast, scaler, contextlib.nullcontext)


def _optimizer_step(cfg, model, optimizer, scaler, step: int, device, rule=None) -> None:
    """The step's update (after DINO's stabilisers, where ``rule`` is given), then DINO's teacher
    follows the student."""
    if rule is not None:  # DINO's stabilisers, on the unscaled (and reduced) gradients
        scaler.unscale_(optimizer)
        apply_gradient_rule(rule, optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=cfg.TRAIN.GRADIENTS != "kept")
    if model.teacher is not None:
        update_teacher(model, teacher_momentum(cfg, step))
    synchronize(device)  # the step's time is its kernels', not their launches


def _summarise(cfg, log: Optional[MetricsLog], last: Optional[dict], model, optimizer, crops, autocast, kept: bool, strategy, world: int) -> None:
    """Step the model with and without checkpointing side by side (:func:`trunksplit.ssl.side_by_side.side_by_side`);
    on rank 0, add that, the plan, the loss of a model that learned nothing (where the method has one) and what
    the step peak is counted beyond to the last row; ``log`` keeps them in summary.json."""
    memory_vs_plain = side_by_side(cfg, model, optimizer, crops, autocast, kept, strategy)
    if last is None:  # not rank 0
        return
    last["chance_loss"] = chance_loss(cfg.METHOD.NAME, sum(c.shape[0] for c in crops) * world)
    last["plan"] = _plans_said(cfg, model.trunk)
    last["peak_beyond"], last["step_also_holds"] = strategy.peak_beyond(cfg), strategy.step_also_holds(cfg)
    last["memory_vs_plain"], last["memory_vs_plain_not_run"] = memory_vs_plain, not_run_because(cfg, strategy)
    log.finish({key: last[key] for key in ("step", "chance_loss", "plan", "memory_vs_plain")})


def _plans_said(cfg, trunk, peaks: bool = False) -> str:
    """The trunk's plan, ``balanced, 4 segments``, or each crop group's; with ``peaks``, each one's predicted step peak."""
    def said(plan: SplitPlan) -> str:
        return plan.headline + (f", predicted trunk peak {plan.predicted_peak_bytes / 2**20:.1f} MiB" if peaks and plan.predicted_peak_bytes else "")

    selected = checkpoint_wrapped_names(trunk)  # MODEL.ACTIVATION_CHECKPOINTING.SELECT: one segment, the blocks checkpoint themselves
    if selected:
        return f"SELECT, {len(selected)} blocks each its own checkpoint ({' '.join(selected)})"
    # a cost-aware trunk's plans, one per crop group, by the group's input shape (the checkpoint's too, for
    # another batch, where a resumed run changed it; later ones win: this run's); vissl's: none stored
    by_shape = {(key[0][0][0][0], key[0][0][0][-1]): (p, key[3]) for key, p in trunk.plans.items()}  # (images, crop size): (plan, updates held)
    batch, groups = cfg.TRAIN.BATCH_SIZE_PER_RANK, crop_groups(cfg)
    read = backward_calls(cfg, crop_shapes(cfg))  # a lone large crop's group runs without a graph: no plan
    found = [(k, s, n, *by_shape[n * batch, s]) for k, (s, n) in enumerate(groups) if read[k] and (n * batch, s) in by_shape]
    if len(groups) > 1 and found:
        return "; ".join([f"group {k + 1} ({n} x {s}px): without a graph" for k, (s, n) in enumerate(groups) if not read[k]]
                         + [f"group {k + 1} ({n} x {s}px{', updates held' if held else ''}): {said(plan)}" for k, s, n, plan, held in found])
    return said(trunk.plan)


def _set_up_before_timing(cfg, model, optimizer, dataset, start, rank, world, device, autocast) -> float:
    """Set-up that the first step would otherwise time and measure, in seconds: the cost-aware
    plan's profiling and, where gradients are kept between steps, allocating them (zeros:
    backward adds into them exactly). Rank 0 says the plan it trains with."""
    kept = cfg.TRAIN.GRADIENTS == "kept"
    setup_start = time.perf_counter()
    if start < cfg.TRAIN.STEPS:
        if rank == 0 and model.trunk.cost_aware and not model.trunk.plans:
            print("planning the trunk: its units profiled once at each crop size ...", flush=True)
        crops = [c.to(device) for c in step_views(dataset, cfg, start, rank, world)]
        try:
            with batchnorm_refusal_said(cfg, crops):
                model.plan_for(crops, autocast, held_calls(cfg, crops), backward_calls(cfg, crops))
        except BudgetTooLowError as e:
            raise ValueError(budget_refused(cfg, model.trunk, e)) from None
    optimizer.zero_grad(set_to_none=not kept)
    if kept:
        keep_gradients(model)
    seconds = time.perf_counter() - setup_start
    if rank == 0 and start < cfg.TRAIN.STEPS:
        print(f"trunk plan: {_plans_said(cfg, model.trunk, peaks=True)} (set up in {seconds:.1f} s)", flush=True)
    return seconds


def _next_step_views(batches, device, skipped: dict, signals: StopSignals):
    """The next step's crops on ``device``, and what the metrics row says of the data: the seconds
    the step waited on the loader, and the unreadable files skipped so far (``skipped`` counts
    them; each is named in a warning the first time). None for the crops where the loader failed
    after a stop signal reached this process (a scheduler's SIGTERM ends the loader's workers too):
    the run stops before this step."""
    waited = time.perf_counter()
    fetched = next_unless_stopping(batches, signals)
    if fetched is None:
        return None, {}
    views, unreadable = fetched
    crops = [c.to(device, non_blocking=True) for c in views]
    for name in unreadable:
        if name not in skipped:
            warnings.warn(f"skipping unreadable image {name}", UserWarning, stacklevel=3)
        skipped[name] = skipped.get(name, 0) + 1
    return crops, {"data_seconds": time.perf_counter() - waited, "skipped_images": sum(skipped.values())}


def _log_row(cfg, log: MetricsLog, bar, step: int, loss, optimizer, seconds: float, peak_bytes: int, world: int, setup_seconds: Optional[float], data: dict) -> dict:
    """Write one metrics row to ``log`` (rank 0) and print it; returns the row. ``data``: the seconds
    the step waited on the loader, and the unreadable images skipped so far (this rank's)."""
    row = {
        "step": step + 1,
        **({"setup_seconds": setup_seconds} if setup_seconds is not None else {}),
        "loss": float(loss),
        "lr": optimizer.param_groups[0]["lr"],
        "images_per_sec": cfg.TRAIN.BATCH_SIZE_PER_RANK * world / seconds,
        "peak_memory_bytes": peak_bytes,
        "step_seconds": seconds,
        **data,
    }
    log.write(row)
    knn = f"  kNN top-1 {row['knn_top1']:.3f}" if "knn_top1" in row else ""
    bar.write(
        f"step {step + 1}/{cfg.TRAIN.STEPS}  loss {row['loss']:.4f}  lr {row['lr']:.4g}  "
        f"{images_per_second(row['images_per_sec'])} images/s  peak {peak_bytes / 2**20:.1f} MiB  data wait {row['data_seconds']:.3f} s{knn}"
    )
    return row


def _save_checkpoint(cfg, strategy, model, optimizer, scaler, steps_done: int, skipped: dict, now: bool = False) -> None:
    """Every ``TRAIN.CHECKPOINT_EVERY`` steps, after the last, and ``now`` (a run stopping)."""
    if steps_done % cfg.TRAIN.CHECKPOINT_EVERY and steps_done != cfg.TRAIN.STEPS and not now:
        return
    rng = rng_states(strategy.world)  # every rank's: stochastic depth and dropout draw from them
    meta = {"scaler": scaler.state_dict(), "step": steps_done, "config": cfg.dump(), "rng": rng, "skipped_images": dict(skipped),
            "plans": [(key, plan.state()) for key, plan in model.trunk.plans.items()]}
    strategy.save(cfg, model, optimizer, meta)


def _forward_backward(cfg, wrapped, model, crops, step: int, autocast, scaler, accumulating: Callable):
    """One step's loss and gradients (reduced across ranks as the strategy says, around this);
    DINO and SwAV with several resolutions group by group (:mod:`trunksplit.ssl.grouped`), the
    earlier groups' gradients kept on this rank in ``accumulating()``."""
    model.normalize_prototypes()
    with batchnorm_refusal_said(cfg, crops):
        if by_crop_group(cfg, crops):
            return grouped_step(cfg, model, wrapped, crops, step, autocast, lambda part: scaler.scale(part).backward(), accumulating)
        loss = whole_step_forward(cfg, wrapped, model, crops, step, autocast)
        scaler.scale(loss).backward()
    return loss.detach()


ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"  # torch's BatchNorm refusal (F.batch_norm, SyncBatchNorm)


@contextlib.contextmanager
def batchnorm_refusal_said(cfg, crops):
    """torch's refusal of a BatchNorm that met one value per channel, in a step or a plan's profile of these
    ``crops``, said in the config's terms: a crop group gives the trunk and head few images (a lone large crop
    at one image per rank: a projection head's BatchNorm1d; a small crop whose last stage is 1x1: the trunk's)."""
    try:
        yield
    except ValueError as e:
        if not str(e).startswith(ONE_VALUE_PER_CHANNEL):
            raise
        raise ValueError(_one_value_per_channel(cfg, len(crops[0]), e)) from None


def _one_value_per_channel(cfg, images: int, error: ValueError) -> str:
    runs = " and ".join(f"{images * count} x {size}px" for size, count in crop_groups(cfg))
    return (f"a BatchNorm in training met one value per channel ({error}): at {images} image{'s' if images > 1 else ''} per rank the step runs "
            f"the trunk and head on {runs} crops, and a BatchNorm normalises each channel over a batch's images and positions (a ResNet's "
            f"last stage is 1/32 of a crop: 1x1 at 32px; a projection head's BatchNorm1d has one position). Give each rank more images "
            f"(TRAIN.BATCH_SIZE_PER_RANK, or more TRAIN.MEMORY_LIMIT where it is fitted), larger crops (DATA.CROP_SIZES), or more crops per image (DATA.CROP_COUNTS)")


def whole_step_forward(cfg, wrapped, model, crops, step: int, autocast) -> torch.Tensor:
    """The whole step's loss, before its one backward: DINO's teacher first (as DINO's own loop runs it: its
    forward then holds nothing beside the student's activations), every crop's forward, the loss."""
    with autocast:
        teacher_out = teacher_outputs(cfg, model, crops) if cfg.METHOD.NAME == "dino" else None
        outputs, embeddings = wrapped(crops, embeddings=True)
        return whole_step_loss(cfg, model, outputs, crops, step, embeddings, teacher_out)


def whole_step_loss(cfg, model, outputs, crops, step: int, embeddings=None, teacher_out=None) -> torch.Tensor:
    """The step's loss over every crop's outputs at once (the whole step: one backward); ``embeddings``: SwAV's
    unit embeddings of the crops (``model(crops, embeddings=True)``), which its queue needs; ``teacher_out``:
    DINO's teacher outputs (:func:`~trunksplit.ssl.dino.teacher_outputs`, best before the student's forward;
    None: computed here)."""
    m = cfg.METHOD
    if m.NAME == "simclr":
        return nt_xent(outputs[0], outputs[1], m.TEMPERATURE)
    if m.NAME == "swav":
        return swav_loss(outputs, swav_codes(cfg, model, outputs, embeddings, step), m.TEMPERATURE)
    return dino_step_loss(cfg, model, outputs, teacher_out if teacher_out is not None else teacher_outputs(cfg, model, crops), step)


def _stop_unless_finite(cfg, loss: torch.Tensor, step: int, largest: Callable[[float], float], scaler) -> None:
    """A NaN or infinite loss stops the run before the optimizer step, so the last checkpoint
    stays the last good one. fp16 is exempt: its grad scaler skips such steps by design. Every
    rank stops together (``largest``: over every rank; one rank's NaN must not leave the others
    waiting in a collective)."""
    if scaler.is_enabled():
        return
    if largest(float(not torch.isfinite(loss).all())):
        raise ValueError(
            f"the loss at step {step + 1} is not finite ({float(loss)} on this rank): training stopped before the optimizer "
            f"step, and {os.path.join(cfg.OUTPUT_DIR, CHECKPOINT)} holds the last good state. Lower OPTIM.LR, or raise "
            "METHOD.TEMPERATURE, and resume with --resume"
        )
