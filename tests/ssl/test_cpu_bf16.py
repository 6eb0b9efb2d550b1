"""A bf16 run on a CPU whose trunk has a convolution torch's bf16 backward computes wrong is refused
before anything is written (trunksplit/ssl/cpu_bf16.py). The reference: the convolution in float64."""
import os
import warnings

import pytest
import torch
import torchvision

from trunksplit.ssl.config import load_config
from trunksplit.ssl.cpu_bf16 import computes_wrong_bf16_weight_gradient, one_pixel_strided_convolutions
from trunksplit.ssl.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
DINO_BF16 = ["MODEL.TRUNK.NAME", "resnet18", "METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", "MODEL.HEAD.HIDDEN_DIM", "32", "DATA.IMAGE_SIZE", "40",
             "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "TRAIN.BATCH_SIZE_PER_RANK", "4",
             "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "1", "TRAIN.AUTOCAST", "bf16"]


def _wrong_runs(input_shape, runs=10) -> int:
    """How often torch's bf16 weight gradient of ResNet's res5.0.conv1 (256 -> 512, 3x3, stride 2, padding 1)
    at ``input_shape`` is more than 5% off float64's, freed memory filled with NaN before each run."""
    g = torch.Generator().manual_seed(1)
    w, wrong = torch.randn(512, 256, 3, 3, generator=g) * 0.05, 0
    for _ in range(runs):
        x = torch.randn(input_shape, generator=g)
        torch.full((10**7,), float("nan"))
        wb, wd = w.bfloat16().requires_grad_(), w.double().requires_grad_()
        for weight, inp in ((wb, x.bfloat16()), (wd, x.double())):
            y = torch.nn.functional.conv2d(inp, weight, stride=2, padding=1)
            y.backward(torch.ones_like(y))
        wrong += not ((wb.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()) <= 0.05
    return wrong


def test_a_bf16_run_whose_trunk_sees_one_pixel_at_a_strided_convolution_is_refused_on_a_cpu(tmp_path):
    """DINO's 16 px local crops bring ResNet-18's res5 to one input pixel, where torch's bf16 backward (oneDNN)
    fills the weight gradient's padding taps with memory it never wrote (a DDP run here trained NaN weights):
    the run is refused, naming the layer and what to change, and writes nothing; in fp32 it trains."""
    if _wrong_runs((64, 256, 1, 1)) == 0:
        pytest.skip(f"torch {torch.__version__} computes this bf16 weight gradient right on this CPU: nothing to refuse")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"TRAIN.AUTOCAST bf16 on this CPU would train res5.0.conv1 \(at 16 px crops\) on wrong gradients: .*"
                                         r"Train in fp32 \(TRAIN.AUTOCAST \"\"\), with larger DATA.CROP_SIZES, or on a GPU"):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), *DINO_BF16]))
    assert not out.exists()
    model, last = train(load_config(QUICK, ["OUTPUT_DIR", str(out), *DINO_BF16, "TRAIN.AUTOCAST", ""]))
    assert all(torch.isfinite(p).all() for p in model.parameters()) and last["step"] == 1


def test_only_a_strided_convolution_over_one_padded_pixel_is_found_wrong():
    """torchvision's ResNet-18 at 16 px (hand-counted: 16, then 8 after conv1, 4 after the max-pool and layer1, 2 after
    layer2, 1 after layer3 and layer4): layer3's strided convolutions see 2 pixels, layer4's (the trunk's res5) see 1,
    and all four end one pixel wide. Torch computes the 3x3 over one padded pixel wrong (most runs, against float64),
    not the one over two pixels, nor the 1x1 without padding."""
    found = one_pixel_strided_convolutions(torchvision.models.resnet18().eval(), [torch.zeros(1, 3, 16, 16)])
    assert {name: tuple(shape) for name, (_, shape) in found.items()} == {
        "layer4.0.conv1": (1, 256, 1, 1), "layer4.0.downsample.0": (1, 256, 1, 1),
        "layer3.0.conv1": (1, 128, 2, 2), "layer3.0.downsample.0": (1, 128, 2, 2)}
    assert _wrong_runs((64, 256, 2, 2)) == 0
    wrong = {name for name, (conv, shape) in found.items() if computes_wrong_bf16_weight_gradient(conv, torch.Size((64, *shape[1:])))}
    assert wrong == ({"layer4.0.conv1"} if _wrong_runs((64, 256, 1, 1)) else set())


def test_an_fp16_run_on_a_cpu_is_told_that_bf16_is_the_cpus_fast_half_precision(tmp_path):
    """Most CPUs have no fp16 arithmetic: the quick start trained 1.5 images/s in fp16 against 38-47 in fp32
    here (docs/config.md). The launcher says so before training, once; a bf16 run hears nothing of it."""
    small = ["OUTPUT_DIR", str(tmp_path / "fp16"), "MODEL.TRUNK.NAME", "resnet18", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40",
             "TRAIN.BATCH_SIZE_PER_RANK", "2", "MODEL.HEAD.HIDDEN_DIM", "16", "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "1", "TRAIN.AUTOCAST", "fp16"]
    with pytest.warns(UserWarning, match=r"TRAIN.AUTOCAST fp16 on a CPU: .* bf16 is what a CPU runs fast") as said:
        train(load_config(QUICK, small))
    assert sum("fp16 on a CPU" in str(w.message) for w in said) == 1
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        train(load_config(QUICK, [*small, "OUTPUT_DIR", str(tmp_path / "bf16"), "TRAIN.AUTOCAST", "bf16"]))
    assert not any("fp16 on a CPU" in str(w.message) for w in heard)
