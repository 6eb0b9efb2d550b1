"""The kNN monitor: DINO's weighted kNN against a hand-written one, classes any features separate,
labels dealt at random, online equal to offline, a run's weights untouched by it, and clear errors."""
import contextlib
import io
import json
import math
import os
import random
import re

import pytest
import torch
from PIL import Image

from trunksplit.cli import main
from trunksplit.ssl.config import load_config
from trunksplit.ssl import knn, loop
from trunksplit.ssl.knn import KnnMonitor, RankShare, extract_features, knn_accuracy
from trunksplit.ssl.loop import train
from trunksplit.ssl.report import read_run, report_figure

from distributed_harness import run_processes, threads_of_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4",
         "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0"]
COLOURS = [(230, 30, 30), (30, 200, 40), (40, 60, 230), (240, 220, 30), (200, 40, 220), (40, 220, 220), (20, 20, 20)]


def _folder(root, per_class, seed, shuffle_labels=False):
    """An ImageFolder of solid-coloured images with a little noise, a colour per class: classes
    that any features separate; with ``shuffle_labels`` the same images dealt to classes at random."""
    rng = random.Random(seed)
    images = [(c, i) for c in range(len(COLOURS)) for i in range(per_class)]
    labels = [c for c, _ in images]
    if shuffle_labels:
        rng.shuffle(labels)
    for (colour, i), label in zip(images, labels):
        folder = os.path.join(root, f"class_{label}")
        os.makedirs(folder, exist_ok=True)
        pixels = torch.tensor(COLOURS[colour], dtype=torch.float32).expand(40, 40, 3) + torch.randn(40, 40, 3, generator=torch.Generator().manual_seed(seed * 1000 + colour * 100 + i)) * 8
        Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()).save(os.path.join(folder, f"{colour}_{i}.png"))
    return str(root)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("knn")
    return {
        "train": _folder(root / "train", 6, 0), "val": _folder(root / "val", 3, 1),
        "random_train": _folder(root / "random_train", 6, 2, shuffle_labels=True), "random_val": _folder(root / "random_val", 3, 3, shuffle_labels=True),
    }


def _reference_knn(train, train_labels, val, val_labels, classes, k, temperature):
    """DINO's weighted kNN written out: for each validation image, its k most similar training
    images (cosine), each voting exp(similarity / T) for its class; the class with most votes."""
    top1 = top5 = 0
    for v, truth in zip(val.tolist(), val_labels.tolist()):
        sims = sorted(((sum(a * b for a, b in zip(v, t)), label) for t, label in zip(train.tolist(), train_labels.tolist())), reverse=True)[:k]
        votes = [0.0] * classes
        for s, label in sims:
            votes[label] += math.exp(s / temperature)
        ranked = sorted(range(classes), key=lambda c: -votes[c])
        top1 += ranked[0] == truth
        top5 += truth in ranked[:5] and votes[truth] > 0  # a class no neighbour voted for is no guess
    return top1 / len(val), top5 / len(val)


def test_knn_accuracy_equals_a_hand_written_weighted_knn():
    g = torch.Generator().manual_seed(0)
    train, val = (torch.nn.functional.normalize(torch.randn(n, 6, generator=g), dim=1) for n in (40, 25))
    train_labels, val_labels = torch.randint(0, 8, (40,), generator=g), torch.randint(0, 8, (25,), generator=g)
    got = knn_accuracy(train, train_labels, val, val_labels, 8, k=7, temperature=0.5)
    top1, top5 = _reference_knn(train, train_labels, val, val_labels, 8, 7, 0.5)
    assert got["knn_top1"] == pytest.approx(top1) and got["knn_top5"] == pytest.approx(top5)
    assert "knn_top5" not in knn_accuracy(train, train_labels % 4, val, val_labels % 4, 4, k=7)  # top-5 of 4 classes says nothing


def _monitor(folders, train="train", val="val"):
    return KnnMonitor(load_config(QUICK, [*SMALL, "EVAL.KNN.TRAIN_PATH", folders[train], "EVAL.KNN.VAL_PATH", folders[val]]))


