"""The multi-crop step backward by crop group (TRAIN.BACKWARD_BY_CROP_GROUP): the whole step's loss
and gradients, the whole step's weights after training, in less memory; in one process, under DDP
and FSDP2, stepped in backward, and resumed."""
import contextlib
import copy
import os
import re

import pytest
import torch

from trunksplit import optimizer_in_backward
from trunksplit import trunk as trunk_module
from trunksplit.ssl import loop
from trunksplit.ssl.config import load_config
from trunksplit.ssl.model import build_ssl_model
from trunksplit.ssl.grouped import by_crop_group, grouped_step
from trunksplit.ssl.loop import train

from distributed_harness import run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "DATA.IMAGE_SIZE", "40", "TRAIN.BATCH_SIZE_PER_RANK", "4", "MODEL.HEAD.HIDDEN_DIM", "64",
         "DATA.NUM_WORKERS", "0", "METHOD.NUM_PROTOTYPES", "32"]
DINO = ["METHOD.NAME", "dino", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]",
        "OPTIM.NAME", "adamw", "OPTIM.LR", "0.0005"]
SWAV = ["METHOD.NAME", "swav", "DATA.CROP_SIZES", "[32, 24, 16]", "DATA.CROP_COUNTS", "[2, 1, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.2, 0.5], [0.05, 0.4]]",
        "OPTIM.LR", "0.01"]
# two resolutions: a parameter's gradient is two groups' parts added in either order, the same float sum
SWAV2 = ["METHOD.NAME", "swav", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "OPTIM.LR", "0.01"]
# one large crop: no term reads it (it is its own target), but its forward moves BatchNorm and gives SwAV its codes
DINO1 = [*DINO[:4], "DATA.CROP_COUNTS", "[1, 3]", *DINO[6:]]
SWAV1 = [*SWAV2[:4], "DATA.CROP_COUNTS", "[1, 2]", *SWAV2[6:]]
METHODS = {"dino": DINO, "swav": SWAV, "swav2": SWAV2, "dino1": DINO1, "swav1": SWAV1}


def _config(method, *more):
    return load_config(QUICK, [*SMALL, *METHODS[method], *more])


def _crops(cfg, batch=4):
    g = torch.Generator().manual_seed(5)
    sizes = [s for s, c in zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS) for _ in range(c)]
    return [torch.randn(batch, 3, s, s, generator=g) for s in sizes]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("method", ["dino", "swav", "swav2", "dino1", "swav1"])
