"""The benchmark behind ``trunksplit bench`` and ``tools/benchmark.py``.

Every row is one way of running the same trunk on the same batch: the plain
trunk, torch's ``checkpoint_sequential`` with equal segments, vissl's plan,
the balanced plan, memory-budget plans (with regions, and with cuts alone),
the smallest feasible budget, and selective wrapping of residual blocks. Peaks are measured (``PeakMemory``) on a second step, in the gradient
mode asked for: ``allocated`` (torch's default ``zero_grad()``: the step
allocates the gradients), ``kept`` (they exist before the step) or
``in_backward`` (every row's optimizer steps in backward, each gradient freed at
its update: :func:`trunksplit.optimizer_in_backward`); step times are medians of
interleaved repeats, reported as ratios to the plain trunk measured in the same
run (in ``in_backward`` mode the plain trunk steps in backward too).
"""
import copy
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential
from tqdm import tqdm

from ..chains import feature_blocks
from ..chains.traced import ChainUnit
from ..fit import NAMED_OPTIMIZERS
from ..in_backward import optimizer_in_backward
from ..planning.memory import PeakMemory
from ..planning.peak import PeakModel
from ..planning.plan import policy_counts
from ..planning.request import priced_in
from ..planning.budget import MemoryBudget
from ..planning.search import annotate, best_plan, peak_model, plan_from_cuts, plan_trunk
from ..planning.timing import wall_seconds
from ..recompute.select import every_k, wrap_selected
from ..ssl.backbones import build_backbone
from ..trunk import CheckpointedTrunk


@dataclass
class Row:
    arch: str
    name: str
    strategy: str  # line in the plot: plain, checkpoint_sequential, vissl, balanced, budget, cuts only, selective
    run: Optional[Callable[[torch.Tensor], torch.Tensor]]  # x -> scalar loss; None where it cannot run
    module: Optional[nn.Module] = None  # what holds the parameters ``run`` trains
    predicted: Optional[int] = None
    recompute: Optional[float] = None  # recomputed FLOPs / forward FLOPs
    note: str = ""
    peak: Optional[int] = None
    times: Optional[List[float]] = None
    profile_seconds: Optional[float] = None  # plain row: the time a cost-aware plan spends measuring


def _trunk_rows(arch: str, x: torch.Tensor, splits: Sequence[int], budgets: Sequence[float], selective: bool, gradients: str,
                objectives: Sequence[str] = ("flops",), optimizer: str = "sgd", width: float = 1.0) -> List[Row]:
    torch.manual_seed(0)
    trunk = _trunk_maker(build_backbone(arch, x.shape[-1], width).to(x.device), gradients, optimizer)
    arch = arch if width == 1 else f"{arch} ({width:g}x)"  # the rows' and table's name: SimCLR's "ResNet-50 (2x)"
    plain = trunk(objective="time" if "time" in objectives else "flops")  # profiled with timings where a plan needs them
    start = time.perf_counter()
    model = peak_model(plain.plan_request(), x, regions=True)  # what a budget plan measures, once per input shape
    profile_seconds = time.perf_counter() - start
    total_flops = sum(model.costs.flops)
    # the same measurements, priced per objective, and without regions
    same = dict(costs=model.costs, feature_units=model.features, gradients=gradients, update_temporaries=model.update_temporaries)
    priced = {o: PeakModel(**same, spans=model.spans, objective=o) for o in objectives}
    cuts_only = PeakModel(**same, objective=objectives[0])

    def trunk_row(name, strategy, trunk):
        if trunk.cost_aware:  # planned from the measurement above, not measured again per row
            plan = plan_trunk(trunk.plan_request(), x, priced[trunk.objective] if trunk.memory_budget is not None else cuts_only)
            trunk.store_plan(trunk.key_for(x), plan)
        else:
            plan = annotate(trunk.plan_for(x), model)
        return _plan_row(arch, name, strategy, trunk, plan, total_flops)

    rows = [Row(arch, "plain", "plain", _loss_fn(plain), plain, model.peak([0]), 0.0, profile_seconds=profile_seconds)]
    for k in splits:
        rows.append(_sequential_row(arch, trunk(), x, k, model, total_flops))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows.append(trunk_row(f"vissl k={k}", "vissl", trunk(num_splits=k)))
            rows.append(trunk_row(f"balanced k={k}", "balanced", trunk(num_splits=k, strategy="balanced")))
    for b in budgets:
        rows += [_budget_row(arch, b, o, len(objectives) > 1, trunk_row, trunk) for o in objectives]
        rows.append(_cuts_only_row(arch, trunk(memory_budget=b, objective=objectives[0]), x, cuts_only, model, total_flops))
    if budgets:  # the smallest feasible budget, asked for
        floor = model.peak(*best_plan(model, _splittable(plain), []))
        rows.append(trunk_row("budget floor", "budget", trunk(memory_budget=floor, objective=objectives[0])))
    if selective:
        block = _block_type(plain)
        for k, label in [(1, "every block"), (2, "every 2nd block")]:
            wrapped = trunk()
            names = wrap_selected(wrapped, every_k(k, block))
            rows.append(Row(arch, f"wrap {label} ({len(names)})", "selective", _loss_fn(wrapped), wrapped))
    return rows


