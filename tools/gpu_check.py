#!/usr/bin/env python
"""Check trunksplit on a GPU in one command and write a markdown report.

    python tools/gpu_check.py --report gpu_report.md             # CUDA: a few minutes on one H100
    python tools/gpu_check.py --device cpu --quick               # the same code, a tiny model, on CPU

Sections, each a table: the environment (device, torch, CUDA, cuDNN); exactness (a checkpointed
training step against the unsplit one in the three gradient modes, deterministic algorithms on);
prediction (the plan's predicted step peak against the allocator's measured peak, allocated and
reserved); time (the eager step at budget 0.5 against the plain step, timm's
``set_grad_checkpointing`` where timm is installed, and torch's compile-time
``activation_memory_budget``); fit (the batch found for a memory size, verified by a real step).
On CPU the peaks are the tensor tracker's (:class:`trunksplit.PeakMemory`), with no reserved
figure. ``--quick`` runs ResNet-18 at 2x3x64x64 and leaves out compile (the fast suite runs it,
so the script cannot rot before a GPU arrives). Reports go to docs/gpu.md, dated, by hand.
"""
import argparse
import copy
import datetime
import os
import sys
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with it, set before CUDA starts

import torch  # noqa: E402
import torchvision  # noqa: E402
from tabulate import tabulate  # noqa: E402

from trunksplit import BudgetTooLowError, CheckpointedTrunk, PeakMemory, fit, optimizer_in_backward  # noqa: E402
from trunksplit.planning.budget import gib  # noqa: E402
from trunksplit.planning.timing import interleaved_medians, synchronize  # noqa: E402

FULL = {"resnet50": "resnet50", "convnext_tiny": "convnext_tiny", "vit_b_16": "vit_base_patch16_224"}  # torchvision -> timm
QUICK = {"mobilenet_v3_small": "mobilenetv3_small_100"}  # activations outweigh its gradients even at 96px, so budgets below 1 are feasible
MODES = ("allocated", "kept", "in_backward")
SGD = dict(lr=0.1, momentum=0.9)


def plans(budget: float) -> dict:
    return {"balanced 4": dict(num_splits=4, strategy="balanced"), f"budget {budget}": dict(memory_budget=budget),
            f"in_backward {budget}": dict(memory_budget=budget, gradients="in_backward")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="MobileNetV3-small at 96px, batch 2, budget 0.7, no compile: a minute on CPU")
    p.add_argument("--budget", type=float, default=0.0, help="the budget plans' fraction (default: 0.5, or 0.7 with --quick)")
    p.add_argument("--batch", type=int, default=0, help="images per step (default: 16, or 2 with --quick)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per row; the median counts")
    p.add_argument("--memory", default="", help="fit's memory size (default: 4GiB, or 64MiB with --quick)")
    p.add_argument("--report", default="", help="where to write the markdown report (default: print it)")
    return p


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return getattr(torchvision.models, name)()


def _loss_weights(trunk, x):
    """Fixed random weights, one per output element, made before any measurement: a loss that weighs
    every element differently, so a swapped or dropped gradient shows."""
    with torch.no_grad():
        shapes = [f.shape for f in copy.deepcopy(trunk).eval()(x)]
    g = torch.Generator(device=x.device).manual_seed(123)
    return [torch.randn(s, generator=g, device=x.device) for s in shapes]


def _step(trunk, x, weights) -> torch.Tensor:
    loss = sum((f * w).sum() for f, w in zip(trunk(x), weights))
    loss.backward()
    return loss.detach()


def _clear(trunk) -> None:
    """Gradients as the trunk's mode clears them between steps."""
    for p in trunk.parameters():
        if trunk.gradients == "kept" and p.grad is not None:
            p.grad.zero_()
        else:
            p.grad = None