def test_one_grouped_step_gives_the_whole_steps_loss_gradients_and_centre(method):
    """The whole step (every crop's forward, one loss, one backward: the loop's own path with the
    switch off) against the grouped one, from one model: the loss, every gradient, DINO's centre.
    A lone large crop's group has no backward: no term reads it."""
    cfg = _config(method)
    torch.manual_seed(0)
    model = build_ssl_model(cfg)
    crops = _crops(cfg)
    whole, grouped = copy.deepcopy(model), copy.deepcopy(model)
    loss = loop.whole_step_loss(cfg, whole, whole(crops), crops, 0)
    loss.backward()
    parts = []
    got = grouped_step(cfg, grouped, grouped, crops, 0, contextlib.nullcontext(), lambda part: (parts.append(part), part.backward()), contextlib.nullcontext)
    assert len(parts) == len(cfg.DATA.CROP_SIZES) - (cfg.DATA.CROP_COUNTS[0] == 1)  # one backward per resolution whose crops a term reads
    assert abs(got.item() / loss.item() - 1) <= 1e-6
    for (name, a), b in zip(whole.named_parameters(), grouped.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert _relative(a.grad, b.grad) <= 1e-6, name
    for (name, a), b in zip(whole.named_buffers(), grouped.buffers()):
        assert torch.equal(a, b), name  # BatchNorm saw the same crops per call; the centre the same teacher outputs


def test_only_dino_and_swav_with_several_resolutions_run_by_group_and_the_switch_is_checked():
    crops = _crops(_config("dino"))
    assert by_crop_group(_config("dino"), crops) and by_crop_group(_config("swav"), _crops(_config("swav")))
    assert not by_crop_group(_config("dino", "TRAIN.BACKWARD_BY_CROP_GROUP", "False"), crops)
    one_size = _config("dino", "DATA.CROP_SIZES", "[32, 32]")
    assert not by_crop_group(one_size, _crops(one_size))  # one resolution: one group, the whole step
    simclr = load_config(QUICK, SMALL)
    assert not by_crop_group(simclr, _crops(simclr))
    with pytest.raises(ValueError, match="TRAIN.BACKWARD_BY_CROP_GROUP must be True or False"):
        _config("dino", "TRAIN.BACKWARD_BY_CROP_GROUP", "None")


def _run(tmp_path, name, method, *more):
    return train(_config(method, "OUTPUT_DIR", str(tmp_path / name), "TRAIN.STEPS", "3", *more))


@pytest.mark.parametrize("method", ["dino", "swav2"])
def test_a_grouped_run_trains_the_whole_step_runs_weights_in_less_memory(tmp_path, method):
    """Three steps each way: the same weights, buffers and teacher (the sums' order aside), a lower
    step peak, and the end-of-run comparison made group by group like the step it compares."""
    (whole, whole_row), (grouped, grouped_row) = (_run(tmp_path, str(g), method, "TRAIN.BACKWARD_BY_CROP_GROUP", str(g)) for g in (False, True))
    for (name, a), (_, b) in zip(whole.state_dict().items(), grouped.state_dict().items()):
        assert a.dtype == torch.int64 and torch.equal(a, b) or _relative(a.float(), b.float()) <= 1e-5, name
    assert grouped_row["peak_memory_bytes"] < 0.9 * whole_row["peak_memory_bytes"], (grouped_row["peak_memory_bytes"], whole_row["peak_memory_bytes"])
    assert grouped_row["memory_vs_plain"]["checkpointed"] < 0.9 * whole_row["memory_vs_plain"]["checkpointed"]
    assert abs(grouped_row["memory_vs_plain"]["checkpointed"] / grouped_row["peak_memory_bytes"] - 1) < 0.05
    cfg = _config(method)  # the summary names each crop group's plan
    groups = [f"group {k + 1} ({n} x {s}px): " for k, (s, n) in enumerate(zip(cfg.DATA.CROP_SIZES, cfg.DATA.CROP_COUNTS))]
    assert [g in grouped_row["plan"] for g in groups] == [True] * len(groups), grouped_row["plan"]


@pytest.mark.parametrize("method, grouped", [("dino1", "True"), ("swav1", "True"), ("swav1", "False")])
def test_one_image_per_rank_with_a_lone_large_crop_says_which_config_values_give_its_batchnorms_more(tmp_path, method, grouped):
    """DINO and SwAV with one large crop (``CROP_COUNTS [1, ...]``) at one image per rank: its group runs the trunk on
    one 32px image, 1x1 at ResNet's last stage, and SwAV's head on one embedding: torch's BatchNorm refuses one value per
    channel, which the launcher printed as it came ("Expected more than 1 value per channel when training"), naming
    no config value. Now it names them; two images per rank train."""
    overrides = ["OUTPUT_DIR", str(tmp_path / "one"), "TRAIN.STEPS", "1", "TRAIN.BACKWARD_BY_CROP_GROUP", grouped, "TRAIN.BATCH_SIZE_PER_RANK", "1"]
    with pytest.raises(ValueError, match=r"one value per channel .*at 1 image per rank the step runs the trunk and head on 1 x 32px and [23] x 16px crops.*"
                                         r"TRAIN.BATCH_SIZE_PER_RANK.*DATA.CROP_SIZES.*DATA.CROP_COUNTS"):
        train(_config(method, *overrides))
    overrides[1], overrides[-1] = str(tmp_path / "two"), "2"
    _, last = train(_config(method, *overrides))
    assert last["step"] == 1 and torch.isfinite(torch.tensor(last["loss"]))


def test_an_optimizer_stepped_in_backward_waits_for_the_last_groups_gradients():
    """``accumulating()``: a backward inside it updates nothing; the next one updates each parameter
    once, from the whole sum: the standard step on the same two backwards, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    standard, stepped = copy.deepcopy(model), copy.deepcopy(model)
    xs = [torch.randn(4, 8), torch.randn(3, 8)]
    optimizer = torch.optim.AdamW(standard.parameters(), lr=0.1)
    for x in xs:
        standard(x).pow(2).sum().backward()
    optimizer.step()
    stand_in = optimizer_in_backward(stepped, torch.optim.AdamW, lr=0.1)
    with stand_in.accumulating():
        stepped(xs[0]).pow(2).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), stepped.parameters()))  # nothing updated yet
    stepped(xs[1]).pow(2).sum().backward()
    for a, b in zip(standard.parameters(), stepped.parameters()):
        assert torch.equal(a, b) and b.grad is None


# a small trunk at larger crops: activations outweigh the gradients, which both steps hold whole at their peak
STEPPED = ["OPTIM.IN_BACKWARD", "True", "MODEL.TRUNK.NAME", "mobilenet_v3_small", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "1", "DATA.IMAGE_SIZE", "64", "DATA.CROP_SIZES", "[64, 48]",
           "DATA.CROP_COUNTS", "[2, 4]"]


def test_a_run_stepped_in_backward_trains_grouped_the_whole_steps_weights_in_less_memory(tmp_path, monkeypatch):
    """Stepped in backward, every group but the last holds its updates (the optimizer steps each
    parameter once, from its whole gradient): the whole step's weights bit for bit (two
    resolutions), a lower step peak (one group's activations beside the gradients, not every
    group's), and the side-by-side copies stepped grouped as the run is. The held group's trunk is
    planned for the gradients it keeps, before the first step, as the plan line says."""
    whole, whole_row = _run(tmp_path, "False", "dino", *STEPPED, "TRAIN.BACKWARD_BY_CROP_GROUP", "False")
    planned = []
    real = trunk_module.plan_trunk
    monkeypatch.setattr(trunk_module, "plan_trunk", lambda *a, **kw: planned.append((a[1].shape, kw.get("held"))) or real(*a, **kw))
    grouped, grouped_row = _run(tmp_path, "True", "dino", *STEPPED, "TRAIN.BACKWARD_BY_CROP_GROUP", "True")
    assert planned == [((8, 3, 64, 64), True), ((16, 3, 48, 48), False)], planned  # once each, the large crops' call held
    assert "group 1 (2 x 64px, updates held): " in grouped_row["plan"] and "group 2 (4 x 48px): " in grouped_row["plan"], grouped_row["plan"]
    for (name, a), (_, b) in zip(whole.state_dict().items(), grouped.state_dict().items()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in grouped.parameters())  # each freed at its update
    assert grouped_row["peak_memory_bytes"] < 0.85 * whole_row["peak_memory_bytes"], (grouped_row["peak_memory_bytes"], whole_row["peak_memory_bytes"])
    assert abs(grouped_row["memory_vs_plain"]["checkpointed"] / grouped_row["peak_memory_bytes"] - 1) < 0.05, grouped_row


def test_a_budget_the_held_group_cannot_meet_is_refused_saying_why_and_the_one_it_names_trains(tmp_path):
    """Stepped in backward, the first group's backward keeps every gradient of the trunk (its updates wait
    for the last group's): at a small batch no plan brings it to half its unsplit step. Refused before
    anything is written, in the config's terms, naming why and the least budget; that one trains."""
    out = tmp_path / "run"
    overrides = ["OUTPUT_DIR", str(out), "TRAIN.STEPS", "1", "OPTIM.IN_BACKWARD", "True", "DATA.IMAGE_SIZE", "64", "DATA.CROP_SIZES", "[64, 32]",
                 "TRAIN.BATCH_SIZE_PER_RANK", "8"]  # activations enough that the held group reaches below 0.99 of its unsplit step
    with pytest.raises(ValueError, match=r"MEMORY_BUDGET 0.5 cannot be met .* Set it to \S+ or more; an earlier crop group's backward runs "
                                         r"with the updates held .* keeps every gradient of the trunk") as refused:
        train(_config("dino", *overrides, "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", "0.5"))
    assert not out.exists()
    named = re.search(r"Set it to (\S+) or more", str(refused.value)).group(1)
    _, row = train(_config("dino", *overrides, "MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET", named))
    assert 0.5 < float(named) < 1 and "group 1 (2 x 64px, updates held): budget" in row["plan"], row["plan"]


def _ranks(rank, world_size, out, method, strategy):
    """Train 2 steps whole, then grouped, in the same two processes; each rank saves its weights."""
    strategy, _, stepped = strategy.partition(" ")
    how = ["DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True"] if strategy == "manual" else ["DISTRIBUTED.STRATEGY", strategy]
    how += ["OPTIM.IN_BACKWARD", "True"] if stepped else []
    for grouped in (False, True):
        run = os.path.join(out, str(grouped))
        # vissl's split: what this test checks does not depend on the plan, and it takes no profiling
        model, _ = train(_config(method, "OUTPUT_DIR", run, "TRAIN.STEPS", "2", *how, "TRAIN.BACKWARD_BY_CROP_GROUP", str(grouped),
                                 "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl"))
        full = strategy == "fsdp"
        torch.save({n: p.full_tensor() if full else p.detach() for n, p in model.named_parameters()}, os.path.join(run, f"rank{rank}.pt"))


# slow, all: DDP (its reductions are counted in the fast suite: test_under_ddp_a_grouped_step_reduces_its_gradients_once_as_the_whole_step_does),
# vissl's manual path, the steps stepped in backward (held by holding_updates: the one-process test) and FSDP2 (its grouped step is checked
# fast against DDP's in tests/ssl/test_dino.py, and its gradients between groups by test_under_fsdp2_a_grouped_step_keeps_each_groups_gradients_sharded)
@pytest.mark.parametrize("method,strategy", [pytest.param("dino", "ddp", marks=pytest.mark.slow), pytest.param("swav2", "fsdp", marks=pytest.mark.slow),
                                             pytest.param("swav2", "manual", marks=pytest.mark.slow),
                                             pytest.param("dino", "ddp in_backward", marks=pytest.mark.slow), pytest.param("swav2", "fsdp in_backward", marks=pytest.mark.slow),
                                             pytest.param("dino1", "ddp", marks=pytest.mark.slow), pytest.param("swav1", "fsdp in_backward", marks=pytest.mark.slow)])
def test_two_ranks_train_grouped_as_they_train_the_whole_step(tmp_path, method, strategy):
    """2 gloo processes each way (DDP: no_sync before the last group; FSDP2: a reduce-scatter per
    group; vissl's manual path: one all-reduce after the step, as before; stepped in backward, DDP's
    hook or FSDP2 updates after the last group's reduction): every rank ends with the same weights,
    those of the whole-step run."""
    run_processes(_ranks, 2, (str(tmp_path), method, strategy))
    ends = {}
    for grouped in (False, True):
        ranks = [torch.load(tmp_path / str(grouped) / f"rank{r}.pt") for r in range(2)]
        for name in ranks[0]:
            assert torch.equal(ranks[0][name], ranks[1][name]), name
        ends[grouped] = ranks[0]
    for name, a in ends[False].items():
        assert _relative(a, ends[True][name]) <= 1e-5, name


def _gradients_between_groups(rank, world_size, out):
    """A grouped SwAV step under FSDP2, as the launcher wraps and runs it; after each group's backward,
    the bytes of gradient this rank holds in its parameters' ``.grad``."""
    from trunksplit.ssl.strategy import FSDP

    cfg = _config("swav2", "DISTRIBUTED.STRATEGY", "fsdp", "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl")
    torch.manual_seed(0)
    model = build_ssl_model(cfg)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    strategy = FSDP(rank, world_size, torch.device("cpu"))
    wrapped = strategy.wrap(cfg, model)
    held = []

    def backward(part):
        part.backward()
        held.append(sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None))

    grouped_step(cfg, model, wrapped, _crops(cfg), 0, contextlib.nullcontext(), backward, lambda: strategy.accumulating(wrapped))
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    torch.save({"held": held, "whole": whole, "shards": shards}, os.path.join(out, f"held{rank}.pt"))


