"""A vissl user's config: a vissl YAML file (keys under ``config:``) or a vissl key on the command line is
refused naming what to write here, and every name it gives is a key of trunksplit's config."""
import os
import re

import pytest

from trunksplit.ssl.config import default_config, load_config
from trunksplit.ssl.config_keys import RENAMED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")

# a pretraining config laid out as vissl's (SimCLR's keys, SwAV's multi-crop) (keys from vissl/config/defaults.yaml)
VISSL_SIMCLR = """\
# @package _global_
config:
  LOG_FREQUENCY: 100
  DATA:
    NUM_DATALOADER_WORKERS: 5
    TRAIN:
      DATA_SOURCES: [disk_folder]
      DATASET_NAMES: [imagenet1k_folder]
      DATA_PATHS: [/datasets/imagenet/train]
      BATCHSIZE_PER_REPLICA: 64
      TRANSFORMS:
        - name: ImgPilToMultiCrop
          total_num_crops: 8
          size_crops: [224, 96]
          num_crops: [2, 6]
          crop_scales: [[0.14, 1], [0.05, 0.14]]
  MODEL:
    TRUNK:
      NAME: resnet
      RESNETS:
        DEPTH: 50
    HEAD:
      PARAMS: [[mlp, {dims: [2048, 2048], use_relu: true}], [mlp, {dims: [2048, 128]}]]
    ACTIVATION_CHECKPOINTING:
      USE_ACTIVATION_CHECKPOINTING: true
      NUM_ACTIVATION_CHECKPOINTING_SPLITS: 4
    WEIGHTS_INIT:
      PARAMS_FILE: /weights/resnet50_supervised.torch
      STATE_DICT_KEY_NAME: ""
      REMOVE_PREFIX: module.
      APPEND_PREFIX: trunk._feature_blocks.
  LOSS:
    name: simclr_info_nce_loss
  OPTIMIZER:
    name: sgd
    use_larc: true
    num_epochs: 100
  DISTRIBUTED:
    NUM_PROC_PER_NODE: 8
    MANUAL_GRADIENT_REDUCTION: true
  CHECKPOINT:
    DIR: /checkpoints/simclr
"""


def _keys(node, prefix=""):
    for name, value in node.items():
        yield from _keys(value, f"{prefix}{name}.") if hasattr(value, "items") else [prefix + name]


def test_a_vissl_config_file_is_refused_saying_what_each_of_its_keys_is_here(tmp_path):
    path = tmp_path / "simclr_8node_resnet.yaml"
    path.write_text(VISSL_SIMCLR)
    with pytest.raises(ValueError) as refused:
        load_config(str(path))
    said = str(refused.value)
    assert said.startswith(f"{path}: a vissl config (its keys under `config:`)")
    for line in ("  DATA.TRAIN.DATA_PATHS ['/datasets/imagenet/train'] -> DATA.PATH",
                 "  DATA.TRAIN.BATCHSIZE_PER_REPLICA 64 -> TRAIN.BATCH_SIZE_PER_RANK",
                 "  MODEL.TRUNK.RESNETS.DEPTH 50 -> MODEL.TRUNK.NAME", "  LOSS.name 'simclr_info_nce_loss' -> METHOD.NAME",
                 "  OPTIMIZER.use_larc True -> OPTIM.NAME lars", "  OPTIMIZER.num_epochs 100 -> TRAIN.STEPS (steps, not epochs)",
                 "  CHECKPOINT.DIR '/checkpoints/simclr' -> OUTPUT_DIR", "  LOG_FREQUENCY 100 -> TRAIN.LOG_EVERY",
                 "  DISTRIBUTED.NUM_PROC_PER_NODE 8 -> torchrun --nproc_per_node",
                 "  DATA.TRAIN.TRANSFORMS [{'name': 'ImgPilToMultiCrop', 'total_num_crops': 8, 'size_c ... -> DATA.CROP_SIZES",
                 "  MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME '' -> nothing: the trunk's weights are found in the file",
                 "  MODEL.WEIGHTS_INIT.APPEND_PREFIX 'trunk._feature_blocks.' -> nothing: the trunk's names, its model's"):
        assert "\n" + line in said, line
    same = said.split("  the same key here: ")[1].split("\n")[0].split(", ")
    assert same == ["MODEL.TRUNK.NAME", "MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING",
                    "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "MODEL.WEIGHTS_INIT.PARAMS_FILE",
                    "MODEL.WEIGHTS_INIT.REMOVE_PREFIX", "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION"]
    assert said.endswith("no counterpart here (leave out): DATA.TRAIN.DATA_SOURCES, DATA.TRAIN.DATASET_NAMES")


def test_a_vissl_key_on_the_command_line_is_refused_with_its_name_here():
    for key in ("OPTIMIZER.num_epochs", "config.OPTIMIZER.num_epochs"):
        with pytest.raises(ValueError, match=re.escape(f"unknown config key: {key}; that is vissl's key: here, TRAIN.STEPS (steps, not epochs)")):
            load_config(QUICK, [key, "3"])
    with pytest.raises(ValueError, match=re.escape("unknown config key: MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE; that is vissl's key: here, nothing: "
                                                   "MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN makes every BatchNorm trunksplit.SyncBatchNorm")):
        load_config(QUICK, ["MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE", "apex"])  # vissl's pytorch or apex: one kind here
    with pytest.raises(ValueError, match=re.escape("config=pretrain/simclr/simclr_8node_resnet: vissl's config=FILE is --config-file FILE here")):
        load_config("", ["config=pretrain/simclr/simclr_8node_resnet"])  # vissl's command line
    with pytest.raises(ValueError, match=re.escape("KEY VALUE pairs with a space between, as in detectron2: config.OPTIMIZER.num_epochs 3; "
                                                   "that is vissl's key: here, TRAIN.STEPS")):
        load_config("", ["config.OPTIMIZER.num_epochs=3"])
    with pytest.raises(ValueError, match=re.escape("unknown config key: TRAIN.STEP; did you mean TRAIN.STEPS?")):
        load_config(QUICK, ["TRAIN.STEP", "3"])  # a key of neither: the closest of trunksplit's


def test_every_name_the_hints_give_is_a_key_here_and_every_vissl_key_they_read_is_not():
    ours = set(_keys(default_config()))
    for vissl_key, said in RENAMED.items():
        assert vissl_key not in ours, vissl_key  # a key of both would never reach its hint
        named = said.split(" ")[0].rstrip(",")
        assert named in ours or named in ("tools/train.py", "torchrun", "nothing:"), (vissl_key, said)
        for also in re.findall(r"\b[A-Z]+\.[A-Z_.]+[A-Z]\b", said):  # a key, or a section (DATA.AUG.*)
            assert also in ours or any(key.startswith(also + ".") for key in ours), (vissl_key, also)

