#!/usr/bin/env python
"""trunksplit under torch.compile, side by side with torch's own memory budget: one run per model.

    python tools/compile_benchmark.py --arch resnet50 convnext_tiny vit_b_16 --budgets 0.7 0.5 0.3

Rows, each a training step of the same trunk on the same batch (gradients kept):
trunksplit eager at each budget, the plain trunk compiled with inductor, compiled with
``activation_memory_budget`` at each budget, and the budget-planned trunk compiled two ways:
``torch.compile(trunk)`` (dynamo traces the trunk; checkpointed segments and regions run eagerly
at graph breaks) and ``trunk.compile()`` (each unit compiled, or run eagerly where its step measured
faster so, and each selective region of the last segment compiled whole as torch's checkpoint
operator; the other checkpoints eager; convolution weights stored channels-last). Peaks are the
step's beyond what was live before it. On CPU every row is metered by ``torch.profiler``'s memory
events (``trunksplit.planning.memory.profiled_peak``: the only meter that sees inside compiled code;
it reads a few percent above the exact tensor tracker), and the eager rows by the tracker too; on
CUDA by the allocator's statistics. Ratios are to the plain eager step under the same meter; step
times are medians of interleaved repeats, as ratios to the compiled plain trunk. ``--channels-last``
stores every row's model and input channels-last first (the baseline a user of that layout compiles).
A budget below a model's floor at the input has no rows for that model (each kind compares the budgets
trunksplit meets); a line names the smallest budget it would meet.
"""
import argparse
import copy
import time
import warnings

import torch
from tabulate import tabulate
from torch.utils.flop_counter import FlopCounterMode

from trunksplit import BudgetTooLowError, CheckpointedTrunk, PeakMemory
from trunksplit.planning.memory import profiled_peak
from trunksplit.cli.parser import batch_shape
from trunksplit.ssl.backbones import build_backbone
from trunksplit.planning.timing import interleaved_medians


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["resnet50"])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--objective", choices=["flops", "time"], default="flops", help="what the budget plans minimise (see trunksplit plan --objective)")
    p.add_argument("--channels-last", action="store_true", help="every row's weights and input in channels-last memory format")
    p.add_argument("--plot", help="also draw every model's rows to this image (peak against step time)")
    return p


def _step(model, x) -> None:
    sum(f.float().sum() for f in model(x)).backward()


def _peak(model, x, exact: bool) -> int:
    """The peak of a step after the first (gradients kept: zeroed, not freed)."""
    if any(p.grad is None for p in model.parameters()):
        _step(model, x)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    if x.is_cuda or exact:
        with PeakMemory(x.device) as mem:
            _step(model, x)
        return mem.peak_bytes
    return profiled_peak(lambda: _step(model, x))


def _compiled(model, x, budget=None):
    """``torch.compile(model)``, compiled by two steps (under ``activation_memory_budget``, if
    given); returns it and the seconds they took."""
    # Private: each row compiles its own graph. Dynamo would hand a new module of the same
    # structure the graph compiled for an earlier row (parameters are graph inputs); a backend
    # object of its own per row gets a graph of its own (dynamo guards a graph on its backend),
    # while torch._dynamo.reset() would drop the earlier rows' graphs, to be compiled again at
    # another budget. Inductor's caches are skipped for the same reason; shapes are static, as the
    # same code compiled for another model would otherwise turn dynamic. activation_memory_budget
    # is torch's own memory budget, read when AOT autograd partitions the graph.
    inductor = torch._dynamo.lookup_backend("inductor")
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.force_disable_caches = True
    torch._functorch.config.activation_memory_budget = 1.0 if budget is None else budget
    compiled = torch.compile(model, backend=lambda gm, example_inputs: inductor(gm, example_inputs), dynamic=False)
    start = time.perf_counter()
    try:
        for _ in range(2):  # warm: whatever a second step would compile, it compiles here
            _step(compiled, x)
    finally:
        torch._functorch.config.activation_memory_budget = 1.0
    return compiled, time.perf_counter() - start


