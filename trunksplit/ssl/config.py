"""Config defaults (fvcore ``CfgNode``), in one place; YAML files only override them.

Key names follow vissl where vissl had the concept (``MODEL.TRUNK.*``,
``MODEL.ACTIVATION_CHECKPOINTING.*``, ``DISTRIBUTED.MANUAL_GRADIENT_REDUCTION``).
"""
import ast
import difflib
import os
import re
from typing import Optional, Sequence

import yaml
from fvcore.common.config import CfgNode as CN

from ..planning.budget import MemoryBudget
from .config_checks import SELECT_KEY, check_config, type_refusal
from .config_keys import by_dotted_key, refuse_vissl_file, vissl_hint

_C = CN()
_C.OUTPUT_DIR = "output/run"
_C.SEED = 0

_C.MODEL = CN()
_C.MODEL.TRUNK = CN()
_C.MODEL.TRUNK.NAME = "resnet50"  # a torchvision classification model (ResNet to ViT, Swin, MaxViT), timm:NAME or hf:TYPE: docs/backbones.md
_C.MODEL.TRUNK.OUT_FEAT_KEYS = ["flatten"]
_C.MODEL.TRUNK.RESNETS = CN()
# vissl's: a torchvision ResNet's stages this many times as wide (2, 4: SimCLR's ResNet-50 (2x), (4x)); a fraction narrows it (0.25: 16 channels in the stem)
_C.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER = 1.0
_C.MODEL.ACTIVATION_CHECKPOINTING = CN()
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = True
_C.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS = 2
_C.MODEL.ACTIVATION_CHECKPOINTING.STRATEGY = "vissl"  # vissl | balanced
_C.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET = 0.0  # 0: off; a fraction in (0, 1] of the unsplit peak, or bytes as a float (2.0e+9)
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT = False
# Selective wrapping instead of trunk splitting, e.g. {every_k: 2, types: [torchvision.models.resnet.Bottleneck]}
# From the command line: SELECT "{every_k: 2, types: [torchvision.models.resnet.Bottleneck]}" or SELECT.every_k 2.
_C.MODEL.ACTIVATION_CHECKPOINTING.SELECT = CN(new_allowed=True)
# the trunk starts from a file's weights, not random ones (a torchvision or timm state_dict, a vissl or trunksplit
# checkpoint; the trunk's entries are found in it): trunksplit/ssl/weights_init.py. Not read on --resume.
_C.MODEL.WEIGHTS_INIT = CN()
_C.MODEL.WEIGHTS_INIT.PARAMS_FILE = ""  # "": random weights
_C.MODEL.WEIGHTS_INIT.REMOVE_PREFIX = ""  # where the file holds the trunk under several prefixes (DINO's student and teacher): the one
# vissl's key: every BatchNorm of the trunk and the head normalises over all ranks' images (SimCLR's global BN),
# trunksplit.SyncBatchNorm, on CPU (gloo) and GPU alike, exact under checkpointing; one process: plain BatchNorm
_C.MODEL.SYNC_BN_CONFIG = CN()
_C.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN = False
_C.MODEL.SYNC_BN_CONFIG.GROUP_SIZE = -1  # vissl's: the ranks a norm spans; -1 one machine's (torchrun's LOCAL_WORLD_SIZE), 0 all, N groups of N
_C.MODEL.HEAD = CN()
_C.MODEL.HEAD.HIDDEN_DIM = 512
_C.MODEL.HEAD.OUTPUT_DIM = 128

_C.METHOD = CN()
_C.METHOD.NAME = "simclr"  # simclr | swav | dino
_C.METHOD.TEMPERATURE = 0.1  # dino: the student's
_C.METHOD.NUM_PROTOTYPES = 64  # swav: prototypes; dino: outputs of the weight-normalised last layer (65536 in the paper)
_C.METHOD.SINKHORN_ITERATIONS = 3  # swav
_C.METHOD.SINKHORN_EPSILON = 0.05  # swav
_C.METHOD.SWAV = CN()  # see trunksplit/ssl/swav.py
_C.METHOD.SWAV.QUEUE_LENGTH = 0  # the last large crops' embeddings, every rank's, partitioned with the batch (SwAV: 3840 at batch 256); 0: none
_C.METHOD.SWAV.QUEUE_START_STEP = 0  # the queue fills from this step on, and is used once full (SwAV: epoch 15)
_C.METHOD.SWAV.FREEZE_PROTOTYPES_STEPS = 0  # the prototypes not updated in the first steps (SwAV: 313 iterations)
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
_C.DATA.NUM_WORKERS = -1  # DataLoader worker processes; -1: the spare cores per process of those it may run on, at most 4

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
# Native DDP trains kept (its buckets hold the gradients anyway: ssl/strategy.py, DDP.configured).
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
    for key in overrides[0::2]:  # hydra's (vissl's command line) KEY=VALUE: shifted, it would pair a key with the next key
        if "=" in key:
            name, value = key.split("=", 1)
            if name == "config":
                raise ValueError(f"{key}: vissl's config=FILE is --config-file FILE here, a YAML of trunksplit's keys (configs/ holds them)")
            raise ValueError(f"{key}: overrides are KEY VALUE pairs with a space between, as in detectron2: {name} {value}{vissl_hint(name)}")
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
                raise ValueError(f"unknown config key: {key}{_did_you_mean(key, cfg)}")
            node = node[part]
        if key in SIZE_KEYS:
            value = str(_size_as_float(key, value))  # "2GiB", as every entry point takes a size
        elif isinstance(node, float) and re.fullmatch(r"[+-]?\d+", value.strip()):
            value = str(float(value))  # "MEMORY_BUDGET 0" means 0.0; yacs would refuse an int for a float key
        if isinstance(node, list):
            value = repr(_as_list(key, value))
        value = _scalar(key, node, value)
        plain += [key, value]
    try:
        cfg.merge_from_list(plain)
    except (ValueError, KeyError, AssertionError) as e:  # yacs: a value of the wrong type
        raise ValueError(f"bad command-line value: {e}") from None
    check_config(cfg, _C)
    cfg.freeze()
    return cfg


