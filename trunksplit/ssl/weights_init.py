"""``MODEL.WEIGHTS_INIT.PARAMS_FILE`` (vissl's key): a run's trunk starts from the weights in a file.

The file is whatever a user has at hand: a torchvision or timm model's ``state_dict()`` (its
classifier's entries are left out), a vissl checkpoint (the trunk under
``classy_state_dict.base_model.model.trunk``), a trunksplit run's ``checkpoint.pt`` or ``trunk.pt``, a Lightning or
DDP checkpoint (``state_dict.module.``). Its nested keys are read joined by dots, and the trunk's
entries are looked for under every prefix, by the trunk's own names (``res2.0.conv1.weight``), its
model's (``layer1.0.conv1.weight``) or vissl's (``_feature_blocks.layer1.0.conv1.weight``). Nothing is
guessed: where the file holds the trunk under several prefixes (a DINO checkpoint's student and
teacher), ``MODEL.WEIGHTS_INIT.REMOVE_PREFIX`` says which; entries under the prefix for modules the
model does not have (a deeper model's blocks) are refused, not dropped.

    start_from_weights(model, cfg)   # "120 tensors from r18.pt; left out, the model's beyond the trunk: fc.bias, fc.weight"
"""
import os
import warnings
from typing import Dict, Iterable, List, Mapping, Set, Tuple

import torch
from torch import nn

from ..chains.names import VISSL_PREFIX
from .backbones import build_backbone
from .run_dir import TRUNK_WEIGHTS

KEY = "MODEL.WEIGHTS_INIT.PARAMS_FILE"
PREFIX_KEY = "MODEL.WEIGHTS_INIT.REMOVE_PREFIX"
SHOWN = 4  # names shown of a list of entries


