"""checkpoint_wrapper: the wrapped module trains exactly like the plain one, and stays a normal module."""
import collections
import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torchvision
from torch import nn

from trunksplit import checkpoint_wrapper, is_checkpoint_wrapped, is_recomputing, unwrap_checkpoint
from trunksplit.recompute.checkpoint import reused_in_recompute, run_checkpointed
from trunksplit.planning.memory import TorchDispatchMode  # the package's one import of torch's private dispatch mode

from reference import ForwardConvolutions


class Block(nn.Module):
    """kwargs in, a nested structure with non-tensor members out; dropout and BatchNorm inside."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.runs = []

    def forward(self, x, scale=1.0, bias=None):
        self.runs.append(is_recomputing())
        y = self.drop(torch.relu(self.bn(self.conv(x)))) * scale
        if bias is not None:
            y = y + bias
        return {"out": (y, y.mean()), "tag": "block", "n": 3}


def _loss(res):
    y, m = res["out"]
    assert res["tag"] == "block" and res["n"] == 3
    return (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum() + m


def _pair():
    torch.manual_seed(0)
    plain = Block()
    return plain, checkpoint_wrapper(copy.deepcopy(plain))


def _run(module, x, bias, seed=7):
    torch.manual_seed(seed)
    loss = _loss(module(x, scale=2.0, bias=bias))
    loss.backward()
    return loss


@pytest.mark.parametrize("input_grad", [False, True])
def test_loss_gradients_dropout_and_batchnorm_equal_the_plain_module(input_grad):
    plain, wrapped = _pair()
    x = torch.randn(2, 3, 8, 8)
    bias = torch.randn(4, 1, 1, requires_grad=True)
    xp, xw = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    bp, bw = bias.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    assert torch.equal(_run(plain, xp, bp), _run(wrapped, xw, bw))
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert b.grad is not None and torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), n  # running stats moved once, num_batches_tracked == 1
    assert int(wrapped.bn.num_batches_tracked) == 1
    assert torch.equal(bp.grad, bw.grad)
    if input_grad:
        assert torch.equal(xp.grad, xw.grad)


class _CountsByAssignment(nn.BatchNorm2d):
    """Moves its counter by assignment (``self.num_batches_tracked = ...``), not in place."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked = self.num_batches_tracked + 1
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1 if self.momentum is None else self.momentum, self.eps)


class _MomentumProperty(nn.BatchNorm2d):
    """Keeps its momentum behind a property, as a norm scheduling its momentum might."""

    @property
    def momentum(self):
        return self.__dict__["_scheduled"]

    @momentum.setter
    def momentum(self, value):
        self.__dict__["_scheduled"] = value


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm2d(4, momentum=None), lambda: nn.SyncBatchNorm(4), lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                                  lambda: _CountsByAssignment(4), lambda: _MomentumProperty(4)],
                         ids=["cumulative-average", "sync", "instance", "counter-assigned", "momentum-property"])
