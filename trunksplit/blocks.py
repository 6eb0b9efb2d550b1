"""Turn a torchvision trunk into ordered, named feature blocks.

vissl's trunks expose their layers as ``feature_blocks``: an ordered dict whose
``res2``..``res5`` entries are stages that the splitter expands into their
residual blocks. :func:`feature_blocks` gives the same view of a stock torchvision
model (the values are the model's own module objects, so training the blocks
trains the model), and :func:`register_trunk` teaches it other families.
"""
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Mapping, Optional, Type

import torchvision
from torch import nn


class FeatureBlocks(OrderedDict):
    """Ordered feature blocks that also say which of them are stages.

    A stage is an iterable of blocks (an ``nn.Sequential`` or ``nn.ModuleList``);
    the splitter may cut between its children. Every other block is one unit.
    ``stages`` defaults to vissl's rule: the names that start with ``res``.
    """

    def __init__(self, *args, stages: Optional[Iterable[str]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stages = frozenset(n for n in self if n.startswith("res")) if stages is None else frozenset(stages)
        unknown = self.stages - set(self)
        if unknown:
            raise ValueError(f"stages {sorted(unknown)} are not among the feature blocks {list(self)}")

    def __reduce__(self):
        return (type(self), (list(self.items()),), {"stages": self.stages})


def stage_names(blocks: Mapping[str, nn.Module]) -> frozenset:
    """The names of ``blocks`` that are stages (see :class:`FeatureBlocks`)."""
    if isinstance(blocks, FeatureBlocks):
        return blocks.stages
    return frozenset(n for n in blocks if n.startswith("res"))



_TRUNK_FAMILIES: Dict[type, Callable[[nn.Module], "OrderedDict[str, nn.Module]"]] = {}


def register_trunk(model_type: Type[nn.Module], fn: Callable[[nn.Module], "OrderedDict[str, nn.Module]"]) -> None:
    """Teach :func:`feature_blocks` a model family.

    ``fn(model)`` must return an ordered dict of the model's own modules in
    execution order; entries named ``res*`` must be iterable stages (their
    children become the units the splitter may cut between). Subclasses of
    ``model_type`` are covered too.
    """
    if not (isinstance(model_type, type) and issubclass(model_type, nn.Module)):
        raise TypeError(f"register_trunk expects an nn.Module subclass, got {model_type!r}")
    if not callable(fn):
        raise TypeError(f"register_trunk expects a callable, got {fn!r}")
    _TRUNK_FAMILIES[model_type] = fn


def feature_blocks(model: nn.Module) -> "OrderedDict[str, nn.Module]":
    """The model's feature blocks, in execution order, named as vissl names them.

    ResNet family (resnet*, resnext*, wide_resnet*):
    ``conv1, bn1, conv1_relu, maxpool, res2, res3, res4, res5, avgpool, flatten``.
    RegNet family: ``conv1`` (the stem), ``res2``..``res5``, ``avgpool``, ``flatten``.
    The classifier head is left out. ``flatten`` is a new ``nn.Flatten(1)``; every
    other value is the model's own module object.
    """
    for klass in type(model).__mro__:
        if klass in _TRUNK_FAMILIES:
            return _TRUNK_FAMILIES[klass](model)
    known = ", ".join(sorted(k.__module__ + "." + k.__qualname__ for k in _TRUNK_FAMILIES))
    raise TypeError(
        f"feature_blocks does not know {type(model).__qualname__}. Supported families: {known}. "
        "Pass an OrderedDict of feature blocks instead, or call trunksplit.register_trunk."
    )


def _resnet_blocks(model: torchvision.models.ResNet) -> "OrderedDict[str, nn.Module]":
    return OrderedDict(
        conv1=model.conv1,
        bn1=model.bn1,
        conv1_relu=model.relu,
        maxpool=model.maxpool,
        res2=model.layer1,
        res3=model.layer2,
        res4=model.layer3,
        res5=model.layer4,
        avgpool=model.avgpool,
        flatten=nn.Flatten(1),
    )


def _regnet_blocks(model: torchvision.models.RegNet) -> "OrderedDict[str, nn.Module]":
    stages = list(model.trunk_output.children())
    if len(stages) != 4:
        raise TypeError(f"expected a RegNet with 4 stages, this one has {len(stages)}")
    blocks = OrderedDict(conv1=model.stem)
    for i, stage in enumerate(stages):
        blocks[f"res{i + 2}"] = stage
    blocks["avgpool"] = model.avgpool
    blocks["flatten"] = nn.Flatten(1)
    return blocks


register_trunk(torchvision.models.ResNet, _resnet_blocks)
register_trunk(torchvision.models.RegNet, _regnet_blocks)


def layer_splittable_before(module: nn.Module) -> bool:
    """Whether a checkpoint segment may start at ``module``.

    A segment must not start with an in-place operation: it would overwrite the
    previous segment's output, which checkpointing keeps for the recompute, and
    backward fails with "modified by an inplace operation". vissl compared
    ``str(m)`` to ``"ReLU(inplace=True)"``; this also catches every other module
    with ``inplace=True`` (ReLU6, LeakyReLU, SiLU, Hardswish, Dropout, ...) and
    looks through ``nn.Sequential`` containers (torchvision's
    ``Conv2dNormActivation`` included) at the child that runs first.

    Sharp edge: a custom module whose ``forward`` starts with an in-place op is
    invisible here; give it an ``inplace = True`` attribute or keep it off
    segment starts.
    """
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return getattr(module, "inplace", False) is not True
