"""What a trunk is: a model as ordered, named feature blocks.

:func:`feature_blocks` dispatches on the model's class: a registered family
(every torchvision classification family is registered, see ``families.py``;
:func:`register_trunk` adds others), else a chain traced with ``torch.fx``
(``traced.py``). The values are the model's own module objects, so training the
blocks trains the model.
"""
from collections import OrderedDict
from typing import Callable, Dict, Type

from torch import nn

from .blocks import FeatureBlocks, child_name, expand_units, feature_ends, layer_splittable_before, stage_names, stages_run_apart, warn_of_hooks_bypassed
from .families import TORCHVISION_FAMILIES
from .hugging_face import hf_family
from .traced import traced_blocks

_TRUNK_FAMILIES: Dict[type, Callable[[nn.Module], "OrderedDict[str, nn.Module]"]] = dict(TORCHVISION_FAMILIES)


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
    Every other torchvision classification family: see ``trunksplit/chains/families.py``
    (hierarchical ones name their stride-4..32 stages ``res2``..``res5``; ViT has
    ``embed, encoder, norm, flatten``). The classifier head is left out; the last
    key is always ``flatten``, the pooled ``[B, C]`` vector the classifier starts
    from. Values are the model's own modules, or small adapters holding them.

    transformers' ViT, DeiT, DINOv2, ConvNeXt and ResNet (and kin, and their image classifiers):
    the same names (``trunksplit/chains/hugging_face.py``).

    Any other model is traced with ``torch.fx`` and cut where one tensor carries
    all the state (``trunksplit/chains/traced.py``); its last key is ``output``, the model's
    own output. A model that cannot be traced raises ``TypeError`` saying why.
    """
    if not isinstance(model, nn.Module):
        hint = f": build it first, e.g. torchvision.models.get_model({model!r})" if isinstance(model, str) else ""
        raise TypeError(f"feature_blocks takes a model (an nn.Module), got {type(model).__name__} {model!r:.60}{hint}")
    for klass in type(model).__mro__:
        if klass in _TRUNK_FAMILIES:
            return _TRUNK_FAMILIES[klass](model)
    family = hf_family(model)
    if family is not None:
        return family(model)
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(f"{type(model).__name__} wraps the model: give the model it holds (.module); to train the trunk "
                        f"data-parallel, build it first and wrap the trunk: {type(model).__name__}(CheckpointedTrunk(model, ...))")
    # private: torch.compile's wrapper (OptimizedModule) holds the model as _orig_mod, with no public accessor
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise TypeError("a torch.compile'd model: give the model before compiling (model._orig_mod), then compile the trunk: "
                        "CheckpointedTrunk(model, ...).compile() compiles each unit and keeps the plan, or torch.compile(trunk)")
    try:
        return traced_blocks(model)
    except TypeError as e:
        known = ", ".join(sorted(k.__module__ + "." + k.__qualname__ for k in _TRUNK_FAMILIES))
        raise TypeError(f"feature_blocks does not know {type(model).__qualname__} and {e} Supported families: {known}.") from None


__all__ = ["FeatureBlocks", "child_name", "expand_units", "feature_blocks", "feature_ends", "layer_splittable_before", "register_trunk", "stage_names", "traced_blocks", "warn_of_hooks_bypassed"]
