"""TRAIN.BATCH_SIZE_PER_RANK 0 fits the launcher's whole step (every crop group, the head, the loss,
a DINO teacher, gradients and optimizer state), and ``trunksplit fit --config-file`` answers the same.
The reference is the training run's own meter: resident bytes counted from the model and the logged
step peak."""
import contextlib
import importlib
import json
import os

import pytest
import torch

from trunksplit import trunk as trunk_module
from trunksplit.cli import main
from trunksplit.ssl.config import load_config
from trunksplit.fit import largest_fitting
from trunksplit.ssl.fit_step import crop_groups
from trunksplit.ssl.model import build_ssl_model
from trunksplit.ssl.loop import step_for_fit, train
from trunksplit.ssl.parallel import SLOW, convolution_slowdown

from distributed_harness import run_processes

fit_step_module = importlib.import_module("trunksplit.ssl.fit_step")  # the module: its _RestOfStep read higher on one rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["MODEL.TRUNK.NAME", "resnet18", "DATA.IMAGE_SIZE", "40", "MODEL.HEAD.HIDDEN_DIM", "64", "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "1",
         "DATA.NUM_IMAGES", "4096"]  # more than any fitted batch: the data set bounds a step too
DINO = ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "512", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 4]",
        "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "OPTIM.NAME", "adamw", "OPTIM.LR", "0.0005"]
SWAV = ["METHOD.NAME", "swav", "METHOD.NUM_PROTOTYPES", "32", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 4]",
        "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]", "OPTIM.LR", "0.01"]
METHODS = {"dino": DINO, "swav": SWAV, "simclr": ["DATA.CROP_SIZES", "[32]"]}
METHODS["simclr stepped in backward"] = [*METHODS["simclr"], "OPTIM.IN_BACKWARD", "True"]
# LARS, as DINO's ResNet-50 recipe: one update allocates a gradient's size, where the trunk's default plans for two
# local crops of 24 px, not 16: there ResNet-18's res5 would see one pixel, whose bf16 weight gradient torch computes wrong on a CPU (refused)
METHODS["dino stepped in backward, bf16"] = [*DINO, "OPTIM.NAME", "lars", "OPTIM.IN_BACKWARD", "True", "TRAIN.AUTOCAST", "bf16", "DATA.CROP_SIZES", "[32, 24]",
                                            "DATA.CROP_COUNTS", "[2, 2]"]
METHODS["simclr, vissl's manual DDP"] = [*METHODS["simclr"], "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION", "True", "MODEL.ACTIVATION_CHECKPOINTING.USE_REENTRANT", "True"]
LIMIT = 300 * 2**20


