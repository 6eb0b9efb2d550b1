"""Config defaults (fvcore ``CfgNode``), in one place; YAML files only override them.

Key names follow vissl where vissl had the concept (``MODEL.TRUNK.*``,
``MODEL.ACTIVATION_CHECKPOINTING.*``, ``DISTRIBUTED.MANUAL_GRADIENT_REDUCTION``).
"""
import math
import os
import re
import warnings
from typing import Sequence

import yaml
from fvcore.common.config import CfgNode as CN

from ..planning.budget import MemoryBudget
from ..recompute.select import condition_from_config
from .backbones import check_backbone_name, fixed_resolution
from .data import SYNTHETIC_KINDS
from .optim import OPTIMIZERS
from .strategy import check_strategy

_C = CN()
_C.OUTPUT_DIR = "output/run"
_C.SEED = 0

_C.MODEL = CN()
_C.MODEL.TRUNK = CN()
_C.MODEL.TRUNK.NAME = "resnet50"  # any torchvision classification model (ResNet to ViT, Swin, MaxViT): docs/backbones.md
_C.MODEL.TRUNK.OUT_FEAT_KEYS = ["flatten"]
_C.MODEL.ACTIVATION_CHECKPOINTING = CN()
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = True
_C.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS = 2
_C.MODEL.ACTIVATION_CHECKPOINTING.STRATEGY = "vissl"  # vissl | balanced
_C.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET = 0.0  # 0: off; a fraction in (0, 1] of the unsplit peak, or bytes as a float (2.0e+9)
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT = False
# Selective wrapping instead of trunk splitting, e.g. {every_k: 2, types: [torchvision.models.resnet.Bottleneck]}
# From the command line: SELECT "{every_k: 2, types: [torchvision.models.resnet.Bottleneck]}" or SELECT.every_k 2.
_C.MODEL.ACTIVATION_CHECKPOINTING.SELECT = CN(new_allowed=True)
_C.MODEL.HEAD = CN()
_C.MODEL.HEAD.HIDDEN_DIM = 512
_C.MODEL.HEAD.OUTPUT_DIM = 128

_C.METHOD = CN()
_C.METHOD.NAME = "simclr"  # simclr | swav | dino
_C.METHOD.TEMPERATURE = 0.1  # dino: the student's
_C.METHOD.NUM_PROTOTYPES = 64  # swav: prototypes; dino: outputs of the weight-normalised last layer (65536 in the paper)
_C.METHOD.SINKHORN_ITERATIONS = 3  # swav
_C.METHOD.SINKHORN_EPSILON = 0.05  # swav
_C.METHOD.DINO = CN()  # see trunksplit/ssl/dino.py; the paper's values
_C.METHOD.DINO.TEACHER_TEMPERATURE = 0.04
_C.METHOD.DINO.WARMUP_TEACHER_TEMPERATURE = 0.04  # linear from this to TEACHER_TEMPERATURE ...
_C.METHOD.DINO.TEACHER_TEMPERATURE_WARMUP_STEPS = 0  # ... over these steps
_C.METHOD.DINO.TEACHER_MOMENTUM = 0.996  # EMA momentum at step 0; a cosine to 1 at the last step
_C.METHOD.DINO.CENTER_MOMENTUM = 0.9
_C.METHOD.DINO.FREEZE_LAST_LAYER_STEPS = 0  # the head's last layer not updated in the first steps (the paper: one epoch)