def test_classes_any_features_separate_read_above_0_9_and_random_labels_near_chance(folders):
    torch.manual_seed(0)
    from trunksplit.ssl.model import build_model

    trunk = build_model(load_config(QUICK, SMALL)).trunk  # random weights: the classes are colours
    separable = _monitor(folders).evaluate(trunk, torch.device("cpu"))
    assert separable["knn_top1"] >= 0.9, separable
    chance = _monitor(folders, "random_train", "random_val").evaluate(trunk, torch.device("cpu"))
    assert chance["knn_top1"] <= 1 / len(COLOURS) + 0.25, chance  # 21 images: chance is 1/7, within a few images


def test_a_runs_evaluations_keep_one_set_of_loader_workers_and_read_as_one_process_does(folders):
    """Where workers start as fresh interpreters (spawn on macOS, forkserver from Python 3.14), a loader made
    per evaluation imported torch again each time: 4 evaluations of a digits run took 30 s more than under
    fork. The monitor reads both folders with one worker, started at its first evaluation and kept; the
    figures are those of one process reading them, every time; the worker goes with the monitor."""
    import gc
    import multiprocessing

    from trunksplit.ssl.model import build_model

    torch.manual_seed(0)
    trunk, cpu = build_model(load_config(QUICK, SMALL)).trunk, torch.device("cpu")
    in_process = _monitor(folders, "random_train", "random_val").evaluate(trunk, cpu)
    before = {p.pid for p in multiprocessing.active_children()}  # an earlier test's loader may still be shutting down
    monitor, workers = _monitor(folders, "random_train", "random_val"), []
    for _ in range(2):
        assert monitor.evaluate(trunk, cpu, workers=1) == in_process
        workers.append({p.pid for p in multiprocessing.active_children()} - before)
    assert len(workers[0]) == 1 and workers[1] == workers[0], workers
    (worker,) = [p for p in multiprocessing.active_children() if p.pid in workers[0]]
    del monitor
    gc.collect()
    worker.join(10)
    assert not worker.is_alive()


