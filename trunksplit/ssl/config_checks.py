"""What a config may hold: each value checked once the config is loaded (defaults, YAML, command
line), every refusal a ``ValueError`` that names the key and what to write instead."""
import math
import warnings
from typing import Optional

import torch.distributed as dist
from fvcore.common.config import CfgNode as CN

from ..planning.budget import MemoryBudget
from ..recompute.select import condition_from_config
from .backbones import check_backbone_name, check_resnet_width, fixed_resolution
from .data import SYNTHETIC_KINDS
from .optim import OPTIMIZERS
from .strategy import check_strategy

SELECT_KEY = "MODEL.ACTIVATION_CHECKPOINTING.SELECT"


_KINDS = [(bool, "True or False"), (int, "a whole number"), (float, "a number"), (str, "text"), ((list, tuple), "a list")]


def type_refusal(key: str, default, value) -> Optional[str]:
    """Why ``value`` cannot be ``key``'s, whose default is ``default``: a bool is True or False, a number a
    number, text text, a list a list (a key whose default is None takes any); None where it can."""
    kind, said = next(((k, w) for k, w in _KINDS if isinstance(default, k)), (None, ""))
    numbers = (int, float) if kind is float else kind
    if kind is not None and (not isinstance(value, numbers) or (kind is not bool and isinstance(value, bool))):
        return f"{key} must be {said} (default {default!r}), got {value!r}"
    return None


def _check_types(cfg: CN, defaults: CN, prefix: str = "") -> None:
    """Every key holds a value of its default's type (:func:`type_refusal`; yacs lets None through)."""
    for name, default in defaults.items():
        key, value = prefix + name, cfg[name]
        if isinstance(default, CN):
            if key != SELECT_KEY:  # its own check: condition_from_config
                _check_types(value, default, key + ".")
            continue
        refusal = type_refusal(key, default, value)
        if refusal:
            raise ValueError(refusal)
        if isinstance(default, (list, tuple)) and default:
            _check_items(key, value, default)


def _check_items(key: str, value, default) -> None:
    """A list's items are of the kind of its default's (CROP_SIZES numbers, OUT_FEAT_KEYS names, CROP_SCALES lists)."""
    kind, said = next((k, w) for k, w in _KINDS if isinstance(default[0], k))
    numbers = (int, float) if kind in (int, float) else kind
    if any(not isinstance(v, numbers) or (kind is not bool and isinstance(v, bool)) for v in value):
        raise ValueError(f"{key}: each item must be {said} (default {list(default)!r}), got {list(value)!r}")


