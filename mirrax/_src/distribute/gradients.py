"""Gradients summed over replicas in ONE packed all-reduce per dtype.

Inside `strategy.run`, differentiating a replicated (unvarying) parameter makes JAX sum its
gradient over replicas: one all-reduce per parameter array, which XLA combines into one
all-reduce instruction with many operands. On GPU (NCCL) that is one grouped call; XLA:CPU's
Gloo path instead runs one collective per operand, each paying a round trip: measured on 2
loopback workers, the tutorial CNN's 10 gradient arrays took 36.6 ms as separate arrays and
4.2 ms as one concatenated vector (BENCHMARKS.md, "Multi-worker weak scaling").

`value_and_grad` below differentiates with respect to a VARYING copy of the parameters (one
`pvary` of their concatenation, no data movement), so JAX inserts no per-array sums; it then
sums the local gradients itself, concatenated into one vector per dtype: one all-reduce, one
pass over the gradient bytes, whatever the number of arrays. The parameters the optimizer
updates stay the caller's unvarying ones, so the result is the same program semantics as
`nnx.value_and_grad` in replica context (tested against it to float rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import _compat, invariant, sharded_optimizer
from mirrax._src.distribute.replica_context import REPLICA_AXIS, current_replica_context


def value_and_grad(
    fn: Callable, has_aux: bool = False, all_reduce_dtype=None, pack: bool | None = None
) -> Callable:
    """`nnx.value_and_grad(fn, has_aux)` whose gradients are summed in ONE packed all-reduce.

    Use it in place of `nnx.value_and_grad` in a step that `strategy.run` runs:
    `loss, grads = mirrax.value_and_grad(loss_fn)(model)`. The gradients are those of
    `nnx.value_and_grad` (summed over replicas, as JAX sums them), computed with one all-reduce
    of the concatenated gradient vector per dtype instead of one per parameter array: the same
    bytes, far fewer collective calls (several times faster across processes on CPU; see
    BENCHMARKS.md). `Model.fit` uses it. Differentiates with respect to the module's
    `nnx.Param`s, the first argument.

    Args:
      fn: `fn(module, *args)` returning a scalar loss, or `(loss, aux)` with `has_aux`.
      has_aux: as `nnx.value_and_grad`.
      all_reduce_dtype: None to sum gradients in their own dtype; or a floating dtype (e.g.
        "bfloat16") to cast the packed gradient vector to it for the all-reduce and back (half
        the bytes on the wire for float32, at bfloat16's precision: about 3 significant
        digits). Opt-in, as Horovod's fp16 compression; the default is exact. XLA:CPU
        promotes a bfloat16 all-reduce back to float32, so this saves bytes only where the
        collective library sums bfloat16 natively (NCCL on GPU). On CPU across processes
        (Gloo) it is slower than float32, not faster: bfloat16 adds two conversions to the
        same float32 all-reduce, and a float16 one (which XLA:CPU keeps) took about 2.3 times
        as long as float32 for half the bytes: Gloo's float16 sum is slow (measured
        in BENCHMARKS.md, "Multi-worker weak scaling"); float16 also overflows above 65504
        unless the loss is scaled. Leave it None on CPU.
      pack: None (default) packs where it pays: across processes on CPU (Gloo), or when
        `all_reduce_dtype` is given; True / False force it. Within one process on CPU the
        concatenation and split cost more than the in-process all-reduce saves (the MLP of
        BENCHMARKS.md's peers section was markedly slower with it), and NCCL on GPU groups a
        combined all-reduce's operands itself.

    In replica-invariant mode (`replica_invariant=True` on the strategy) the arguments after
    the module are the batch: each array has this replica's batch rows first, and `fn` runs
    once per micro-batch at the same shapes whatever the replica count (unrolled); the
    value is the pairwise sum of the micro-batches' values, the gradients their sum over
    all micro-batches of all replicas in the fixed tree (docs/design.md, "Replica
    invariance"). Aux leaves with the micro-batch's rows first come back joined into the
    replica's rows; other aux leaves come back stacked, one per micro-batch.

    Returns:
      A function `(module, *args) -> (value, grads)`, as `nnx.value_and_grad` returns.

    Raises:
      TypeError: `all_reduce_dtype` is not a floating dtype.
      UnsupportedArgumentError: `all_reduce_dtype` in replica-invariant mode.
      InvalidBatchError: replica-invariant mode and no array argument after the module, or
        one whose first axis is not the batch's.
    """
    if not callable(fn):
        raise errors.InvalidArgumentTypeError(
            f"value_and_grad: fn must be a function fn(module, *args) returning the loss; "
            f"received {fn!r} of type {type(fn).__name__}."
        )
    if pack is not None and not isinstance(pack, bool):
        raise errors.InvalidArgumentTypeError(
            f"value_and_grad: pack must be None, True or False; received {pack!r}."
        )
    try:
        floating = all_reduce_dtype is None or jnp.issubdtype(jnp.dtype(all_reduce_dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise errors.InvalidArgumentTypeError(
            "value_and_grad: all_reduce_dtype must be None or a floating dtype such as "
            f"'bfloat16'; received {all_reduce_dtype!r}."
        )

    def wrapped(module, *args):
        if invariant.active():
            return _micro_batch_value_and_grad(fn, module, args, has_aux, all_reduce_dtype)
        return packed_value_and_grad(lambda m: fn(m, *args), module, has_aux, all_reduce_dtype, pack)

    return wrapped


def _micro_batch_value_and_grad(fn, module, args, has_aux, all_reduce_dtype):
    if all_reduce_dtype is not None:
        raise errors.UnsupportedArgumentError(
            "value_and_grad: all_reduce_dtype is not supported with replica_invariant=True: "
            "the gradients are summed exactly in their own dtype, in one fixed tree. Leave "
            f"all_reduce_dtype None; received {all_reduce_dtype!r}."
        )
    # NNX objects among the arguments (a metric the loss updates) travel with the module, so
    # their updates are combined over the micro-batches; the rest is the batch.
    held = [i for i, a in enumerate(args) if isinstance(a, (nnx.Pytree, nnx.Variable))]
    batch = tuple(a for i, a in enumerate(args) if i not in held)

    def call(nodes, *batch_parts):
        rebuilt, parts = [], iter(batch_parts)
        for i in range(len(args)):
            rebuilt.append(nodes[1 + held.index(i)] if i in held else next(parts))
        return fn(nodes[0], *rebuilt)

    value, aux, grads = invariant.micro_batch_call(
        call, (module,) + tuple(args[i] for i in held), batch, differentiate=True, has_aux=has_aux
    )
    return ((value, aux) if has_aux else value), grads[0]


def packed_value_and_grad(
    loss_fn: Callable, module, has_aux: bool = False, all_reduce_dtype=None, pack: bool | None = None
):
    """`nnx.value_and_grad(loss_fn, has_aux)(module)` with gradients of `nnx.Param`s summed
    over replicas in one packed all-reduce per dtype.

    Outside a multi-replica `strategy.run`, without `pack`, or when some parameter is not a
    replicated float array, it is exactly `nnx.value_and_grad`.

    Args:
      loss_fn: `loss_fn(module)` returning a scalar loss (or `(loss, aux)` with `has_aux`).
      module: the NNX module whose `nnx.Param`s are differentiated.
      has_aux: as `nnx.value_and_grad`.

    Returns:
      `(value, grads)` as `nnx.value_and_grad`: `grads` an `nnx.State` of the parameters'
      gradients, summed over all replicas (unvarying).
    """
    ctx = current_replica_context()
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=has_aux)
    if pack is None:
        pack = all_reduce_dtype is not None or (jax.process_count() > 1 and jax.default_backend() == "cpu")
    in_step = ctx is not None and ctx.traced and ctx.num_replicas_in_sync > 1
    scatter = in_step and ctx.strategy.extended.shard_optimizer_state
    if not (pack or scatter) or not in_step:
        return grad_fn(module)
    variables = [v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)]
    originals = [v.get_value() for v in variables]
    if not originals or not all(_packable(x) for x in originals):
        return grad_fn(module)
    for variable, local in zip(variables, _varying_copies(originals)):
        variable.set_value(local)
    try:
        value, grads = grad_fn(module)
    finally:
        for variable, original in zip(variables, originals):
            variable.set_value(original)
    leaves, treedef = jax.tree.flatten(grads)
    if scatter:
        # Sharded optimizer state: each replica needs only its slice of each gradient.
        summed = sharded_optimizer.scatter_gradients(
            leaves,
            ctx.num_replicas_in_sync,
            ctx.scattered_gradients,
            all_reduce_dtype,
            (lambda whole: _packed_psum(whole, all_reduce_dtype)) if pack else None,
        )
        return value, jax.tree.unflatten(treedef, summed)
    return value, jax.tree.unflatten(treedef, _packed_psum(leaves, all_reduce_dtype))


def _packable(x) -> bool:
    return (
        isinstance(x, jax.Array)
        and jnp.issubdtype(x.dtype, jnp.floating)
        and REPLICA_AXIS not in _compat.varying_axes(x)
    )


def _by_dtype(arrays: list) -> dict:
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(jnp.dtype(a.dtype), []).append(i)
    return groups


def _concat_split(arrays: list, transform: Callable) -> list:
    """`transform` applied to the concatenation of `arrays` (per dtype), split back."""
    out = [None] * len(arrays)
    for indices in _by_dtype(arrays).values():
        flat = transform(jnp.concatenate([arrays[i].reshape(-1) for i in indices]))
        offset = 0
        for i in indices:
            size = arrays[i].size
            out[i] = flat[offset : offset + size].reshape(arrays[i].shape)
            offset += size
    return out


def _varying_copies(arrays: list) -> list:
    return _concat_split(arrays, lambda flat: _compat.pvary(flat, REPLICA_AXIS))


def _packed_psum(arrays: list, wire_dtype=None) -> list:
    def psum(flat):
        if wire_dtype is None:
            return jax.lax.psum(flat, REPLICA_AXIS)
        return jax.lax.psum(flat.astype(wire_dtype), REPLICA_AXIS).astype(flat.dtype)

    return _concat_split(arrays, psum)
