#!/usr/bin/env python
"""Where the eager checkpointed step's extra time goes, against the plain step.

    python tools/eager_overhead.py --device cuda                       # ResNet-50 and ViT-B/16, 4 x 224px
    python tools/eager_overhead.py --device cpu --models resnet18 --input 4x3x64x64 --budgets 0.7 --repeats 2
    python tools/eager_overhead.py --device cpu --models resnet50 --narrow 16 --input 4x3x64x64 --budgets 0.7 0.5   # dispatch-bound
    python tools/eager_overhead.py --device cuda --budgets 0.5 --switch                 # and against timm's switch
    python tools/eager_overhead.py --device cuda --models vit_b_16 --budgets 0.5 --gradients kept   # a budget of activations alone

For each model and budget, eight or nine steps run interleaved (median of ``--repeats``): the plain trunk;
the budget plan priced in FLOPs (``objective="flops"``, the default on a CPU); the same plan with its
regions taken out (its cuts only), and so under torch's own non-reentrant checkpoint (trunksplit's
until 2026-12-04) and under reentrant checkpointing (one autograd node per segment, where
non-reentrant's hooks run in Python for every tensor a segment saves); the same plan
with every selective region run as ``"recompute"`` (no per-op policy); the plan priced in measured
time (``objective="time"``, the default on a GPU); from the same profile, the time plan with a
cut priced as before 2026-11-27 (at the forward of the units it reruns, the checkpoint itself free);
and the time plan of a reentrant trunk (cuts alone, no per-tensor hooks), where cuts reach the budget.
Each row gives the step time, its ratio to plain, its extra time over plain and, for the two time
plans, what their prices predicted it (the segments' ``recompute_seconds``), the peak ratio and the
aten ops a step runs (counted by a dispatch mode, forward and backward). The attribution table splits
the FLOPs plan's extra time: the forward of the units its checkpointed segments run again (each
unit's forward timed alone on the plain model: kernels and launches), the checkpoint machinery (the
cuts-only step less the plain step less that recompute; of it, what non-reentrant's saved-tensor
hooks cost against the same cuts reentrant, and what torch's checkpoint costs beyond ours), and the
regions (the plan less its cuts); then the
selective policy against the same regions recomputed whole: above 0 its per-op dispatch costs more
than the convolutions it keeps from rerunning (a GPU), below 0 less (a CPU). Every step and plan runs in
one gradient mode (``--gradients``): allocated, torch's default, each step's gradients freed after it (a
ViT-B/16 at 4 images cannot go below 0.69 of its step so: the gradients), or kept, zeroed in place, the
budget then a fraction of a step that holds them beforehand.
"""
import argparse
import copy
import sys
import time
from dataclasses import replace
from unittest import mock

import torch
import torchvision
from tabulate import tabulate
from torch import nn
from torchvision.models.resnet import ResNet
from torchvision.models.vision_transformer import VisionTransformer

from trunksplit import CheckpointedTrunk, PeakMemory
from trunksplit.cli.parser import batch_shape, shape_text
from trunksplit.planning.peak import PeakModel
from trunksplit.planning.search import peak_model, plan_trunk
from trunksplit.planning.timing import interleaved_medians, synchronize
from trunksplit.planning.memory import TorchDispatchMode  # the package's one import of torch's private dispatch mode
from trunksplit.recompute import checkpoint as checkpoint_module
from trunksplit.recompute.policies import POLICIES, RECOMPUTE


