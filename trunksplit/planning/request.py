"""What the planner is asked: a :class:`PlanRequest`, built by the trunk, read by planning.

Planning is a function of a request and an example input (:func:`trunksplit.planning.search.plan_trunk`):
the request carries everything of the trunk that a plan depends on, so the planner never
reaches back into the trunk that asked.
"""
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..chains.blocks import layer_splittable_before
from .budget import MemoryBudget
from .choices import GRADIENT_MODES, OBJECTIVES, STRATEGIES

# in_backward: until an optimizer_in_backward measures its own, a parameter's update is taken to
# allocate two tensors of its size (AdamW's for-loop form: the most of SGD, LARS and AdamW)
UPDATE_TEMPORARIES = 2.0
# where trunksplit.optimizer_in_backward marks each parameter it takes over (an InBackwardMark)
IN_BACKWARD_ATTR = "_trunksplit_stepped_in_backward"


class InBackwardMark:
    """What ``optimizer_in_backward`` leaves on each parameter it takes over: its stand-in, which
    the parameter's hooks call (``stand_in``), and how many tensors of the parameter's size one
    update allocates (``update_temporaries``: a trunk handed over as its parameters plans for it too,
    see :func:`planned_temporaries`).

    Why on the parameter: the stand-in holds the parameter (through its optimizer), and a hook
    holding the stand-in would close that cycle on autograd's C++ side, where Python's garbage
    collector cannot see it (every model ever stepped in backward stayed alive); held in the
    parameter's ``__dict__``, the cycle is one gc frees. Pickled with a whole model
    (``torch.save(model)``) it becomes None: hooks are not pickled, and a loaded model is not
    stepped in backward."""

    __slots__ = ("stand_in",)

    def __init__(self, stand_in):
        self.stand_in = stand_in

    @property
    def update_temporaries(self) -> float:
        return self.stand_in.update_temporaries

    @property
    def holding(self) -> bool:
        return self.stand_in.holding

    def __reduce__(self):
        return type(None), ()


def in_backward_mark(p: torch.Tensor) -> Optional[InBackwardMark]:
    """``p``'s :class:`InBackwardMark`, or None where no optimizer steps it in backward."""
    return getattr(p, IN_BACKWARD_ATTR, None)


