"""tools/train.py end to end: metrics, two processes, resume, and clear errors that change nothing."""
import contextlib
import errno
import importlib.util
import io
import json
import math
import os
import pathlib
import pty
import re
import select
import signal
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.multiprocessing.reductions import StorageWeakRef  # private, as trunksplit.planning.memory imports it: a storage's liveness

from trunksplit.cli import main as cli_main
from trunksplit.ssl.backbones import resnet_of_width
from trunksplit.ssl.config import load_config
from trunksplit.ssl import loop, side_by_side
from trunksplit import CheckpointedTrunk
from trunksplit import trunk as trunk_module
from trunksplit.ssl.loop import train
from trunksplit.ssl.stopping import StopSignals, Stopped, stop_between_steps
from trunksplit.ssl.fit_step import fitted_batch
from trunksplit.ssl.model import build_trunk
from trunksplit.ssl import strategy

from distributed_harness import run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
# small and quick; loader workers are tested in test_data.py, so these runs build views in-process
# ResNet-18 a quarter as wide (16 channels in the stem): vissl's blocks and every code path of the full width, for
# a fraction of its compute and a fourteenth of its weights (docs/architecture.md); ANY_WIDTH with another trunk
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4", "MODEL.HEAD.HIDDEN_DIM", "64",
         "DATA.NUM_WORKERS", "0"]
