"""The published SSL augmentations, drawn from a generator so that every view is reproducible.

SimCLR's recipe (Chen et al. 2020), which SwAV's multi-crop reuses for its colour distortions:
a random resized crop (scale from ``DATA.CROP_SCALES``, aspect ratio 3/4 to 4/3), a horizontal
flip (p 0.5), colour jitter of brightness, contrast and saturation 0.8 and hue 0.2 in a random
order (p 0.8), grayscale (p 0.2), Gaussian blur with sigma in [0.1, 2.0] and a kernel a tenth of
the crop (p 0.5), then normalisation with ImageNet's mean and std. DINO's recipe (Caron et al.
2021) adds solarisation (pixels above 0.5 inverted) and gives each crop its own blur and
solarisation rates: blur p 1.0 on the first global crop, p 0.1 and solarisation p 0.2 on the
second, blur p 0.5 on the local crops. Each probability and strength is a ``DATA.AUG`` key; the
blur and solarisation rates are lists with one entry per crop, the last holding for the rest.

The ops are torchvision's (``transforms.v2.functional``, on tensors), but every random choice
comes from the generator passed in, not torch's global one: a view is a function of (seed,
step, rank, position), whichever loader worker builds it.
"""
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torchvision.transforms.v2 import functional as TF

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Distortion:
    """One crop's flip, colour, blur and solarisation, as ``DATA.AUG`` sets them."""

    jitter: Tuple[float, float, float, float]  # brightness, contrast, saturation, hue
    jitter_p: float
    grayscale_p: float
    blur_p: float
    solarize_p: float
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]
    flip_p: float = 0.5


def crop_distortions(cfg) -> List[Distortion]:
    """One :class:`Distortion` per crop of a step, in crop order (``sum(DATA.CROP_COUNTS)``)."""
    aug = cfg.DATA.AUG
    return [
        Distortion(tuple(aug.COLOR_JITTER), aug.COLOR_JITTER_PROB, aug.GRAYSCALE_PROB, _entry(aug.BLUR_PROB, k), _entry(aug.SOLARIZE_PROB, k), tuple(aug.MEAN),
                   tuple(aug.STD), aug.FLIP_PROB)
        for k in range(sum(cfg.DATA.CROP_COUNTS))
    ]


def _entry(per_crop: Sequence[float], k: int) -> float:
    """Crop ``k``'s value of a per-crop list whose last entry holds for the crops after it."""
    return float(per_crop[min(k, len(per_crop) - 1)])


def crop_box(h: int, w: int, scale: Sequence[float], g: torch.Generator, ratio=(3 / 4, 4 / 3)) -> Tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop covering ``scale`` of the image's area, at an
    aspect ratio drawn log-uniformly from ``ratio``: torchvision's RandomResizedCrop, from ``g``,
    with its fallback to the largest centred crop after ten misses."""
    area = h * w
    for _ in range(10):
        target = area * _uniform(g, *scale)
        aspect = math.exp(_uniform(g, math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, (), generator=g))
            left = int(torch.randint(0, w - cw + 1, (), generator=g))
            return top, left, ch, cw
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, side, side


def augment(img: torch.Tensor, size: int, scale: Sequence[float], d: Distortion, g: torch.Generator) -> torch.Tensor:
    """One view of ``img`` (``[3, H, W]`` in [0, 1]): cropped to ``size``, flipped, distorted, normalised."""
    top, left, ch, cw = crop_box(img.shape[-2], img.shape[-1], scale, g)
    view = TF.resized_crop(img, top, left, ch, cw, [size, size], antialias=True)
    if _happens(g, d.flip_p):
        view = TF.horizontal_flip(view)
    if _happens(g, d.jitter_p):
        view = _jitter(view, d.jitter, g)
    if _happens(g, d.grayscale_p):
        view = TF.rgb_to_grayscale(view, num_output_channels=3)
    if _happens(g, d.blur_p):
        kernel = max(3, int(0.1 * size) // 2 * 2 + 1)  # a tenth of the crop, odd
        sigma = _uniform(g, 0.1, 2.0)
        view = TF.gaussian_blur(view, [kernel, kernel], [sigma, sigma])
    if _happens(g, d.solarize_p):
        view = TF.solarize(view.clamp(0, 1), 0.5)
    return TF.normalize(view.clamp(0, 1), list(d.mean), list(d.std))


def _jitter(view: torch.Tensor, strength: Sequence[float], g: torch.Generator) -> torch.Tensor:
    """ColorJitter: brightness, contrast, saturation factors in [1 - s, 1 + s] and a hue shift in
    [-h, h], applied in a random order."""
    b, c, s, h = strength
    ops = [
        lambda v: TF.adjust_brightness(v, _uniform(g, max(0.0, 1 - b), 1 + b)),
        lambda v: TF.adjust_contrast(v, _uniform(g, max(0.0, 1 - c), 1 + c)),
        lambda v: TF.adjust_saturation(v, _uniform(g, max(0.0, 1 - s), 1 + s)),
        lambda v: TF.adjust_hue(v, _uniform(g, -h, h)),
    ]
    for i in torch.randperm(4, generator=g).tolist():
        view = ops[i](view)
    return view


def _uniform(g: torch.Generator, lo: float, hi: float) -> float:
    return float(torch.empty(()).uniform_(lo, hi, generator=g)) if hi > lo else float(lo)


def _happens(g: torch.Generator, p: float) -> bool:
    return float(torch.rand((), generator=g)) < p