def test_a_run_with_the_monitor_trains_the_weights_of_a_run_without_and_offline_reads_the_same(tmp_path, folders, capsys, monkeypatch):
    """Labels dealt at random, so the accuracies are not all 1.0: the step-0 point is the model the
    run started from (offline ``--untrained`` builds it again from the config and seed), the last
    is the checkpoint's (offline, and kept in knn.jsonl for the report). Offline, the images are read
    by as many workers as the run's (it read them all in its own process, whatever the machine had)."""
    overrides = [*SMALL, "TRAIN.STEPS", "3", "DATA.NUM_WORKERS", "1"]
    read_by = []
    monkeypatch.setattr(knn, "RankShare", lambda dataset, workers=0, *a: read_by.append(workers) or RankShare(dataset, workers, *a))
    plain, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "plain"), *overrides]))
    watched = ["EVAL.KNN.TRAIN_PATH", folders["random_train"], "EVAL.KNN.VAL_PATH", folders["random_val"], "EVAL.KNN.EVERY_STEPS", "2"]
    trunks_written = []
    monkeypatch.setattr(loop, "save_trunk_weights", lambda out, *a: trunks_written.append(out))
    monitored, last = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "knn"), *overrides, *watched]))
    assert trunks_written == [str(tmp_path / "knn")]  # at the end of the run, not at each evaluation
    for (name, a), (_, b) in zip(plain.state_dict().items(), monitored.state_dict().items()):
        assert torch.equal(a, b), name
    rows = [json.loads(line) for line in (tmp_path / "knn" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "knn_top1" in r] == [0, 2, 3]  # untrained, every 2 steps, and at the end
    assert all(r["knn_seconds"] > 0 and 0 <= r["knn_top5"] <= 1 for r in rows if "knn_top1" in r)
    assert "loss" not in rows[0] and all("loss" in r for r in rows[1:])  # step 0 is an evaluation, not a step
    capsys.readouterr()
    for flags, row in (([], last), (["--untrained"], rows[0])):
        assert main(["knn", str(tmp_path / "knn"), "--train", folders["random_train"], "--val", folders["random_val"], *flags]) == 0
        out, err = capsys.readouterr()
        assert f"top-1 {row['knn_top1']:.4f}, top-5 {row['knn_top5']:.4f}" in out, (flags, out)
        assert "\r" not in err  # stderr here is not a terminal, as in a log: no progress bar's carriage returns
    assert read_by == [1, 1, 1]  # the run's monitor, then each offline command
    kept = [json.loads(line) for line in (tmp_path / "knn" / "knn.jsonl").read_text().splitlines()]
    assert [(r["step"], r["untrained"], r["knn_top1"]) for r in kept] == [(3, False, last["knn_top1"]), (0, True, rows[0]["knn_top1"])]
    assert kept[0]["val"] == os.path.abspath(folders["random_val"])
    # the run trained without the monitor, evaluated afterwards: its report has a kNN panel for that point alone
    assert main(["knn", str(tmp_path / "plain"), "--train", folders["random_train"], "--val", folders["random_val"]]) == 0
    knn_ax = next(ax for ax in report_figure([read_run(str(tmp_path / "plain"))]).axes if ax.get_ylabel() == "kNN top-1")
    assert [tuple(p) for c in knn_ax.collections for p in c.get_offsets()] == [(3, last["knn_top1"])]  # the same weights as the monitored run's
    assert all(float(t).is_integer() for t in knn_ax.get_xticks())  # steps: no tick at 2.5


def _two_ranks(rank, world_size, out, folders):
    from trunksplit.ssl.model import build_model

    torch.manual_seed(0)
    trunk = build_model(load_config(QUICK, SMALL)).trunk
    held, real = [], knn.knn_accuracy
    knn.knn_accuracy = lambda train_features, *args: held.append(train_features.shape) or real(train_features, *args)
    result = _monitor(folders).evaluate(trunk, torch.device("cpu"), rank=rank, world=world_size)
    torch.save((result, held), os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_share_the_images_hold_half_the_train_features_and_read_what_one_process_reads(tmp_path, folders):
    """42 train and 21 validation images over 2 ranks: the concatenated share of 63 padded on one rank.
    Each rank keeps its 21 train features (a monitor of ImageNet's train set held 10 GB of ResNet-50
    features on every GPU), the validation features travel; the figures are one process's."""
    run_processes(_two_ranks, 2, (str(tmp_path), folders))
    from trunksplit.ssl.model import build_model

    torch.manual_seed(0)
    alone = _monitor(folders).evaluate(build_model(load_config(QUICK, SMALL)).trunk, torch.device("cpu"))
    train_images = sum(len(files) for _, _, files in os.walk(folders["train"]))
    for rank in range(2):
        result, held = torch.load(tmp_path / f"rank{rank}.pt")
        assert result == pytest.approx(alone)
        assert held == [torch.Size([train_images // 2, 128])]  # SMALL's quarter-width ResNet-18: 128 features, half the images


def _ranked_in_shares(rank, world_size, out, train, train_labels, val, val_labels, shares):
    """Each split of the train rows into two shares (rank 0's first), kNN'd on two ranks."""
    results = [knn_accuracy(train[:cut] if rank == 0 else train[cut:], train_labels[:cut] if rank == 0 else train_labels[cut:],
                            val, val_labels, 8, k=7, temperature=0.5, world=world_size) for cut in shares]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_knn_over_shares_of_the_train_features_equals_the_hand_written_knn_over_all(tmp_path):
    """Uneven shares, a share short of k (3 rows for k = 7) and an empty one: the merged k best of
    both ranks are the k best of all, on both ranks."""
    g = torch.Generator().manual_seed(1)
    train, val = (torch.nn.functional.normalize(torch.randn(n, 6, generator=g), dim=1) for n in (40, 25))
    train_labels, val_labels = torch.randint(0, 8, (40,), generator=g), torch.randint(0, 8, (25,), generator=g)
    top1, top5 = _reference_knn(train, train_labels, val, val_labels, 8, 7, 0.5)
    shares = [20, 29, 3, 37, 0]
    run_processes(_ranked_in_shares, 2, (str(tmp_path), train, train_labels, val, val_labels, shares))
    for rank in range(2):
        for got in torch.load(tmp_path / f"rank{rank}.pt"):
            assert (got["knn_top1"], got["knn_top5"]) == pytest.approx((top1, top5))


def test_unlabelled_empty_or_mismatched_folders_are_refused_before_anything_is_written(tmp_path, folders):
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    (tmp_path / "one" / "only").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "only" / "a.png")
    (tmp_path / "empty").mkdir()
    for name in ("cats", "dogs"):
        (tmp_path / "other" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "other" / name / "a.png")
    for name in ("cats", "dogs", "birds"):  # birds: a class folder without images
        (tmp_path / "gap" / name).mkdir(parents=True)
    for name in ("cats", "dogs"):
        Image.new("RGB", (8, 8)).save(tmp_path / "gap" / name / "a.png")
    unlabelled = "is no folder of labelled images (root/class_name/image.jpg, an image in every class folder)"
    cases = [(str(tmp_path / "flat"), unlabelled), (str(tmp_path / "one"), "1 class folder"), (str(tmp_path / "empty"), unlabelled),
             (str(tmp_path / "gap"), unlabelled + ": Found no valid file for the classes birds"), (str(tmp_path / "missing"), "is not a directory"),
             (str(tmp_path / "other"), "need the same class folders")]
    for path, message in cases:
        out = tmp_path / "run"
        overrides = [*SMALL, "TRAIN.STEPS", "1", "OUTPUT_DIR", str(out), "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", path]
        with pytest.raises(ValueError, match=re.escape(message)):
            train(load_config(QUICK, overrides))
        assert not out.exists()
    # trunksplit knn says them of its own arguments
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(QUICK, SMALL).dump())
    for path, said in ((str(tmp_path / "gap"), f"error: --val {str(tmp_path / 'gap')!r} {unlabelled}"),
                       (str(tmp_path / "other"), "error: --train and --val need the same class folders")):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["knn", str(run), "--train", folders["train"], "--val", path]) == 2
        assert err.getvalue().startswith(said), err.getvalue()
    with pytest.raises(ValueError, match="come together"):
        load_config(QUICK, ["EVAL.KNN.TRAIN_PATH", folders["train"]])
    with pytest.raises(ValueError, match="EVAL.KNN.K must be >= 1"):
        load_config(QUICK, ["EVAL.KNN.K", "0"])


def _lines(ax):
    return [(list(line.get_xdata()), list(line.get_ydata()), line.get_label()) for line in ax.get_lines()]


def test_report_draws_each_curve_against_its_reference_and_overlays_runs(tmp_path, folders, capsys):
    """The kNN panel starts at the untrained point and reads on 0..1 (not zoomed to fill it), the
    loss is drawn against chance (ln(2B - 1) for SimCLR, by hand), the memory against the step
    without checkpointing the run measured side by side; several runs overlay in one picture."""
    a, b = tmp_path / "a", tmp_path / "b"
    _, last = train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "2", "OUTPUT_DIR", str(a), "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", folders["val"]]))
    assert json.loads((a / "summary.json").read_text()) == {key: last[key] for key in ("step", "chance_loss", "plan", "memory_vs_plain")}
    assert not (a / "tensorboard").exists()  # LOGGING.TENSORBOARD is off by default: nothing new written
    b.mkdir()  # a second run, as an earlier release left it: metrics only (no summary, no kNN)
    (b / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 2, "images_per_sec": 9.0, "peak_memory_bytes": 2**21}) + "\n" for s in (1, 2, 3)))
    capsys.readouterr()
    assert main(["report", str(a)]) == 0
    printed = capsys.readouterr().out
    assert "kNN top-1" in printed and " untrained" in printed and "of chance, 1.9459" in printed and "MiB without" in printed
    with Image.open(a / "report.png") as picture:
        assert picture.size[0] > 400 and picture.size[1] > 400
    untrained = json.loads((a / "metrics.jsonl").read_text().splitlines()[0])
    loss_ax, knn_ax, _, memory_ax, _ = report_figure([read_run(str(a))]).axes
    assert [(x[0], y[0]) for x, y, _ in _lines(knn_ax)] == [(0, untrained["knn_top1"])] and knn_ax.get_ylim() == (0, 1.02)
    assert any(y == [math.log(2 * 4 - 1)] * 2 for _, y, _ in _lines(loss_ax))  # batch 4: 2B - 1 = 7 candidates
    assert any(y == [last["memory_vs_plain"]["plain"] / 2**20] * 2 for _, y, _ in _lines(memory_ax)) and memory_ax.get_ylim()[0] == 0
    assert main(["report", str(a), str(b), "--output", str(tmp_path / "both.png")]) == 0
    printed = capsys.readouterr().out
    assert "a: steps 1..2" in printed and "b: steps 1..3" in printed and (tmp_path / "both.png").exists()
    loss_ax = report_figure([read_run(str(a)), read_run(str(b))]).axes[0]
    assert sorted(len(x) for x, _, label in _lines(loss_ax) if label in ("a", "b")) == [2, 3]
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_training_on_the_folder_that_holds_the_validation_images_is_warned_at_start(folders, recwarn):
    """A user's first run pointed DATA.PATH at the folder holding both splits and trained on the
    images its kNN classified; the training split alone is not warned about."""
    root = os.path.dirname(folders["val"])  # holds train/, val/ and the others, as class folders
    with pytest.warns(UserWarning, match=r"DATA.PATH .* holds 21 of the 21 images of EVAL.KNN.VAL_PATH"):
        _monitor_of(folders, ["DATA.PATH", root])
    recwarn.clear()
    _monitor_of(folders, ["DATA.PATH", folders["train"]])
    _monitor_of(folders, [])  # synthetic training images
    assert not [w for w in recwarn if "EVAL.KNN.VAL_PATH" in str(w.message)]


