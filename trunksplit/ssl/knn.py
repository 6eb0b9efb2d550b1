"""k-nearest-neighbour evaluation: how good the trunk's features are, as SSL codebases measure it.

DINO's weighted kNN (``eval_knn.py``), which DINOv2, solo-learn and lightly report too: every
image of a labelled validation folder votes among its ``k`` nearest images of a labelled train
folder by cosine similarity, each neighbour weighing ``exp(similarity / temperature)``; top-1 and
top-5 accuracy (top-5 where there are more than 5 classes). Features are the trunk's last
requested feature, flattened and L2-normalised, computed in eval mode without gradients (nothing
is checkpointed, BatchNorm uses its running statistics) from images read as training reads them
(unreadable files skipped and named) and transformed for evaluation: the shorter side resized to
``crop / 0.875``, a centre crop of ``crop``, normalised. Each rank extracts its share of the
images and keeps its share of the train features: every rank gathers the validation features and
ranks them against its share, and the ``k`` best of every rank are gathered and merged, so a rank
holds 1/world of the train features (DINO's ``eval_knn.py`` gathers all of them on rank 0) and every
rank gets the figures one process holding all of them gets.

The training loop runs it every ``EVAL.KNN.EVERY_STEPS`` (and at the end) without touching the
run's random state: a run with the monitor trains the same weights as one without.
"""
import math
import os
import sys
import warnings
from typing import Callable, Dict, Iterable, Sequence, Tuple

import PIL.Image
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torchvision.transforms.v2 import functional as TF
from tqdm import tqdm

from .config import load_config
from .data import IMAGE_EXTENSIONS, num_workers, read_image
from .model import build_ssl_model
from .parallel import autocast_for
from .run_dir import CHECKPOINT, load_checkpoint, load_sharded_model
from .stopping import ignore_interrupts
from .weights_init import start_from_weights

EVAL_CROP_FRACTION = 0.875  # the centre crop's share of the resized image (ImageNet's 224 of 256)
BATCH = 64  # images per forward while extracting features


class LabelledImages(torch.utils.data.Dataset):
    """An ImageFolder (a folder per class) as evaluation images: ``(image, label, index)``, the label
    -1 for a file that cannot be read (dropped from the evaluation and named)."""

    def __init__(self, root: str, crop: int, mean: Sequence[float], std: Sequence[float], key: str):
        self.root, self.crop, self.mean, self.std = root, crop, list(mean), list(std)
        self.folder = labelled_folder(root, key)
        self.classes = self.folder.classes
        if not any(self[i][1] >= 0 for i in range(len(self))):  # stops at the first readable image
            raise ValueError(f"{key} {root!r}: none of its {len(self)} image files can be read as an image; give a folder of images")

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        path, label = self.folder.samples[i]
        try:
            image = read_image(path, round(self.crop / EVAL_CROP_FRACTION))
        except (OSError, SyntaxError, ValueError, RuntimeError, PIL.Image.DecompressionBombError):
            return torch.zeros(3, self.crop, self.crop), -1, i
        image = TF.center_crop(image, [self.crop, self.crop])
        return TF.normalize(image, self.mean, self.std), label, i


def labelled_folder(root: str, key: str) -> torchvision.datasets.DatasetFolder:
    """``root`` listed as an ImageFolder with at least two classes; a ``ValueError`` naming ``key``
    for a missing, empty or unlabelled (no class folders, or one) folder."""
    if not root or not os.path.isdir(root):
        raise ValueError(f"{key} {root!r} is not a directory: give an ImageFolder root (a folder per class, images in each)")
    try:
        folder = torchvision.datasets.DatasetFolder(root, loader=str, extensions=IMAGE_EXTENSIONS)  # only its list is read
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise ValueError(f"{key} {root!r} is no folder of labelled images (root/class_name/image.jpg, an image in every class folder): {e}") from None
    if len(folder.classes) < 2:
        raise ValueError(f"{key} {root!r} has {len(folder.classes)} class folder ({folder.classes}): "
                         "a kNN evaluation needs labels, a folder per class, at least two")
    return folder