def _resident(model, optimizer: str) -> int:
    """Bytes resident between steps, counted by hand: the model's tensors and the optimizer's state
    (SGD's momentum, AdamW's two moments and step counters) of what trains."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    slots = {"adamw": 2, "sgd": 1, "lars": 1}[optimizer]
    return (sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            + slots * sum(p.numel() * p.element_size() for p in trainable) + (4 * len(trainable) if slots == 2 else 0))


def _fitted_run(out, method, grouped=True):
    """Train one step with the fitted batch; (batch, everything resident during that step as the run
    measured it, the trunk budget the run saved). Stepped in backward, two: the first step makes the
    optimizer's state, which the resident bytes count already."""
    overrides = ["OUTPUT_DIR", str(out / f"{method}-{grouped}"), *SMALL, *METHODS[method], "TRAIN.BACKWARD_BY_CROP_GROUP", str(grouped),
                 "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(LIMIT))]
    overrides += ["TRAIN.STEPS", "2"] if "OPTIM.IN_BACKWARD" in METHODS[method] else []
    model, last = train(load_config(QUICK, overrides))
    resident = _resident(model, load_config(QUICK, overrides).OPTIM.NAME)
    saved = load_config(str(out / f"{method}-{grouped}" / "config.yaml"))
    return saved.TRAIN.BATCH_SIZE_PER_RANK, resident + last["peak_memory_bytes"], saved.MODEL.ACTIVATION_CHECKPOINTING.MEMORY_BUDGET


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Each (method, grouped) run once for the module's tests: (batch, measured total)."""
    out, runs = tmp_path_factory.mktemp("fitted"), {}

    def run(method, grouped=True):
        if (method, grouped) not in runs:
            runs[method, grouped] = _fitted_run(out, method, grouped)
        return runs[method, grouped]

    return run


@pytest.mark.xdist_group("fitted")  # the module fixture's runs, made once on one worker
# slow: the same fit as dino's, one crop group or two; stepped in backward (7 s alone, 12-18 s in the suite), the fast suite
# keeps the launcher's fit predicting that step (test_dinos_teacher_adds_nothing...[in_backward]) and the trunk's fitted
# step stepped in backward filling 90-100% (tests/test_fit.py)
@pytest.mark.parametrize("method", ["dino", pytest.param("swav", marks=pytest.mark.slow), pytest.param("simclr", marks=pytest.mark.slow),
                                    pytest.param("simclr stepped in backward", marks=pytest.mark.slow)])
def test_the_fitted_batchs_whole_step_fills_the_memory_limit_without_passing_it(fitted, method):
    """Head, loss, teacher and every crop group counted: the step as the run measures it lands in
    0.85-1.00 of TRAIN.MEMORY_LIMIT (before, a SimCLR run measured 2.7% over it; multi-crop was refused).
    Stepped in backward, the fit's checking step measured the optimizer's state it made, counted resident
    already, and fitted a batch that filled 0.77 of the limit (its check now runs after a first step)."""
    batch, total, budget = fitted(method)
    assert batch >= 2 and 0.85 * LIMIT <= total <= LIMIT, (batch, total / LIMIT)
    assert 1 < budget < LIMIT  # the trunk's share, in bytes, saved with the batch (a resume trains with both)


@pytest.mark.slow  # 10-11 s: the fast suite keeps the fitted DINO step under DDP and the grouped fit (below)
def test_a_fitted_bf16_run_stepped_in_backward_trains_the_plans_its_fit_checked(tmp_path, monkeypatch):
    """Four defects, each failing this run. The fit profiled the trunk without the run's autocast and keyed
    its plans so: under bf16 its checks measured far above its line (1 image per rank was fitted) and the
    run planned again; a selective region failed in the recompute (pytorch/pytorch#193338); the run's
    optimizer (LARS with the recipe's arguments, not fit's stand-in) dropped the fitted plans and planning
    again refused the fitted budget by 0.3 MiB; and one backward through both crop sizes updates no trunk
    parameter before the first call's part of its gradient arrives (the later call's parts wait in
    autograd's buffers), which the fit did not count (0.82 of the limit). Now 0.85-1.00, with the plans
    the fit checked: the trunk is never planned again."""
    slowdown = convolution_slowdown(torch.bfloat16)
    if slowdown > SLOW:  # an AVX2-only CPU (2026-11-29): the fitted step alone ran past 20 minutes
        pytest.skip(f"this CPU emulates bf16 (its convolutions {slowdown:.0f}x as long as fp32's): the fitted run takes over 20 minutes here")
    planned_again = []
    real = trunk_module.plan_trunk
    monkeypatch.setattr(trunk_module, "plan_trunk", lambda *a, **kw: planned_again.append(a[1].shape) or real(*a, **kw))
    batch, total, _ = _fitted_run(tmp_path, "dino stepped in backward, bf16")
    assert batch >= 2 and 0.85 * LIMIT <= total <= LIMIT, (batch, total / LIMIT)
    assert planned_again == []


@pytest.mark.xdist_group("fitted")  # the module fixture's runs, made once on one worker
def test_backward_by_crop_group_fits_more_images_than_the_whole_step(fitted):
    """One group's activations alive at a time: more images per rank in the same memory, each run within it."""
    grouped, grouped_total, _ = fitted("dino", True)
    whole, whole_total, _ = fitted("dino", False)
    assert grouped >= 1.4 * whole, (grouped, whole)
    assert 0.85 * LIMIT <= whole_total <= LIMIT and grouped_total <= LIMIT


def _prediction(method_overrides):
    """fit's prediction of a launcher step (``fit_step._StepPrediction``), before any batch is searched."""
    cfg = load_config(QUICK, [*SMALL, *method_overrides, "TRAIN.MEMORY_LIMIT", str(float(LIMIT))])
    torch.manual_seed(0)
    return fit_step_module._StepPrediction(cfg, build_ssl_model(cfg), torch.device("cpu"), fit_step_module.RankLayout(),
                                           step_for_fit(cfg, contextlib.nullcontext()), lambda line: None, None)


# in_backward (6 s) in the slow tier; the fit of a step stepped in backward stays fast in test_dinos_teacher_adds_nothing_...[in_backward]
@pytest.mark.parametrize("stepped", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["allocated", "in_backward"])
def test_a_lone_large_crops_group_is_predicted_as_it_runs_without_backward(stepped):
    """DINO with one global crop (DATA.CROP_COUNTS [1, 4]), grouped: no term reads that crop, so its group runs
    without a graph, and the next group finds no gradients; stepped in backward, the next group's is the step's
    only backward, its updates held by none. Predicted so, the step a fit finds is the step measured (predicted
    as a trained group, it was 10% over, and the fit a batch short of what the memory holds)."""
    step = _prediction([*DINO[:6], "DATA.CROP_COUNTS", "[1, 4]", *DINO[8:], "OPTIM.IN_BACKWARD", str(stepped)])
    images = largest_fitting(lambda b: step.fits(b, LIMIT))
    budget = step.budget(images, LIMIT)
    assert abs(step.measured(images, budget) / step.total(images, budget) - 1) < 0.03
    assert [key[0][0][0] for key in step.plans(images, budget)] == [(images * 4, 3, 16, 16)]  # the run's trunk plans the small crops alone


@pytest.mark.parametrize("mode", [[], ["TRAIN.GRADIENTS", "kept"], ["OPTIM.IN_BACKWARD", "True"]], ids=["allocated", "kept", "in_backward"])
def test_dinos_teacher_adds_nothing_to_the_whole_steps_peak_and_fit_predicts_that_step_at_a_large_batch(mode):
    """DINO's teacher runs before the student's forward, as DINO's own loop does, so its forward holds a unit's
    input and output beside nothing of the student's. Run after it (until 2026-12-04) it sat on every activation
    the student kept for backward: at 160 images of 2 x 32px 15.7 MiB over the step's peak, which fit did not
    count (4.6% under the measured step; 9.3% at 231 images). Against the same step with a stand-in teacher
    trunk that keeps nothing: the same peak; and fit's prediction within 1% of it."""
    step = _prediction([*DINO[:4], "DATA.CROP_SIZES", "[32]", "DATA.CROP_COUNTS", "[2]", "DATA.CROP_SCALES", "[[0.4, 1.0]]", *DINO[10:], *mode])
    images, budget = 160, LIMIT  # a trunk budget above the unsplit step: the trunk's activations all held at once
    measured = step.measured(images, budget)
    teacher = step.model.teacher
    width = next(m for m in teacher.head.modules() if isinstance(m, torch.nn.Linear)).in_features
    teacher.trunk = fit_step_module._StandInTrunk(width).requires_grad_(False)
    assert measured == step.measured(images, budget)
    assert abs(measured / step.total(images, budget) - 1) < 0.01, (measured, step.total(images, budget))


def test_a_fit_no_step_checks_measures_the_rest_of_the_step_at_its_batch_and_stays_within_the_memory():
    """Predicted only (``verify=False``, as one FSDP2 rank's fit is), the fit's answer is all there is. The rest of
    the step (head, loss, teacher's targets) was a line through 2 and 4 images, under the head's activations at a
    hundred: DINO at 300 MiB was fitted 158 images that measured 301.7 MiB. Measured again at the batch found, the
    fit answers a batch whose real step is within the memory and within 1% of what it predicted."""
    one_resolution = [*DINO[:4], "DATA.CROP_SIZES", "[32]", "DATA.CROP_COUNTS", "[2]", "DATA.CROP_SCALES", "[[0.4, 1.0]]", *DINO[10:]]
    cfg = load_config(QUICK, [*SMALL, *one_resolution, "TRAIN.MEMORY_LIMIT", str(float(LIMIT))])
    torch.manual_seed(0)
    found = fit_step_module.fit_step(cfg, torch.device("cpu"), step_for_fit(cfg, contextlib.nullcontext()), verify=False)
    measured = _prediction(one_resolution).measured(found.images, found.trunk_budget)
    assert found.measured_total is None and measured <= LIMIT, (found.images, measured / LIMIT)
    assert abs(measured / found.predicted_total - 1) < 0.01, (measured, found.predicted_total)


def test_a_batch_no_trunk_budget_fits_by_prediction_is_checked_on_each_groups_lowest_peak_plan():
    """Where a real step measured well below the limit, fit checks one image more, though by prediction no trunk
    budget fits it (the search's budget 0: each crop group's lowest-peak plan). That check runs those plans, and the
    budget fit hands on is bytes each of them meets: 0 reads as no budget to a trunk, which then takes no stored
    plan (the check, and a launcher run, stopped with "this trunk runs vissl's fixed plan")."""
    step = _prediction(DINO)
    images = largest_fitting(lambda b: step.fits(b, LIMIT)) + 1
    assert step.budget(images, LIMIT) == 0  # the case: no budget fits this batch by prediction
    lowest = step.plans(images, 0)
    for (size, count), plan in zip(step.groups, lowest.values()):  # each group's lowest-peak plan: none within a budget peaks lower
        assert plan.predicted_peak_bytes == min(step.chains[size].plan(images * count, b).predicted_peak_bytes for b in (0, LIMIT // 8, LIMIT // 4, LIMIT))
    measured = step.measured(images, 0)
    assert abs(measured / step.total(images, 0) - 1) < 0.1, (measured, step.total(images, 0))  # the step predicted: those plans
    budget = fit_step_module.trunk_budget(0, lowest)
    assert budget == max(plan.predicted_peak_bytes for plan in lowest.values()) > 1


def test_a_limit_too_small_for_one_image_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(out), *SMALL, *DINO, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(100 * 2**20))])
    with pytest.raises(ValueError, match=r"TRAIN.MEMORY_LIMIT 100.0 MiB .* too small for one image per rank: the smallest that fits is"):
        train(cfg)
    assert not out.exists()


