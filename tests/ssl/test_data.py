"""The launcher's loader: real image files decoded in worker processes, every batch a function of (seed, step, rank)."""
import json
import os

import numpy
import pytest
import torch

from trunksplit.ssl.config import load_config
from trunksplit.ssl.data import SyntheticImages, batch_indices, image_dataset, read_image, step_loader
from trunksplit.ssl.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4", "MODEL.HEAD.HIDDEN_DIM", "64"]


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """An ImageFolder of real JPEG files, written here, and one file that is not an image."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for cls in ("cats", "dogs"):
        (root / cls).mkdir()
        for i in range(5):
            pixels = (torch.rand(48, 56, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / cls / f"{i}.jpg", quality=90)
    (root / "dogs" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return root


def _batches(cfg, workers, start=0, rank=0, world=1, context=None):
    cfg = cfg.clone()
    cfg.defrost()
    cfg.DATA.NUM_WORKERS = workers
    loader = step_loader(image_dataset(cfg), cfg, rank, world, start, pin_memory=False)
    loader.multiprocessing_context = context  # None: the platform's (fork on Linux before Python 3.14)
    return list(loader)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")  # torch's advice on a 2-core machine
def test_any_number_of_workers_gives_the_same_batches_and_a_resume_its_tail(jpegs):
    cfg = load_config(QUICK, ["DATA.PATH", str(jpegs), "TRAIN.STEPS", "6", *SMALL])
    reference = _batches(cfg, 0)
    assert len(reference) == 6 and all(len(views) == 2 and views[0].shape == (4, 3, 32, 32) for views, _ in reference)
    skipped = [name for _, names in reference for name in names]
    assert skipped and all(name.endswith("broken.jpg") for name in skipped)  # 6 steps of 4 from 11 files: it is drawn
    # forkserver, Python 3.14's default on Linux: the dataset, the views and the workers' set-up
    # reach each worker pickled, not forked
    for workers, context in ((1, None), (4, None), (2, "forkserver")):
        got = _batches(cfg, workers, context=context)
        assert [s for _, s in got] == [s for _, s in reference]
        for (a, _), (b, _) in zip(reference, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (workers, context)
    tail = _batches(cfg, 2, start=4)  # what a run resumed after step 4 is fed
    assert all(torch.equal(x, y) for (a, _), (b, _) in zip(reference[4:], tail) for x, y in zip(a, b))
    other_rank = _batches(cfg, 0, rank=1, world=2)
    assert not torch.equal(other_rank[0][0][0], _batches(cfg, 0, rank=0, world=2)[0][0][0])  # ranks see other images


@pytest.mark.parametrize("signame", ["SIGINT", "SIGHUP"])
def test_a_ctrl_c_or_hang_up_that_reaches_the_loaders_workers_fails_no_batch(jpegs, signame):
    """A terminal's Ctrl-C, and its hang-up (an ssh connection dropped), reach the loader's workers too;
    one they ended would fail the batch the stopping run's step waits on (torch: 'DataLoader worker
    exited unexpectedly'). They ignore both: the steps after the signal are those of a loader never signalled."""
    import multiprocessing
    import signal
    import time

    cfg = load_config(QUICK, ["DATA.PATH", str(jpegs), "TRAIN.STEPS", "4", "DATA.NUM_WORKERS", "1", *SMALL])
    others = {p.pid for p in multiprocessing.active_children()}  # an earlier test's loader may still be shutting down
    batches = iter(step_loader(image_dataset(cfg), cfg, 0, 1, 0, pin_memory=False))
    got = [next(batches)]
    workers = [p for p in multiprocessing.active_children() if p.pid not in others]
    assert len(workers) == 1
    os.kill(workers[0].pid, getattr(signal, signame))
    time.sleep(0.5)  # a worker it ends is gone by now
    got += list(batches)
    assert [names for _, names in got] == [names for _, names in _batches(cfg, 0)]
    assert all(torch.equal(x, y) for (a, _), (b, _) in zip(got, _batches(cfg, 0)) for x, y in zip(a, b))


