"""Turn a model into ordered, named feature blocks.

vissl's trunks expose their layers as ``feature_blocks``: an ordered dict whose
``res2``..``res5`` entries are stages that the splitter expands into their
residual blocks. :func:`feature_blocks` gives the same view of every torchvision
classification family (``families.py``; the values are the model's own module
objects, so training the blocks trains the model), and :func:`register_trunk`
teaches it other families. :class:`FeatureBlocks` says which blocks are stages.
"""
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Mapping, Optional, Type

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
    execution order, whose last entry gives the features the caller wants. A
    :class:`FeatureBlocks` names its stages (iterables whose children become
    the units the splitter may cut between); in a plain dict the entries named
    ``res*`` are the stages, as in vissl. Subclasses of ``model_type`` are
    covered too, and a later registration of the same type replaces the earlier.
    """
    if not (isinstance(model_type, type) and issubclass(model_type, nn.Module)):
        raise TypeError(f"register_trunk expects an nn.Module subclass, got {model_type!r}")
    if not callable(fn):
        raise TypeError(f"register_trunk expects a callable, got {fn!r}")
    _TRUNK_FAMILIES[model_type] = fn


def feature_blocks(model: nn.Module) -> FeatureBlocks:
    """The model's feature blocks, in execution order, named as vissl names them.

    ResNet family (resnet*, resnext*, wide_resnet*):
    ``conv1, bn1, conv1_relu, maxpool, res2, res3, res4, res5, avgpool, flatten``.
    RegNet family: ``conv1`` (the stem), ``res2``..``res5``, ``avgpool``, ``flatten``.
    Every other torchvision classification family: see ``trunksplit/families.py``
    (hierarchical ones name their stride-4..32 stages ``res2``..``res5``; ViT has
    ``embed, encoder, norm, flatten``). The classifier head is left out; the last
    key is always ``flatten``, the pooled ``[B, C]`` vector the classifier starts
    from. Values are the model's own modules, or small adapters holding them.

    Any other model is traced with ``torch.fx`` and cut where one tensor carries
    all the state (``trunksplit/auto.py``); its last key is ``output``, the model's
    own output. A model that cannot be traced raises ``TypeError`` saying why.
    """
    for klass in type(model).__mro__:
        if klass in _TRUNK_FAMILIES:
            return _TRUNK_FAMILIES[klass](model)
    from .auto import traced_blocks  # here: auto imports this module

    try:
        return traced_blocks(model)
    except TypeError as e:
        known = ", ".join(sorted(k.__module__ + "." + k.__qualname__ for k in _TRUNK_FAMILIES))
        raise TypeError(f"feature_blocks does not know {type(model).__qualname__} and {e} Supported families: {known}.") from None


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


from . import families  # noqa: E402,F401  registers torchvision's families (it imports this module)
