"""checkpoint_by_hooks: the non-reentrant checkpoint the trunk's cuts and checkpoint_wrapper run,
against the plain module and torch's own non-reentrant checkpoint."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trunksplit.planning.memory import PeakMemory
from trunksplit.recompute.hooked import checkpoint_by_hooks


def _block(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8).eval(), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(8, 4, 3, padding=1), nn.GELU())


def _run(block, x, checkpointed, seed=1):
    torch.manual_seed(seed)  # the same dropout mask in both runs, drawn in the forward
    return checkpoint_by_hooks(block, x) if checkpointed else block(x)


def _grads(block, x):
    return [x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("backwards", [1, 2])
def test_outputs_and_gradients_are_the_plain_blocks_with_its_dropout_mask(backwards):
    """The recompute draws the forward's dropout mask again (the RNG state restored); a second
    backward through a retained graph recomputes again and adds the same gradients."""
    results = []
    for checkpointed in (False, True):
        block, x = _block(), torch.randn(2, 3, 8, 8).requires_grad_()
        out = _run(block, x, checkpointed)
        torch.manual_seed(99)  # the RNG moves on between forward and backward, as in training
        torch.rand(5)
        for i in range(backwards):
            (out * out).sum().backward(retain_graph=i < backwards - 1)
        results.append((out.detach(), _grads(block, x)))
    (plain_out, plain_grads), (out, grads) = results
    assert torch.equal(plain_out, out)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))


def test_autograd_grad_with_create_graph_gives_the_plain_blocks_penalty_gradients():
    """A gradient penalty: torch.autograd.grad of the output with create_graph, then a backward
    through that gradient (it recomputes the block once for each)."""
    grads = []
    for checkpointed in (False, True):
        block, x = _block(), torch.randn(2, 3, 8, 8).requires_grad_()
        out = _run(block, x, checkpointed)
        (g,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        grads.append([p.grad for p in block.parameters()] + [g.detach()])
    assert all(torch.allclose(a, b, rtol=0, atol=0) for a, b in zip(*grads))


def test_cpu_autocast_is_re_entered_for_the_recompute():
    """The recompute runs under the forward's autocast (bf16 on the CPU) although the backward runs
    outside it: gradients bit for bit the plain block's."""
    grads = []
    for checkpointed in (False, True):
        block, x = _block(), torch.randn(2, 3, 8, 8).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _run(block, x, checkpointed)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        grads.append(_grads(block, x))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_recompute_makes_tensors_on_the_default_device_the_forward_had():
    """Factory calls inside the function (``torch.ones(3)``) follow ``with torch.device(...)`` around the
    forward; the backward runs outside it, and the recompute must put them where the forward did (here
    the meta device: shapes only, no GPU needed)."""
    def f(x):
        return (x * torch.ones(3)).sin()

    with torch.device("meta"):
        x = torch.randn(2, 3, requires_grad=True)
        out = checkpoint_by_hooks(f, x)
    out.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == (2, 3)


def test_non_tensor_arguments_and_tensors_in_containers_reach_the_recompute():
    def f(x, pair, scale):
        return (x * pair[0] + pair[1]).tanh() * scale

    grads = []
    for run in (lambda *a: f(*a), lambda *a: checkpoint_by_hooks(f, *a)):
        torch.manual_seed(0)
        x, w, b = (torch.randn(4, 5, requires_grad=True) for _ in range(3))
        run(x, [w, b], 3.0).sum().backward()
        grads.append([x.grad, w.grad, b.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _torch_checkpoint(f, h):
    return checkpoint(f, h, use_reentrant=False)


@pytest.mark.parametrize("inner", [checkpoint_by_hooks, _torch_checkpoint], ids=["by hooks", "torch's"])
def test_a_checkpoint_nested_in_one_is_dropped_with_it_as_in_torchs_own_nesting(inner):
    """The inner checkpoint's input is saved through the outer one's hooks: the outer drops it in
    the forward and makes it again, so nesting holds no more bytes than torch's checkpoint nested in
    itself (the step's peak, counted tensor by tensor, and the gradients equal)."""
    results = []
    for outer, inner_run in ((_torch_checkpoint, _torch_checkpoint), (checkpoint_by_hooks, inner)):
        torch.manual_seed(0)
        x, w = torch.randn(64, 256, requires_grad=True), torch.randn(256, requires_grad=True)

        def segment(h):
            h = (h * w).sin()
            h = inner_run(lambda t: (t * w).cos().sin(), h)
            return (h * w).tanh()

        with PeakMemory() as mem:
            outer(segment, x).sum().backward()
        results.append((mem.peak_bytes, x.grad, w.grad))
    (reference_peak, *reference_grads), (peak, *grads) = results
    assert peak == reference_peak
    assert all(torch.equal(a, b) for a, b in zip(reference_grads, grads))


def test_a_recompute_that_saves_other_tensors_is_refused_with_what_differs():
    """A function that runs other ops when called again (state it changes) cannot be recomputed:
    a clear error in backward, naming what the forward and the recompute saved; no gradient given."""
    calls = []

    def fewer(x):
        calls.append(1)
        return x * x if len(calls) == 1 else x.sin()  # saves two tensors, then one

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="the recompute saved 1 tensors for backward, the forward 2"):
        checkpoint_by_hooks(fewer, x).sum().backward()
    assert x.grad is None

    def other_shape(x):
        calls.append(1)
        return x.sin() if len(calls) % 2 else x[:2].sin().sum() * x[0].new_ones(3)

    calls.clear()
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"made tensor 0 as \(2,\) torch.float32, the forward saved \(3,\)"):
        checkpoint_by_hooks(other_shape, x).sum().backward()
    assert x.grad is None


def test_under_no_grad_the_function_runs_once_and_nothing_is_kept():
    calls = []

    def f(x):
        calls.append(1)
        return x.sin()

    with torch.no_grad():
        out = checkpoint_by_hooks(f, torch.randn(3, requires_grad=True))
    assert not out.requires_grad and out.grad_fn is None and len(calls) == 1