@pytest.mark.filterwarnings("ignore:skipping unreadable image")  # the broken file, drawn: not what this test is about
def test_a_fetch_that_a_schedulers_sigterm_failed_stops_the_run_before_that_step(jpegs):
    """A scheduler's SIGTERM ends the loader's workers with the run: the batches they still owed fail
    (torch: 'DataLoader worker ... exited unexpectedly'), and the run died with a traceback, unsaved.
    After a stop signal, such a fetch gives no crops: the loop stops before that step, saved (the
    whole launcher under a real group SIGTERM: the slow tier's test_train.py)."""
    import multiprocessing
    import signal

    from trunksplit.ssl.loop import _next_step_views
    from trunksplit.ssl.stopping import stop_between_steps

    cfg = load_config(QUICK, ["DATA.PATH", str(jpegs), "TRAIN.STEPS", "4", "DATA.NUM_WORKERS", "1", *SMALL])
    others = {p.pid for p in multiprocessing.active_children()}  # an earlier test's loader may still be shutting down
    batches = iter(step_loader(image_dataset(cfg), cfg, 0, 1, 0, pin_memory=False))  # as the loop: before its handlers
    with stop_between_steps(say=False) as signals:
        crops, _ = _next_step_views(batches, torch.device("cpu"), {}, signals)
        assert len(crops) == 2
        for worker in [p for p in multiprocessing.active_children() if p.pid not in others]:  # the job's SIGTERM: the worker, then the run
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(5)
        signal.raise_signal(signal.SIGTERM)
        assert _next_step_views(batches, torch.device("cpu"), {}, signals) == (None, {})


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux's CPU affinity and 2 cores")
def test_the_default_worker_count_is_the_cores_the_process_may_run_on_less_its_own():
    """``DATA.NUM_WORKERS -1`` counted the machine's cores: a job given one core of a big node (SLURM, taskset) started
    a worker per core of the node, at most 4, to share its one. The reference: the affinity, set here and restored."""
    from trunksplit.ssl.data import num_workers

    cfg, cores = load_config(QUICK, ["DATA.NUM_WORKERS", "-1"]), os.sched_getaffinity(0)
    assert num_workers(cfg) == min(4, len(cores) - 1)
    try:
        os.sched_setaffinity(0, {min(cores)})  # this thread's: what a loader started here would share
        assert num_workers(cfg) == 0
    finally:
        os.sched_setaffinity(0, cores)


@pytest.mark.parametrize("n,batch,world", [(10, 2, 2), (11, 3, 1), (12, 2, 3)])
def test_no_step_holds_an_image_twice_and_an_epoch_draws_each_image_at_most_once(n, batch, world):
    """Each epoch is a shuffle of the data set cut into whole steps, its remainder left out (a DataLoader's
    drop_last): where a step ran across two epochs' shuffles it could hold an image twice (SimCLR takes the
    copies for two images). Where steps divide the data set, an epoch draws every image; a step larger
    than the data set is refused."""
    per_step, per_epoch = batch * world, n // (batch * world)
    steps = [[i for r in range(world) for i in batch_indices(n, batch, s, r, world, seed=0)] for s in range(3 * per_epoch)]
    assert all(len(step) == len(set(step)) == per_step and all(0 <= i < n for i in step) for step in steps)
    for e in range(3):
        epoch = [i for step in steps[e * per_epoch:(e + 1) * per_epoch] for i in step]
        assert len(epoch) == len(set(epoch)) == per_epoch * per_step
        if n % per_step == 0:
            assert sorted(epoch) == list(range(n))
    with pytest.raises(ValueError, match=f"a step of {n + 1} images .* from a data set of {n} would hold images more than once"):
        batch_indices(n, n + 1, 0, 0, 1, seed=0)


def test_training_with_two_workers_skips_the_corrupt_file_names_it_and_counts_it(jpegs, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(out), "DATA.PATH", str(jpegs), "DATA.NUM_WORKERS", "2", "TRAIN.STEPS", "6", *SMALL])
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*broken.jpg") as caught:
        _, last = train(cfg)
    assert sum("broken.jpg" in str(w.message) for w in caught) == 1  # once, however often it is drawn
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and last["skipped_images"] >= 1
    assert all(r["data_seconds"] >= 0 and r["step_seconds"] > 0 for r in rows)


