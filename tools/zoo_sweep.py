#!/usr/bin/env python
"""Sweep trunksplit over the model zoos a user brings: torchvision, timm, transformers.

    python tools/zoo_sweep.py --libraries torchvision timm --size 64 --out output/zoo_sweep.jsonl
    python tools/zoo_sweep.py --libraries timm --peaks --size 224 --limit 20
    python tools/zoo_sweep.py --libraries torchvision --peaks --features res3 flatten --out output/zoo_features.jsonl
    python tools/zoo_sweep.py --libraries timm --wrap 0.6 --size 224 --limit 20
    python tools/zoo_sweep.py --libraries torchvision --budget 0.5 --objective time --batch 8

Each model is built with random weights (nothing is downloaded). ``CheckpointedTrunk(model,
num_splits=4, strategy="balanced")`` then trains two steps beside the same model unsplit, from
the same weights and seeds; the model is *exact* when outputs, every gradient, every parameter
after the SGD step and every buffer are bit-identical. Traced models (no torchvision family)
are also checked against the model's own forward. A model the trunk refuses (torch.fx cannot
trace it) is *refused*, any other exception a *crash*. With ``--peaks`` the balanced trunk's
predicted step peak is compared with the measured one (exact tensor bytes) in each gradient mode
of ``--gradients`` (kept between steps and allocated by the step, both by default; or stepped in
backward, ``in_backward``: SGD with momentum), and both with
the plain step. With ``--budget B`` (and ``--objective``), the budget plan's trunk (regions and all,
gradients kept) is checked for exactness instead of the balanced one, at B or, where a model's floor at
the input is above it, at the floor. With ``--wrap B``, ``apply_activation_checkpointing(
model, memory_budget=B)`` is checked instead: exact against the plain model, and its measured
peak within 3% of the budget (or the smallest feasible budget it names). timm models: the smallest two of each timm
module; transformers models: the listed vision models, where the package is installed. The
summary table per library is printed at the end; every model's row goes to ``--out``.
"""
import argparse
import contextlib
import copy
import gc
import json
import os
import re
import signal
import statistics
import sys
import time
import traceback
import warnings

import torch
import torchvision

from trunksplit import BudgetTooLowError, CheckpointedTrunk, PeakMemory, apply_activation_checkpointing, optimizer_in_backward

TRANSFORMERS = ["ViTModel", "ConvNextModel", "ResNetModel", "SwinModel", "Dinov2Model", "ViTForImageClassification", "ResNetForImageClassification"]


def torchvision_models(max_params: float = 200e6):
    """Every torchvision classification builder with at most ``max_params`` parameters (the four
    above it, ViT-L/16, ViT-L/32, ViT-H/14 and RegNetY-128GF, would need several copies of
    1.2-2.6 GB each on a CPU)."""
    for name in torchvision.models.list_models(module=torchvision.models):
        n = torchvision.models.get_model_weights(name).DEFAULT.meta["num_params"]  # the published count, nothing built
        if n <= max_params:
            yield "torchvision", name, lambda size, name=name: torchvision.models.get_model(name, **_vit_size(name, size))


def _vit_size(name, size):
    if size is None:
        return {}
    if name.startswith("vit_"):
        return {"image_size": size}
    return {"input_size": (size, size)} if name.startswith("maxvit") else {}


def timm_models(per_module: int = 2, max_params: float = 60e6):
    """The ``per_module`` smallest models of every timm module (counted on the meta device; the
    ``test_*`` models, timm's own fixtures, left out)."""
    import timm

    for module in timm.list_modules():
        sized = []
        for name in timm.list_models(module=module):
            if name.startswith("test_"):
                continue
            n = _meta_params(lambda: timm.create_model(name, pretrained=False))
            if n is not None and n <= max_params:
                sized.append((n, name))
        for _, name in sorted(sized)[:per_module]:
            yield "timm", name, lambda size, name=name: _timm_model(timm, name, size)


