"""What each unit brings to the peak model (:class:`trunksplit.planning.peak.PeakModel`) beyond its
measured figures: the gradients held after it, the updates of an optimizer stepped in backward, and
when a segment's input goes."""
import itertools
import operator
from typing import List, Sequence, Tuple

from .profile import UnitCosts


def gradients_after(c: UnitCosts) -> List[int]:
    """For each unit, the gradients the step has allocated while it runs its backward: those of the
    units after it, as their backward made them (a slice keeps its whole storage: ``fresh_gradient_surplus``)."""
    grads = c.param_bytes if c.gathered or not c.fresh_gradient_surplus else tuple(map(operator.add, c.param_bytes, c.fresh_gradient_surplus))
    return list(itertools.accumulate(reversed(grads)))[::-1][1:] + [0]


def backward_terms(c: UnitCosts, gradients: str, compiled: bool, temporaries: float) -> Tuple[List[int], List[int], List[int]]:
    """Each unit's backward beyond what its forward left, as a gradient mode makes it: while the unit holds
    what it saved (its input among them), and once it has let go of all (0 where not measured apart: a
    compiled unit, a rank's shards, the allocator's figures); and the part of the first that the updates
    of an optimizer stepped in backward add, each making ``temporaries`` tensors of its parameter's size
    (:func:`_updates`). Its own gradients stay as its backward makes them where the step allocates them
    (``"allocated"``: a stage of a traced ViT holds all of its own at once), or where a compiled graph
    returns them together (``PeakModel``'s ``compiled``)."""
    fresh = (gradients == "allocated" or compiled) and c.backward_fresh and not c.gathered
    excess, released = (c.backward_fresh if fresh else c.backward_excess), (0,) * len(c)
    held_apart, released_apart = (c.fresh_while_input_held, c.released_fresh) if fresh else (c.excess_while_input_held, c.released_excess)
    if not compiled and not c.gathered and held_apart:  # the input beside the first part only
        excess, released = held_apart, released_apart
    if gradients != "in_backward":
        return list(excess), list(released), [0] * len(c)
    update = _updates(c, excess, temporaries, compiled, after_saves=False)
    after = _updates(c, released, temporaries, compiled, after_saves=True)
    return [e + u for e, u in zip(excess, update)], [r + u for r, u in zip(released, after)], update


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
    a checkpoint keeps its input until the last tensor its segment saved goes (torch's non-reentrant
    ``_CheckpointFrame`` is held by the hooks of each), the last segment only in its units' saves of it.
    0 (held to the end) where the moments are not measured: compiled units, FSDP2 ranks, a reentrant
    checkpoint (its backward holds its input whole)."""
    c = model.costs
    if a == 0 or c.input_from[a] != a - 1 or a - 1 in model.features or model.compiled or c.gathered or (model.reentrant and not last):
        return 0
    return c.output[a - 1]