def _trunk_maker(base: nn.Module, gradients: str, optimizer: str) -> Callable[..., CheckpointedTrunk]:
    """What makes each row's trunk: a copy of ``base`` returning its last block (flatten for torchvision's,
    output for a traced (timm) trunk, as ``plan`` asks), in the gradient mode; with ``"in_backward"`` each
    its own ``optimizer`` stepped in backward, which the trunk then plans for."""
    last = list(feature_blocks(base))[-1:]

    def trunk(**kw) -> CheckpointedTrunk:
        made = CheckpointedTrunk(copy.deepcopy(base), last, gradients=gradients, **kw)
        if gradients == "in_backward":
            optimizer_class, kwargs = NAMED_OPTIMIZERS[optimizer]
            optimizer_in_backward(made, optimizer_class, **kwargs)  # kept alive by the parameters it steps
        return made
    return trunk


def _budget_row(arch, budget, objective, labelled, trunk_row, trunk) -> Row:
    """The budget plan under ``objective`` (named for it where several are compared)."""
    name, strategy = (f"budget {_label(budget)}, {objective}", f"budget ({objective})") if labelled else (f"budget {_label(budget)}", "budget")
    try:
        return trunk_row(name, strategy, trunk(memory_budget=budget, objective=objective))
    except ValueError as e:
        return Row(arch, name, strategy, None, note=str(e).split("; ")[-1])


def _label(budget) -> str:
    """A budget as a row names it: ``0.5``, or bytes (``2e+09``)."""
    budget = MemoryBudget.parse(budget)
    return f"{budget.fraction:g}" if budget.fraction is not None else f"{budget.bytes:g}"


def _plan_row(arch, name, strategy, trunk, plan, total_flops) -> Row:
    recompute = sum(s.recompute_flops for s in plan.segments) / total_flops
    note = ""
    if plan.regions:
        note = f"regions: {policy_counts(plan.regions)}; cheap ops rerun {sum(s.recompute_bytes for s in plan.segments) / 2**20:.0f} MiB"
    return Row(arch, name, strategy, _loss_fn(trunk), trunk, plan.predicted_peak_bytes, recompute, note=note)


def _splittable(trunk: CheckpointedTrunk) -> List[bool]:
    return list(trunk.plan_request().splittable)


def _cuts_only_row(arch, trunk, x, cuts_only, model, total_flops) -> Row:
    """A budget met by cuts alone (no regions): the block-level plan, for comparison."""
    name = f"budget {_label(trunk.memory_budget)}, cuts only"
    cuts = best_plan(cuts_only, _splittable(trunk), [], budget=trunk.memory_budget.in_bytes(cuts_only.peak([0])))
    if cuts is None:
        floor = cuts_only.peak(best_plan(cuts_only, _splittable(trunk), []).starts)
        return Row(arch, name, "cuts only", None, note=f"cuts alone reach {floor / cuts_only.peak([0]):.3f} of unsplit")
    request = trunk.plan_request()
    plan = plan_from_cuts(list(request.names), cuts, request.stops, "budget", model)
    trunk.store_plan(trunk.key_for(x), plan)
    return _plan_row(arch, name, "cuts only", trunk, plan, total_flops)