def _meta_params(build):
    """A model's parameter count, built on the meta device (no memory); None where it cannot be built."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sum(p.numel() for p in build().parameters())
    except Exception:  # noqa: BLE001 - a model that cannot even be built is left out of the sweep
        return None


def _timm_model(timm, name, size):
    if size is None:
        return timm.create_model(name, pretrained=False)
    try:
        return timm.create_model(name, pretrained=False, img_size=size)
    except TypeError:  # a model without an img_size argument: built as it comes
        return timm.create_model(name, pretrained=False)


def input_size(model, size: int) -> int:
    """``size`` if the plain model runs it, else the size the model was made for (timm's
    ``pretrained_cfg``, or 224): some models only take multiples of a window or a fixed size."""
    for candidate in (size, _native_size(model), 299):
        try:
            with torch.no_grad():  # in training mode, as trained: auxiliary heads run too
                copy.deepcopy(model).train()(torch.zeros(2, 3, candidate, candidate))
            return candidate
        except Exception:  # noqa: BLE001 - the model's own refusal of this size
            continue
    raise RuntimeError(f"the plain model runs neither {size}px, {_native_size(model)}px nor 299px inputs")


def _built_and_sized(build, size: int):
    """The model built for ``size`` and that size; else built as it comes, at the size it runs."""
    try:
        model = build(size)
        return model, input_size(model, size)
    except Exception:  # noqa: BLE001 - a model that cannot be built for, or run at, this size
        model = build(None)
        return model, input_size(model, _native_size(model))


def _native_size(model) -> int:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return int(cfg.get("input_size", (3, 224, 224))[-1])


def transformers_models():
    try:
        import transformers
    except ImportError:
        return
    for cls in TRANSFORMERS:
        config = getattr(transformers, re.split("Model|For", cls)[0] + "Config")()
        yield "transformers", cls, lambda size, cls=cls, config=config: getattr(transformers, cls)(config)


def _tensors(value):
    """Every tensor in a (nested) output: lists, tuples, named tuples, dicts, dataclass-like objects."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


def _step(module, x, seed, weights=None):
    """A training step's forward and backward; ``weights`` (one per output, made before the step): the loss
    ``sum((o * w).sum())``, whose backward makes each output's gradient and nothing else of its size."""
    torch.manual_seed(seed)
    out = [o for o in _tensors(module(x)) if o.requires_grad]
    sum((o * w).sum() if weights else o.float().pow(2).mean() for o, w in zip(out, weights or out)).backward()
    return [o.detach() for o in out]


def _weights(module, x):
    """One fixed random tensor per output of ``module`` at ``x`` (see _step)."""
    with torch.no_grad():
        out = _tensors(module.eval()(x))
    module.train()
    return [torch.randn(o.shape, generator=torch.Generator().manual_seed(k), dtype=o.dtype) for k, o in enumerate(out)]


def _two_steps(module, x):
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    _step(module, x, 1)
    opt.step()
    opt.zero_grad()
    return _step(module, x, 2)


