"""Independent references: the plain torchvision model, its features read with forward hooks, a count of the convolutions a backward reruns."""
import torch
import torchvision
from torch import nn

from trunksplit import PeakMemory
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