def test_an_empty_folder_stays_a_clear_error_and_an_empty_class_folder_none(tmp_path):
    """No images, or images right under the root (ImageFolder lists none there), is refused saying
    where they go; a class folder without images beside one with them is no fault (labels unused)."""
    from PIL import Image

    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    for folder in ("empty", "flat"):
        with pytest.raises(ValueError, match=r"holds no images in ImageFolder layout: put them in folders under it, root/any_name/image.jpg"):
            image_dataset(load_config(QUICK, ["DATA.PATH", str(tmp_path / folder), *SMALL]))
    (tmp_path / "flat" / "cats").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "cats" / "a.png")
    (tmp_path / "flat" / "dogs").mkdir()  # no dog yet
    assert len(image_dataset(load_config(QUICK, ["DATA.PATH", str(tmp_path / "flat"), *SMALL]))) == 1


def test_lossless_files_decode_to_their_exact_pixels_through_decode_image_or_pil(tmp_path):
    from PIL import Image

    pixels = (torch.rand(24, 24, 3, generator=torch.Generator().manual_seed(4)) * 255).to(torch.uint8)
    want = pixels.permute(2, 0, 1).float() / 255
    for name in ("a.png", "a.bmp"):  # PNG: decode_image; BMP: the PIL fallback
        Image.fromarray(pixels.numpy()).save(tmp_path / name)
        got = read_image(str(tmp_path / name), 24)
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6), name
    # larger images: shorter side resized to the size, then centre-cropped
    Image.fromarray(torch.zeros(30, 60, 3, dtype=torch.uint8).numpy()).save(tmp_path / "wide.png")
    assert read_image(str(tmp_path / "wide.png"), 20).shape == (3, 20, 20)


def test_a_torchvision_without_its_deprecated_decoders_reads_every_file_through_pil(tmp_path, jpegs, monkeypatch):
    """torchvision 0.29 deprecated ``torchvision.io.decode_image`` (TorchCodec supersedes it). Where a
    release has removed it, every file is read through PIL, to the pixels torchvision gave (PNG exactly,
    JPEG within a level: two libjpeg builds), the odd files too; before, every read failed
    (AttributeError), and the loader's skipping of unreadable files did not catch it."""
    import torchvision
    from PIL import Image

    Image.fromarray((torch.rand(24, 24, 3, generator=torch.Generator().manual_seed(4)) * 255).to(torch.uint8).numpy()).save(tmp_path / "a.png")
    files = [str(tmp_path / "a.png"), *(str(jpegs / "cats" / f"{i}.jpg") for i in range(5))]
    _odd_files(tmp_path / "odd")
    with Image.open(tmp_path / "odd" / "odd" / "animated.jpg") as gif:  # its first frame, as PIL opens it
        first = torch.from_numpy(numpy.array(gif.convert("RGB"))).permute(2, 0, 1).float() / 255
    by_torchvision = [read_image(f, 24) for f in files]
    monkeypatch.delattr(torchvision.io, "decode_image")
    by_pil = [read_image(f, 24) for f in files]
    assert torch.equal(by_pil[0], by_torchvision[0])
    assert all((a - b).abs().max() <= 1 / 255 + 1e-6 for a, b in zip(by_pil[1:], by_torchvision[1:]))
    dataset = image_dataset(load_config(QUICK, ["DATA.PATH", str(tmp_path / "odd"), "DATA.IMAGE_SIZE", "40"]))
    images = {os.path.basename(dataset.name(i)): dataset[i] for i in range(len(dataset))}
    assert (images["animated.jpg"] - first).abs().max() < 1e-6  # an animated GIF's first frame, as before
    assert [os.path.basename(dataset.name(i)) for i in dataset.unreadable] == ["bomb.bmp"]