ANY_WIDTH = ["MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "1"]


def _script(*args):
    """tools/train.py run as a user runs it: its own process (startup, imports, exit status)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def _train_tool():
    spec = importlib.util.spec_from_file_location("train_tool", os.path.join(ROOT, "tools", "train.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _cli(*args):
    """tools/train.py's ``main`` in this process (``_script``'s exit status and output, without
    a second Python importing torch for every error case)."""
    tool = _train_tool()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main(list(args))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_the_launcher_without_a_config_file_says_it_trains_the_defaults(tmp_path):
    """As detectron2's train_net, no --config-file trains the defaults; it says so first, and where the configs are."""
    result = _cli("OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "TRAIN.STEPS", "1")
    assert result.returncode == 0 and result.stdout.startswith("no --config-file: training the defaults of trunksplit/ssl/config.py")
    assert "no --config-file" not in _cli("--config-file", QUICK, "OUTPUT_DIR", str(tmp_path / "quick"), *SMALL, "TRAIN.STEPS", "1").stdout



def test_an_override_in_exponent_form_is_a_value_and_flags_may_come_between_overrides(tmp_path):
    """``OPTIM.WEIGHT_DECAY -1e-4`` reached argparse as a flag it did not know ("unrecognized arguments"),
    never the config, which says what is wrong with the value. Overrides on both sides of a flag are
    read in order; a flag spelt wrong among them is still a usage error."""
    refused = _cli("--config-file", QUICK, "OUTPUT_DIR", str(tmp_path / "refused"), "OPTIM.WEIGHT_DECAY", "-1e-4", "TRAIN.STEPS", "1")
    assert refused.returncode == 2 and "OPTIM.WEIGHT_DECAY and WEIGHT_DECAY_END must be finite numbers >= 0" in refused.stderr
    assert "got -0.0001" in refused.stderr and not (tmp_path / "refused").exists()
    result = _cli("OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "--config-file", QUICK, "OPTIM.LR", "-0", "TRAIN.STEPS", "1")
    assert result.returncode == 0 and "no --config-file" not in result.stdout, result.stderr
    assert load_config(str(tmp_path / "run" / "config.yaml")).OPTIM.LR == 0 and "step 1/1" in result.stdout
    with pytest.raises(SystemExit) as stopped:
        _cli("--config-file", QUICK, "TRAIN.STEPS", "1", "--restart")
    assert stopped.value.code == 2

def test_quickstart_cli_writes_finite_metrics(tmp_path):
    out = tmp_path / "run"
    result = _script("--config-file", QUICK, "OUTPUT_DIR", str(out), "TRAIN.STEPS", "3", *SMALL)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["images_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and r["lr"] > 0
    assert load_config(str(out / "config.yaml")).TRAIN.STEPS == 3  # the resolved config, loadable
    assert "without checkpointing" in result.stdout and "images/s" in result.stdout
    assert (out / "checkpoint.pt").exists()
    # the plan is said before the first step: profiling announced, then the plan and its predicted peak,
    # the trunk's part of the step the run then measures
    lines = result.stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("trunk plan: balanced, 4 segments, predicted trunk peak "))
    assert lines[said - 1].startswith("planning the trunk") and lines[said + 1].startswith("step 1/3"), lines[:said + 2]
    predicted = float(lines[said].split("predicted trunk peak ")[1].split(" MiB")[0]) * 2**20
    assert 0.8 * rows[0]["peak_memory_bytes"] <= predicted <= rows[0]["peak_memory_bytes"], (predicted, rows[0]["peak_memory_bytes"])
    # SimCLR's chance level, by hand: each of the 2 x batch views picks its partner among all the others
    chance = math.log(2 * int(SMALL[SMALL.index("TRAIN.BATCH_SIZE_PER_RANK") + 1]) - 1)
    assert f"loss {rows[-1]['loss']:.4f} ({rows[-1]['loss'] / chance:.2f} of {chance:.4f}, the loss of a model that learned nothing)" in result.stdout


@pytest.mark.slow  # 5-17 s; its parts in the fast suite: a failed fetch (test_data.py), one rank of two (below), the resume
def test_a_schedulers_sigterm_stops_the_run_after_its_step_saved_and_no_process_prints_a_traceback(tmp_path):
    """A scheduler's SIGTERM (SLURM's preemption) reaches every process of the job, the loader's workers
    too: torch's loader raised that a worker was killed, and nothing was saved. The run now finishes the
    step it is in, saves it (read back here by torch.load: the step of the last metrics row, though
    TRAIN.CHECKPOINT_EVERY is far off), says so, and exits as a shell reports the signal. Ctrl-C takes
    the same path (its workers: tests/ssl/test_data.py; one rank of two: below)."""
    signum = signal.SIGTERM
    out = tmp_path / "run"
    args = ["--config-file", QUICK, "OUTPUT_DIR", str(out), *SMALL, "DATA.NUM_WORKERS", "1", "TRAIN.STEPS", "100000", "TRAIN.CHECKPOINT_EVERY", "1000"]
    run = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group: the job's processes
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    os.killpg(run.pid, signum)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 128 + signum, err
    saved, logged = torch.load(out / "checkpoint.pt", weights_only=True)["step"], json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert saved == logged >= 3, (saved, logged)
    assert f"{signal.Signals(signum).name}: stopping once this step is done and saved" in err
    assert (f"interrupted: {out / 'checkpoint.pt'} holds step {saved}; add --resume to continue from it, or --resume TRAIN.STEPS {saved} "
            "to write its trunk's weights (trunk.pt) as they are, without training on") in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    from trunksplit.ssl.stopping import interrupted_note  # a run stopped before its first checkpoint

    assert "holds nothing to resume, and the same command starts afresh" in interrupted_note(str(tmp_path / "new"), 10)


def _stopped_on_one_rank(rank, world_size, out):
    """Rank 1 alone receives SIGINT, in its second step (as torchrun passes a signal on to each rank
    in turn): both ranks must stop after that step, with one checkpoint of it."""
    update, updates = loop._optimizer_step, []

    def update_then_signal(*args):
        updates.append(update(*args))
        if rank == 1 and len(updates) == 2:
            signal.raise_signal(signal.SIGINT)

    loop._optimizer_step = update_then_signal  # this spawned process's copy of the loop
    with pytest.raises(Stopped) as stopped:
        train(load_config(QUICK, ["OUTPUT_DIR", out, "TRAIN.STEPS", "6", "TRAIN.CHECKPOINT_EVERY", "1000", *SMALL]))
    assert (stopped.value.step, stopped.value.signum) == (2, signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handler is gone with it
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 2


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Without agreement, the signalled rank left and the other failed in the next collective (gloo's
    'Connection closed by peer'), where torchrun's Ctrl-C had reached it a moment later."""
    run_processes(_stopped_on_one_rank, 2, (str(tmp_path),))


@pytest.mark.slow
def test_ctrl_c_to_torchrun_stops_both_ranks_after_the_same_step_saved(tmp_path):
    """What a terminal's Ctrl-C does: SIGINT to torchrun's group, which torchrun passes on to each
    rank (they run in sessions of their own). Rank 0 printed gloo's 'Connection closed by peer'
    traceback, where rank 1 had left first, and nothing was saved past the last periodic checkpoint."""
    out = tmp_path / "run"
    args = ["--config-file", QUICK, "OUTPUT_DIR", str(out), *SMALL, "TRAIN.STEPS", "100000", "TRAIN.CHECKPOINT_EVERY", "1000"]
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "tools", "train.py"),
                            *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and run.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    said, _ = run.communicate(timeout=120)
    saved, logged = torch.load(out / "checkpoint.pt", weights_only=True)["step"], json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert saved == logged >= 3, (saved, logged, said)
    assert said.count(f"interrupted: {out / 'checkpoint.pt'} holds step {saved}; add --resume to continue from it, or --resume TRAIN.STEPS {saved} "
                       "to write its trunk's weights (trunk.pt) as they are, without training on") == 1, said
    assert "[rank" not in said and "Connection closed" not in said, said  # torchrun's own SignalException is torchrun's


def test_a_second_signal_stops_at_once_and_the_handlers_before_the_run_come_back():
    """The first signal only asks (the run finishes its step); the second raises where it lands, as
    Ctrl-C does without trunksplit, for a step that does not end (a hung collective, a slow loader)."""
    with stop_between_steps(say=False) as signals:
        signal.raise_signal(signal.SIGTERM)
        assert signals.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            time.sleep(1)  # a signal's Python handler runs between bytecodes: here at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


WITHOUT_HANG_UP = """
import signal
del signal.SIGHUP, signal.SIGCHLD  # as on Windows
import trunksplit.ssl.loop  # the launcher, all of it
from trunksplit.ssl.stopping import ignore_interrupts, stop_between_steps
with stop_between_steps(say=False) as signals:
    signal.raise_signal(signal.SIGTERM)
assert signals.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
ignore_interrupts(0)  # a loader worker's set-up
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
print("stopped by", signals.signum)
"""


def test_the_launcher_imports_and_stops_on_a_platform_without_hang_up_or_child_signals():
    """Windows has no SIGHUP and no SIGCHLD: importing the launcher failed there (AttributeError), before
    any step. Where they are missing, SIGINT and SIGTERM still stop a run between steps."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_HANG_UP], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and f"stopped by {int(signal.SIGTERM)}" in done.stdout, done.stderr[-2000:]


def test_a_hang_up_asks_the_run_to_stop_once_and_the_gone_terminal_takes_every_later_write():
    """An ssh connection dropped: SIGHUP ended the run where it was, unsaved past its last periodic
    checkpoint. Now it asks the run to stop, as SIGTERM does. A write to a hung-up terminal fails (EIO):
    the stopping step's progress bar or its last print would raise before the save, so the descriptors
    that were the terminal now go to /dev/null. A second SIGHUP (a shell passes its own on to its jobs)
    does not stop the run at once; Ctrl-C still does."""
    master, slave = pty.openpty()
    os.close(master)  # the terminal hangs up
    with pytest.raises(OSError) as gone:
        os.write(slave, b"step 3/30")
    assert gone.value.errno == errno.EIO
    signals, watching = StopSignals(say=True, terminal=[slave]), signal.getsignal(signal.SIGCHLD)
    try:  # the handler stops watching the loader's workers (SIGCHLD): this worker's own loaders' handler comes back
        signals.handle(signal.SIGHUP, None)
        signals.handle(signal.SIGHUP, None)
        assert signals.signum == signal.SIGHUP and os.write(slave, b"step 3/30") == 9
        with pytest.raises(KeyboardInterrupt):
            signals.handle(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGCHLD, watching if watching is not None else signal.SIG_DFL)
        os.close(slave)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (nohup would have it ignored: kept so)
    try:
        with stop_between_steps(say=False) as signals:
            signal.raise_signal(signal.SIGHUP)
            assert signals.signum == signal.SIGHUP
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.slow  # 6-10 s; its parts in the fast suite: above, and the loader's workers (test_data.py)
def test_a_run_whose_terminal_hangs_up_stops_after_its_step_saved(tmp_path):
    """The launcher on a pseudo-terminal (its progress bar on) that hangs up mid-run, then SIGHUP to its
    group twice, as the kernel and then the shell send it: the run, its loader's worker too, ends after
    the step it was in, saved, and exits as a shell reports SIGHUP. Before, SIGHUP killed it unsaved."""
    out = tmp_path / "run"
    args = ["--config-file", QUICK, "OUTPUT_DIR", str(out), *SMALL, "DATA.NUM_WORKERS", "1", "TRAIN.STEPS", "100000", "TRAIN.CHECKPOINT_EVERY", "1000"]
    master, slave = pty.openpty()
    run = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "train.py"), *args], cwd=ROOT, stdin=slave, stdout=slave,
                           stderr=slave, start_new_session=True)
    os.close(slave)
    metrics, deadline, said = out / "metrics.jsonl", time.monotonic() + 120, b""
    while time.monotonic() < deadline and run.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if select.select([master], [], [], 0.1)[0]:  # read what it writes, or a full terminal would block it
            said += os.read(master, 65536)
    assert b"\r" in said, said  # the progress bar's redraws: it wrote to a terminal
    os.close(master)  # the hang-up: from here every write to the terminal fails
    os.killpg(run.pid, signal.SIGHUP)
    os.killpg(run.pid, signal.SIGHUP)
    assert run.wait(timeout=60) == 128 + signal.SIGHUP
    saved, logged = torch.load(out / "checkpoint.pt", weights_only=True)["step"], json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert saved == logged >= 3, (saved, logged)


def test_a_signal_ignored_as_the_run_began_stays_ignored_and_sigterm_still_stops_it(tmp_path, monkeypatch):
    """``python tools/train.py ... &`` in a script (a shell without job control) starts the run with SIGINT
    ignored, so that a Ctrl-C meant for the script's foreground command does not reach it. The run took
    SIGINT over and stopped at that Ctrl-C; now it trains on, as Python leaves such a process alone."""
    update, updates = loop._optimizer_step, []

    def update_then_interrupt(*args):
        updates.append(update(*args))
        if len(updates) == 2:
            signal.raise_signal(signal.SIGINT)  # the script's Ctrl-C reaches its whole process group

    monkeypatch.setattr(loop, "_optimizer_step", update_then_interrupt)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        try:
            train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.STEPS", "3", *SMALL]))
        except Stopped as stopped:  # a KeyboardInterrupt: uncaught, it would end the test session
            pytest.fail(f"the ignored SIGINT stopped the run: {stopped}")
        assert len(updates) == 3 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 3
        with stop_between_steps(say=False) as signals:  # a scheduler's SIGTERM still asks such a run to stop
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
            assert signals.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_child_that_ends_as_the_run_stops_is_no_error(monkeypatch):
    """SIGTERM reaches a job's every process: a loader worker's SIGCHLD can be pending as the stop
    signal's handler stops watching the workers. Python found no handler for it then, and printed
    "Signal 17 ignored due to race condition" as an error (seen in a run stopped in its kNN evaluation)."""
    errors = []
    monkeypatch.setattr(sys, "unraisablehook", errors.append)
    before = signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, as torch's loader installs
    try:
        with stop_between_steps(say=False) as signals:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGCHLD])
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGCHLD)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGCHLD])  # both pending: SIGTERM's handled first
            time.sleep(0.1)
            assert signals.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert errors == [], [str(e.exc_value) for e in errors]


def test_the_side_by_side_line_says_why_it_reads_below_a_step_that_holds_a_teacher():
    """Both copies run the student under a stand-in loss; DINO's step also holds its loss and teacher
    (the run says what its step holds: below, vissl's all-reduce on two ranks)."""
    line_of, mib = _train_tool()._side_by_side, 2**20
    vs = {"checkpointed": 100 * mib, "plain": 200 * mib}
    plain_line = "memory, one step side by side: checkpointed 100.0 MiB, without checkpointing 200.0 MiB (0.50x)"
    assert line_of(vs, "", 100 * mib, ["the method's loss"]) == plain_line  # SimCLR's: the same step
    assert line_of(vs, "", 110 * mib, ["the method's loss", "DINO's teacher"]) == plain_line + (
        " (the student alone under a stand-in loss: the step peak above also holds the method's loss and DINO's teacher)")


def _two_rank_run(rank, world_size, out, manual):
    overrides = ["OUTPUT_DIR", out, "TRAIN.STEPS", "2", *SMALL, *ANY_WIDTH]  # full width: its gradients, flattened at once by vissl's all-reduce, make the peak
    if manual:
        overrides += ["DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True", "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT", "True"]
    model, last = train(load_config(QUICK, overrides))
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    if rank == 0:
        gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        torch.save({"last": last, "gradient_bytes": gradients}, os.path.join(out, "last.pt"))


def _ddp_gradients(rank, world_size, out):
    from trunksplit.ssl.model import build_model

    cfg = load_config(QUICK, ["OUTPUT_DIR", out, *SMALL])
    wrapped = strategy.strategy_for(cfg, rank, world_size, torch.device("cpu")).wrap(cfg, build_model(cfg))
    sum(o.pow(2).mean() for o in wrapped([torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)])).backward()
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(grads) > 20 and len(storages) <= len(grads) // 10, (len(grads), len(storages))
    # DDP makes its buckets anew as the second step starts, the first ones freed before: no step holds both
    first = [StorageWeakRef(g.untyped_storage()) for g in grads]
    del grads
    alive_at_forward = []
    wrapped.module.register_forward_pre_hook(lambda module, args: alive_at_forward.append(sum(not ref.expired() for ref in first)))
    meter = strategy.strategy_for(cfg, rank, world_size, torch.device("cpu")).meter
    peaks = []
    for _ in range(2):
        for p in wrapped.parameters():
            p.grad = None  # zero_grad()
        with meter(wrapped) as mem:
            sum(o.pow(2).mean() for o in wrapped([torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)])).backward()
        peaks.append(mem.peak_bytes)
    assert alive_at_forward == [0, 0], alive_at_forward
    assert peaks[0] == peaks[1], peaks  # the launcher's meter: the new buckets are not the second step's


def _ddp_kept_gradients(rank, world_size, out):
    from trunksplit.ssl.model import build_model

    cfg = load_config(QUICK, ["OUTPUT_DIR", out, *SMALL, "TRAIN.GRADIENTS", "kept"])
    model = build_model(cfg)
    wrapped = strategy.strategy_for(cfg, rank, world_size, torch.device("cpu")).wrap(cfg, model)
    trained = [p for p in wrapped.parameters() if p.requires_grad]
    assert all(p.grad is not None and not p.grad.any() for p in trained)
    storages = {p.grad.untyped_storage().data_ptr() for p in trained}
    assert len(storages) <= len(trained) // 10, (len(trained), len(storages))


def test_kept_gradients_under_native_ddp_are_its_buckets_from_the_wrap_on(tmp_path):
    """TRAIN.GRADIENTS kept: zeros made before DDP wraps the model, which makes them views into its
    buckets at once; made after (as before), the first step held them beside the buckets until its
    synced backward copied them in."""
    run_processes(_ddp_kept_gradients, 2, (str(tmp_path),))


def test_native_ddp_keeps_one_copy_of_the_gradients_in_its_buckets(tmp_path):
    """``gradient_as_bucket_view``: each gradient a view into DDP's all-reduce buckets (a handful of
    storages), where a gradient per parameter beside its bucket copy held them twice; DDP's second
    step makes them anew, freeing the first ones before (the CPU meter once counted them as that step's)."""
    run_processes(_ddp_gradients, 2, (str(tmp_path),))


@pytest.mark.parametrize("manual", [False, True], ids=["native_ddp", "manual_ddp"])
def test_two_processes_end_with_identical_weights_equal_to_the_saved_ones(tmp_path, manual):
    run_processes(_two_rank_run, 2, (str(tmp_path), manual))
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    initial = load_config(QUICK, [*SMALL, *ANY_WIDTH])  # weights moved away from a fresh init
    for name, value in saved.items():
        assert torch.equal(ranks[0][name], value) and torch.equal(ranks[1][name], value), name
    assert any(not torch.equal(v, ranks[0][k]) for k, v in _fresh_state(initial).items() if v.is_floating_point())
    # the run's last line: its step holds more than the side-by-side copies, and says what (vissl's all-reduce
    # flattens every gradient at once beside them: 0.95 of their bytes more, measured; native DDP's step: none)
    run = torch.load(tmp_path / "last.pt", weights_only=False)
    last, extra = run["last"], run["last"]["peak_memory_bytes"] - run["last"]["memory_vs_plain"]["checkpointed"]
    assert ("vissl's all-reduce (every gradient flattened at once)" in last["step_also_holds"]) == manual
    assert (extra >= 0.9 * run["gradient_bytes"]) == manual, (extra, run["gradient_bytes"])
    if not manual:  # resumed on one process: said, with what changes (the batch, the scaled rate, the random streams)
        with pytest.warns(UserWarning, match=r"saved by 2 processes and resumes on 1: each step's batch is 1 x TRAIN.BATCH_SIZE_PER_RANK where it was 2 x \(and OPTIM.LR with it"), \
                pytest.warns(UserWarning, match=r"TRAIN.STEPS \(2 then, 3 now\) changed"), \
                pytest.warns(UserWarning, match=r"TRAIN.GRADIENTS \(kept then, allocated now\) changed .* the trunk plans again"):  # DDP kept them
            _, resumed = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path), "TRAIN.STEPS", "3", *SMALL, *ANY_WIDTH]), resume=True)
        assert resumed["step"] == 3 and math.isfinite(resumed["loss"])


def _fresh_state(cfg):
    from trunksplit.ssl.model import build_model

    torch.manual_seed(cfg.SEED)
    return build_model(cfg).state_dict()