STEP_HEADERS = ["model", "budget", "step", "plan", "ms", "time ratio", "extra ms", "predicted extra ms", "peak ratio", "aten ops"]
SWITCH_HEADERS = ["model", "step", "ms", "time ratio", "against the switch", "peak ratio"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the default) or cpu")
    p.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"], help="torchvision model names")
    p.add_argument("--budgets", nargs="*", type=float, default=[0.7, 0.5, 0.3],
                   help="memory budgets, fractions of the unsplit step (none, with --switch: only the switch's comparison)")
    p.add_argument("--input", type=batch_shape, default=(4, 3, 224, 224), help="the batch every step runs, NxCxHxW (as trunksplit plan's --input)")
    p.add_argument("--repeats", type=int, default=7, help="steps timed per variant, interleaved; the median is reported")
    p.add_argument("--switch", action="store_true",
                   help="also timm's set_grad_checkpointing (every block under torch's checkpoint) and the time plans at its peak")
    p.add_argument("--narrow", type=int, default=1, metavar="D",
                   help="ResNets and ViTs: every width divided by D (16: a ResNet whose step costs its ops' dispatch, "
                        "a CPU stand-in for a GPU's launch-bound step; see build)")
    p.add_argument("--gradients", choices=["allocated", "kept"], default="allocated",
                   help="the loop's gradient mode every step and plan runs in: allocated (torch's default, freed after each step) "
                        "or kept (zeroed in place: a budget is then of activations alone, which a ViT at a few images needs to reach 0.5)")
    return p


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _forward_backward(trunk, x):
    sum(f.float().mean() for f in trunk(x)).backward()


def _step(trunk, x):
    _forward_backward(trunk, x)
    _clear_gradients(trunk)


def _clear_gradients(trunk) -> None:
    """As a loop clears them in the trunk's gradient mode: freed (``zero_grad()``), or kept and zeroed in place
    (``zero_grad(set_to_none=False)``: every step then starts with them alive, as ``gradients="kept"`` plans)."""
    for p in trunk.parameters():
        if trunk.gradients == "kept" and p.grad is not None:
            p.grad.zero_()
        else:
            p.grad = None


def _peak(trunk, x):
    _step(trunk, x)
    with PeakMemory(x.device) as mem:
        _step(trunk, x)
    return mem.peak_bytes


def _ops(trunk, x):
    with _OpCount() as count:
        _forward_backward(trunk, x)
    _clear_gradients(trunk)  # not counted: the same in every row
    return count.ops


def _median_ms(steps: dict, x, repeats: int) -> dict:
    seconds = interleaved_medians({k: (lambda t=trunk: _step(t, x)) for k, trunk in steps.items()}, x.device, repeats)
    return {k: s * 1e3 for k, s in seconds.items()}


def unit_forward_ms(trunk, x, repeats: int) -> list:
    """Each unit's forward (with autograd, as a recompute runs it) on the plain trunk, timed alone."""
    times = []
    h = x
    for _, unit in trunk.units:
        best = float("inf")
        for _ in range(max(repeats, 2)):
            synchronize(x.device)
            start = time.perf_counter()
            out = unit(h)
            synchronize(x.device)
            best = min(best, (time.perf_counter() - start) * 1e3)
        times.append(best)
        h = out.detach()
    return times


class UnderTorchsCheckpoint(CheckpointedTrunk):
    """A trunk whose non-reentrant cuts run under torch's own checkpoint, as trunksplit's did until
    2026-12-04, not under :func:`trunksplit.recompute.hooked.checkpoint_by_hooks`: the two side by side."""

    def forward(self, *args, **kwargs):
        # the swap a benchmark may make: run_checkpointed looks the function up by name at each call
        with mock.patch.object(checkpoint_module, "checkpoint_by_hooks", lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)):
            return super().forward(*args, **kwargs)


def _with_plan(model, x, plan, gradients="allocated", use_reentrant=False, trunk_class=CheckpointedTrunk):
    trunk = trunk_class(copy.deepcopy(model), memory_budget=1.0, use_reentrant=use_reentrant, gradients=gradients)
    trunk.store_plan(trunk.key_for(x), plan)
    return trunk


def _reason(refusal: ValueError) -> str:
    """The planner's refusal of a budget, in a table cell: its smallest feasible budget."""
    clauses = str(refusal).split(";")
    return next((c for c in clauses if "smallest feasible" in c), clauses[0]).strip().split(". ")[0][:120]