def _odd_files(root):
    """A folder of the files scraped sets hold: an animated GIF named .jpg, a .gif, and a
    decompression bomb (a tiny BMP that claims 30000x30000 pixels), beside two plain JPEGs."""
    from PIL import Image

    (root / "odd").mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    frames = [Image.fromarray((torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(3)]
    frames[0].save(root / "odd" / "animated.jpg", format="GIF", save_all=True, append_images=frames[1:])
    frames[1].save(root / "odd" / "still.gif")
    for i in range(2):
        frames[i].save(root / "odd" / f"plain{i}.jpg", quality=95)
    header = b"BM" + (54).to_bytes(4, "little") + bytes(4) + (54).to_bytes(4, "little")
    info = (40).to_bytes(4, "little") + (30000).to_bytes(4, "little") + (30000).to_bytes(4, "little") + (1).to_bytes(2, "little") + (24).to_bytes(2, "little") + bytes(24)
    (root / "odd" / "bomb.bmp").write_bytes(header + info)
    return frames


def test_gifs_are_listed_an_animated_one_gives_its_first_frame_and_a_bomb_is_skipped_by_name(tmp_path):
    from PIL import Image

    _odd_files(tmp_path)
    cfg = load_config(QUICK, ["DATA.PATH", str(tmp_path), "DATA.IMAGE_SIZE", "40"])
    dataset = image_dataset(cfg)
    names = sorted(os.path.basename(dataset.name(i)) for i in range(len(dataset)))
    assert names == ["animated.jpg", "bomb.bmp", "plain0.jpg", "plain1.jpg", "still.gif"]
    with Image.open(tmp_path / "odd" / "animated.jpg") as gif:  # PIL opens an animated GIF at its first frame
        assert gif.n_frames == 3
        first = torch.from_numpy(numpy.array(gif.convert("RGB"))).permute(2, 0, 1).float() / 255
    animated = read_image(str(tmp_path / "odd" / "animated.jpg"), 40)
    assert animated.shape == (3, 40, 40) and (animated - first).abs().max() < 1e-6
    images = [dataset[i] for i in range(len(dataset))]  # the bomb's index gives the next readable image
    assert all(img.shape == (3, 40, 40) for img in images)
    assert [os.path.basename(dataset.name(i)) for i in dataset.unreadable] == ["bomb.bmp"]
    assert Image.MAX_IMAGE_PIXELS is not None  # the guard stays on: the file is skipped, not decoded


def test_bench_data_on_a_folder_with_a_bomb_and_gifs_measures_instead_of_crashing(tmp_path, capsys):
    from trunksplit.cli import main

    _odd_files(tmp_path)
    assert main(["bench-data", "--recipes", "simclr", "--workers", "0", "--steps", "1", "--batch", "4", "--folder", str(tmp_path), "--jpegs", "4"]) == 0
    assert "images/s, 0 workers" in capsys.readouterr().out
    # a step holds each image once: a batch beyond the folder's 5 images, or beyond the JPEGs it writes, is refused in its own options
    assert main(["bench-data", "--recipes", "simclr", "--workers", "0", "--steps", "1", "--batch", "6", "--folder", str(tmp_path)]) == 2
    assert f"--batch 6 is more images than --folder {tmp_path} holds (5; a step holds each image once)" in capsys.readouterr().err
    assert main(["bench-data", "--recipes", "simclr", "--workers", "0", "--steps", "1", "--batch", "6", "--jpegs", "4"]) == 2
    assert "--batch 6 is more images than --jpegs 4 writes (a step holds each image once): give --jpegs 6 or more" in capsys.readouterr().err


def test_stripes_are_black_and_white_gratings_the_same_every_run_and_each_its_own():
    a, b = SyntheticImages(8, 32, seed=1, kind="stripes"), SyntheticImages(8, 32, seed=1, kind="stripes")
    images = [a[i] for i in range(8)]
    assert all(torch.equal(x, b[i]) for i, x in enumerate(images))  # a function of (seed, index)
    assert all(x.shape == (3, 32, 32) and set(x.unique().tolist()) == {0.0, 1.0} and torch.equal(x[0], x[2]) for x in images)
    assert len({tuple(x.flatten().tolist()) for x in images}) == 8
    with pytest.raises(ValueError, match="synthetic images are one of"):
        SyntheticImages(8, 32, kind="noise")
