"""The optimizer stepped in backward: each parameter updated as soon as its gradient is whole,
then its gradient freed, so the gradients of a model are never all alive at once.

In torch's default gradient mode every parameter's gradient is alive at the end of backward;
for a small batch on a big model that is a large share of the step (docs/planning.md). torch
documents the way out (``Tensor.register_post_accumulate_grad_hook``); this module packages it
as a stand-in for the optimizer, and under DDP runs the update after the gradient's all-reduce.
Plan the trunk for it with ``gradients="in_backward"``.
"""
import contextlib
import inspect
import threading
import warnings
from typing import Callable, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .planning.memory import PeakMemory, is_measuring_alone, measuring_alone
from .planning.request import IN_BACKWARD_ATTR, UPDATE_TEMPORARIES, InBackwardMark, in_backward_mark
from .trunk import CheckpointedTrunk

Params = Union[nn.Module, Iterable[torch.Tensor], Iterable[dict]]


def optimizer_in_backward(model: Params, optimizer_class: Callable[..., torch.optim.Optimizer], *, param_groups: Optional[Iterable[dict]] = None,
                          **optimizer_kwargs) -> "InBackwardOptimizer":
    """Step ``optimizer_class(params, **optimizer_kwargs)`` inside backward, one parameter at a
    time, and return what stands in for it in the training loop.

    ``model``: a module (its parameters that require a gradient, or ``param_groups`` of them), or
    what an optimizer takes (parameters, or parameter groups). A ``CheckpointedTrunk`` inside the
    module must plan for it (``gradients="in_backward"``); it is told what one update of this
    optimizer allocates (:func:`update_temporaries`). A ``DistributedDataParallel`` model is updated after each
    bucket's all-reduce (a DDP communication hook; build it with ``gradient_as_bucket_view=True``
    so that DDP keeps no second copy of the gradients), an FSDP2 model (``fully_shard``) on the
    sharded parameter after its reduce-scatter (FSDP2 calls the hooks there).

    Exact: each parameter's update is the optimizer's own ``step()`` restricted to that
    parameter, with its group's hyperparameters and its own state, so with the same ``foreach``
    setting the parameters equal a standard ``step()`` after backward bit for bit (the foreach
    and the for-loop forms of an optimizer differ from each other by rounding, in the standard
    step too). That holds for optimizers that step each parameter on its own (torch's, LARS);
    one that keeps state per group or reads every parameter at once (timm's Lamb, Adan) is
    probed when it is given and named in a ``UserWarning``: step it after backward. Under DDP
    the gradients are averaged across ranks before the update, as DDP does.

    Sharp edges: every backward is an optimizer step (to accumulate gradients over several
    backwards, run all but the last in ``stand_in.accumulating()``: the gradients then stay
    alive until the last); gradients cannot be clipped by their global norm (a gradient is gone
    before the last one exists), nor unscaled by an fp16 ``GradScaler``; per-parameter transforms run on the whole
    gradient inside the update. An optimizer that needs a closure (LBFGS) is refused. Under DDP
    the all-reduce of a bucket finishes before backward goes on (no overlap). A model wrapped in
    DDP *after* this call would be updated before the all-reduce: wrap first.

    Example::

        trunk = CheckpointedTrunk(resnet50(), ["flatten"], memory_budget=0.3, gradients="in_backward")
        optimizer = optimizer_in_backward(trunk, torch.optim.AdamW, lr=1e-3)
        for x in batches:
            loss_fn(trunk(x)).backward()  # the parameters are updated here
            optimizer.step()  # nothing left to do
            optimizer.zero_grad()
    """
    if not callable(optimizer_class):
        raise TypeError(f"optimizer_class is what builds the optimizer from the parameters (torch.optim.AdamW, or a function), got {optimizer_class!r}")
    if _needs_closure(optimizer_class):
        raise ValueError(f"{getattr(optimizer_class, '__name__', optimizer_class)} steps with a closure that runs forward and backward "
                         "again; stepped in backward there is none to give: use it after backward, as usual")
    module = model.module if isinstance(model, DistributedDataParallel) else model
    trunks = [m for m in module.modules() if isinstance(m, CheckpointedTrunk)] if isinstance(module, nn.Module) else []
    for trunk in trunks:
        if trunk.gradients != "in_backward":
            raise ValueError(f"this model's CheckpointedTrunk plans for gradients={trunk.gradients!r}; an optimizer stepped in backward "
                             "frees each gradient at its update: build the trunk with gradients=\"in_backward\"")
    params = model if not isinstance(module, nn.Module) else _trainable(module) if param_groups is None else param_groups
    _warn_unless_per_parameter(optimizer_class, optimizer_kwargs)
    stand_in = InBackwardOptimizer(optimizer_class(params, **optimizer_kwargs))
    # what one update allocates, marked on each parameter taken over (_take_over): a trunk plans for it however it was handed over
    stand_in.update_temporaries = update_temporaries(optimizer_class, optimizer_kwargs, next((p.device for p in stand_in._groups), torch.device("cpu")))
    for trunk in trunks:
        trunk.update_temporaries = stand_in.update_temporaries  # and its plans made before are made again
    if isinstance(model, DistributedDataParallel):
        if model.find_unused_parameters:  # a parameter no rank used keeps no gradient, as DDP leaves it: mark the local uses
            stand_in._used = set()
            stand_in._handles = [p.register_post_accumulate_grad_hook(_mark_used) for p in _take_over(stand_in)]
        model.register_comm_hook(dist.group.WORLD if model.process_group is None else model.process_group, stand_in._ddp_hook)
        stand_in._reduced_first = True
        return stand_in
    stand_in._handles = [p.register_post_accumulate_grad_hook(_update) for p in _take_over(stand_in)]
    return stand_in