def test_a_limit_larger_than_the_host_can_give_on_cpu_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    fit_module = importlib.import_module("trunksplit.fit")  # the module: trunksplit.fit is the function

    monkeypatch.setattr(fit_module, "host_bytes_available", lambda: 200 * 2**20)
    out = tmp_path / "run"
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(out), *SMALL, *DINO, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(LIMIT))])
    with pytest.raises(ValueError, match=r"TRAIN.MEMORY_LIMIT 300.0 MiB .* is more than this machine has available .*set TRAIN.BATCH_SIZE_PER_RANK yourself"):
        train(cfg)
    assert not out.exists()


def test_cpu_ranks_on_one_host_are_refused_a_limit_they_cannot_all_fill_at_once(monkeypatch):
    """torchrun's CPU ranks on one host each fit and train a step of TRAIN.MEMORY_LIMIT at the same time:
    the host must give the limit once per rank (torchrun's ``LOCAL_WORLD_SIZE``), where each rank's
    own check passes alone; a GPU rank's step fills its own GPU."""
    fit_module = importlib.import_module("trunksplit.fit")
    strategy = importlib.import_module("trunksplit.ssl.strategy")
    monkeypatch.setattr(fit_module, "host_bytes_available", lambda: 500 * 2**20)  # room for one rank's 300 MiB, not two
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cpu = torch.device("cpu")
    cfg = load_config(QUICK, [*SMALL, *DINO, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(LIMIT))])
    assert strategy.DDP(0, 2, torch.device("cuda", 0)).rank_layout.host_ranks == 1
    for ranks in (strategy.DDP(0, 2, cpu), strategy.ManualDDP(0, 2, cpu), strategy.FSDP(0, 2, cpu)):
        with pytest.raises(ValueError, match=r"TRAIN.MEMORY_LIMIT for each of this host's 2 ranks, in all 600.0 MiB .* is more than this "
                                             r"machine has available \(500.0 MiB .*set TRAIN.BATCH_SIZE_PER_RANK yourself"):
            fit_step_module.fitted_batch(cfg, cpu, step_for_fit(cfg, contextlib.nullcontext()), layout=ranks.rank_layout)


