"""The published augmentations: each random choice at its configured rate, crops within their scale, views normalised."""
import math
import os

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from trunksplit.ssl.augment import IMAGENET_MEAN, IMAGENET_STD, augment, crop_box, crop_distortions
from trunksplit.ssl.config import load_config

QUICK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "quickstart.yaml")
DRAWS = 2000


def _within_binomial(hits: int, n: int, p: float) -> bool:
    return abs(hits / n - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9  # 4 standard errors


def test_crop_areas_stay_within_the_scale_and_aspect_ratios_within_three_to_four():
    g = torch.Generator().manual_seed(0)
    for scale in ([0.08, 1.0], [0.14, 1.0], [0.05, 0.14]):
        shares, ratios = [], []
        for _ in range(DRAWS):
            top, left, h, w = crop_box(96, 128, scale, g)
            assert 0 <= top <= 96 - h and 0 <= left <= 128 - w
            shares.append(h * w / (96 * 128))
            ratios.append(w / h)
        # rounding a side to whole pixels moves the area by at most a pixel's row and column
        assert min(shares) >= scale[0] * 0.95 and max(shares) <= min(1.0, scale[1] * 1.05)
        assert min(ratios) >= 3 / 4 * 0.9 and max(ratios) <= 4 / 3 * 1.1


def test_grayscale_and_blur_happen_at_their_configured_rates(monkeypatch):
    cfg = load_config(QUICK, [])
    d = crop_distortions(cfg)[0]
    assert (d.jitter, d.jitter_p, d.grayscale_p, d.blur_p, d.solarize_p) == ((0.8, 0.8, 0.8, 0.2), 0.8, 0.2, 0.5, 0.0)  # SimCLR's published values
    g = torch.Generator().manual_seed(1)
    colourful = torch.stack([torch.linspace(0, 1, 32).expand(32, 32), torch.rand(32, 32, generator=g), torch.linspace(1, 0, 32).expand(32, 32)])
    blurs = []
    real_blur = TF.gaussian_blur
    monkeypatch.setattr(TF, "gaussian_blur", lambda *a, **k: blurs.append(1) or real_blur(*a, **k))
    gray = 0
    for _ in range(400):
        view = augment(colourful, 16, [0.5, 1.0], d, g)
        pixels = view * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        gray += bool(torch.allclose(pixels[0], pixels[1], atol=1e-5) and torch.allclose(pixels[1], pixels[2], atol=1e-5))
    assert _within_binomial(gray, 400, 0.2), gray
    assert _within_binomial(len(blurs), 400, 0.5), len(blurs)


def test_views_are_normalised_tensors_of_the_configured_size_and_reproducible():
    cfg = load_config(QUICK, ["DATA.AUG.GRAYSCALE_PROB", "0.0", "DATA.AUG.BLUR_PROB", "1.0"])
    d = crop_distortions(cfg)[0]
    img = torch.rand(3, 40, 50, generator=torch.Generator().manual_seed(2))
    a = augment(img, 24, [0.3, 1.0], d, torch.Generator().manual_seed(9))
    b = augment(img, 24, [0.3, 1.0], d, torch.Generator().manual_seed(9))
    assert a.shape == (3, 24, 24) and a.dtype == torch.float32 and torch.equal(a, b)
    low = (0 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    high = (1 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert all(a[c].min() >= low[c] - 1e-5 and a[c].max() <= high[c] + 1e-5 for c in range(3))


@pytest.mark.parametrize("key,value", [("DATA.AUG.COLOR_JITTER", "[0.8, 0.8, 0.8]"), ("DATA.AUG.BLUR_PROB", "1.5"), ("DATA.AUG.SOLARIZE_PROB", "[0.0, -0.2]"), ("DATA.AUG.STD", "[0.2, 0.0, 0.2]")])
def test_bad_augmentation_values_are_refused(key, value):
    with pytest.raises(ValueError, match=key.split(".")[-1]):
        load_config(QUICK, [key, value])
