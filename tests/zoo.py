"""Small instances of every torchvision family (the zoo's own classes, fewer channels and
blocks, so a training step takes milliseconds), each model's head, to remove for a reference, and
models no family knows, whose chains are traced."""
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models import convnext, efficientnet, maxvit, vgg, vision_transformer
from torchvision.models import swin_transformer as swin

# name -> builder; stochastic depth and dropout are on, so RNG exactness is exercised
SMALL = {
    "resnet18": lambda: torchvision.models.resnet18(),
    "regnet_x_400mf": lambda: torchvision.models.regnet_x_400mf(),
    "convnext": lambda: convnext.ConvNeXt(
        [convnext.CNBlockConfig(16, 32, 1), convnext.CNBlockConfig(32, 64, 1), convnext.CNBlockConfig(64, 96, 2), convnext.CNBlockConfig(96, None, 1)],
        stochastic_depth_prob=0.3,
    ),
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(stochastic_depth_prob=0.3),
    "efficientnet_v2_s": lambda: efficientnet.EfficientNet(  # V2-S's block kinds (fused, then depthwise), fewer and narrower
        [efficientnet.FusedMBConvConfig(1, 3, 1, 16, 16, 1), efficientnet.FusedMBConvConfig(4, 3, 2, 16, 24, 2), efficientnet.MBConvConfig(4, 3, 2, 24, 32, 2),
         efficientnet.MBConvConfig(6, 3, 2, 32, 48, 2), efficientnet.MBConvConfig(6, 3, 2, 48, 64, 1)],
        dropout=0.2, stochastic_depth_prob=0.3, last_channel=256,
    ),
    "mobilenet_v2": lambda: torchvision.models.mobilenet_v2(width_mult=0.5),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(),
    "mnasnet0_5": lambda: torchvision.models.mnasnet0_5(),
    "shufflenet_v2_x0_5": lambda: torchvision.models.shufflenet_v2_x0_5(),
    "densenet": lambda: torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16),
    "vgg": lambda: _narrow_vgg([8, "M", 16, "M", 16, 16, "M", 32, "M", 32, "M"]),
    "swin": lambda: swin.SwinTransformer([4, 4], 16, [1, 1, 2, 1], [1, 2, 2, 4], [2, 2], stochastic_depth_prob=0.3),
    "swin_v2": lambda: swin.SwinTransformer(
        [4, 4], 16, [1, 1, 2, 1], [1, 2, 2, 4], [2, 2], stochastic_depth_prob=0.3, block=swin.SwinTransformerBlockV2, downsample_layer=swin.PatchMergingV2
    ),
    "maxvit": lambda: maxvit.MaxVit((64, 64), 16, 2, [16, 32, 32, 48], [1, 1, 2, 1], 8, stochastic_depth_prob=0.3, num_classes=10),
    "vit": lambda: vision_transformer.VisionTransformer(32, 8, 3, 2, 32, 64, dropout=0.1),
}


def _narrow_vgg(layers):
    """torchvision's VGG class with narrow features and a classifier to match: its own classifier takes
    512 x 7 x 7 inputs to 4096 whatever the features (120M parameters: a second to build and to copy)."""
    with torch.device("meta"):  # the classifier built here is replaced below, never initialised
        model = vgg.VGG(nn.Sequential(), num_classes=10, init_weights=False)
    model.features = vgg.make_layers(layers, batch_norm=True)
    width = next(c for c in reversed(layers) if c != "M")
    model.classifier = nn.Sequential(nn.Linear(width * 7 * 7, 64), nn.ReLU(True), nn.Dropout(), nn.Linear(64, 64), nn.ReLU(True), nn.Dropout(), nn.Linear(64, 10))
    for m in model.modules():  # VGG's own initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return model


def small(name, seed=0):
    torch.manual_seed(seed)
    return SMALL[name]()


def input_for(name, batch=2):
    size = 32 if name == "vit" else 64
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


# The head starts at the classifier's first Linear; replacing it by Identity leaves the
# model's own forward computing the pooled feature trunksplit calls "flatten".
_HEADS = {
    torchvision.models.ResNet: lambda m: setattr(m, "fc", nn.Identity()),
    torchvision.models.RegNet: lambda m: setattr(m, "fc", nn.Identity()),
    torchvision.models.ConvNeXt: lambda m: m.classifier.__setitem__(2, nn.Identity()),
    torchvision.models.EfficientNet: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.MobileNetV2: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.MobileNetV3: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.MNASNet: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.ShuffleNetV2: lambda m: setattr(m, "fc", nn.Identity()),
    torchvision.models.DenseNet: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.VGG: lambda m: setattr(m, "classifier", nn.Identity()),
    torchvision.models.SwinTransformer: lambda m: setattr(m, "head", nn.Identity()),
    torchvision.models.MaxVit: lambda m: [m.classifier.__setitem__(i, nn.Identity()) for i in (3, 4, 5)],
    torchvision.models.VisionTransformer: lambda m: setattr(m, "heads", nn.Identity()),
}


def without_head(model):
    """The model itself, its classifier from the first Linear on replaced by Identity."""
    _HEADS[type(model)](model)
    return model


# Models no family knows: CheckpointedTrunk traces their chains with torch.fx.
class ResidualNet(nn.Module):
    """A ModuleList of residual blocks, functional ops in forward, a parameter read directly."""

    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.Dropout(0.2)) for _ in range(depth))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width).view(1, width, 1, 1))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        x = x * self.scale
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyViT(nn.Module):
    """Tokens: a class-token parameter, attention with a residual, LayerNorm, dropout."""

    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(dim), attn=nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True), mlp=nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))))
            for _ in range(depth)
        )

    def tokens(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for layer in self.layers:
            h = layer["norm"](x)
            x = x + layer["attn"](h, h, h, need_weights=False)[0]
            x = x + layer["mlp"](x)
        return x

    def forward(self, x):
        return self.tokens(x)[:, 0]
