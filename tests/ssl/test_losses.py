"""The losses' collectives, and one rank's step measured alone (``alone_as_one_of``): the batch fit
measures a rank's step in one process, with the memory of the real step among its ranks and no
collective, so that ranks whose measurements differ never wait on each other."""
import contextlib

import torch

from trunksplit.planning.memory import PeakMemory
from trunksplit.ssl.dino import update_center
from trunksplit.ssl.losses import alone_as_one_of, nt_xent, swav_loss

from distributed_harness import run_processes


# bytes: every tensor these steps hand a collective (SimCLR's: two gathers of 2 x 64 x 4 floats, their two
# stacked gradients as many), all of which gloo's thread may hold a moment longer
GLOO_HOLDS = 8192


def _losses(rank, world_size):
    """Each loss's forward and backward: its peak bytes among the ranks and alone as one of them."""
    g = torch.Generator().manual_seed(rank)

    def simclr():
        z1, z2 = (torch.randn(64, 4, generator=g).requires_grad_() for _ in range(2))  # the logits, 128 x 128 per rank, outweigh the gathers
        nt_xent(z1, z2, 0.1).backward()

    def swav():
        scores = [torch.randn(8, 16, generator=g).requires_grad_() for _ in range(3)]
        swav_loss(scores, 2, 0.1, 3, 0.05).backward()

    def dino_center():
        update_center(torch.zeros(1, 16), [torch.randn(8, 16, generator=g) for _ in range(2)], 0.9)

    for step in (simclr, swav, dino_center):
        peaks = {}
        for alone in (False, True):
            with alone_as_one_of(world_size) if alone else contextlib.nullcontext(), PeakMemory("cpu") as mem:
                step()
            peaks[alone] = mem.peak_bytes
        # among the ranks, gloo's thread may hold a collective's tensor a moment longer (SwAV's 64-byte row
        # sums, SimCLR's gathered parts were seen so): the real step reads that much more, at random
        assert 0 < peaks[True] <= peaks[False] <= peaks[True] + GLOO_HOLDS, (step.__name__, peaks)
    if rank == 0:  # a step the other rank never runs: alone, it waits on no one (a collective would hang here)
        with alone_as_one_of(world_size):
            simclr()
            swav()
            dino_center()


def test_a_rank_alone_has_the_memory_of_its_step_among_the_ranks_and_runs_no_collective():
    run_processes(_losses, 2, timeout=120)