_C.DATA = CN()
_C.DATA.PATH = ""  # an ImageFolder root; empty: deterministic synthetic images
_C.DATA.NUM_IMAGES = 256  # synthetic data set size
_C.DATA.SYNTHETIC = "fields"  # without DATA.PATH: "fields" (smooth colour fields) or "stripes" (black-and-white gratings)
_C.DATA.IMAGE_SIZE = 96  # synthetic images, and what ImageFolder images are resized to
_C.DATA.CROP_SIZES = [64]  # one entry per resolution; the trunk runs once per resolution per step
_C.DATA.CROP_COUNTS = [2]
_C.DATA.CROP_SCALES = [[0.3, 1.0]]
# SimCLR's colour distortions (SwAV's multi-crop uses them too), see trunksplit/ssl/augment.py
_C.DATA.AUG = CN()
_C.DATA.AUG.FLIP_PROB = 0.5  # a horizontal flip (0 where a flipped image means another thing: digits, text)
_C.DATA.AUG.COLOR_JITTER = [0.8, 0.8, 0.8, 0.2]  # brightness, contrast, saturation, hue
_C.DATA.AUG.COLOR_JITTER_PROB = 0.8
_C.DATA.AUG.GRAYSCALE_PROB = 0.2
# one entry per crop in crop order, the last holding for the crops after it (DINO: [1.0, 0.1, 0.5])
_C.DATA.AUG.BLUR_PROB = [0.5]
_C.DATA.AUG.SOLARIZE_PROB = [0.0]  # DINO: [0.0, 0.2, 0.0]
_C.DATA.AUG.MEAN = [0.485, 0.456, 0.406]  # ImageNet's
_C.DATA.AUG.STD = [0.229, 0.224, 0.225]
_C.DATA.NUM_WORKERS = -1  # DataLoader worker processes; -1: the machine's spare cores per process, at most 4

_C.TRAIN = CN()
_C.TRAIN.BATCH_SIZE_PER_RANK = 8  # 0: the largest that fits TRAIN.MEMORY_LIMIT (trunksplit.fit)
_C.TRAIN.MEMORY_LIMIT = 0.0  # bytes resident per rank during a step (parameters, optimizer state, gradients, peak), for batch 0
_C.TRAIN.STEPS = 20
_C.TRAIN.LOG_EVERY = 1
_C.TRAIN.CHECKPOINT_EVERY = 10
_C.TRAIN.AUTOCAST = ""  # "" | bf16 | fp16
_C.TRAIN.DEVICE = ""  # "": cuda when available, else cpu
# allocated: optimizer.zero_grad() sets gradients to None (torch's default), so each step allocates
# them in backward; kept: zero_grad(set_to_none=False). Memory budgets are planned for this mode.
_C.TRAIN.GRADIENTS = "allocated"
# DINO and SwAV with several crop resolutions: each resolution's forward, loss share and backward before
# the next one's forward (one group's activations alive at a time; the same gradients): trunksplit/ssl/grouped.py
_C.TRAIN.BACKWARD_BY_CROP_GROUP = True

_C.OPTIM = CN()
_C.OPTIM.NAME = "sgd"  # sgd | lars | adamw, see trunksplit/ssl/optim.py
_C.OPTIM.LR = 0.3
# > 0: OPTIM.LR is the rate at this many images a step, scaled linearly to the run's total batch (all
# ranks), the rule the SimCLR, SwAV and DINO recipes state (0.3 x batch / 256: LR 0.3, LR_BATCH_SIZE 256)
_C.OPTIM.LR_BATCH_SIZE = 0
_C.OPTIM.MOMENTUM = 0.9  # sgd, lars
_C.OPTIM.BETAS = [0.9, 0.999]  # adamw
_C.OPTIM.LARS_TRUST_COEFFICIENT = 0.001  # lars (vissl's LARC trust_coefficient)
_C.OPTIM.WEIGHT_DECAY = 1e-6
_C.OPTIM.WEIGHT_DECAY_END = None  # None: constant; a value: cosine from WEIGHT_DECAY to it (DINO: 0.04 to 0.4)
_C.OPTIM.CLIP_GRAD = 0.0  # > 0: each parameter's gradient clipped to this norm before its update (DINO: 3.0)
_C.OPTIM.EXCLUDE_BIAS_AND_NORM = False  # True: biases and norm weights get no weight decay and no LARS trust ratio
_C.OPTIM.WARMUP_STEPS = 2
# True: each parameter is updated in backward as soon as its gradient is whole, and the gradient freed
# (trunksplit.optimizer_in_backward): the gradients are never all alive, and the trunk plans for it
_C.OPTIM.IN_BACKWARD = False