def _interrupt_at_step_3(cfg, monkeypatch):
    """Train as ``cfg`` says until step 3 begins, then stop as a killed run would."""
    real = loop.set_schedules  # called as each step begins

    def interrupt(cfg, optimizer, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(cfg, optimizer, step)

    monkeypatch.setattr(loop, "set_schedules", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(loop, "set_schedules", real)


DINO_SMALL = ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]",
              "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "OPTIM.NAME", "adamw", "OPTIM.LR", "0.001", "OPTIM.WEIGHT_DECAY_END", "0.4"]


# SwAV's queue: 8 embeddings of each large crop, full after the two steps saved, used by the two resumed
SWAV_QUEUE = ["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "16", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]",
              "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "METHOD.SWAV.QUEUE_LENGTH", "8"]


@pytest.mark.parametrize("method", ["simclr", pytest.param("dino", marks=pytest.mark.slow), "dino_in_backward", "swav_queue"])  # dino: dino_in_backward resumes its teacher and centre too
def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path, monkeypatch, method):
    # DINO: the EMA teacher, the centre and AdamW's state resume too (stepped in backward as well); SwAV its queue
    overrides = ["TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", *SMALL, *(DINO_SMALL if method.startswith("dino") else []),
                 *(SWAV_QUEUE if method == "swav_queue" else []), *(["OPTIM.IN_BACKWARD", "True"] if method.endswith("in_backward") else [])]
    straight, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides]))

    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides])
    _interrupt_at_step_3(cfg, monkeypatch)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 2
    resumed, last = train(cfg, resume=True)

    assert not method.startswith("dino") or {"center", "teacher.head.last_layer"} <= set(straight.state_dict())
    assert method != "swav_queue" or bool(straight.queue[:, -1].any())
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and last["step"] == 4


@pytest.mark.parametrize("saved, resumed", [(False, True), pytest.param(True, False, marks=pytest.mark.slow)])  # slow: DINO's way back
def test_a_run_resumed_with_its_optimizer_stepped_in_backward_or_no_longer_trains_the_uninterrupted_weights(tmp_path, monkeypatch, saved, resumed):
    """OPTIM.IN_BACKWARD changed on --resume (a run moved to a smaller GPU steps in backward) plans the trunk
    again and warns of nothing else: the optimizer's state carries over, and the weights are the
    uninterrupted run's, bit for bit (SimCLR into stepping in backward; DINO, teacher and all, out of it)."""
    overrides = ["TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", *SMALL, *([] if resumed else DINO_SMALL)]
    straight, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides, "OPTIM.IN_BACKWARD", str(saved)]))
    _interrupt_at_step_3(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides, "OPTIM.IN_BACKWARD", str(saved)]), monkeypatch)
    with pytest.warns(UserWarning) as said:
        moved, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides, "OPTIM.IN_BACKWARD", str(resumed)]), resume=True)
    resume_warnings = [str(w.message) for w in said if str(w.message).startswith("--resume")]
    assert resume_warnings == [f"--resume: OPTIM.IN_BACKWARD ({saved} then, {resumed} now) changed since {tmp_path / 'b' / 'checkpoint.pt'} "
                               "was saved: the trunk plans again for the new settings"], resume_warnings
    for (name, a), (_, b) in zip(straight.state_dict().items(), moved.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_run_stopped_by_a_signal_resumes_to_the_uninterrupted_runs_weights(tmp_path, monkeypatch):
    """The checkpoint a stop writes between two steps (none periodic here) is the state a run of
    those steps ends in: resumed, the run ends where one never stopped does, bit for bit."""
    overrides = ["TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "1000", *SMALL]
    straight, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides]))
    cfg, update, updates = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides]), loop._optimizer_step, []

    def update_then_signal(*args):
        updates.append(update(*args))
        if len(updates) == 2:
            signal.raise_signal(signal.SIGTERM)  # in the second step: a scheduler's preemption

    monkeypatch.setattr(loop, "_optimizer_step", update_then_signal)
    with pytest.raises(Stopped):
        train(cfg)
    monkeypatch.setattr(loop, "_optimizer_step", update)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 2
    resumed, _ = train(cfg, resume=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", [
    ["OPTIM.NAME", "sgd"],
    ["OPTIM.NAME", "lars", "OPTIM.EXCLUDE_BIAS_AND_NORM", "True"],
    ["OPTIM.NAME", "adamw", "OPTIM.LR", "0.001", "OPTIM.WEIGHT_DECAY", "0.04", "OPTIM.WEIGHT_DECAY_END", "0.4"],
    pytest.param(DINO_SMALL, marks=pytest.mark.slow),  # the dino_in_backward resume and test_dino's in_backward run train DINO so in the fast suite
], ids=["sgd", "lars", "adamw", "dino"])
def test_a_run_stepped_in_backward_trains_the_standard_runs_weights_in_less_memory(tmp_path, recipe):
    """Bit for bit in one process (the DINO teacher's EMA follows the update), and the step's
    peak lower: gradients are never all alive at once."""
    runs = {}
    for how in ("standard", "in_backward"):
        # the whole step both ways (DINO's): there each gradient is freed at its update; backward by crop group, both ways hold
        # every gradient until the last group's backward (tests/ssl/test_grouped.py compares the two steps stepped in backward)
        overrides = ["OUTPUT_DIR", str(tmp_path / how), "TRAIN.STEPS", "3", *SMALL, *recipe, "OPTIM.IN_BACKWARD", str(how == "in_backward"),
                     "TRAIN.BACKWARD_BY_CROP_GROUP", "False"]
        runs[how] = train(load_config(QUICK, overrides))
    (standard, standard_row), (stepped, stepped_row) = runs["standard"], runs["in_backward"]
    for (name, a), (_, b) in zip(standard.state_dict().items(), stepped.state_dict().items()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in stepped.parameters())
    assert stepped_row["peak_memory_bytes"] < standard_row["peak_memory_bytes"]
    checkpointed, plain = stepped_row["memory_vs_plain"]["checkpointed"], stepped_row["memory_vs_plain"]["plain"]
    assert checkpointed < plain and checkpointed <= 1.05 * stepped_row["peak_memory_bytes"]  # the copies stepped in backward too


def test_the_side_by_side_step_is_left_out_where_it_could_fail_and_the_line_says_why():
    """A fitted batch (TRAIN.MEMORY_LIMIT) would pass the limit with a plain step; under FSDP2 on a GPU a
    rank out of memory for it would leave the others waiting in a collective (one process, or DDP's rank 0
    alone, only loses the line). A CPU's FSDP2 run steps it (the test above)."""
    mib, limited = 2**20, load_config(QUICK, ["TRAIN.MEMORY_LIMIT", "1GiB"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert side_by_side.not_run_because(load_config(QUICK), strategy.FSDP(0, 2, cpu)) == ""
    assert side_by_side.not_run_because(load_config(QUICK), strategy.DDP(0, 2, cuda)) == ""
    assert side_by_side.not_run_because(load_config(QUICK), strategy.FSDP(0, 2, cuda)).startswith("FSDP2 on a GPU: a rank without room")
    assert side_by_side.not_run_because(limited, strategy.Strategy(0, 1, cpu)) == "TRAIN.MEMORY_LIMIT is set, and a step without checkpointing would pass it"
    assert side_by_side.side_by_side(limited, None, None, [], None, False, strategy.Strategy(0, 1, cpu)) is None  # nothing copied, nothing run
    said = _train_tool()._side_by_side(None, side_by_side.not_run_because(load_config(QUICK), strategy.FSDP(0, 2, cuda)), 100 * mib, [])
    assert said == ("memory, one step side by side: not run (FSDP2 on a GPU: a rank without room for a step without checkpointing "
                    "would leave the others waiting in a collective)")


def test_the_side_by_side_step_under_autocast_is_the_step_trained(tmp_path):
    """Under bf16 autocast the training step runs backward outside autocast (its weight casts freed as
    their layers' backward ends); the side-by-side copy must too, or it reports autocast's cached casts
    of every weight alive through backward (here about half again the step's peak)."""
    _, last = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path), "TRAIN.STEPS", "2", "TRAIN.LOG_EVERY", "1", "TRAIN.AUTOCAST", "bf16", *SMALL]))
    assert abs(last["memory_vs_plain"]["checkpointed"] / last["peak_memory_bytes"] - 1) < 0.02, (last["memory_vs_plain"], last["peak_memory_bytes"])


def _two_rank_in_backward(rank, world_size, out, in_backward):
    overrides = ["OUTPUT_DIR", out, "TRAIN.STEPS", "3", *SMALL, "OPTIM.NAME", "lars", "OPTIM.IN_BACKWARD", str(in_backward)]
    model, _ = train(load_config(QUICK, overrides))
    torch.save({n: p.detach() for n, p in model.named_parameters()}, os.path.join(out, f"rank{rank}.pt"))


def test_two_ddp_processes_stepped_in_backward_train_the_standard_weights(tmp_path):
    """DDP's communication hook updates each bucket after its all-reduce: within 1e-6 relative of DDP's
    own reduction (which divides after summing, where the hook divides first)."""
    for how in ("standard", "in_backward"):
        (tmp_path / how).mkdir()
        run_processes(_two_rank_in_backward, 2, (str(tmp_path / how), how == "in_backward"))
    standard, stepped = (torch.load(tmp_path / how / "rank0.pt") for how in ("standard", "in_backward"))
    other_rank = torch.load(tmp_path / "in_backward" / "rank1.pt")
    for name, a in standard.items():
        assert (a - stepped[name]).abs().max() <= 1e-6 * a.abs().max().clamp_min(1e-12), name
        assert torch.equal(stepped[name], other_rank[name]), name


def _snapshot(folder):
    return {p: pathlib.Path(folder, p).read_bytes() for p in sorted(os.listdir(folder))} if os.path.isdir(folder) else None


