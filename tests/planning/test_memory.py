"""The meters: ProfiledPeak against hand-counted bytes, on one process and on gloo ranks."""
import torch
import torch.distributed as dist

from trunksplit.planning.memory import ProfiledPeak

from distributed_harness import run_processes

FLOAT = 4


def test_profiled_peak_counts_what_is_allocated_beyond_the_start():
    before = torch.empty(10_000)  # live before: not counted
    with ProfiledPeak() as meter:
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a
        c = torch.empty(500)
    assert meter.peak_bytes == 3000 * FLOAT
    del before, b, c


def _reduce_scatter_readings(rank, world_size, n, reps, out):
    inp = torch.randn(n)
    readings = []
    for _ in range(reps):
        with ProfiledPeak() as meter:
            for _ in range(3):
                shard = torch.empty(n // world_size)
                dist.reduce_scatter_tensor(shard, inp)
                del shard
        readings.append(meter.peak_bytes)
    torch.save(readings, f"{out}/readings{rank}.pt")


def test_a_gloo_collectives_copy_is_counted_until_the_collective_returns(tmp_path):
    # gloo clones a reduce-scatter's input and frees the clone wherever its work object dies, often on
    # its own worker thread, where the profiler records nothing: at random the free goes missing and
    # the copy would seem to live on, adding a whole input to the next collective's reading
    n, reps = 2**18, 6
    run_processes(_reduce_scatter_readings, 2, args=(n, reps, str(tmp_path)))
    for rank in range(2):
        # by hand: each round holds its shard (n / 2) and gloo's copy of the input (n), one round at a time
        assert torch.load(tmp_path / f"readings{rank}.pt") == [(n // 2 + n) * FLOAT] * reps
