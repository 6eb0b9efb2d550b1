import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist (pytest.ini runs one worker per core) each worker gets its share of the
# cores: every worker taking all of them oversubscribes the machine, and OpenMP kernels then
# run several times slower. Results do not depend on it: every comparison in the suite runs
# its reference in the same process, with the same thread count.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _workers))

# The stop tests test a command a terminal runs: SIGINT handled by Python. A suite started from a
# script with `&` (no job control) inherits SIGINT ignored, as do its workers and their children,
# and a run keeps an ignored signal ignored; the test of that case sets it itself.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config):
    """One worker for the CUDA tier (``-m cuda``): the tests share one GPU and read its allocator's peaks."""
    marks = config.getoption("markexpr", "") or ""
    if "cuda" in marks and "not cuda" not in marks:
        return 1
    return None


def pytest_collection_modifyitems(config, items):
    """The suite's longest test (the GPU check's CPU run, 40 s) first: collected last, it began when
    the other worker had little left and kept one core busy alone at the end."""
    items.sort(key=lambda item: item.fspath.basename != "test_gpu_check.py")  # stable: the rest keep their order