@pytest.mark.parametrize(
    "args,message",
    [
        (["TRAIN.STEPZ", "3"], "unknown config key: TRAIN.STEPZ"),
        (["DATA.PATH", "/nonexistent/images"], "DATA.PATH '/nonexistent/images' is not a directory"),
        (["MODEL.TRUNK.NAME", "resnet9000"], "torchvision has no model 'resnet9000'"),
        # found by planning, said in the config's terms
        (["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.01", *SMALL], "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET 0.01 cannot be met at this "
                                                                           "run's crops: the least the trunk's step reaches is 0."),
        ([*SMALL, "DATA.CROP_SIZES", "[16]", "TRAIN.BATCH_SIZE_PER_RANK", "2", "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.5"],
         "(NUM_ACTIVATION_CHECKPOINTING_SPLITS). No plan saves even 1% of the unsplit step at these crops: remove it (0), or set it to 1; "),  # not "1 or more"
        (["DISTRIBUTED.STRATEGY", "fsdp", *SMALL], "DISTRIBUTED.STRATEGY fsdp shards the model across processes: run under torchrun"),
        ([*SMALL, "TRAIN.BATCH_SIZE_PER_RANK", "1"], "SimCLR needs at least 2 images a step, all ranks together"),  # its loss: see below
        ([*SMALL, "DATA.NUM_IMAGES", "6", "TRAIN.BATCH_SIZE_PER_RANK", "8"], "TRAIN.BATCH_SIZE_PER_RANK 8 x 1 rank is 8 images a step, more than the "
                                                                             "data set holds (DATA.NUM_IMAGES 6): a step would hold an image more than "
                                                                             "once (SimCLR would take its copies for different images). Set "
                                                                             "TRAIN.BATCH_SIZE_PER_RANK 6 or less"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "run"
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not out.exists()


def test_a_budget_the_trunk_cannot_meet_names_the_config_values_that_can(tmp_path):
    """Refused in the config's terms, and its advice holds: the budget it names trains (a hundredth less
    is refused too), and so does the one refused, with the gradients kept out of the step as it says.
    ``trunksplit plan --config-file`` refuses it in the same words, before a run."""
    # 8 images: the trunk's floor 0.98 of its step with the gradients in it (ResNet-18 at 32px is mostly gradients)
    overrides = ["OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "TRAIN.BATCH_SIZE_PER_RANK", "8", "TRAIN.STEPS", "1"]
    budget = "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET"
    with pytest.raises(ValueError, match=r"MEMORY_BUDGET 0.6 cannot be met .* Set it to \S+ or more; .* TRAIN.GRADIENTS kept") as refused:
        train(load_config(QUICK, [*overrides, budget, "0.6"]))
    named = float(re.search(r"Set it to (\S+) or more", str(refused.value)).group(1))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert cli_main(["plan", "--config-file", QUICK, *overrides[2:], budget, "0.6"]) == 2
    assert f"error: {refused.value}" in err.getvalue()
    with pytest.raises(ValueError, match="cannot be met"):  # the least it names, to the hundredth
        train(load_config(QUICK, [*overrides, budget, f"{named - 0.01:g}"]))
    model, _ = train(load_config(QUICK, [*overrides, budget, str(named)]))
    assert 0.6 < named < 1 and model.trunk.plan.strategy == "budget"
    model, _ = train(load_config(QUICK, [*overrides, "OUTPUT_DIR", str(tmp_path / "kept"), budget, "0.6", "TRAIN.GRADIENTS", "kept"]))
    assert model.trunk.plan.strategy == "budget"


@pytest.mark.parametrize("autocast", ["", "bf16"])  # bf16 on a CPU: its convolution probe runs the crops first
def test_a_crop_size_the_trunk_cannot_run_is_refused_in_the_configs_terms_before_anything_is_written(tmp_path, autocast):
    """A ViT cuts whole patches: 24px crops of a 16px-patch ViT are refused as the run starts, naming the
    size and the key, rather than deep inside the first step's trunk call."""
    out = tmp_path / "run"
    overrides = ["OUTPUT_DIR", str(out), *SMALL, "MODEL.TRUNK.NAME", "vit_s_16", *ANY_WIDTH, "METHOD.NAME", "dino", "DATA.CROP_SIZES", "[32, 24]",
                 "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "TRAIN.AUTOCAST", autocast]
    with pytest.raises(ValueError, match=re.escape("MODEL.TRUNK.NAME vit_s_16 cannot run the 24px crops of DATA.CROP_SIZES [32, 24]: "
                                                   "this ViT cuts 16x16 patches")):
        train(load_config(QUICK, overrides))
    assert not out.exists()


def test_a_last_feature_the_head_cannot_take_is_refused_naming_it(tmp_path):
    """A ViT's encoder output is tokens (1, 5, 384 at 32 px): the head was built for 5 inputs and the first
    step failed in a matrix product. Refused as the model is built; a feature map (res5) is averaged, and trains."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape("MODEL.TRUNK.OUT_FEAT_KEYS: the head takes the last feature, encoder, of shape (1, 5, 384)")):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), *SMALL, "MODEL.TRUNK.NAME", "vit_s_16", *ANY_WIDTH, "MODEL.TRUNK.OUT_FEAT_KEYS", "[encoder]"]))
    assert not out.exists()
    model, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(out), *SMALL, "TRAIN.STEPS", "1", "MODEL.TRUNK.OUT_FEAT_KEYS", "[res4, res5]"]))
    assert model.head[0].in_features == 128  # res5 channels of SMALL's ResNet-18, a quarter of 512


def test_a_timm_trunk_trains_on_its_pooled_features_with_the_default_feature_key(tmp_path):
    """``MODEL.TRUNK.NAME timm:NAME`` with ``OUT_FEAT_KEYS [flatten]`` (the default): the head takes
    the model's pooled features, as timm's own ``forward_head(..., pre_logits=True)`` gives them, not
    its classifier's logits (before: refused, 'unknown feature key(s) ['flatten']')."""
    timm = pytest.importorskip("timm")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name in ("convnext_atto", "vit_tiny_patch16_224"):  # the ViT's patch embedding has an op named flatten
        cfg_args = ["OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "MODEL.TRUNK.NAME", f"timm:{name}", *ANY_WIDTH, "TRAIN.STEPS", "1"]
        trunk = build_trunk(load_config(QUICK, cfg_args))
        reference = timm.create_model(name, pretrained=False, img_size=32) if "vit" in name else timm.create_model(name, pretrained=False)
        reference.load_state_dict(trunk.model_state_dict(reference))  # its classifier kept: loaded from the trunk's weights
        with torch.no_grad():
            pooled = reference.eval().forward_head(reference.forward_features(x), pre_logits=True)
            assert torch.equal(trunk.eval()(x)[-1], pooled), name
    # the fit's trunk too (before: refused as above), its batch found for a memory size
    fitted = ["OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "MODEL.TRUNK.NAME", "timm:convnext_atto", *ANY_WIDTH, "TRAIN.STEPS", "1",
              "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", "60MiB", "DATA.NUM_IMAGES", "512"]
    model, last = train(load_config(QUICK, fitted))
    assert model.head[0].in_features == 320 and math.isfinite(last["loss"])  # ConvNeXt-atto's pooled width


def test_simclrs_loss_of_one_image_is_zero_with_no_gradient_so_one_image_a_step_is_refused():
    """Hand-computed: with one image, each view's only other view is its partner (softmax over one logit)."""
    z1, z2 = torch.randn(1, 8, requires_grad=True), torch.randn(1, 8, requires_grad=True)
    loss = loop.nt_xent(z1, z2, 0.1)
    loss.backward()
    assert loss.item() == 0 and not z1.grad.any() and not z2.grad.any()
    assert loop.nt_xent(torch.randn(2, 8), torch.randn(2, 8), 0.1).item() > 0  # two images: a negative each


@pytest.mark.parametrize(
    "args,message",
    [
        (["DATA.CROP_SCALES", "[[1.0, 0.3]]"], "DATA.CROP_SCALES: each entry is [smallest, largest]"),
        (["DATA.CROP_SCALES", "[[0.0, 5.0]]"], "DATA.CROP_SCALES: each entry is [smallest, largest]"),
        (["METHOD.NAME", "swav", "DATA.CROP_COUNTS", "[1]"], "SwAV predicts one crop's code from another"),
        (["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "0"], "METHOD.NUM_PROTOTYPES must be >= 1"),
        (["MODEL.HEAD.HIDDEN_DIM", "0"], "MODEL.HEAD.HIDDEN_DIM must be >= 1"),
        (["METHOD.TEMPERATURE", "0"], "METHOD.TEMPERATURE must be a positive number"),
        (["DISTRIBUTED.STRATEGY", "fsdp", "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True"], "MANUAL_GRADIENT_REDUCTION is DDP-only"),
        (["DISTRIBUTED.STRATEGY", "fsdp", "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT", "True"], "cannot run under FSDP"),
        (["DISTRIBUTED.STRATEGY", "zero3"], "DISTRIBUTED.STRATEGY must be ddp or fsdp"),
        (["DATA.NUM_WORKERS", "-2"], "DATA.NUM_WORKERS must be >= 0"),
        (["OPTIM.WEIGHT_DECAY_END", "nan"], "WEIGHT_DECAY_END must be finite numbers >= 0"),
        (["OPTIM.WEIGHT_DECAY_END", "abc"], "WEIGHT_DECAY_END must be finite numbers >= 0"),
        (["OPTIM.WEIGHT_DECAY_END", "[0.4]"], "WEIGHT_DECAY_END must be finite numbers >= 0"),
        (["OPTIM.WEIGHT_DECAY_END", "float('inf')"], "WEIGHT_DECAY_END must be finite numbers >= 0"),
        (["OPTIM.NAME", "adamw", "OPTIM.BETAS", "[0.9]"], "OPTIM.BETAS are AdamW's two coefficients"),
        (["OPTIM.NAME", "adamw", "OPTIM.BETAS", "[0.9, 1.5]"], "OPTIM.BETAS are AdamW's two coefficients"),
        (["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "1.5"], "neither a fraction in (0, 1] nor a whole number of bytes"),
        (["OPTIM.IN_BACKWARD", "True", "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True"], "OPTIM.IN_BACKWARD True cannot train with DISTRIBUTED.MANUAL_GRADIENT_REDUCTION True"),
        (["OPTIM.IN_BACKWARD", "True", "TRAIN.AUTOCAST", "fp16"], "OPTIM.IN_BACKWARD True cannot train with TRAIN.AUTOCAST fp16"),
        (["OPTIM.IN_BACKWARD", "True", "TRAIN.GRADIENTS", "kept"], "OPTIM.IN_BACKWARD True cannot train with TRAIN.GRADIENTS kept"),
        (["OPTIM.IN_BACKWARD", "True", "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT", "True"], "cannot train with MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT True"),
        # every key is checked for its type by name (yacs lets None through)
        (["EVAL.KNN.K", "None"], "EVAL.KNN.K must be a whole number (default 20), got None"),
        (["EVAL.KNN.EVERY_STEPS", "None"], "EVAL.KNN.EVERY_STEPS must be a whole number (default 0), got None"),
        (["OPTIM.LR", "None"], "OPTIM.LR must be a number (default 0.3), got None"),
        (["OPTIM.IN_BACKWARD", "None"], "OPTIM.IN_BACKWARD must be True or False (default False), got None"),
        (["DATA.CROP_SIZES", "None"], "DATA.CROP_SIZES must be a list"),
        (["DATA.CROP_SIZES", "[64, big]"], "DATA.CROP_SIZES: each item must be a whole number (default [64]), got [64, 'big']"),
        (["DATA.CROP_SCALES", "[0.2, 1.0]"], "DATA.CROP_SCALES: each item must be a list (default [[0.3, 1.0]]), got [0.2, 1.0]"),
        (["MODEL.TRUNK.OUT_FEAT_KEYS", "[4]"], "MODEL.TRUNK.OUT_FEAT_KEYS: each item must be text"),
        (["MODEL.TRUNK.OUT_FEAT_KEYS", "[res4"], "MODEL.TRUNK.OUT_FEAT_KEYS takes a list such as [res4, flatten] or one value, got '[res4'"),
        (["TRAIN.DEVICE", "None"], "TRAIN.DEVICE must be text"),
        # the command line's values of another kind, named by key (before: yacs's "Type mismatch (<class 'int'> vs. <class 'str'>)")
        (["TRAIN.STEPS", "five"], "TRAIN.STEPS must be a whole number (default 30), got 'five'"),
        (["TRAIN.STEPS", "2.5"], "TRAIN.STEPS must be a whole number (default 30), got 2.5"),
        (["OPTIM.IN_BACKWARD", "yes"], "OPTIM.IN_BACKWARD must be True or False (default False), got 'yes'"),
        (["OPTIM.LR", "abc"], "OPTIM.LR must be a number (default 0.3), got 'abc'"),
        (["TRAIN.GRADIENTS", "3"], "TRAIN.GRADIENTS must be allocated or kept, got '3'"),  # text: the key's own check
        # a misspelt key, with the one meant
        (["TRAIN.STEP", "5"], "unknown config key: TRAIN.STEP; did you mean TRAIN.STEPS?"),
        (["OPTIMS.LR", "0.1"], "unknown config key: OPTIMS.LR; did you mean OPTIM.LR?"),
    ],
)
def test_values_that_would_train_nonsense_are_refused_when_the_config_loads(args, message):
    """Checked as the config loads, before train() starts, so nothing is written (the CLI cases above show the path)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(QUICK, args)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_checkpoint_on_resume_is_refused_and_nothing_is_touched(tmp_path, damage):
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))  # in-process: the CLI's start-up is tested below
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
    (tmp_path / "images" / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), "DATA.PATH", str(tmp_path / "images"), "TRAIN.STEPS", "2", "DATA.NUM_WORKERS", "0", *SMALL])
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*broken.png"):  # no workers: warned in this process
        _, last = train(cfg)  # 2 steps of 4 images from 7 files: every file is read, the broken one too
    assert math.isfinite(last["loss"]) and last["step"] == 2


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = loop.nt_xent
    calls = []

    def nan_at_step_3(*args):
        calls.append(1)
        loss = real(*args)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "nt_xent", nan_at_step_3)
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.STEPS", "5", "TRAIN.CHECKPOINT_EVERY", "1", *SMALL])
    with pytest.raises(ValueError, match=r"the loss at step 3 is not finite .*checkpoint.pt holds the last good state"):
        train(cfg)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 2 and all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]


STOCHASTIC = ["MODEL.TRUNK.NAME", "efficientnet_b0", "DATA.CROP_SIZES", "[32]", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4",
              "MODEL.HEAD.HIDDEN_DIM", "32", "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2"]


def test_resume_with_stochastic_depth_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """EfficientNet drops blocks at random (stochastic depth 0.2): the checkpoint carries the generators' state."""
    straight, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *STOCHASTIC]))
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *STOCHASTIC])
    _interrupt_at_step_3(cfg, monkeypatch)
    resumed, _ = train(cfg, resume=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def _trained(cfg, interrupt: bool):
    """In a rank of several processes: the model trained as ``cfg`` says, straight, or stopped as
    step 3 begins (as a killed run would be) and resumed."""
    if not interrupt:
        return train(cfg)[0]
    real = loop.set_schedules  # called as each step begins
    loop.set_schedules = lambda c, o, step: (_ for _ in ()).throw(KeyboardInterrupt) if step == 3 else real(c, o, step)
    try:
        train(cfg)
    except KeyboardInterrupt:
        pass
    loop.set_schedules = real
    dist.barrier()
    return train(cfg, resume=True)[0]


def _two_rank_stochastic(rank, world_size, out, interrupt):
    model = _trained(load_config(QUICK, ["OUTPUT_DIR", out, *STOCHASTIC]), interrupt)
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow  # a minute on 2 cores: two processes train 4 steps twice; the 1-process test above is in the fast suite
def test_resume_with_stochastic_depth_under_two_processes_equals_an_uninterrupted_run(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_processes(_two_rank_stochastic, 2, (str(tmp_path / "a"), False))
    run_processes(_two_rank_stochastic, 2, (str(tmp_path / "b"), True))
    straight, resumed = torch.load(tmp_path / "a" / "rank1.pt"), torch.load(tmp_path / "b" / "rank1.pt")
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # fp16 autocast runs slowly on CPU (25 s here); it matters on a GPU
def test_fp16_resume_keeps_the_grad_scaler(tmp_path, monkeypatch):
    overrides = ["TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", "TRAIN.AUTOCAST", "fp16", *SMALL]
    train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides]))
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides])
    _interrupt_at_step_3(cfg, monkeypatch)
    train(cfg, resume=True)
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in "ab")
    assert a["scaler"] == b["scaler"] and a["scaler"]["_growth_tracker"] + (a["scaler"]["scale"] != 65536.0) > 0
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name


def test_resume_tolerates_a_torn_last_metrics_line(tmp_path):
    out = tmp_path / "run"
    base = ["OUTPUT_DIR", str(out), "TRAIN.CHECKPOINT_EVERY", "2", *SMALL]
    train(load_config(QUICK, base + ["TRAIN.STEPS", "2"]))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # killed while writing step 3's row
    with pytest.warns(UserWarning, match=r"TRAIN.STEPS \(2 then, 3 now\) changed"):
        train(load_config(QUICK, base + ["TRAIN.STEPS", "3"]), resume=True)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


def test_a_damaged_metrics_line_before_the_last_names_the_file(tmp_path):
    out = tmp_path / "run"
    base = ["OUTPUT_DIR", str(out), "TRAIN.CHECKPOINT_EVERY", "2", *SMALL]
    train(load_config(QUICK, base + ["TRAIN.STEPS", "2"]))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("garbage\n" + "\n".join(lines) + "\n")
    before = _snapshot(out)
    with pytest.warns(UserWarning, match=r"TRAIN.STEPS \(2 then, 3 now\) changed"), pytest.raises(ValueError, match=r"metrics.jsonl line 1 is not a metrics row"):
        train(load_config(QUICK, base + ["TRAIN.STEPS", "3"]), resume=True)
    assert _snapshot(out) == before


def test_a_new_run_never_overwrites_an_earlier_runs_checkpoint(tmp_path):
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))
    before = _snapshot(out)
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL)
    assert result.returncode == 2 and "--resume" in result.stderr and "another OUTPUT_DIR" in result.stderr
    assert _snapshot(out) == before


