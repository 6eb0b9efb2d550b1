"""The training loop: one process or many (``torchrun``), either DDP path, resumable."""
import contextlib
import copy
import glob
import json
import math
import os
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from ..distributed import manual_gradient_all_reduce, manual_gradient_reduction, manual_sync_params
from ..profile import PeakMemory
from ..trunk import CheckpointedTrunk
from ..wrapper import unwrap_checkpoint
from .data import image_dataset, step_views
from .losses import nt_xent, swav_loss
from .model import SSLModel, build_model

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


def setup_distributed(cfg):
    """(rank, world size, device); joins the process group that torchrun describes, if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.TRAIN.DEVICE:
        try:
            device = torch.device(cfg.TRAIN.DEVICE)
        except RuntimeError:
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE!r} is not a device; use cpu, cuda, cuda:1, or leave it empty") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("TRAIN.DEVICE asks for cuda but this machine has no usable GPU; use cpu, or leave it empty to pick")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"TRAIN.DEVICE {cfg.TRAIN.DEVICE}: this machine has {torch.cuda.device_count()} GPU(s)")
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(cfg.DISTRIBUTED.BACKEND or ("nccl" if device.type == "cuda" else "gloo"), init_method="env://")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def with_fitted_batch(cfg, device, rank: int):
    """The config with the largest batch per rank that fits TRAIN.MEMORY_LIMIT, and the memory budget that
    leaves the trunk (the least recompute that fits), as ``trunksplit.fit`` predicts them."""
    from ..fit import fit_config_batch

    batch, budget = fit_config_batch(cfg, device)
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.BATCH_SIZE_PER_RANK = batch
    cfg.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET = float(budget)
    cfg.freeze()
    if rank == 0:
        print(f"TRAIN.MEMORY_LIMIT {cfg.TRAIN.MEMORY_LIMIT:.4g} bytes fits {batch} images per rank "
              f"({batch * sum(cfg.DATA.CROP_COUNTS)} crops through the trunk), trunk budget {budget} bytes")
    return cfg


def learning_rate(cfg, step: int) -> float:
    """Linear warmup, then cosine decay to zero over TRAIN.STEPS."""
    base, warmup, total = cfg.OPTIM.LR, cfg.OPTIM.WARMUP_STEPS, cfg.TRAIN.STEPS
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def check_output_dir(path: str, resume: bool) -> None:
    """Refuse, before anything is written, an OUTPUT_DIR that cannot be used or would destroy a run."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"OUTPUT_DIR {path!r} cannot be created: {parent} is a file")
    ckpt = os.path.join(path, CHECKPOINT)
    if not resume and os.path.exists(ckpt):
        raise ValueError(
            f"OUTPUT_DIR {path} holds a checkpoint of an earlier run ({ckpt}): pass --resume to continue it, "
            f"or start afresh in another OUTPUT_DIR (or delete {ckpt} first); nothing was overwritten"
        )


def load_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers only
        missing = {"model", "optimizer", "step"} - set(state)
    except Exception as e:  # truncated or not a checkpoint: say so, touch nothing
        raise ValueError(f"--resume: cannot read checkpoint {path} ({type(e).__name__}: {e}); the file is left as it is") from None
    if missing:
        raise ValueError(f"--resume: {path} is not a trunksplit checkpoint (missing {sorted(missing)}); the file is left as it is")
    return state


