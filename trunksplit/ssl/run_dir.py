"""A run's directory: its checkpoint, metrics and config, written so that a run resumes exactly
and a crash or a mistake never destroys an earlier run."""
import glob
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from ..planning.plan import SplitPlan
from .config_keys import by_dotted_key
from .run_lock import held_elsewhere, hold_output_dir, in_use

CHECKPOINT = "checkpoint.pt"
TRUNK_WEIGHTS = "trunk.pt"  # the trained trunk under its model's names, written at the end of a run
METRICS = "metrics.jsonl"


def check_output_dir(path: str, resume: bool, agree: Callable = lambda decision: decision) -> None:
    """Refuse, before anything is written, an OUTPUT_DIR that cannot be used or would destroy a run, or
    that a run still going writes (see :func:`hold_output_dir`; rank 0's answer, by ``agree``, on every rank)."""
    if agree(held_elsewhere(path)):
        raise in_use(path)
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"OUTPUT_DIR {path!r} cannot be created: {parent} is a file")
    try:  # a directory made and removed: whether this process may write there (permissions, a read-only or virtual file system)
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".trunksplit-write-check-"))
    except OSError as e:
        raise ValueError(f"OUTPUT_DIR {path!r} cannot be written: making a directory in {parent} fails ({e.strerror}); give a directory this process may write") from None
    ckpt = os.path.join(path, CHECKPOINT)
    if not resume and os.path.exists(ckpt):
        raise ValueError(
            f"OUTPUT_DIR {path} holds a checkpoint of an earlier run ({ckpt}): pass --resume to continue it, "
            f"or start afresh in another OUTPUT_DIR (or delete {ckpt} first); nothing was overwritten"
        )


