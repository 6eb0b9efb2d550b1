#!/usr/bin/env python
"""Benchmark checkpoint plans: `python tools/benchmark.py [--arch resnet50 resnet101 ...] [--ddp]`.

Without --ddp: the same as `trunksplit bench` (see `trunksplit bench --help`).
With --ddp: step time of the manual DDP path vs native DDP, two gloo processes.
"""
import sys

if __name__ == "__main__":
    if "--ddp" in sys.argv:
        from trunksplit.cli.bench_ddp import main
    else:
        from trunksplit.cli import main

        sys.argv.insert(1, "bench")
    sys.exit(main())