def test_every_norm_with_running_statistics_moves_them_once_a_step(norm):
    """Three steps, so a cumulative average's factor (1 / num_batches_tracked) is read after the counter
    moved: a recompute that bumped the counter, or averaged again, would show in the statistics. Norms
    that assign their counter or keep their momentum behind a property too: the recompute's guard
    sets both without ``nn.Module.__setattr__`` where it can."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(), nn.ReLU())
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    for step in range(3):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for module in (plain, wrapped):
            (module(x) * torch.arange(4.0).view(4, 1, 1)).sum().backward()
    for (name, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert wrapped[1].running_mean.abs().sum() > 0  # the statistics moved (the comparison is not of two untouched buffers)
    assert wrapped[1].momentum == plain[1].momentum and "num_batches_tracked" not in vars(wrapped[1])  # nothing left behind
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in plain.named_buffers()]


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def test_the_recompute_runs_the_forwards_ops_again_and_no_others():
    """On a GPU every op is a kernel launch: beyond the plain step, a checkpointed step runs its forward's
    ops once more and nothing else that computes (no copy of BatchNorm's counter made or written back;
    torch's checkpoint adds only views and allocations: detach, empty)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(2, 3, 8, 8)
    inputs = [x.clone().requires_grad_() for _ in range(3)]  # a leaf each: a second backward into one would add to its .grad
    counts = []
    for run in (lambda: plain(inputs[0]).sum().backward(), lambda: wrapped(inputs[1]).sum().backward(), lambda: plain(inputs[2])):
        with _AtenOps() as seen:
            run()
        counts.append(seen.ops)
    step, checkpointed, forward = counts
    extra = {func: checkpointed[func] - step[func] - forward[func] for func in checkpointed | step | forward}
    assert {func for func, n in extra.items() if n} <= {torch.ops.aten.detach.default, torch.ops.aten.empty.memory_format}, extra


def test_runs_twice_in_training_once_under_no_grad_and_flags_the_recompute():
    _, wrapped = _pair()
    x = torch.randn(2, 3, 8, 8)
    _run(wrapped, x, None)
    assert wrapped.runs == [False, True]
    wrapped.runs.clear()
    with torch.no_grad():
        wrapped(x)
    assert wrapped.runs == [False]
    assert not is_recomputing()


def test_bf16_autocast_on_cpu_is_restored_in_the_recompute():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 16)
    for m in (plain, wrapped):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).sum().backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_state_dict_and_parameter_names_unchanged_and_loadable_both_ways():
    model = torchvision.models.resnet18()
    plain_keys = list(model.state_dict())
    plain_names = [n for n, _ in model.layer1[0].named_parameters()]
    wrapped = copy.deepcopy(model)
    checkpoint_wrapper(wrapped.layer1[0])
    assert list(wrapped.state_dict()) == plain_keys
    assert [n for n, _ in wrapped.layer1[0].named_parameters()] == plain_names
    model.load_state_dict(wrapped.state_dict(), strict=True)
    wrapped.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("policy, reruns_convs", [("recompute", True), ("save_expensive", False)])
def test_a_policy_says_what_backward_reruns_and_training_stays_exact(policy, reruns_convs):
    plain, _ = _pair()
    wrapped = copy.deepcopy(checkpoint_wrapper(copy.deepcopy(plain), policy=policy))  # the policy survives a copy
    x = torch.randn(2, 3, 8, 8)
    losses = []
    for module in (plain, wrapped):
        torch.manual_seed(7)
        losses.append(_loss(module(x, scale=2.0)))
        with ForwardConvolutions() as convs:
            losses[-1].backward()
    assert (convs.count > 0) == reruns_convs and wrapped.runs == [False, True]
    assert torch.equal(*losses)
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), n  # BatchNorm moved once under either policy


@pytest.mark.parametrize("policy", ["recompute", "save_expensive", "save_heavy"])
def test_a_second_backward_of_one_forward_is_the_plain_modules_under_every_policy(policy):
    """Two losses of one forward, each backwarded alone (``retain_graph=True``): the checkpoint reruns
    its module for each; a selective policy's kept outputs went to the first backward, so its second
    reruns every op (torch's own refuses: "Trying to backward an extra time"). The plain module's
    gradients and BatchNorm statistics, bit for bit."""
    plain, _ = _pair()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), policy=policy)
    x = torch.randn(2, 3, 8, 8)
    for module in (plain, wrapped):
        torch.manual_seed(7)
        loss = _loss(module(x))
        loss.backward(retain_graph=True)
        (2 * loss).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    for (n, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), n


def test_an_unknown_policy_is_refused_and_the_module_left_as_it_was():
    module = Block()
    with pytest.raises(ValueError, match=r"policy must be one of \('recompute', 'save_expensive', 'save_heavy'\), got 'save_all'"):
        checkpoint_wrapper(module, policy="save_all")
    assert type(module) is Block and not is_checkpoint_wrapped(module)


