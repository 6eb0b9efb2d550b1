"""Stopping a training run between steps, where ``--resume`` continues it exactly.

Ctrl-C (SIGINT), SIGTERM (a scheduler preempting the job) and SIGHUP (the terminal closed: an ssh
connection dropped; torchrun passes each on to its ranks) ask the loop to stop once the step it is
in is done. Every rank stops between the same two steps (the loop agrees on it before each step,
one all-reduce of a number) and writes a checkpoint there first. An evaluation between two steps
(kNN) is left between two of its batches (:func:`until_stopped`). A second signal stops at once,
from the last checkpoint written (a second SIGHUP does not: see :class:`StopSignals`).

Why not Python's own KeyboardInterrupt: it is raised wherever the signal lands, and one that
lands in a callback (a tensor's finaliser) is printed and dropped, so the run goes on; under
torchrun the rank whose interrupt was dropped then waits in a collective on one that has exited,
and fails with the transport's error, not a note on where to resume.
"""
import contextlib
import os
import signal
import threading
from typing import Callable, Iterable, Iterator

import torch

from .run_dir import CHECKPOINT


def _signals(*names: str) -> tuple:
    """The signals of ``names`` this platform has: Windows has no SIGHUP and no SIGCHLD."""
    return tuple(getattr(signal, name) for name in names if hasattr(signal, name))


STOP_SIGNALS = _signals("SIGINT", "SIGTERM", "SIGHUP")
HANDLED = STOP_SIGNALS + _signals("SIGCHLD")  # SIGCHLD: see StopSignals.handle
HANG_UP = getattr(signal, "SIGHUP", None)


class Stopped(KeyboardInterrupt):
    """The run stopped between steps, as a signal asked: its checkpoint holds ``step``; a launcher
    exits with ``128 + signum``, as a shell reports a command the signal ended."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.step, self.signum = step, signum


class EvaluationStopped(Exception):
    """An evaluation left between two of its batches: a stop signal reached a rank (:func:`until_stopped`)."""


class StopSignals:
    """The first stop signal this process received (``signum``, 0 while none): the loop reads it
    before each step. A second signal raises KeyboardInterrupt where it lands, but for SIGHUP: no one
    is left at the terminal to ask twice, and a shell passes its own SIGHUP on to its jobs, so a run
    may get two for one hang-up. ``terminal``: this process's file descriptors that were a terminal
    as the run began."""

    def __init__(self, say: bool, terminal=()):
        self.signum = 0
        self._say = say
        self._terminal = terminal

    def handle(self, signum: int, frame) -> None:
        if signum == HANG_UP:
            _write_past_a_closed_terminal(self._terminal)
            if self.signum:
                return
        elif self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        # A scheduler (SLURM) signals every process of the job, the data loader's workers too; torch's
        # loader then raises, from its SIGCHLD handler, that a worker was killed, wherever the step is.
        # The run stops before its next step (a fetch that fails now stops it there): stop watching the
        # workers (restored on leaving the block). A Python handler that does nothing, not SIG_DFL: a
        # SIGCHLD already pending would find no Python handler, and Python prints "Signal 17 ignored
        # due to race condition" as an error.
        for s in _signals("SIGCHLD"):
            signal.signal(s, _unwatched)
        if self._say and signum != HANG_UP:  # os.write: a handler may land inside a print
            os.write(2, f"\n{signal.Signals(signum).name}: stopping once this step is done and saved "
                        "(Ctrl-C again stops at once, from the last checkpoint)\n".encode())


@contextlib.contextmanager
def stop_between_steps(say: bool) -> Iterator[StopSignals]:
    """SIGINT, SIGTERM and SIGHUP handled as :class:`StopSignals` inside the block, the handlers before it
    restored after it. ``say``: this process prints that it is stopping (rank 0). Signal handlers
    belong to the main thread: in another, nothing is installed and the signals act as before. A
    signal ignored as the block begins stays ignored: a shell starts a script's ``cmd &`` (no job
    control) with SIGINT ignored, so that a Ctrl-C meant for the script's foreground command does
    not reach it (Python keeps it so too; SIGTERM still stops such a run).

        with stop_between_steps(rank == 0) as signals:
            for step in steps:
                if signals.signum:  # under several processes: the largest of every rank's
                    save(step)  # the steps done
                    raise Stopped(step, signals.signum)
                ...
    """
    signals = StopSignals(say, terminal=[fd for fd in (1, 2) if os.isatty(fd)])
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    before = {s: signal.getsignal(s) for s in HANDLED}
    for s in STOP_SIGNALS:
        if before[s] != signal.SIG_IGN:
            signal.signal(s, signals.handle)
    try:
        yield signals
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python


def stop_if_asked(signum: int, step: int, start: int, save: Callable[[], None]) -> None:
    """Between two steps, with ``step`` steps done: where ``signum`` (the largest of every rank's
    stop signal, 0 for none) is set, stop here, after ``save()`` (unless this run has done no step:
    the checkpoint it resumed from holds them). Every rank takes the same ``signum``, so that none
    is left waiting in the next step's collectives for one that has left."""
    if signum:
        if step > start:
            save()
        raise Stopped(step, int(signum))


