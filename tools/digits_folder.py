#!/usr/bin/env python
"""Write scikit-learn's handwritten digits as ImageFolders: real images no one here made, for kNN.

    python tools/digits_folder.py output/digits [--size 32] [--val-fraction 0.2] [--train-per-class 0]

scikit-learn ships the UCI handwritten digits (1,797 scans of 8 x 8 pixels, 16 grey levels, ten
classes) inside its package: nothing is downloaded. Each image is scaled to ``--size`` pixels
(bilinear) and written as a PNG under ``OUT/train/<digit>/`` or ``OUT/val/<digit>/``; the split
is a fixed shuffle per class (the same every run), ``--val-fraction`` of each class for
validation, and at most ``--train-per-class`` per class for training (0: all the rest). Point
``DATA.PATH`` (train on the images, labels unused) and ``EVAL.KNN.TRAIN_PATH``/``VAL_PATH`` at it.
Needs scikit-learn (an optional extra: ``pip install scikit-learn``).
"""
import argparse
import os
import sys

import numpy as np
from PIL import Image


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the folder to write train/ and val/ into (created; must not hold them yet)")
    p.add_argument("--size", type=int, default=32, help="height and width of the written images")
    p.add_argument("--val-fraction", type=float, default=0.2, help="the share of each class kept for validation")
    p.add_argument("--train-per-class", type=int, default=0, help="at most this many training images per class (0: all)")
    return p


def write_digits(out: str, size: int = 32, val_fraction: float = 0.2, train_per_class: int = 0) -> dict:
    """Write the folders; returns the image count of each split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("tools/digits_folder.py needs scikit-learn, which ships the digits: pip install scikit-learn") from None
    if not 0 < val_fraction < 1 or size < 8:
        raise SystemExit(f"--val-fraction must be in (0, 1) and --size >= 8; got {val_fraction} and {size}")
    for split in ("train", "val"):
        if os.path.exists(os.path.join(out, split)):
            raise SystemExit(f"{os.path.join(out, split)} exists already: choose another folder, or delete it")
    digits = load_digits()
    counts = {"train": 0, "val": 0}
    rng = np.random.default_rng(0)
    for label in range(10):
        index = np.flatnonzero(digits.target == label)
        rng.shuffle(index)
        n_val = round(len(index) * val_fraction)
        splits = {"val": index[:n_val], "train": index[n_val:][: train_per_class or None]}
        for split, chosen in splits.items():
            folder = os.path.join(out, split, str(label))
            os.makedirs(folder)
            for i in chosen:
                pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
                Image.fromarray(pixels, mode="L").resize((size, size), Image.BILINEAR).save(os.path.join(folder, f"{i:04d}.png"))
                counts[split] += 1
    return counts


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    counts = write_digits(args.out, args.size, args.val_fraction, args.train_per_class)
    print(f"wrote {counts['train']} training and {counts['val']} validation images of 10 digits ({args.size} x {args.size}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