def save_atomically(obj, path: str) -> None:
    """Write to a temporary file beside ``path``, then rename: a crash never leaves half a checkpoint.

    An exception during the save removes the temporary file; one a killed process left
    behind is removed by :func:`remove_stale_temporaries` at the next start."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_temporaries(path: str) -> None:
    """Delete ``path.tmp<pid>`` files of saves that never finished (rank 0, before training)."""
    for tmp in glob.glob(glob.escape(path) + ".tmp*"):
        os.remove(tmp)


def train(cfg, resume: bool = False) -> Tuple[SSLModel, Optional[dict]]:
    """Train as ``cfg`` says; returns the model and, on rank 0, the last logged metrics."""
    check_output_dir(cfg.OUTPUT_DIR, resume)
    rank, world, device = setup_distributed(cfg)
    if cfg.TRAIN.BATCH_SIZE_PER_RANK == 0:
        cfg = with_fitted_batch(cfg, device, rank)
    dataset = image_dataset(cfg)  # fails early on a bad DATA.PATH, before anything is written
    torch.manual_seed(cfg.SEED)
    model = build_model(cfg).to(device)
    manual = cfg.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION
    if world > 1 and not manual and model.trunk.use_reentrant and len(set(cfg.DATA.CROP_SIZES)) > 1:
        raise ValueError(
            "reentrant checkpointing under native DDP with several trunk forwards per step fails "
            "('marked ready twice'): set DISTRIBUTED.MANUAL_GRADIENT_REDUCTION True or USE_REENTRANT False"
        )
    wrapped = DDP(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.OPTIM.LR, momentum=cfg.OPTIM.MOMENTUM, weight_decay=cfg.OPTIM.WEIGHT_DECAY)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.TRAIN.AUTOCAST == "fp16")
    start, rows = 0, []
    ckpt_path = os.path.join(cfg.OUTPUT_DIR, CHECKPOINT)
    metrics_path = os.path.join(cfg.OUTPUT_DIR, METRICS)
    if resume:
        state = load_checkpoint(ckpt_path)
        _check_same_model(state, cfg, ckpt_path)
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ValueError(f"--resume: {ckpt_path} does not fit the configured model: {str(e).splitlines()[0]} ...; resume with the config it was trained with") from None
        optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        start = state["step"]
        rows = _metrics_before(metrics_path, start)  # read (and checked) before anything is written
    if rank == 0:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
        remove_stale_temporaries(ckpt_path)
        with open(os.path.join(cfg.OUTPUT_DIR, "config.yaml"), "w") as f:
            f.write(cfg.dump())
        with open(metrics_path, "w") as f:
            f.writelines(rows)
    autocast = _autocast(cfg, device)
    # Set-up that the first step would otherwise time and measure: the cost-aware plan's
    # profiling and, where gradients are kept between steps, allocating them (zeros:
    # backward adds into them exactly).
    kept = cfg.TRAIN.GRADIENTS == "kept"
    setup_start = time.perf_counter()
    if start < cfg.TRAIN.STEPS:
        model.plan_for([c.to(device) for c in step_views(dataset, cfg, start, rank, world)], autocast)
    optimizer.zero_grad(set_to_none=not kept)
    if kept:
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    setup_seconds = time.perf_counter() - setup_start
    bar = tqdm(range(start, cfg.TRAIN.STEPS), initial=start, total=cfg.TRAIN.STEPS, disable=rank != 0, desc="train")
    last = None
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        crops = [c.to(device, non_blocking=True) for c in step_views(dataset, cfg, step, rank, world)]
        logging = step % cfg.TRAIN.LOG_EVERY == 0 or step == cfg.TRAIN.STEPS - 1
        start_time = time.perf_counter()
        with PeakMemory(device) if logging else contextlib.nullcontext() as mem:
            loss = _forward_backward(cfg, wrapped, model, crops, manual, autocast, scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=not kept)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start_time
        if logging and rank == 0:
            last = {
                "step": step + 1,
                **({"setup_seconds": setup_seconds} if step == start else {}),
                "loss": float(loss),
                "lr": optimizer.param_groups[0]["lr"],
                "images_per_sec": cfg.TRAIN.BATCH_SIZE_PER_RANK * world / seconds,
                "peak_memory_bytes": mem.peak_bytes,
                "step_seconds": seconds,
            }
            with open(os.path.join(cfg.OUTPUT_DIR, METRICS), "a") as f:
                f.write(json.dumps(last) + "\n")
            bar.write(
                f"step {step + 1}/{cfg.TRAIN.STEPS}  loss {last['loss']:.4f}  lr {last['lr']:.4g}  "
                f"{last['images_per_sec']:.1f} images/s  peak {mem.peak_bytes / 2**20:.1f} MiB"
            )
        if (step + 1) % cfg.TRAIN.CHECKPOINT_EVERY == 0 or step + 1 == cfg.TRAIN.STEPS:
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step + 1, "config": cfg.dump()}
                save_atomically(state, ckpt_path)
            if world > 1:
                dist.barrier()
    if world > 1:  # BatchNorm statistics of the last step differ per rank; end with rank 0's, as saved
        manual_sync_params(wrapped)
    if last is not None:
        plan = model.trunk.plan
        last["plan"] = f"{plan.strategy}, {len(plan.segments)} segments"
        last["memory_vs_plain"] = compare_with_plain(model, crops, autocast, kept)
    return model, last


def compare_with_plain(model, crops, autocast, kept_gradients: bool) -> Optional[dict]:
    """Peak bytes of one step of ``model`` and of a plain (never checkpointed) copy, side by side.

    Both run the same surrogate loss on the same crops, in this process only (no
    collectives), on copies whose gradients are where the loop leaves them between
    steps (None, or kept zeros), one copy at a time, so the real model is untouched.
    None where a GPU has no room for a copy.
    """
    peaks = {}
    for name in ("checkpointed", "plain"):
        try:
            m = _copy_for_comparison(model, plain=name == "plain", kept_gradients=kept_gradients)
            with PeakMemory(crops[0].device) as mem, autocast:
                sum(o.float().pow(2).mean() for o in m(crops)).backward()
        except torch.cuda.OutOfMemoryError:
            return None
        peaks[name] = mem.peak_bytes
        del m
    return peaks


def _copy_for_comparison(model, plain: bool, kept_gradients: bool):
    m = copy.deepcopy(model)
    if plain:
        for sub in m.modules():
            unwrap_checkpoint(sub)
        m.trunk = CheckpointedTrunk(m.trunk._blocks(), m.trunk.out_feat_keys)
    for p in m.parameters():  # deepcopy drops .grad: put them back where the loop keeps them
        p.grad = torch.zeros_like(p) if kept_gradients else None
    return m


def _forward_backward(cfg, wrapped, model, crops, manual_flag, autocast, scaler):
    """One step's loss and gradients, on the DDP path the config picks."""
    manual = manual_gradient_reduction(wrapped, manual_flag)
    with wrapped.no_sync() if manual else contextlib.nullcontext():
        if manual:
            manual_sync_params(wrapped)
        model.normalize_prototypes()
        with autocast:
            outputs = wrapped(crops)
            if cfg.METHOD.NAME == "simclr":
                loss = nt_xent(outputs[0], outputs[1], cfg.METHOD.TEMPERATURE)
            else:
                loss = swav_loss(outputs, cfg.DATA.CROP_COUNTS[0], cfg.METHOD.TEMPERATURE, cfg.METHOD.SINKHORN_ITERATIONS, cfg.METHOD.SINKHORN_EPSILON)
        scaler.scale(loss).backward()
    if manual:
        manual_gradient_all_reduce(wrapped)
    return loss.detach()