def _update(p: torch.Tensor) -> None:
    """A parameter's hook: its stand-in's update, the stand-in found on the parameter (see InBackwardMark: a hook holding it leaked)."""
    in_backward_mark(p).stand_in.update(p)


def _mark_used(p: torch.Tensor) -> None:
    in_backward_mark(p).stand_in._used.add(p)


def _warn_unless_per_parameter(optimizer_class, optimizer_kwargs: dict) -> None:
    """Warn, naming it, where ``optimizer_class`` stepped one parameter at a time is not its standard
    step: an optimizer that keeps state per group (a step counter) or reads every parameter at
    once (a global norm: timm's Lamb, Adan) cannot be exact in backward. Probed on two small
    matrices, two steps each way; torch's own optimizers and LARS pass."""
    def probe():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(8, 8, generator=g).requires_grad_() for _ in range(2)]

    standard, stepped = probe(), probe()
    try:
        together, alone = optimizer_class(standard, **optimizer_kwargs), InBackwardOptimizer(optimizer_class(stepped, **optimizer_kwargs))
        for scale in (1.0, 100.0):  # gradients of two sizes, so that a norm over both parameters shows
            for i, (a, b) in enumerate(zip(standard, stepped)):
                a.grad, b.grad = torch.full_like(a, scale * (i + 1)), torch.full_like(b, scale * (i + 1))
            together.step()
            with measuring_alone():  # a probe on scratch tensors: nothing to reduce
                for b in stepped:
                    alone.update(b)
    except Exception:  # noqa: BLE001 - an optimizer that cannot be probed on CPU matrices: the real step will say
        return
    if not all(torch.equal(a, b) for a, b in zip(standard, stepped)):
        warnings.warn(f"{getattr(optimizer_class, '__name__', optimizer_class)} does not step each parameter on its own (state kept per "
                      "group, or a norm over all parameters): stepped in backward, one parameter at a time, it is not its standard step "
                      "(two probe steps differed); step it after backward", UserWarning, stacklevel=3)


@contextlib.contextmanager
def holding_updates(model: Union[nn.Module, Iterable[torch.Tensor]]):
    """Backwards in this context add to the gradients of ``model``'s parameters and update none of
    them, whichever stand-ins step them in backward (each one's :meth:`InBackwardOptimizer.accumulating`);
    the next backward outside it updates each from the whole sum. For code that holds the model and
    not its optimizer (a step backward by crop group, a measured step). Parameters no optimizer
    steps in backward: nothing changes.

    Example::

        with holding_updates(model):
            loss_of(model(first_half)).backward()  # gradients kept, nothing updated
        loss_of(model(second_half)).backward()  # each parameter updated from both halves
    """
    marks = (in_backward_mark(p) for p in (model.parameters() if isinstance(model, nn.Module) else model))
    stand_ins = {id(m.stand_in): m.stand_in for m in marks if m is not None}
    with contextlib.ExitStack() as stack:
        for stand_in in stand_ins.values():
            stack.enter_context(stand_in.accumulating())
        yield


