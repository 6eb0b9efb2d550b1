"""The recipes of docs/integrations.md, run: Lightning with lightly's SimCLR and DINO examples, timm
and Hugging Face transformers models, each 3 steps bit for bit against the same stack without
trunksplit, and budgets met as measured. Optional extras (``pip install -e ".[clients]"``): each
test skips cleanly where its library is missing."""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torchvision
from torch import nn

import trunksplit
from trunksplit import PeakMemory, apply_activation_checkpointing

from distributed_harness import run_processes, threads_of_workers

pytestmark = pytest.mark.clients  # outside the fast suite: python -m pytest -q -m clients
STEPS = 3


def _batches(shape, n=STEPS, views=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(tuple(torch.randn(*shape, generator=g) for _ in range(views)), torch.zeros(shape[0])) for _ in range(n)]


def _lightning_fit(module, batches, ckpt_path=None, **trainer_kwargs):
    """``module`` trained by a Lightning ``Trainer`` on ``batches`` (one epoch unless told)."""
    pl = pytest.importorskip("pytorch_lightning")
    kwargs = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(**{**kwargs, **trainer_kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return module


def _same_weights(a: nn.Module, b: nn.Module):
    """Parameters in module order (the two may name them differently), equal bit for bit."""
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb) > 0
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert x.shape == y.shape and torch.equal(x, y), i


def _lightly_simclr(checkpointed: bool, momentum=0.0, seed=0):
    """lightly's SimCLR example (docs.lightly.ai), at a small size; ``checkpointed``: its two changed
    lines. ``momentum`` gives the optimizer a state to resume (lightly's example has none)."""
    pl = pytest.importorskip("pytorch_lightning")
    pytest.importorskip("lightly")
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead

    class SimCLR(pl.LightningModule):
        def __init__(self):
            super().__init__()
            resnet = torchvision.models.resnet18()
            if checkpointed:
                self.backbone = trunksplit.CheckpointedTrunk(resnet, ["flatten"], num_splits=3, strategy="balanced")  # changed
            else:
                self.backbone = nn.Sequential(*list(resnet.children())[:-1])
            self.projection_head = SimCLRProjectionHead(512, 512, 128)
            self.criterion = NTXentLoss()

        def forward(self, x):
            x = self.backbone(x)[0] if checkpointed else self.backbone(x).flatten(start_dim=1)  # changed
            return self.projection_head(x)

        def training_step(self, batch, batch_index):
            (x0, x1) = batch[0]
            return self.criterion(self.forward(x0), self.forward(x1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.06, momentum=momentum)

    torch.manual_seed(seed)
    return SimCLR()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightlys_simclr_under_lightning_trains_the_plain_backbones_weights(precision):
    batches = _batches((4, 3, 32, 32))
    plain = _lightning_fit(_lightly_simclr(False), batches, precision=precision)
    checkpointed = _lightning_fit(_lightly_simclr(True), batches, precision=precision)
    _same_weights(plain, checkpointed)
    assert checkpointed.backbone.plan.strategy == "balanced" and any(s.checkpointed for s in checkpointed.backbone.plan.segments)


def test_a_checkpointed_trunk_resumes_from_lightnings_modelcheckpoint_bit_for_bit(tmp_path):
    """Two epochs straight (the plain backbone) against one epoch, a ``ModelCheckpoint``, and a
    second epoch resumed by ``ckpt_path`` into a trunk built from other weights: the checkpoint
    carries the trunk's weights and the optimizer's momentum, and the run goes on as if unbroken."""
    pl = pytest.importorskip("pytorch_lightning")
    batches = _batches((4, 3, 32, 32))
    straight = _lightning_fit(_lightly_simclr(False, momentum=0.9), batches, max_epochs=2)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _lightning_fit(_lightly_simclr(True, momentum=0.9), batches, max_epochs=1, enable_checkpointing=True, callbacks=[saver])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert any(k.startswith("backbone.res2.0.") for k in saved["state_dict"]) and saved["optimizer_states"][0]["state"]
    resumed = _lightly_simclr(True, momentum=0.9, seed=1)
    assert not torch.equal(next(resumed.parameters()), next(straight.parameters()))
    _lightning_fit(resumed, batches, ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=2)
    _same_weights(straight, resumed)


DDP_BATCH = (4, 3, 32, 32)


def _simclr_under_lightning_ddp(rank, world_size, out):
    """A worker: lightly's SimCLR, plain then checkpointed, under ``Trainer(strategy="ddp")`` with
    processes started outside Lightning (as torchrun starts them: ``LOCAL_RANK`` set). Saves the
    weights it ends with, and for the checkpointed run each step's weights and reduced gradients."""
    pl = pytest.importorskip("pytorch_lightning")
    os.environ["LOCAL_RANK"] = str(rank)

    class Record(pl.Callback):
        def __init__(self):
            self.steps = []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.steps.append([(p.detach().clone(), p.grad.clone()) for p in module.parameters()])

    for checkpointed in (False, True):
        module, record = _lightly_simclr(checkpointed), Record()
        _lightning_fit(module, _batches(DDP_BATCH, n=STEPS * world_size), strategy="ddp", devices=world_size, callbacks=[record])
        torch.save([p.detach().clone() for p in module.parameters()], os.path.join(out, f"{checkpointed}-{rank}.pt"))
    torch.save(record.steps, os.path.join(out, f"steps-{rank}.pt"))  # the checkpointed run's


def _reference_gradients(weights, step, world_size):
    """What DDP's reduced gradient should be, by hand in one process from the same weights: the
    gradient of the mean of the ranks' losses, each on the batch that torch's ``DistributedSampler``
    deals that rank (Lightning puts one in, shuffled with seed 0)."""
    module = _lightly_simclr(False)
    with torch.no_grad():
        for p, w in zip(module.parameters(), weights):
            p.copy_(w)
    batches = _batches(DDP_BATCH, n=STEPS * world_size)
    dealt = [list(torch.utils.data.DistributedSampler(batches, world_size, r, shuffle=True, seed=0)) for r in range(world_size)]
    losses = [module.training_step(batches[dealt[r][step]], step) for r in range(world_size)]
    (sum(losses) / world_size).backward()
    return [p.grad for p in module.parameters()]


def test_lightlys_simclr_under_lightning_ddp_on_two_processes_trains_the_plain_weights(tmp_path):
    """Bit for bit with the plain backbone under the same DDP run; each step's reduced gradient
    equal to one process's (to rounding: a few steps of SimCLR at this size amplify rounding, so
    gradients are checked step by step from the run's own weights)."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("lightly")
    run_processes(_simclr_under_lightning_ddp, 2, (str(tmp_path),))
    plain, checkpointed = ([torch.load(tmp_path / f"{c}-{r}.pt") for r in range(2)] for c in (False, True))
    for a, b in zip(plain[0], checkpointed[0]):
        assert torch.equal(a, b)
    for a, b in zip(checkpointed[0], checkpointed[1]):
        assert torch.equal(a, b)  # the ranks agree
    steps = torch.load(tmp_path / "steps-0.pt")
    assert len(steps) == STEPS
    with threads_of_workers(2):
        for step, recorded in enumerate(steps):
            expected = _reference_gradients([w for w, _ in recorded], step, 2)
            for (_, got), want in zip(recorded, expected):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _lightly_dino(budget):
    """lightly's DINO example with a timm ViT in ``MaskedVisionTransformerTIMM``; ``budget``: the
    changed line, a memory budget for the student's backbone."""
    pl = pytest.importorskip("pytorch_lightning")
    pytest.importorskip("lightly")
    timm = pytest.importorskip("timm")
    from lightly.loss import DINOLoss
    from lightly.models.modules import DINOProjectionHead, MaskedVisionTransformerTIMM
    from lightly.models.utils import deactivate_requires_grad, update_momentum

    class DINO(pl.LightningModule):
        def __init__(self):
            super().__init__()
            vit = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8, num_classes=0)
            backbone = MaskedVisionTransformerTIMM(vit=vit)
            if budget is not None:
                example = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))  # a generator of its own: the heads' init stays
                apply_activation_checkpointing(backbone, memory_budget=budget, example_inputs=(example,))  # changed
            self.student_backbone = backbone
            self.student_head = DINOProjectionHead(192, 256, 64, 512, freeze_last_layer=1)
            self.teacher_backbone = copy.deepcopy(backbone)
            self.teacher_head = DINOProjectionHead(192, 256, 64, 512)
            deactivate_requires_grad(self.teacher_backbone)
            deactivate_requires_grad(self.teacher_head)
            self.criterion = DINOLoss(output_dim=512, warmup_teacher_temp_epochs=5)

        def forward(self, x):
            return self.student_head(self.student_backbone(x).flatten(start_dim=1))

        def forward_teacher(self, x):
            return self.teacher_head(self.teacher_backbone(x).flatten(start_dim=1))

        def training_step(self, batch, batch_index):
            update_momentum(self.student_backbone, self.teacher_backbone, m=0.99)
            update_momentum(self.student_head, self.teacher_head, m=0.99)
            views = batch[0]
            teacher_out = [self.forward_teacher(view) for view in views[:2]]
            student_out = [self.forward(view) for view in views]
            return self.criterion(teacher_out, student_out, epoch=self.current_epoch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return DINO()


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")  # lightly's DINOProjectionHead builds its last layer so
def test_lightlys_dino_with_a_timm_vit_meets_a_budget_and_trains_the_plain_weights():
    batches = _batches((8, 3, 64, 64), views=3)
    plain = _lightning_fit(_lightly_dino(None), batches)
    budgeted = _lightly_dino(0.6)
    wrapped = [n for n, m in budgeted.student_backbone.named_modules() if trunksplit.is_checkpoint_wrapped(m)]
    assert wrapped  # the budget wrapped blocks of the ViT inside lightly's wrapper
    _lightning_fit(budgeted, batches)
    _same_weights(plain, budgeted)


def _step_peak(model, x, loss=lambda out: out.float().pow(2).mean(), gradients="allocated"):
    """The second step's peak; ``gradients="kept"``: zeroed in place between steps, not freed."""
    loss(model(x)).backward()
    model.zero_grad(set_to_none=gradients == "allocated")
    with PeakMemory() as mem:
        loss(model(x)).backward()
    model.zero_grad()
    return mem.peak_bytes


def _sgd_steps(model, x, loss):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        loss(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("name,budget", [("resnet18", 0.9), ("vit_tiny_patch16_224", 0.6), ("convnext_atto", 0.6)])
def test_a_timm_model_meets_a_budget_in_place_of_set_grad_checkpointing(name, budget):
    timm = pytest.importorskip("timm")
    kwargs = dict(img_size=64, patch_size=8) if name.startswith("vit") else {}
    torch.manual_seed(0)
    plain = timm.create_model(name, num_classes=0, **kwargs)
    budgeted = copy.deepcopy(plain)
    x = torch.randn(8, 3, 64, 64) if name.startswith("vit") else torch.randn(8, 3, 128, 128)
    plan = apply_activation_checkpointing(budgeted, memory_budget=budget, example_inputs=(x,))  # in place of set_grad_checkpointing(True)
    assert plan.peak_bytes <= budget * plan.unwrapped_peak_bytes
    assert _step_peak(copy.deepcopy(budgeted), x) <= budget * _step_peak(copy.deepcopy(plain), x) * 1.02  # as measured
    loss = lambda out: out.float().pow(2).mean()
    _same_weights(_sgd_steps(plain, x, loss), _sgd_steps(budgeted, x, loss))


def _hf_models():
    transformers = pytest.importorskip("transformers")
    vit = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    convnext = transformers.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1])
    dinov2 = transformers.Dinov2Config(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    return {"vit": (transformers.ViTModel, vit), "convnext": (transformers.ConvNextModel, convnext), "dinov2": (transformers.Dinov2Model, dinov2)}


@pytest.mark.parametrize("name,budget", [("vit", 0.7), ("convnext", 0.8), ("dinov2", 0.7)])
def test_a_transformers_vision_model_meets_a_budget_in_place_of_its_checkpointing_switch(name, budget):
    model_class, config = _hf_models()[name]
    torch.manual_seed(0)
    plain = model_class(config)
    budgeted = copy.deepcopy(plain)
    x = torch.randn(8, 3, 64, 64)
    plan = apply_activation_checkpointing(budgeted, memory_budget=budget, example_inputs=(x,))  # in place of activation_checkpointing_enable()
    assert plan.peak_bytes <= budget * plan.unwrapped_peak_bytes
    loss = lambda out: out.last_hidden_state.float().pow(2).mean()
    assert _step_peak(copy.deepcopy(budgeted), x, loss) <= budget * _step_peak(copy.deepcopy(plain), x, loss) * 1.02
    _same_weights(_sgd_steps(plain, x, loss), _sgd_steps(budgeted, x, loss))


def test_a_budgeted_transformers_model_trains_the_plain_weights_under_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    intermediate_size=128, num_labels=3)
    g = torch.Generator().manual_seed(0)
    data = [{"pixel_values": torch.randn(3, 64, 64, generator=g), "labels": int(i % 3)} for i in range(8 * STEPS)]
    trained = {}
    for how in ("plain", "budget"):
        torch.manual_seed(0)
        model = transformers.ViTForImageClassification(config)
        if how == "budget":
            example = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
            apply_activation_checkpointing(model, memory_budget=0.8, example_inputs=(example,))  # in place of activation_checkpointing_enable()
        args = transformers.TrainingArguments(str(tmp_path / how), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=1e-3,
                                              use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                                              dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
        trained[how] = model
    _same_weights(trained["plain"], trained["budget"])


def test_a_budget_reaches_below_the_transformers_switch_with_gradients_kept():
    """With gradients kept, DINOv2's switch (every layer checkpointed whole: ``activation_checkpointing_enable()``,
    ``gradient_checkpointing_enable()`` before transformers deprecated that name) is not the lowest wrapping: the last
    layer, whose backward runs first, rebuilds less in parts. A budget of the switch's own measured peak is met, below it."""
    model_class, config = _hf_models()["dinov2"]
    torch.manual_seed(0)
    plain = model_class(config)
    switch, budgeted = copy.deepcopy(plain), copy.deepcopy(plain)
    (getattr(switch, "activation_checkpointing_enable", None) or switch.gradient_checkpointing_enable)()  # the older name, where the transformers installed has no other
    x = torch.randn(8, 3, 64, 64)
    loss = lambda out: out.last_hidden_state.float().pow(2).mean()
    switch_peak = _step_peak(switch, x, loss, gradients="kept")
    apply_activation_checkpointing(budgeted, memory_budget=switch_peak, example_inputs=(x,), gradients="kept")
    assert _step_peak(budgeted, x, loss, gradients="kept") < switch_peak


def _recipe_blocks(heading: str) -> list:
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "integrations.md")).read()
    section = page.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]


