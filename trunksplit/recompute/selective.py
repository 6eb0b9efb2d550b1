"""torch's selective checkpointing as the trunk's regions and :func:`checkpoint_wrapper` run it: the
contexts that keep the outputs a policy picks, with the caller's own contexts (the buffers' guard)
entered around torch's, and a second backward through a region run as a whole recompute.

torch keeps a selective region's picked outputs for one backward: its recompute hands each to the
backward and lets it go (``_CONSUMED``), and refuses a second backward through the same forward
("Trying to backward an extra time"). A gradient penalty (``create_graph=True``) or a second loss
(``retain_graph=True``) makes one. That recompute runs here without torch's replay: every op again,
kept ones too, as a ``"recompute"`` region would (the same values: the same ops on the same inputs,
the random state restored by the checkpoint), so the gradients are the plain model's.
"""
import contextlib
from typing import Callable, ContextManager

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts


def selective_contexts(keep: Callable, first_forward: Callable[[], ContextManager], recompute: Callable[[], ContextManager]) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint``: torch's selective contexts keeping the outputs
    of the ops ``keep(func, args)`` picks, inside ``first_forward()`` and ``recompute()``.

    The caller's contexts run outside torch's modes, whose recompute replays only the ops the forward
    ran (a guard's copies of buffers are not among them), and autocast's casts and the profiler's
    annotations as they come in both passes (:func:`ops_run_as_they_come`). The first recompute replays; a later one (a second
    backward) runs every op again (see the module docstring)."""

    def ours(make: Callable[[], ContextManager]) -> ContextManager:
        return _both(make(), ops_run_as_they_come())

    def contexts():
        forward, replay = create_selective_checkpoint_contexts(keep_policy(keep))
        if hasattr(forward, "respect_saved_tensors_hooks"):
            # torch 2.14 asks, with a FutureWarning, whether the kept outputs go through the saved-tensor
            # hooks around the region (an enclosing cut's); checkpoint's argument for it cannot reach a mode
            # wrapped in ours. Earlier torch keeps them outside the hooks, as False still does.
            forward.respect_saved_tensors_hooks = False
        return _both(ours(first_forward), forward), _ReplayOnce(lambda: _both(ours(recompute), replay), lambda: ours(recompute))

    return contexts


def keep_policy(keep: Callable) -> Callable:
    """The selective-checkpoint policy keeping the outputs of the ops ``keep(func, args)`` picks.

    The rest are ``PREFER_RECOMPUTE``, not ``MUST_RECOMPUTE``: compiled, AOT autograd's partitioner
    then still saves a random op's output (dropout on CPU would draw another mask if run again)."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if keep(func, args) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _ReplayOnce:
    """A context made when entered: ``first()``'s the first time (torch's replay of the kept outputs),
    ``again()``'s after (a plain recompute: the kept outputs went to the first backward). Each is a
    fresh context: a generator's, entered twice, failed with an ``AttributeError`` naming nothing."""

    def __init__(self, first: Callable[[], ContextManager], again: Callable[[], ContextManager]):
        self._first, self._again, self._entered = first, again, None

    def __enter__(self):
        self._entered = self._first() if self._entered is None else self._again()
        return self._entered.__enter__()

    def __exit__(self, *exc):
        return self._entered.__exit__(*exc)


@contextlib.contextmanager
def ops_run_as_they_come():
    """Inside, torch's selective checkpoint runs some ops as they come, neither kept nor replayed
    (torch's public ``SAC_IGNORED_OPS``), where the recompute runs them a different number of times than
    the forward did and torch, replaying only the forward's ops by count, refused the backward:

    - autocast's casts: a weight an earlier call under the same autocast had cast (a trunk at a second
      crop size) is a cache hit in the forward and a cast in the recompute (a fresh autocast)
      (pytorch/pytorch#193338). The forward keeps autocast's graph (the plain model's gradients, bit
      for bit); the recompute's cast has the same values. Activations' casts are never kept here anyway.
    - ``record_function``'s annotations, which FSDP2's hooks make: a region holding several sharded units
      recomputes the ones whose backward has not begun as a new forward (one more annotation each, the
      root's), and the step failed ("invocation index 8 encountered during backward but not found").
      They hold no values.

    Only our additions are removed."""
    profiler = torch.ops.profiler
    ops = (torch.ops.aten._to_copy.default, profiler._record_function_enter.default, profiler._record_function_enter_new.default,
           profiler._record_function_exit._RecordFunction)
    added = [op for op in ops if op not in SAC_IGNORED_OPS]
    SAC_IGNORED_OPS.update(added)
    try:
        yield
    finally:
        SAC_IGNORED_OPS.difference_update(added)


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield
