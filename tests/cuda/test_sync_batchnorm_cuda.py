"""The CUDA tier for trunksplit.SyncBatchNorm: two processes on one GPU (gloo carries CUDA tensors), each
with half the batch, normalise as one process does the whole batch, checkpointed or not."""
import pytest
import torch
from torch import nn

from distributed_harness import run_processes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU on this machine")]


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.Conv2d(16, 4, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.2, 0.2)
    return model


def _batch(rank, device):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 3, 16, 16, generator=g).to(device), torch.randn(4, 4, 12, 12, generator=g).to(device)


def _halves(rank, world_size, out, device):
    """Each rank's gradients (summed over the ranks below: the global loss's), plain and checkpointed."""
    from trunksplit import checkpoint_wrapper, convert_sync_batchnorm

    results = {}
    for checkpointed in (False, True):
        model = convert_sync_batchnorm(_model()).to(device)
        x, w = _batch(rank, device)
        (((checkpoint_wrapper(model) if checkpointed else model)(x)) * w).sum().backward()  # trunksplit's: running statistics moved once
        results[checkpointed] = {n: p.grad.cpu() for n, p in model.named_parameters()}
        results[checkpointed]["running_var"] = model[1].running_var.cpu()
    torch.save(results, f"{out}/rank{rank}.pt")


def test_two_processes_on_the_gpu_normalise_as_one_process_over_the_whole_batch(tmp_path, device="cuda"):
    run_processes(_halves, 2, (str(tmp_path), device))
    model = _model().to(device)
    xs, ws = zip(*(_batch(rank, device) for rank in range(2)))
    (model(torch.cat(xs)) * torch.cat(ws)).sum().backward()
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for checkpointed in (False, True):
        for n, p in model.named_parameters():
            got, want = ranks[0][checkpointed][n] + ranks[1][checkpointed][n], p.grad.cpu()
            assert (got - want).abs().max() <= 1e-4 * want.abs().max() + 1e-6, (checkpointed, n)
        assert torch.allclose(ranks[0][checkpointed]["running_var"], model[1].running_var.cpu(), rtol=1e-5, atol=1e-6)
    for n in ranks[0][False]:  # the recompute runs the same kernels on the same inputs
        assert torch.equal(ranks[0][True][n], ranks[0][False][n]), n