def check_config(cfg: CN, defaults: CN) -> None:
    """Refuse a loaded config whose values would fail later or train nonsense, naming what to change."""
    _check_types(cfg, defaults)
    check_backbone_name(cfg.MODEL.TRUNK.NAME)
    check_resnet_width(cfg.MODEL.TRUNK.NAME, cfg.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER)
    if fixed_resolution(cfg.MODEL.TRUNK.NAME) and len(set(cfg.DATA.CROP_SIZES)) > 1:
        raise ValueError(f"{cfg.MODEL.TRUNK.NAME} is built for one resolution; DATA.CROP_SIZES {list(cfg.DATA.CROP_SIZES)} asks for several")
    ac = cfg.MODEL.ACTIVATION_CHECKPOINTING
    if ac.STRATEGY not in ("vissl", "balanced"):
        raise ValueError(f"MODEL.ACTIVATION_CHECKPOINTING.STRATEGY must be vissl or balanced, got {ac.STRATEGY!r}")
    MemoryBudget.parse(ac.MEMORY_BUDGET, "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET")  # validates
    if ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS < 1:
        raise ValueError(f"MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS must be >= 1, got {ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS}")
    if len(ac.SELECT):
        try:
            condition_from_config(dict(ac.SELECT))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{SELECT_KEY}: {e}") from None
        _say_which_wins(ac)
    if cfg.TRAIN.BATCH_SIZE_PER_RANK == 0:
        if not cfg.TRAIN.MEMORY_LIMIT > 0 or not math.isfinite(cfg.TRAIN.MEMORY_LIMIT):
            raise ValueError("TRAIN.BATCH_SIZE_PER_RANK 0 picks the batch that fits TRAIN.MEMORY_LIMIT: give that limit in bytes (1.6e+10)")
    for key in ("TRAIN.STEPS", "TRAIN.LOG_EVERY", "TRAIN.CHECKPOINT_EVERY", "DATA.NUM_IMAGES", "DATA.IMAGE_SIZE"):
        section, name = key.split(".")
        if cfg[section][name] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[section][name]}")
    if cfg.TRAIN.BATCH_SIZE_PER_RANK < 0:
        raise ValueError(f"TRAIN.BATCH_SIZE_PER_RANK must be >= 1 (or 0 with TRAIN.MEMORY_LIMIT), got {cfg.TRAIN.BATCH_SIZE_PER_RANK}")
    _check_data(cfg)
    _check_optim(cfg)
    _check_method_and_head(cfg)
    if cfg.METHOD.NAME == "simclr" and list(cfg.DATA.CROP_COUNTS) != [2]:
        raise ValueError("SimCLR takes exactly two views: DATA.CROP_COUNTS [2]")
    if cfg.TRAIN.GRADIENTS not in ("allocated", "kept"):
        raise ValueError(f"TRAIN.GRADIENTS must be allocated or kept, got {cfg.TRAIN.GRADIENTS!r}")
    _check_in_backward(cfg)
    _check_knn(cfg)
    _check_distributed(cfg)
    if cfg.TRAIN.AUTOCAST not in ("", "bf16", "fp16"):
        raise ValueError(f"TRAIN.AUTOCAST must be '', bf16 or fp16, got {cfg.TRAIN.AUTOCAST!r}")
    if cfg.MODEL.WEIGHTS_INIT.REMOVE_PREFIX and not cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE:
        raise ValueError(f"MODEL.WEIGHTS_INIT.REMOVE_PREFIX {cfg.MODEL.WEIGHTS_INIT.REMOVE_PREFIX!r} says where the trunk is in "
                         "MODEL.WEIGHTS_INIT.PARAMS_FILE: give that file too")


def _check_data(cfg: CN) -> None:
    """The loader's workers, the crops, the synthetic images (an ImageFolder is read when the run starts)."""
    if cfg.DATA.NUM_WORKERS < -1:
        raise ValueError(f"DATA.NUM_WORKERS must be >= 0, or -1 for the machine's spare cores; got {cfg.DATA.NUM_WORKERS}")
    if any(s < 1 for s in cfg.DATA.CROP_SIZES) or any(c < 1 for c in cfg.DATA.CROP_COUNTS):
        raise ValueError("DATA.CROP_SIZES and DATA.CROP_COUNTS must be >= 1")
    if not (len(cfg.DATA.CROP_SIZES) == len(cfg.DATA.CROP_COUNTS) == len(cfg.DATA.CROP_SCALES)):
        raise ValueError("DATA.CROP_SIZES, DATA.CROP_COUNTS and DATA.CROP_SCALES need one entry per resolution")
    if cfg.DATA.SYNTHETIC not in SYNTHETIC_KINDS:
        raise ValueError(f"DATA.SYNTHETIC must be one of {SYNTHETIC_KINDS}, got {cfg.DATA.SYNTHETIC!r}")


def _check_distributed(cfg: CN) -> None:
    """The strategy, and the backend by one of torch's names (torch's own refusal is an AssertionError in every rank)."""
    check_strategy(cfg)
    backends = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    if cfg.DISTRIBUTED.BACKEND not in ("", *backends):
        raise ValueError(f"DISTRIBUTED.BACKEND must be {', '.join(backends)} or empty (nccl on CUDA, gloo on CPU), got {cfg.DISTRIBUTED.BACKEND!r}")


