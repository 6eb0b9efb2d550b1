"""torch's selective checkpointing as the trunk's regions and :func:`checkpoint_wrapper` run it: the
contexts that keep the outputs a policy picks, with the caller's own contexts (the buffers' guard)
entered around torch's, and a second backward through a region refused saying what to do instead.

torch keeps a selective region's picked outputs for one backward: the recompute hands each to the
backward and lets it go (``_CONSUMED``), so a second backward through the same forward
(``retain_graph=True``, or ``create_graph=True`` for a gradient penalty) cannot run it. Whole
checkpoints (a trunk's segments, the ``"recompute"`` policy) rerun their forward as often as asked.
"""
import contextlib
from typing import Callable, ContextManager

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

SECOND_BACKWARD = (
    "a second backward through a selective region (a memory_budget plan's region whose policy keeps some ops' outputs, "
    "see plan.regions, or a checkpoint_wrapper with a selective policy): torch's selective checkpointing gives its kept "
    "outputs to one backward only, and this forward's were used. Add the losses and call backward once; for a gradient "
    "penalty (create_graph=True) or retain_graph=True, use a plan without selective regions (strategy='balanced' with "
    "num_splits, no memory_budget), or checkpoint_wrapper's default policy 'recompute': whole checkpoints rerun their "
    "forward for every backward"
)


def selective_contexts(keep: Callable, first_forward: Callable[[], ContextManager], recompute: Callable[[], ContextManager]) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint``: torch's selective contexts keeping the outputs
    of the ops ``keep(func, args)`` picks, inside ``first_forward()`` and ``recompute()``.

    The caller's contexts run outside torch's modes, whose recompute replays only the ops the forward
    ran (a guard's copies of buffers are not among them). Sharp edge: the recompute context is entered
    once; a second time, it raises :data:`SECOND_BACKWARD` (torch would refuse anyway, and a
    generator's context, entered twice, fails with an ``AttributeError`` that names nothing)."""

    def contexts():
        forward, replay = create_selective_checkpoint_contexts(keep_policy(keep))
        return _both(first_forward(), forward), _Once(lambda: _both(_both(recompute(), casts_run_as_they_come()), replay))

    return contexts


def keep_policy(keep: Callable) -> Callable:
    """The selective-checkpoint policy keeping the outputs of the ops ``keep(func, args)`` picks.

    The rest are ``PREFER_RECOMPUTE``, not ``MUST_RECOMPUTE``: compiled, AOT autograd's partitioner
    then still saves a random op's output (dropout on CPU would draw another mask if run again)."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if keep(func, args) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Once:
    """The context ``make()`` gives, made when entered, and entered once: a second entry (a second
    backward through the region) raises :data:`SECOND_BACKWARD`."""

    def __init__(self, make: Callable[[], ContextManager]):
        self._make, self._entered = make, None

    def __enter__(self):
        if self._entered is not None:
            raise RuntimeError(SECOND_BACKWARD)
        self._entered = self._make()
        return self._entered.__enter__()

    def __exit__(self, *exc):
        return self._entered.__exit__(*exc)


@contextlib.contextmanager
def casts_run_as_they_come():
    """Inside, torch's selective checkpoint runs autocast's casts as they come, neither kept nor replayed
    (torch's public ``SAC_IGNORED_OPS``): a weight an earlier call under the same autocast had cast (a
    trunk at a second crop size) is a cache hit in the forward and a cast in the recompute (a fresh
    autocast), which torch, replaying only the forward's ops, refused (pytorch/pytorch#193338). The
    forward keeps autocast's graph (the plain model's gradients, bit for bit); the recompute's cast has
    the same values. Activations' casts are never kept here anyway. Only our additions are removed."""
    added = [op for op in (torch.ops.aten._to_copy.default,) if op not in SAC_IGNORED_OPS]
    SAC_IGNORED_OPS.update(added)
    try:
        yield
    finally:
        SAC_IGNORED_OPS.difference_update(added)


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield
