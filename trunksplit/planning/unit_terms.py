"""What each unit brings to the peak model (:class:`trunksplit.planning.peak.PeakModel`) beyond its
measured figures: the gradients held after it, the updates of an optimizer stepped in backward, and
when a segment's input goes."""
import itertools
import operator
from typing import List, NamedTuple, Sequence, Tuple

from .profile import UnitCosts


def gradients_after(c: UnitCosts) -> List[int]:
    """For each unit, the gradients the step has allocated while it runs its backward: those of the
    units after it, as their backward made them (a slice keeps its whole storage: ``fresh_gradient_surplus``)."""
    grads = c.param_bytes if c.gathered or not c.fresh_gradient_surplus else tuple(map(operator.add, c.param_bytes, c.fresh_gradient_surplus))
    return list(itertools.accumulate(reversed(grads)))[::-1][1:] + [0]


def copies(c: UnitCosts, features: Sequence[int]) -> Tuple[List[int], List[bool]]:
    """Where a step runs on a copy of a segment's input (``run_units``' ``copy_input``: a cut forced after a feature
    before an in-place op, ``bn1`` before ``ReLU(inplace=True)``), a storage of its own beside the caller's feature:
    for each segment start ``a``, the first unit whose storage the segment holds as its own (``a``, or where it copies,
    the unit that made the input); and for each unit, whether a step copies its input there (cut after its feature)."""
    own = [c.input_from[a] if 0 < a and c.starts_in_place and c.starts_in_place[a] and c.input_from[a] >= 0 else a for a in range(len(c))]
    return own, [own[i] != i and i - 1 in features for i in range(len(c))]


def held_features(c: UnitCosts, features: Sequence[int]) -> List[int]:
    """The requested features whose storages the caller's hold keeps, each storage once: the first feature made in it.
    A feature that is a view of an earlier one (a ResNet's ``flatten`` of ``avgpool``'s output; a ViT's class token,
    ``x[:, 0]``, of the token map, where a registered unit takes it so) holds no storage of its own: counted as well,
    torchvision's ViT-B/16 returning ``norm`` and ``flatten`` (its class token then a view) was predicted one token map over."""
    first = {}
    for f in sorted(features):
        first.setdefault(c.output_from[f] if c.output_from else f, f)
    return sorted(first.values())


def feature_terms(c: UnitCosts, features: Sequence[int], copied: Sequence[bool]) -> Tuple[List[int], List[int], List[int]]:
    """What a step's requested features (unit indices) add beside each unit's backward: the loss's gradient of
    each feature before the unit, made as backward starts and waiting until backward reaches its feature (beside
    the unit right after a feature, what it adds to that unit's peak, measured: ``c.beside_waiting``, none where
    not; all of it where the unit is ``copied``, run on a copy of its input); inside the last segment, each
    feature after the unit (other than the last unit's), which the caller holds where backward would have let it
    go, and the unit's own, which its backward would have let go where it saves it (measured:
    ``c.beside_held_output``); and beside the recompute of a checkpoint ending at the unit right after a feature,
    the rest of that feature's waiting gradient, which nothing has accumulated into yet. Other segments hold no feature inside:
    cuts come after features. Sharp edge: a loss that makes more than the gradient (a ``pow``'s temporaries on
    a large feature) is the caller's and not counted."""
    n, output = len(c), c.output
    beside = [0 if i == 0 or i - 1 not in features else output[i - 1] if copied[i] else c.beside_waiting[i] if c.beside_waiting else 0 for i in range(n)]
    # measured only where the unit saves its output (the others' the scan counts: PeakModel._caller_keeps)
    own = c.beside_held_output or (0,) * n
    held = held_features(c, features)
    return ([sum(output[f] for f in features if f < i - 1) + beside[i] for i in range(n)],
            [sum(output[f] for f in held if i < f < n - 1) + own[i] for i in range(n)],
            [output[i - 1] - beside[i] if i > 0 and i - 1 in features else 0 for i in range(n)])


class BackwardTerms(NamedTuple):
    """Each unit's backward beyond what its forward left, as the peak model reads it (:func:`backward_terms`)."""

    running: List[int]  # while it holds what it saved (its input among them), updates stepped in backward included
    released: List[int]  # once it has let go of all it saved
    update: List[int]  # the part of ``running`` that updates stepped in backward add
    # where it ends a checkpointed segment, beside the recompute: from its first unpack on, and its released
    # part (none where it saves nothing: its backward runs before the recompute, beside none)
    running_last: List[int]
    released_last: List[int]


