"""Selective activation checkpointing: wrap the submodules a condition picks (:func:`wrap_selected`,
which ``trunksplit.apply_activation_checkpointing`` calls when no memory budget is given).

One API, as torchtune's RFC asked: a condition is any ``(name, module) -> bool``
callable, or torch's ``check_fn`` shape, ``(module) -> bool``; :class:`by_type`, :class:`by_name`
and :class:`every_k` build the common ones, and :func:`condition_from_config` builds them from a
YAML mapping.
"""
import importlib
import inspect
import re
import warnings
from typing import Callable, List, Mapping, Type

from torch import nn

from ..chains.blocks import layer_splittable_before, stages_run_apart
from .wrapper import checkpoint_wrapper, is_checkpoint_wrapped

Condition = Callable[[str, nn.Module], bool]


class by_type:
    """Select modules that are instances of any of ``types``: ``by_type(Bottleneck)``."""

    def __init__(self, *types: Type[nn.Module]):
        _check_types(types, "by_type")
        self.types = types

    def __call__(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.types)

    def __repr__(self) -> str:
        return f"by_type({', '.join(t.__name__ for t in self.types)})"


class by_name:
    """Select modules whose full name (as in ``named_modules()``) matches ``pattern`` entirely:
    ``by_name(r"layer[34]\\.\\d+")``."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise TypeError(f"by_name needs a regular expression string, got {pattern!r}")
        try:
            self.regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"by_name: {pattern!r} is not a valid regular expression ({e})") from None

    def __call__(self, name: str, module: nn.Module) -> bool:
        return self.regex.fullmatch(name) is not None

    def __repr__(self) -> str:
        return f"by_name({self.regex.pattern!r})"


class every_k:
    """Select the 0th, k-th, 2k-th ... module of the given types, in ``named_modules()`` order.

    The count starts afresh in every :func:`wrap_selected` call,
    so applying the same condition to two models selects the same layers in each.
    With no types, every module counts.
    """

    def __init__(self, k: int, *types: Type[nn.Module]):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"every_k needs a whole number k >= 1, got {k!r}")
        if types:
            _check_types(types, "every_k")
        self.k, self.types, self.seen = k, types, 0

    def reset(self) -> None:
        self.seen = 0

    def __call__(self, name: str, module: nn.Module) -> bool:
        if self.types and not isinstance(module, self.types):
            return False
        self.seen += 1
        return (self.seen - 1) % self.k == 0

    def __repr__(self) -> str:
        return f"every_k({self.k}, {', '.join(t.__name__ for t in self.types)})"


def as_condition(condition) -> Condition:
    """``condition`` as a ``(name, module) -> bool`` callable: torch's ``check_fn(module)`` (one
    parameter, as ``torch.distributed.algorithms._checkpoint`` takes it) is called with the module,
    and module classes (``Bottleneck``, or a tuple or set of them, as FSDP's ``ModuleWrapPolicy``
    takes them) select their instances: :class:`by_type`. Sharp edge, handled: a class is callable,
    and called with ``(name, module)`` it would be constructed from them."""
    classes = tuple(condition) if isinstance(condition, (tuple, list, set, frozenset)) else (condition,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes) and classes:
        return by_type(*classes)
    if isinstance(condition, nn.Module):  # callable, as every module is: it would be run on (name, module)
        raise TypeError(f"condition must be a (name, module) -> bool callable or module classes, got a {type(condition).__name__} module: "
                        f"to select it, pass by_name('<its name in named_modules()>') or by_type({type(condition).__name__})")
    if isinstance(condition, str):
        raise TypeError(f"condition must be a (name, module) -> bool callable or module classes, got the string {condition!r}: "
                        f"to select by name, pass by_name({condition!r})")
    if not callable(condition):
        raise TypeError(f"condition must be a (name, module) -> bool callable or module classes (by_type), got {condition!r}")
    try:
        parameters = [p for p in inspect.signature(condition).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # a builtin without a signature: taken as (name, module)
        return condition
    return _ModuleOnly(condition) if len(parameters) == 1 else condition


class _ModuleOnly:
    def __init__(self, check_fn):
        self.check_fn = check_fn

    def __call__(self, name: str, module: nn.Module) -> bool:
        return self.check_fn(module)

    def __repr__(self) -> str:
        return repr(self.check_fn)


def _check_types(types, who):
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"{who} needs one or more nn.Module classes, got {types!r}")


def wrap_selected(model: nn.Module, condition: Condition, offload_to_cpu: bool = False) -> List[str]:
    """Wrap, in place, every submodule of ``model`` that ``condition(name, module)`` selects.

    Returns the selected names in ``named_modules()`` order. The root is never
    wrapped; a module inside a selected or already wrapped one is left alone,
    since its parent's checkpoint already covers it; so is a container that is never
    called (no forward of its own: ``ModuleList``, ``ModuleDict``, the bare modules
    fx builds along a traced unit's paths), since checkpointing it would do nothing.
    The condition sees every other submodule, in order, wrapped ones included, so
    counting conditions count all matches and applying the same condition again
    selects the same modules (wrapping twice changes nothing).

    A module whose first operation is in-place (``ReLU(inplace=True)``, or a
    ``Sequential`` starting with one) cannot be checkpointed: it would overwrite
    the input the recompute needs. Nor can a stage of a ``CheckpointedTrunk`` in
    ``model`` (``res4``): the trunk runs its blocks one by one, never the stage's
    forward, so a wrapper on it would never run; its blocks stay candidates. Such
    matches are skipped with a warning that names them. Raises ``ValueError`` when
    nothing can be wrapped, naming the module types present; the model is then unchanged.
    """
    condition = as_condition(condition)
    if hasattr(condition, "reset"):
        condition.reset()
    selected, in_place, apart, covered = [], [], [], []
    stages = stages_run_apart(model)
    for name, module in model.named_modules():
        if not name or any(name.startswith(c + ".") for c in covered) or type(module).forward is nn.Module.forward:
            continue
        if condition(name, module):
            if name in stages:
                apart.append(name)  # its blocks stay candidates
            elif layer_splittable_before(module):
                selected.append((name, module))
                covered.append(name)
            else:
                in_place.append(name)
        elif is_checkpoint_wrapped(module):
            covered.append(name)
    _say_skipped(in_place, "whose first operation is in-place", "a checkpoint would overwrite its own input",
                 "Select the blocks that contain them instead (by_type of the block class)", bool(selected))
    _say_skipped(apart, "that a trunk runs block by block", "the trunk never calls a stage itself, so a wrapper on one would never run",
                 f"Select their blocks instead (by_name(r'{re.escape(apart[0]) if apart else ''}\\.\\d+'), SELECT.name_regex, or by_type of the block class)", bool(selected))
    if not selected:
        present = sorted({type(m).__name__ for n, m in model.named_modules() if n})
        traced = "" if "ChainUnit" not in present else (  # the model's own block classes were traced through
            ". A traced trunk runs its model's blocks as ChainUnits, each named after the outermost module whose last call it "
            "holds (stages_0_blocks_0; a stage's last block ends its stage: stages_0; the model's last: output): select those by "
            "name (by_name, SELECT.name_regex), or give the trunk a memory budget")
        named = "" if not stages else (". A trunk's modules are named by its feature blocks (a ResNet's res4.0 is torchvision's layer3.0): "
                                       "by_name and SELECT.name_regex match those")
        raise ValueError(f"the condition {condition!r} selected no submodule to checkpoint; module types present: {present}{traced}{named}")
    for _, module in selected:
        checkpoint_wrapper(module, offload_to_cpu=offload_to_cpu)
    return [name for name, _ in selected]


def _say_skipped(names: List[str], which: str, why: str, instead: str, others_selected: bool) -> None:
    """Matches that cannot be checkpointed: a warning naming them, or, with nothing else selected, ``ValueError``."""
    if not names:
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    message = f"not checkpointing {len(names)} selected module(s) {which} ({shown}): {why}"
    if not others_selected:
        raise ValueError(f"{message}; nothing else was selected. {instead}")
    warnings.warn(f"{message}. {instead}", UserWarning, stacklevel=3)


def _import_class(path: str) -> type:
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import module class {path!r}: {e}") from None


def condition_from_config(select: Mapping) -> Condition:
    """A condition from a config mapping, so a recipe can change the selection without code.

    Keys: ``types`` (dotted class paths), ``every_k`` (int, counts matches of
    ``types``), ``name_regex``. Given together, all must hold. Example YAML::

        MODEL.ACTIVATION_CHECKPOINTING.SELECT:
          every_k: 2
          types: [torchvision.models.resnet.Bottleneck]
    """
    unknown = set(select) - {"types", "every_k", "name_regex"}
    if unknown:
        raise ValueError(f"unknown selection key(s) {sorted(unknown)}; use types, every_k, name_regex")
    paths = select.get("types", ())
    if isinstance(paths, str):  # one class written without brackets
        paths = [paths]
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"SELECT.types must be a list of dotted class paths (torchvision.models.resnet.Bottleneck), got {paths!r}")
    types = tuple(_import_class(p) for p in paths)
    for path, t in zip(paths, types):
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise ValueError(f"SELECT.types: {path!r} is not an nn.Module class")
    parts = []
    if "name_regex" in select:
        if not isinstance(select["name_regex"], str) or not select["name_regex"]:
            raise ValueError(f"SELECT.name_regex must be a non-empty regular expression, got {select['name_regex']!r}")
        parts.append(by_name(select["name_regex"]))
    if "every_k" in select:
        k = select["every_k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SELECT.every_k must be an integer >= 1, got {k!r}")
        parts.append(every_k(k, *types))
    elif types:
        parts.append(by_type(*types))
    if not parts:
        raise ValueError("an empty selection: give types, every_k or name_regex")
    return _All(parts)


class _All:
    def __init__(self, parts):
        self.parts = parts

    def reset(self):
        for p in self.parts:
            if hasattr(p, "reset"):
                p.reset()

    def __call__(self, name, module):
        # every part sees every module, so a counting part counts all its matches
        return all([p(name, module) for p in self.parts])

    def __repr__(self):
        return " and ".join(map(repr, self.parts))
