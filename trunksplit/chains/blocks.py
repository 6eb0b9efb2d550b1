"""Feature blocks and the chain of units they make.

vissl's trunks expose their layers as ``feature_blocks``: an ordered dict whose
``res2``..``res5`` entries are stages that the splitter expands into their
residual blocks. :class:`FeatureBlocks` says which blocks are stages;
:func:`expand_units` turns the blocks into the chain of units a plan cuts, and
:func:`layer_splittable_before` says where a cut may fall.
"""
import difflib
import re
import warnings
from collections import OrderedDict
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
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



def stages_run_apart(model: nn.Module) -> frozenset:
    """The names, as ``model.named_modules()`` gives them, of stages whose blocks a trunk inside ``model``
    (a module with :class:`FeatureBlocks` as ``feature_blocks``: a ``CheckpointedTrunk``) runs one by
    one, never through the stage's own forward: a wrapper on one of them would never run."""
    found = set()
    for prefix, module in model.named_modules():
        blocks = getattr(module, "feature_blocks", None)
        if isinstance(blocks, FeatureBlocks):
            found.update(f"{prefix}.{child_name(s)}".lstrip(".") for s in blocks.stages)
    return frozenset(found)


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


def small_view_copied(selected: torch.Tensor, source) -> torch.Tensor:
    """``selected``, copied where it is at most half the tensor ``source`` it was selected from. A unit that
    returns a view keeps its source's whole storage alive wherever its output is held: a ViT's class token
    (``x[:, 0]``, as torchvision's and timm's models take it) held as a head's input through backward kept the
    token map (197 tokens of ViT-B at 224px for one). The copy frees the source after the forward where nothing
    saves it, and costs no more than it frees; a larger selection (the patch tokens, ``x[:, 1:]``) stays a view.
    Values and gradients are the view's. Registered units call it (ViT's ``flatten``); a traced unit that ends
    with a selection is routed through it (:mod:`trunksplit.chains.traced`)."""
    if isinstance(source, torch.Tensor) and 2 * selected.numel() <= source.numel():
        return selected.clone(memory_format=torch.contiguous_format)
    return selected


def expand_units(blocks: Mapping[str, nn.Module]) -> List[Tuple[str, nn.Module]]:
    """The chain of units: each block, with the stages expanded into their children."""
    units, stages = [], stage_names(blocks)
    for name, block in blocks.items():
        if name in stages:
            if not isinstance(block, Iterable):
                raise TypeError(f"feature block {name!r} is a stage so it must be an iterable of blocks, got {type(block).__name__}")
            child_names = {id(m): n for n, m in block.named_children()} if isinstance(block, nn.Module) else {}
            for i, child in enumerate(block):
                units.append((f"{name}.{child_names.get(id(child), i)}", child))
        else:
            units.append((name, block))
    return units


def child_name(key: str) -> str:
    """A block's or unit's name as a child module's: traced blocks are named ``layer3.1``, and module names cannot hold dots."""
    return key.replace(".", "_")


# where nn.Module keeps the hooks its __call__ runs (forward, backward, with kwargs): see hook_dicts
HOOK_DICT_NAMES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def hook_dicts(module: nn.Module) -> List[dict]:
    """The dicts that hold ``module``'s own hooks.

    torch has no public call that says whether a module has hooks, or that removes them
    without their handles: these are the dicts ``register_forward_hook`` and friends fill
    (private attributes of ``nn.Module``), named here and nowhere else."""
    return [hooks for hooks in (getattr(module, name, None) for name in HOOK_DICT_NAMES) if hooks is not None]


def warn_of_hooks_bypassed(model: Optional[nn.Module], units: Sequence[nn.Module]) -> None:
    """Warn (``UserWarning``) of hooks on modules of ``model`` that hold some of ``units`` but are never called when the
    units run one by one: the model itself, a stage whose blocks are units, a container a traced unit ran through.
    ``model`` None (a trunk given its blocks): nothing to check.

    Why: a forward hook on ``model.layer2`` (a feature capture, timm's ``FeatureHooks``) silently never fires in a
    trunk, which runs ``layer2``'s blocks itself and never ``layer2.forward``. Hooks on the units and inside them fire."""
    if model is None:
        return
    run = {id(m) for unit in units for m in unit.modules()}
    bypassed = [name or f"the model itself ({type(m).__name__})" for name, m in model.named_modules()
                if id(m) not in run and any(hook_dicts(m)) and any(id(sub) in run for sub in m.modules())]
    if bypassed:
        warnings.warn(f"hooks on {', '.join(bypassed)} will not fire: the trunk runs the blocks inside them itself (a stage's blocks one "
                      "by one, a traced model's units), never calling their forward. Register them on the blocks it runs (trunk.units), "
                      "or ask for a stage's output as a feature (out_feat_keys)", UserWarning, stacklevel=3)


def feature_ends(blocks: Mapping[str, nn.Module], keys: Sequence[str]) -> "OrderedDict[str, int]":
    """For each requested feature in chain order: the unit index just past it."""
    _check_keys(blocks, keys)
    ends, n, stages = OrderedDict(), 0, stage_names(blocks)
    for name, block in blocks.items():
        n += len(block) if name in stages else 1
        if name in keys:
            ends[name] = n
    return ends


def _check_keys(blocks: Mapping[str, nn.Module], keys: Sequence[str]) -> None:
    if isinstance(keys, str):
        raise TypeError(f"feature keys must be a list of names, got the string {keys!r}")
    if len(keys) == 0:
        raise ValueError(f"no output feature requested; known keys: {list(blocks)}")
    unknown = [k for k in keys if k not in blocks]
    if unknown:
        hints = [h for h in (_did_you_mean(k, list(blocks)) for k in unknown) if h]
        raise ValueError(f"unknown feature key(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                         + f"; known keys: {list(blocks)}")


# vissl's ResNet feature names (its trunk's feat_eval_mapping) that are not block names here; its "conv1", the
# stem after its ReLU, is the block conv1_relu here, where conv1 is the convolution's own output
VISSL_FEATURE_NAMES = {"res1": "maxpool", "res5avg": "avgpool"}


def _did_you_mean(key: str, known: List[str]) -> Optional[str]:
    """The known key ``key`` most likely meant: torchvision's ``layer1..4`` are vissl's ``res2..5``, and
    the other way round where a trunk names its stages as its model does (timm's, traced; a dict of blocks)."""
    if VISSL_FEATURE_NAMES.get(key) in known:
        return f"{VISSL_FEATURE_NAMES[key]} for {key} (vissl's name of that block's output)"
    layer = re.fullmatch(r"layer(\d)", key)
    if layer and f"res{int(layer[1]) + 1}" in known:
        return f"res{int(layer[1]) + 1} for {key}"
    res = re.fullmatch(r"res(\d)", key)
    if res and f"layer{int(res[1]) - 1}" in known:
        return f"layer{int(res[1]) - 1} for {key}"
    close = difflib.get_close_matches(key.lower(), known, n=1)
    return f"{close[0]} for {key}" if close else None
