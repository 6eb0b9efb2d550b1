"""Independent references: the plain torchvision model, its features read with forward hooks, a count of the convolutions a backward reruns, and one step of the plain model beside the checkpointed trunk."""
import copy
import warnings

import torch
import torchvision
from torch import nn

from trunksplit import CheckpointedTrunk, PeakMemory
from trunksplit.planning.memory import TorchDispatchMode  # torch's dispatch-mode base, from where trunksplit isolates the private import

# Where each trunksplit feature lives in the plain torchvision model.
_RESNET_FEATURES = {"conv1": "conv1", "bn1": "bn1", "maxpool": "maxpool", "res2": "layer1", "res3": "layer2", "res4": "layer3", "res5": "layer4", "avgpool": "avgpool"}
_REGNET_FEATURES = {"res2": "trunk_output.block1", "res3": "trunk_output.block2", "res4": "trunk_output.block3", "res5": "trunk_output.block4", "avgpool": "avgpool"}


def build(arch, seed=0):
    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)()
    # Non-trivial BatchNorm affine parameters and running stats, so a mix-up shows.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def plain_features(model, x, keys):
    """The plain model's features: its own forward, read with hooks on its stages.

    ``flatten`` is the avgpool output flattened, as the model's forward does before its classifier.
    A feature is the block's output as the block left it: bn1's is copied in the hook,
    before the ReLU(inplace=True) that follows overwrites it."""
    table = _RESNET_FEATURES if isinstance(model, torchvision.models.ResNet) else _REGNET_FEATURES
    found, handles = {}, []
    for key in set(keys) - {"flatten"} | {"avgpool"}:
        handles.append(model.get_submodule(table[key]).register_forward_hook(lambda m, i, o, key=key: found.__setitem__(key, o.clone() if key == "bn1" else o)))
    model(x)
    for h in handles:
        h.remove()
    found["flatten"] = torch.flatten(found["avgpool"], 1)
    return [found[k] for k in keys]


def loss_of(features, seed=123):
    """A loss that weighs every output element differently."""
    g = torch.Generator().manual_seed(seed)
    return sum((f * torch.randn(f.shape, generator=g)).sum() for f in features)


def gradient_penalty(features_of, x):
    """R1's penalty (a GAN discriminator's): the squared norm of the loss's gradient with respect to the
    images ``x`` (which require grad), backwarded through the graph of that gradient (``create_graph=True``):
    a second backward of one forward. ``features_of(x)``: a list of features, as :func:`loss_of` takes."""
    (g,) = torch.autograd.grad(loss_of(features_of(x)), x, create_graph=True)
    g.pow(2).sum().backward()


def second_step_peak(trunk, x):
    """The peak of a trunk's second training step on ``x`` (the first makes what later steps reuse:
    gradients, an optimizer's state), its gradients cleared before it as the trunk's mode says a
    loop clears them: set to None (torch's default ``zero_grad()``; stepped in backward, the update
    freed them already) or zeroed (``zero_grad(set_to_none=False)``)."""
    loss_of(trunk(x)).backward()
    for p in trunk.parameters():
        if trunk.gradients == "kept":
            p.grad.zero_()
        else:
            p.grad = None
    with PeakMemory() as mem:
        loss_of(trunk(x)).backward()
    return mem.peak_bytes


def held_feature_peaks(model, twin, trunk, x, w):
    """``model`` against the unsplit ``trunk`` of ``twin`` (a copy of it), each stepped with its feature held
    through backward (as a loop's variable holds a head's input), the loss ``(feature * w).sum()``, gradients
    set to None before each step. Checks that both give the same feature and gradients; returns the second
    steps' peaks (the model's, the trunk's) and the trunk's feature."""
    trunk.plan_for(x)
    assert not any(s.checkpointed for s in trunk.plan.segments)
    peaks, features = [], []
    for m, forward in ((model, lambda: model(x)), (trunk, lambda: trunk(x)[0])):
        for _ in range(2):  # the second step's peak: the first made the gradients
            for p in m.parameters():
                p.grad = None
            with PeakMemory() as mem:
                feature = forward()
                (feature * w).sum().backward()
        peaks.append(mem.peak_bytes)
        features.append(feature)
    assert torch.equal(features[0], features[1])
    twins = dict(twin.named_parameters())
    assert all(torch.equal(p.grad, twins[n].grad) for n, p in model.named_parameters())
    return peaks, features[1]


def grads_by_name(model):
    return {n: p.grad for n, p in model.named_parameters()}


class ForwardConvolutions(TorchDispatchMode):
    """Counts forward convolutions (aten.convolution): what a backward that reruns a conv calls."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten.convolution
        return func(*args, **(kwargs or {}))


def step_both(arch, keys, splits, reentrant, input_grad=False, strategy="vissl", **kw):
    """One training step of the plain model and of the checkpointed trunk built from a copy of it."""
    plain = build(arch)
    model = copy.deepcopy(plain)
    model.initial_buffers = {n: b.clone() for n, b in model.named_buffers()}
    trunk = CheckpointedTrunk(model, keys, num_splits=splits, use_reentrant=reentrant, strategy=strategy, **kw)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    x_plain, x_trunk = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    want = plain_features(plain, x_plain, keys)
    loss_of(want).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = trunk(x_trunk)
    loss_of(got).backward()
    return plain, model, trunk, want, got, (x_plain, x_trunk)


def close(a, b, rtol=1e-5):
    """Equal up to the rounding of a different summation order, relative to the tensor's scale."""
    return a.shape == b.shape and bool((a - b).abs().max() <= rtol * a.abs().max().clamp_min(1e-30))


def check_step(plain, model, trunk, want, got, reentrant, reentrant_rtol=1e-5):
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # Non-reentrant checkpointing replays the plain graph op for op: bit-exact. Reentrant
    # checkpointing runs one inner backward per segment, which changes the order in which
    # the gradients of a tensor used several times are summed: equal up to float rounding.
    same = torch.equal if not reentrant else (lambda a, b: close(a, b, reentrant_rtol))
    trunk_params = {id(p) for p in trunk.parameters()}
    want_grads, got_grads = grads_by_name(plain), grads_by_name(model)
    for name, p in model.named_parameters():
        if id(p) in trunk_params:
            assert got_grads[name] is not None, name
            assert same(want_grads[name], got_grads[name]), name
        else:  # not run by the trunk: no gradient in either model
            assert got_grads[name] is None and want_grads[name] is None, name
    trunk_buffers = {id(b) for b in trunk.buffers()}
    for (name, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        # BatchNorm statistics, num_batches_tracked included: as the plain step left them
        # where the trunk runs the layer, untouched elsewhere.
        assert torch.equal(a if id(b) in trunk_buffers else model.initial_buffers[name], b), name
