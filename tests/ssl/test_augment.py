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
    for scale in ([0.08, 1.0], [0.14, 1.0], [0.05, 0.14], [0.4, 1.0], [0.05, 0.4]):
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
    cfg = load_config("", [])  # the defaults
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


@pytest.mark.parametrize("flip", [0.0, 0.5, 1.0])
def test_views_flip_at_their_configured_rate(flip):
    """A left-to-right ramp, cropped whole, nothing else distorting it: each view is the ramp or its mirror image."""
    cfg = load_config(QUICK, ["DATA.AUG.FLIP_PROB", str(flip), "DATA.AUG.COLOR_JITTER_PROB", "0", "DATA.AUG.GRAYSCALE_PROB", "0", "DATA.AUG.BLUR_PROB", "0"])
    d = crop_distortions(cfg)[0]
    ramp = torch.linspace(0, 1, 16).expand(3, 16, 16).contiguous()
    g, flipped = torch.Generator().manual_seed(3), 0
    for _ in range(400):
        view = augment(ramp, 16, [1.0, 1.0], d, g)
        flipped += bool(view[0, 0, 0] > view[0, 0, -1])
    assert _within_binomial(flipped, 400, flip), flipped


@pytest.mark.parametrize("key,value", [("DATA.AUG.COLOR_JITTER", "[0.8, 0.8, 0.8]"), ("DATA.AUG.BLUR_PROB", "1.5"), ("DATA.AUG.FLIP_PROB", "1.5"), ("DATA.AUG.SOLARIZE_PROB", "[0.0, -0.2]"), ("DATA.AUG.STD", "[0.2, 0.0, 0.2]"),
                                       ("DATA.SYNTHETIC", "noise")])
def test_bad_augmentation_values_are_refused(key, value):
    with pytest.raises(ValueError, match=key.split(".")[-1]):
        load_config(QUICK, [key, value])


def _recipe(name):
    return load_config(os.path.join(os.path.dirname(QUICK), "recipes", f"{name}.yaml"), [])


def test_recipe_configs_hold_the_published_parameters():
    simclr, swav, dino = _recipe("simclr"), _recipe("swav"), _recipe("dino")
    assert (simclr.DATA.CROP_SIZES, simclr.DATA.CROP_COUNTS, simclr.DATA.CROP_SCALES) == ([224], [2], [[0.08, 1.0]])
    assert (swav.DATA.CROP_SIZES, swav.DATA.CROP_COUNTS, swav.DATA.CROP_SCALES) == ([224, 96], [2, 6], [[0.14, 1.0], [0.05, 0.14]])
    assert (dino.DATA.CROP_SIZES, dino.DATA.CROP_SCALES) == ([224, 96], [[0.4, 1.0], [0.05, 0.4]]) and dino.DATA.CROP_COUNTS[0] == 2
    for cfg in (simclr, swav):
        assert (cfg.DATA.AUG.COLOR_JITTER, cfg.DATA.AUG.COLOR_JITTER_PROB, cfg.DATA.AUG.GRAYSCALE_PROB) == ([0.8, 0.8, 0.8, 0.2], 0.8, 0.2)
        assert cfg.OPTIM.NAME == "lars" and cfg.OPTIM.EXCLUDE_BIAS_AND_NORM
    assert (dino.DATA.AUG.COLOR_JITTER, dino.DATA.AUG.BLUR_PROB, dino.DATA.AUG.SOLARIZE_PROB) == ([0.4, 0.4, 0.2, 0.1], [1.0, 0.1, 0.5], [0.0, 0.2, 0.0])
    assert (dino.OPTIM.NAME, dino.OPTIM.WEIGHT_DECAY, dino.OPTIM.WEIGHT_DECAY_END) == ("adamw", 0.04, 0.4)


def test_dino_crops_blur_and_solarise_at_their_own_rates(monkeypatch):
    cfg = load_config(os.path.join(os.path.dirname(QUICK), "recipes", "dino.yaml"), ["DATA.CROP_SIZES", "[16, 8]", "DATA.CROP_COUNTS", "[2, 3]"])
    ds = crop_distortions(cfg)
    assert [(d.blur_p, d.solarize_p) for d in ds] == [(1.0, 0.0), (0.1, 0.2), (0.5, 0.0), (0.5, 0.0), (0.5, 0.0)]
    calls = []
    for op in ("gaussian_blur", "solarize"):
        real = getattr(TF, op)
        monkeypatch.setattr(TF, op, lambda *a, _op=op, _real=real, **k: calls.append(_op) or _real(*a, **k))
    g = torch.Generator().manual_seed(3)
    img = torch.rand(3, 24, 24, generator=g)
    n = 400
    for k in (0, 1, 2):
        calls.clear()
        views = [augment(img, 16, [0.4, 1.0], ds[k], g) for _ in range(n)]
        blurs, solarised = calls.count("gaussian_blur"), calls.count("solarize")
        assert _within_binomial(blurs, n, ds[k].blur_p) and _within_binomial(solarised, n, ds[k].solarize_p), (k, blurs, solarised)
        assert all(v.shape == (3, 16, 16) for v in views)