def load_checkpoint(path: str, reader: str = "--resume") -> dict:
    """A run's checkpoint, read for ``reader`` (what the errors name: ``--resume``, ``trunksplit knn``)."""
    if not os.path.isfile(path):
        raise ValueError(f"{reader}: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers only
        missing = ({"sharded", "step"} if "sharded" in state else {"model", "optimizer", "step"}) - set(state)
    except Exception as e:  # truncated or not a checkpoint: say so, touch nothing
        raise ValueError(f"{reader}: cannot read checkpoint {path} ({type(e).__name__}: {e}); the file is left as it is") from None
    if missing:
        raise ValueError(f"{reader}: {path} is not a trunksplit checkpoint (missing {sorted(missing)}); the file is left as it is")
    return state


def save_trunk_weights(out: str, trunk, state: dict, rank: int) -> None:
    """Rank 0: ``state`` (a ``state_dict`` of ``trunk``'s blocks, gathered whole) under the names of the
    model ``trunk`` was built from, in ``out/trunk.pt``: it loads strictly into that model without its
    classifier (``model.fc = nn.Identity()``), and a run's ``MODEL.WEIGHTS_INIT.PARAMS_FILE`` takes it."""
    if rank == 0:
        save_atomically(trunk.model_state_dict(state=state), os.path.join(out, TRUNK_WEIGHTS))


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


def metrics_rows(path: str, reader: str) -> Tuple[List[Tuple[str, dict]], Optional[int]]:
    """Each whole row of a metrics file with its line, and the number of a torn last line (a run
    killed while writing it: left out) or None. A damaged line before the last is a ``ValueError``
    that names ``reader`` (what reads it), the file and the line."""
    with open(path) as f:
        lines = f.readlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                return rows, number
            raise ValueError(f"{reader}: {path} line {number} is not a metrics row ({line.strip()[:60]!r}); fix or remove that line") from None
        rows.append((line if line.endswith("\n") else line + "\n", row))
    return rows, None


def _metrics_before(path: str, step: int) -> list:
    """On resume: the logged rows up to the checkpoint (later ones are logged again); a torn last
    line is dropped (it will be logged again)."""
    if not os.path.exists(path):
        return []
    return [line for line, row in metrics_rows(path, "--resume")[0] if row["step"] <= step]


# what a checkpoint's state is made of: another value would not load, or would load into another run
SAME_ON_RESUME = ("MODEL.TRUNK.NAME", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "METHOD.NAME", "OPTIM.NAME")
# what the trunk's saved plans were made for: another value plans again
PLANNED_FOR = ("MODEL.ACTIVATION_CHECKPOINTING", "TRAIN.GRADIENTS", "OPTIM.IN_BACKWARD")
# what leaves the weights as they would be (checkpointing is exact; where files go, how often they are
# written, how many workers load the same batches, what is evaluated, the weights the run started from:
# the checkpoint holds its own): any other key changed on resume trains another run from the checkpoint on, and is said
WEIGHTS_KEEP_ACROSS = (*PLANNED_FOR, "OUTPUT_DIR", "TRAIN.LOG_EVERY", "TRAIN.CHECKPOINT_EVERY", "TRAIN.MEMORY_LIMIT", "TRAIN.DEVICE",
                       "TRAIN.BACKWARD_BY_CROP_GROUP", "DATA.NUM_WORKERS", "EVAL", "LOGGING", "DISTRIBUTED", "MODEL.WEIGHTS_INIT")


def _at(config: dict, key: str):
    """``config``'s value at a dotted ``key`` (None where it has none: a checkpoint of an earlier release)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _check_same_run(saved: dict, now: dict, path: str) -> None:
    """The checkpoint's config (``saved``) must be of the configured (``now``) architecture, method and
    optimizer: a clear error instead of a size mismatch or an optimizer state of another kind."""
    for key in SAME_ON_RESUME:
        if _at(saved, key) is not None and _at(saved, key) != _at(now, key):
            raise ValueError(f"--resume: {path} holds a run with {key} {_at(saved, key)}, but the config asks for {_at(now, key)}; "
                             f"resume with the same {key}, or start afresh in another OUTPUT_DIR")


def _value(value) -> str:
    """A config value as a person reads it: 0.00234375, not 0.0023437500000000003 (a scaled learning rate)."""
    return format(value, ".6g") if isinstance(value, float) else str(value)


def _say_other_training(saved: dict, now: dict, path: str) -> None:
    """Warn, naming each key with its two values, where the resumed run trains on with other settings
    than the checkpoint's run (a larger TRAIN.STEPS, which stretches the schedules; another batch or
    learning rate): it goes on, but it is no longer the run an uninterrupted one would have been. A key
    the checkpoint's config lacks (an earlier release's) is not said."""
    before, after = by_dotted_key(saved), by_dotted_key(now)
    changed = [key for key in after if key in before and before[key] != after[key]
               and not any(key == kept or key.startswith(kept + ".") for kept in WEIGHTS_KEEP_ACROSS)]
    if changed:
        said = ", ".join(f"{key} ({_value(before[key])} then, {_value(after[key])} now)" for key in changed)
        warnings.warn(f"--resume: {said} changed since {path} was saved: the run goes on from its step with the new values "
                      "(schedules run to TRAIN.STEPS as it is now), so its weights will not be those of an uninterrupted run of either config",
                      UserWarning)


def _plans_still_asked_for(saved: dict, now: dict, path: str, say: bool) -> bool:
    """Whether the checkpoint's plans were made for this config's checkpointing; if not, and ``say``, say that they are made again."""
    changed = [key for key in PLANNED_FOR if _at(saved, key) != _at(now, key)]
    # a section is named, a value said as it was and is (a strategy may have set it: DDP trains TRAIN.GRADIENTS kept)
    said = [key if isinstance(_at(now, key), dict) else f"{key} ({_at(saved, key)} then, {_at(now, key)} now)" for key in changed]
    if changed and say:
        warnings.warn(f"--resume: {', '.join(said)} changed since {path} was saved: the trunk plans again for the new settings", UserWarning)
    return not changed


def saved_batch(cfg) -> Optional[Tuple[int, float]]:
    """(images per rank, trunk memory budget) the run in OUTPUT_DIR trained with, from its
    checkpoint's config; None where it has none. A resumed ``TRAIN.BATCH_SIZE_PER_RANK 0`` run
    trains on these, not on a new fit: a fit measured again may answer otherwise."""
    path = os.path.join(cfg.OUTPUT_DIR, CHECKPOINT)
    try:
        saved = yaml.safe_load(load_checkpoint(path).get("config") or "{}")
        return int(saved["TRAIN"]["BATCH_SIZE_PER_RANK"]), float(saved["MODEL"]["ACTIVATION_CHECKPOINTING"]["MEMORY_BUDGET"])
    except (yaml.YAMLError, KeyError, TypeError):
        return None


@dataclass
class Resumed:
    """What a run continues from: the step, the metrics rows logged up to it, the unreadable files
    skipped up to it (and how often). A new run starts from the defaults."""

    step: int = 0
    rows: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)


def resume_from(cfg, model, optimizer, scaler, rank: int, world: int, load) -> Resumed:
    """Load the run's checkpoint into ``model``, ``optimizer`` (``load(cfg, state, model, optimizer)``:
    the strategy's), ``scaler``, this rank's random number generators and the trunk's plans (those
    it trained with: a plan measured again may differ); read and checked before anything is written."""
    ckpt_path = os.path.join(cfg.OUTPUT_DIR, CHECKPOINT)
    state = load_checkpoint(ckpt_path)
    try:
        saved = yaml.safe_load(state.get("config") or "{}") or {}
    except yaml.YAMLError:
        saved = {}
    now = yaml.safe_load(cfg.dump())  # the config as the checkpoint stores it, to compare key by key
    _check_same_run(saved, now, ckpt_path)
    if rank == 0 and state["step"] < cfg.TRAIN.STEPS:  # one process says it; with nothing left to train, new values train nothing
        _say_other_training(saved, now, ckpt_path)
    try:
        load(cfg, state, model, optimizer)
    except RuntimeError as e:
        raise ValueError(f"--resume: {ckpt_path} does not fit the configured model: {str(e).splitlines()[0]} ...; resume with the config it was trained with") from None
    if "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    _restore_rng(state.get("rng"), rank, world, ckpt_path)
    for key, plan in (state.get("plans") or []) if _plans_still_asked_for(saved, now, ckpt_path, say=rank == 0) else []:
        model.trunk.store_plan(key, SplitPlan.from_state(plan))
    start = state["step"]
    if start >= cfg.TRAIN.STEPS and rank == 0:
        warnings.warn(f"--resume: {ckpt_path} is at step {start} and TRAIN.STEPS is {cfg.TRAIN.STEPS}: nothing is left to train "
                      "(raise TRAIN.STEPS to go on); its trunk's weights as they are go to trunk.pt", UserWarning)
    return Resumed(start, _metrics_before(os.path.join(cfg.OUTPUT_DIR, METRICS), start), dict(state.get("skipped_images") or {}))


def start_run_dir(cfg, rows) -> None:
    """Rank 0, once everything is checked: the directory held (:mod:`trunksplit.ssl.run_lock`), its
    config, and the metrics logged so far."""
    os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
    held = hold_output_dir(cfg.OUTPUT_DIR)
    remove_stale_temporaries(os.path.join(cfg.OUTPUT_DIR, CHECKPOINT))
    with os.fdopen(os.dup(held), "w") as f:  # the same open file: closing this copy keeps the lock
        f.truncate(0)
        f.write(cfg.dump())
    with open(os.path.join(cfg.OUTPUT_DIR, METRICS), "w") as f:
        f.writelines(rows)


def rng_states(world: int) -> list:
    """Every rank's random number generator states (CPU, and CUDA where used), gathered so that
    rank 0 can save them: a resumed run draws the same stochastic-depth and dropout masks as an
    uninterrupted one. A collective under several processes: every rank calls it."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    if world == 1:
        return [mine]
    states = [None] * world
    dist.all_gather_object(states, mine)
    return states


