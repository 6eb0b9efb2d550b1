import collections
import copy
import functools
import hashlib
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import profile_memo  # noqa: E402  (tests/ on the path first; imports no torch until installed)

# The stop tests test a command a terminal runs: SIGINT handled by Python. A suite started from a
# script with `&` (no job control) inherits SIGINT ignored, as do its workers and their children,
# and a run keeps an ignored signal ignored; the test of that case sets it itself.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Building a torchvision model is mostly its random initialisation (ResNet-18: 80 ms, a copy of it 20 ms),
# and the suite builds hundreds, most from a seed a test built the same model from before. A builder called
# with the same arguments, random state, default dtype and device makes the same model; so the first is
# kept, and a later call gets a copy of it and the random state that building it left: only time differs.
_BUILT = collections.OrderedDict()  # the last few models built, oldest first; big ones are not kept


def _remembered(builder):
    import torch  # in a process that runs tests (see pytest_configure)

    @functools.wraps(builder)
    def build(*args, **kwargs):
        key = (builder.__name__, args, tuple(sorted(kwargs.items())), torch.get_default_dtype(), str(torch.get_default_device()),
               hashlib.sha1(torch.get_rng_state().numpy()).digest())
        try:
            kept = _BUILT.get(key)
        except TypeError:  # an unhashable argument: built as asked
            return builder(*args, **kwargs)
        if kept is not None:
            _BUILT.move_to_end(key)
            torch.set_rng_state(kept[1])
            return copy.deepcopy(kept[0])
        model = builder(*args, **kwargs)
        if sum(p.numel() for p in model.parameters()) <= 30_000_000:
            _BUILT[key] = (copy.deepcopy(model), torch.get_rng_state())
            while len(_BUILT) > 8:
                _BUILT.popitem(last=False)
        return model
    return build


def _set_up_a_test_process() -> None:
    """What a process that runs tests needs: its share of the cores, the builders remembered, the profiles too."""
    import torch
    import torchvision

    # Under pytest-xdist (pytest.ini runs one worker per core) each worker gets its share of the
    # cores: every worker taking all of them oversubscribes the machine, and OpenMP kernels then
    # run several times slower. Results do not depend on it: every comparison in the suite runs
    # its reference in the same process, with the same thread count.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
    for name in torchvision.models.list_models(module=torchvision.models):
        setattr(torchvision.models, name, _remembered(getattr(torchvision.models, name)))
    # the launcher builds its trunk by name (trunksplit/ssl/backbones.py), through torchvision's registry, which
    # holds the builders themselves, not the names above
    torchvision.models.get_model = _remembered(torchvision.models.get_model)
    profile_memo.install()  # a chain profiled again gets its first profile's figures: tests/profile_memo.py


def pytest_configure(config):
    """Set up a process that runs tests, before it collects any. pytest-xdist's controller only hands tests
    out to its workers, which it starts once configured: importing torch there (2.8 s) delayed them all."""
    hands_tests_out = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no" and not config.getoption("collectonly")
    if not hands_tests_out:
        _set_up_a_test_process()


_SHARED_PROFILES = profile_memo.share_between_processes()  # by this process and the workers it starts


@pytest.fixture(autouse=True, scope="module")
def _profiles_remembered_in_a_modules_fixtures_unless_it_is_of_profiling(request):
    """See tests/profile_memo.py: set up before a module's own fixtures, whatever test ran before."""
    profile_memo.memo_off[0] = request.node.nodeid.startswith(profile_memo.OWN_TESTS)
    yield
    profile_memo.memo_off[0] = True


@pytest.fixture(autouse=True)
def _profiles_remembered_unless_the_test_is_of_profiling(request):
    """See tests/profile_memo.py: what a test of profiling itself asserts must be what ran."""
    module_setting = profile_memo.memo_off[0]
    profile_memo.memo_off[0] = ("monkeypatch" in request.fixturenames or request.node.get_closest_marker("fresh_profile") is not None
                                or request.node.nodeid.startswith(profile_memo.OWN_TESTS))
    yield
    profile_memo.memo_off[0] = module_setting


def pytest_unconfigure(config):
    profile_memo.stop_sharing(_SHARED_PROFILES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: a run without it (-p no:xdist) still starts
def pytest_xdist_auto_num_workers(config):
    """One worker for the CUDA tier (``-m cuda``): the tests share one GPU and read its allocator's peaks."""
    marks = config.getoption("markexpr", "") or ""
    if "cuda" in marks and "not cuda" not in marks:
        return 1
    return None


def pytest_collection_modifyitems(config, items):
    """One of the suite's longest tests (the GPU check's CPU run, 8 s; 40 s when this was written) first:
    collected last, it began when the other worker had little left and kept one core busy alone at the end."""
    items.sort(key=lambda item: item.fspath.basename != "test_gpu_check.py")  # stable: the rest keep their order