def _check_optim(cfg: CN) -> None:
    """The optimizer, its schedules and DINO's stabilisers."""
    if cfg.OPTIM.NAME not in OPTIMIZERS:
        raise ValueError(f"OPTIM.NAME must be one of {', '.join(OPTIMIZERS)}, got {cfg.OPTIM.NAME!r}")
    if not (math.isfinite(cfg.OPTIM.LR) and cfg.OPTIM.LR >= 0) or cfg.OPTIM.WARMUP_STEPS < 0 or cfg.OPTIM.LR_BATCH_SIZE < 0:
        raise ValueError(f"OPTIM.LR, OPTIM.WARMUP_STEPS and OPTIM.LR_BATCH_SIZE must be >= 0, got {cfg.OPTIM.LR}, {cfg.OPTIM.WARMUP_STEPS} and {cfg.OPTIM.LR_BATCH_SIZE}")
    end = cfg.OPTIM.WEIGHT_DECAY_END
    end_is_number = end is None or (isinstance(end, (int, float)) and not isinstance(end, bool) and math.isfinite(end) and end >= 0)
    if not (math.isfinite(cfg.OPTIM.WEIGHT_DECAY) and cfg.OPTIM.WEIGHT_DECAY >= 0) or not end_is_number:
        raise ValueError(f"OPTIM.WEIGHT_DECAY and WEIGHT_DECAY_END must be finite numbers >= 0 (WEIGHT_DECAY_END None: constant; DINO: 0.04 to 0.4), "
                         f"got {cfg.OPTIM.WEIGHT_DECAY!r} and {end!r}")
    betas = cfg.OPTIM.BETAS
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ValueError(f"OPTIM.BETAS are AdamW's two coefficients, each in [0, 1) (torch's default: [0.9, 0.999]), got {list(betas)!r}")
    if not (math.isfinite(cfg.OPTIM.CLIP_GRAD) and cfg.OPTIM.CLIP_GRAD >= 0) or cfg.METHOD.DINO.FREEZE_LAST_LAYER_STEPS < 0:
        raise ValueError(f"OPTIM.CLIP_GRAD must be a number >= 0 (0: off; DINO: 3.0) and METHOD.DINO.FREEZE_LAST_LAYER_STEPS >= 0; "
                         f"got {cfg.OPTIM.CLIP_GRAD} and {cfg.METHOD.DINO.FREEZE_LAST_LAYER_STEPS}")


def _check_knn(cfg: CN) -> None:
    """The kNN evaluation's numbers (its folders are read when the run starts, before anything is written)."""
    knn = cfg.EVAL.KNN
    if bool(knn.TRAIN_PATH) != bool(knn.VAL_PATH):
        raise ValueError("EVAL.KNN.TRAIN_PATH and EVAL.KNN.VAL_PATH come together: labelled train images and the validation images classified by them")
    if knn.K < 1 or not (math.isfinite(knn.TEMPERATURE) and knn.TEMPERATURE > 0) or knn.EVERY_STEPS < 0:
        raise ValueError(f"EVAL.KNN.K must be >= 1, TEMPERATURE a positive number and EVERY_STEPS >= 0 (0: at the end); "
                         f"got {knn.K}, {knn.TEMPERATURE} and {knn.EVERY_STEPS}")