def test_interrupted_saves_leave_no_temporary_files(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt.tmp4242").write_bytes(b"x" * 1000)  # a save killed by SIGKILL in an earlier run
    real_save = torch.save

    def disk_full(obj, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_the_first_row_logs_set_up_apart_from_the_step(tmp_path):
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "3", *SMALL]))
    rows = _rows(out)
    assert rows[0]["setup_seconds"] > 0 and all("setup_seconds" not in r for r in rows[1:])
    # the plan is made and the gradients exist before the first step: it measures what the others do
    assert rows[0]["peak_memory_bytes"] == rows[1]["peak_memory_bytes"] == rows[2]["peak_memory_bytes"]


def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "make_config,overrides,message",
    [
        (lambda d: str(d), [], "is a directory"),
        (lambda d: _write(d / "bad.yaml", "TRAIN: [unclosed\n"), [], "is not valid YAML"),
        (lambda d: _write(d / "child.yaml", "_BASE_: missing_base.yaml\n"), [], "missing_base.yaml does not exist"),
        (lambda d: _write(d / "typo.yaml", "TRAIN:\n  STEP: 5\n"), [], "unknown config key in {d}/typo.yaml: TRAIN.STEP; did you mean TRAIN.STEPS?"),
        (lambda d: _write(d / "lower.yaml", "train:\n  steps: 5\n"), [], "unknown config key in {d}/lower.yaml: train; did you mean TRAIN?"),  # keys are upper case
        (None, ["model.trunk.name", "resnet18"], "unknown config key: model.trunk.name; did you mean MODEL.TRUNK.NAME?"),
        (None, ["MODEL.TRUNK.NAME", "get_model"], "torchvision has no model 'get_model'"),
        (None, ["MODEL.TRUNK.NAME", "resnet"], "torchvision has no model 'resnet'; did you mean resnet18 or resnet34 or resnet50 or resnet101 (5 in all)?"),
        (None, ["MODEL.TRUNK.NAME", "regnet_y"], "did you mean regnet_y_8gf or regnet_y_16gf or regnet_y_32gf or regnet_y_128gf (8 in all)?"),  # vissl's: a family
        (None, ["TRAIN.STEPS=3"], "TRAIN.STEPS=3: overrides are KEY VALUE pairs with a space between, as in detectron2: TRAIN.STEPS 3"),
        (None, ["OUTPUT_DIR", "/tmp/a=b", "OPTIM.LR=0.1", "TRAIN.STEPS=3"], "OPTIM.LR=0.1: overrides are KEY VALUE pairs"),  # a value may hold one
        (None, ["TRAIN.STEPS"], "overrides come in KEY VALUE pairs; got an odd count: ['TRAIN.STEPS']"),
        (None, ["TRAIN.LOG_EVERY", "0"], "TRAIN.LOG_EVERY must be >= 1"),
        (None, ["TRAIN.CHECKPOINT_EVERY", "0"], "TRAIN.CHECKPOINT_EVERY must be >= 1"),
        (None, ["DATA.NUM_IMAGES", "0"], "DATA.NUM_IMAGES must be >= 1"),
        (None, ["DISTRIBUTED.BACKEND", "foo"], "DISTRIBUTED.BACKEND must be gloo, nccl"),  # torch's own: an AssertionError in every rank
        (None, ["TRAIN.BATCH_SIZE_PER_RANK", "-2"], "TRAIN.BATCH_SIZE_PER_RANK must be >= 1"),
        (None, ["TRAIN.STEPS", "-3"], "TRAIN.STEPS must be >= 1"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "1.5"], "neither a fraction in (0, 1] nor a whole number of bytes"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "1e400"], "MEMORY_BUDGET must be 0 (off)"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT", "{every_k: 0}"], "every_k must be an integer >= 1"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT", "{name_regex: 'a[b'}"], "not a valid regular expression"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT", "[1, 2]"], "takes a mapping"),
        (None, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT.types", "[3]"], "list of dotted class paths"),
    ],
)
def test_config_mistakes_are_clear_errors(tmp_path, make_config, overrides, message):
    path = make_config(tmp_path) if make_config else QUICK
    with pytest.raises(ValueError) as caught:
        load_config(path, overrides)
    assert message.format(d=tmp_path) in str(caught.value)


def test_a_list_on_the_command_line_is_written_as_in_a_config_file_or_as_one_value(tmp_path):
    """``OUT_FEAT_KEYS [res4, flatten]`` as YAML writes it (yacs alone wants a quoted Python literal), and
    one value for a list of it; each load equals the YAML file's."""
    keys = _write(tmp_path / "keys.yaml", "_BASE_: " + QUICK + "\nMODEL:\n  TRUNK:\n    OUT_FEAT_KEYS: [res4, flatten]\n")
    from_file = load_config(keys).MODEL.TRUNK.OUT_FEAT_KEYS
    assert from_file == ["res4", "flatten"]
    for written in ("[res4, flatten]", "[res4,flatten]", "['res4', 'flatten']", "('res4', 'flatten')"):
        assert load_config(QUICK, ["MODEL.TRUNK.OUT_FEAT_KEYS", written]).MODEL.TRUNK.OUT_FEAT_KEYS == from_file, written
    assert load_config(QUICK, ["MODEL.TRUNK.OUT_FEAT_KEYS", "res5"]).MODEL.TRUNK.OUT_FEAT_KEYS == ["res5"]
    assert load_config(QUICK, ["DATA.AUG.BLUR_PROB", "1e-1"]).DATA.AUG.BLUR_PROB == [0.1]