class RankShare:
    """This rank's share of ``dataset`` (image ``rank``, ``rank + world``, ...: every rank runs the same
    number of forwards, the last share padded with the last image, as FSDP2's collectives need), read
    by ``workers`` loader processes that are kept between passes: a run evaluates every
    ``EVERY_STEPS``, and where workers start as fresh interpreters (spawn: macOS and Windows;
    forkserver: Linux from Python 3.14) each would import torch again at every evaluation, seconds
    each. Sharp edge: they stay, idle, until the share is dropped."""

    def __init__(self, dataset: torch.utils.data.Dataset, workers: int = 0, rank: int = 0, world: int = 1):
        self.size, self.world = len(dataset), world
        per_rank = math.ceil(self.size / world)
        self.indices = torch.arange(rank, per_rank * world, world)  # the dataset's image of each row; from ``size`` on, padding
        mine = self.indices.clamp(max=self.size - 1).tolist()
        self.loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, mine), batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0,
                                                  worker_init_fn=ignore_interrupts, generator=torch.Generator().manual_seed(0))  # no draw from the global generator


@torch.no_grad()
def extract_features(trunk: torch.nn.Module, share: RankShare, device: torch.device, autocast=None, progress: bool = False,
                     batches: Callable[[Iterable], Iterable] = iter) -> Tuple[torch.Tensor, torch.Tensor]:
    """(features, labels) of the share's images, a row for each of ``share.indices`` (its padding
    included): the trunk's last feature, flattened, L2-normalised, float32 on ``device``; the label -1
    where the image could not be read. ``trunk`` is run in eval mode and left in its mode. ``progress``: a bar on stderr
    (the offline command; the training loop has its own). ``batches`` turns the loader into the batches
    run (a training run's: until a stop signal, :func:`~trunksplit.ssl.stopping.until_stopped`)."""
    modes = [(m, m.training) for m in trunk.modules()]
    trunk.eval()
    parts, labels = [], []
    try:
        bar = tqdm(share.loader, desc="kNN features", file=sys.stderr, leave=False, disable=not progress or not sys.stderr.isatty())  # a log: no \r lines
        for images, batch_labels, _ in batches(bar):
            with autocast if autocast is not None else torch.autocast(device.type, enabled=False):
                feature = trunk(images.to(device))[-1]
            parts.append(F.normalize(feature.flatten(1).float(), dim=1))
            labels.append(batch_labels.to(device))
    finally:
        for m, training in modes:
            m.training = training
    return torch.cat(parts), torch.cat(labels)


