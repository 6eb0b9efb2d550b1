"""tools/train.py end to end: metrics, two processes, resume, and clear errors that change nothing."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from trunksplit.config import load_config
from trunksplit.ssl import loop
from trunksplit.ssl.loop import train

from distributed_harness import run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4", "MODEL.HEAD.HIDDEN_DIM", "64"]


def _cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_quickstart_cli_writes_finite_metrics(tmp_path):
    out = tmp_path / "run"
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), "TRAIN.STEPS", "3", *SMALL)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["images_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and r["lr"] > 0
    assert load_config(str(out / "config.yaml")).TRAIN.STEPS == 3  # the resolved config, loadable
    assert "without checkpointing" in result.stdout and "images/s" in result.stdout
    assert (out / "checkpoint.pt").exists()


def _two_rank_run(rank, world_size, out, manual):
    overrides = ["OUTPUT_DIR", out, "TRAIN.STEPS", "2", *SMALL]
    if manual:
        overrides += ["DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True", "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT", "True"]
    model, _ = train(load_config(QUICK, overrides))
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.parametrize("manual", [False, True], ids=["native_ddp", "manual_ddp"])
def test_two_processes_end_with_identical_weights_equal_to_the_saved_ones(tmp_path, manual):
    run_processes(_two_rank_run, 2, (str(tmp_path), manual))
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    initial = load_config(QUICK, SMALL)  # weights moved away from a fresh init
    for name, value in saved.items():
        assert torch.equal(ranks[0][name], value) and torch.equal(ranks[1][name], value), name
    assert any(not torch.equal(v, ranks[0][k]) for k, v in _fresh_state(initial).items() if v.is_floating_point())


def _fresh_state(cfg):
    from trunksplit.ssl.model import build_model

    torch.manual_seed(cfg.SEED)
    return build_model(cfg).state_dict()


def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    overrides = ["TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", *SMALL]
    straight, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides]))

    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides])
    real_views = loop.step_views

    def interrupt_at_step_3(dataset, cfg, step, rank, world):
        if step == 3:
            raise KeyboardInterrupt
        return real_views(dataset, cfg, step, rank, world)

    monkeypatch.setattr(loop, "step_views", interrupt_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(loop, "step_views", real_views)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 2
    resumed, last = train(cfg, resume=True)

    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and last["step"] == 4


def _snapshot(folder):
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))} if os.path.isdir(folder) else None


@pytest.mark.parametrize(
    "args,message",
    [
        (["TRAIN.STEPZ", "3"], "unknown config key: TRAIN.STEPZ"),
        (["DATA.PATH", "/nonexistent/images"], "DATA.PATH '/nonexistent/images' is not a directory"),
        (["MODEL.TRUNK.NAME", "resnet9000"], "torchvision has no model 'resnet9000'"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "run"
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_checkpoint_on_resume_is_refused_and_nothing_is_touched(tmp_path, damage):
    out = tmp_path / "run"
    assert _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL).returncode == 0
    ckpt = out / "checkpoint.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a checkpoint")
    before = _snapshot(out)
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL, "--resume")
    assert result.returncode == 2 and "cannot read checkpoint" in result.stderr
    assert _snapshot(out) == before


def test_image_folder_data(tmp_path):
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "images" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (50, 40), color=(40 * i, 100, 200 if cls == "a" else 20)).save(tmp_path / "images" / cls / f"{i}.png")
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), "DATA.PATH", str(tmp_path / "images"), "TRAIN.STEPS", "1", *SMALL])
    _, last = train(cfg)
    assert math.isfinite(last["loss"])