def test_under_fsdp2_a_grouped_step_keeps_each_groups_gradients_sharded(tmp_path):
    """Each group's gradients are reduce-scattered after its backward and add up as shards: between
    groups a rank holds its shard of every gradient, not the whole model's. Before, every group but the
    last ran without gradient sync, and each rank kept the whole model's gradients unsharded until the
    last (the SEER recipe on 2 CPU ranks peaked at 45.5 MiB, now 40.8)."""
    run_processes(_gradients_between_groups, 2, (str(tmp_path),))
    for rank in range(2):
        got = torch.load(tmp_path / f"held{rank}.pt")
        assert got["held"] == [got["shards"], got["shards"]] and got["shards"] <= 0.55 * got["whole"], got


def _recipe_block(heading: str) -> str:
    with open(os.path.join(ROOT, "docs", "integrations.md")) as f:
        page = f.read()
    return page.split(f"## {heading}", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_own_loop_recipe_gives_the_gradients_of_dinos_whole_step_loss():
    """docs/integrations.md's block, run as printed, against DINO's loss over all crops at once."""
    from trunksplit.ssl.losses import dino_loss

    namespace = {}
    exec(_recipe_block("Your own loop: DINO backward by crop group"), namespace)
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GELU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 32))
    teacher, whole = copy.deepcopy(student), copy.deepcopy(student)
    crops = [torch.randn(4, 3, 16, 16) for _ in range(2)] + [torch.randn(4, 3, 8, 8) for _ in range(4)]
    center = torch.randn(1, 32) * 0.1
    got, targets = namespace["dino_backward_by_crop_group"](student, teacher, crops, center)
    with torch.no_grad():
        teacher_out = list(teacher(torch.cat(crops[:2])).chunk(2))
    want = dino_loss([whole(c) for c in crops], teacher_out, center, 0.1, 0.04)
    want.backward()
    assert abs(got.item() / want.item() - 1) <= 1e-6
    assert all(torch.equal(a, b) for a, b in zip(targets, teacher_out))  # what the centre moves by
    for (name, a), b in zip(whole.named_parameters(), student.parameters()):
        assert _relative(a.grad, b.grad) <= 1e-6, name