def gathered(share: RankShare, local: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The dataset's rows from image ``start`` on, in its order, on every rank, from each rank's rows
    of ``local`` (a row per ``share.indices``): only the rows from ``start`` travel."""
    first = start // share.world  # rank r's row j is image r + j * world: rows from ``first`` on hold every image from ``start``
    if share.world == 1:
        return local[start : share.size]
    parts = [torch.empty_like(local[first:]) for _ in range(share.world)]
    dist.all_gather(parts, local[first:].contiguous())
    every = torch.stack(parts, dim=1).flatten(0, 1)  # images first * world, first * world + 1, ...
    return every[start - first * share.world : share.size - first * share.world]


def knn_accuracy(train_features: torch.Tensor, train_labels: torch.Tensor, val_features: torch.Tensor, val_labels: torch.Tensor,
                 num_classes: int, k: int = 20, temperature: float = 0.07, world: int = 1) -> Dict[str, float]:
    """DINO's weighted kNN: ``{"knn_top1": ..., "knn_top5": ...}`` (top-5 only with more than 5
    classes), fractions of the validation images. Features are L2-normalised rows. A class none of
    the ``k`` neighbours voted for counts as no guess (DINO's sort would rank such ties arbitrarily).
    With ``world`` > 1 (a process group of that size), ``train_*`` are this rank's share of the train
    images (any share, even none) and ``val_*`` every validation image on every rank: each rank ranks
    its share and the ``k`` best of all ranks are merged, the figures of one process holding them all
    (neighbours tied at the k-th place aside), the same on every rank."""
    total = len(train_features)
    if world > 1:
        count = torch.tensor(total, device=train_features.device)
        dist.all_reduce(count)
        total = int(count)
    k = min(k, total)
    correct1 = correct5 = 0
    for start in range(0, len(val_features), 256):  # a chunk of similarities at a time
        sims = val_features[start : start + 256] @ train_features.T
        top, index = sims.topk(min(k, sims.shape[1]), dim=1)
        top_labels = train_labels[index]
        if world > 1:
            top, top_labels = _best_of_ranks(top, top_labels, k, world)
        votes = torch.zeros(len(sims), num_classes, device=sims.device)
        votes.scatter_add_(1, top_labels, (top / temperature).exp())
        weight, ranked = votes.topk(min(5, num_classes), dim=1)
        hit = (ranked == val_labels[start : start + 256, None]) & (weight > 0)  # a class no neighbour voted for is no guess
        correct1 += hit[:, 0].sum().item()
        correct5 += hit.any(1).sum().item()
    out = {"knn_top1": correct1 / len(val_features)}
    if num_classes > 5:
        out["knn_top5"] = correct5 / len(val_features)
    return out


def _best_of_ranks(top: torch.Tensor, labels: torch.Tensor, k: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most similar of every rank's ``top`` (similarities, best first, at most ``k`` a row)
    and their labels: a rank short of ``k`` pads with -inf, which weighs nothing and which the merge
    never picks (``k`` is at most the train images of all ranks)."""
    short = k - top.shape[1]
    top = F.pad(top, (0, short), value=-math.inf)
    labels = F.pad(labels, (0, short))
    every_top, every_label = [torch.empty_like(top) for _ in range(world)], [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(every_top, top.contiguous())
    dist.all_gather(every_label, labels.contiguous())
    best, index = torch.cat(every_top, dim=1).topk(k, dim=1)
    return best, torch.cat(every_label, dim=1).gather(1, index)


def evaluated_trunk(model: torch.nn.Module) -> torch.nn.Module:
    """The trunk whose features the kNN evaluation reads: DINO's teacher's, the model DINO reports and
    its eval_knn.py reads by default (``--checkpoint_key teacher``); otherwise the trunk trained."""
    return (model.teacher if model.teacher is not None else model).trunk


class KnnMonitor:
    """The launcher's kNN evaluation of ``EVAL.KNN`` (train and validation folders, checked when it is
    made: before anything is written)."""

    def __init__(self, cfg):
        knn, aug = cfg.EVAL.KNN, cfg.DATA.AUG
        crop = cfg.DATA.CROP_SIZES[0]
        self.train = LabelledImages(knn.TRAIN_PATH, crop, aug.MEAN, aug.STD, "EVAL.KNN.TRAIN_PATH")
        self.val = LabelledImages(knn.VAL_PATH, crop, aug.MEAN, aug.STD, "EVAL.KNN.VAL_PATH")
        if self.train.classes != self.val.classes:
            raise ValueError(f"EVAL.KNN.TRAIN_PATH and VAL_PATH need the same class folders; got {self.train.classes} and {self.val.classes}")
        self.k, self.temperature, self.every = knn.K, knn.TEMPERATURE, knn.EVERY_STEPS
        self.share = None  # both folders' images, this rank's share, read by workers kept between evaluations
        _warn_if_trained_on(cfg.DATA.PATH, self.val)

    def due(self, steps_done: int, total: int) -> bool:
        """Evaluate after this many steps: every ``EVERY_STEPS``, and at the end."""
        return steps_done == total or (self.every > 0 and steps_done % self.every == 0)

    def evaluate(self, trunk, device, workers: int = 0, rank: int = 0, world: int = 1, autocast=None, progress: bool = False,
                 batches: Callable[[Iterable], Iterable] = iter) -> Dict[str, float]:
        """The kNN accuracies of ``trunk``'s features, the same on every rank; the global random state
        as it was (the training run's draws do not move). Both folders are read by one set of ``workers``,
        made at the first evaluation and kept for the next (:class:`RankShare`). ``batches``: as
        :func:`extract_features`'s."""
        if self.share is None:
            self.share = RankShare(torch.utils.data.ConcatDataset([self.train, self.val]), workers, rank, world)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            features, labels = extract_features(trunk, self.share, device, autocast, progress, batches)
        samples = self.train.folder.samples + self.val.folder.samples
        every_label = gathered(self.share, labels)  # labels only, 8 bytes an image: every rank names every unreadable image
        for i in (every_label < 0).nonzero().flatten().tolist():
            warnings.warn(f"kNN evaluation: skipping unreadable image {samples[i][0]}", UserWarning, stacklevel=2)
        split = len(self.train)
        mine = (self.share.indices.to(labels.device) < split) & (labels >= 0)  # this rank's share of the train features: they stay here
        val_features, val_labels = gathered(self.share, features, split), every_label[split:]
        keep = val_labels >= 0
        return knn_accuracy(features[mine], labels[mine], val_features[keep], val_labels[keep], len(self.train.classes), self.k, self.temperature, world)


def _warn_if_trained_on(data_path: str, val: LabelledImages) -> None:
    """Warn where ``DATA.PATH`` (what the run trains on: every image in its class folders) holds
    validation images: the kNN figure would then score images the trunk trained on."""
    if not data_path:
        return  # synthetic training images
    root = os.path.realpath(data_path)
    relative = [(p, os.path.relpath(os.path.realpath(p), root)) for p, _ in val.folder.samples]
    inside = [p for p, rel in relative if not rel.startswith(os.pardir) and os.sep in rel]  # ImageFolder lists root/class/.../image, not root/image
    if inside:
        warnings.warn(f"DATA.PATH {data_path!r} holds {len(inside)} of the {len(val)} images of EVAL.KNN.VAL_PATH (e.g. {inside[0]}): "
                      "the run trains on images its kNN evaluation classifies, which flatters the figure; point DATA.PATH at the "
                      "training split (for instance EVAL.KNN.TRAIN_PATH's folder)", UserWarning, stacklevel=3)


def knn_of_run(run_dir: str, train_path: str, val_path: str, untrained: bool = False, device: str = "cpu") -> Tuple[int, Dict[str, float]]:
    """(step, accuracies) of a finished run's trunk (its ``checkpoint.pt``), or with ``untrained`` of
    the model it started from (its config and seed, or its ``MODEL.WEIGHTS_INIT`` file): the numbers the online monitor logs at that
    step. A sharded (FSDP2) checkpoint's shards are read into one whole model."""
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise ValueError(f"{run_dir!r} holds no config.yaml: give the OUTPUT_DIR of a run of tools/train.py")
    cfg = load_config(config, ["EVAL.KNN.TRAIN_PATH", train_path, "EVAL.KNN.VAL_PATH", val_path])
    monitor = KnnMonitor(cfg)
    torch.manual_seed(cfg.SEED)
    model = build_ssl_model(cfg)
    step = 0
    if untrained and cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE:  # the run started from that file's weights
        start_from_weights(model, cfg)
    if not untrained:
        state = load_checkpoint(os.path.join(run_dir, CHECKPOINT), "trunksplit knn")
        if "sharded" in state:  # an FSDP2 run's: its shards read into one whole model
            load_sharded_model(os.path.join(run_dir, state["sharded"]), model)
        else:
            model.load_state_dict(state["model"])
        step = state["step"]
    device = torch.device(device)
    # as the monitor ran, images read by as many workers as the run's loader had
    return step, monitor.evaluate(evaluated_trunk(model.to(device)), device, num_workers(cfg), autocast=autocast_for(cfg, device), progress=True)