def _restore_rng(states, rank: int, world: int, path: str) -> None:
    if not states:
        return  # a checkpoint of an earlier release: the generators start from SEED, as they did
    if len(states) != world:
        if rank == 0:  # one process says it: every rank's is the same
            saved = f"{len(states)} process" + ("es" if len(states) > 1 else "")
            warnings.warn(f"{path} was saved by {saved} and resumes on {world}: each step's batch is {world} x TRAIN.BATCH_SIZE_PER_RANK where "
                          f"it was {len(states)} x (and OPTIM.LR with it, where OPTIM.LR_BATCH_SIZE scales it), and the random number "
                          "generators start afresh, so stochastic depth and dropout draw other masks than an uninterrupted run", UserWarning)
        return
    torch.set_rng_state(states[rank]["cpu"])
    if "cuda" in states[rank] and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[rank]["cuda"])


SHARDED = "sharded"  # under OUTPUT_DIR: one torch.distributed.checkpoint directory per save, step_<N>


def save_sharded(cfg, model, optimizer, meta: dict, rank: int, world: int) -> None:
    """FSDP: every rank writes its shards with ``torch.distributed.checkpoint`` into a new
    directory; once all have, rank 0 writes ``checkpoint.pt`` (the step, config, RNG states and
    where the shards are) atomically, then removes older shard directories. A crash at any point
    leaves the last complete checkpoint in place. DCP reshards on load: a run saved on 2 ranks
    resumes on 4."""
    name = os.path.join(SHARDED, f"step_{meta['step']}")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(cfg.OUTPUT_DIR, name))
    if world > 1:
        dist.barrier()
    if rank == 0:
        save_atomically({**meta, "sharded": name}, os.path.join(cfg.OUTPUT_DIR, CHECKPOINT))
        for old in glob.glob(os.path.join(glob.escape(cfg.OUTPUT_DIR), SHARDED, "step_*")):
            if os.path.basename(old) != os.path.basename(name):
                shutil.rmtree(old, ignore_errors=True)


