"""A trunk's parameter names and its source model's: ``res2.0.conv1.weight`` is ``layer1.0.conv1.weight``.

A trunk holds the model's own modules under feature-block names, so its ``state_dict`` keys
differ from the model's. A checkpoint must cross in both directions: a plain model's into the
trunk (checkpointing turned on mid-project) and the trunk's into the plain model. The names
are matched once, by tensor identity, and kept as strings (no reference to the model).
"""
from collections import OrderedDict
from typing import Dict, Mapping, Optional

from torch import nn


def source_names(holder: nn.Module, model: nn.Module) -> Dict[str, str]:
    """``holder``'s state_dict key -> ``model``'s key of the same tensor, for every tensor both hold."""
    names = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), name)
    tensors = dict(holder.named_parameters(remove_duplicate=False))
    tensors.update(holder.named_buffers(remove_duplicate=False))
    return {k: names[id(t)] for k, t in tensors.items() if id(t) in names}


def to_source_names(state: Mapping, names: Dict[str, str], model: Optional[nn.Module] = None) -> "OrderedDict":
    """``state`` (the holder's) under the model's names. With ``model`` (of the same architecture),
    its own entries fill in what the holder does not hold (a classifier), in its order, so that
    the result loads into it strictly; without, those are left out."""
    out = OrderedDict((names[k], v) for k, v in state.items() if k in names)
    if model is None:
        return out
    theirs = model.state_dict()
    extra = sorted(set(out) - set(theirs))
    if extra:
        raise ValueError(f"the model has no entries {extra[:5]}{' ...' if len(extra) > 5 else ''}: it is not the trunk's architecture")
    return OrderedDict((k, out.get(k, v)) for k, v in theirs.items())


# vissl's ResNe(X)t trunk holds torchvision's modules under this prefix: its checkpoints' trunk weights
# (``ckpt["classy_state_dict"]["base_model"]["model"]["trunk"]``) are torchvision's names behind it
VISSL_PREFIX = "_feature_blocks."


def from_source_names(state_dict: dict, prefix: str, names: Dict[str, str]) -> None:
    """Rename, in place, the entries of ``state_dict`` under ``prefix`` that carry the model's
    names (or vissl's for them: ``_feature_blocks.layer1.0.conv1.weight``) to the holder's: a
    load-state-dict pre-hook's work. A tensor the holder keeps under several names (a module two
    units run: a traced ViT's position embedding, a block called twice) fills each of them. An
    entry already under the holder's name wins (nothing is overwritten); unknown names are left
    for ``load_state_dict`` to report."""
    theirs: Dict[str, list] = {}
    for mine, model in names.items():
        theirs.setdefault(model, []).append(mine)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix):]
        mine = theirs.get(name[len(VISSL_PREFIX):] if name.startswith(VISSL_PREFIX) else name, [])
        filled = [m for m in mine if m != name and prefix + m not in state_dict]
        for m in filled:
            state_dict[prefix + m] = state_dict[key]
        if filled and name not in mine:
            del state_dict[key]