def _block_type(trunk: CheckpointedTrunk) -> type:
    """The class the trunk's stages are made of (Bottleneck, CNBlock, EncoderBlock ...): the most common one.
    A traced trunk (timm's) has no stages: its units are its blocks (``ChainUnit``; each instance is of its own
    subclass, as every ``fx.GraphModule``)."""
    blocks = trunk.feature_blocks
    kinds = [type(m) for name, stage in blocks.items() if name in blocks.stages for m in stage]
    if not kinds:
        return ChainUnit
    return max(set(kinds), key=kinds.count)


def _sequential_row(arch, trunk, x, k, model, total_flops) -> Row:
    """torch's checkpoint_sequential with k equal segments over the flattened trunk."""
    chain = nn.Sequential(*[m for _, m in trunk.units])
    n = len(chain)
    if k > n:
        return Row(arch, f"checkpoint_sequential k={k}", "checkpoint_sequential", None, note=f"only {n} layers")
    size = n // k
    starts = [i * size for i in range(k)]
    row = Row(arch, f"checkpoint_sequential k={k}", "checkpoint_sequential", None, chain, model.peak(starts), model.total_recompute(starts) / total_flops)
    run = lambda x: checkpoint_sequential(chain, k, x, use_reentrant=False).sum()  # noqa: E731
    try:
        run(x).backward()
        row.run = run
    except RuntimeError as e:
        row.predicted = row.recompute = None
        row.note = "fails: " + str(e).split("\n")[0][:60]
    return row


def _loss_fn(trunk):
    return lambda x: sum(f.sum() for f in trunk(x))


def _measure(rows: List[Row], x: torch.Tensor, repeats: int, progress: bool, gradients: str) -> None:
    runnable = [r for r in rows if r.run is not None]
    bar = tqdm(total=len(runnable) * (3 + repeats), desc="bench", disable=not progress or not sys.stderr.isatty())  # a log: no \r lines

    def zero_grad(r):  # as the training loop would between steps
        for p in r.module.parameters():
            if gradients == "allocated":
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    for r in runnable:
        r.run(x).backward()  # a first step: parameters get their .grad
        zero_grad(r)
        with PeakMemory(x.device) as mem:
            r.run(x).backward()
        r.peak, r.times = mem.peak_bytes, []
        bar.update(2)
    # interleaved, so drifting machine load hits every row alike; the first round untimed: each row warmed up alone,
    # and in the first round after that a row that peaks above the last one still grows the host allocator's heap
    for i in range(1 + repeats):
        for r in runnable:
            zero_grad(r)
            seconds = wall_seconds(lambda: r.run(x).backward(), x.device)
            if i:
                r.times.append(seconds)
            bar.update(1)
    bar.close()


def run_benchmark(
    archs: Sequence[str] = ("resnet50",),
    input_shape: Sequence[int] = (4, 3, 224, 224),
    splits: Sequence[int] = (4, 6),
    budgets: Sequence[float] = (0.5, 0.45),
    repeats: int = 5,
    device: str = "cpu",
    out_dir: Optional[str] = "output/bench",
    selective: bool = True,
    progress: bool = True,
    gradients: str = "allocated",
    objectives: Sequence[str] = ("auto",),
    optimizer: str = "sgd",
    width: float = 1.0,
) -> str:
    """Run the benchmark; returns the markdown table (also written, with a plot, to ``out_dir``).
    ``objectives``: budget plans under each (see ``CheckpointedTrunk(objective=...)``), side by side;
    ``"auto"`` is the one a trunk on ``device`` plans with by default (time on a GPU, FLOPs on a CPU).
    ``optimizer``: with ``gradients="in_backward"``, the optimizer each row steps in backward (a name of
    ``trunksplit.fit.NAMED_OPTIMIZERS``: sgd, lars, adamw). ``input_shape``: the batch every row steps, NxCxHxW.
    ``width``: every ResNet of ``archs`` that many times as wide (vissl's ``WIDTH_MULTIPLIER``; 2 and 4: SimCLR's
    ResNet-50 (2x) and (4x)), named so in its table."""
    if gradients == "in_backward" and optimizer not in NAMED_OPTIMIZERS:
        raise ValueError(f"gradients=\"in_backward\" steps an optimizer in backward: optimizer is one of {', '.join(NAMED_OPTIMIZERS)}, got {optimizer!r}")
    dev = torch.device(device)
    objectives = list(dict.fromkeys(priced_in(o, dev) for o in objectives))
    x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(0)).to(dev)
    tables, all_rows = [], []
    for arch in archs:
        rows = _trunk_rows(arch, x, splits, budgets, selective, gradients, objectives, optimizer, width)
        _measure(rows, x, repeats, progress, gradients)
        for r in rows:  # keep the figures, not a model copy per row: five big models would not fit
            r.run = r.module = None
        all_rows += rows
        tables.append(_table(rows, rows[0].arch, x, gradients, objectives, optimizer))
        if out_dir:  # written as each model finishes, so a long run keeps what it measured
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "benchmark.md"), "w") as f:
                f.write("\n\n".join(tables) + "\n")
            _plot(all_rows, os.path.join(out_dir, "benchmark.png"))
    return "\n\n".join(tables)