def load_sharded(path: str, model, optimizer) -> None:
    """A sharded checkpoint's model and optimizer state, into ``model`` sharded or whole: DCP reshards
    on load, to another world size or to whole tensors (an FSDP2 run going on in one process or under DDP)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    _dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_whole_into_shards(state: dict, model, optimizer) -> None:
    """A whole checkpoint's model and optimizer state into a sharded (FSDP2) model: every rank reads
    the whole file and keeps its shards (a one-process or DDP run going on under FSDP2). torch.optim
    keys its state by a parameter's place in the param groups, torch's state-dict helpers by name: the
    places are this optimizer's, built as the checkpoint's was (same model and optimizer, checked)."""
    saved = state["optimizer"]
    sizes = ([len(group["params"]) for group in saved["param_groups"]], [len(group["params"]) for group in optimizer.param_groups])
    if sizes[0] != sizes[1]:  # as torch.optim's load_state_dict refuses it: the places would name other parameters
        raise ValueError(f"--resume: the checkpoint's optimizer has parameter groups of {sizes[0]} parameters, this run's {sizes[1]}; "
                         "resume with the config it was trained with (OPTIM.EXCLUDE_BIAS_AND_NORM)")
    names = {p: n for n, p in model.named_parameters()}
    by_place = dict(enumerate(names[p] for group in optimizer.param_groups for p in group["params"]))
    optim_state = {"state": {by_place[i]: slots for i, slots in saved["state"].items()},
                   "param_groups": [{**group, "params": [by_place[i] for i in group["params"]]} for group in saved["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def load_sharded_model(path: str, model) -> None:
    """The model's part of a sharded checkpoint, into a whole (unsharded) model in one process:
    DCP reshards on load, here to one rank (``trunksplit knn`` of an FSDP2 run)."""
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"])


def _dcp_load(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # "... load in a single process": what is meant
        dcp.load(state, checkpoint_id=path)


def drop_shards(out: str) -> None:
    """Remove ``out``'s shard directories: a whole checkpoint was written over the sharded one that named them."""
    shutil.rmtree(os.path.join(out, SHARDED), ignore_errors=True)
