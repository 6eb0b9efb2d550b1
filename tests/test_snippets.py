"""Every Python block of README.md and docs/ runs as printed: what a user copies works.

A block runs in a fresh namespace after a few lines of set-up that give it what the page's text
says the reader has (``images``, ``model``, ``sample_batch``, a loss), never by editing the block;
where the block computes something an independent reference can check (the plain model's output
or gradients), the check runs after it. Blocks that need an optional library run in the clients
suite. A new block must be listed here (the first test fails until it is); the two DINO blocks of
integrations.md are run by the tests that check them against DINO's and lightly's losses.
"""
import os

import pytest

from distributed_harness import free_port, run_processes
from docs_pages import PAGES, ROOT, fences

SIMCLR_LIGHTNING = """\
import pytorch_lightning as pl, torch, torchvision
from lightly.loss import NTXentLoss
from lightly.models.modules import SimCLRProjectionHead
"""
TIMM = "import timm, torch, trunksplit\nsample_batch = torch.randn(8, 3, 128, 128)\n"
TRANSFORMERS = """\
import tempfile, torch, trunksplit
from transformers import Trainer, TrainingArguments, ViTConfig, ViTForImageClassification
config = ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, num_labels=3)
sample_pixel_values = torch.randn(8, 3, 64, 64)
data = [{"pixel_values": torch.randn(3, 64, 64), "labels": i % 3} for i in range(16)]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=2, report_to=[], use_cpu=True)
"""

# (page, n-th Python block) -> (set-up, check after it, optional libraries it needs: the clients suite)
BLOCKS = {
    ("README.md", 0): (
        "import torch\ntorch.manual_seed(0)\nimages = torch.randn(2, 3, 64, 64)\n",
        "torch.manual_seed(0)\nx = torch.randn(2, 3, 64, 64)\nplain = torchvision.models.resnet50()\nplain.fc = torch.nn.Identity()\n"
        "assert torch.equal(pooled, plain(x)) and 'segment' in str(trunk.plan).lower()\n",
        ()),
    ("checkpoint_wrapper.md", 0): (
        "import torch, torchvision\ntorch.manual_seed(1)\nmodel = torchvision.models.resnet50()\nblock = torchvision.models.resnet18().layer1[0]\n",
        "x = torch.randn(2, 3, 64, 64)\ntorch.manual_seed(1)\nplain = torchvision.models.resnet50()\n"
        "model(x).sum().backward()\nplain(x).sum().backward()\n"
        "assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))\n",
        ()),
    ("checkpoint_wrapper.md", 1): (
        "import torch, torchvision\nfrom trunksplit import apply_activation_checkpointing\nmodel = torchvision.models.mobilenet_v2()\n"
        "images = torch.randn(2, 3, 128, 128)\n",
        "assert plan.peak_bytes <= 0.5 * plan.unwrapped_peak_bytes and plan.names\n",
        ()),
    ("planning.md", 0): (
        "import torch\nloader = [torch.randn(4, 3, 128, 128)]  # a budget of 0.3 needs activations above the update's temporaries\nloss_fn = lambda features: features[-1].sum()\n",
        "assert all(p.grad is None for p in trunk.parameters())  # each gradient freed at its update\n",
        ()),
    ("integrations.md", 0): (SIMCLR_LIGHTNING, "assert SimCLR()(torch.randn(2, 3, 64, 64)).shape == (2, 128)\n", ("pytorch_lightning", "lightly")),
    ("integrations.md", 1): (
        "import timm, torch, trunksplit\nfrom lightly.models.modules import MaskedVisionTransformerTIMM\nsample_batch = torch.randn(4, 3, 224, 224)\n",
        "assert backbone(sample_batch).shape == (4, 384)\n", ("timm", "lightly")),
    ("integrations.md", 2): (TIMM, "assert model(sample_batch).shape == (8, 320)\n", ("timm",)),
    ("integrations.md", 3): (TRANSFORMERS, "assert trainer.train().global_step == 2\n", ("transformers", "accelerate")),
    ("integrations.md", 4): (
        "import torch, trunksplit\nfrom transformers import Dinov2Config, Dinov2Model\npixel_values = torch.randn(8, 3, 64, 64)\n"
        "config = Dinov2Config(image_size=64, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2)\n"
        "torch.manual_seed(0)\n",
        "torch.manual_seed(0)\nassert torch.equal(cls, Dinov2Model(config)(pixel_values).pooler_output) and trunk.plan.strategy == 'budget'\n",
        ("transformers",)),
}
RUN_ELSEWHERE = {("integrations.md", 5): "tests/ssl/test_grouped.py", ("integrations.md", 6): "tests/test_integrations.py"}
# a budget of 0.5 needs activations well above the gradients: 224px images, too slow for the fast suite
UNDER_TORCHRUN = {("distributed.md", 0): (
    "import torch\nimages = torch.randn(4, 3, 224, 224)\nloss = lambda features: features[-1].sum()\n",
    "assert all(p.grad is not None for p in trunk.parameters() if p.requires_grad)\n")}


def _python_blocks():
    for page in PAGES:
        blocks = [body for language, body in fences(page.read_text())[0] if language == "python"]
        for i, body in enumerate(blocks):
            yield (page.name, i), body


SOURCE = dict(_python_blocks())


def test_every_python_block_is_run_by_a_test():
    listed = set(BLOCKS) | set(RUN_ELSEWHERE) | set(UNDER_TORCHRUN)
    assert set(SOURCE) == listed, f"blocks not listed here: {sorted(set(SOURCE) - listed)}; listed, not on a page: {sorted(listed - set(SOURCE))}"
    for (page, i), test in RUN_ELSEWHERE.items():  # the test that runs it reads it from the page
        assert page in (ROOT / test).read_text(), test


def _run(key, setup: str, check: str) -> None:
    namespace = {}
    exec(compile(setup, f"<set-up of {key}>", "exec"), namespace)
    exec(compile(SOURCE[key], f"<{key[0]}, Python block {key[1]}>", "exec"), namespace)
    exec(compile(check, f"<check of {key}>", "exec"), namespace)


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.clients if needs else ()) for k, (_, _, needs) in BLOCKS.items()],
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_block_runs_as_printed(key):
    setup, check, needs = BLOCKS[key]
    for module in needs:
        pytest.importorskip(module)
    _run(key, setup, check)


def _under_torchrun(rank, world_size, key, port):
    import torch.distributed as dist

    dist.destroy_process_group()  # the harness's: the block starts its own, from torchrun's variables
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    _run(key, *UNDER_TORCHRUN[key])


@pytest.mark.slow  # python -m pytest -q -m slow tests/test_snippets.py
@pytest.mark.parametrize("key", list(UNDER_TORCHRUN), ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_block_runs_as_printed_under_torchrun(key):
    run_processes(_under_torchrun, 2, (key, free_port()), timeout=600)