def variants(model, x, budget: float, gradients: str = "allocated"):
    """(label -> trunk, the flops plan, label -> why that step is not run) or (None, the planner's reason, {}) where
    the budget does not fit; every trunk in the gradient mode ``gradients``."""
    planned = CheckpointedTrunk(copy.deepcopy(model), memory_budget=budget, objective="flops", gradients=gradients)
    try:
        plan = planned.plan_for(x)
    except ValueError as e:
        return None, _reason(e), {}
    timed = CheckpointedTrunk(copy.deepcopy(model), memory_budget=budget, objective="time", gradients=gradients)
    request = timed.plan_request()
    measured = peak_model(request, x, regions=True)
    timed.store_plan(timed.key_for(x), plan_trunk(request, x, measured))
    # the same profile priced as before 2026-11-27: a cut at its units' forward, checkpoints free
    by_forward = PeakModel(costs=replace(measured.costs, rerun_seconds=measured.costs.forward_seconds, checkpoint_seconds=0.0), feature_units=measured.features,
                           gradients=measured.gradients, spans=measured.spans, objective="time", update_temporaries=measured.update_temporaries)
    cuts = replace(plan, segments=tuple(replace(s, regions=()) for s in plan.segments))
    whole = replace(plan, segments=tuple(replace(s, regions=tuple((a, b, RECOMPUTE.name if POLICIES[p].selective else p) for a, b, p in s.regions))
                                         for s in plan.segments))
    steps = {"plain": CheckpointedTrunk(copy.deepcopy(model), gradients=gradients), f"budget {budget}, objective flops": planned,
             "its cuts only": _with_plan(model, x, cuts, gradients),
             "its cuts only, torch's checkpoint": _with_plan(model, x, cuts, gradients, trunk_class=UnderTorchsCheckpoint),
             "its cuts only, reentrant": _with_plan(model, x, cuts, gradients, use_reentrant=True),
             "selective regions run whole": _with_plan(model, x, whole, gradients), "objective time": timed,
             "objective time, cuts priced by their forward (before)": _with_plan(model, x, plan_trunk(request, x, by_forward), gradients)}
    reentrant, unreached = CheckpointedTrunk(copy.deepcopy(model), memory_budget=budget, objective="time", use_reentrant=True, gradients=gradients), {}
    try:  # cuts alone (a reentrant trunk has no regions): none may reach the budget
        reentrant.plan_for(x)
        steps["objective time, reentrant"] = reentrant
    except ValueError as e:
        unreached["objective time, reentrant"] = _reason(e)
    return steps, plan, unreached


