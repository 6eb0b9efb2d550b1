"""FSDP2's terms in the peak model: what a rank holds beyond the unsharded model's figures
around each unit's backward (its gathered weights, whole gradients, reduce-scatter buffers).
Functions of a :class:`trunksplit.planning.peak.PeakModel` built with ``costs.gathered``."""


def fsdp_in_backward(model: "PeakModel", a: int, i: int, last: bool) -> int:
    """Under FSDP2, what a rank holds beyond the unsharded model's figures while unit ``i``
    of a segment starting at ``a`` runs its backward (0 unsharded).

    Measured on gloo ranks (torch.profiler's allocation events around FSDP2's own
    record_function marks), as FSDP2's source says: a unit's forward all-gathers its weights
    into a flat buffer, then copies them out to each parameter (twice its weights for a
    moment), and frees them after the forward, except in a checkpoint's recompute, which
    runs in backward: there they stay until the unit's own backward (``PeakModel._step`` keeps them).
    A unit's backward holds its weights (gathered again, in the last segment), its whole
    gradients as its backward makes them until they are reduce-scattered (``backward_fresh``,
    with the scratch a CPU convolution's weight-gradient kernel holds beside each), the
    reduce-scatter input of the unit before
    it in backward (kept until this unit's own reduce), and the flat buffer of the next
    unit's weights, prefetched (already held inside a recomputed segment, but for its first)."""
    g, c = model._gathered, model.costs
    if not c.gathered:
        return 0
    after = g[i + 1] if i + 1 < model.n else 0
    prefetched = g[i - 1] if i > 0 and (last or i == a) else 0
    # its whole gradients, as its backward makes them (the profiled ones already hold theirs)
    grads = c.backward_fresh[i] - c.backward_excess[i] if c.backward_fresh else g[i]
    return (g[i] if last else 0) + grads + after + prefetched


def fsdp_at_reduce(model: "PeakModel", a: int, i: int, last: bool) -> int:
    """Under FSDP2, what a rank holds beyond the units before ``i`` while unit ``i``'s gradients
    are reduce-scattered (0 unsharded): its activations and gathered weights are freed by then;
    the gradients of the units after it, the next unit's prefetched weights, its whole
    gradients copied into the reduce-scatter input (both for a moment), then that input, the
    backend's own copy of it (gloo clones it; ``reduce_scatter_copies``) and the rank's shard
    of the result."""
    c, g = model.costs, model._gathered
    if not c.gathered:
        return 0
    prefetched = g[i - 1] if i > 0 and (last or i == a) else 0
    reduce = max(2 * g[i], (1 + c.reduce_scatter_copies) * g[i] + c.param_bytes[i] + model._update[i])
    return model._grads_after[i] + prefetched + reduce
