"""The CUDA tier: what a GPU user relies on, checked on the GPU against the plain model.

Run with ``python -m pytest -q -m cuda`` (one worker: the tests read one GPU's allocator). Every
test skips, saying so, where torch sees no GPU. Exactness runs with deterministic algorithms: the
unsplit step and the checkpointed one then run the same kernels on the same inputs, so the
comparisons hold to float rounding of nothing (docs/gpu.md records whether they were bit for bit).
Peaks are the caching allocator's ``max_memory_allocated``, the figure a plan predicts on CUDA.
"""
import copy
import gc
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from trunksplit import CheckpointedTrunk, PeakMemory, checkpoint_wrapper, fit, optimizer_in_backward

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU on this machine")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")
SGD = dict(lr=0.1, momentum=0.9)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: attention's backward has no deterministic kernel everywhere
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.allow_tf32 = True
    gc.collect()
    torch.cuda.empty_cache()


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    with torch.no_grad():  # BatchNorm affine parameters that are not 1 and 0, so a mix-up shows
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.to(CUDA)


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)).to(CUDA)


def _weights(model, x):
    """One fixed random weight per output element (made before anything is measured)."""
    with torch.no_grad():
        shapes = [f.shape for f in copy.deepcopy(model).eval()(x)]
    g = torch.Generator(device=CUDA).manual_seed(123)
    return [torch.randn(s, generator=g, device=CUDA) for s in shapes]


def _step(model, x, weights) -> torch.Tensor:
    loss = sum((f * w).sum() for f, w in zip(model(x), weights))
    loss.backward()
    return loss.detach()


def _sgd_step(trunk, x, weights):
    """One SGD step (in backward where the trunk's mode says so); the loss."""
    if trunk.gradients == "in_backward":
        return _step(trunk, x, weights)
    optimizer = torch.optim.SGD(trunk.parameters(), **SGD)
    if trunk.gradients == "kept":
        for p in trunk.parameters():
            p.grad = torch.zeros_like(p)
    loss = _step(trunk, x, weights)
    optimizer.step()
    return loss


def _stepping(trunk):
    if trunk.gradients == "in_backward":
        optimizer_in_backward(trunk, torch.optim.SGD, **SGD)
    return trunk


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = a.double().abs().max().clamp_min(1e-30)
    assert ((a.double() - b.double()).abs().max() / scale).item() <= 1e-6, what


@pytest.mark.parametrize("plan", [dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.5), dict(memory_budget=0.5, objective="flops")],
                         ids=["balanced4", "budget0.5", "budget0.5-flops"])
@pytest.mark.parametrize("gradients", ["allocated", "kept", "in_backward"])
def test_a_checkpointed_step_trains_the_plain_models_weights_on_cuda(gradients, plan):
    """The unsplit trunk (the model's own modules, nothing checkpointed) and a planned one, one SGD
    step each on ResNet-50: the loss, every parameter after the step, every BatchNorm buffer."""
    x = _images(8, 160)
    model = _model("resnet50")
    plain = _stepping(CheckpointedTrunk(copy.deepcopy(model), gradients=gradients))
    planned = _stepping(CheckpointedTrunk(copy.deepcopy(model), gradients=gradients, **plan))
    assert len(planned.plan_for(x).segments) > 1 or planned.plan_for(x).regions  # something is checkpointed
    weights = _weights(plain, x)
    _close(_sgd_step(plain, x, weights), _sgd_step(planned, x, weights), "loss")
    for (name, a), b in zip(plain.named_parameters(), planned.parameters()):
        _close(a, b, name)
    for (name, a), b in zip(plain.named_buffers(), planned.buffers()):
        _close(a.float(), b.float(), name)