class _NarrowResNet(ResNet):
    """torchvision's ResNet with the stem's and every stage's width divided by ``divisor``."""

    def __init__(self, block, layers, divisor: int):
        self.divisor = divisor
        super().__init__(block, layers)
        self.fc = nn.Linear(self.inplanes, self.fc.out_features)  # the last stage's width

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):
        if planes == 64:  # the first stage: ResNet.__init__ has just built the stem at 64 wide
            self.inplanes = 64 // self.divisor
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(self.inplanes)
        return super()._make_layer(block, planes // self.divisor, blocks, stride, dilate)


def build(name: str, narrow: int = 1, size: int = 224) -> nn.Module:
    """torchvision's ``name``; a ResNet or ViT with every width divided by ``narrow`` where it is above 1.

    A narrow ResNet-50 (16: 4 to 128 channels) has ResNet-50's ops, modules and saved tensors, each
    costing about its dispatch on a CPU, as a GPU's ops cost their launch at a few images: the
    stand-in for a launch-bound step that this CPU can run (the thin one, ``width_per_group=1``,
    kept its wide 1x1 convolutions and stayed compute-bound). A narrow ViT keeps its heads, layers
    and patches, its hidden and MLP widths divided, for images of ``size`` pixels (64: 16 tokens)."""
    model = getattr(torchvision.models, name)()
    if narrow == 1:
        return model
    if isinstance(model, VisionTransformer):
        heads = model.encoder.layers[0].self_attention.num_heads
        if narrow < 1 or model.hidden_dim % (narrow * heads):
            raise SystemExit(f"error: --narrow {narrow}: {name}'s width {model.hidden_dim} divided by it must still split into its {heads} heads")
        return VisionTransformer(size, model.patch_size, len(model.encoder.layers), heads, model.hidden_dim // narrow, model.mlp_dim // narrow)
    if not isinstance(model, ResNet):
        raise SystemExit(f"error: --narrow builds ResNets and ViTs only, not {name}")
    if narrow < 1 or 64 % narrow:
        raise SystemExit(f"error: --narrow {narrow}: a ResNet's widths (64 to 2048) divided by it must stay whole: use a divisor of 64")
    return _NarrowResNet(type(model.layer1[0]), [len(getattr(model, f"layer{i}")) for i in range(1, 5)], narrow)


class _Checkpointed(nn.Module):
    """A block under torch's non-reentrant checkpoint, as timm's ``checkpoint_seq`` runs each one."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _check_switchable(model: nn.Module) -> None:
    if not isinstance(model, (ResNet, VisionTransformer)):
        raise SystemExit(f"error: --switch runs ResNets and ViTs (timm's switch checkpoints their blocks), not {type(model).__name__}")


def every_block_checkpointed(model: nn.Module) -> nn.Module:
    """A copy of ``model`` run as timm's ``set_grad_checkpointing(True)`` runs timm's own: every block
    of a ResNet's stages (of a ViT's encoder) checkpointed, the stem and head not."""
    _check_switchable(model)
    model = copy.deepcopy(model)
    stages = [model.encoder.layers] if isinstance(model, VisionTransformer) else [getattr(model, f"layer{i}") for i in range(1, 5)]
    for stage in stages:
        for name, block in stage.named_children():
            setattr(stage, name, _Checkpointed(block))
    return model


def switch_rows(name: str, model: nn.Module, x, repeats: int, gradients: str = "allocated") -> list:
    """The plain step, timm's switch, and the time plans (non-reentrant and reentrant) at the
    switch's measured peak: what issue 49's "10% faster than timm's switch" compares."""
    switch = "timm's switch (every block checkpointed)"
    steps = {"plain": CheckpointedTrunk(copy.deepcopy(model), gradients=gradients), switch: CheckpointedTrunk(every_block_checkpointed(model), gradients=gradients)}
    peaks = {k: _peak(t, x) for k, t in steps.items()}
    for label, reentrant in (("objective time at its peak", False), ("objective time, reentrant, at its peak", True)):
        trunk = CheckpointedTrunk(copy.deepcopy(model), memory_budget=peaks[switch], objective="time", use_reentrant=reentrant, gradients=gradients)
        try:
            trunk.plan_for(x)
        except ValueError as e:
            print(f"eager_overhead: {label}: {_reason(e)}", file=sys.stderr)
            continue
        steps[label], peaks[label] = trunk, _peak(trunk, x)
    ms = _median_ms(steps, x, repeats)
    return [[name, k, f"{ms[k]:.1f}", f"{ms[k] / ms['plain']:.3f}", f"{ms[k] / ms[switch]:.3f}", f"{peaks[k] / peaks['plain']:.3f}"] for k in steps]


def _regions(plan) -> str:
    counts = {}
    for _, _, p in plan.regions:
        counts[p] = counts.get(p, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in counts.items()) or "none"


def rows_for(name: str, model: nn.Module, x, budget: float, repeats: int, gradients: str = "allocated"):
    steps, plan, unreached = variants(model, x, budget, gradients)
    if steps is None:
        return [[name, budget, "-", plan, "-", "-", "-", "-", "-", "-"]], []
    ms = _median_ms(steps, x, repeats)
    peaks = {k: _peak(t, x) for k, t in steps.items()}
    base = "plain"
    table = []
    for k, trunk in steps.items():
        p = trunk.plan_for(x) if k != base else None
        shape = "-" if p is None else f"{sum(s.checkpointed for s in p.segments)} checkpointed of {len(p.segments)}; regions: {_regions(p)}"
        predicted = "-" if p is None or p.segments[0].recompute_seconds is None else f"{sum(s.recompute_seconds for s in p.segments) * 1e3:.1f}"
        table.append([name, budget, k, shape, f"{ms[k]:.1f}", f"{ms[k] / ms[base]:.3f}", f"{ms[k] - ms[base]:.1f}", predicted, f"{peaks[k] / peaks[base]:.3f}", _ops(trunk, x)])
    table += [[name, budget, k, why, "-", "-", "-", "-", "-", "-"] for k, why in unreached.items()]  # said, not left out
    unit_ms = unit_forward_ms(steps[base], x, repeats)
    rerun = sum(sum(unit_ms[s.start:s.stop]) for s in plan.segments if s.checkpointed)
    label = f"budget {budget}, objective flops"
    gap = ms[label] - ms[base]
    parts = [("segments' recompute (forward of the units they rerun)", rerun),
             ("checkpoint machinery (cuts only - plain - that recompute)", ms["its cuts only"] - ms[base] - rerun),
             ("  of it, the saved-tensor hooks (cuts only - the same reentrant)", ms["its cuts only"] - ms["its cuts only, reentrant"]),
             ("  torch's checkpoint's hooks against ours (the same cuts)", ms["its cuts only, torch's checkpoint"] - ms["its cuts only"]),
             ("regions (plan - its cuts only)", ms[label] - ms["its cuts only"]),
             ("  selective against whole (plan - regions run whole; < 0: saves)", ms[label] - ms["selective regions run whole"])]
    attribution = [[name, budget, what, f"{v:.1f}", f"{v / gap:.2f}" if gap > 0 else "-"] for what, v in parts]
    attribution.append([name, budget, "the plan's extra time (plan - plain)", f"{gap:.1f}", "1.00"])
    return table, attribution


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.budgets and not args.switch:
        raise SystemExit("error: nothing to measure: give --budgets, --switch or both")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no GPU here; on CPU: --device cpu --models resnet18 --input 4x3x64x64", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(0)).to(device)
    tables, attributions, switched = [], [], []
    models = {name if args.narrow == 1 else f"{name} / {args.narrow}": build(name, args.narrow, args.input[2]).to(device)
              for name in args.models}  # all built first: one the tool cannot build is refused before any is measured
    for model in models.values() if args.switch else ():
        _check_switchable(model)  # a family without blocks, as early
    for name, model in models.items():
        for budget in args.budgets:
            print(f"eager_overhead: {name} budget {budget} ...", file=sys.stderr, flush=True)
            t, a = rows_for(name, model, x, budget, args.repeats, args.gradients)
            print(tabulate(t, headers=STEP_HEADERS, tablefmt="github"), file=sys.stderr, flush=True)  # kept should a time limit cut the run
            tables += t
            attributions += a
        if args.switch:
            print(f"eager_overhead: {name} against timm's switch ...", file=sys.stderr, flush=True)
            switched += switch_rows(name, model, x, args.repeats, args.gradients)
            print(tabulate(switched, headers=SWITCH_HEADERS, tablefmt="github"), file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"### Eager steps, {shape_text(args.input)}, {where}, torch {torch.__version__}, gradients {args.gradients}, median of {args.repeats}, interleaved\n")
    if tables:
        print(tabulate(tables, headers=STEP_HEADERS, tablefmt="github"))
        print("\n### The plan's extra time, attributed (ms per step, share of the plan's extra time)\n")
        print(tabulate(attributions, headers=["model", "budget", "part", "ms", "share"], tablefmt="github"))
    if switched:
        print("\n### At the peak of timm's switch (the time plans given its measured peak as their budget)\n")
        print(tabulate(switched, headers=SWITCH_HEADERS, tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