def priced_in(objective: str, device: torch.device) -> str:
    """What a plan for ``device`` prices its recompute in: ``objective``, where ``"auto"`` is
    ``"time"`` on an accelerator and ``"flops"`` on a CPU.

    Why: a GPU runs a small op about as fast as it launches it, so the cheap ops a selective
    region runs again (norms, activations) and torch's per-op selective-checkpoint dispatch cost
    time that FLOPs do not see (docs/gpu.md measures both objectives' plans on an H100). On a CPU,
    FLOPs track time well enough, and keep plans the same from run to run and machine to machine."""
    if objective != "auto":
        return objective
    return "flops" if torch.device(device).type == "cpu" else "time"


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One trunk's planning question, frozen.

    ``units``: the chain's ``(name, module)`` pairs in execution order (the modules are the
    trunk's own: profiling runs copies of them). ``feature_stops``: each requested feature and
    the unit index just past it, in chain order. ``strategy``: ``"vissl"`` or ``"balanced"``;
    a ``budget`` wins over it (least recompute that fits). ``num_splits``: the segment count
    (an upper bound under a budget). ``gradients``, ``objective``, ``use_reentrant``: as
    :class:`trunksplit.CheckpointedTrunk` takes them. ``compiled``: the trunk runs its units
    compiled. ``world_size``: plan one of that many FSDP2 ranks (1: unsharded).
    ``update_temporaries``: with ``gradients="in_backward"``, how many tensors of a parameter's
    size the optimizer's update of one parameter allocates (:func:`trunksplit.in_backward.update_temporaries`).

    Every field is given by keyword, none has a default: a field forgotten where a request is made
    is an error there, not a default that only some runs (FSDP2's, compiled ones) would notice.

    Sharp edge: it holds the modules, so it is not a cache key; :func:`trunksplit.trunk.plan_key`
    is (what the plan depends on besides the request: the input's shapes, device, autocast).
    """

    units: Tuple[Tuple[str, nn.Module], ...]
    feature_stops: Tuple[Tuple[str, int], ...]
    num_splits: Optional[int]
    strategy: str
    budget: Optional[MemoryBudget]
    gradients: str
    objective: str
    use_reentrant: bool
    compiled: bool
    world_size: int
    update_temporaries: float

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {STRATEGIES}")
        if self.num_splits is not None and (isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"num_splits must be an integer >= 1 or None, got {self.num_splits!r}")
        if self.gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES} (how zero_grad leaves them, or the optimizer stepped in backward), got {self.gradients!r}")
        if not isinstance(self.use_reentrant, bool):  # "no" or "False" from a string would read as True
            raise ValueError(f"use_reentrant is True or False, got {self.use_reentrant!r}")
        if self.use_reentrant and self.gradients == "in_backward":  # each reentrant segment's backward is its own: a gradient arrives in parts
            raise ValueError("use_reentrant=True cannot step an optimizer in backward exactly: a parameter used by several segments or "
                             "trunk calls gets its gradient in parts, and would be updated on each; use use_reentrant=False")
        if isinstance(self.update_temporaries, bool) or not isinstance(self.update_temporaries, (int, float)) or not 0 <= self.update_temporaries < float("inf"):
            raise ValueError(f"update_temporaries is a number >= 0 (tensors of a parameter's size its update allocates), got {self.update_temporaries!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.budget is not None and not isinstance(self.budget, MemoryBudget):
            raise TypeError(f"a PlanRequest's budget is a MemoryBudget (MemoryBudget.parse(value)), got {self.budget!r}")

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(n for n, _ in self.units)

    @property
    def modules(self) -> Tuple[nn.Module, ...]:
        return tuple(m for _, m in self.units)

    @property
    def splittable(self) -> Tuple[bool, ...]:
        """Where a segment may start: False before a unit whose first op is in-place."""
        return tuple(layer_splittable_before(m) for _, m in self.units)

    @property
    def stops(self) -> Dict[str, int]:
        """``feature_stops`` as an ordered dict."""
        return dict(self.feature_stops)

    @property
    def forced(self) -> Tuple[int, ...]:
        """The cuts a plan must make: after every requested feature but the last unit."""
        return tuple(stop for _, stop in self.feature_stops if stop < len(self.units))

    @property
    def feature_units(self) -> Tuple[int, ...]:
        """The unit whose output each requested feature is."""
        return tuple(stop - 1 for _, stop in self.feature_stops)

    @property
    def cost_aware(self) -> bool:
        """Planned from measured costs (balanced, or a budget), not by module count as vissl did."""
        return self.strategy != "vissl" or self.budget is not None


def planned_temporaries(params: Iterable[torch.Tensor], default: float) -> float:
    """Tensors of a parameter's size that the update of ``params`` allocates in backward: the most
    that an optimizer stepping them there measured (``optimizer_in_backward`` marks each parameter
    it takes over), else ``default``."""
    marked = [mark.update_temporaries for mark in map(in_backward_mark, params) if mark is not None]
    return max(marked) if marked else default


def updates_held(params: Iterable[torch.Tensor]) -> bool:
    """Whether an optimizer stepping ``params`` in backward holds their updates now (its
    ``accumulating()``, :func:`trunksplit.in_backward.holding_updates`): a backward then keeps every
    gradient it makes, as in torch's default mode (``"allocated"``), instead of freeing each."""
    return any(mark.holding for mark in map(in_backward_mark, params) if mark is not None)


def plan_key(shapes: Sequence[Tuple[Tuple[int, ...], torch.dtype]], device: torch.device, held: bool = False,
             frozen: Sequence[int] = (), input_grad: bool = False) -> Tuple:
    """The key of a cost-aware plan for inputs of these (shape, dtype) on ``device``, in the
    current autocast state, ``held``: for a call whose updates in backward are held (see
    :func:`updates_held`); ``frozen``: of a trunk whose parameters at these positions do not train
    (:func:`frozen_parameters`; a frozen stem saves nothing and has no gradients, so its plan is not
    the plan once it trains); ``input_grad``: the input requires grad (then every unit passes a gradient
    on, frozen or not). What ``CheckpointedTrunk.plan_for`` caches a plan under. It needs no
    tensor, so a plan for a batch too big to allocate can be stored (``fit``)."""
    device = torch.device(device).type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return (tuple((tuple(s), d) for s, d in shapes), device, autocast, bool(held), tuple(frozen), bool(input_grad))


def frozen_parameters(parameters: Iterable[torch.Tensor]) -> Tuple[int, ...]:
    """The positions of the parameters that do not require grad, in ``parameters``' order: part of a plan's key."""
    return tuple(i for i, p in enumerate(parameters) if not p.requires_grad)


MANY_PLANS = 16  # plans one trunk makes before it says that each new input shape is measured again


def warn_of_many_plans(count: int) -> None:
    """Said once, as a trunk makes its :data:`MANY_PLANS`-th plan: each new :func:`plan_key` (a shape, a
    batch, a dtype) profiles the trunk before its step, which inputs of ever new sizes (detection,
    multi-scale training, a last batch of each size) pay again and again, silently."""
    if count == MANY_PLANS:
        # stacklevel: the user's trunk(x), past plan_for, torch.compiler.disable's wrapper, forward and nn.Module's two call frames
        warnings.warn(f"this trunk has planned for {count} inputs of different shapes (trunk.plans): each new one is measured before "
                      "its step, a profile of every unit. Inputs of many sizes plan once with strategy='vissl' (no measurement), "
                      "or once per size when padded or resized to a few sizes", UserWarning, stacklevel=7)
