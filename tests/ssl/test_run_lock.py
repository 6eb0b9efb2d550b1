"""One run writes an OUTPUT_DIR at a time: a second run, fresh or resuming, is refused while the first
goes, changing nothing, and may go on once the first has ended, however it ended."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trunksplit.ssl.config import load_config
from trunksplit.ssl.loop import train
from trunksplit.ssl.run_lock import hold_output_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
TINY = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4",
        "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0", "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "2"]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Windows has no flock: runs there are not guarded")


def _first_row(run: subprocess.Popen, metrics: str, log: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not (os.path.isfile(metrics) and os.path.getsize(metrics)):
        assert run.poll() is None, open(log).read()[-800:]
        assert time.monotonic() < deadline, "the first run logged no step"
        time.sleep(0.1)


def test_a_second_run_is_refused_while_the_first_writes_the_directory_and_goes_on_after_a_sigkill(tmp_path):
    """Before, a --resume started while its run still went (or two runs started together) trained beside it:
    metrics.jsonl held every step twice, interleaved, and each overwrote the other's checkpoint."""
    out, log = str(tmp_path / "run"), str(tmp_path / "first.log")
    with open(log, "w") as stderr:  # a file, not a pipe: a pipe nobody reads would stop the run once full
        first = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "train.py"), "--config-file", QUICK, *TINY, "TRAIN.STEPS", "100000",
                                  "TRAIN.CHECKPOINT_EVERY", "1", "OUTPUT_DIR", out], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        _first_row(first, os.path.join(out, "metrics.jsonl"), log)
        config = open(os.path.join(out, "config.yaml"), "rb").read()
        for resume in (False, True):
            with pytest.raises(ValueError, match=f"OUTPUT_DIR {out} is in use: a run still going writes it"):
                train(load_config(QUICK, [*TINY, "TRAIN.STEPS", "2", "OUTPUT_DIR", out]), resume=resume)
        with pytest.raises(ValueError, match="is in use"):  # two runs that both passed the check: the second to start writing
            hold_output_dir(out)
        assert open(os.path.join(out, "config.yaml"), "rb").read() == config  # nothing written over the running one's
        assert first.poll() is None  # and it goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(60)
    step = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"]
    with pytest.warns(UserWarning, match=r"TRAIN.STEPS \(100000 then"):
        _, last = train(load_config(QUICK, [*TINY, "TRAIN.STEPS", str(step + 1), "TRAIN.CHECKPOINT_EVERY", "1", "OUTPUT_DIR", out]), resume=True)
    assert last["step"] == step + 1  # no stale lock: the system let go of the killed run's


def test_a_run_lets_go_of_its_directory_when_it_ends(tmp_path):
    """A process that trained (a notebook, a test) keeps running; another may now train into the directory."""
    out = str(tmp_path / "run")
    train(load_config(QUICK, [*TINY, "TRAIN.STEPS", "1", "OUTPUT_DIR", out]))
    take = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('taken')")
    taken = subprocess.run([sys.executable, "-c", take, os.path.join(out, "config.yaml")], capture_output=True, text=True, timeout=60)
    assert taken.stdout.strip() == "taken", taken.stderr[-500:]


def test_a_forked_worker_that_outlives_its_runs_end_does_not_hold_the_directory(tmp_path):
    """``flock`` belongs to the open file, which a fork shares: a loader's worker (a kNN loader's, kept alive
    by an exception's traceback in a notebook) held the directory for as long as it lived."""
    import multiprocessing

    from trunksplit.ssl.run_lock import release_output_dir

    out = str(tmp_path / "run")
    os.makedirs(out)
    hold_output_dir(out)
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    worker.start()
    try:
        release_output_dir(out)
        take = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('taken')"
        taken = subprocess.run([sys.executable, "-c", take, os.path.join(out, "config.yaml")], capture_output=True, text=True, timeout=60)
        assert worker.is_alive() and taken.stdout.strip() == "taken", taken.stderr[-500:]
    finally:
        worker.kill()
        worker.join(10)