def measure(step, device: torch.device):
    """(allocated, reserved) peak bytes of ``step()`` beyond what was live before it; reserved is None on CPU."""
    if device.type != "cuda":
        with PeakMemory(device) as mem:
            step()
        return mem.peak_bytes, None
    synchronize(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    with PeakMemory(device) as mem:
        step()
    return mem.peak_bytes, torch.cuda.max_memory_reserved(device) - reserved


def environment(device: torch.device) -> list:
    rows = [("date", datetime.date.today().isoformat()), ("torch", torch.__version__), ("device", str(device))]
    if device.type == "cuda":
        rows += [("GPU", torch.cuda.get_device_name(device)), ("CUDA", torch.version.cuda),
                 ("cuDNN", torch.backends.cudnn.version()), ("memory", f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB")]
    else:
        rows += [("threads", torch.get_num_threads()), ("note", "CPU: peaks are exact tensor bytes (tensor tracker); no GPU figure")]
    return rows


def _stepping(trunk):
    """``trunk``, with SGD stepped in its backward where its gradient mode says so."""
    if trunk.gradients == "in_backward":
        optimizer_in_backward(trunk, torch.optim.SGD, **SGD)
    return trunk


def _trained(trunk, x, weights):
    """One SGD step of ``trunk`` (in backward for ``in_backward``, where :func:`_stepping` set it up): its loss and the trunk."""
    if trunk.gradients == "in_backward":
        return _step(trunk, x, weights), trunk
    optimizer = torch.optim.SGD(trunk.parameters(), **SGD)
    if trunk.gradients == "kept":
        for p in trunk.parameters():
            p.grad = torch.zeros_like(p)
    loss = _step(trunk, x, weights)
    optimizer.step()
    return loss, trunk


def _difference(a, b) -> float:
    """Largest elementwise difference of two tensors, relative to the larger one's largest magnitude."""
    return ((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30)).item()


def _planned(model, x, **kw):
    """A trunk planned for ``x``, or the planner's one-line reason why none fits. A trunk that steps
    its optimizer in backward gets it first: the plan counts what its updates allocate."""
    trunk = _stepping(CheckpointedTrunk(model, **kw))
    try:
        trunk.plan_for(x)
    except BudgetTooLowError as e:  # a budget below this input's floor: the report says so, with the floor
        return None, f"below this input's floor, {e.smallest_bytes / e.unsplit_bytes:.3f} of unsplit ({gib(e.smallest_bytes)})"
    return trunk, ""


def exactness_rows(name: str, x: torch.Tensor, budget: float, quick: bool = False) -> list:
    """The unsplit trunk (the model's own modules, nothing checkpointed) against planned trunks,
    one SGD step each: the loss, every parameter after the step, every buffer. ``quick``: the
    balanced plan in one gradient mode only (each plan is a profile: seconds on CPU)."""
    rows = []
    for mode in MODES:
        kinds = [("balanced 4", dict(num_splits=4, strategy="balanced")), (f"budget {budget}", dict(memory_budget=budget))]
        for label, kw in kinds[1:] if quick and mode != "allocated" else kinds:
            model = _model(name).to(x.device)
            plain = _stepping(CheckpointedTrunk(copy.deepcopy(model), gradients=mode))
            planned, why = _planned(copy.deepcopy(model), x, gradients=mode, **kw)
            if planned is None:
                rows.append([name, mode, label, "-", why, "-"])
                continue
            weights = _loss_weights(plain, x)
            (loss_a, a), (loss_b, b) = (_trained(t, x, weights) for t in (plain, planned))
            tensors = [*zip(a.parameters(), b.parameters()), *zip(a.buffers(), b.buffers())]
            worst = max(_difference(p.float(), q.float()) for p, q in tensors)
            exact = torch.equal(loss_a, loss_b) and all(torch.equal(p, q) for p, q in tensors)
            rows.append([name, mode, label, len(planned.plan_for(x).segments), "yes" if exact else "no", f"{worst:.1e}"])
    return rows


def prediction_rows(name: str, x: torch.Tensor, budget: float) -> list:
    """Each plan's predicted step peak against the step measured (the second: the first makes the
    optimizer's state), gradients cleared before it as the plan's mode clears them."""
    rows = []
    for label, kw in plans(budget).items():
        trunk, why = _planned(_model(name).to(x.device), x, **kw)
        if trunk is None:
            rows.append([name, label, x.shape[0], why, "-", "-", "-", "-"])
            continue
        weights = _loss_weights(trunk, x)
        predicted = trunk.plan_for(x).predicted_peak_bytes
        _step(trunk, x, weights)
        _clear(trunk)
        allocated, reserved = measure(lambda: _step(trunk, x, weights), x.device)
        rows.append([name, label, x.shape[0], _mib(predicted), _mib(allocated), _mib(reserved), f"{predicted / allocated:.3f}",
                     "-" if reserved is None else f"{predicted / reserved:.3f}"])
        del trunk
    return rows


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _timed_row(label: str, model, x, weights) -> dict:
    if model is None:
        return {"label": label, "model": None, "peak": None}
    _step(model, x, weights)
    _clear(model)
    peak, _ = measure(lambda: _step(model, x, weights), x.device)
    _clear(model)
    return {"label": label, "model": model, "peak": peak}


def _timm_models(timm_name: str, x):
    """timm's plain model and its own switch (``set_grad_checkpointing``); None where timm is not installed."""
    try:
        import timm
    except ImportError:
        return None
    torch.manual_seed(0)
    plain = timm.create_model(timm_name, num_classes=0, **({"img_size": x.shape[-1]} if "vit" in timm_name else {})).to(x.device)
    switch = copy.deepcopy(plain)
    switch.set_grad_checkpointing(True)
    return plain, switch


def _with_loss_of_features(model):
    """A timm model returning one tensor, as a trunk returns a list: the same loss applies to both."""
    class Listed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.gradients = model, "allocated"

        def forward(self, x):
            return [self.inner(x)]

    return Listed()


def time_rows(name: str, timm_name: str, x: torch.Tensor, repeats: int, budget: float) -> list:
    """Eager step times and peaks: the unsplit trunk, a budget plan; then timm's model, its switch, and
    trunksplit planned on timm's model at the switch's measured peak. Ratios are to the plain step of
    the same library, measured side by side (interleaved, median of ``repeats``)."""
    model = _model(name).to(x.device)
    plain = CheckpointedTrunk(copy.deepcopy(model))
    weights = _loss_weights(plain, x)
    rows = [_timed_row("torchvision, unsplit", plain, x, weights)]
    ours, why = _planned(model, x, memory_budget=budget)
    rows.append(_timed_row(f"trunksplit budget {budget}" + (f": {why}" if why else ""), ours, x, weights))
    groups = [rows]
    timm_models = _timm_models(timm_name, x)
    if timm_models is not None:
        tplain, tswitch = (_with_loss_of_features(m) for m in timm_models)
        tweights = _loss_weights(tplain, x)
        timm_rows = [_timed_row("timm, plain", tplain, x, tweights), _timed_row("timm set_grad_checkpointing", tswitch, x, tweights)]
        ours, why = _planned(copy.deepcopy(timm_models[0]), x, memory_budget=timm_rows[1]["peak"])
        timm_rows.append(_timed_row("trunksplit at the switch's peak" + (f": {why}" if why else ""), ours, x, tweights))
        groups.append(timm_rows)
    out = []
    for group in groups:
        runnable = {r["label"]: (lambda m=r["model"], w=(weights if group is rows else tweights): (_step(m, x, w), _clear(m))) for r in group if r["model"] is not None}
        seconds = interleaved_medians(runnable, x.device, repeats)
        base = group[0]
        for r in group:
            s = seconds.get(r["label"])
            out.append([name, r["label"], _mib(r["peak"]), "-" if r["peak"] is None else f"{r['peak'] / base['peak']:.3f}",
                        "-" if s is None else f"{s * 1e3:.1f}", "-" if s is None else f"{s / seconds[base['label']]:.3f}"])
    return out


def compile_rows(name: str, x: torch.Tensor, repeats: int, budget: float) -> list:
    """torch.compile's own answer: the plain model compiled, and compiled under
    ``activation_memory_budget`` (the min-cut partitioner's knob), against trunksplit's
    ``trunk.compile()`` at the same budget. Peaks and times of the compiled steps, side by side."""
    import torch._functorch.config as functorch_config  # private: torch's budget has no public switch

    model = _model(name).to(x.device)
    weights = _loss_weights(CheckpointedTrunk(copy.deepcopy(model)), x)
    torch._dynamo.reset()
    plain = torch.compile(CheckpointedTrunk(copy.deepcopy(model)))
    rows = [_timed_row("torch.compile, plain", plain, x, weights)]
    with functorch_config.patch(activation_memory_budget=budget):
        budgeted = torch.compile(CheckpointedTrunk(copy.deepcopy(model)))
        rows.append(_timed_row(f"torch.compile, activation_memory_budget {budget}", budgeted, x, weights))
    ours = CheckpointedTrunk(model, memory_budget=budget)
    ours.compile()
    rows.append(_timed_row(f"trunksplit budget {budget}, trunk.compile()", ours, x, weights))
    seconds = interleaved_medians({r["label"]: (lambda m=r["model"]: (_step(m, x, weights), _clear(m))) for r in rows}, x.device, repeats)
    base = rows[0]
    return [[name, r["label"], _mib(r["peak"]), f"{r['peak'] / base['peak']:.3f}", f"{seconds[r['label']] * 1e3:.1f}",
             f"{seconds[r['label']] / seconds[base['label']]:.3f}"] for r in rows]


def fit_rows(name: str, size: int, memory: str, device: torch.device) -> list:
    """``fit``'s batch for ``memory``, verified by a real step at that batch (a CUDA out-of-memory error would end the check here)."""
    found = fit(_model(name).to(device), (3, size, size), memory, optimizer="sgd")
    return [[name, memory, found.batch_size, _mib(found.predicted_total_bytes), _mib(found.measured_total_bytes),
             f"{found.measured_total_bytes / found.memory:.3f}", "yes"]]


def sections(args) -> list:
    """The report's sections as (title, headers, a function that makes the rows), in the order they run."""
    device = torch.device(args.device)
    models = QUICK if args.quick else FULL
    first = next(iter(models))
    batch, size = args.batch or (2 if args.quick else 16), 96 if args.quick else 224
    memory = args.memory or ("64MiB" if args.quick else "4GiB")
    budget = args.budget or (0.7 if args.quick else 0.5)
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    timed = ["model", "step", "peak (MiB)", "peak ratio", "ms", "time ratio"]

    def exact():
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: attention's backward has no deterministic kernel on every GPU
        try:
            return exactness_rows(first, x, budget, args.quick)
        finally:
            torch.use_deterministic_algorithms(False)

    out = [("Environment", ["what", "value"], lambda: environment(device)),
           (f"Exactness: planned against unsplit, one SGD step, {batch} images of {size}px, deterministic algorithms",
            ["model", "gradients", "plan", "segments", "bit for bit", "largest difference (relative)"], exact),
           (f"Prediction: the plan's step peak against the measured one, {batch} images of {size}px",
            ["model", "plan", "batch", "predicted (MiB)", "allocated (MiB)", "reserved (MiB)", "predicted / allocated", "predicted / reserved"],
            lambda: [r for n in models for r in prediction_rows(n, x, budget)]),
           (f"Time: eager steps, median of {args.repeats}, interleaved", timed,
            lambda: [r for n, t in models.items() for r in time_rows(n, t, x, args.repeats, budget)])]
    out.append(("fit: the largest batch for a memory size, verified by a real step",
                ["model", "memory", "batch", "predicted total (MiB)", "measured total (MiB)", "measured / memory", "step ran"],
                lambda: fit_rows(first, size, memory, device)))
    if not args.quick:  # last: compiling takes the longest
        out.append(("Compiled steps", timed, lambda: compile_rows(first, x, args.repeats, budget)))
    return out


def main(argv=None) -> int:
    """Run the sections in order, writing the report after each (a check cut short keeps what it measured);
    a section that fails is reported with its error and the next one runs. Exit 1 if any failed."""
    args = build_parser().parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no GPU here; use --device cpu --quick to check the script on CPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    parts, failed, begin = [], 0, time.perf_counter()
    for title, headers, rows in sections(args):
        print(f"gpu_check: {title.split(':')[0]} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # split-count and determinism notices: the tables say what matters
                body = tabulate(rows(), headers=headers, tablefmt="github")
        except Exception as e:  # noqa: BLE001 - the report names it, and the other sections still run
            failed += 1
            body = f"FAILED: {type(e).__name__}: {e}"
        parts.append(f"### {title}\n\n{body}\n\n({time.perf_counter() - start:.0f} s)")
        text = "\n\n".join(parts) + f"\n\nwhole check: {time.perf_counter() - begin:.0f} s\n"
        if args.report:
            with open(args.report, "w") as f:
                f.write(text)
    print(f"report: {args.report}" if args.report else text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
