"""The suite's second shortcut (the first: ``conftest._remembered``): a chain profiled again in one test
process, with the same units, input layout, arguments and torch settings, gets the figures its first
profile gave. Only time differs, for the reason a profile measures a repeated block once
(:mod:`trunksplit.planning.same_units`): the tracker counts storages, which follow shapes, strides, dtypes
and the ops that run, never values. The suite profiles ResNet-18 at 2x3x64x64 a few hundred times (the
same plan at each gradient mode, a budget ladder...): profiling was a quarter of its time (2026-12-05), 44% of that
repeats, and the suite went from 434 to 375-392 s on 2 cores. The figures go to a folder the test processes share
(``SHARED_ENV``, made by the first of them, pytest-xdist's controller): of the profiles left, a fifth of the time went
to chains the other worker had profiled already (2026-12-05: 19.5 of 87 s).

What a profile's figures can follow beyond its arguments is in the key: each unit's structure and layouts
(``measurement_key``), and the settings that choose the ops a forward runs (autocast, SDPA's backends,
deterministic algorithms, oneDNN, grad mode). A unit holding an object the key cannot compare by value
(a ``torch.compile`` wrapper, a traced chain's tuple input) is profiled each time.

Never remembered, so that what a test asserts of profiling itself is what ran (``memo_off``):
tests that patch anything (the ``monkeypatch`` fixture), tests marked ``fresh_profile`` (profiling leaves
the user's hooks, statistics and random state alone), the profiler's own files (``OWN_TESTS``), a
profile that reports progress or is the allocator's, and any process with a process group (FSDP2's sharded units).
Checked by tests/test_conftest.py."""
import functools
import hashlib
import os
import pickle
import shutil
import tempfile
from typing import Dict, Optional

OWN_TESTS = ("tests/planning/test_memory.py", "tests/planning/test_same_units.py", "tests/planning/test_timing.py", "tests/test_conftest.py")
REAL = None  # the library's profile_units, once installed
_FIGURES: Dict[tuple, object] = {}
memo_off = [True]  # set for each module and each test (conftest's autouse fixtures), off outside them
SHARED_ENV = "TRUNKSPLIT_SUITE_PROFILES"  # the folder the controller makes and its workers inherit (they start after conftest is imported)


def settings() -> tuple:
    """The torch settings that can change which ops a forward runs, or the tensors they make."""
    import torch  # not at the top: see install

    return (tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
            torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
            torch.backends.mkldnn.enabled)


def key(units, x, spans, timed, allocator, use_reentrant, features):
    """What two profiles share where they give the same figures; None: profile it."""
    import torch  # not at the top: see install
    from trunksplit.planning.same_units import measurement_key

    if memo_off[0] or allocator or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None  # the allocator's figures depend on what its cache holds, as same_units says: measured each time
    try:
        return measurement_key([u for _, u in units], x, tuple(n for n, _ in units), tuple(map(tuple, spans)), timed, allocator, use_reentrant,
                               tuple(features), settings())
    except TypeError:  # spans or features not as the profiler documents them: let it say so
        return None


def profile_units(units, x, spans=(), timed=False, allocator=False, progress=None, use_reentrant=False, features=()):
    k = None if progress is not None else key(units, x, spans, timed, allocator, use_reentrant, features)
    if k is None:
        return REAL(units, x, spans, timed, allocator, progress, use_reentrant, features)
    if k not in _FIGURES:
        path = _shared_path(k)
        figures = _read(path)
        if figures is None:
            figures = REAL(units, x, spans, timed, allocator, progress, use_reentrant, features)
            _write(path, figures)
        _FIGURES[k] = figures
        while len(_FIGURES) > 256:  # a few MiB at most: figures are tuples of ints
            _FIGURES.pop(next(iter(_FIGURES)))
    return _FIGURES[k]


def _shared_path(k) -> Optional[str]:
    """Where another test process keeps the figures of key ``k``: its pickle's digest (equal bytes, equal keys; a key
    pickled in another order, a frozenset's, only misses). None: no shared folder, or a key that does not pickle."""
    folder = os.environ.get(SHARED_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    try:
        return os.path.join(folder, hashlib.sha1(pickle.dumps(k, protocol=4)).hexdigest())
    except (pickle.PicklingError, TypeError, AttributeError):  # a class defined in a function, a lambda
        return None


def _read(path: Optional[str]):
    """The figures another process wrote at ``path``; None where none are (yet)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _write(path: Optional[str], figures) -> None:
    """Written whole under another name, then renamed: a reader never sees half a file."""
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(figures, f, protocol=4)
        os.replace(tmp, path)
    except (pickle.PicklingError, TypeError, AttributeError, OSError):
        if os.path.exists(tmp):
            os.remove(tmp)


def share_between_processes() -> Optional[str]:
    """The first test process (the controller, or the only one) makes the shared folder; it returns it to remove at the end."""
    if os.environ.get(SHARED_ENV):
        return None
    os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="trunksplit-suite-profiles-")
    return os.environ[SHARED_ENV]


def stop_sharing(folder: Optional[str]) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_ENV, None)


def install() -> None:
    """Put the remembering profiler where the library calls it (each module imported it by name). Imported
    here, not at the top: pytest-xdist's controller imports this module for the shared folder alone and runs
    no test, so it imports no torch (what its workers wait for)."""
    global REAL
    from trunksplit.planning import profile, scaled, search

    if REAL is not None:  # installed already: the library's names hold this module's profile_units
        return
    REAL = profile.profile_units
    functools.update_wrapper(profile_units, REAL)  # its name and docstring
    for module in (profile, search, scaled):
        module.profile_units = profile_units