def _refuse_unreduced(p: torch.Tensor) -> None:
    """Among several ranks, a plain (unsharded) parameter's update from its own rank's gradient runs
    before any reduction: a model wrapped in DDP after ``optimizer_in_backward`` (its replicas drift
    apart). FSDP2's parameters are DTensors, updated after their reduce-scatter."""
    if is_measuring_alone():  # a measured step of a private copy of the model, say: this rank's own on purpose
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not isinstance(p, DTensor):
        raise RuntimeError("optimizer_in_backward: this parameter would be updated from this rank's own gradient, before any reduction "
                           "across the ranks (the model was wrapped in DistributedDataParallel after optimizer_in_backward?): wrap it in "
                           "DDP first and give optimizer_in_backward the DDP model, whose hook reduces each bucket before its update")


def _needs_closure(optimizer_class) -> bool:
    """Whether ``optimizer_class.step`` requires a closure (LBFGS): its ``closure`` has no default."""
    closure = inspect.signature(getattr(optimizer_class, "step", lambda closure=None: None)).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _take_over(stand_in: "InBackwardOptimizer") -> List[torch.Tensor]:
    """The parameters whose updates ``stand_in`` runs: those that can have a gradient (an optimizer
    takes frozen ones too; they never get one). A parameter stepped in backward by an earlier
    stand-in (a new training phase, a rebuilt optimizer) is taken from it: that one's hooks are
    removed, with a warning, so that two optimizers never update one parameter."""
    params = [p for p in stand_in._groups if p.requires_grad]
    earlier = {id(m.stand_in): m.stand_in for m in map(in_backward_mark, params) if m is not None and m.stand_in._handles}
    for e in earlier.values():
        e.remove()
        warnings.warn(f"optimizer_in_backward: these parameters were stepped in backward by {e!r}; its hooks are removed and the new "
                      "optimizer updates them", UserWarning, stacklevel=3)
    for p in params:
        setattr(p, IN_BACKWARD_ATTR, InBackwardMark(stand_in))
    return params


def update_temporaries(optimizer_class: Callable[..., torch.optim.Optimizer], optimizer_kwargs: Optional[dict] = None,
                       device: Union[str, torch.device] = "cpu") -> float:
    """How many tensors of a parameter's size ``optimizer_class(**optimizer_kwargs)`` allocates
    while it updates one parameter on ``device``, its state aside: what a step in backward adds at
    the moment that parameter's gradient is whole (``gradients="in_backward"`` plans for it). The
    second update of a scratch 256 x 256 parameter, measured (an optimizer's foreach and
    for-loop forms differ, and the device picks between them: docs/planning.md has the figures)."""
    optimizer_kwargs = optimizer_kwargs or {}
    p = torch.zeros(256, 256, device=device, requires_grad=True)  # a matrix: some optimizers (Muon) take only 2-D parameters
    optimizer = optimizer_class([p], **optimizer_kwargs)
    for _ in range(2):  # the first update allocates the state
        p.grad = torch.full_like(p, 1e-3)
        with PeakMemory(p.device) as mem:
            optimizer.step()
    return round(mem.peak_bytes / (p.numel() * p.element_size()), 2)