# k-nearest-neighbour evaluation of the trunk's features (DINO's weighted kNN): trunksplit/ssl/knn.py
_C.EVAL = CN()
_C.EVAL.KNN = CN()
_C.EVAL.KNN.TRAIN_PATH = ""  # an ImageFolder root (a folder per class): the neighbours; empty: no kNN evaluation
_C.EVAL.KNN.VAL_PATH = ""  # an ImageFolder root with the same class folders: the images classified
_C.EVAL.KNN.EVERY_STEPS = 0  # 0: after the last step only
_C.EVAL.KNN.K = 20
_C.EVAL.KNN.TEMPERATURE = 0.07

# beside metrics.jsonl (always written): trunksplit/ssl/metrics_log.py
_C.LOGGING = CN()
_C.LOGGING.TENSORBOARD = False  # True: TensorBoard scalars in OUTPUT_DIR/tensorboard (needs: pip install tensorboard)

_C.DISTRIBUTED = CN()
_C.DISTRIBUTED.STRATEGY = "ddp"  # ddp: a replica per rank; fsdp: parameters, gradients and optimizer state sharded (FSDP2)
_C.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION = False
_C.DISTRIBUTED.BACKEND = ""  # "": nccl on CUDA, gloo on CPU


def default_config() -> CN:
    return _C.clone()


