"""Images and their views: deterministic synthetic images by default, ImageFolder when a path is given.

Every batch is a pure function of (seed, step, rank): which images, which crops,
which flips. That is what makes a resumed run equal an uninterrupted one, and
what shards the data across ranks without a sampler's state.
"""
import functools
import math
import os
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
import PIL.Image
import torchvision
from torchvision.transforms.v2 import functional as TF

from .augment import Distortion, augment, crop_distortions
from .stopping import ignore_interrupts


SYNTHETIC_KINDS = ("fields", "stripes")


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` images of ``size`` x ``size``, the same for the same index, every run. ``kind``:
    ``"fields"``, smooth random colour fields; ``"stripes"``, black-and-white gratings (two sinusoids
    of random orientation, spacing and phase, summed and thresholded), whose orientation and
    spacing survive crops and flips, so that a short contrastive run learns to match two views of
    one (configs/quickstart.yaml)."""

    def __init__(self, n: int, size: int, seed: int = 0, kind: str = "fields"):
        if kind not in SYNTHETIC_KINDS:
            raise ValueError(f"synthetic images are one of {SYNTHETIC_KINDS}, got {kind!r}")
        self.n, self.size, self.seed, self.kind = n, size, seed, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        if self.kind == "stripes":
            return _stripes(self.size, g)
        coarse = torch.rand(1, 3, 6, 6, generator=g)
        return F.interpolate(coarse, size=(self.size, self.size), mode="bicubic", align_corners=False)[0].clamp(0, 1)


def _stripes(size: int, g: torch.Generator) -> torch.Tensor:
    """Two gratings (orientation, 2 to 12 cycles across, phase drawn from ``g``), summed, thresholded at 0: black and white."""
    y, x = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    total = torch.zeros(size, size)
    for _ in range(2):
        angle, cycles, phase = (torch.rand(3, generator=g) * torch.tensor([math.pi, 10.0, 2 * math.pi])).tolist()
        total += torch.sin((2 + cycles) * math.pi * (x * math.cos(angle) + y * math.sin(angle)) + phase)
    return (total > 0).float().expand(3, size, size).clone()


# ImageFolder's extensions and GIF, which decode_image reads (ImageFolder would not list it)
IMAGE_EXTENSIONS = tuple(torchvision.datasets.folder.IMG_EXTENSIONS) + (".gif",)


def image_dataset(cfg) -> torch.utils.data.Dataset:
    if not cfg.DATA.PATH:
        return SyntheticImages(cfg.DATA.NUM_IMAGES, cfg.DATA.IMAGE_SIZE, cfg.SEED, cfg.DATA.SYNTHETIC)
    if not os.path.isdir(cfg.DATA.PATH):
        raise ValueError(f"DATA.PATH {cfg.DATA.PATH!r} is not a directory; give an ImageFolder root (class folders of images) or leave it empty for synthetic data")
    try:  # the labels are unused: a class folder without images is no fault
        folder = torchvision.datasets.DatasetFolder(cfg.DATA.PATH, loader=functools.partial(read_image, size=cfg.DATA.IMAGE_SIZE),
                                                    extensions=IMAGE_EXTENSIONS, allow_empty=True)
    except FileNotFoundError:  # no class folders: images right under the root are not listed
        folder = None
    if folder is None or len(folder) == 0:
        raise ValueError(f"DATA.PATH {cfg.DATA.PATH!r} holds no images in ImageFolder layout: put them in folders under it, "
                         "root/any_name/image.jpg (one folder will do: the labels are unused)")
    return _ImagesOnly(folder)


def read_image(path: str, size: int) -> torch.Tensor:
    """``path`` as a ``[3, size, size]`` float tensor in [0, 1]: decoded, shorter side resized to
    ``size``, centre-cropped. JPEG, PNG, GIF and WebP are decoded by ``torchvision.io.decode_image``
    (libjpeg-turbo and libpng, in the loader's worker, no PIL image in between); other formats
    ImageFolder lists (BMP, TIFF, ...) go through PIL, as does every file where torchvision has no
    decoder. A file neither can read raises."""
    image = _torchvision_decoded(path)
    if image is None:
        image = TF.pil_to_tensor(torchvision.datasets.folder.pil_loader(path))
    if image.ndim == 4:  # an animated GIF (even one named .jpg): its first frame, as PIL opens it
        image = image[0]
    image = TF.center_crop(TF.resize(image, size, antialias=True), [size, size])
    return TF.to_dtype(image, torch.float32, scale=True)


def _torchvision_decoded(path: str) -> Optional[torch.Tensor]:
    """``path`` decoded by torchvision as an RGB uint8 tensor, or None where torchvision cannot: a
    format it does not know or a corrupt file (PIL then decides which), or a torchvision without the
    decoder. torchvision 0.29 deprecated its image decoders (TorchCodec supersedes them): the release
    that removes them leaves every file to PIL, not every read failing."""
    if not hasattr(torchvision.io, "decode_image") or not hasattr(torchvision.io, "ImageReadMode"):
        return None
    try:
        return torchvision.io.decode_image(path, mode=torchvision.io.ImageReadMode.RGB)
    except RuntimeError:
        return None


class _ImagesOnly(torch.utils.data.Dataset):
    """The folder's images without labels. A file that cannot be read is skipped: the next readable
    image stands in for it, the same one every run, so batches stay a function of (seed, step,
    rank); :class:`StepViews` reports it by name, and the training loop warns once and counts it."""

    def __init__(self, folder):
        self.folder = folder
        self.unreadable = set()  # indices found unreadable

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        for j in [(i + k) % len(self.folder) for k in range(len(self.folder))]:
            if j in self.unreadable:
                continue
            try:
                return self.folder[j][0]
            except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError):  # PIL: UnidentifiedImageError (an OSError), truncated files, bombs
                self.unreadable.add(j)
        raise ValueError(f"DATA.PATH {self.folder.root!r}: none of its {len(self.folder)} images can be read")

    def name(self, i: int) -> str:
        return self.folder.samples[i][0]


def check_images_a_step(cfg, world: int, data_set: int) -> None:
    """A step's images are distinct images of the data set (``data_set`` of them). SimCLR tells each
    view's partner from the views of the step's other images (every rank's): a step of one image has
    none, so its loss is 0 and its gradient too."""
    images = cfg.TRAIN.BATCH_SIZE_PER_RANK * world
    if images > data_set:
        source = f"{data_set} images in DATA.PATH" if cfg.DATA.PATH else f"DATA.NUM_IMAGES {data_set}"
        raise ValueError(f"TRAIN.BATCH_SIZE_PER_RANK {cfg.TRAIN.BATCH_SIZE_PER_RANK} x {world} rank{'s' if world > 1 else ''} is {images} images a step, "
                         f"more than the data set holds ({source}): a step would hold an image more than once (SimCLR would take its copies "
                         f"for different images). Set TRAIN.BATCH_SIZE_PER_RANK {data_set // world} or less, or give more images")
    if cfg.METHOD.NAME == "simclr" and images < 2:
        raise ValueError(f"SimCLR needs at least 2 images a step, all ranks together (each view is told from the other images' views), got "
                         f"{images} (TRAIN.BATCH_SIZE_PER_RANK {cfg.TRAIN.BATCH_SIZE_PER_RANK} x {world} rank): its loss would be 0 and nothing learned")


def batch_indices(n: int, batch: int, step: int, rank: int, world: int, seed: int) -> List[int]:
    """This rank's images for ``step``: epoch-wise shuffles of the data set, split across ranks. An
    epoch is the steps its shuffle fills; its last images short of a step are left out (a
    ``DataLoader``'s ``drop_last``), so that no step holds an image twice (SimCLR would take the
    copies for two images). A step of more images than the data set is refused."""
    per_step = batch * world
    if per_step > n:
        raise ValueError(f"a step of {per_step} images ({batch} per rank x {world}) from a data set of {n} would hold images more than once")
    epoch, k = divmod(step, n // per_step)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    start = k * per_step + rank * batch
    return order[start:start + batch].tolist()


def views(images: torch.Tensor, sizes, counts, scales, distortions: Sequence[Distortion], g: torch.Generator) -> List[torch.Tensor]:
    """Multi-crop: for each resolution, ``count`` augmented views of every image (see
    :func:`trunksplit.ssl.augment.augment`), crop ``k`` distorted as ``distortions[k]`` says,
    every random choice drawn from ``g``.

    Returns one tensor per crop, ``[B, 3, size, size]``, grouped by resolution."""
    crops = [(size, scale) for size, count, scale in zip(sizes, counts, scales) for _ in range(count)]
    return [torch.stack([augment(img, size, scale, d, g) for img in images]) for (size, scale), d in zip(crops, distortions)]


def step_views(dataset, cfg, step: int, rank: int, world: int) -> List[torch.Tensor]:
    """The views this rank trains on at ``step``."""
    return StepViews(dataset, cfg, rank, world)[step][0]


class StepViews(torch.utils.data.Dataset):
    """Each step's views for one rank, indexed by step: ``(views, unreadable files skipped)``.

    A ``DataLoader`` over it (see :func:`step_loader`) builds whole steps in its workers. Every
    step is a function of (seed, step, rank) alone, so 0, 1 or 4 workers give the same batches,
    and a resumed run starts its sampler at the checkpoint's step. The skipped files are those of
    the step's images that could not be read (the next readable image stood in for each)."""

    def __init__(self, dataset, cfg, rank: int, world: int):
        self.dataset, self.cfg, self.rank, self.world = dataset, cfg, rank, world

    def __len__(self) -> int:
        return self.cfg.TRAIN.STEPS

    def __getitem__(self, step: int):
        cfg = self.cfg
        idx = batch_indices(len(self.dataset), cfg.TRAIN.BATCH_SIZE_PER_RANK, step, self.rank, self.world, cfg.SEED)
        images = torch.stack([self.dataset[i] for i in idx])
        skipped = [self.dataset.name(i) for i in idx if i in getattr(self.dataset, "unreadable", ())]
        g = torch.Generator().manual_seed(cfg.SEED * 1_000_003 + step * 1009 + self.rank)
        return views(images, cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS, cfg.DATA.CROP_SCALES, crop_distortions(cfg), g), skipped


def step_loader(dataset, cfg, rank: int, world: int, start: int, pin_memory: bool) -> torch.utils.data.DataLoader:
    """Steps ``start`` .. ``TRAIN.STEPS - 1`` of this rank, built by ``DATA.NUM_WORKERS`` worker
    processes (see :func:`num_workers`) ahead of the step that needs them."""
    workers = num_workers(cfg)
    return torch.utils.data.DataLoader(
        StepViews(dataset, cfg, rank, world), batch_size=None, sampler=range(start, cfg.TRAIN.STEPS), num_workers=workers,
        pin_memory=pin_memory, persistent_workers=workers > 0, prefetch_factor=2 if workers else None, worker_init_fn=ignore_interrupts,
        # its own generator: the loader draws its workers' base seed when its iterator starts, and from
        # torch's global generator that draw would shift the model's dropout and stochastic depth
        # after a resume (the views themselves never use it)
        generator=torch.Generator().manual_seed(cfg.SEED),
    )


def num_workers(cfg) -> int:
    """``DATA.NUM_WORKERS``, or for -1 (the default) the cores this process can have beyond its own,
    shared with the other processes torchrun starts on the machine, at most 4. The cores it can have:
    those it may run on (a job given 2 cores of a 64-core node, by SLURM or ``taskset``, has 2)."""
    if cfg.DATA.NUM_WORKERS >= 0:
        return cfg.DATA.NUM_WORKERS
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, usable_cores() // local - 1))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (Linux), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