def _did_you_mean(key: str, cfg: CN) -> str:
    """``"; did you mean TRAIN.STEPS?"`` for ``TRAIN.STEP`` or ``train.steps``: the closest known key (or
    section), where one is close; for a key of vissl's (``OPTIMIZER.num_epochs``), what it is here."""
    known = list(by_dotted_key(cfg))
    sections = {key.rsplit(".", i)[0] for key in known for i in range(1, key.count(".") + 1)}
    same_but_case = [k for k in (*known, *sections) if k.upper() == key.upper()]
    close = same_but_case or difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return vissl_hint(key) or (f"; did you mean {close[0]}?" if close else "")


def _scalar(key: str, default, text: str) -> str:
    """A scalar key's value as yacs reads it (a Python literal): a text key's number as text (``TRAIN.GRADIENTS 3``
    reaches the key's own check), another kind's value than its default's refused naming the key and the kind
    (:func:`type_refusal`; yacs would say "Type mismatch (<class 'int'> vs. <class 'str'>)")."""
    if isinstance(default, (CN, list, tuple)) or default is None:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if isinstance(default, str):
        return repr(text) if isinstance(value, (int, float)) else text
    refusal = type_refusal(key, default, value)
    if refusal:
        raise ValueError(refusal)
    return text


def _as_list(key: str, text: str) -> Optional[list]:
    """A list key's value from the command line: a Python literal (``"['res4', 'flatten']"``), or
    YAML's list as a config file writes it (``[res4, flatten]``, unquoted); one value stands for a
    list of it (``OUT_FEAT_KEYS res5``, ``BLUR_PROB 0.5``: one for every crop)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ValueError(f"{key} takes a list such as [res4, flatten] or one value, got {text!r}") from None
    if value is None:
        return None  # refused by the type check, which names the key
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _merge_file(cfg: CN, path: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"config file {path} is a directory; give a YAML file such as configs/quickstart.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    try:
        loaded = cfg.load_yaml_with_base(path, allow_unsafe=False)
        refuse_vissl_file(loaded, by_dotted_key(cfg))
        for key in SIZE_KEYS:  # "MEMORY_BUDGET: 2GiB": a size string, read as the command line reads it
            section, name = key.rsplit(".", 1)
            node = loaded
            for part in section.split("."):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict) and isinstance(node.get(name), str):
                node[name] = _size_as_float(key, node[name])
        _whole_numbers_as_floats(loaded, cfg)
        cfg.merge_from_other_cfg(CN(loaded))
    except KeyError as e:  # fvcore: "Non-existent config key: A.B"
        key = str(e.args[0]).split(": ")[-1]
        raise ValueError(f"unknown config key in {path}: {key}{_did_you_mean(key, cfg)}") from None
    except FileNotFoundError as e:  # the file exists, so its _BASE_ does not
        raise ValueError(f"{path}: its _BASE_ file {e.filename or e} does not exist (a _BASE_ path is relative to the file that names it)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    except (ValueError, AssertionError, TypeError) as e:  # yacs: a value of the wrong type
        raise ValueError(f"{path}: {e}") from None


def _whole_numbers_as_floats(loaded: dict, defaults: CN) -> None:
    """``WIDTH_MULTIPLIER: 2`` or ``LR: 1`` in a file, for a key whose default is a float: read as 2.0, as the
    command line reads it (yacs refuses an int for a float key: "Type mismatch")."""
    for key, value in loaded.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, CN):
            _whole_numbers_as_floats(value, default)
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            loaded[key] = float(value)


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