def _autocast(cfg, device):
    if not cfg.TRAIN.AUTOCAST:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.TRAIN.AUTOCAST == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def _metrics_before(path: str, step: int) -> list:
    """On resume: the logged rows up to the checkpoint (later ones are logged again).

    A torn last line (a run killed while writing it) is dropped; a damaged line
    before it is an error that names the file and the line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.readlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step_of_row = row["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                break  # torn by an interruption: it will be logged again
            raise ValueError(f"--resume: {path} line {number} is not a metrics row ({line.strip()[:60]!r}); fix or remove that line") from None
        if step_of_row <= step:
            rows.append(line if line.endswith("\n") else line + "\n")
    return rows


def _check_same_model(state: dict, cfg, path: str) -> None:
    """The checkpoint must be of the configured architecture (a clear error instead of a size mismatch)."""
    try:
        saved = yaml.safe_load(state.get("config") or "{}")["MODEL"]["TRUNK"]["NAME"]
    except (yaml.YAMLError, KeyError, TypeError):
        saved = None
    if saved is not None and saved != cfg.MODEL.TRUNK.NAME:
        raise ValueError(
            f"--resume: {path} holds a {saved} run, but the config asks for {cfg.MODEL.TRUNK.NAME}; "
            "resume with the same MODEL.TRUNK.NAME, or start afresh in another OUTPUT_DIR"
        )
