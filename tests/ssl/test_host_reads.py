"""A training step never reads a tensor's value back to the host: on a GPU each such read waits for every
kernel queued before it (torch's sync debug mode counts them: tests/cuda). Counted here on the CPU, where
the same code runs, as the ``aten._local_scalar_dense`` calls (``.item()``, ``bool()``, ``float()``, ``if t``)
that the launcher's forward, backward and optimizer step make; the loss logged once a step is outside them."""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # private: see every op run, to count the reads

from trunksplit.ssl import loop
from trunksplit.ssl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4", "MODEL.HEAD.HIDDEN_DIM", "64",
         "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "2"]
MULTI_CROP = ["DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]"]
# optimizers without a step counter (AdamW's is a host tensor, read on the host: no wait on a GPU)
CASES = {
    "simclr": [],
    "dino grouped, clipped": ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", *MULTI_CROP, "OPTIM.CLIP_GRAD", "3.0"],
    "swav, its queue used": ["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "16", *MULTI_CROP, "METHOD.SWAV.QUEUE_LENGTH", "4"],  # full after step 1
    "dino whole, clipped, stepped in backward": ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", *MULTI_CROP, "OPTIM.CLIP_GRAD", "3.0",
                                                 "TRAIN.BACKWARD_BY_CROP_GROUP", "False", "OPTIM.IN_BACKWARD", "True"],
}


class _HostReads(TorchDispatchMode):
    """Counts the ops that hand a tensor's value to Python."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", list(CASES))
def test_the_launchers_step_reads_no_tensor_value_back_to_the_host(tmp_path, monkeypatch, case):
    """DINO's gradient clipping branched on each parameter's clip coefficient (DINO's ``if clip_coef < 1``):
    one read a parameter (134 in these two steps), inside backward where the optimizer steps there."""
    reads = _HostReads()

    def counted(real):
        def run(*args, **kwargs):
            with reads:
                return real(*args, **kwargs)
        return run

    monkeypatch.setattr(loop, "_forward_backward", counted(loop._forward_backward))
    monkeypatch.setattr(loop, "_optimizer_step", counted(loop._optimizer_step))
    _, last = loop.train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), *SMALL, *CASES[case]]))
    assert last["step"] == 2
    assert reads.count == 0, reads.count