class _Outputs(nn.Module):
    """A whole model as a trunk is called: its output in a list."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return [self.model(x)]


@pytest.mark.parametrize("plan", [dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.5, gradients="kept"), "checkpoint_wrapper"],
                         ids=["balanced4", "budget0.5", "checkpoint_wrapper"])
def test_a_recompute_draws_the_forwards_random_masks_on_the_gpus_generator(plan):
    """Stochastic depth (ConvNeXt-T's, here 0.5 in every block) draws its masks from the GPU's generator: each
    recompute restores that generator's state (cuts and ``checkpoint_wrapper``: trunksplit's own checkpoint,
    ``recompute/hooked.py``, whose GPU path the CPU tests cannot reach; a budget's selective regions: torch's), so
    the step has the gradients of the plain step with the same seed. Another seed gives other gradients: the masks
    matter. (Checked on the CPU with the device swapped: with the CPU generator's restore taken out of
    ``hooked.py`` the cut and wrapper cases fail.)"""
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny().to(CUDA)
    for m in model.modules():
        if isinstance(m, torchvision.ops.StochasticDepth):
            m.p = 0.5  # torchvision's rises from 0 at the first block: a mask drawn again wrongly would often match
    x = _images(8, 96)
    if plan == "checkpoint_wrapper":
        plain, checkpointed = _Outputs(copy.deepcopy(model)), _Outputs(copy.deepcopy(model))
        for i, stage in enumerate(checkpointed.model.features):
            checkpointed.model.features[i] = checkpoint_wrapper(stage)
    else:
        plain, checkpointed = CheckpointedTrunk(copy.deepcopy(model)), CheckpointedTrunk(copy.deepcopy(model), **plan)
        assert len(checkpointed.plan_for(x).segments) > 1 or checkpointed.plan_for(x).regions  # something is checkpointed
    weights = _weights(plain, x)
    grads = []
    for trunk, seed in ((plain, 7), (checkpointed, 7), (plain, 8)):
        torch.manual_seed(seed)  # the GPU's generator too
        trunk.zero_grad(set_to_none=True)
        _step(trunk, x, weights)
        grads.append([p.grad.clone() for p in trunk.parameters()])
    for (name, _), a, b in zip(plain.named_parameters(), grads[0], grads[1]):
        _close(a, b, name)
    assert any(not torch.equal(a, c) for a, c in zip(grads[0], grads[2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("plan", ["balanced4", "checkpoint_wrapper"])
def test_a_recompute_under_the_gpus_autocast_runs_in_the_forwards_precision(plan, dtype):
    """Under ``torch.autocast("cuda")`` a recompute re-enters the forward's autocast (trunksplit's own checkpoint
    keeps the GPU's autocast state and the CPU's; the CPU tests reach only the CPU's): the checkpointed step,
    cut or every ResNet-50 stage under ``checkpoint_wrapper``, has the plain autocast step's gradients. A
    recompute in float32 would save tensors of another dtype than the forward's, which the checkpoint refuses. (Checked on
    the CPU with the device swapped: with the autocast restore taken out of ``hooked.py`` both cases fail.)"""
    x = _images(8, 96)
    model = _model("resnet50")
    plain = _Outputs(copy.deepcopy(model))
    if plan == "checkpoint_wrapper":
        checkpointed = _Outputs(copy.deepcopy(model))
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            setattr(checkpointed.model, stage, checkpoint_wrapper(getattr(checkpointed.model, stage)))
    else:
        checkpointed = CheckpointedTrunk(copy.deepcopy(model), ["flatten"], num_splits=4, strategy="balanced")
        plain = CheckpointedTrunk(copy.deepcopy(model), ["flatten"])
        with torch.autocast("cuda", dtype=dtype):
            assert len(checkpointed.plan_for(x).segments) == 4
    weights = _weights(plain, x)
    grads = []
    for trunk in (plain, checkpointed):
        with torch.autocast("cuda", dtype=dtype):
            outputs = trunk(x)
        sum((f.float() * w).sum() for f, w in zip(outputs, weights)).backward()
        grads.append([p.grad for p in trunk.parameters()])
    for (name, _), a, b in zip(plain.named_parameters(), grads[0], grads[1]):
        _close(a, b, name)


def _second_step_peak(trunk, x, weights) -> int:
    _step(trunk, x, weights)
    for p in trunk.parameters():
        if trunk.gradients == "kept":
            p.grad.zero_()
        else:
            p.grad = None
    with PeakMemory(CUDA) as mem:
        _step(trunk, x, weights)
    return mem.peak_bytes


@pytest.mark.parametrize("plan", [dict(num_splits=4, strategy="balanced"), dict(memory_budget=0.5), dict(memory_budget=0.5, objective="flops"),
                                  dict(memory_budget=0.5, gradients="in_backward")], ids=["balanced4", "budget0.5", "budget0.5-flops", "in_backward0.5"])
@pytest.mark.parametrize("name", ["resnet50", "convnext_tiny", "vit_b_16"])
def test_the_predicted_step_peak_is_the_allocators_within_5_percent(name, plan):
    """The plan's predicted peak against ``torch.cuda.max_memory_allocated`` of the step (the
    second: the first makes the optimizer's state), at 224px, batch 8. A cost-aware plan on a GPU is
    priced in measured time unless the objective is given (``"auto"``: FLOPs do not see launches)."""
    torch.use_deterministic_algorithms(False)  # the kernels users run: cuDNN picks its own
    x = _images(8, 224)
    trunk = _stepping(CheckpointedTrunk(_model(name), **plan))
    predicted = trunk.plan_for(x).predicted_peak_bytes
    assert ("objective time" in trunk.plan_for(x).note) == ("objective" not in plan)
    measured = _second_step_peak(trunk, x, _weights(trunk, x))
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)
    if "memory_budget" in plan:
        unsplit = _second_step_peak(_stepping(CheckpointedTrunk(_model(name), gradients=trunk.gradients)), x, _weights(trunk, x))
        assert measured <= 0.5 * unsplit * 1.05, (measured, unsplit)


def test_a_call_whose_updates_are_held_meets_its_budget_as_the_allocator_measures_it():
    """Stepped in backward inside ``accumulating()`` (an earlier crop group, gradient accumulation), a
    call keeps every gradient: planned as torch's default mode's step, its predicted peak is the
    allocator's within 5%, and it meets 0.5 of that mode's unsplit step. ResNet-50, 224px, batch 8."""
    torch.use_deterministic_algorithms(False)
    x = _images(8, 224)
    trunk = CheckpointedTrunk(_model("resnet50"), memory_budget=0.5, gradients="in_backward")
    stand_in = optimizer_in_backward(trunk, torch.optim.SGD, **SGD)
    weights = _weights(trunk, x)
    _step(trunk, x, weights)  # an updating step: the momentum made
    with stand_in.accumulating():
        predicted = trunk.plan_for(x).predicted_peak_bytes
        with PeakMemory(CUDA) as mem:
            _step(trunk, x, weights)
    assert abs(predicted / mem.peak_bytes - 1) <= 0.05, (predicted, mem.peak_bytes)
    unsplit = _second_step_peak(CheckpointedTrunk(_model("resnet50")), x, weights)
    assert mem.peak_bytes <= 0.5 * unsplit * 1.05, (mem.peak_bytes, unsplit)


def test_fit_finds_a_batch_whose_real_step_fits_on_cuda():
    """``fit``'s batch for 3 GiB, verified by a real step on the GPU: it ran (no out-of-memory
    error) and its measured total (parameters, gradients, momentum and the step's peak) fits."""
    memory = 3 * 2**30
    found = fit(_model("resnet50"), (3, 224, 224), memory, optimizer="sgd")
    assert found.measured_total_bytes is not None
    assert 0.85 * memory <= found.measured_total_bytes <= memory, (found.batch_size, found.measured_total_bytes)
    assert found.predicted_total_bytes >= found.measured_total_bytes * 0.98


def test_a_fit_or_a_run_larger_than_the_gpu_can_give_is_refused_before_profiling(tmp_path):
    """``fit``'s checking step, and the launcher's fitted batch (``TRAIN.MEMORY_LIMIT``), fill the memory asked on the
    GPU: past what it can give, the step ran out of memory after the profiling. Refused up front, the figure read from
    the driver (free memory, and what this process's allocator holds), before the launcher writes anything."""
    from trunksplit.planning.memory import gpu_bytes_available
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.loop import train

    free, total = torch.cuda.mem_get_info(CUDA)
    assert free <= gpu_bytes_available(CUDA) <= total
    with pytest.raises(ValueError, match=r"is more than cuda:0 can give .*predict only \(verify=False"):
        fit(_model("resnet50"), (3, 224, 224), 2 * total)
    out = tmp_path / "run"
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), ["OUTPUT_DIR", str(out), "TRAIN.DEVICE", "cuda", "TRAIN.BATCH_SIZE_PER_RANK", "0",
                                                                   "TRAIN.MEMORY_LIMIT", str(float(2 * total))])
    with pytest.raises(ValueError, match=r"TRAIN.MEMORY_LIMIT .* is more than cuda:0 can give .*set TRAIN.BATCH_SIZE_PER_RANK yourself"):
        train(cfg)
    assert not out.exists()