def test_the_crop_group_recipe_with_lightlys_dinoloss_trains_as_dinoloss_over_the_whole_step():
    """docs/integrations.md's two blocks, run as printed, against lightly's own ``DINOLoss`` called once
    on every crop (its whole-step loss): the same gradients, the same weights after the step, the same centre."""
    pytest.importorskip("lightly")
    from lightly.loss import DINOLoss

    namespace = {}
    for block in _recipe_blocks("Your own loop: DINO backward by crop group"):
        exec(block.replace("DINOLoss(output_dim=65536)", "DINOLoss(output_dim=32)"), namespace)
    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 32))
    teacher, whole = copy.deepcopy(student), copy.deepcopy(student)
    crops = [torch.randn(4, 3, 16, 16) for _ in range(2)] + [torch.randn(4, 3, 8, 8) for _ in range(6)]
    namespace["criterion"].center.normal_(0, 0.1)
    reference = DINOLoss(output_dim=32)
    reference.center.copy_(namespace["criterion"].center)
    grouped_opt, whole_opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (student, whole))
    got = namespace["lightly_dino_step"](student, teacher, crops, grouped_opt)
    with torch.no_grad():
        teacher_out = list(teacher(torch.cat(crops[:2])).chunk(2))
    want = reference(teacher_out, [whole(c) for c in crops])
    want.backward()
    whole_opt.step()
    assert abs(got.item() / want.item() - 1) <= 1e-6
    for (name, a), b in zip(whole.named_parameters(), student.parameters()):
        assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6, name
    assert torch.allclose(namespace["criterion"].center, reference.center, rtol=0, atol=1e-7)