def _write_past_a_closed_terminal(fds) -> None:
    """Point ``fds`` (stdout, stderr: those that were a terminal) at /dev/null. After a hang-up every
    write to the terminal fails (EIO): the stopping step's progress bar, a warning, the last print
    would raise before the checkpoint is written. The run's record is its metrics file."""
    if fds:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in fds:
            os.dup2(devnull, fd)
        os.close(devnull)


def _unwatched(signum: int, frame) -> None:
    """SIGCHLD once the run is stopping: a loader's worker that ended is no error now."""


def until_stopped(batches: Iterable, signals: StopSignals, largest: Callable[[float], float]) -> Iterator:
    """``batches``, until a stop signal reaches any rank: then :class:`EvaluationStopped`. An evaluation
    (kNN over a data set can take minutes) must not keep a stopping run past its scheduler's grace
    period (SLURM's KillWait: 30 s by default), after which the job is killed unsaved. The ranks agree
    before each batch (``largest``: the largest of every rank's number), so all leave at the same one;
    a fetch that fails after a signal (a scheduler's SIGTERM ends the loader's workers too) leaves
    too. Every rank must be given as many batches.

        for images in until_stopped(loader, signals, strategy.largest): ...
    """
    batches = iter(batches)
    while True:
        try:
            batch = next_unless_stopping(batches, signals)
        except StopIteration:
            return
        if largest(signals.signum):
            raise EvaluationStopped
        yield batch


def next_unless_stopping(batches: Iterator, signals: StopSignals):
    """The next of ``batches``, or None where fetching it failed after a stop signal reached this process:
    a scheduler's SIGTERM ends a data loader's workers too, and the batches they still owed fail. A
    failure without a signal is raised; so is the end of ``batches`` (StopIteration)."""
    try:
        return next(batches)
    except StopIteration:
        raise
    except Exception:
        if not signals.signum:
            raise
        return None


def ignore_interrupts(worker_id: int) -> None:
    """A data loader's ``worker_init_fn``: Ctrl-C in a terminal, and the terminal's hang-up, reach the
    loader's workers too, and a worker they ended would fail the batch the stopping step still waits
    on. The loader stops its workers itself."""
    for s in _signals("SIGINT", "SIGHUP"):
        signal.signal(s, signal.SIG_IGN)


def interrupted_note(output_dir: str, checkpoint_every: int) -> str:
    """What an interrupted run leaves to continue from: the step its last checkpoint holds, read
    without loading the weights (``mmap``), or that it saved none yet."""
    path = os.path.join(output_dir, CHECKPOINT)
    try:
        step = int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:  # none written yet, or not readable: nothing to resume from
        return f"interrupted before the first checkpoint (TRAIN.CHECKPOINT_EVERY {checkpoint_every}): {output_dir} holds nothing to resume, and the same command starts afresh"
    return (f"interrupted: {path} holds step {step}; add --resume to continue from it, or --resume TRAIN.STEPS {step} "
            "to write its trunk's weights (trunk.pt) as they are, without training on")