def _table(rows: List[Row], arch: str, x: torch.Tensor, gradients: str, objectives: Sequence[str], optimizer: str) -> str:
    from tabulate import tabulate

    plain = rows[0]
    t_plain = statistics.median(plain.times)
    plain.note = f"profiling for a cost-aware plan: {plain.profile_seconds:.2f} s = {plain.profile_seconds / t_plain:.1f} plain steps"
    body = []
    for r in rows:
        measured = r.peak is not None
        body.append(
            [
                r.name,
                f"{r.peak / 2**20:.1f}" if measured else "-",
                f"{r.peak / plain.peak:.2f}" if measured else "-",
                f"{r.predicted / 2**20:.1f}" if r.predicted is not None else "-",
                f"{r.predicted / r.peak - 1:+.1%}" if measured and r.predicted is not None else "-",
                f"{r.recompute:.2f}" if r.recompute is not None else "-",
                f"{statistics.median(r.times) / t_plain:.2f}" if measured else "-",
                r.note,
            ]
        )
    beyond = {"allocated": "parameters (gradients allocated by the step)", "kept": "parameters and kept gradients",
              "in_backward": f"parameters and {optimizer}'s state ({optimizer} stepped in backward)"}[gradients]
    head = f"### {arch}, input {tuple(x.shape)}, {x.device.type}, peak beyond {beyond}, budget plans priced in {' and '.join(objectives)}"
    headers = ["plan", "peak MiB", "peak / plain", "predicted MiB", "predicted vs measured", "recompute / forward", "step time / plain", "note"]
    return head + "\n\n" + tabulate(body, headers=headers, tablefmt="github")


def _plot(rows: List[Row], path: str) -> None:
    """Per model: peak against recomputed FLOPs (top) and against step time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = sorted({r.arch for r in rows}, key=[r.arch for r in rows].index)
    fig, axes = plt.subplots(2, len(archs), figsize=(5.5 * len(archs), 8.4), squeeze=False)
    for col, arch in enumerate(archs):
        mine = [r for r in rows if r.arch == arch and r.peak is not None and r.recompute is not None]
        plain = next(r for r in mine if r.strategy == "plain")
        t_plain = statistics.median(plain.times)
        for strategy in ["checkpoint_sequential", "vissl", "balanced", "cuts only", "budget", "budget (flops)", "budget (time)"]:
            mine_here = [r for r in mine if r.strategy == strategy]
            if not mine_here:
                continue
            label = strategy.replace("budget", "budget, with regions")
            frontier = sorted((r.recompute, r.peak / plain.peak) for r in mine_here)
            axes[0][col].plot(*zip(*([(0.0, 1.0)] + frontier)), marker="o", label=label)
            # step time is noisy and not monotone in the recompute: points, not a line
            timed = [(statistics.median(r.times) / t_plain, r.peak / plain.peak) for r in mine_here]
            axes[1][col].plot(*zip(*timed), marker="o", linestyle="none", label=label)
        for ax, xlabel in ((axes[0][col], "recomputed FLOPs / forward FLOPs"), (axes[1][col], "step time / plain step time")):
            ax.set_title(arch)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("step peak / plain peak")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