def test_the_launchers_fitted_batch_fills_its_memory_limit_as_the_gpus_allocator_measures_the_step(tmp_path):
    """``TRAIN.BATCH_SIZE_PER_RANK 0``: multi-crop DINO's whole step (teacher, head, loss, each crop group's
    backward, AdamW's state) fitted to ``TRAIN.MEMORY_LIMIT`` on the GPU. Its step, as the allocator measures it,
    and what is resident beside it (counted here by hand) land in 0.85-1.00 of the limit: above it, a run given a
    GPU's memory as its limit would run out of it; well below, it would leave memory idle. (The CPU tests check the
    same fit against the tensor tracker, not against the allocator, which also counts cuDNN's workspaces.)"""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.loop import train

    limit, device = 2 * 2**30, "cuda"
    overrides = ["OUTPUT_DIR", str(tmp_path / "run"), "TRAIN.DEVICE", device, "MODEL.TRUNK.NAME", "resnet18", "DATA.IMAGE_SIZE", "72",
                 "MODEL.HEAD.HIDDEN_DIM", "256", "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "1", "DATA.NUM_IMAGES", "8192", "METHOD.NAME", "dino",
                 "METHOD.NUM_PROTOTYPES", "4096", "DATA.CROP_SIZES", "[64, 32]", "DATA.CROP_COUNTS", "[2, 4]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]",
                 "OPTIM.NAME", "adamw", "OPTIM.LR", "0.0005", "TRAIN.BATCH_SIZE_PER_RANK", "0", "TRAIN.MEMORY_LIMIT", str(float(limit))]
    model, last = train(load_config(str(ROOT / "configs" / "quickstart.yaml"), overrides))
    trainable = [p for p in model.parameters() if p.requires_grad]
    resident = (sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
                + 2 * sum(p.numel() * p.element_size() for p in trainable))  # AdamW's two moments (its step counts are on the host)
    batch = load_config(str(tmp_path / "run" / "config.yaml")).TRAIN.BATCH_SIZE_PER_RANK
    assert batch >= 2 and 0.85 * limit <= resident + last["peak_memory_bytes"] <= limit, (batch, (resident + last["peak_memory_bytes"]) / limit)