def exact_row(model, x, budget=0.0, objective="auto"):
    """Whether the balanced trunk (with ``budget``: the budget plan, see :func:`_budget_trunk`) trains
    exactly as the unsplit one (and as the model itself, when traced)."""
    plain = CheckpointedTrunk(copy.deepcopy(model))
    if budget:
        trunk, budget = _budget_trunk(model, x, budget, objective)
    else:
        trunk = CheckpointedTrunk(copy.deepcopy(model), num_splits=4, strategy="balanced")
    want, got = _two_steps(plain, x), _two_steps(trunk, x)
    same = len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    for (n, a), b in zip(plain.named_parameters(), trunk.parameters()):
        same = same and torch.equal(a, b) and (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
    same = same and all(torch.equal(a, b) for a, b in zip(plain.buffers(), trunk.buffers()))
    traced = list(plain.feature_blocks)[-1] == "output"  # a family's blocks (torchvision's, transformers') end at its pooled feature
    if traced:  # the traced chain is the model's own forward
        torch.manual_seed(3)
        own = _tensors(model(x))
        torch.manual_seed(3)
        chain = _tensors(CheckpointedTrunk(copy.deepcopy(model))(x)[-1])
        same = same and len(own) == len(chain) > 0 and all(torch.equal(a, b) for a, b in zip(own, chain))
    row = {"result": "exact" if same else "differs", "segments": len(trunk.plan.segments), "traced": traced}
    if budget:
        row.update(budget=budget, regions=sorted({policy for _, _, policy in trunk.plan.regions}))  # the budget: asked, or the floor
    return row


def _budget_trunk(model, x, budget, objective):
    """A budget plan's trunk (gradients kept: activations only) and its budget as a fraction of the
    unsplit step: ``budget``, or the model's floor at this input where that is above it."""
    def planned(b):
        trunk = CheckpointedTrunk(copy.deepcopy(model), memory_budget=b, objective=objective, gradients="kept")
        trunk.plan_for(x)
        return trunk

    try:
        return planned(budget), budget
    except BudgetTooLowError as e:
        return planned(e.smallest_bytes), round(e.smallest_bytes / e.unsplit_bytes, 3)


def _peak(module, x, gradients="kept", weighted=False):
    weights = _weights(module, x) if weighted else None
    _step(module, x, 0, weights)  # gradients exist (or an optimizer's state, stepped in backward), as from the second step on
    for p in module.parameters():  # where the loop leaves them: zeroed, or None (torch's default; the update freed them)
        p.grad = p.grad if gradients == "kept" else None
    with PeakMemory() as mem:
        _step(module, x, 0, weights)
    return mem.peak_bytes


def _trunk(model, gradients, **kwargs):
    """A trunk of a copy of ``model`` in a gradient mode; ``"in_backward"``: SGD with momentum stepped in
    its backward (the update's temporaries as :func:`trunksplit.optimizer_in_backward` tells the trunk)."""
    trunk = CheckpointedTrunk(copy.deepcopy(model), gradients=gradients, **kwargs)
    if gradients == "in_backward":
        optimizer_in_backward(trunk, torch.optim.SGD, lr=1e-3, momentum=0.9)
    return trunk


def peaks_row(model, x, modes=("kept",), features=None):
    """The balanced trunk's predicted and measured peak, and the plain step's, in each gradient mode
    of ``modes``; ``predicted_vs_measured`` is the one furthest from 1. ``features``: the trunks return
    these blocks, each weighed by the loss (see _step)."""
    row, asked = {"result": "planned"}, {"out_feat_keys": features} if features else {}
    for gradients in modes:
        plain = _peak(_trunk(model, gradients, **asked), x, gradients, bool(features))
        trunk = _trunk(model, gradients, num_splits=4, strategy="balanced", **asked)
        plan = trunk.plan_for(x)
        measured = _peak(trunk, x, gradients, bool(features))
        row.update({f"plain_{gradients}": plain, f"predicted_{gradients}": plan.predicted_peak_bytes, f"measured_{gradients}": measured,
                    f"predicted_vs_measured_{gradients}": plan.predicted_peak_bytes / measured})
    row["measured_vs_plain"] = row[f"measured_{modes[0]}"] / row[f"plain_{modes[0]}"]
    row["predicted_vs_measured"] = max((row[f"predicted_vs_measured_{g}"] for g in modes), key=lambda r: abs(r - 1))
    row["predicted"] = row[f"predicted_{modes[0]}"]
    return row


def wrap_row(model, x, budget):
    """``apply_activation_checkpointing(model, memory_budget=budget)``: exact against the plain
    model over two steps, and its step peak measured independently (gradients kept), or the
    smallest feasible budget the refusal names."""
    plain = copy.deepcopy(model)
    wrapped = copy.deepcopy(model)
    try:
        plan = apply_activation_checkpointing(wrapped, memory_budget=budget, example_inputs=(x,), gradients="kept")
    except BudgetTooLowError as e:
        return {"result": "infeasible", "smallest": e.smallest_bytes and round(e.smallest_bytes / e.unsplit_bytes, 3)}
    same = _same_training(model, plain, wrapped, x)
    ratio = _peak(wrapped, x) / _peak(plain, x)
    return {"result": same, "wrapped": len(plan.names), "measured_vs_plain": ratio, "meets": ratio <= budget * 1.03}


def _same_training(model, plain, other, x) -> str:
    """"exact" when two steps of ``other`` equal two of ``plain`` bit for bit (outputs, gradients);
    else "nondeterministic" when the plain model does not even repeat itself (CPU kernels that
    accumulate in a varying order, as index_put's backward), else "differs"."""
    def same(a, b):
        want, got = _two_steps(a, x), _two_steps(b, x)
        equal = len(want) == len(got) and all(torch.equal(p, q) for p, q in zip(want, got))
        return equal and all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()) if p.grad is not None)

    if same(plain, other):
        return "exact"
    return "differs" if same(copy.deepcopy(model), copy.deepcopy(model)) else "nondeterministic"


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    def alarm(*_):
        raise _Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sweep_one(library, name, build, size, batch, peaks, seconds, wrap=0.0, gradients=("kept",), budget=0.0, objective="auto", features=None):
    row = {"library": library, "model": name}
    start = time.perf_counter()
    try:
        with _time_limit(seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model, row["size"] = _built_and_sized(build, size)
            x = torch.randn(batch, 3, row["size"], row["size"], generator=torch.Generator().manual_seed(0))
            row.update(wrap_row(model, x, wrap) if wrap else peaks_row(model, x, tuple(gradients), features) if peaks else exact_row(model, x, budget, objective))
    except TypeError as e:
        row.update(result="refused" if "trace" in str(e) or "feature_blocks" in str(e) else "crash", error=str(e).splitlines()[0][:300])
    except ValueError as e:
        row.update(result="refused" if "unknown feature key" in str(e) else "crash", error=str(e).splitlines()[0][:300])
    except _Timeout as e:
        row.update(result="timeout", error=str(e))
    except Exception as e:  # noqa: BLE001 - the sweep reports every other failure as a crash
        row.update(result="crash", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", where=traceback.format_exc().splitlines()[-3][:200])
    row["seconds"] = round(time.perf_counter() - start, 2)
    gc.collect()  # an optimizer stepped in backward and its model hold each other (a cycle through the parameters): free them now
    return row


def summary(rows, mode: str, asked: float = 0.0) -> str:
    """The per-library table: counts by result, for ``peaks`` and ``wrap`` the peak ratios, for
    ``budget`` how many were planned at their floor, above the ``asked`` budget."""
    extra = {"exact": [], "budget": ["planned at their floor", "median budget", "with regions"], "peaks": ["median measured / plain", "worst predicted / measured"], "wrap": ["infeasible", "meet the budget", "median measured / plain"]}[mode]
    head = ["library", "models", "planned" if mode == "peaks" else "exact", "differs", "nondeterministic model", "refused", "crash or timeout", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for lib in dict.fromkeys(r["library"] for r in rows):
        mine = [r for r in rows if r["library"] == lib]
        count = {k: sum(r.get("result") == k for r in mine) for k in ("exact", "planned", "differs", "nondeterministic", "refused", "crash", "timeout", "infeasible")}
        cells = [lib, len(mine), count["planned" if mode == "peaks" else "exact"], count["differs"], count["nondeterministic"], count["refused"], count["crash"] + count["timeout"]]
        ratios = [r["measured_vs_plain"] for r in mine if "measured_vs_plain" in r]
        median = f"{statistics.median(ratios):.2f}" if ratios else "-"
        if mode == "peaks":
            cells += [median, f"±{max((abs(r['predicted_vs_measured'] - 1) for r in mine if 'predicted' in r), default=0):.1%}"]
        elif mode == "wrap":
            cells += [count["infeasible"], sum(bool(r.get("meets")) for r in mine), median]
        elif mode == "budget":
            budgets = [r["budget"] for r in mine if "budget" in r]
            floors = sum(r["budget"] > asked for r in mine if "budget" in r)
            cells += [floors, f"{statistics.median(budgets):.2f}" if budgets else "-", sum(bool(r.get("regions")) for r in mine)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libraries", nargs="+", default=["torchvision", "timm", "transformers"], choices=["torchvision", "timm", "transformers"])
    p.add_argument("--size", type=int, default=64, help="input resolution")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--peaks", action="store_true", help="compare predicted and measured peaks instead of checking exactness")
    p.add_argument("--gradients", nargs="+", choices=["kept", "allocated", "in_backward"], default=["kept", "allocated"],
                   help="with --peaks: the gradient modes predicted and measured (the first gives measured / plain)")
    p.add_argument("--features", nargs="+", default=None,
                   help="with --peaks: the feature blocks the trunks return (res3 flatten), each weighed by the loss; a model without them is refused")
    p.add_argument("--wrap", type=float, default=0.0, help="check apply_activation_checkpointing at this memory budget instead")
    p.add_argument("--budget", type=float, default=0.0,
                   help="check the budget plan at this fraction instead of the balanced one (gradients kept; at the model's floor where that is above it)")
    p.add_argument("--objective", choices=["auto", "flops", "time"], default="auto", help="with --budget: what the plan is priced in")
    p.add_argument("--limit", type=int, default=0, help="at most this many models per library (0: all)")
    p.add_argument("--only", nargs="*", default=[], help="just these model names")
    p.add_argument("--seconds", type=int, default=300, help="per model; slower ones are reported as timeouts")
    p.add_argument("--out", default="output/zoo_sweep.jsonl")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out and sweep only the models they lack")
    p.add_argument("--shard", default="0/1", help="K/N: sweep only every N-th model from the K-th (run N of them side by side on one --out with --resume)")
    p.add_argument("--summarize", action="store_true", help="print the table of the rows in --out, sweeping nothing")
    return p


def _mode(args) -> str:
    return "wrap" if args.wrap else "peaks" if args.peaks else "budget" if args.budget else "exact"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sources = {"torchvision": torchvision_models, "timm": timm_models, "transformers": transformers_models}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    if args.summarize:
        with open(args.out) as f:
            print(summary([json.loads(line) for line in f if line.strip()], _mode(args), args.budget))
        return 0
    k, n = (int(v) for v in args.shard.split("/"))
    if args.resume and os.path.exists(args.out):  # a long sweep that was stopped goes on where it was
        with open(args.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    done = {(r["library"], r["model"]) for r in rows}
    with open(args.out, "a" if args.resume else "w") as f:
        for lib in args.libraries:
            models = [m for m in sources[lib]() if not args.only or m[1] in args.only]
            for library, name, build in models[: args.limit or None][k::n]:
                if (library, name) in done:
                    continue
                rows.append(sweep_one(library, name, build, args.size, args.batch, args.peaks, args.seconds, args.wrap, args.gradients, args.budget, args.objective, args.features))
                f.write(json.dumps(rows[-1]) + "\n")
                f.flush()
                print(json.dumps(rows[-1]), flush=True)
    print(summary(rows, _mode(args), args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