def _check_in_backward(cfg: CN) -> None:
    """What an optimizer stepped in backward cannot train with: each backward is its step."""
    if not cfg.OPTIM.IN_BACKWARD:
        return
    refused = {
        "TRAIN.GRADIENTS kept": (cfg.TRAIN.GRADIENTS == "kept", "gradients are freed at each update: leave TRAIN.GRADIENTS allocated"),
        "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION True": (cfg.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION,
                                                      "vissl's manual all-reduce runs after backward, when every parameter was updated already from "
                                                      "its own rank's gradient: set it False (DDP's hook reduces each bucket before its update)"),
        "TRAIN.AUTOCAST fp16": (cfg.TRAIN.AUTOCAST == "fp16", "fp16's gradient scaler unscales gradients after backward, when they are gone: use bf16"),
        "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT True": (cfg.MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT,
                                                              "a trunk called once per crop resolution gets each gradient in parts, one per "
                                                              "reentrant backward, and would be updated on each: set it False"),
    }
    for setting, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"OPTIM.IN_BACKWARD True cannot train with {setting}: {why}")


def _check_method_and_head(cfg: CN) -> None:
    """Values that would train nonsense (a NaN loss, an empty layer) rather than fail."""
    if cfg.METHOD.NAME not in ("simclr", "swav", "dino"):
        raise ValueError(f"METHOD.NAME must be simclr, swav or dino, got {cfg.METHOD.NAME!r}")
    aug = cfg.DATA.AUG
    if len(aug.COLOR_JITTER) != 4 or any(v < 0 for v in aug.COLOR_JITTER) or aug.COLOR_JITTER[3] > 0.5:
        raise ValueError(f"DATA.AUG.COLOR_JITTER is [brightness, contrast, saturation, hue], each >= 0 and hue <= 0.5; got {list(aug.COLOR_JITTER)}")
    if not all(0 <= p <= 1 for p in (aug.COLOR_JITTER_PROB, aug.GRAYSCALE_PROB, aug.FLIP_PROB)):
        raise ValueError("DATA.AUG.COLOR_JITTER_PROB, GRAYSCALE_PROB and FLIP_PROB are probabilities in [0, 1]")
    for key in ("BLUR_PROB", "SOLARIZE_PROB"):
        if not aug[key] or not all(isinstance(p, (int, float)) and 0 <= p <= 1 for p in aug[key]):
            raise ValueError(f"DATA.AUG.{key} is a list of probabilities in [0, 1], one per crop (the last holds for the rest); got {aug[key]!r}")
    if len(aug.MEAN) != 3 or len(aug.STD) != 3 or not all(s > 0 for s in aug.STD):
        raise ValueError("DATA.AUG.MEAN and DATA.AUG.STD take one value per colour channel, STD above 0")
    for scale in cfg.DATA.CROP_SCALES:
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"DATA.CROP_SCALES: each entry is [smallest, largest] share of the image's area, with 0 < smallest <= largest <= 1; got {list(scale)}")
    for key in ("MODEL.HEAD.HIDDEN_DIM", "MODEL.HEAD.OUTPUT_DIM"):
        section, sub, name = key.split(".")
        if cfg[section][sub][name] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[section][sub][name]}")
    if not (math.isfinite(cfg.METHOD.TEMPERATURE) and cfg.METHOD.TEMPERATURE > 0):
        raise ValueError(f"METHOD.TEMPERATURE must be a positive number (0.1 is usual), got {cfg.METHOD.TEMPERATURE}")
    if cfg.METHOD.NAME == "swav":
        if cfg.METHOD.NUM_PROTOTYPES < 1:
            raise ValueError(f"METHOD.NUM_PROTOTYPES must be >= 1 for SwAV, got {cfg.METHOD.NUM_PROTOTYPES}")
        if sum(cfg.DATA.CROP_COUNTS) < 2:
            raise ValueError(f"SwAV predicts one crop's code from another: DATA.CROP_COUNTS {list(cfg.DATA.CROP_COUNTS)} gives {sum(cfg.DATA.CROP_COUNTS)} crop")
        if cfg.METHOD.SINKHORN_ITERATIONS < 1 or not cfg.METHOD.SINKHORN_EPSILON > 0:
            raise ValueError("METHOD.SINKHORN_ITERATIONS must be >= 1 and METHOD.SINKHORN_EPSILON > 0")
        negative = [f"{key} {value}" for key, value in cfg.METHOD.SWAV.items() if value < 0]
        if negative:
            raise ValueError(f"METHOD.SWAV: {', '.join(negative)}: each is a count (of embeddings, or steps), 0 or more")
    if cfg.METHOD.NAME == "dino":
        _check_dino(cfg)
    _say_targets_are_the_first_crops(cfg)


