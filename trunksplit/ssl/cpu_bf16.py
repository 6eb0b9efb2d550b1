"""bf16 convolutions on a CPU whose weight gradients torch computes wrong, found before a run trains on them.

torch's bf16 convolution on x86 CPUs (oneDNN; not on an AVX2-only one, where it takes another path) fills
the weight gradient of a strided convolution whose output is one pixel wide, in the taps that see only
padding, with memory it never wrote: zeros when that memory is fresh, anything once it is reused (up to
1e33, and NaN). fp32, and the same convolution without oneDNN, are right; so are GPUs. Small crops bring a trunk's last stages there: a ResNet at a DINO local
crop of 16-32 px (its res5 sees 1-2 pixels). Measured on torch 2.14.1 (a kin of pytorch/pytorch#169688,
open: stride 3 bf16 convolutions wrong on CPU); a DDP DINO run in bf16 here trained NaN weights from its
second step. Each such convolution of the trunk is run at its shape, in bf16 and in float64, freed memory
poisoned with NaN first: where this torch computes it wrong, the run is refused.
"""
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from .model import build_trunk, feature_width

PROBES = 5  # runs of each convolution: reused memory is not always dirty (a one-pixel input came out wrong in 13-15 of 15 runs)


def one_pixel_strided_convolutions(trunk: nn.Module, inputs: List[torch.Tensor]) -> Dict[str, Tuple[nn.Conv2d, torch.Size]]:
    """The trunk's strided ``Conv2d`` layers whose output is one pixel wide or high at any of ``inputs``
    (one batch per crop size), each with the input shape it has there (the first such)."""
    found: Dict[str, Tuple[nn.Conv2d, torch.Size]] = {}

    def record(name):
        def hook(module, args, output):
            one_pixel = any(s > 1 and n == 1 for s, n in zip(module.stride, output.shape[-2:]))
            if one_pixel and name not in found:
                found[name] = (module, args[0].shape)
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in trunk.named_modules() if isinstance(m, nn.Conv2d) and max(m.stride) > 1]
    try:
        with torch.no_grad():
            for x in inputs:
                trunk(x)
    finally:
        for h in hooks:
            h.remove()
    return found


def computes_wrong_bf16_weight_gradient(conv: nn.Conv2d, input_shape: torch.Size) -> bool:
    """Whether torch's bf16 weight gradient of ``conv`` at ``input_shape`` differs from float64's by more than
    bf16's rounding (5%), in any of :data:`PROBES` runs on random weights and inputs (this process's CPU)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(conv.weight.shape, generator=g) * 0.05
    x = torch.randn(input_shape, generator=g)
    args = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
    exact = w.double().requires_grad_()
    y = nn.functional.conv2d(x.double(), exact, **args)
    y.backward(torch.ones_like(y))
    for _ in range(PROBES):
        torch.full((4 * w.numel() + x.numel(),), float("nan"))  # freed at once, NaN: what the convolution may find
        wb = w.bfloat16().requires_grad_()
        yb = nn.functional.conv2d(x.bfloat16(), wb, **args)
        yb.backward(torch.ones_like(yb))
        err = (wb.grad.double() - exact.grad).abs().max() / exact.grad.abs().max().clamp_min(1e-30)
        if not err <= 0.05:  # NaN too
            return True
    return False


def refuse_wrong_bf16_convolutions(cfg, device: torch.device, agree: Callable = lambda decision: decision) -> None:
    """Refuse a ``TRAIN.AUTOCAST bf16`` run on a CPU whose trunk, at the config's crops, has a convolution
    this torch computes wrong (every rank takes ``agree``'s answer: rank 0's, under torchrun)."""
    if cfg.TRAIN.AUTOCAST != "bf16" or device.type != "cpu":
        return
    batch = cfg.TRAIN.BATCH_SIZE_PER_RANK or 32  # a fitted batch: not known yet
    crops: Dict[int, int] = {}  # crop size -> crops of it per image
    for size, count in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS):
        crops[size] = crops.get(size, 0) + count
    trunk = build_trunk(cfg)
    feature_width(trunk, cfg)  # a crop size the trunk cannot run, said in the config's terms before it is probed
    trunk.eval()
    probes: Dict[str, Tuple[nn.Conv2d, torch.Size, int]] = {}  # each at its shape in the run's trunk call, at the first crop size that brings it there
    for size, count in sorted(crops.items()):
        for name, (conv, shape) in one_pixel_strided_convolutions(trunk, [torch.zeros(1, 3, size, size)]).items():
            probes.setdefault(name, (conv, torch.Size((batch * count, *shape[1:])), size))
    wrong = agree([f"{name} (at {size} px crops)" for name, (conv, shape, size) in probes.items() if computes_wrong_bf16_weight_gradient(conv, shape)])
    if wrong:
        raise ValueError(
            f"TRAIN.AUTOCAST bf16 on this CPU would train {', '.join(wrong)} on wrong gradients: there "
            f"{'its' if len(wrong) == 1 else 'their'} output is one pixel wide, where torch's bf16 convolution (oneDNN) fills the weight "
            "gradient with memory it never wrote (checked against float64 here; see trunksplit/ssl/cpu_bf16.py). "
            "Train in fp32 (TRAIN.AUTOCAST \"\"), with larger DATA.CROP_SIZES, or on a GPU")
