"""On a CPU the launcher keeps the memory a step frees for the next step (glibc's malloc told so), as
CUDA's caching allocator does: the reference is the kernel's own count of the pages it had to fault in."""
import os
import subprocess
import sys

import pytest

from trunksplit.ssl.parallel import keep_freed_host_memory

# two warm-up training steps, then the page faults of two more: a step's activations made again
_STEPS = """
import resource, sys, torch, torchvision
from trunksplit.ssl.parallel import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
model, x = torchvision.models.resnet18(), torch.randn(8, 3, 96, 96)
for _ in range(2):
    model(x).sum().backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    model(x).sum().backward()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_in_two_steps(how, env):
    done = subprocess.run([sys.executable, "-c", _STEPS, how], capture_output=True, text=True, env=env, check=True, timeout=300)
    kept, faults = done.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_a_steps_freed_memory_is_made_again_without_the_kernel_faulting_it_in(monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    default, faulted = _faults_in_two_steps("default", env)
    activations = 8 * 64 * 48 * 48 * 4 // os.sysconf("SC_PAGE_SIZE")  # the stem's output alone, in pages
    assert not default and faulted > activations, faulted  # glibc's default: handed back, faulted in again each step
    kept, faulted_kept = _faults_in_two_steps("keep", env)
    assert kept and faulted_kept < faulted / 10, (faulted_kept, faulted)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert keep_freed_host_memory() is False  # a user's own MALLOC_* setting wins: left alone
