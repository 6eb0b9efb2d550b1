"""The losses' collectives, and one rank's step measured alone (``alone_as_one_of``): the batch fit
measures a rank's step in one process, with the memory of the real step among its ranks and no
collective, so that ranks whose measurements differ never wait on each other."""
import contextlib

import pytest
import torch

from trunksplit.planning.memory import PeakMemory
from trunksplit.ssl.dino import update_center
from trunksplit.ssl.losses import alone_as_one_of, dino_loss, nt_xent, sinkhorn, swav_loss

from distributed_harness import run_processes


def _swav(scores):
    """SwAV's loss without a queue: the two large crops' codes, Sinkhorn over the batch, predicted from the other crops."""
    return swav_loss(scores, {i: sinkhorn(scores[i].detach(), 3, 0.05) for i in range(2)}, 0.1)


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
        _swav(scores).backward()

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


def _outputs(rank: int) -> list:
    """Rank ``rank``'s half of a step's outputs (two large crops and a small one, 8 images of 16 each): rank
    1's run higher, so that a rank's outputs scaled apart from the other's show."""
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(16, 10, generator=g) + torch.cat([torch.zeros(8, 1), torch.full((8, 1), 0.5)]) for _ in range(3)]
    return [s[8 * rank: 8 * rank + 8].clone().requires_grad_() for s in whole]


def _dino(outputs, center):
    """DINO's loss, its teacher's outputs a fixed function of the student's large crops; then the centre moves,
    as the step moves it."""
    teacher = [o.detach().flip(-1) * 2 for o in outputs[:2]]
    loss = dino_loss(outputs, teacher, center, 0.1, 0.04)
    update_center(center, teacher, 0.9)
    return loss


LOSSES = {  # each method's loss of the step's outputs (and DINO's centre)
    "simclr": lambda outputs, center: nt_xent(outputs[0], outputs[1], 0.1),
    "swav": lambda outputs, center: _swav(outputs),
    "dino": _dino,
}


def _center() -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, 10).reshape(1, -1)


def _over_ranks(rank, world_size, method, expected_grads, expected_center):
    outputs, center = _outputs(rank), _center()
    LOSSES[method](outputs, center).backward()
    for s, expected in zip(outputs, expected_grads):  # DDP averages the ranks' gradients: each rank's own, divided by the world
        if expected is None:  # SimCLR's third crop: unused
            assert s.grad is None
            continue
        torch.testing.assert_close(s.grad / world_size, expected[8 * rank: 8 * rank + 8], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(center, expected_center)


@pytest.mark.parametrize("method", sorted(LOSSES))
def test_each_loss_over_two_ranks_has_the_gradients_of_the_whole_batch_in_one_process(method):
    """What DDP trains on 2 ranks of 8 images is what one process computes on the 16: SimCLR's negatives are
    every rank's views, SwAV's codes one equal partition of every rank's batch, DINO's centre the mean over
    every rank. SwAV's once failed it: each rank subtracted its own largest score before the exponential,
    which weighted the ranks' columns unequally in the partition's row sums."""
    whole = [torch.cat(parts).detach().requires_grad_() for parts in zip(_outputs(0), _outputs(1))]
    center = _center()
    LOSSES[method](whole, center).backward()
    run_processes(_over_ranks, 2, (method, [s.grad for s in whole], center), timeout=120)