def _monitor_of(folders, overrides):
    return KnnMonitor(load_config(QUICK, [*SMALL, *overrides, "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", folders["val"]]))


def test_offline_knn_of_a_bf16_run_reads_the_features_its_monitor_read(tmp_path, folders, monkeypatch):
    """``trunksplit knn`` promises the numbers the monitor logged at that step: a bf16 run's monitor extracts
    features under the run's autocast, so must the offline evaluation (it ran fp32: a digits run read 0.933
    online and 0.936 offline). The features the kNN is given, online and offline, bit for bit."""
    from trunksplit.ssl import knn as knn_module

    given = []
    real = knn_module.knn_accuracy
    monkeypatch.setattr(knn_module, "knn_accuracy", lambda *args, **kwargs: given.append(args[:4]) or real(*args, **kwargs))
    run = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(run), *SMALL, "TRAIN.STEPS", "1", "TRAIN.AUTOCAST", "bf16", "EVAL.KNN.TRAIN_PATH", folders["train"],
                              "EVAL.KNN.VAL_PATH", folders["val"]]))
    online = given[-1]
    assert main(["knn", str(run), "--train", folders["train"], "--val", folders["val"]]) == 0
    assert all(torch.equal(a, b) for a, b in zip(online, given[-1]))


def test_knn_of_a_run_without_a_checkpoint_says_so_in_its_own_words(tmp_path, folders, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(QUICK, SMALL).dump())
    assert main(["knn", str(run), "--train", folders["train"], "--val", folders["val"]]) != 0
    err = capsys.readouterr().err
    assert "trunksplit knn: no checkpoint at" in err and "--resume" not in err