def test_checkpoint_wrapper_offloaded_to_the_host_is_exact_and_frees_the_gpu():
    """Each ResNet-50 stage wrapped with ``offload_to_cpu=True``: the same gradients as the plain
    model, and the stages' inputs (what the checkpoints keep) held in pinned host memory, not on
    the GPU: after the forward the GPU holds exactly those inputs less than without offloading."""
    x = _images(8, 160)
    plain = _model("resnet50")
    after_forward = {}
    models = {}
    for offload in (False, True):
        m = copy.deepcopy(plain)
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            setattr(m, stage, checkpoint_wrapper(getattr(m, stage), offload_to_cpu=offload))
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = m(x)
        torch.cuda.synchronize()
        after_forward[offload] = torch.cuda.memory_allocated() - start
        if offload:
            held = [o for o in gc.get_objects() if type(o).__name__ == "_Offloaded"]
            assert held and all(o.tensor.device.type == "cpu" and o.tensor.is_pinned() for o in held)
        out.sum().backward()
        models[offload] = m
    reference = plain(x)
    reference.sum().backward()
    inputs = sum(_input_bytes(plain, stage, x) for stage in ("layer1", "layer2", "layer3", "layer4"))
    assert after_forward[False] - after_forward[True] >= inputs * 0.99, (after_forward, inputs)
    for m in models.values():
        for (name, a), b in zip(plain.named_parameters(), m.parameters()):
            _close(a.grad, b.grad, name)