def packs(c: UnitCosts, reentrant: bool) -> List[bool]:
    """Whether each unit saves a tensor for its backward (run in a reentrant checkpoint: as if it did, the
    recompute runs its segment whole): where a non-reentrant recompute runs to, and where it starts."""
    return [reentrant or bool(c.saves_input[i] or c.saved[i] or c.keeps_output[i]) for i in range(len(c))]


def backward_terms(c: UnitCosts, gradients: str, compiled: bool, temporaries: float, reentrant: bool) -> BackwardTerms:
    """Each unit's backward beyond what its forward left, as a gradient mode makes it (:class:`BackwardTerms`).
    Split where a unit lets go of what it saved and at its first unpack, but for a compiled unit, a rank's
    shards and the allocator's figures (one peak each); a reentrant checkpoint recomputes before any of its
    segment's backward. Its own gradients stay as its backward makes them where the step allocates them
    (``"allocated"``: a stage of a traced ViT holds all of its own at once), or where a compiled graph
    returns them together (``PeakModel``'s ``compiled``); stepped in backward (``"in_backward"``), each
    update makes ``temporaries`` tensors of its parameter's size (:func:`_updates`)."""
    fresh = (gradients == "allocated" or compiled) and c.backward_fresh and not c.gathered
    excess, n = (c.backward_fresh if fresh else c.backward_excess), len(c)
    released, from_unpack = (0,) * n, excess
    parts = (c.fresh_while_input_held, c.fresh_from_unpack, c.released_fresh) if fresh else (c.excess_while_input_held, c.excess_from_unpack, c.released_excess)
    if not compiled and not c.gathered and parts[0]:  # the input beside the first part only
        excess, from_unpack, released = parts
        from_unpack = excess if reentrant or not from_unpack else from_unpack
    saves = packs(c, reentrant)
    released_last = [r if s else 0 for r, s in zip(released, saves)]
    from_unpack = [f if s else 0 for f, s in zip(from_unpack, saves)]
    if gradients != "in_backward":
        return BackwardTerms(list(excess), list(released), [0] * n, from_unpack, released_last)
    update = _updates(c, excess, temporaries, compiled, after_saves=False)
    add = lambda figures, after_saves: [f + u for f, u in zip(figures, _updates(c, figures, temporaries, compiled, after_saves))]  # noqa: E731
    return BackwardTerms([e + u for e, u in zip(excess, update)], add(released, True), update, add(from_unpack, False), add(released_last, True))


def _updates(c: UnitCosts, excess: Sequence[int], temporaries: float, compiled: bool, after_saves: bool) -> List[int]:
    """What each unit's backward holds beyond ``excess`` where an optimizer stepped in backward updates its
    parameters, before the unit lets go of what it saved or after (``after_saves``): from the moments measured
    at each update where there are (``UnitCosts.update_moments``), else (a compiled unit, whose graph returns
    its gradients together; a rank's shards; costs scaled to another batch) the update of its largest
    parameter on top of its peak."""
    if c.update_moments and not compiled and not c.gathered:
        # measured where the gradient was added into a kept one and freed: stepped in backward, it lives on through the update
        return [max(0, max((int(alive + (1 + temporaries) * nbytes) for alive, nbytes, after in moments if after == after_saves), default=0) - e)
                for moments, e in zip(c.update_moments, excess)]
    return [0] * len(c) if after_saves or not c.largest_param else [int(temporaries * b) for b in c.largest_param]


def input_relief(model: "PeakModel", a: int, last: bool) -> int:
    """Bytes of a segment's input that go before its backward ends: once no unit of it holds the input,
    it is predicted without it. Unit ``a - 1`` allocated it and the caller holds no view of it (a feature):
    a checkpoint keeps its input until the last tensor its segment saved goes (its frame, with the saved
    input, is held by the hooks of each: :mod:`trunksplit.recompute.hooked`), the last segment only in its units' saves of it.
    0 (held to the end) where the moments are not measured: compiled units, FSDP2 ranks, a reentrant
    checkpoint (its backward holds its input whole)."""
    c = model.costs
    if a == 0 or c.input_from[a] != a - 1 or a - 1 in model.features or model.compiled or c.gathered or (model.reentrant and not last):
        return 0
    return c.output[a - 1]