def rows_for(arch: str, x: torch.Tensor, budgets, objective: str = "flops", memory_format=torch.contiguous_format):
    """Every row, built, compiled and its peak measured at once (a compiled row measured after
    others compiled can see a graph compiled again under another budget)."""
    torch.manual_seed(0)
    base = build_backbone(arch, x.shape[-1]).to(x.device, memory_format=memory_format)

    def trunk(**kw):
        return CheckpointedTrunk(copy.deepcopy(base), ["flatten"], gradients="kept", **kw)

    plain = trunk()
    forward = _forward_flops(plain, x)

    def row(name, kind, model, seconds, recompute, eager=False):
        r = dict(name=name, kind=kind, model=model, seconds=seconds, recompute=recompute, peak=_peak(model, x, exact=False))
        if eager:
            r["exact"] = _peak(model, x, exact=True)
        return r

    def planned(b, compiled=False):
        t = trunk(memory_budget=b, objective=objective)
        if compiled:
            t.compile(dynamic=False)  # before planning: a compiled trunk plans for its compiled regions
        start = time.perf_counter()
        plan = t.plan_for(x)  # eagerly, as a compiled trunk's first forward would
        return t, time.perf_counter() - start, sum(s.recompute_flops for s in plan.segments) / forward

    rows, met = [row("plain eager", "plain eager", plain, 0.0, 0.0, eager=True)], []
    for b in budgets:
        try:
            t, seconds, recompute = planned(b)
        except BudgetTooLowError as e:  # no row at this budget, in any kind: the rows compare budgets met
            print(f"{arch}: budget {b:g} left out: {e}", flush=True)
            continue
        met.append(b)
        rows.append(row(f"trunksplit {b:g} eager", "trunksplit eager", t, seconds, recompute, eager=True))
    budgets = met
    rows.append(row("compile plain", "compile plain", *_compiled(trunk(), x), 0.0))
    for b in budgets:
        rows.append(row(f"compile, activation_memory_budget {b:g}", "compile, activation_memory_budget", *_compiled(trunk(), x, b), None))
    for b in budgets:
        t, seconds, recompute = planned(b)
        model, compiling = _compiled(t, x)
        rows.append(row(f"trunksplit {b:g} torch.compile(trunk)", "trunksplit torch.compile(trunk)", model, seconds + compiling, recompute))
    for b in budgets:
        t, seconds, recompute = planned(b, compiled=True)
        rows.append(row(f"trunksplit {b:g} trunk.compile()", "trunksplit trunk.compile()", t, seconds + _compiled_inside(t, x), recompute))
    return rows


def _compiled_inside(trunk, x) -> float:
    """``trunk.compile()`` (called before planning): each unit and each selective region compiled with
    inductor, the other checkpoints eager; compiled by two steps (the second compiles the recomputes'
    variant). Returns the seconds."""
    start = time.perf_counter()
    for _ in range(2):
        _step(trunk, x)
    return time.perf_counter() - start


def _forward_flops(model, x) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops()


def measure_times(rows, x, repeats: int) -> None:
    """Each row's median step time (``r["step"]``), the rows interleaved after one untimed round."""
    medians = interleaved_medians({i: (lambda m=r["model"]: _step(m, x)) for i, r in enumerate(rows)}, x.device, repeats)
    for i, r in enumerate(rows):
        r["step"] = medians[i]


def table(arch, rows, x, objective: str) -> str:
    plain = rows[0]
    compiled_time = next(r for r in rows if r["name"] == "compile plain")["step"]
    meter = "allocator" if x.is_cuda else "profiler"
    body = [[r["name"], f"{r['peak'] / 2**20:.1f}", f"{r['peak'] / plain['peak']:.2f}",
             f"{r['exact'] / plain['exact']:.2f}" if "exact" in r else "-",
             "-" if r["recompute"] is None else f"{r['recompute']:.2f}",
             f"{r['step'] / compiled_time:.2f}", f"{r['seconds']:.1f}"] for r in rows]
    headers = ["row", f"peak MiB ({meter})", f"/ plain eager ({meter})", "/ plain eager (tracker)", "recompute / forward",
               "step time / compiled plain", "plan + compile s"]
    return f"### {arch}, input {tuple(x.shape)}, {x.device.type}, gradients kept, objective {objective}\n\n" + tabulate(body, headers=headers, tablefmt="github")


def plot(results, path: str) -> None:
    """Per model: each row's peak (/ plain eager) against its step time (/ compiled plain), one
    marker per kind of row, budgets joined in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.6), squeeze=False)
    for ax, (arch, rows) in zip(axes[0], results):
        plain, compiled = rows[0], next(r for r in rows if r["name"] == "compile plain")["step"]
        for kind in dict.fromkeys(r["kind"] for r in rows):
            points = [(r["step"] / compiled, r["peak"] / plain["peak"]) for r in rows if r["kind"] == kind]
            ax.plot(*zip(*points), marker="o", label=kind)
        ax.set_title(arch)
        ax.set_xlabel("step time / compiled plain step")
        ax.set_ylabel("step peak / plain eager peak (profiler)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(0)).to(device)
    results = []
    for arch in args.arch:
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        rows = rows_for(arch, x.contiguous(memory_format=fmt), args.budgets, args.objective, fmt)
        measure_times(rows, x, args.repeats)
        print(table(arch, rows, x, args.objective) + "\n", flush=True)
        results.append((arch, rows))
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