def _input_bytes(model, stage: str, x) -> int:
    seen = []
    handle = getattr(model, stage).register_forward_pre_hook(lambda mod, args: seen.append(args[0].untyped_storage().nbytes()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def test_trunk_compile_trains_as_the_compiled_plain_model_on_cuda():
    """``trunk.compile()`` on the GPU (inductor's Triton kernels) against the plain model under
    ``torch.compile``: gradients within compile's tolerance (the two graphs fuse differently)."""
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    # fp32 convolutions: cuDNN's TF32 default rounds each convolution's inputs to 10 bits, so two graphs that
    # lay a convolution out differently (trunk.compile() stores weights channels-last) differ by about 1e-2 at conv1
    torch.backends.cudnn.allow_tf32 = False
    x = _images(4, 96)
    plain = CheckpointedTrunk(_model("resnet18"))
    trunk = CheckpointedTrunk(copy.deepcopy(plain.feature_blocks), memory_budget=0.5, gradients="kept")  # cuts and a selective region
    trunk.compile()
    weights = _weights(plain, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in (torch.compile(plain), trunk):
            _step(model, x, weights)
    for (name, a), b in zip(plain.named_parameters(), trunk.parameters()):
        assert (a.grad - b.grad).norm() <= 1e-4 * a.grad.norm(), name


def test_a_budget_wrapping_of_a_model_without_buffers_leaves_the_gpus_generator_where_it_was():
    """``apply_activation_checkpointing(memory_budget=...)`` measures training steps (dropout draws in them) and
    puts the random state back: a ViT has no buffers, by which the GPUs to fork were found, so its steps moved
    the GPU's generator, and the user's next masks were not those of the same seed without the wrapping."""
    from torchvision.models.vision_transformer import VisionTransformer

    from trunksplit import apply_activation_checkpointing

    torch.manual_seed(0)
    model = VisionTransformer(32, 8, num_layers=4, num_heads=2, hidden_dim=64, mlp_dim=128, dropout=0.1).to(CUDA)
    assert not list(model.buffers())
    x = _images(4, 32)
    gpu, cpu = torch.cuda.get_rng_state(), torch.get_rng_state()
    plan = apply_activation_checkpointing(model, memory_budget=0.7, example_inputs=(x,), gradients="kept")
    assert plan.names, plan  # measured steps ran, dropout in each
    assert torch.equal(torch.cuda.get_rng_state(), gpu) and torch.equal(torch.get_rng_state(), cpu)


def _run_on_the_gpu(out, stop_at: int = 0) -> dict:
    """The launcher's run of EfficientNet-B0 (stochastic depth 0.2) under fp16 autocast on the GPU, 4 steps, checkpointed
    every 2; ``stop_at``: stopped as that step begins (as a killed run would be), then resumed. The last checkpoint."""
    from trunksplit.ssl import loop
    from trunksplit.ssl.config import load_config

    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), [
        "OUTPUT_DIR", str(out), "TRAIN.DEVICE", "cuda", "TRAIN.AUTOCAST", "fp16", "MODEL.TRUNK.NAME", "efficientnet_b0",
        "DATA.CROP_SIZES", "[64]", "DATA.IMAGE_SIZE", "72", "TRAIN.BATCH_SIZE_PER_RANK", "8", "MODEL.HEAD.HIDDEN_DIM", "64",
        "DATA.NUM_WORKERS", "0", "TRAIN.STEPS", "4", "TRAIN.CHECKPOINT_EVERY", "2"])
    real = loop.set_schedules  # called as each step begins
    if stop_at:
        loop.set_schedules = lambda c, o, step: (_ for _ in ()).throw(KeyboardInterrupt) if step == stop_at else real(c, o, step)
        try:
            with pytest.raises(KeyboardInterrupt):
                loop.train(cfg)
        finally:
            loop.set_schedules = real
    loop.train(cfg, resume=bool(stop_at))
    return torch.load(out / "checkpoint.pt", weights_only=True, map_location="cpu")


def test_a_gpu_run_resumed_takes_up_the_gpus_generator_and_the_grad_scaler(tmp_path):
    """Stochastic depth draws on the GPU's generator, and fp16's grad scaler moves its scale: a run stopped
    after step 2 and resumed ends with the uninterrupted run's weights and scaler (the checkpoint carries
    ``torch.cuda.get_rng_state()``; the CPU tests cannot reach it). (Checked on the CPU with the device swapped:
    with the CPU generator's restore taken out of ``run_dir._restore_rng`` it fails.)"""
    straight, resumed = _run_on_the_gpu(tmp_path / "a"), _run_on_the_gpu(tmp_path / "b", stop_at=2)
    assert straight["scaler"] == resumed["scaler"]
    for name, value in straight["model"].items():
        if value.is_floating_point() and "running" not in name:
            _close(value, resumed["model"][name], name)


def _colour_folder(root, per_class: int, seed: int) -> str:
    """An ImageFolder of noisy solid colours, a colour per class: classes a random trunk's features separate."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    for label, colour in enumerate([(230, 30, 30), (30, 200, 40), (40, 60, 230), (240, 220, 30)]):
        (root / f"class_{label}").mkdir(parents=True)
        for i in range(per_class):
            pixels = torch.tensor(colour, dtype=torch.float32).expand(40, 40, 3) + 8 * torch.randn(40, 40, 3, generator=g)
            Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()).save(root / f"class_{label}" / f"{i}.png")
    return str(root)


def test_the_quick_start_trains_on_one_gpu_with_the_knn_monitor(tmp_path):
    """The README's first command, shortened, on the GPU, watched by the kNN monitor from step 0: it
    trains, its peaks are the allocator's, and the untrained trunk's features separate colours.
    (FSDP2 needs two ranks, two GPUs with NCCL: not on a one-GPU machine.)"""
    out = tmp_path / "run"
    knn = ["EVAL.KNN.TRAIN_PATH", _colour_folder(tmp_path / "train", 6, 0), "EVAL.KNN.VAL_PATH", _colour_folder(tmp_path / "val", 3, 1),
           "EVAL.KNN.EVERY_STEPS", "2"]
    result = subprocess.run([sys.executable, "tools/train.py", "--config-file", "configs/quickstart.yaml", "TRAIN.STEPS", "4",
                             "TRAIN.CHECKPOINT_EVERY", "4", "TRAIN.DEVICE", "cuda", "OUTPUT_DIR", str(out), *knn],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    assert steps and steps[-1]["step"] == 4 and all(r["peak_memory_bytes"] > 0 for r in steps)
    evaluated = [r for r in rows if "knn_top1" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 4] and evaluated[0]["knn_top1"] >= 0.9, evaluated
    assert "memory, one step side by side" in result.stdout


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dinos_last_layer_under_autocast_casts_and_rounds_as_autograds_on_cuda(dtype):
    """The launcher's ``TRAIN.AUTOCAST`` on the GPU: DINO's fused last layer gives autograd's
    weight-normalised ``F.linear`` under the same autocast, its dtype, and fp32 parameter
    gradients within that precision's rounding (the fused forward divides after the product)."""
    from trunksplit.ssl.model import DINOHead

    torch.manual_seed(0)
    head = DINOHead(256, 512, 64, 4096).to(CUDA)
    x = torch.randn(32, 256, device=CUDA)
    grad = torch.randn(32, 4096, device=CUDA)
    reference = lambda v: F.linear(F.normalize(head.mlp(v), dim=-1), F.normalize(head.last_layer, dim=1))
    results = []
    for forward in (head, reference):
        with torch.autocast("cuda", dtype=dtype):
            out = forward(x)
        results.append((out, torch.autograd.grad(out, list(head.parameters()), grad.to(out.dtype))))
    (ours, ours_grads), (theirs, their_grads) = results
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert ours.dtype == theirs.dtype == dtype
    assert (ours.float() - theirs.float()).abs().max() <= 4 * ulp * theirs.float().abs().max()
    for (name, p), a, b in zip(head.named_parameters(), ours_grads, their_grads):
        assert a.dtype == b.dtype == p.dtype == torch.float32, name
        assert (a - b).norm() <= 8 * ulp * b.norm(), name


def test_a_multi_crop_step_backward_by_crop_group_on_cuda():
    """DINO at two resolutions on the GPU, one step from one model each way: the whole step's
    gradients (fp32 convolutions: the same kernels either way), and a lower allocator peak."""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.model import build_ssl_model
    from trunksplit.ssl.grouped import grouped_step
    from trunksplit.ssl.loop import whole_step_loss
    import contextlib

    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), [
        "MODEL.TRUNK.NAME", "resnet50", "METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "4096", "MODEL.HEAD.HIDDEN_DIM", "512",
        "DATA.CROP_SIZES", "[160, 64]", "DATA.CROP_COUNTS", "[2, 6]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]"])
    torch.manual_seed(0)
    model = build_ssl_model(cfg).to(CUDA)
    sizes = [160] * 2 + [64] * 6
    crops = [_images(16, s) for s in sizes]
    whole, grouped = copy.deepcopy(model), copy.deepcopy(model)
    with PeakMemory(CUDA) as whole_peak:
        whole_step_loss(cfg, whole, whole(crops), crops, 0).backward()
    with PeakMemory(CUDA) as grouped_peak:
        grouped_step(cfg, grouped, grouped, crops, 0, contextlib.nullcontext(), lambda part: part.backward(), contextlib.nullcontext)
    for (name, a), b in zip(whole.named_parameters(), grouped.parameters()):
        if a.grad is not None:
            assert ((a.grad - b.grad).norm() / a.grad.norm()).item() <= 1e-5, name
    assert grouped_peak.peak_bytes < 0.8 * whole_peak.peak_bytes, (grouped_peak.peak_bytes, whole_peak.peak_bytes)


