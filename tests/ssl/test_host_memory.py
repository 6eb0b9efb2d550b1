"""On a CPU the launcher, the commands and every benchmark's timing keep the memory a step frees for the next
step (glibc's malloc told so), as CUDA's caching allocator does: the reference is the kernel's own count of the
pages it had to fault in."""
import os
import subprocess
import sys

import pytest

from trunksplit.planning.timing import keep_freed_host_memory

# glibc told to hand back every block above 128 KiB (its initial threshold, which its default raises as
# blocks are freed: the default is no reference, two steps faulted in 216 to 38,338 pages run to run on a
# loaded machine, 2026-11-28); then the page faults of two steps after two warm-up steps, before and after
# KEEP (keep_freed_host_memory(), or a benchmark's timing) in the same process
_STEPS = """
import ctypes, ctypes.util, resource, torch, torchvision
from trunksplit.planning.timing import interleaved_medians, keep_freed_host_memory
ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed
torch.manual_seed(0)
model, x = torchvision.models.resnet18(), torch.randn(8, 3, 96, 96)

def faults_in_two_steps():
    for _ in range(2):
        model(x).sum().backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2):
        model(x).sum().backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

handing_back = faults_in_two_steps()
kept = KEEP
print(kept, handing_back, faults_in_two_steps())
"""


@pytest.mark.slow  # a second Python and four ResNet-18 steps (4-9 s); the fast suite keeps the settings' test below
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
@pytest.mark.parametrize("keep", ["keep_freed_host_memory()", 'bool(interleaved_medians({"step": lambda: model(x).sum().backward()}, "cpu", repeats=1))'],
                         ids=["the launcher's and the commands' call", "a benchmark timing its steps"])
def test_a_steps_freed_memory_is_made_again_without_the_kernel_faulting_it_in(keep):
    """A benchmark's steps timed with glibc's default each paid for faulting their pages in, the more the higher
    their peak: bench timed a wide ResNet-50's plain step slower than its checkpointed ones (docs/benchmarks.md)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _STEPS.replace("KEEP", keep)], capture_output=True, text=True, env=env, check=True, timeout=300)
    kept, handing_back, faulted_kept = done.stdout.split()
    activations = 8 * 64 * 48 * 48 * 4 // os.sysconf("SC_PAGE_SIZE")  # the stem's output alone, in pages
    assert int(handing_back) > 10 * activations, handing_back  # the count sees a step's memory faulted in again
    # kept: 0 to 1,941 pages against 161,281 to 163,779 handed back (twelve runs, three at once on 2 cores)
    assert kept == "True" and int(faulted_kept) < int(handing_back) / 20, (faulted_kept, handing_back)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_glibc_takes_the_settings_unless_the_user_set_malloc_their_own_way(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    assert keep_freed_host_memory() is True  # glibc accepted every setting
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert keep_freed_host_memory() is False  # a user's own MALLOC_* setting wins: left alone