def test_select_from_the_command_line_equals_select_from_yaml(tmp_path):
    from trunksplit import is_checkpoint_wrapped
    from trunksplit.ssl.model import build_trunk

    base = os.path.join(ROOT, "configs", "simclr_resnet50.yaml")
    yaml_cfg = load_config(os.path.join(ROOT, "configs", "simclr_resnet50_selective.yaml"), ["MODEL.TRUNK.NAME", "resnet50"])
    flow = "{every_k: 2, types: [torchvision.models.resnet.Bottleneck]}"
    one_split = ["MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "1"]
    cli_cfg = load_config(base, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT", flow, *one_split])
    keyed = load_config(base, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT.every_k", "2", "MODEL.ACTIVATION_CHECKPOINTING.SELECT.types",
                                "[torchvision.models.resnet.Bottleneck]", *one_split])
    wrapped = [[n for n, m in build_trunk(c).named_modules() if is_checkpoint_wrapped(m)] for c in (yaml_cfg, cli_cfg, keyed)]
    assert wrapped[0] == wrapped[1] == wrapped[2] and len(wrapped[0]) == 8


def test_a_selective_run_says_which_blocks_checkpoint_themselves(tmp_path):
    """SELECT leaves the trunk one segment: the run's plan line read "vissl, 1 segment", as if nothing were
    checkpointed. Now it names the selected blocks: every second of ResNet-50's 16 bottlenecks (3, 4, 6, 3)."""
    blocks = [f"res{stage}.{i}" for stage, count in ((2, 3), (3, 4), (4, 6), (5, 3)) for i in range(count)]
    _, last = train(load_config(os.path.join(ROOT, "configs", "simclr_resnet50_selective.yaml"), [
        "OUTPUT_DIR", str(tmp_path), "DATA.CROP_SIZES", "[64]", "DATA.IMAGE_SIZE", "64", "TRAIN.BATCH_SIZE_PER_RANK", "2", "TRAIN.STEPS", "1",
        "DATA.NUM_IMAGES", "8", "DATA.NUM_WORKERS", "0"]))
    assert last["plan"] == f"SELECT, 8 blocks each its own checkpoint ({' '.join(blocks[::2])})"


def test_select_with_a_budget_says_which_wins():
    with pytest.warns(UserWarning, match=r"SELECT wins.*MEMORY_BUDGET 0.5 is ignored"):
        load_config(QUICK, ["MODEL.ACTIVATION_CHECKPOINTING.SELECT", "{every_k: 2}", "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.5"])


@pytest.mark.parametrize(
    "setup,overrides,message",
    [
        (lambda d: None, ["TRAIN.DEVICE", "cuda"] if not torch.cuda.is_available() else ["TRAIN.DEVICE", "cuda:99"], "TRAIN.DEVICE"),
        (lambda d: None, ["TRAIN.DEVICE", "potato"], "not a device"),
        pytest.param(lambda d: None, ["TRAIN.DEVICE", "mps"], "TRAIN.DEVICE mps: torch has no usable mps device on this machine; use cpu",
                     marks=pytest.mark.skipif(torch.mps.is_available(), reason="this machine has an Apple GPU")),
        (lambda d: (d / "afile").write_text("x"), ["OUTPUT_DIR", "{d}/afile/run"], "is a file"),
        (lambda d: (d / "empty").mkdir(), ["DATA.PATH", "{d}/empty"], "holds no images"),
        # a directory no process may write in, root's included (before: a FileNotFoundError traceback after planning)
        pytest.param(lambda d: None, ["OUTPUT_DIR", "/proc/trunksplit-run"], r"cannot be written: making a directory in /proc fails",
                     marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no process makes a directory")),
    ],
)
def test_launcher_mistakes_are_clear_errors_and_write_nothing(tmp_path, setup, overrides, message):
    setup(tmp_path)
    overrides = [o.replace("{d}", str(tmp_path)) for o in overrides]
    if "OUTPUT_DIR" not in overrides:
        overrides += ["OUTPUT_DIR", str(tmp_path / "run")]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        train(load_config(QUICK, [*SMALL, "TRAIN.STEPS", "1", *overrides]))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("key,value,saved", [("MODEL.TRUNK.NAME", "resnet34", "resnet18"), ("MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.5", "0.25"),
                                             ("OPTIM.NAME", "adamw", "sgd"), ("METHOD.NAME", "swav", "simclr")])
def test_resume_with_another_architecture_method_or_optimizer_is_refused(tmp_path, key, value, saved):
    """Another optimizer's state fails deep in torch (AdamW's load_state_dict: KeyError 'step'), another head
    with a size mismatch: refused first, naming the key, nothing written."""
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))
    before = _snapshot(out)
    with pytest.raises(ValueError, match=f"holds a run with {key} {saved}, but the config asks for {value}; resume with the same {key}"):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL, key, value]), resume=True)
    assert _snapshot(out) == before


def test_resume_with_other_checkpointing_plans_again_and_a_finished_run_says_so(tmp_path):
    """The checkpoint's plans are the ones its run trained with; a resumed run that asks for other
    checkpointing (here vissl's 2 segments for balanced 4) gets a plan made for what it asks, and a warning."""
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))
    other = ["MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl", "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS", "2",
             "TRAIN.GRADIENTS", "kept"]  # a value is said as it was and is (DDP sets this one: the user may not know it changed)
    with pytest.warns(UserWarning, match=r"MODEL.ACTIVATION_CHECKPOINTING, TRAIN.GRADIENTS \(allocated then, kept now\) changed since .* the trunk plans again"), \
            pytest.warns(UserWarning, match=r"TRAIN.STEPS \(1 then, 2 now\) changed"):
        model, last = train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL, *other]), resume=True)
    assert last["step"] == 2 and (model.trunk.plan.strategy, len(model.trunk.plan.segments)) == ("vissl", 2)
    with pytest.warns(UserWarning, match="is at step 2 and TRAIN.STEPS is 2: nothing is left to train"):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL, *other]), resume=True)


def test_a_stopped_runs_trunk_is_written_by_resuming_it_at_its_own_step_without_a_word_of_changed_settings(tmp_path, monkeypatch):
    """What the interrupted note tells a user who wants a stopped run's trunk: ``--resume TRAIN.STEPS <its step>``
    trains nothing and writes trunk.pt, the checkpoint's trunk under torchvision's names. The shorter TRAIN.STEPS
    stretches no schedule, so it is not warned of as a change (it was: "its weights will not be those of an
    uninterrupted run", said of a run that trains no step)."""
    out, update, updates = tmp_path / "run", loop._optimizer_step, []

    def update_then_signal(*args):  # Ctrl-C in the second step
        updates.append(update(*args))
        if len(updates) == 2:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(loop, "_optimizer_step", update_then_signal)
    with pytest.raises(Stopped):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "5", *SMALL]))
    monkeypatch.undo()
    assert not (out / "trunk.pt").exists()  # a stopped run writes its checkpoint, not its trunk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), *SMALL, "TRAIN.STEPS", "2"]), resume=True)
    said = [str(w.message) for w in caught if "--resume" in str(w.message)]
    assert said == [f"--resume: {out / 'checkpoint.pt'} is at step 2 and TRAIN.STEPS is 2: nothing is left to train (raise TRAIN.STEPS "
                    "to go on); its trunk's weights as they are go to trunk.pt"], said
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    plain = resnet_of_width("resnet18", 0.25)  # SMALL's trunk
    plain.fc = torch.nn.Identity()
    plain.load_state_dict(torch.load(out / "trunk.pt", weights_only=True))  # strict: every entry, torchvision's names
    assert all(torch.equal(v, saved[f"trunk.{k}"]) for k, v in CheckpointedTrunk(plain).state_dict().items())


def test_resume_with_another_batch_or_length_says_what_changed_and_names_the_plan_it_trains_with(tmp_path):
    """A resumed run may go on with other settings (a longer TRAIN.STEPS, another batch): it trains, but it is
    no longer the run its checkpoint was part of, so each changed key is said with both values. What leaves
    the weights as they are (log and checkpoint cadence, loader workers) is not. The summary names the plan
    of the batch it trains, not the checkpoint's (that one read as a crop group's)."""
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", *SMALL, "TRAIN.LOG_EVERY", "2", "TRAIN.CHECKPOINT_EVERY", "3"]), resume=True)
    assert not [w for w in caught if "changed since" in str(w.message)]

    with pytest.warns(UserWarning) as caught:
        model, last = train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL, "TRAIN.BATCH_SIZE_PER_RANK", "6"]), resume=True)
    said = [str(w.message) for w in caught if "changed since" in str(w.message)]
    assert len(said) == 1 and "TRAIN.BATCH_SIZE_PER_RANK (4 then, 6 now)" in said[0] and "TRAIN.STEPS (1 then, 2 now)" in said[0], said
    assert "OPTIM.LR (0.0046875 then, 0.0070312" in said[0]  # the learning rate the linear scaling rule gave each batch
    assert last["step"] == 2 and last["plan"] == "balanced, 4 segments" and len(model.trunk.plans) == 2


def test_maxvit_with_several_resolutions_is_refused():
    with pytest.raises(ValueError, match="maxvit_t is built for one resolution"):
        load_config(os.path.join(ROOT, "configs", "simclr_vit_b_16.yaml"), ["MODEL.TRUNK.NAME", "maxvit_t", "DATA.CROP_SIZES", "[224, 96]", "DATA.CROP_COUNTS", "[2, 6]",
                                                                             "DATA.CROP_SCALES", "[[0.1, 1.0], [0.05, 0.1]]", "METHOD.NAME", "swav"])


# slow: the fast suite fits the whole step in tests/ssl/test_fit_step.py (DINO's, whose step is SimCLR's and more)
@pytest.mark.slow
@pytest.mark.parametrize("gradients", ["allocated", "kept"])
def test_batch_size_zero_trains_the_largest_batch_that_fits_the_memory_limit(tmp_path, gradients):
    limit = 170 * 2**20  # at full width (ANY_WIDTH): the weights a part of it; a quarter-width trunk reaches the data set's 128 images first
    overrides = ["OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.STEPS", "2", *SMALL, *ANY_WIDTH, "TRAIN.BATCH_SIZE_PER_RANK", "0",
                 "TRAIN.MEMORY_LIMIT", str(float(limit)), "TRAIN.GRADIENTS", gradients]
    model, last = train(load_config(QUICK, overrides))
    saved = load_config(str(tmp_path / "run" / "config.yaml"))
    batch = saved.TRAIN.BATCH_SIZE_PER_RANK
    assert batch >= 2 and saved.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET > 1  # the fitted batch and trunk budget
    # everything resident during a logged step: parameters, SGD momentum, gradients, and the step's measured peak
    # (which includes the gradients where the step allocates them); the head and the loss are fitted too
    params = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    resident = params + trainable + (trainable if gradients == "kept" else 0)
    assert 0.85 * limit <= resident + last["peak_memory_bytes"] <= limit, (batch, resident + last["peak_memory_bytes"])