def _host_waits(run) -> int:
    """How many times ``run()`` makes the host wait for the GPU, as torch's sync debug mode counts them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in seen)


def test_a_grouped_step_makes_the_host_wait_for_the_gpu_no_more_often_than_the_whole_step():
    """The grouped step summed its groups' losses into a host scalar moved to the GPU at the first group: a
    copy from pageable memory, which waits for every kernel queued before it, where the whole step queues its
    backward at once (the H200 measured grouped steps 4-12% slower, not attributed). Counted on a second step
    of each (the first plans the trunk)."""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.model import build_ssl_model
    from trunksplit.ssl.grouped import grouped_step
    from trunksplit.ssl.loop import whole_step_forward
    import contextlib

    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), [
        "MODEL.TRUNK.NAME", "resnet18", "METHOD.NAME", "dino", "METHOD.NUM_PROTOTYPES", "1024", "MODEL.HEAD.HIDDEN_DIM", "256",
        "DATA.CROP_SIZES", "[96, 48]", "DATA.CROP_COUNTS", "[2, 4]", "DATA.CROP_SCALES", "[[0.4, 1.0], [0.05, 0.4]]"])
    torch.manual_seed(0)
    model = build_ssl_model(cfg).to(CUDA)
    crops = [_images(8, s) for s in [96] * 2 + [48] * 4]
    whole, grouped = copy.deepcopy(model), copy.deepcopy(model)
    steps = {"whole": lambda: whole_step_forward(cfg, whole, whole, crops, 0, contextlib.nullcontext()).backward(),
             "grouped": lambda: grouped_step(cfg, grouped, grouped, crops, 0, contextlib.nullcontext(), lambda part: part.backward(), contextlib.nullcontext)}
    for step in steps.values():
        step()
    waits = {name: _host_waits(step) for name, step in steps.items()}
    assert waits["grouped"] <= waits["whole"], waits


def test_dinos_gradient_clipping_makes_the_host_wait_for_the_gpu_at_no_parameter():
    """DINO's clip_gradients branches on each parameter's clip coefficient (``if clip_coef < 1``), a device value:
    the host waited for the GPU at every parameter, after backward or, stepped in backward, inside it. The rule
    scales by min(coefficient, 1) on the GPU: DINO's gradients (against its formula on the host), no wait."""
    from trunksplit.ssl.config import load_config
    from trunksplit.ssl.model import build_ssl_model
    from trunksplit.ssl.optim import gradient_rule

    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), ["MODEL.TRUNK.NAME", "resnet18", "METHOD.NAME", "dino", "OPTIM.CLIP_GRAD", "0.5"])
    torch.manual_seed(0)
    model = build_ssl_model(cfg).to(CUDA)
    g = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * torch.rand((), generator=g)).to(CUDA)  # some within the clip, some above
    want, clipped = {}, set()
    for name, p in model.named_parameters():
        grad = p.grad.cpu()
        coefficient = 0.5 / (torch.linalg.vector_norm(grad) + 1e-6)
        want[name] = grad * coefficient if coefficient < 1 else grad
        if coefficient < 1:
            clipped.add(name)
    assert 0 < len(clipped) < len(want)  # both cases met
    rule = gradient_rule(cfg, model, step=10**6)  # past the last layer's frozen steps: clipping alone
    assert _host_waits(lambda: [rule(p) for p in model.parameters()]) == 0
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad.cpu(), want[name], rtol=1e-6, atol=0), name
        assert name in clipped or torch.equal(p.grad.cpu(), want[name]), name  # within the clip: untouched, bit for bit


