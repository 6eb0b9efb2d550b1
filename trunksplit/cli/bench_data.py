"""``trunksplit bench-data``: images per second of each recipe's input pipeline, by worker count.

    trunksplit bench-data [--recipes simclr swav dino] [--workers 0 1 2 4] [--steps 4] [--batch 16] [--folder DIR]

For each recipe (``configs/recipes/<name>.yaml`` of a clone, or a YAML file's path: its crops and
augmentations, at their published sizes) it runs the launcher's own loader (:func:`trunksplit.ssl.data.step_loader`)
over the embedded synthetic images and over a folder of JPEG files (``--folder``, an
ImageFolder root; without it, ``--jpegs`` synthetic images are written as JPEGs to a
temporary folder first, so decoding is measured too). The figure is images per second over
``--steps`` steps, one image being all of its crops, after an untimed step per worker (at least
one): the workers start together, so the first of them delivers while the others' first steps
are nearly done, and timing those would credit the loader with work done before the clock
started. Loader workers run torch single-threaded (``DataLoader`` sets one thread per worker),
while zero workers build views in the main process with all its threads.
"""
import os
import tempfile
import time
from typing import List, Sequence

import PIL.Image
import torch
from tabulate import tabulate

from ..ssl.config import load_config
from ..ssl.data import SyntheticImages, image_dataset, step_loader

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "recipes")


def recipe_path(recipe: str) -> str:
    """The YAML file of ``recipe``: a path as given, a name in the clone's ``configs/recipes``.

    Sharp edge: the recipes live in the repository, not in the package, so an install from a
    wheel has no names to look up; the refusal says to give a file's path."""
    if recipe.endswith((".yaml", ".yml")) or os.sep in recipe:
        if not os.path.isfile(recipe):
            raise ValueError(f"recipe file {recipe} does not exist")
        return recipe
    if not os.path.isdir(RECIPES):
        raise ValueError(f"no recipe {recipe!r}: recipe names are the files of configs/recipes/ in a clone of trunksplit, and this install "
                         f"has none ({RECIPES}); give a recipe's YAML path instead (--recipes path/to/simclr.yaml)")
    path = os.path.join(RECIPES, f"{recipe}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"no recipe {recipe!r}: {path} does not exist (the recipes are {', '.join(sorted(f[:-5] for f in os.listdir(RECIPES) if f.endswith('.yaml')))}, or give a YAML file's path)")
    return path


def images_per_second(path: str, workers: int, steps: int, batch: int, folder: str = "") -> float:
    """The pipeline of the recipe at ``path`` (:func:`recipe_path`) at ``workers`` loader processes: images (all
    their crops) per second."""
    warmup = max(1, workers)
    # synthetic images cost nothing to have: as many as a step takes (a step holds each image once)
    cfg = load_config(path, ["DATA.PATH", folder, "DATA.NUM_WORKERS", str(workers), "TRAIN.BATCH_SIZE_PER_RANK", str(batch), "TRAIN.STEPS", str(steps + warmup),
                             "DATA.NUM_IMAGES", str(max(batch, load_config(path).DATA.NUM_IMAGES))])
    dataset = image_dataset(cfg)
    if batch > len(dataset):
        raise ValueError(f"--batch {batch} is more images than --folder {folder} holds ({len(dataset)}; a step holds each image once): give a smaller --batch")
    batches = iter(step_loader(dataset, cfg, rank=0, world=1, start=0, pin_memory=False))
    for _ in range(warmup):  # not timed: the workers start and deliver their first steps
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return steps * batch / (time.perf_counter() - start)


def write_jpegs(root: str, count: int, size: int) -> str:
    """``count`` synthetic images as JPEG files (quality 90) in an ImageFolder layout under ``root``."""
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    images = SyntheticImages(count, size)
    for i in range(count):
        # PIL, not torchvision.io.write_jpeg: torchvision 0.29 deprecated its encoders
        pixels = (images[i] * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
        PIL.Image.fromarray(pixels).save(os.path.join(root, "images", f"{i:05d}.jpg"), quality=90)
    return root


def run_data_benchmark(recipes: Sequence[str], workers: Sequence[int], steps: int, batch: int, folder: str, jpegs: int) -> List[list]:
    """Rows of (source, recipe, images/s at each worker count); printed as a table."""
    paths = [recipe_path(r) for r in recipes]  # every name checked before any image is written
    if not folder and batch > jpegs:
        raise ValueError(f"--batch {batch} is more images than --jpegs {jpegs} writes (a step holds each image once): give --jpegs {batch} or more")
    with tempfile.TemporaryDirectory() as scratch:
        sources = [("synthetic", ""), ("jpeg folder", folder or write_jpegs(scratch, jpegs, 256))]
        rows = [[source, recipe, *(images_per_second(recipe_file, w, steps, batch, images) for w in workers)]
                for source, images in sources for recipe, recipe_file in zip(recipes, paths)]
    print(tabulate(rows, headers=["images from", "recipe", *(f"images/s, {w} workers" for w in workers)], floatfmt=".1f", tablefmt="github"))
    return rows