def test_crop_groups_are_the_trunk_calls_of_a_step():
    cfg = load_config(QUICK, [*SMALL, "METHOD.NAME", "swav", "DATA.CROP_SIZES", "[32, 32, 16]", "DATA.CROP_COUNTS", "[2, 1, 4]",
                              "DATA.CROP_SCALES", "[[0.4, 1.0], [0.3, 1.0], [0.05, 0.4]]"])
    assert crop_groups(cfg) == [(32, 3), (16, 4)]  # consecutive crops of one size are one trunk call


@pytest.mark.xdist_group("fitted")  # the module fixture's runs, made once on one worker
def test_fit_from_the_command_line_answers_what_the_launcher_trains_with(fitted, capsys):
    """``trunksplit fit --config-file`` prints the images per rank, each group's plan, and a line per
    phase on stderr (not a terminal here); the launcher then trains with that batch."""
    code = main(["fit", "--config-file", QUICK, "--memory", "300MiB", *SMALL, *DINO])
    out, err = capsys.readouterr()
    assert code == 0, err
    images = int(out.split(" images per rank fit ")[0])
    assert "group 1: 2 x 32px crops per image" in out and "group 2: 4 x 16px crops per image" in out
    budget = int(out.split("trunk budget ")[1].split("(")[1].split(" bytes")[0])
    for line in [line for line in out.splitlines() if line.startswith("  group ")]:
        peak = float(line.split("predicted trunk peak ")[1].split(" MiB")[0]) * 2**20
        above = "(above the trunk budget: the lowest this group reaches" in line
        assert above == (peak > budget + 0.05 * 2**20) or abs(peak - budget) <= 0.05 * 2**20, (line, budget)  # a plan above the budget says why
    phases = [line.split()[1] for line in err.splitlines() if line.startswith("fit: ")]
    assert phases[:5] == ["profiling", "profiling", "measuring", "searching", "measuring"] and set(phases[5:]) == {"checking"}, err  # the rest again at the batch found
    batch, total, _ = fitted("dino")
    assert batch == images and total <= LIMIT
    said = out.split("TRAIN.MEMORY_LIMIT ")[1].split()[0]  # what to paste: exactly --memory (it printed 3.146e+08, 27200 bytes short)
    assert load_config(QUICK, ["TRAIN.MEMORY_LIMIT", said]).TRAIN.MEMORY_LIMIT == 300 * 2**20