def test_bench_plans_budgets_as_a_trunk_on_the_gpu_does_by_default(tmp_path):
    """A trunk on a GPU prices its recompute in time (``objective="auto"``); bench's budget rows priced it in
    FLOPs whatever the device, plans no trunk there trained (ResNet-50 at budget 0.5: 3.65x the plain step
    against 1.98x on an H100, docs/gpu.md)."""
    from trunksplit.cli import main

    assert main(["bench", "--arch", "resnet18", "--input", "2x3x64x64", "--splits", "2", "--budgets", "0.9", "--repeats", "1",
                 "--no-selective", "--device", "cuda", "--out", str(tmp_path)]) == 0
    assert "cuda, peak beyond parameters (gradients allocated by the step), budget plans priced in time\n" in (tmp_path / "benchmark.md").read_text()


def test_plan_measures_where_the_trunk_trains_by_default(capsys):
    """``trunksplit plan`` had no --device: on a GPU machine it measured on the CPU, in tensor bytes priced in FLOPs,
    a plan the GPU trunk (the allocator's bytes, recompute priced in time) would not make."""
    from trunksplit.cli import main

    assert main(["plan", "--arch", "resnet18", "--input", "4x3x64x64", "--budget", "0.7", "--gradients", "kept"]) == 0
    assert "MiB of the CUDA allocator's bytes (max_memory_allocated)" in capsys.readouterr().out