def start_from_weights(model: nn.Module, cfg) -> str:
    """Load the trunk's weights from ``cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE`` into ``model.trunk`` (and a
    DINO teacher's trunk, which starts as the student); returns what was loaded, to be said."""
    path, prefix = cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE, cfg.MODEL.WEIGHTS_INIT.REMOVE_PREFIX
    flat = flat_tensors(read_weights(path))
    namings = trunk_namings(model.trunk, _names_model(cfg.MODEL.TRUNK.NAME, cfg.DATA.CROP_SIZES[0]))
    prefix, naming = find_trunk(flat, namings, prefix, path, cfg.MODEL.TRUNK.NAME)
    under = {name[len(prefix):]: t for name, t in flat.items() if name.startswith(prefix)}
    loaded = {name: t for name, t in under.items() if name in naming.names}
    left = sorted(set(under) - naming.names)
    _refuse_other_models(left, prefix, naming, path, cfg.MODEL.TRUNK.NAME)
    try:
        model.trunk.load_state_dict(loaded)
    except RuntimeError as e:  # a size mismatch: another width or kind of model
        detail = next((line.strip().rstrip(".") for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise ValueError(f"{KEY} {path}: its weights do not fit MODEL.TRUNK.NAME {cfg.MODEL.TRUNK.NAME} ({detail}): "
                         "a checkpoint of another model") from None
    if getattr(model, "teacher", None) is not None:  # DINO's teacher starts as the student
        model.teacher.trunk.load_state_dict(model.trunk.state_dict())
    said = f"{len(loaded)} tensors from {path}" + (f" (under {prefix!r})" if prefix else "")
    return said + (f"; left out, the model's beyond the trunk: {_some(left)}" if left else "")


def _names_model(name: str, size: int) -> nn.Module:
    """A model of the trunk's architecture for its module names: on the meta device (no memory, no
    init), or for real where the architecture's init needs data (RegNet's)."""
    try:
        with torch.device("meta"):
            return build_backbone(name, size)
    except (ValueError, RuntimeError, NotImplementedError, TypeError):
        return build_backbone(name, size)


def check_weights_file(path: str) -> None:
    """Refuse, before a run starts, a weights file that is not there (a run's folder: its trunk.pt named)."""
    if not os.path.isfile(path):
        run = os.path.join(path, TRUNK_WEIGHTS)
        hint = f" ({path} is a run's folder: {run} holds its trained trunk)" if os.path.isfile(run) else ""
        raise ValueError(f"{KEY} {path!r} is not a file{hint}: give a file of weights (a model's state_dict, a vissl or trunksplit "
                         "checkpoint), or '' to start from random weights")


def read_weights(path: str):
    """The file's contents, read as weights only (tensors and plain containers: no code runs)."""
    check_weights_file(path)
    try:
        with warnings.catch_warnings():  # torch's remark on a pickle protocol, before the refusal that says more
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not torch.save's, truncated, or holding objects other than tensors and containers
        raise ValueError(f"{KEY} {path}: cannot read it as weights ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         "save the model's weights alone: torch.save(model.state_dict(), path)") from None


def flat_tensors(node, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Every tensor in nested mappings by its dotted path: ``{"state_dict": {"module.fc.weight": t}}``
    gives ``{"state_dict.module.fc.weight": t}``."""
    if isinstance(node, torch.Tensor):
        return {prefix[:-1]: node}
    found = {}
    if isinstance(node, Mapping):
        for key, value in node.items():
            found.update(flat_tensors(value, f"{prefix}{key}."))
    return found


class Naming:
    """One way the trunk's entries may be named in a file: ``names`` all of them, ``required`` those a
    file must hold (a BatchNorm's ``num_batches_tracked`` may be missing: old torchvision files lack it),
    ``modules`` the module paths under the same names (what else a file may hold for the model)."""

    def __init__(self, names: Iterable[str], modules: Iterable[str]):
        self.names = set(names)
        self.required = {n for n in self.names if not n.endswith("num_batches_tracked")}
        self.modules = set(modules)


def trunk_namings(trunk: nn.Module, source: nn.Module) -> List[Naming]:
    """The trunk's own names, its model's (``source``: the model the trunk was built from, or one of its
    architecture) and vissl's for those."""
    own = Naming(trunk.state_dict(), (n for n, _ in trunk.named_modules()))
    model_names = list(trunk.model_state_dict())
    modules = [n for n, _ in source.named_modules()]
    vissl_modules = (VISSL_PREFIX + n if n else VISSL_PREFIX[:-1] for n in modules)
    return [own, Naming(model_names, modules), Naming((VISSL_PREFIX + n for n in model_names), vissl_modules)]


def find_trunk(flat: Mapping[str, torch.Tensor], namings: List[Naming], asked: str, path: str, arch: str) -> Tuple[str, Naming]:
    """The prefix under which ``flat`` holds every entry the trunk requires, with the naming it holds them
    by: ``asked`` where given, else the one place it is (several readings of the same tensors, as vissl's
    ``trunk.`` with ``_feature_blocks.`` names and ``trunk._feature_blocks.`` with the model's, are one)."""
    under: Dict[str, Set[str]] = {}
    for name in flat:
        for i in [0] + [i + 1 for i, c in enumerate(name) if c == "."]:
            under.setdefault(name[:i], set()).add(name[i:])
    complete: Dict[frozenset, Tuple[str, Naming]] = {}
    for prefix in sorted(under, key=len):
        for naming in namings:
            if naming.required <= under[prefix]:
                complete.setdefault(frozenset(prefix + n for n in naming.names & under[prefix]), (prefix, naming))
    places = sorted(complete.values(), key=lambda found: found[0])
    if asked:
        asked = asked if asked.endswith(".") else asked + "."  # a prefix ends where a name does
        chosen = [found for found in places if found[0] == asked]
        if chosen:
            return chosen[0]
        raise ValueError(f"{PREFIX_KEY} {asked!r}: {path} does not hold the trunk's weights under it; " + _where(places, under, namings, arch))
    if len(places) == 1:
        return places[0]
    if not places:
        raise ValueError(f"{KEY} {path}: " + _where(places, under, namings, arch))
    raise ValueError(f"{KEY} {path} holds the trunk's weights under {len(places)} prefixes, {', '.join(repr(p) for p, _ in places)}: "
                     f"set {PREFIX_KEY} to the one to start from (of a DINO run's, the teacher's is the one DINO evaluates)")


def _where(places: List[Tuple[str, Naming]], under: Dict[str, Set[str]], namings: List[Naming], arch: str) -> str:
    """Where the file holds the trunk, or how near it comes to holding it: what is missing under the best prefix."""
    if places:
        return f"it does under {', '.join(repr(p) for p, _ in places)}"
    if not under:
        return "it holds no tensors"
    prefix, naming = max(((p, n) for p in under for n in namings), key=lambda pn: len(pn[1].required & under[pn[0]]))
    missing = sorted(naming.required - under[prefix])
    return (f"it holds no complete set of the trunk's {len(naming.required)} weights under any prefix: the most, "
            f"{len(naming.required) - len(missing)}, under {prefix!r}, lacking {_some(missing)}: is it a checkpoint of {arch}?")


def _refuse_other_models(left: List[str], prefix: str, naming: Naming, path: str, arch: str) -> None:
    """Entries under the trunk's prefix that are not the trunk's (``left``), for modules the model does not have
    (resnet34's ``layer1.2`` in a resnet18 run), mean another model: refused. The model's own modules beyond
    the trunk (its classifier) are not."""
    other = sorted({_first_missing(rest, naming.modules) for rest in left} - {None})
    if other:
        raise ValueError(f"{KEY} {path} holds weights under {prefix!r} of modules {arch} does not have ({_some(other)}): "
                         "a checkpoint of another model; give MODEL.TRUNK.NAME the file's architecture")


def _first_missing(name: str, modules: Set[str]):
    """The outermost module on ``name``'s path that is not among ``modules`` (``layer1.2`` of
    ``layer1.2.conv1.weight`` in a resnet18), or None where its module is there."""
    parts = name.split(".")[:-1]
    return next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in modules), None)


def _some(names: List[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