def test_report_of_a_killed_run_draws_the_whole_rows_and_says_which_line_it_dropped(tmp_path, capsys):
    """A run killed while writing its last metrics line (``--resume`` drops that line too): the
    report draws the whole rows and says what it left out; a damaged line before the last is still an error."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 4.0 - s, "images_per_sec": 10.0, "peak_memory_bytes": 2**20, "data_seconds": 0.01} for s in (1, 2)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(whole + '{"step": 3, "loss": 1.')
    with pytest.warns(UserWarning, match="line 3, the last, is torn"):
        assert main(["report", str(run)]) == 0
    assert "steps 1..2 (2 rows)" in capsys.readouterr().out and (run / "report.png").exists()
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n' + whole)
    assert main(["report", str(run)]) == 2
    assert "line 1 is not a metrics row" in capsys.readouterr().err


def _unreadable_folder(root):
    for name in ("cats", "dogs"):
        (root / name).mkdir(parents=True)
        for i in range(2):
            (root / name / f"{i}.png").write_bytes(b"not an image")
    return str(root)


def test_a_folder_of_unreadable_images_is_refused_before_training_or_extraction(tmp_path, folders, capsys):
    """Every image unreadable: the run is refused before anything is written (it trained, then died
    on a ZeroDivisionError, before); offline, the folder is named (it read top-1 0.0000)."""
    bad = _unreadable_folder(tmp_path / "bad")
    for train_path, val_path, key in ((folders["train"], bad, "EVAL.KNN.VAL_PATH"), (bad, folders["val"], "EVAL.KNN.TRAIN_PATH")):
        out = tmp_path / "run"
        with pytest.raises(ValueError, match=f"{key} .*none of its 4 image files can be read"):
            train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "1", "OUTPUT_DIR", str(out), "EVAL.KNN.TRAIN_PATH", train_path, "EVAL.KNN.VAL_PATH", val_path]))
        assert not out.exists()
    out = tmp_path / "trained"
    train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "1", "OUTPUT_DIR", str(out)]))
    assert main(["knn", str(out), "--train", bad, "--val", folders["val"]]) == 2
    assert "none of its 4 image files can be read" in capsys.readouterr().err


def test_an_evaluation_that_fails_leaves_the_steps_checkpoint_saved(tmp_path, folders, monkeypatch):
    evaluate, calls = KnnMonitor.evaluate, []

    def broken(*args, **kwargs):  # the untrained model's evaluation (step 0) works; the one after step 3 breaks
        calls.append(1)
        if len(calls) == 1:
            return evaluate(*args, **kwargs)
        raise RuntimeError("the evaluation broke")

    monkeypatch.setattr(KnnMonitor, "evaluate", broken)
    out = tmp_path / "run"
    cfg = load_config(QUICK, [*SMALL, "TRAIN.STEPS", "3", "TRAIN.CHECKPOINT_EVERY", "10", "OUTPUT_DIR", str(out),
                              "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", folders["val"]])
    with pytest.raises(RuntimeError, match="the evaluation broke"):
        train(cfg)
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3  # the last step's, saved before evaluating


def _stopped_in_an_evaluation(rank, world_size, out, folders):
    """Rank 1 alone receives SIGINT at its second batch of the kNN evaluation after step 2 (4 images a
    batch: 6 a rank). Both ranks leave the evaluation at the same batch and stop after step 2, saved."""
    import signal

    from trunksplit.ssl.stopping import Stopped

    knn.BATCH, until, seen = 4, loop.until_stopped, []

    def signalled_at_the_second(batches, signals, largest):
        for batch in until(batches, signals, largest):
            seen.append(batch)
            if rank == 1 and len(seen) == 2:
                signal.raise_signal(signal.SIGINT)
            yield batch

    loop.until_stopped = signalled_at_the_second  # this spawned process's copy of the loop
    cfg = load_config(QUICK, [*SMALL, "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "10", "OUTPUT_DIR", out,
                              "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", folders["val"], "EVAL.KNN.EVERY_STEPS", "2"])
    with pytest.raises(Stopped) as stopped:
        train(cfg)
    assert (stopped.value.step, stopped.value.signum, len(seen)) == (2, signal.SIGINT, 2)


def test_a_signal_during_an_evaluation_stops_the_run_at_once_saved_on_every_rank(tmp_path, folders):
    """A kNN evaluation over a data set can outlast a scheduler's grace period (SLURM's KillWait, 30 s),
    and the job is then killed unsaved: a stop signal ran the whole evaluation first. The run now leaves
    it between two batches, every rank at the same one, and saves the step; its row has no accuracy."""
    out = tmp_path / "run"
    run_processes(_stopped_in_an_evaluation, 2, (str(out), folders))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "knn_top1" in r] == [0] and rows[-1]["step"] == 2


def test_an_evaluation_whose_loader_workers_a_sigterm_ended_stops_and_does_not_fail(folders, monkeypatch):
    """A scheduler's SIGTERM ends the kNN loader's workers with the run: the batches they still owed
    failed the evaluation (torch: 'DataLoader worker (pid(s) ...) exited unexpectedly'), a traceback
    and exit 1, nothing saved. After a stop signal such a fetch leaves the evaluation."""
    import multiprocessing
    import signal

    from trunksplit.ssl.model import build_model
    from trunksplit.ssl.stopping import EvaluationStopped, stop_between_steps, until_stopped

    monkeypatch.setattr(knn, "BATCH", 4)
    others = {p.pid for p in multiprocessing.active_children()}  # an earlier test's loader may still be shutting down
    trunk, fetched = build_model(load_config(QUICK, SMALL)).trunk, []

    def ended_with_its_workers(loader, signals):
        for batch in until_stopped(loader, signals, lambda signum: signum):  # one process: its own signal
            fetched.append(batch)
            if len(fetched) == 1:  # the job's SIGTERM: to each worker, then to the run
                for worker in [p for p in multiprocessing.active_children() if p.pid not in others]:
                    os.kill(worker.pid, signal.SIGTERM)
                    worker.join(5)
                signal.raise_signal(signal.SIGTERM)
            yield batch

    with stop_between_steps(say=False) as signals:
        with pytest.raises(EvaluationStopped):
            extract_features(trunk, RankShare(_monitor(folders).train, workers=1), torch.device("cpu"), batches=lambda loader: ended_with_its_workers(loader, signals))
    assert len(fetched) == 1


def test_a_dino_run_is_evaluated_by_its_teacher_as_dinos_own_knn_does(tmp_path, folders, capsys):
    """DINO reports its teacher, and its eval_knn.py reads the teacher by default (--checkpoint_key
    teacher): the monitor and the offline command read it too. The reference: the checkpoint's teacher
    trunk run image by image, and the hand-written kNN."""
    import torch.nn.functional as F

    from trunksplit.ssl.model import build_ssl_model

    out = tmp_path / "run"
    dino = ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", "MODEL.HEAD.OUTPUT_DIM", "16", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]",
            "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "METHOD.DINO.TEACHER_MOMENTUM", "0.5", "OPTIM.LR", "3.0", "TRAIN.STEPS", "3"]
    cfg = load_config(QUICK, [*SMALL, *dino, "OUTPUT_DIR", str(out), "EVAL.KNN.TRAIN_PATH", folders["random_train"], "EVAL.KNN.VAL_PATH", folders["random_val"]])
    _, last = train(cfg)
    model = build_ssl_model(cfg)
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["model"])
    monitor = KnnMonitor(cfg)

    def reference(trunk):
        trunk.eval()
        with torch.no_grad():
            read = [[(F.normalize(trunk(image[None])[-1].flatten(1), dim=1)[0], label) for image, label, _ in images] for images in (monitor.train, monitor.val)]
        (train_f, train_l), (val_f, val_l) = [(torch.stack([f for f, _ in r]), torch.tensor([label for _, label in r])) for r in read]
        return _reference_knn(train_f, train_l, val_f, val_l, len(COLOURS), cfg.EVAL.KNN.K, cfg.EVAL.KNN.TEMPERATURE)

    teacher = reference(model.teacher.trunk)  # the student's, reference(model.trunk), read 0.000 top-1 against 0.048 (2026-11-29)
    assert (last["knn_top1"], last["knn_top5"]) == pytest.approx(teacher), (last, teacher)
    capsys.readouterr()
    assert main(["knn", str(out), "--train", folders["random_train"], "--val", folders["random_val"]]) == 0
    assert f"at step 3: top-1 {teacher[0]:.4f}, top-5 {teacher[1]:.4f}" in capsys.readouterr().out


def _ranks_with_monitor(rank, world_size, out, folders, strategy):
    train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "2", "OUTPUT_DIR", out, "DISTRIBUTED.STRATEGY", strategy,
                              "EVAL.KNN.TRAIN_PATH", folders["train"], "EVAL.KNN.VAL_PATH", folders["val"]]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_on_two_ranks_the_online_knn_is_the_offline_knn_of_the_checkpoint(tmp_path, folders, capsys, strategy):
    """Each rank moves its own BatchNorm statistics; the checkpoint holds rank 0's, and so must every
    rank's share of the online evaluation (0.238 online against 0.000 offline, before). An FSDP2 run's
    sharded checkpoint is read whole by ``trunksplit knn`` (it was refused)."""
    out = tmp_path / "run"
    run_processes(_ranks_with_monitor, 2, (str(out), folders, strategy))
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    with threads_of_workers(2):  # the ranks' thread count: the same convolution kernels, the same features
        assert main(["knn", str(out), "--train", folders["train"], "--val", folders["val"]]) == 0
    assert f"at step 2: top-1 {last['knn_top1']:.4f}" in capsys.readouterr().out
