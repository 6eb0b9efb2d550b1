"""A config's keys by their dotted names (``TRAIN.STEPS``), and vissl's keys with what each one is here.

A vissl user's first run points ``--config-file`` at a vissl YAML (its keys under ``config:``, for hydra) or
types a vissl key on the command line. Both are refused, as every unknown key is, but saying what to write
here instead: most of vissl's keys that an SSL run sets are renamed, and the activation-checkpointing and
manual-DDP keys are the same. No file is translated silently: several keys mean something else here
(vissl counts epochs, trunksplit steps), so the user writes the new file, once, from the list.

    vissl_hint("DATA.TRAIN.DATA_PATHS")   # "; that is vissl's key: here, DATA.PATH (one ImageFolder root, not a list)"
"""
from typing import Iterable

# vissl's key (under ``config.``) -> what to write in trunksplit's config instead (vissl/config/defaults.yaml)
RENAMED = {
    "SEED_VALUE": "SEED",
    "LOG_FREQUENCY": "TRAIN.LOG_EVERY",
    "DATA.TRAIN.DATA_PATHS": "DATA.PATH (one ImageFolder root, not a list)",
    "DATA.TRAIN.BATCHSIZE_PER_REPLICA": "TRAIN.BATCH_SIZE_PER_RANK",
    "DATA.NUM_DATALOADER_WORKERS": "DATA.NUM_WORKERS",
    "DATA.TRAIN.TRANSFORMS": ("DATA.CROP_SIZES, DATA.CROP_COUNTS and DATA.CROP_SCALES (ImgPilToMultiCrop's size_crops, num_crops and "
                              "crop_scales), and DATA.AUG.* for the rest (configs/recipes/ holds SimCLR's, SwAV's and DINO's)"),
    "MODEL.TRUNK.RESNETS.DEPTH": "MODEL.TRUNK.NAME, a torchvision model's name (resnet50 for vissl's resnet of depth 50)",
    "MODEL.TRUNK.TRUNK_PARAMS.RESNETS.DEPTH": "MODEL.TRUNK.NAME, a torchvision model's name (resnet50 for vissl's resnet of depth 50)",
    "MODEL.TRUNK.TRUNK_PARAMS.RESNETS.WIDTH_MULTIPLIER": "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER",
    "MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME": ("nothing: the trunk's weights are found in the file, nested or not (vissl's, trunksplit's, a state_dict); "
                                              "where MODEL.WEIGHTS_INIT.REMOVE_PREFIX is needed, it is the whole dotted path (state_dict.module.)"),
    "MODEL.WEIGHTS_INIT.APPEND_PREFIX": "nothing: the trunk's names, its model's (torchvision's, timm's) and vissl's _feature_blocks. ones all load",
    "MODEL.WEIGHTS_INIT.SKIP_LAYERS": "nothing: a file without num_batches_tracked loads, and the model's classifier is left out",
    "MODEL.AMP_PARAMS.USE_AMP": "TRAIN.AUTOCAST (bf16 or fp16: torch's autocast)",
    "MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE": ("nothing: MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN makes every BatchNorm trunksplit.SyncBatchNorm, "
                                          "on any backend (gloo, nccl) and exact under checkpointing; apex's is not used"),
    "MODEL.HEAD.PARAMS": "MODEL.HEAD.HIDDEN_DIM and MODEL.HEAD.OUTPUT_DIM (METHOD.NAME builds the head)",
    "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP": "DISTRIBUTED.STRATEGY fsdp (FSDP2)",
    "MODEL.GRAD_CLIP.MAX_NORM": "OPTIM.CLIP_GRAD (each parameter's gradient clipped to it, as DINO does, not their joint norm)",
    "LOSS.name": "METHOD.NAME (simclr for simclr_info_nce_loss, swav for swav_loss, dino for dino_loss)",
    "LOSS.simclr_info_nce_loss.temperature": "METHOD.TEMPERATURE",
    "LOSS.swav_loss.temperature": "METHOD.TEMPERATURE",
    "LOSS.swav_loss.num_iters": "METHOD.SINKHORN_ITERATIONS",
    "LOSS.swav_loss.epsilon": "METHOD.SINKHORN_EPSILON",
    "LOSS.swav_loss.num_prototypes": "METHOD.NUM_PROTOTYPES (one number)",
    "LOSS.swav_loss.queue.queue_length": "METHOD.SWAV.QUEUE_LENGTH (every rank's embeddings together, not one rank's)",
    "LOSS.swav_loss.queue.local_queue_length": "METHOD.SWAV.QUEUE_LENGTH (every rank's embeddings together: this times the ranks)",
    "LOSS.swav_loss.queue.start_iter": "METHOD.SWAV.QUEUE_START_STEP",
    "MODEL.TEMP_FROZEN_PARAMS_ITER_MAP": ("METHOD.SWAV.FREEZE_PROTOTYPES_STEPS (SwAV's prototypes) or METHOD.DINO.FREEZE_LAST_LAYER_STEPS "
                                          "(DINO's last layer): steps, for that one parameter"),
    "LOSS.dino_loss.student_temp": "METHOD.TEMPERATURE",
    "LOSS.dino_loss.teacher_temp_min": "METHOD.DINO.WARMUP_TEACHER_TEMPERATURE",
    "LOSS.dino_loss.teacher_temp_max": "METHOD.DINO.TEACHER_TEMPERATURE",
    "LOSS.dino_loss.teacher_temp_warmup_iters": "METHOD.DINO.TEACHER_TEMPERATURE_WARMUP_STEPS",
    "LOSS.dino_loss.momentum": "METHOD.DINO.TEACHER_MOMENTUM",
    "LOSS.dino_loss.ema_center": "METHOD.DINO.CENTER_MOMENTUM",
    "LOSS.dino_loss.output_dim": "METHOD.NUM_PROTOTYPES (the output dimension of DINO's head)",
    "OPTIMIZER.name": "OPTIM.NAME (sgd, lars or adamw)",
    "OPTIMIZER.use_larc": "OPTIM.NAME lars",
    "OPTIMIZER.larc_config.trust_coefficient": "OPTIM.LARS_TRUST_COEFFICIENT",
    "OPTIMIZER.momentum": "OPTIM.MOMENTUM",
    "OPTIMIZER.weight_decay": "OPTIM.WEIGHT_DECAY",
    "OPTIMIZER.betas": "OPTIM.BETAS",
    "OPTIMIZER.regularize_bn": "OPTIM.EXCLUDE_BIAS_AND_NORM (True where vissl's is False)",
    "OPTIMIZER.regularize_bias": "OPTIM.EXCLUDE_BIAS_AND_NORM (True where vissl's is False)",
    "OPTIMIZER.num_epochs": "TRAIN.STEPS (steps, not epochs)",
    "OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_value": "OPTIM.LR (the rate at OPTIM.LR_BATCH_SIZE images a step)",
    "OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size": "OPTIM.LR_BATCH_SIZE",
    "CHECKPOINT.DIR": "OUTPUT_DIR",
    "CHECKPOINT.CHECKPOINT_FREQUENCY": "TRAIN.CHECKPOINT_EVERY (steps, not epochs)",
    "CHECKPOINT.CHECKPOINT_ITER_FREQUENCY": "TRAIN.CHECKPOINT_EVERY",
    "CHECKPOINT.AUTO_RESUME": "tools/train.py --resume",
    "DISTRIBUTED.NUM_PROC_PER_NODE": "torchrun --nproc_per_node",
    "DISTRIBUTED.NUM_NODES": "torchrun --nnodes",
    "HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD": "LOGGING.TENSORBOARD",
}
SHOWN_WITHOUT_COUNTERPART = 8  # of a vissl file's keys that mean nothing here: this many named, the rest counted
SHOWN_VALUE = 60  # characters of a renamed key's value (a transforms list runs to hundreds)


