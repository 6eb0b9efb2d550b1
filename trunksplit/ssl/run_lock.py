"""A run's hold on its OUTPUT_DIR: one run writes a directory at a time.

Two runs writing one OUTPUT_DIR (a ``--resume`` started while the run it resumes still goes, two
terminals, a scheduler's requeue beside the job) would interleave their metrics and overwrite each
other's checkpoints. The run that writes a directory holds its config.yaml locked with ``flock``:
the system drops the lock when the process ends, however it ends (a SIGKILL leaves no stale lock),
and it binds other processes only. Not guarded: Windows (no ``fcntl``), and file systems without
locks.
"""
import os
from typing import Dict

try:
    import fcntl  # POSIX; Windows has none
except ImportError:
    fcntl = None

CONFIG = "config.yaml"
_HELD: Dict[str, int] = {}  # OUTPUT_DIR (its real path) -> the descriptor of its config.yaml, locked by this process's run


def hold_output_dir(path: str) -> int:
    """Lock ``path``'s config.yaml for this process's run (created empty where there is none); its
    descriptor, which the run writes the config through. A run this process started earlier in ``path``
    (ended by an exception, never released) hands the lock on. A ``ValueError`` where another process
    holds it."""
    real = os.path.realpath(path)
    if real in _HELD:
        release_output_dir(path)
    fd = os.open(os.path.join(path, CONFIG), os.O_RDWR | os.O_CREAT, 0o644)
    if not _locked(fd, exclusive=True):
        os.close(fd)
        raise in_use(path)
    _HELD[real] = fd
    return fd


def in_use(path: str) -> ValueError:
    """The error of a run refused ``path``: what holds it, and what to do."""
    return ValueError(f"OUTPUT_DIR {path} is in use: a run still going writes it (it holds {os.path.join(path, CONFIG)} locked; fuser "
                      f"names its process). Let it end or stop it (it saves on SIGTERM), then --resume; or train into another OUTPUT_DIR; "
                      f"nothing was written")


def release_output_dir(path: str) -> None:
    """Let go of ``path`` (a run's end): another process may write it now."""
    fd = _HELD.pop(os.path.realpath(path), None)
    if fd is not None:
        os.close(fd)


def held_elsewhere(path: str) -> bool:
    """Whether another process's run holds ``path`` (:func:`hold_output_dir`)."""
    config = os.path.join(path, CONFIG)
    if os.path.realpath(path) in _HELD or not os.path.isfile(config):
        return False
    try:
        fd = os.open(config, os.O_RDONLY)
    except OSError:  # unreadable: whether the run may write there is check_output_dir's and start_run_dir's to say
        return False
    try:
        return not _locked(fd, exclusive=False)
    finally:
        os.close(fd)  # a shared lock, gone with its descriptor


def _forget_held_in_child() -> None:
    """A forked child (a loader's worker) closes its copies of the held descriptors. ``flock`` belongs to
    the open file, which a fork shares: a worker that outlived its run's end (a kNN loader's, kept by an
    exception's traceback in a notebook) would hold the directory on for it."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_held_in_child)


def _locked(fd: int, exclusive: bool) -> bool:
    """Whether ``fd`` got its lock at once; True where locks cannot be had (no fcntl, or a file system without them)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: a file system that does not lock
        return True
    return True