def test_a_fit_on_a_small_data_set_stops_at_its_share_of_a_step(tmp_path, capsys):
    """300 MiB holds hundreds of SimCLR images per rank (the fit above trains 256 and more); 24 synthetic
    images give a step 24: the fit stops there and says why, the run trains 24 distinct images a step (a
    larger batch would draw some twice), and ``trunksplit fit --config-file`` answers the same."""
    small = [*SMALL, *METHODS["simclr"], "DATA.NUM_IMAGES", "24"]
    out = tmp_path / "run"
    train(load_config(QUICK, ["OUTPUT_DIR", str(out), *small, "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(LIMIT))]))
    said = capsys.readouterr().out
    assert load_config(str(out / "config.yaml")).TRAIN.BATCH_SIZE_PER_RANK == 24
    assert "fit: the data set gives each rank 24 images a step: the batch stops there (the memory would hold more)" in said
    assert main(["fit", "--config-file", QUICK, "--memory", "300MiB", *small]) == 0
    assert capsys.readouterr().out.startswith("24 images per rank fit 300.0 MiB")


def test_fit_overrides_without_a_config_file_are_refused(capsys):
    assert main(["fit", "--memory", "1GiB", "TRAIN.STEPS", "3"]) == 2
    assert "need --config-file" in capsys.readouterr().err
    assert main(["fit", "resnet18", "--memory", "1GiB"]) == 2
    assert "give the model with --arch resnet18" in capsys.readouterr().err


DDP_LIMITS = {"simclr": 200 * 2**20, "simclr stepped in backward": 200 * 2**20, "simclr, vissl's manual DDP": 260 * 2**20, "dino": LIMIT}


def _ddp_fitted_run(rank, world_size, out, method, apart=False):
    """Two DDP ranks train three steps with the batch TRAIN.BATCH_SIZE_PER_RANK 0 fits; each saves its
    weights, and rank 0 writes (batch, everything resident during its largest step as the run measured
    it). ``apart``: rank 1 measures the rest of the step 4 MiB higher (as two GPUs' allocators may), so
    its fit checks other batches than rank 0's."""
    if apart and rank == 1:
        measured = fit_step_module._RestOfStep.__call__
        fit_step_module._RestOfStep.__call__ = lambda rest, images: measured(rest, images) + 4 * 2**20
    overrides = ["OUTPUT_DIR", out, *SMALL, *METHODS[method], "TRAIN.STEPS", "3", "TRAIN.LOG_EVERY", "1",
                 "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(DDP_LIMITS[method]))]
    model, _ = train(load_config(QUICK, overrides))
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            peaks = [json.loads(line)["peak_memory_bytes"] for line in f]
        # every step's: the second makes DDP's buckets anew; stepped in backward, not the first, which makes the
        # optimizer's state that the resident bytes count already
        peak = max(peaks[1:] if "OPTIM.IN_BACKWARD" in METHODS[method] else peaks)
        # and DDP's buckets: a flat copy of every trained parameter's gradient, made when DDP wraps the model
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        resident = _resident(model, load_config(QUICK, overrides).OPTIM.NAME) + buckets
        batch = load_config(os.path.join(out, "config.yaml")).TRAIN.BATCH_SIZE_PER_RANK
        with open(os.path.join(out, "fitted.json"), "w") as f:
            json.dump([batch, resident + peak], f)


def test_ranks_whose_fits_measure_apart_train_rank_0s_batch_together_and_count_ddps_buckets(tmp_path):
    """Each rank fits alone (its checking steps gather no other rank's embeddings), then takes rank 0's
    answer: before, the checks' all_gathers met other batches and the run failed ("Connection reset").
    Every rank holds DDP's buckets from the wrap on, the gradients views into them: the fitted step lands
    in 0.85-1.00 of the limit (before, SimCLR's measured 1.06x)."""
    run_processes(_ddp_fitted_run, 2, (str(tmp_path), "simclr", True), timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    batch, total = json.loads((tmp_path / "fitted.json").read_text())
    limit = DDP_LIMITS["simclr"]
    assert batch >= 2 and 0.85 * limit <= total <= limit, (batch, total / limit)


# slow (2-rank fits, 8-16 s each); SimCLR's one backward is in the fast suite, above
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["dino", "simclr stepped in backward", "simclr, vissl's manual DDP"])
def test_a_ddp_ranks_fitted_batch_counts_ddps_gradient_buckets(tmp_path, method):
    """As for SimCLR above, with the gradients freed and made again: a step backward by crop group (DINO's)
    makes them again beside the buckets under no_sync (before, it measured 1.12x the limit); stepped in
    backward, the buckets sit beside gradients freed at their update (its checking step failed: 'updated
    from this rank's own gradient'); vissl's manual path keeps the gradients its own, all flattened at
    once by its all-reduce."""
    run_processes(_ddp_fitted_run, 2, (str(tmp_path), method), timeout=480)  # DINO's: 240 s was passed on a loaded 2-core machine
    batch, total = json.loads((tmp_path / "fitted.json").read_text())
    limit = DDP_LIMITS[method]
    assert batch >= 2 and 0.85 * limit <= total <= limit, (batch, total / limit)