def standard_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer behind ``optimizer``: itself, or the one an :class:`InBackwardOptimizer`
    steps (what ``torch.distributed.checkpoint``'s state-dict helpers take)."""
    return optimizer.optimizer if isinstance(optimizer, InBackwardOptimizer) else optimizer


def _trainable(module: nn.Module) -> List[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


class InBackwardOptimizer(torch.optim.Optimizer):
    """What a training loop holds in place of the optimizer when the optimizer steps in backward
    (made by :func:`optimizer_in_backward`).

    ``param_groups``, ``defaults``, ``state``, ``state_dict()`` and ``load_state_dict()`` are the
    wrapped optimizer's own, so learning-rate and weight-decay schedules and checkpoints work
    unchanged (it is a ``torch.optim.Optimizer``, as ``torch.optim.lr_scheduler`` requires, built
    around the wrapped one rather than by ``Optimizer.__init__``),
    and a checkpoint loads into the standard optimizer and back. ``step()`` does nothing (the
    update ran in backward) and ``zero_grad()`` clears what is left (DDP's bucket views).
    ``remove()`` takes the hooks away; the optimizer then steps only when called
    (``stand_in.optimizer.step()``). ``before_update``: a per-parameter rule run on each whole
    gradient before its update (clipping by the parameter's own norm; False skips the update).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        # each parameter's group, by position: the update steps the optimizer over that group alone
        # (``load_state_dict`` replaces the group dicts, from here or from torch.distributed.checkpoint)
        self._groups = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._handles: List = []
        self.update_temporaries = UPDATE_TEMPORARIES  # tensors of a parameter's size one update allocates (measured by optimizer_in_backward)
        # run on each parameter's whole gradient before its update (clip it; False: no update this step)
        self.before_update: Optional[Callable[[torch.Tensor], bool]] = None
        self._lock = threading.Lock()  # one update at a time: it swaps the optimizer's groups for a moment
        self._accumulating = False  # see accumulating()
        self._used: Optional[set] = None  # under DDP with find_unused_parameters: the parameters this rank used in this backward
        self._reduced_first = False  # updates run after DDP's reduction (its communication hook)

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:  # OneCycleLR reads it to find the momentum it cycles
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Optional[Callable] = None) -> None:
        """Nothing: every parameter was updated when its gradient was whole."""
        if closure is not None:
            raise ValueError("an optimizer stepped in backward takes no closure: its updates ran in backward already")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def accumulating(self):
        """Backwards run in this context add to the gradients and update nothing: the next backward
        outside it updates each parameter from the whole sum (a multi-crop step backward by crop
        group, gradient accumulation). The gradients stay alive meanwhile. Enter it before the
        forward: a trunk planned for ``gradients="in_backward"`` plans such a call for the gradients
        its backward keeps (``"allocated"``)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @property
    def holding(self) -> bool:
        """Whether updates are held now (inside :meth:`accumulating`)."""
        return self._accumulating

    def update(self, p: torch.Tensor) -> None:
        """Update ``p`` from its gradient, as the optimizer's ``step()`` would, then free the gradient
        (``before_update(p)``, where set, first: it may change the gradient, or return False to skip).
        Inside :meth:`accumulating`, nothing: the gradient is kept for the next backward."""
        if self._accumulating:
            return
        if not self._reduced_first:
            _refuse_unreduced(p)
        if self.before_update is not None and not self.before_update(p):
            p.grad = None
            return
        group = self.optimizer.param_groups[self._groups[p]]
        with self._lock:
            groups, params = self.optimizer.param_groups, group["params"]
            self.optimizer.param_groups, group["params"] = [group], [p]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups, group["params"] = groups, params
        p.grad = None

    def remove(self) -> None:
        """Take the hooks away (DDP's communication hook cannot be removed: rebuild the DDP model)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self._groups:  # no longer stepped in backward by this one: plans and wrapping see so
            mark = in_backward_mark(p)
            if mark is not None and mark.stand_in is self:
                delattr(p, IN_BACKWARD_ATTR)

    def _ddp_hook(self, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: average the bucket across ranks, then update its parameters."""
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(process_group))
        dist.all_reduce(buffer, group=process_group)
        params = bucket.parameters()
        used = [True] * len(params)
        if self._used is not None:  # find_unused_parameters: how many ranks used each (one more small all-reduce)
            counts = torch.tensor([float(p in self._used) for p in params], device=buffer.device)
            dist.all_reduce(counts, group=process_group)
            used = (counts > 0).tolist()
            self._used.difference_update(params)
        for p, g, anyone in zip(params, bucket.gradients(), used):
            if p in self._groups:
                p.grad = g if anyone else None  # the averaged gradient, a view of the bucket; none where no rank used p
                if anyone:
                    self.update(p)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def __repr__(self) -> str:
        return f"InBackwardOptimizer({self.optimizer.__class__.__name__}, {len(self._groups)} parameters)"

    def __reduce_ex__(self, protocol):
        # Optimizer's pickling (its state dict's fields) would make a stand-in with no optimizer and no hooks
        raise TypeError("an optimizer stepped in backward is not pickled or copied whole (its hooks live on the parameters): save "
                        "stand_in.state_dict(), the standard optimizer's format, and load it into a new one with load_state_dict()")