def test_batch_size_zero_needs_a_memory_limit():
    with pytest.raises(ValueError, match="TRAIN.MEMORY_LIMIT"):
        load_config(QUICK, ["TRAIN.BATCH_SIZE_PER_RANK", "0"])


FSDP = ["DISTRIBUTED.STRATEGY", "fsdp", "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", *SMALL]


def _fsdp_run(rank, world_size, out, interrupt, resume_only=False, extra=()):
    """Under FSDP: train 4 steps straight, or until step 3 begins, then resume; rank 0 saves the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cfg = load_config(QUICK, ["OUTPUT_DIR", out, *FSDP, *extra])
    model = train(cfg, resume=True)[0] if resume_only else _trained(cfg, interrupt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # every rank all-gathers
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))


def _fsdp_two_steps(rank, world_size, out):
    train(load_config(QUICK, ["OUTPUT_DIR", out, *FSDP, "TRAIN.STEPS", "2"]))


def _fsdp_from_a_whole_checkpoint(rank, world_size, out):
    """Resume a one-process run under FSDP2; rank 0 keeps the state loaded, gathered whole by torch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from trunksplit.in_backward import standard_optimizer

    real, whole = strategy.FSDP.load, StateDictOptions(full_state_dict=True, cpu_offload=True)

    def load_and_keep(self, cfg, state, model, optimizer):
        real(self, cfg, state, model, optimizer)
        loaded = {"model": get_model_state_dict(model, options=whole),  # collectives: every rank gathers, rank 0 keeps
                  "optimizer": get_optimizer_state_dict(model, standard_optimizer(optimizer), options=whole)}
        if rank == 0:
            torch.save({"model": loaded["model"], "optimizer": loaded["optimizer"]["state"]}, os.path.join(out, "loaded.pt"))

    strategy.FSDP.load = load_and_keep  # this spawned process's copy
    train(load_config(QUICK, ["OUTPUT_DIR", out, "DISTRIBUTED.STRATEGY", "fsdp", "TRAIN.STEPS", "3", *SMALL]), resume=True)


def _state_of(model, slots: dict) -> dict:
    """The model's state and the optimizer's ``slots`` (by torch's names), cloned: the next step updates them in place."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {name: {slot: v.clone() for slot, v in kept.items()} for name, kept in slots.items()}}


def _equal_states(got: dict, want: dict) -> None:
    """The model's and the optimizer's state of ``got`` are ``want``'s, by torch's names, bit for bit."""
    assert got["model"].keys() == want["model"].keys()
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name
    assert want["optimizer"] and got["optimizer"].keys() == want["optimizer"].keys()
    for name, slots in want["optimizer"].items():
        assert all(torch.equal(got["optimizer"][name][slot], value) for slot, value in slots.items()), name


def test_a_run_moves_from_one_process_to_fsdp_and_back_its_checkpoint_resharded_on_load(tmp_path, monkeypatch):
    """A whole checkpoint (one process or DDP) resumed under FSDP2: every rank reads it and keeps its shards;
    a sharded one resumed in one process (or under DDP) is read whole, DCP resharding on load. Both were
    refused ("resume with the DISTRIBUTED.STRATEGY it was trained with"), so a run could neither move to FSDP2
    as its model outgrew one device nor go on after losing its second GPU. Each way, the state loaded is the
    state saved as torch names it (gathered whole under FSDP2; the shards as torch's own converter reads
    them), and the run trains on: sharded, then whole, its whole checkpoint replacing the shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from trunksplit.in_backward import standard_optimizer

    out, saved, loaded = tmp_path / "run", {}, {}
    real_save, real_load = strategy.Strategy.save, strategy.Strategy.load

    def save_and_keep(self, cfg, model, optimizer, meta):
        real_save(self, cfg, model, optimizer, meta)
        saved.update(_state_of(model, get_optimizer_state_dict(model, optimizer)["state"]))  # torch's names for torch.optim's places

    monkeypatch.setattr(strategy.Strategy, "save", save_and_keep)
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "2", *SMALL]))
    run_processes(_fsdp_from_a_whole_checkpoint, 2, (str(out),))  # started from a fork server: unpatched
    _equal_states(torch.load(out / "loaded.pt", weights_only=False), saved)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["sharded"] == os.path.join("sharded", "step_3")

    dcp_to_torch_save(out / "sharded" / "step_3", tmp_path / "shards.pt")
    want = torch.load(tmp_path / "shards.pt", weights_only=False)
    # the trained trunk, gathered whole from the shards at the end, under torchvision's names
    plain = resnet_of_width("resnet18", 0.25)  # SMALL's trunk
    plain.fc = torch.nn.Identity()
    plain.load_state_dict(torch.load(out / "trunk.pt", weights_only=True))  # strict
    gathered = CheckpointedTrunk(plain).state_dict()
    assert all(torch.equal(v, want["model"][f"trunk.{k}"]) for k, v in gathered.items())

    def load_and_keep(self, cfg, state, model, optimizer):
        real_load(self, cfg, state, model, optimizer)
        loaded.update(_state_of(model, get_optimizer_state_dict(model, standard_optimizer(optimizer))["state"]))

    monkeypatch.setattr(strategy.Strategy, "save", real_save)
    monkeypatch.setattr(strategy.Strategy, "load", load_and_keep)
    with pytest.warns(UserWarning, match="saved by 2 processes and resumes on 1"), pytest.warns(UserWarning, match=r"TRAIN.STEPS \(3 then, 4 now\) changed"):
        train(load_config(QUICK, ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "4", *SMALL]), resume=True)
    _equal_states(loaded, {"model": want["model"], "optimizer": want["optimizer"]["state"]})
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 4 and not (out / "sharded").exists()


def test_a_whole_checkpoint_whose_optimizer_groups_differ_is_refused_before_anything_loads():
    """Moving to FSDP2, torch.optim's places are named by this run's optimizer: groups of other sizes
    (OPTIM.EXCLUDE_BIAS_AND_NORM changed) would give one parameter another's momentum (a shape error
    steps later, or silently wrong where the shapes agree). Refused as torch.optim refuses it, naming the key."""
    from trunksplit.ssl.run_dir import load_whole_into_shards

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    one_group = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    one_group.step()
    state = {"model": {k: v + 1 for k, v in model.state_dict().items()}, "optimizer": one_group.state_dict()}
    weights, bias_and_norm = [model[0].weight], [model[0].bias, *model[1].parameters()]
    two_groups = torch.optim.SGD([{"params": weights}, {"params": bias_and_norm, "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("optimizer has parameter groups of [4] parameters, this run's [1, 3]; resume with the "
                                                   "config it was trained with (OPTIM.EXCLUDE_BIAS_AND_NORM)")):
        load_whole_into_shards(state, model, two_groups)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not two_groups.state


def _fsdp_with_and_without_checkpointing(rank, world_size, out):
    for how in ("checkpointed", "unsplit"):
        overrides = ["OUTPUT_DIR", os.path.join(out, how), *FSDP, "TRAIN.STEPS", "1", "MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING", str(how == "checkpointed")]
        _, last = train(load_config(QUICK, overrides))
        if rank == 0:
            with open(os.path.join(out, f"{how}.json"), "w") as f:
                json.dump(last, f)


def test_an_fsdp_run_ends_with_one_sharded_step_with_and_without_checkpointing_side_by_side(tmp_path):
    """FSDP2 refuses deepcopy, so its runs had no side-by-side line: the copies are now built afresh and
    sharded as the run's, and every rank steps them together. The checkpointed copy steps what the run
    stepped (its plans; a stand-in for SimCLR's loss), the plain copy what a run without checkpointing
    steps, each rank's peak as the run's meter counts it (the profiler's events on CPU)."""
    run_processes(_fsdp_with_and_without_checkpointing, 2, (str(tmp_path),))
    checkpointed, unsplit = (json.loads((tmp_path / f"{how}.json").read_text()) for how in ("checkpointed", "unsplit"))
    vs = checkpointed["memory_vs_plain"]
    assert abs(vs["checkpointed"] / checkpointed["peak_memory_bytes"] - 1) < 0.02, (vs, checkpointed["peak_memory_bytes"])
    assert abs(vs["plain"] / unsplit["peak_memory_bytes"] - 1) < 0.02, (vs, unsplit["peak_memory_bytes"])
    assert vs["checkpointed"] < vs["plain"]
    same = unsplit["memory_vs_plain"]  # nothing checkpointed either way (the profiler's events differed by 4 bytes, a scalar)
    assert abs(same["checkpointed"] - same["plain"]) <= 64, same
    assert json.loads((tmp_path / "checkpointed" / "summary.json").read_text())["memory_vs_plain"] == vs


@pytest.mark.slow  # two 2-process runs: about 20 s on 2 cores
def test_fsdp_runs_resume_from_sharded_checkpoints_to_the_uninterrupted_weights(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_processes(_fsdp_run, 2, (str(tmp_path / "a"), False))
    run_processes(_fsdp_run, 2, (str(tmp_path / "b"), True))
    assert (tmp_path / "b" / "sharded" / "step_4").is_dir() and not (tmp_path / "b" / "sharded" / "step_2").exists()
    straight, resumed = torch.load(tmp_path / "a" / "full.pt"), torch.load(tmp_path / "b" / "full.pt")
    fresh = _fresh_state(load_config(QUICK, FSDP))
    assert straight.keys() == fresh.keys()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name
    assert [r["step"] for r in _rows(tmp_path / "b")] == [1, 2, 3, 4]


@pytest.mark.slow  # three 2-process runs: about 30 s on 2 cores
def test_fsdp_stepped_in_backward_resumes_exactly_and_trains_the_standard_weights(tmp_path):
    """Each sharded parameter updated after its reduce-scatter; the sharded checkpoint holds the
    optimizer's state (loaded by torch.distributed.checkpoint into the optimizer behind the stand-in)."""
    stepped = ["OPTIM.NAME", "adamw", "OPTIM.LR", "0.001", "OPTIM.IN_BACKWARD", "True"]
    for run, interrupt, extra in (("standard", False, stepped[:4]), ("straight", False, stepped), ("resumed", True, stepped)):
        (tmp_path / run).mkdir()
        run_processes(_fsdp_run, 2, (str(tmp_path / run), interrupt, False, extra))
    standard, straight, resumed = (torch.load(tmp_path / run / "full.pt") for run in ("standard", "straight", "resumed"))
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name
        if value.is_floating_point() and "running" not in name:
            assert (value - standard[name]).abs().max() <= 1e-6 * standard[name].abs().max().clamp_min(1e-12), name


@pytest.mark.slow  # two 2-process runs: about 25 s on 2 cores
def test_dino_under_fsdp_resumes_its_sharded_teacher_and_centre_exactly(tmp_path):
    """DINO's teacher is sharded as its student: the sharded checkpoint holds each rank's slice of it
    (and the centre), and a resumed run ends with the uninterrupted run's student, teacher and centre."""
    dino = [*DINO_SMALL, "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl"]
    for run, interrupt in (("straight", False), ("resumed", True)):
        (tmp_path / run).mkdir()
        run_processes(_fsdp_run, 2, (str(tmp_path / run), interrupt, False, dino))
    straight, resumed = (torch.load(tmp_path / run / "full.pt") for run in ("straight", "resumed"))
    assert any(name.startswith("teacher.") for name in straight) and "center" in straight
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


@pytest.mark.slow  # four gloo processes on two cores
def test_an_fsdp_run_saved_on_two_ranks_resumes_on_four(tmp_path):
    run_processes(_fsdp_two_steps, 2, (str(tmp_path),))
    run_processes(_fsdp_run, 4, (str(tmp_path), False, True), timeout=400)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)


def test_batch_size_zero_under_fsdp_fits_one_rank_of_the_world():
    # fitted_batch predicts per rank: sharded weights, gradients and momentum leave room for more images
    overrides = [*SMALL, *ANY_WIDTH, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(200 * 2**20))]  # its weights matter
    cpu = torch.device("cpu")
    one, one_budget, _ = fitted_batch(load_config(QUICK, overrides), cpu, loop.step_for_fit(load_config(QUICK, overrides), contextlib.nullcontext()))
    fsdp, ddp = (load_config(QUICK, [*overrides, "DISTRIBUTED.STRATEGY", name]) for name in ("fsdp", "ddp"))
    sharded, budget, _ = fitted_batch(fsdp, cpu, loop.step_for_fit(fsdp, contextlib.nullcontext()), layout=strategy.FSDP(0, 4, cpu).rank_layout)
    ddp_rank = strategy.DDP(0, 4, cpu)
    ddp = ddp_rank.configured(ddp)  # as the launcher trains it: the gradients kept in DDP's buckets
    replica, replica_budget, _ = fitted_batch(ddp, cpu, loop.step_for_fit(ddp, contextlib.nullcontext()), layout=ddp_rank.rank_layout)
    # a DDP rank holds the whole model and DDP's buckets besides (tests/ssl/test_fit_step.py trains it): never more room
    assert replica <= one and replica_budget < one_budget
    assert sharded > one and 0 < budget < 200 * 2**20