def vissl_hint(key: str) -> str:
    """``"; that is vissl's key: here, X"`` for a key of vissl's (``config.`` before it or not), else ``""``."""
    said = RENAMED.get(key[len("config."):] if key.startswith("config.") else key)
    return f"; that is vissl's key: here, {said}" if said else ""


def refuse_vissl_file(loaded: dict, known: Iterable[str]) -> None:
    """A YAML file laid out as vissl's (its keys under ``config:``) refused with, for each of its keys,
    what to write here: renamed, the same key, or nothing (``known``: trunksplit's full keys)."""
    if not isinstance(loaded.get("config"), dict):
        return
    known = set(known)
    renamed, same, other = [], [], []
    for key, value in by_dotted_key(loaded["config"]).items():
        if key in RENAMED:
            shown = repr(value) if len(repr(value)) <= SHOWN_VALUE else repr(value)[:SHOWN_VALUE] + " ..."
            renamed.append(f"  {key} {shown} -> {RENAMED[key]}")
        else:
            (same if key in known else other).append(key)
    lines = ["a vissl config (its keys under `config:`); trunksplit's config has keys of its own "
             "(trunksplit/ssl/config.py; configs/quickstart.yaml is a file of them). Write instead:", *renamed]
    if same:
        lines.append(f"  the same key here: {', '.join(same)}")
    if other:
        more = f" and {len(other) - SHOWN_WITHOUT_COUNTERPART} more" if len(other) > SHOWN_WITHOUT_COUNTERPART else ""
        lines.append(f"  no counterpart here (leave out): {', '.join(other[:SHOWN_WITHOUT_COUNTERPART])}{more}")
    raise ValueError("\n".join(lines))


def by_dotted_key(node: dict, prefix: str = "") -> dict:
    """Every value of a nested mapping (a YAML file's, a ``CfgNode``) that is not itself a mapping, by its
    dotted key, in the file's order: ``{"TRAIN.STEPS": 30, ...}``."""
    found = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        found.update(by_dotted_key(value, key + ".") if isinstance(value, dict) else {key: value})
    return found