def _counted_reductions(rank, world_size, out):
    """DINO under DDP, whole and grouped, each bucket's all-reduce counted by a communication hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from trunksplit.ssl import strategy

    counts = {}
    wrap = strategy.DDP.wrap

    def counting_wrap(self, cfg, model):
        ddp = wrap(self, cfg, model)
        ddp.register_comm_hook(None, lambda state, bucket: (counts.__setitem__(grouped, counts.get(grouped, 0) + 1), allreduce_hook(None, bucket))[1])
        return ddp

    strategy.DDP.wrap = counting_wrap
    for grouped in (False, True):
        train(_config("dino", "OUTPUT_DIR", os.path.join(out, str(grouped)), "TRAIN.STEPS", "2", "TRAIN.BACKWARD_BY_CROP_GROUP", str(grouped)))
    torch.save(counts, os.path.join(out, f"counts{rank}.pt"))


def test_under_ddp_a_grouped_step_reduces_its_gradients_once_as_the_whole_step_does(tmp_path):
    """Every group but the last under ``no_sync()``: as many bucket all-reduces per step as the whole
    step's one backward makes (without it, one set per group)."""
    run_processes(_counted_reductions, 2, (str(tmp_path),))
    counts = torch.load(tmp_path / "counts0.pt")
    assert counts[True] == counts[False] > 0, counts