def test_a_resumed_run_counts_skipped_images_as_the_uninterrupted_run(tmp_path, monkeypatch):
    from PIL import Image

    root = tmp_path / "images" / "only"
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        Image.fromarray((torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()).save(root / f"{i}.jpg")
    (root / "broken.jpg").write_bytes(b"not an image")
    overrides = [*SMALL, "DATA.PATH", str(tmp_path / "images"), "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2", "TRAIN.BATCH_SIZE_PER_RANK", "2"]
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "a"), *overrides]))
        cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides])
        _interrupt_at_step_3(cfg, monkeypatch)
        train(cfg, resume=True)
    for run in ("a", "b"):
        rows[run] = [json.loads(line)["skipped_images"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert rows["a"][-1] >= 1 and rows["b"] == rows["a"]


def test_a_resumed_run_with_a_fitted_batch_trains_on_its_checkpoints_batch_and_plan(tmp_path, monkeypatch):
    """TRAIN.BATCH_SIZE_PER_RANK 0: the fit is measured, and a second measurement may answer otherwise;
    --resume takes the batch and budget the checkpoint was trained with, never fits again. (The first
    run's fit answers 3 images and budget 1.0 here, an answer no default gives: the real fit is
    tested in tests/ssl/test_fit_step.py.)"""
    overrides = [*SMALL, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(170 * 2**20)), "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2"]
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "b"), *overrides])
    monkeypatch.setattr(loop, "fitted_batch", lambda cfg, device, run_step, world, say, images_at_most: (3, 1.0, []))
    _interrupt_at_step_3(cfg, monkeypatch)
    first = yaml.safe_load(torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["config"])
    assert first["TRAIN"]["BATCH_SIZE_PER_RANK"] == 3 and first["MODEL"]["ACTIVATION_CHECKPOINTING"]["MEMORY_BUDGET"] == 1.0

    def another_answer(*args, **kwargs):
        raise AssertionError("a resumed run fitted its batch, or planned its trunk, again")

    monkeypatch.setattr(loop, "fitted_batch", another_answer)
    monkeypatch.setattr(trunk_module, "plan_trunk", another_answer)  # the checkpoint's plan is the one it trained with
    resumed, last = train(cfg, resume=True)
    assert last["step"] == 4 and last["images_per_sec"] > 0
    saved = yaml.safe_load(torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["config"])
    assert saved["TRAIN"] == first["TRAIN"] and saved["MODEL"] == first["MODEL"]


def test_a_run_sized_to_its_memory_limit_runs_no_step_without_checkpointing_and_says_so(tmp_path, monkeypatch):
    """The fitted batch fills TRAIN.MEMORY_LIMIT: the summary's plain step beside a copy of the model would
    pass it (on a CPU, until the host runs out). Not run, and the last lines say why. (The fit answers 3
    images by a stub: the real fit is tests/ssl/test_fit_step.py's.)"""
    monkeypatch.setattr(loop, "fitted_batch", lambda cfg, device, run_step, world, say, images_at_most: (3, 1.0, []))

    def plain_step(*args, **kwargs):
        raise AssertionError("a step without checkpointing ran beside a run sized to its memory limit")

    monkeypatch.setattr(side_by_side, "compare_with_plain", plain_step)
    out = tmp_path / "run"
    result = _cli("--config-file", QUICK, "OUTPUT_DIR", str(out), *SMALL, "TRAIN.STEPS", "1", "TRAIN.BATCH_SIZE_PER_RANK", "0",
                  "TRAIN.MEMORY_LIMIT", "170MiB")
    assert result.returncode == 0, result.stderr
    assert "side by side: not run (TRAIN.MEMORY_LIMIT is set" in result.stdout, result.stdout
    assert json.loads((out / "summary.json").read_text())["memory_vs_plain"] is None


def _fit_alone_then_agree(rank, world_size, out):
    """Each rank's fit answers otherwise (as allocator-profiled fits do between ranks); the launcher's
    strategy makes every rank train with rank 0's answer."""
    cfg = load_config(QUICK, [*SMALL, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(220 * 2**20)), "DISTRIBUTED.STRATEGY", "fsdp"])
    loop.fitted_batch = lambda cfg, device, run_step, world, say, images_at_most: (3 + rank, 1000.0 * (rank + 1), [])  # this process only
    cpu = torch.device("cpu")
    s = strategy.strategy_for(cfg, rank, world_size, cpu)
    fitted, _ = loop._batch_to_train(cfg, cpu, s, resume=False, images_at_most=256)
    torch.save((fitted.TRAIN.BATCH_SIZE_PER_RANK, fitted.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET), os.path.join(out, f"{rank}.pt"))


def test_ranks_that_fit_different_batches_train_with_rank_0s(tmp_path):
    run_processes(_fit_alone_then_agree, 2, (str(tmp_path),))
    assert [torch.load(tmp_path / f"{r}.pt") for r in range(2)] == [(3, 1000.0), (3, 1000.0)]


def test_train_device_cuda_without_an_index_is_this_processs_gpu(monkeypatch):
    """``TRAIN.DEVICE cuda`` names no GPU; under torchrun each process takes its own (LOCAL_RANK), as
    the default does. torch.cuda.set_device refuses a device without an index, which ended the
    quick start on a GPU (docs/gpu.md). This machine has no GPU: torch.cuda answers as one with two."""
    from trunksplit.ssl.parallel import setup_distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank, world, device = setup_distributed(load_config("", ["TRAIN.DEVICE", "cuda"]))
    assert (rank, world, device, chosen) == (0, 1, torch.device("cuda", 1), [torch.device("cuda", 1)])
    with pytest.raises(ValueError, match="this machine has 2 GPU"):
        setup_distributed(load_config("", ["TRAIN.DEVICE", "cuda:2"]))


def test_nccl_for_cpu_ranks_is_refused_in_the_configs_terms_before_any_process_group(monkeypatch):
    """torchrun's CPU ranks with DISTRIBUTED.BACKEND nccl: torch's 'ProcessGroupNCCL is only supported with GPUs'
    came from inside init_process_group; now the config's key and what to set, and no group is made."""
    from trunksplit.ssl.parallel import setup_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"DISTRIBUTED.BACKEND nccl runs on GPUs, and this run is on cpu: use gloo, or leave it empty"):
        setup_distributed(load_config("", ["TRAIN.DEVICE", "cpu", "DISTRIBUTED.BACKEND", "nccl"]))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("world", [1, 2])
def test_a_learning_rate_given_per_256_images_is_scaled_to_the_runs_total_batch(world, capsys):
    """OPTIM.LR_BATCH_SIZE: the recipes' linear scaling rule (0.3 x total batch / 256) applied, said,
    and recorded in the config the run saves (applied once: the saved config's rate is the rate)."""
    from trunksplit.ssl.optim import learning_rate, with_scaled_lr

    cfg = load_config(QUICK, ["OPTIM.LR", "0.3", "OPTIM.LR_BATCH_SIZE", "256", "TRAIN.BATCH_SIZE_PER_RANK", "16", "OPTIM.WARMUP_STEPS", "0"])
    scaled = with_scaled_lr(cfg, world, rank=0)
    assert scaled.OPTIM.LR == pytest.approx(0.3 * 16 * world / 256) and scaled.OPTIM.LR_BATCH_SIZE == 0
    assert learning_rate(scaled, 0) == pytest.approx(0.3 * 16 * world / 256)
    assert f"{scaled.OPTIM.LR:.4g} at this run's {16 * world}" in capsys.readouterr().out
    assert with_scaled_lr(scaled, world, rank=0).OPTIM.LR == scaled.OPTIM.LR  # once
    assert cfg.OPTIM.LR == 0.3  # the given config is left as it was
    with pytest.raises(ValueError, match="OPTIM.LR_BATCH_SIZE must be >= 0"):
        load_config(QUICK, ["OPTIM.LR_BATCH_SIZE", "-256"])


def test_a_run_logged_to_a_file_has_one_plain_line_per_step(tmp_path, capsys):
    """Not a terminal (captured here, as in a log file): no progress bar's carriage returns, so the log greps."""
    train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), *SMALL, "TRAIN.STEPS", "2"]))
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]



@pytest.mark.slow  # 30 steps of ResNet-50: about 40 s on 2 cores (python -m pytest -q -m slow)
def test_the_quick_start_learns(tmp_path):
    """The README's first command, as shipped: its last ten losses average well below SimCLR's chance level
    (each of 2 x 16 views picking its partner among 31 at random: ln 31), where smooth colour fields under
    SimCLR's colour distortions ended at it."""
    out = tmp_path / "run"
    result = _script("--config-file", QUICK, "OUTPUT_DIR", str(out))
    assert result.returncode == 0, result.stderr
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-10:]) / 10 <= 0.9 * math.log(31), losses