SELECT_KEY = "MODEL.ACTIVATION_CHECKPOINTING.SELECT"
# keys that take a memory size or budget: written as numbers (0.5, 2.0e+9) or size strings (2GiB)
SIZE_KEYS = ("MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "TRAIN.MEMORY_LIMIT")


def _size_as_float(key: str, value) -> float:
    """A size or budget as the config stores it: a float (a fraction, or bytes; 0: none)."""
    budget = MemoryBudget.parse(value, key)
    return 0.0 if budget is None else float(budget.fraction if budget.fraction is not None else budget.bytes)


def load_config(path: str = "", overrides: Sequence[str] = ()) -> CN:
    """Defaults, then the YAML file, then ``KEY VALUE`` pairs, as detectron2 does.

    Every mistake is a ``ValueError`` that names what to change (an unknown key, a
    missing file or ``_BASE_``, bad YAML, a value out of range); the result is frozen.
    """
    cfg = default_config()
    if path:
        _merge_file(cfg, path)
    if len(overrides) % 2:
        raise ValueError(f"overrides come in KEY VALUE pairs; got an odd count: {list(overrides)}")
    plain = []
    for key, value in zip(overrides[0::2], overrides[1::2]):
        if key == SELECT_KEY or key.startswith(SELECT_KEY + "."):
            _set_select(cfg, key[len(SELECT_KEY) + 1 :], value)
            continue
        node = cfg
        for part in key.split("."):
            if not isinstance(node, CN) or part not in node:
                raise ValueError(f"unknown config key: {key}")
            node = node[part]
        if key in SIZE_KEYS:
            value = str(_size_as_float(key, value))  # "2GiB", as every entry point takes a size
        elif isinstance(node, float) and re.fullmatch(r"[+-]?\d+", value.strip()):
            value = str(float(value))  # "MEMORY_BUDGET 0" means 0.0; yacs would refuse an int for a float key
        if isinstance(node, list) and re.fullmatch(r"[+-]?[\d.]+(e[+-]?\d+)?", value.strip()):
            value = f"[{value}]"  # "BLUR_PROB 0.5": one value for every crop
        plain += [key, value]
    try:
        cfg.merge_from_list(plain)
    except (ValueError, KeyError, AssertionError) as e:  # yacs: a value of the wrong type
        raise ValueError(f"bad command-line value: {e}") from None
    _check(cfg)
    cfg.freeze()
    return cfg


def _merge_file(cfg: CN, path: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"config file {path} is a directory; give a YAML file such as configs/quickstart.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    try:
        loaded = cfg.load_yaml_with_base(path, allow_unsafe=False)
        for key in SIZE_KEYS:  # "MEMORY_BUDGET: 2GiB": a size string, read as the command line reads it
            section, name = key.rsplit(".", 1)
            node = loaded
            for part in section.split("."):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict) and isinstance(node.get(name), str):
                node[name] = _size_as_float(key, node[name])
        cfg.merge_from_other_cfg(CN(loaded))
    except KeyError as e:  # fvcore: "Non-existent config key: A.B"
        raise ValueError(f"unknown config key in {path}: {str(e.args[0]).split(': ')[-1]}") from None
    except FileNotFoundError as e:  # the file exists, so its _BASE_ does not
        raise ValueError(f"{path}: its _BASE_ file {e.filename or e} does not exist (a _BASE_ path is relative to the file that names it)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    except (ValueError, AssertionError, TypeError) as e:  # yacs: a value of the wrong type
        raise ValueError(f"{path}: {e}") from None


def _set_select(cfg: CN, sub: str, text: str) -> None:
    """SELECT from the command line: a YAML mapping for the whole node, or one of its keys."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{SELECT_KEY}: {text!r} is not valid YAML ({e})") from None
    node = cfg.MODEL.ACTIVATION_CHECKPOINTING
    if not sub:
        if value in (None, {}):
            node.SELECT = CN(new_allowed=True)
            return
        if not isinstance(value, dict):
            raise ValueError(f"{SELECT_KEY} takes a mapping such as \"{{every_k: 2, types: [torchvision.models.resnet.Bottleneck]}}\", got {text!r}")
        node.SELECT = CN(value, new_allowed=True)
    else:
        node.SELECT[sub] = value


def _check_types(cfg: CN, defaults: CN, prefix: str = "") -> None:
    """Every key holds a value of its default's type (yacs lets None through): a bool is True or
    False, a number a number, text text, a list a list; a key whose default is None takes any."""
    kinds = [(bool, "True or False"), (int, "a whole number"), (float, "a number"), (str, "text"), ((list, tuple), "a list")]
    for name, default in defaults.items():
        key, value = prefix + name, cfg[name]
        if isinstance(default, CN):
            if key != SELECT_KEY:  # its own check: condition_from_config
                _check_types(value, default, key + ".")
            continue
        kind, said = next(((k, w) for k, w in kinds if isinstance(default, k)), (None, ""))
        numbers = (int, float) if kind is float else kind
        if kind is not None and (not isinstance(value, numbers) or (kind is not bool and isinstance(value, bool))):
            raise ValueError(f"{key} must be {said} (default {default!r}), got {value!r}")


def _check(cfg: CN) -> None:
    _check_types(cfg, _C)
    check_backbone_name(cfg.MODEL.TRUNK.NAME)
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
    if cfg.DATA.NUM_WORKERS < -1:
        raise ValueError(f"DATA.NUM_WORKERS must be >= 0, or -1 for the machine's spare cores; got {cfg.DATA.NUM_WORKERS}")
    if any(s < 1 for s in cfg.DATA.CROP_SIZES) or any(c < 1 for c in cfg.DATA.CROP_COUNTS):
        raise ValueError("DATA.CROP_SIZES and DATA.CROP_COUNTS must be >= 1")
    _check_optim(cfg)
    if not (len(cfg.DATA.CROP_SIZES) == len(cfg.DATA.CROP_COUNTS) == len(cfg.DATA.CROP_SCALES)):
        raise ValueError("DATA.CROP_SIZES, DATA.CROP_COUNTS and DATA.CROP_SCALES need one entry per resolution")
    _check_method_and_head(cfg)
    if cfg.METHOD.NAME == "simclr" and list(cfg.DATA.CROP_COUNTS) != [2]:
        raise ValueError("SimCLR takes exactly two views: DATA.CROP_COUNTS [2]")
    if cfg.TRAIN.GRADIENTS not in ("allocated", "kept"):
        raise ValueError(f"TRAIN.GRADIENTS must be allocated or kept, got {cfg.TRAIN.GRADIENTS!r}")
    _check_in_backward(cfg)
    _check_knn(cfg)
    check_strategy(cfg)
    if cfg.TRAIN.AUTOCAST not in ("", "bf16", "fp16"):
        raise ValueError(f"TRAIN.AUTOCAST must be '', bf16 or fp16, got {cfg.TRAIN.AUTOCAST!r}")
    if cfg.DATA.SYNTHETIC not in SYNTHETIC_KINDS:
        raise ValueError(f"DATA.SYNTHETIC must be one of {SYNTHETIC_KINDS}, got {cfg.DATA.SYNTHETIC!r}")


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
    if cfg.METHOD.NAME == "dino":
        _check_dino(cfg)


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
