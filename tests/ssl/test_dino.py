"""DINO: the loss, the centre and the EMA teacher against hand-written references, and the loop's DINO step."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from distributed_harness import run_processes
from trunksplit.planning.memory import PeakMemory, _TensorAccounting  # the tracker, to read what a forward leaves alive
from trunksplit.ssl.config import load_config
from trunksplit.ssl.dino import teacher_momentum, teacher_temperature, update_center
from trunksplit.ssl.losses import dino_loss
from trunksplit.ssl.loop import train
from trunksplit.ssl.model import DINOHead, SSLModel, build_model
from trunksplit.ssl.optim import gradient_rule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
DINO = ["METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "32", "MODEL.TRUNK.NAME", "resnet18", "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", "0.25", "MODEL.HEAD.HIDDEN_DIM", "32", "MODEL.HEAD.OUTPUT_DIM", "16",
        "DATA.IMAGE_SIZE", "40", "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 2]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]",
        "TRAIN.BATCH_SIZE_PER_RANK", "4", "DATA.NUM_WORKERS", "0", "OPTIM.NAME", "adamw", "OPTIM.LR", "0.001"]


def _reference_loss(student, teacher, center, student_temperature, teacher_temperature):
    """DINO's loss written out element by element in float64: softmax, log-softmax, pairs, means."""
    total, terms = 0.0, 0
    for i, t in enumerate(teacher):
        for j, s in enumerate(student):
            if i == j:
                continue
            crop = 0.0
            for b in range(t.shape[0]):
                e = [math.exp((float(t[b, k]) - float(center[0, k])) / teacher_temperature) for k in range(t.shape[1])]
                q = [v / sum(e) for v in e]
                logits = [float(s[b, k]) / student_temperature for k in range(s.shape[1])]
                top = max(logits)
                log_z = top + math.log(sum(math.exp(v - top) for v in logits))
                crop += -sum(q[k] * (logits[k] - log_z) for k in range(len(q)))
            total += crop / t.shape[0]
            terms += 1
    return total / terms


def test_loss_equals_a_hand_written_reference_with_centring_and_both_temperatures():
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(3, 5, generator=g) for _ in range(4)]  # 2 global crops lead, then 2 local
    teacher = [torch.randn(3, 5, generator=g) for _ in range(2)]
    center = torch.randn(1, 5, generator=g)
    got = dino_loss(student, teacher, center, 0.1, 0.04)
    assert math.isclose(float(got), _reference_loss(student, teacher, center, 0.1, 0.04), rel_tol=1e-5)
    # the teacher gives targets only: gradients reach the student alone
    student = [s.requires_grad_() for s in student]
    teacher = [t.requires_grad_() for t in teacher]
    dino_loss(student, teacher, center, 0.1, 0.04).backward()
    assert all(s.grad is not None for s in student) and all(t.grad is None for t in teacher)


def test_centre_moves_towards_the_mean_of_every_teacher_output():
    center = torch.tensor([[1.0, -2.0, 0.5]])
    outs = [torch.tensor([[0.0, 1.0, 2.0], [2.0, 3.0, 4.0]]), torch.tensor([[4.0, 5.0, 0.0], [6.0, 7.0, 2.0]])]
    update_center(center, outs, 0.9)
    mean = [3.0, 4.0, 2.0]  # by hand
    assert torch.allclose(center, torch.tensor([[0.9 * 1.0 + 0.1 * mean[0], 0.9 * -2.0 + 0.1 * mean[1], 0.9 * 0.5 + 0.1 * mean[2]]]))


def test_schedules_match_dinos_formulas():
    cfg = load_config(QUICK, ["TRAIN.STEPS", "11", "METHOD.DINO.WARMUP_TEACHER_TEMPERATURE", "0.04", "METHOD.DINO.TEACHER_TEMPERATURE", "0.07",
                              "METHOD.DINO.TEACHER_TEMPERATURE_WARMUP_STEPS", "4"])
    assert [round(teacher_temperature(cfg, s), 6) for s in (0, 2, 4, 10)] == [0.04, 0.055, 0.07, 0.07]
    # momentum: 0.996 at the first step, 1 at the last, halfway between at the middle (cosine)
    assert [round(teacher_momentum(cfg, s), 9) for s in (0, 5, 10)] == [0.996, 0.998, 1.0]