def _say_targets_are_the_first_crops(cfg: CN) -> None:
    """DINO's teacher and SwAV's codes read the first DATA.CROP_COUNTS[0] crops, which both recipes make their large
    ones: say so where a later resolution is larger (the small crops listed first, most likely)."""
    sizes, first = list(cfg.DATA.CROP_SIZES), cfg.DATA.CROP_COUNTS[0]
    if cfg.METHOD.NAME in ("dino", "swav") and max(sizes) > sizes[0]:
        method, targets = ("DINO", "the teacher's crops") if cfg.METHOD.NAME == "dino" else ("SwAV", "the crops SwAV assigns codes to")
        warnings.warn(f"DATA.CROP_SIZES {sizes}: {targets} are the first {first} (DATA.CROP_COUNTS[0]), at {sizes[0]}px, and the "
                      f"{max(sizes)}px crops only predict them; list the large crops first, as {method}'s recipes do",
                      UserWarning, stacklevel=3)


def _check_dino(cfg: CN) -> None:
    d = cfg.METHOD.DINO
    if sum(cfg.DATA.CROP_COUNTS) < 2:
        raise ValueError(f"DINO predicts each global crop's teacher output from the other crops: DATA.CROP_COUNTS {list(cfg.DATA.CROP_COUNTS)} gives one crop")
    if not (d.TEACHER_TEMPERATURE > 0 and d.WARMUP_TEACHER_TEMPERATURE > 0) or d.TEACHER_TEMPERATURE_WARMUP_STEPS < 0:
        raise ValueError("METHOD.DINO.TEACHER_TEMPERATURE and WARMUP_TEACHER_TEMPERATURE must be > 0 (0.04 is DINO's), TEACHER_TEMPERATURE_WARMUP_STEPS >= 0")
    if not (0 <= d.TEACHER_MOMENTUM <= 1 and 0 <= d.CENTER_MOMENTUM <= 1):
        raise ValueError(f"METHOD.DINO.TEACHER_MOMENTUM and CENTER_MOMENTUM are in [0, 1] (DINO: 0.996 and 0.9), got {d.TEACHER_MOMENTUM} and {d.CENTER_MOMENTUM}")
    if cfg.METHOD.NUM_PROTOTYPES < 1:
        raise ValueError(f"METHOD.NUM_PROTOTYPES (DINO's output dimension) must be >= 1, got {cfg.METHOD.NUM_PROTOTYPES}")


def _say_which_wins(ac: CN) -> None:
    """SELECT replaces trunk splitting; say so where the config also asks for splitting."""
    if not ac.USE_ACTIVATION_CHECKPOINTING:
        warnings.warn("USE_ACTIVATION_CHECKPOINTING is False, so SELECT is ignored: nothing is checkpointed", UserWarning, stacklevel=3)
        return
    ignored = []
    if ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS != 1:
        ignored.append(f"NUM_ACTIVATION_CHECKPOINTING_SPLITS {ac.NUM_ACTIVATION_CHECKPOINTING_SPLITS}")
    if ac.STRATEGY != "vissl":
        ignored.append(f"STRATEGY {ac.STRATEGY}")
    if ac.MEMORY_BUDGET:
        ignored.append(f"MEMORY_BUDGET {ac.MEMORY_BUDGET:g}")
    if ignored:
        warnings.warn(
            f"SELECT wins: the selected blocks are wrapped and the trunk runs as one segment, so {', '.join(ignored)} "
            "is ignored (leave those at 1 segment, vissl and 0, or clear SELECT to split the trunk)",
            UserWarning,
            stacklevel=3,
        )
