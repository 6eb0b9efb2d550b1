"""Step time of vissl's manual DDP path vs native DDP: two gloo processes, two forwards per step.

    python tools/benchmark.py --ddp [--arch resnet50] [--input 4x3x112x112] [--steps 6]

Both paths run in the same processes, interleaved step by step; rank 0 prints
the median step times and their ratio.
"""
import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from ..distributed.ddp import manual_gradient_all_reduce, manual_sync_params
from ..ssl.data import usable_cores
from ..trunk import CheckpointedTrunk
from .parser import batch_shape, shape_text


def _step(ddp, views, manual):
    if manual:
        with ddp.no_sync():
            manual_sync_params(ddp)
            sum(ddp(v)[0].pow(2).mean() for v in views).backward()
        manual_gradient_all_reduce(ddp)
    else:
        sum(ddp(v)[0].pow(2).mean() for v in views).backward()


def _worker(rank, world, port, args, threads):
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    views = [torch.randn(*args.input, generator=g) for _ in range(2)]
    paths = {}
    for name, manual in (("native (non-reentrant, DDP hooks)", False), ("manual (reentrant, no_sync + all-reduce)", True)):
        torch.manual_seed(0)
        trunk = CheckpointedTrunk(getattr(torchvision.models, args.arch)(), ["flatten"], num_splits=args.splits, use_reentrant=manual)
        paths[name] = (DDP(trunk), manual, [])
    for _, (ddp, manual, _) in paths.items():
        _step(ddp, views, manual)  # warm-up
    for _ in range(args.steps):
        for ddp, manual, times in paths.values():
            dist.barrier()
            t = time.perf_counter()
            _step(ddp, views, manual)
            dist.barrier()
            times.append(time.perf_counter() - t)
    if rank == 0:
        medians = {name: statistics.median(times) for name, (_, _, times) in paths.items()}
        native, manual = medians.values()
        for name, m in medians.items():
            print(f"{name:45s} median step {m:.3f} s")
        print(f"manual / native step time: {manual / native:.2f}  ({args.arch}, 2 gloo processes, 2 views of {shape_text(args.input)} per rank, {args.splits} segments, {args.steps} interleaved steps)")
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--input", type=batch_shape, default=(4, 3, 112, 112), help="one view's batch per rank, NxCxHxW (two views a step)")
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, usable_cores() // 2)
    mp.spawn(_worker, args=(2, port, args, threads), nprocs=2, join=True)
    return 0
