"""Config defaults (fvcore ``CfgNode``), in one place; YAML files only override them.

Key names follow vissl where vissl had the concept (``MODEL.TRUNK.*``,
``MODEL.ACTIVATION_CHECKPOINTING.*``, ``DISTRIBUTED.MANUAL_GRADIENT_REDUCTION``).
"""
from typing import Sequence

from fvcore.common.config import CfgNode as CN

_C = CN()
_C.OUTPUT_DIR = "output/run"
_C.SEED = 0

_C.MODEL = CN()
_C.MODEL.TRUNK = CN()
_C.MODEL.TRUNK.NAME = "resnet50"  # any torchvision ResNet/ResNeXt/Wide-ResNet/RegNet
_C.MODEL.TRUNK.OUT_FEAT_KEYS = ["flatten"]
_C.MODEL.ACTIVATION_CHECKPOINTING = CN()
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = True
_C.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS = 2
_C.MODEL.ACTIVATION_CHECKPOINTING.STRATEGY = "vissl"  # vissl | balanced
_C.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET = 0.0  # 0: off; a fraction in (0, 1] of the unsplit peak, or bytes as a float (2.0e+9)
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT = False
# Selective wrapping instead of trunk splitting, e.g. {every_k: 2, types: [torchvision.models.resnet.Bottleneck]}
_C.MODEL.ACTIVATION_CHECKPOINTING.SELECT = CN(new_allowed=True)
_C.MODEL.HEAD = CN()
_C.MODEL.HEAD.HIDDEN_DIM = 512
_C.MODEL.HEAD.OUTPUT_DIM = 128

_C.METHOD = CN()
_C.METHOD.NAME = "simclr"  # simclr | swav
_C.METHOD.TEMPERATURE = 0.1
_C.METHOD.NUM_PROTOTYPES = 64  # swav
_C.METHOD.SINKHORN_ITERATIONS = 3  # swav
_C.METHOD.SINKHORN_EPSILON = 0.05  # swav

_C.DATA = CN()
_C.DATA.PATH = ""  # an ImageFolder root; empty: deterministic synthetic images
_C.DATA.NUM_IMAGES = 256  # synthetic data set size
_C.DATA.IMAGE_SIZE = 96  # synthetic images, and what ImageFolder images are resized to
_C.DATA.CROP_SIZES = [64]  # one entry per resolution; the trunk runs once per resolution per step
_C.DATA.CROP_COUNTS = [2]
_C.DATA.CROP_SCALES = [[0.3, 1.0]]

_C.TRAIN = CN()
_C.TRAIN.BATCH_SIZE_PER_RANK = 8
_C.TRAIN.STEPS = 20
_C.TRAIN.LOG_EVERY = 1
_C.TRAIN.CHECKPOINT_EVERY = 10
_C.TRAIN.AUTOCAST = ""  # "" | bf16 | fp16
_C.TRAIN.DEVICE = ""  # "": cuda when available, else cpu

_C.OPTIM = CN()
_C.OPTIM.LR = 0.3
_C.OPTIM.MOMENTUM = 0.9
_C.OPTIM.WEIGHT_DECAY = 1e-6
_C.OPTIM.WARMUP_STEPS = 2

_C.DISTRIBUTED = CN()
_C.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION = False
_C.DISTRIBUTED.BACKEND = ""  # "": nccl on CUDA, gloo on CPU


def default_config() -> CN:
    return _C.clone()


def load_config(path: str = "", overrides: Sequence[str] = ()) -> CN:
    """Defaults, then the YAML file, then ``KEY VALUE`` pairs, as detectron2 does.

    Unknown keys raise ``ValueError`` naming the key; the result is frozen.
    """
    cfg = default_config()
    if path:
        try:
            cfg.merge_from_file(path)
        except KeyError as e:  # fvcore: "Non-existent config key: A.B"
            raise ValueError(f"unknown config key in {path}: {str(e.args[0]).split(': ')[-1]}") from None
        except FileNotFoundError:
            raise ValueError(f"config file not found: {path}") from None
    if len(overrides) % 2:
        raise ValueError(f"overrides come in KEY VALUE pairs; got an odd count: {list(overrides)}")
    for key in overrides[0::2]:
        node = cfg
        for part in key.split("."):
            if not isinstance(node, CN) or part not in node:
                raise ValueError(f"unknown config key: {key}")
            node = node[part]
    cfg.merge_from_list(list(overrides))
    _check(cfg)
    cfg.freeze()
    return cfg


def _check(cfg: CN) -> None:
    ac = cfg.MODEL.ACTIVATION_CHECKPOINTING
    if ac.STRATEGY not in ("vissl", "balanced"):
        raise ValueError(f"MODEL.ACTIVATION_CHECKPOINTING.STRATEGY must be vissl or balanced, got {ac.STRATEGY!r}")
    if cfg.METHOD.NAME not in ("simclr", "swav"):
        raise ValueError(f"METHOD.NAME must be simclr or swav, got {cfg.METHOD.NAME!r}")
    if not (len(cfg.DATA.CROP_SIZES) == len(cfg.DATA.CROP_COUNTS) == len(cfg.DATA.CROP_SCALES)):
        raise ValueError("DATA.CROP_SIZES, DATA.CROP_COUNTS and DATA.CROP_SCALES need one entry per resolution")
    if cfg.METHOD.NAME == "simclr" and list(cfg.DATA.CROP_COUNTS) != [2]:
        raise ValueError("SimCLR takes exactly two views: DATA.CROP_COUNTS [2]")
    if cfg.TRAIN.AUTOCAST not in ("", "bf16", "fp16"):
        raise ValueError(f"TRAIN.AUTOCAST must be '', bf16 or fp16, got {cfg.TRAIN.AUTOCAST!r}")