def test_head_last_layer_is_weight_normalised_with_its_gain_fixed_at_one():
    head = DINOHead(8, 16, 4, 6)
    x = torch.randn(5, 8)
    before = head(x)
    with torch.no_grad():
        head.last_layer.mul_(torch.tensor([[3.0], [0.5], [2.0], [1.0], [7.0], [0.1]]))  # rescale rows: weight_norm's v
    assert torch.allclose(head(x), before, atol=1e-6)
    assert before.abs().max() <= 1 + 1e-6  # unit rows times a unit bottleneck: cosines


def _autograd_head(head, x):
    """The head as DINO writes it, every op left to autograd: the reference for the fused last layer."""
    return torch.nn.functional.linear(torch.nn.functional.normalize(head.mlp(x), dim=-1), torch.nn.functional.normalize(head.last_layer, dim=1))


def test_head_outputs_and_gradients_match_autograds_weight_normalised_linear():
    torch.manual_seed(0)
    head = DINOHead(8, 16, 4, 6).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 6, dtype=torch.float64)
    ours = torch.autograd.grad(head(x), [x, *head.parameters()], grad)
    reference = torch.autograd.grad(_autograd_head(head, x), [x, *head.parameters()], grad)
    assert torch.allclose(head(x), _autograd_head(head, x), rtol=0, atol=1e-14)
    for a, b in zip(ours, reference):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_head_under_bf16_autocast_matches_autograds_head_under_the_same_autocast():
    """The launcher's ``TRAIN.AUTOCAST bf16`` on CPU: the fused last layer casts as autograd's
    ``F.linear`` does (a bf16 output, fp32 parameter gradients) and agrees with it to bf16 rounding
    (its forward divides after the product instead of before: a few bf16 ulps)."""
    torch.manual_seed(0)
    head = DINOHead(32, 64, 16, 256)
    x = torch.randn(8, 32)
    grad = torch.randn(8, 256)
    results = []
    for forward in (head, lambda v: _autograd_head(head, v)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(x)
        results.append((out, torch.autograd.grad(out, list(head.parameters()), grad.to(out.dtype))))
    (ours, ours_grads), (reference, reference_grads) = results
    assert ours.dtype == reference.dtype == torch.bfloat16
    assert (ours.float() - reference.float()).abs().max() <= 4 * 2**-8 * reference.float().abs().max()
    for (name, p), a, b in zip(head.named_parameters(), ours_grads, reference_grads):
        assert a.dtype == b.dtype == p.dtype == torch.float32, name
        assert (a - b).norm() <= 0.02 * b.norm(), name


@pytest.mark.parametrize("fused", [True, False], ids=["ours", "autograd"])
def test_head_last_layers_backward_allocates_one_weight_sized_tensor(fused):
    """DINO's 65536 x 256 last layer is 64 MiB: autograd keeps its normalised copy from forward to backward
    and makes four more in the backward, the multi-crop step's peak (exact tensor bytes)."""
    head = DINOHead(4, 8, 64, 2048)
    weight_bytes = head.last_layer.numel() * head.last_layer.element_size()
    x = torch.randn(3, 4)
    with _TensorAccounting() as forward:
        out = head(x) if fused else _autograd_head(head, x)
    held = forward.current_bytes()  # the output and what its graph saved for backward
    with PeakMemory("cpu") as backward:
        out.sum().backward()
    if fused:
        assert held < weight_bytes / 4 and backward.peak_bytes < 1.25 * weight_bytes  # the gradient, and small tensors
    else:  # the reference shows what the fused layer avoids, so this test can tell them apart
        assert held > weight_bytes and backward.peak_bytes > 3 * weight_bytes


def _fresh_student(cfg):
    torch.manual_seed(cfg.SEED)
    return build_model(cfg).state_dict()


def test_a_step_moves_the_teacher_by_ema_of_the_student_and_shows_it_the_global_crops_only(tmp_path, monkeypatch):
    cfg = load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.STEPS", "1", *DINO, "METHOD.DINO.TEACHER_MOMENTUM", "0.9"])
    initial = _fresh_student(cfg)
    seen = []
    real_forward = SSLModel.forward

    def recording(self, crops):
        if self.teacher is None and not torch.is_grad_enabled():  # the teacher: no teacher of its own, no gradients
            seen.append([tuple(c.shape) for c in crops])
        return real_forward(self, crops)

    monkeypatch.setattr(SSLModel, "forward", recording)
    model, last = train(cfg)
    assert math.isfinite(last["loss"])
    assert seen and all(shapes == [(4, 3, 32, 32)] * 2 for shapes in seen)  # the two global crops, never the local ones
    teacher = model.teacher
    assert len(teacher.trunk.plan.segments) == 1 and not teacher.trunk.plan.regions  # never checkpointed
    assert len(model.trunk.plan.segments) > 1
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    # the teacher started as the student and moved by the EMA after the step, momentum 0.9 at step 0
    m = teacher_momentum(cfg, 0)
    assert m == 0.9
    student = dict(model.named_parameters())
    assert all(not torch.equal(initial[n], p) for n, p in student.items() if not n.startswith("teacher.")), "the student moved"
    for name, t in teacher.named_parameters():
        assert torch.allclose(t, m * initial[name] + (1 - m) * student[name], rtol=0, atol=1e-6), name
    assert model.center.abs().sum() > 0


def _ddp_then_fsdp(rank, world_size, out):
    """Two DINO steps under DDP, then under FSDP2, in the same two processes (vissl's split: no profiling);
    each run's full weights, the teacher's too, and centre; and how much of the teacher a rank holds."""
    from torch.distributed.tensor import DTensor

    for strategy in ("ddp", "fsdp"):
        model, _ = train(load_config(QUICK, ["OUTPUT_DIR", os.path.join(out, strategy), *DINO, "TRAIN.STEPS", "2", "DISTRIBUTED.STRATEGY", strategy,
                                             "MODEL.ACTIVATION_CHECKPOINTING.STRATEGY", "vissl", "OPTIM.NAME", "sgd", "OPTIM.LR", "0.1",
                                             "OPTIM.CLIP_GRAD", "1e-4"]))  # every gradient clipped: a rank's shard norm would scale it otherwise
        state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
        state["center"] = model.center.clone()
        teacher = list(model.teacher.parameters())
        state["teacher_held"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in teacher) / sum(p.numel() for p in teacher)
        torch.save(state, os.path.join(out, f"{strategy}{rank}.pt"))


def test_under_fsdp2_the_teacher_is_sharded_and_dino_trains_the_ddp_runs_weights(tmp_path):
    """DINO's EMA teacher sharded as its student, each rank updating its own slice: two grouped steps on
    2 gloo ranks end with the DDP run's student, teacher and centre, to float rounding (FSDP2
    reduce-scatters each crop group's gradients, DDP all-reduces once; SGD, whose update is linear in
    them: Adam's would magnify rounding where a gradient is near 0). With DINO's clipping each gradient
    is scaled by its whole norm, not a shard's. Before, DINO and OPTIM.CLIP_GRAD under FSDP were refused."""
    run_processes(_ddp_then_fsdp, 2, (str(tmp_path),))
    ddp = torch.load(tmp_path / "ddp0.pt")
    for rank in range(2):
        fsdp = torch.load(tmp_path / f"fsdp{rank}.pt")
        assert fsdp.pop("teacher_held") <= 0.55 and ddp["teacher_held"] == 1.0  # half the teacher a rank under FSDP2
        for name, value in fsdp.items():  # atol: a BatchNorm bias, from 0, is a sum that cancels, rounded otherwise by each reduction
            torch.testing.assert_close(value, ddp[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(name.startswith("teacher.") for name in ddp)


@pytest.mark.parametrize("overrides,message", [
    (["DATA.CROP_SIZES", "[32]", "DATA.CROP_COUNTS", "[1]", "DATA.CROP_SCALES", "[[0.4, 1.0]]"], "gives one crop"),
    (["METHOD.DINO.TEACHER_TEMPERATURE", "0.0"], "TEACHER_TEMPERATURE"),
    (["METHOD.DINO.TEACHER_MOMENTUM", "1.5"], "TEACHER_MOMENTUM"),
])
def test_bad_dino_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(QUICK, [*DINO, *overrides])


@pytest.mark.slow
def test_dino_vit_s_16_trains_under_torchrun_with_two_processes_and_its_loss_falls(tmp_path):
    # 40 s on 2 cores. A fresh ViT maps every synthetic image to nearly the same embedding, so a
    # centre at DINO's momentum 0.9 reaches their mean within ~20 steps and flattens the teacher to
    # uniform (the loss climbs to log K: DINO's first phase, which takes thousands of steps to
    # leave). With momentum 0.99 the centre acts over ~100 steps, and 30 steps show the student
    # learning the teacher's targets across views.
    out = tmp_path / "run"
    overrides = ["OUTPUT_DIR", str(out), "DATA.CROP_SIZES", "[32, 16]", "DATA.CROP_COUNTS", "[2, 4]", "DATA.IMAGE_SIZE", "40",
                 "TRAIN.BATCH_SIZE_PER_RANK", "8", "TRAIN.STEPS", "30", "TRAIN.CHECKPOINT_EVERY", "30", "TRAIN.AUTOCAST", "", "TRAIN.LOG_EVERY", "1",
                 "MODEL.HEAD.HIDDEN_DIM", "512", "METHOD.NUM_PROTOTYPES", "1024", "METHOD.DINO.CENTER_MOMENTUM", "0.99",
                 "OPTIM.LR", "0.001", "OPTIM.LR_BATCH_SIZE", "0", "OPTIM.WARMUP_STEPS", "3", "DATA.NUM_WORKERS", "0"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "tools", "train.py"),
                             "--config-file", os.path.join(ROOT, "configs", "dino_vit_s_16.yaml"), *overrides],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert "balanced" in result.stdout  # the student's trunk ran checkpointed segments


def test_clip_grad_scales_each_parameters_gradient_to_its_norm_as_dino_does():
    """DINO's clip_gradients by hand: a gradient (3, 4) has norm 5; clipped to 3 it is scaled by
    3 / (5 + 1e-6); one of norm 2 is left alone; the head's last layer is frozen only in the first steps."""
    cfg = load_config(QUICK, DINO + ["OPTIM.CLIP_GRAD", "3.0", "METHOD.DINO.FREEZE_LAST_LAYER_STEPS", "2"])
    torch.manual_seed(0)
    model = build_model(cfg)
    big, small = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    big.grad, small.grad = torch.tensor([3.0, 4.0]), torch.tensor([1.2, 1.6])
    rule = gradient_rule(cfg, model, step=0)
    assert rule(big) and rule(small)
    assert torch.allclose(big.grad, torch.tensor([3.0, 4.0]) * (3 / (5 + 1e-6)), rtol=0, atol=1e-7)
    assert torch.equal(small.grad, torch.tensor([1.2, 1.6]))
    model.head.last_layer.grad = torch.ones_like(model.head.last_layer)
    assert not rule(model.head.last_layer) and model.head.last_layer.grad is None  # frozen at step 0 and 1
    model.head.last_layer.grad = torch.ones_like(model.head.last_layer)
    assert gradient_rule(cfg, model, step=2)(model.head.last_layer) and model.head.last_layer.grad is not None
    assert gradient_rule(load_config(QUICK, DINO), model, step=0) is None  # neither asked for: nothing runs


@pytest.mark.parametrize("in_backward", [pytest.param(False, marks=pytest.mark.slow), True], ids=["standard", "in_backward"])  # standard: test_gradient_rule checks its rule
def test_the_last_layer_stays_frozen_for_its_steps_and_both_stabilisers_train_alike_stepped_in_backward(tmp_path, in_backward):
    """Two steps frozen: the last layer as initialised and without optimizer state; a third step moves
    it. The same run stepped in backward trains the same weights bit for bit."""
    frozen, stepped = DINO + ["METHOD.DINO.FREEZE_LAST_LAYER_STEPS", "2"], ["OPTIM.IN_BACKWARD", str(in_backward)]
    stabilised = frozen + ["OPTIM.CLIP_GRAD", "0.05"] + stepped
    torch.manual_seed(0)
    initial = build_model(load_config(QUICK, stabilised)).head.last_layer.detach().clone()
    two, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "two"), "TRAIN.STEPS", "2", *stabilised]))
    assert torch.equal(two.head.last_layer, initial)
    saved = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)["optimizer"]
    last_index = [n for n, p in two.named_parameters() if p.requires_grad].index("head.last_layer")
    assert last_index not in saved["state"] and len(saved["state"]) > 0
    three, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "three"), "TRAIN.STEPS", "3", *stabilised]))
    assert not torch.equal(three.head.last_layer, initial)
    if in_backward:  # against the standard run of the same recipe
        # both backward by crop group (the default): stepped in backward, the first group's backward holds its updates
        standard, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "standard"), "TRAIN.STEPS", "3", *stabilised[:-2]]))
        for (name, a), (_, b) in zip(standard.state_dict().items(), three.state_dict().items()):
            assert torch.equal(a, b), name
    unclipped, _ = train(load_config(QUICK, ["OUTPUT_DIR", str(tmp_path / "unclipped"), "TRAIN.STEPS", "2", *frozen, *stepped]))
    assert not torch.equal(unclipped.trunk.conv1.weight, two.trunk.conv1.weight)  # the clip did something, all else the same