def test_the_lightning_recipe_script_runs_as_shipped():
    """docs/recipes/lightning_lightly_simclr.py, run as a user runs it (a few steps, generated images):
    lightly's SimCLR example with its two changed lines trains on a checkpointed trunk."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("lightly")
    out = _run_recipe("lightning_lightly_simclr.py", "--steps", "3", "--batch", "8", "--size", "32")
    assert "trained 3 steps; last loss" in out and "trunk plan: balanced, 3 segments" in out


def _run_recipe(name, *args):
    script = os.path.join(os.path.dirname(__file__), "..", "docs", "recipes", name)
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=600, cwd=os.path.dirname(script))
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_timm_recipe_script_runs_as_shipped_and_trains_the_unwrapped_weights():
    pytest.importorskip("timm")
    out = _run_recipe("timm_budget.py", "--steps", "2")  # its defaults: convnext_atto, budget 0.6, 8 x 128px
    assert out.startswith("WrapPlan: ") and "weights equal to the unwrapped run's: True" in out
    measured = float(out.split("measured step peak ")[1].split(" = ")[1].split(" of")[0])
    assert measured <= 0.6 * 1.02


def test_the_transformers_recipe_script_runs_under_trainer_as_shipped(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run_recipe("transformers_trainer.py", "--steps", "2", "--out", str(tmp_path))
    assert out.startswith("WrapPlan: ") and "trained 2 steps; last loss" in out


def test_the_lightly_dino_recipe_script_runs_by_crop_group_as_shipped():
    pytest.importorskip("lightly")
    out = _run_recipe("lightly_dino_by_crop_group.py", "--steps", "2", "--batch", "2", "--global-size", "64", "--local-size", "32")
    assert "step peak: lightly's whole step" in out and "trained 2 steps; last loss" in out
