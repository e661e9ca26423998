"""`steps_per_execution`: k consecutive batches in one `strategy.run`, as one `jax.lax.scan`
over the step (its carry the objects' state) where their signatures agree, and the grouping of
a loop's batches into calls."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from mirrax._src.distribute.current import get_replica_context
from mirrax._src.distribute.values import PerReplica

# step function -> its `make_multi_step`, made once (the same function keys strategy.run's
# program cache). Kept out of `CompiledState`: ParameterServerStrategy pickles that to its
# workers, and each function reachable from it multiplied what a scheduled function carried
# (three of them made the digits CNN test take 108 s instead of 23).
_MULTI_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STACKED_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def multi_step_of(step, stacked: bool = False):
    """`make_multi_step(step)` (`stacked`: `make_stacked_multi_step(step)`), the same object for
    the same `step` while `step` lives (held weakly: the multi-step calls `step` through a weak
    reference, only while tracing)."""
    cache = _STACKED_STEPS if stacked else _MULTI_STEPS
    multi = cache.get(step)
    if multi is None:
        ref = weakref.ref(step)

        def one(*args):
            fn = ref()
            assert fn is not None  # called only while step lives (it is traced from there)
            return fn(*args)

        one.__name__ = getattr(step, "__name__", "step")
        multi = cache[step] = (make_stacked_multi_step if stacked else make_multi_step)(one)
    return multi


def make_multi_step(step):
    """k steps in one program (`steps_per_execution`, as Keras's `multi_*_steps`): each
    micro-step sees its own batch mask. Returns the tuple of the k steps' results (predict:
    the k batches' outputs; fit and evaluate: Nones).

    Consecutive batches of one signature (structure, shapes and dtypes: every batch of a call,
    typically, a partial one padded to the same shapes) run as ONE `jax.lax.scan` over them
    stacked, the objects' state its carry: the step is compiled once whatever k (and traced a
    fixed number of times), where Keras unrolls k copies (compile time and program size grow
    with k). A lone batch, a step that changes the state's structure or types, and every batch
    in replica-invariant mode (its write-back recognises combined values by identity, which a
    scan's carry does not keep) run unrolled, as before."""

    def steps(module, optimizer, metrics, tracker, loss_scale, batches, masks):
        ctx = get_replica_context()
        assert ctx is not None  # a step runs in a replica context (None is cross-replica only)
        objects = (module, optimizer, metrics, tracker, loss_scale)
        saved = ctx.peek_batch_mask()
        results: list = []
        try:
            for run in _runs(batches, masks, scan=not ctx.strategy.replica_invariant):
                scanned = _scanned(step, objects, run, ctx) if len(run) > 1 and _scannable(objects) else None
                if scanned is None:
                    for batch, mask in run:
                        ctx.batch_mask = mask
                        results.append(step(*objects, batch))
                else:
                    results.extend(scanned)
        finally:
            ctx.batch_mask = saved
        return tuple(results)

    # Errors and warnings about the call name the user's step, not this wrapper.
    steps.__name__ = steps.__qualname__ = getattr(step, "__name__", "step")
    return steps


def make_stacked_multi_step(step):
    """k steps in one program over a batch placed k at once (`batching.place_group`): each
    replica's batch leaves are (k, rows, ...) and its batch mask (k, rows), every row real, so
    each step keeps the call's example count (one batch's). One `jax.lax.scan` over the leading
    axis, as `make_multi_step`'s, without stacking the batches on the device first; a step that
    changes the state's structure or types runs unrolled on each slice. Returns None (fit and
    evaluate, whose steps' results are not read)."""

    def steps(module, optimizer, metrics, tracker, loss_scale, batch):
        ctx = get_replica_context()
        assert ctx is not None  # a step runs in a replica context (None is cross-replica only)
        objects = (module, optimizer, metrics, tracker, loss_scale)
        masks, count = ctx.peek_batch_mask(), ctx.example_count
        if _scannable(objects) and _scan(step, objects, (batch, masks), ctx, count) is not None:
            return None
        for i in range(masks.shape[0]):
            with ctx.micro_batch(masks[i], count):
                step(*objects, jax.tree.map(lambda a, i=i: a[i], batch))
        return None

    steps.__name__ = steps.__qualname__ = getattr(step, "__name__", "step")
    return steps


def _types(tree) -> tuple:
    """The structure of `tree` (arrays, tracers or ShapeDtypeStructs) and each leaf's (shape,
    dtype, weak type): what a scan's stacked inputs must share, and its carry must keep."""
    leaves, treedef = jax.tree.flatten(jax.eval_shape(lambda t: t, tree))
    return treedef, tuple((x.shape, x.dtype, x.weak_type) for x in leaves)


def _runs(batches, masks, scan: bool) -> list:
    """The (batch, mask) pairs cut into runs of consecutive pairs of one signature (each pair a
    run of its own without `scan`)."""
    if not scan:
        return [[pair] for pair in zip(batches, masks)]
    runs: list = []
    last = None
    for pair in zip(batches, masks):
        signature = _types(pair)
        if runs and signature == last:
            runs[-1].append(pair)
        else:
            runs.append([pair])
        last = signature
    return runs


def _scannable(objects) -> bool:
    """Whether every leaf of the objects' state is an array (a scan's carry can hold nothing
    else)."""
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(objects)))


def _scanned(step, objects, run, ctx) -> list | None:
    """`step(*objects, batch)` for each (batch, mask) of `run` as one `jax.lax.scan` over them
    stacked (`_scan`); each step's result, or None with the objects untouched."""
    scanned = _scan(step, objects, jax.tree.map(lambda *xs: jnp.stack(xs), *run), ctx, None)
    if scanned is None:
        return None
    return [jax.tree.map(lambda a, i=i: a[i], scanned[0]) for i in range(len(run))]


def _scan(step, objects, stacked, ctx, count):
    """`step(*objects, batch)` for each (batch, mask) along the leading axis of `stacked` as one
    `jax.lax.scan` (called by attribute, so `scan_carry` can make a carry that turns
    per-replica start so), each step with the example count `count` (None: not known); the
    objects hold the last step's state after it. Returns (the steps' results stacked,), or None,
    with the objects untouched, for a step that changes the state's structure or types
    (creates a variable, turns an int32 count into a float): a scan's carry cannot, so the
    caller runs those steps unrolled, as before."""
    graphdef, state = nnx.split(objects)

    def body(carry, pair):
        batch, mask = pair
        copies = nnx.merge(graphdef, carry)
        with ctx.micro_batch(mask, count):
            result = step(*copies, batch)
        return nnx.state(copies), result

    try:
        final, results = jax.lax.scan(body, state, stacked)
    except TypeError:
        # The body ran on copies merged from the scan's own carry: nothing reached `objects`.
        first = jax.tree.map(lambda a: a[0], stacked)
        if _types(jax.eval_shape(body, state, first)[0]) != _types(state):
            return None
        raise
    nnx.update(objects, final)
    return (results,)


def groups(batches, size: int):
    """Consecutive groups of `size` batches (the last may be shorter)."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def mask_of(batch):
    """The (num_replicas, rows) mask array shared by a distributed batch's leaves."""
    return next(
        leaf
        for leaf in jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, PerReplica))
        if isinstance(leaf, PerReplica)
    ).mask