def test_deepcopy_is_an_independent_copy_that_trains_itself():
    _, wrapped = _pair()
    twin = copy.deepcopy(wrapped)
    assert is_checkpoint_wrapped(twin)
    x = torch.randn(2, 3, 8, 8)
    _run(twin, x, None)
    assert all(p.grad is None for p in wrapped.parameters())
    assert all(p.grad is not None for p in twin.parameters())
    assert twin.runs[-2:] == [False, True] and wrapped.runs == []  # the copy ran its own forward, checkpointed
    assert int(twin.bn.num_batches_tracked) == 1 and int(wrapped.bn.num_batches_tracked) == 0


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_and_torch_save_round_trip(how):
    plain, wrapped = _pair()
    if how == "pickle":
        back = pickle.loads(pickle.dumps(wrapped))
    else:
        buf = io.BytesIO()
        torch.save(wrapped, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    assert is_checkpoint_wrapped(back) and type(back) is type(wrapped)
    back.runs.clear()
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(_run(plain, x, None), _run(back, x, None))
    assert back.runs == [False, True]
    for (n, a), (_, b) in zip(plain.named_parameters(), back.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_wrapped_fx_graph_module_copies_to_one_that_checkpoints_itself(how):
    """fx's GraphModule makes a class for each instance, and its own deepcopy and pickle rebuild one:
    a wrapped one's copy looped forever when called (RecursionError; a traced trunk's unit, copied
    by the launcher's side-by-side step), and pickle could not name the class. The copy is
    independent, checkpointed, and steps as the plain traced module does."""
    torch.manual_seed(0)
    plain = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    back = copy.deepcopy(wrapped) if how == "deepcopy" else pickle.loads(pickle.dumps(wrapped))
    assert is_checkpoint_wrapped(back)
    runs = {"wrapped": [], "copy": []}
    for who, module in (("wrapped", wrapped), ("copy", back)):
        module.get_submodule("2").register_forward_pre_hook(lambda m, args, who=who: runs[who].append(is_recomputing()))
    x = torch.randn(2, 4)
    plain(x).pow(2).sum().backward()
    back(x).pow(2).sum().backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), back.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    assert runs == {"wrapped": [], "copy": [False, True]}  # its own forward, checkpointed
    assert all(p.grad is None for p in wrapped.parameters())
    assert type(unwrap_checkpoint(back)).forward(back, x).shape == (2, 4)  # unwrapped, it runs as the plain module


def test_a_wrapped_fx_graph_modules_classes_go_with_it():
    """fx makes a class for each GraphModule: the wrapper's class for it is not kept once the module is gone
    (a traced trunk's units, wrapped by a selection and copied for a teacher, each made about 50)."""
    gm = checkpoint_wrapper(torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    gm(torch.randn(2, 4, requires_grad=True)).sum().backward()
    classes = [weakref.ref(type(gm)), weakref.ref(type(copy.deepcopy(gm)))]
    del gm
    gc.collect()
    assert [c() for c in classes] == [None, None]


def test_a_deleted_wrapped_module_is_freed_without_gc():
    gc.disable()
    try:
        module = checkpoint_wrapper(nn.Linear(4, 4))
        module(torch.randn(2, 4)).sum().backward()
        ref = weakref.ref(module)
        del module
        assert ref() is None
    finally:
        gc.enable()


def test_wrapping_twice_is_harmless_and_unwrap_restores_the_class():
    _, wrapped = _pair()
    again = checkpoint_wrapper(wrapped)
    assert again is wrapped and type(wrapped).__mro__.count(type(wrapped)) == 1
    _run(wrapped, torch.randn(2, 3, 8, 8), None)
    assert wrapped.runs == [False, True]  # checkpointed once, not nested
    unwrap_checkpoint(wrapped)
    assert type(wrapped) is Block and not is_checkpoint_wrapped(wrapped)
    wrapped.runs.clear()
    _run(wrapped, torch.randn(2, 3, 8, 8), None)
    assert wrapped.runs == [False]


def test_offload_to_cpu_works_on_a_cpu_only_machine():
    plain, _ = _pair()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=True)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(_run(plain, x, None), _run(wrapped, x, None))
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_wrapping_a_non_module_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        checkpoint_wrapper(lambda x: x)


class TakesTorchsNames(nn.Module):
    """A module whose own keywords share names with torch.utils.checkpoint's and run_checkpointed's."""

    def forward(self, x, debug=None, preserve_rng_state=None, early_stop=None, use_reentrant=None, context_fn=None,
                determinism_check=None, function=None, bns=None):
        got = dict(debug=debug, preserve_rng_state=preserve_rng_state, early_stop=early_stop, use_reentrant=use_reentrant,
                   context_fn=context_fn, determinism_check=determinism_check, function=function, bns=bns)
        return x * 2, got


def test_every_keyword_reaches_the_module_unchanged():
    wrapped = checkpoint_wrapper(TakesTorchsNames())
    kwargs = dict(debug="d", preserve_rng_state="p", early_stop="e", use_reentrant="u", context_fn="c", determinism_check="dc", function="f", bns="b")
    x = torch.randn(3, requires_grad=True)
    y, got = wrapped(x, **kwargs)
    assert got == kwargs
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_slice_of_a_wrapped_sequential_runs_and_trains_like_the_plain_slice():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(3, 4)
    part = wrapped[1:]
    assert is_checkpoint_wrapped(part) and list(part.state_dict()) == list(plain[1:].state_dict())
    plain[1:](x).pow(2).sum().backward()
    part(x).pow(2).sum().backward()
    assert torch.equal(plain[2].weight.grad, wrapped[2].weight.grad)
    unwrap_checkpoint(part)  # a slice made by the container can be unwrapped too
    assert type(part) is nn.Sequential


@pytest.mark.parametrize("make", [nn.ReLU, nn.SiLU, nn.Hardswish, nn.Dropout, nn.LeakyReLU,
                                  lambda inplace: nn.Sequential(nn.ReLU(inplace=inplace), nn.Linear(4, 4))],
                         ids=["relu", "silu", "hardswish", "dropout", "leaky_relu", "sequential_starting_in_place"])
def test_a_module_that_overwrites_its_input_is_refused_and_left_unwrapped(make):
    module = make(inplace=True)
    cls = type(module)
    with pytest.raises(ValueError, match=r"cannot wrap .* inplace=True: it overwrites its input.*inplace=False"):
        checkpoint_wrapper(module)
    assert type(module) is cls and not is_checkpoint_wrapped(module)
    wrapped = checkpoint_wrapper(make(inplace=False))  # the same module without the in-place op is fine
    x = torch.randn(3, 4, requires_grad=True)
    wrapped(x * 1).sum().backward()
    assert x.grad is not None


class _RunningMean(nn.Module):
    """Writes a buffer in forward (an EMA of its input) and reads it before the write."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.linear(x) + self.ema
        self.ema.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y.relu()


def test_a_buffer_written_in_forward_moves_once_and_the_recompute_reads_it_as_the_forward_did():
    torch.manual_seed(0)
    plain = _RunningMean()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(5, 4)
    for _ in range(3):
        plain(x).pow(2).sum().backward()
        wrapped(x).pow(2).sum().backward()
    assert torch.equal(plain.ema, wrapped.ema)
    assert torch.equal(plain.linear.weight.grad, wrapped.linear.weight.grad)


class _Counted(nn.Module):
    """Scales by a number its forward makes with a side effect (a collective's stand-in: the call count),
    through ``reused_in_recompute``: a recompute that made it again would scale by the next count."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        def count():
            self.calls += 1
            return torch.tensor(float(self.calls))
        return self.linear(x) * reused_in_recompute(self, count)


@pytest.mark.parametrize("how", ["recompute", "save_expensive", "reentrant", "nested"])
def test_what_a_forward_computes_once_its_recompute_reuses_and_a_forward_never_backpropagated_leaves_nothing(how):
    """Each forward computes it once, checkpointed or not, in either mode, nested too; a forward whose
    graph is dropped takes its value with it (kept in a queue, the next step's recompute would read it)."""
    torch.manual_seed(0)
    plain, x = _Counted(), torch.randn(5, 4)
    counted = copy.deepcopy(plain)
    if how == "reentrant":
        def run(inp):
            return run_checkpointed(counted, [counted], (inp,), use_reentrant=True)
    else:
        run = checkpoint_wrapper(counted, policy="recompute" if how == "nested" else how)
        run = checkpoint_wrapper(nn.Sequential(run)) if how == "nested" else run
    inputs = [x.detach().clone().requires_grad_() for _ in range(2)]
    for model, inp in zip((plain, run), inputs):
        model(inp)  # dropped before any backward
        model(inp).pow(2).sum().backward()
    assert plain.calls == counted.calls == 2
    assert torch.equal(plain.linear.weight.grad, counted.linear.weight.grad) and torch.equal(inputs[0].grad, inputs[1].grad)
    assert reused_in_recompute(plain, lambda: 7) == 7  # outside a checkpoint: computed


class Concatenating(nn.Module):
    """A DenseNet layer: it takes the list of every feature so far, which its caller grows after the call."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, 2, 3, padding=1)

    def forward(self, features):
        return torch.relu(self.conv(torch.cat(features, 1)))


class Branches(nn.Module):
    """An HRNet module: it replaces the branches of the list it is given with their outputs."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(2))

    def forward(self, xs):
        for i, branch in enumerate(self.branches):
            xs[i] = torch.tanh(branch(xs[i]))
        return xs[0] + xs[1]


def _dense(layers, x):
    features = [x]
    for layer in layers:
        features.append(layer(features))  # the list the layer was given grows
    return torch.cat(features, 1).pow(2).sum()


@pytest.mark.parametrize("policy", ["recompute", "save_expensive"])
def test_the_recompute_sees_the_input_lists_the_forward_saw(policy):
    torch.manual_seed(0)
    dense = nn.ModuleList(Concatenating(3 + 2 * i) for i in range(3))
    branches = Branches()
    x = torch.randn(2, 3, 8, 8)
    grads = []
    for wrap in (False, True):
        d, b = copy.deepcopy(dense), copy.deepcopy(branches)
        if wrap:
            for m in (*d, b):
                checkpoint_wrapper(m, policy=policy)
        (_dense(d, x) + b([x, 2 * x]).sum()).backward()
        grads.append([p.grad for p in (*d.parameters(), *b.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_dict_subclass_inputs_reach_a_wrapped_module_as_they_reach_the_plain_one():
    """A transformers ``ModelOutput`` (an OrderedDict subclass with attributes) or a ``defaultdict``
    passed to a wrapped module arrives as the same kind of object, as torch's checkpoint passes it."""
    import collections

    class Output(collections.OrderedDict):
        @property
        def hidden(self):
            return self["hidden"]

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, batch):
            return self.linear(batch.hidden) + batch["missing"].sum()  # attribute access; a defaultdict's factory

    class Both(collections.defaultdict):
        hidden = property(lambda self: self["hidden"])

    torch.manual_seed(0)
    plain = Reads()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    for make in (lambda h: Output(hidden=h, missing=torch.ones(1)), lambda h: Both(lambda: torch.zeros(1), hidden=h)):
        h = torch.randn(2, 4)
        grads = []
        for m in (plain, wrapped):
            m.zero_grad()
            m(make(h)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Indexed(nn.Module):
    """A layer that reads an index table, as Swin's attention reads its relative-position index."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("index", torch.arange(64 * 1024) % 64)  # 512 KiB of int64

    def forward(self, x):
        return self.linear(x)[:, self.index[:64]]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_frozen_module_on_an_input_without_gradient_runs_as_it_is(reentrant):
    """Frozen, on an input that needs no gradient (a fine-tuned trunk's stem on the images), nothing is saved
    for backward, so nothing is checkpointed: the step's peak is the plain module's (before: the copies of its
    buffers that a checkpoint keeps while its first forward runs were on top), and it runs once."""
    from trunksplit import PeakMemory
    from trunksplit.recompute.checkpoint import run_checkpointed

    plain = _Indexed().requires_grad_(False)
    x = torch.randn(8, 64)
    with PeakMemory() as alone:
        want = plain(x)
    calls = []
    plain.register_forward_hook(lambda *a: calls.append(1))
    with PeakMemory() as checkpointed:
        got = run_checkpointed(plain, [plain], (x,), use_reentrant=reentrant)
    assert torch.equal(got, want) and not got.requires_grad and calls == [1]
    assert checkpointed.peak_bytes == alone.peak_bytes, (checkpointed.peak_bytes, alone.peak_bytes)
