"""Distributed values: `PerReplica` (one value per replica) and `Mirrored` (one value, every replica).

A `PerReplica` holds, for each leaf, ONE global `jax.Array` of shape (num_replicas, ...) sharded
along `REPLICA_AXIS`: replica r's value is row r, stored on replica r's device. Values whose
leading sizes differ between replicas (the shards of a partial batch, or
`experimental_distribute_values_from_function` returning [1, 2, 3] and [10]) are padded to a
common size along their first axis, with a validity mask of shape (num_replicas, rows) and the
true per-replica lengths; `.values` returns the true, unpadded values. Values that cannot be
padded into one array (different trailing shapes) are kept as a tuple of per-replica arrays
("ragged"); they can be read but not passed to `run` or reduced elementwise.

Both classes are registered pytrees (the arrays are the leaves; strategy, mask and lengths ride
along as static data) and have a tf.distribute-like repr. They deliberately do not overload
arithmetic: combine them with `strategy.reduce` / `gather`, or read `.values`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrax import errors
from mirrax._src.distribute import exact_sums
from mirrax._src.distribute.reduce import ReduceOp


class _ByIdentity:
    """Makes an array usable as pytree aux data (compared and hashed by identity)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.value is self.value

    def __hash__(self):
        return id(self.value)


class DistributedValues:
    """Base of `PerReplica` and `Mirrored`: values tied to one strategy's replicas.

    Attributes:
      values: tuple with one entry per replica of THIS process (its local replicas), in replica
        order; each entry has the structure of the original value.
    """

    _strategy: Any

    @property
    def strategy(self):
        """The strategy whose replicas hold this value (mirrax's own; TF keeps it private)."""
        return self._strategy

    @property
    def values(self) -> tuple:
        raise NotImplementedError

    def __repr__(self) -> str:
        rows = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self.values))
        return f"{type(self).__name__}:{{\n{rows}\n}}"


class PerReplica(DistributedValues):
    """One value per replica, as `tf.distribute.DistributedValues` of a `PerReplica` kind.

    Made by `strategy.run` (outputs that differ across replicas), by distributed datasets (each
    element is a `PerReplica` batch) and by `strategy.experimental_distribute_values_from_function`.
    Leaves are global arrays of shape (num_replicas_in_sync, ...) sharded over `REPLICA_AXIS`.
    """

    def __init__(self, strategy, value, mask=None, lengths=None, ragged=None):
        self._strategy = strategy
        self._value = value
        self._mask = mask  # bool (num_replicas, rows) or None
        self._lengths = lengths  # true rows of EVERY replica (all processes), or None
        self._ragged = ragged  # tuple of per-local-replica values when they cannot be stacked

    @property
    def stacked(self):
        """The replicas' values stacked: a pytree of global arrays of shape
        (num_replicas_in_sync, ...), sharded over `REPLICA_AXIS`; for a batch, each replica's
        row is padded to the static per-replica size (None when the values cannot be stacked)."""
        return self._value

    @property
    def mask(self):
        """For a distributed batch: bool array (num_replicas_in_sync, rows) marking the real
        examples of each replica's padded row; None otherwise."""
        return self._mask

    @property
    def lengths(self):
        """For a distributed batch: the tuple of every replica's real example count (all
        processes), in replica order; None otherwise."""
        return self._lengths

    def _masked(self, leaf) -> bool:
        """Whether `leaf` is batch-like: its per-replica first axis is the masked axis."""
        return self._mask is not None and leaf.ndim >= 2 and leaf.shape[1] == self._mask.shape[1]

    @property
    def values(self) -> tuple:
        if self._ragged is not None:
            return self._ragged
        strategy = self._strategy
        replicas = strategy.extended.replica_devices.local_replica_ids

        def per_replica(leaf):
            rows = local_rows(leaf, strategy)
            if self._masked(leaf):
                rows = [row[: self._lengths[r]] for row, r in zip(rows, replicas)]
            return rows

        leaves, treedef = jax.tree.flatten(self._value)
        columns = [per_replica(leaf) for leaf in leaves]
        return tuple(
            jax.tree.unflatten(treedef, [column[i] for column in columns]) for i in range(len(replicas))
        )


class Mirrored(DistributedValues):
    """One value held identically by every replica, as tf.distribute's `Mirrored`.

    `strategy.run` returns outputs that JAX proves are the same on every replica (unvarying) as
    `Mirrored`; leaves are global arrays replicated over the strategy's mesh.
    """

    def __init__(self, strategy, value):
        self._strategy = strategy
        self._value = value

    @property
    def replicated(self):
        """The value: a pytree of global arrays replicated over the strategy's mesh."""
        return self._value

    @property
    def values(self) -> tuple:
        strategy = self._strategy
        leaves, treedef = jax.tree.flatten(self._value)
        columns = [local_rows(leaf, strategy, stacked=False) for leaf in leaves]
        return tuple(
            jax.tree.unflatten(treedef, [column[i] for column in columns])
            for i in range(len(strategy.extended.replica_devices.local_replica_ids))
        )


class DistributedInput:
    """Base of distributed datasets and their iterators (input.py): what `strategy.run` refuses
    as an argument, since it wants one batch, not the pipeline."""


def _flatten_per_replica(v: PerReplica):
    aux = (v._strategy, _ByIdentity(v._mask), v._lengths, v._ragged is not None)
    return ((v._ragged if v._ragged is not None else v._value),), aux


def _unflatten_per_replica(aux, children):
    strategy, mask, lengths, ragged = aux
    if ragged:
        return PerReplica(strategy, None, ragged=children[0])
    return PerReplica(strategy, children[0], mask=mask.value, lengths=lengths)


jax.tree_util.register_pytree_node(PerReplica, _flatten_per_replica, _unflatten_per_replica)
jax.tree_util.register_pytree_node(
    Mirrored, lambda v: ((v._value,), v._strategy), lambda s, c: Mirrored(s, c[0])
)


def is_distributed(x) -> bool:
    """True for `PerReplica` and `Mirrored` values."""
    return isinstance(x, DistributedValues)


def local_rows(leaf: jax.Array, strategy, stacked: bool = True) -> list:
    """The per-local-replica pieces of a global array, each on its replica's device.

    With `stacked`, `leaf` has shape (num_replicas, ...) and replica r gets `leaf[r]`; otherwise
    `leaf` is replicated and every replica gets the whole array.
    """
    if isinstance(leaf, jax.core.Tracer):  # inside a mirrax.function: rows of the traced value
        ids = strategy.extended.replica_devices.local_replica_ids
        return [leaf[r] for r in ids] if stacked else [leaf] * len(ids)
    by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
    rows = [by_device[d] for d in strategy.extended.replica_devices.local_devices]
    return [row[0] for row in rows] if stacked else rows


# -- the arithmetic of strategy.reduce and strategy.gather (validated there) ------------------------


def reduce_value(strategy, op: ReduceOp, value, axis):
    """`strategy.reduce(op, value, axis)` for one `PerReplica`, `Mirrored` or plain value whose
    owner the caller checked; see `Strategy.reduce` for the semantics and errors."""
    replicas = strategy.num_replicas_in_sync
    if isinstance(value, PerReplica):
        if value._ragged is not None:
            shapes = [jax.tree.map(np.shape, v) for v in value._ragged]
            raise errors.InvalidArgumentError(
                f"strategy.reduce: the replicas' values have shapes {shapes}, which cannot "
                "be combined into one value. Make the shapes agree (except along axis 0, "
                "which axis=0 reduces)."
            )
        return jax.tree.map(lambda x: _reduce_stacked(strategy, op, value, x, axis), value._value)
    if isinstance(value, Mirrored):
        return jax.tree.map(lambda x: _reduce_same(op, x, axis, replicas), value._value)
    if op is ReduceOp.SUM and replicas > 1:
        raise errors.InvalidArgumentError(
            f"strategy.reduce: cannot SUM the plain (non-distributed) value {value!r} over "
            f"{replicas} replicas: it is one value, not one per replica (as "
            "tf.distribute). Reduce the PerReplica value that strategy.run returned, or use "
            "MEAN."
        )
    return _reduce_same(op, jnp.asarray(value), axis, 1)


def _reduce_stacked(strategy, op: ReduceOp, value: PerReplica, x, axis):
    if strategy.replica_invariant:
        return _reduce_invariant(strategy, op, value, x, axis)
    if axis is None:
        x = _elementwise_rows(value, x)
        return x.sum(0) if op is ReduceOp.SUM else x.mean(0)
    axis = normalize_axis(axis, x.ndim - 1)
    if value._masked(x) and axis == 0:
        mask = value._mask.reshape(value._mask.shape + (1,) * (x.ndim - 2))
        total = jnp.where(mask, x, jnp.zeros((), x.dtype)).sum((0, 1))
        if op is ReduceOp.SUM:
            return total
        count = value._mask.sum()
        return total / jnp.maximum(count, 1).astype(jnp.result_type(total, jnp.float32))
    reduced = x.sum((0, axis + 1))
    if op is ReduceOp.SUM:
        return reduced
    return reduced / (x.shape[0] * x.shape[axis + 1] or 1)


def _reduce_invariant(strategy, op: ReduceOp, value: PerReplica, x, axis):
    """`_reduce_stacked` in replica-invariant mode: every float sum in the fixed tree.

    Over replicas: the pairwise tree over the replica index (which continues each replica's
    tree over its micro-batches). Along a batch's axis 0: each micro-batch's rows are summed
    at the same shape, then the micro-batches in the pairwise tree, so the bits do not depend
    on the replica count.
    """
    replicas = x.shape[0]
    if axis is None:
        x = _elementwise_rows(value, x)
        total = exact_sums.pairwise_sum(x)
        return total if op is ReduceOp.SUM else total / jnp.asarray(replicas, total.dtype)
    axis = normalize_axis(axis, x.ndim - 1)
    rows = x.shape[1] if x.ndim > 1 else 0
    micro_batches = strategy.micro_batches
    local = micro_batches // replicas
    if axis == 0 and rows % local == 0:
        micro = x.reshape((micro_batches, rows // local) + x.shape[2:])
        if value._masked(x):
            mask = value._mask.reshape(micro.shape[:2] + (1,) * (x.ndim - 2))
            micro = jnp.where(mask, micro, jnp.zeros((), x.dtype))
            count = value._mask.sum()
        else:
            count = x.shape[0] * rows
        total = exact_sums.pairwise_sum(micro.sum(1))
    else:
        total = exact_sums.pairwise_sum(x.sum(axis + 1))
        count = replicas * x.shape[axis + 1]
    if op is ReduceOp.SUM:
        return total
    return total / jnp.maximum(count, 1).astype(jnp.result_type(total, jnp.float32))


def _reduce_same(op: ReduceOp, x, axis, replicas: int):
    if axis is not None:
        axis = normalize_axis(axis, x.ndim)
        x = x.sum(axis) if op is ReduceOp.SUM else x.mean(axis)
    return x * replicas if op is ReduceOp.SUM else x


def _elementwise_rows(value: PerReplica, x):
    """`x` (a leaf of `value`, stacked) without a batch's padding rows, for an elementwise
    reduce over the replicas.

    Raises:
      ValueError: the replicas hold batches of different lengths.
    """
    if not value._masked(x):
        return x
    if len(set(value._lengths)) > 1:
        raise errors.InvalidArgumentError(
            "strategy.reduce: the replicas' values have different lengths along axis 0 "
            f"({list(value._lengths)}), so they cannot be combined elementwise. Pass "
            "axis=0 to reduce along that axis too."
        )
    return x[:, : value._lengths[0]]


def gather_value(strategy, value, axis):
    """`strategy.gather(value, axis)` for one `PerReplica`, `Mirrored` or plain value whose
    owner the caller checked; see `Strategy.gather` for the semantics and errors."""
    if isinstance(value, PerReplica):
        if value._ragged is not None:
            pieces = [jnp.asarray(v) for v in value._ragged]
            return jnp.concatenate(pieces, normalize_axis(axis, pieces[0].ndim))
        return jax.tree.map(lambda x: _gather_stacked(strategy, value, x, axis), value._value)
    if isinstance(value, Mirrored):
        value = value._value
    replicas = strategy.num_replicas_in_sync

    def repeat(x):
        if jnp.ndim(x) == 0:
            raise errors.InvalidArgumentError(
                f"strategy.gather: {x!r} is a scalar, which has no axis to concatenate "
                "along. Gather arrays of rank >= 1 (e.g. x[None], shape (1,))."
            )
        return jnp.concatenate([jnp.asarray(x)] * replicas, normalize_axis(axis, jnp.ndim(x)))

    return jax.tree.map(repeat, value)


def _gather_stacked(strategy, value: PerReplica, x, axis):
    if x.ndim == 1:
        raise errors.InvalidArgumentError(
            "strategy.gather: the per-replica values are scalars, which have no axis to "
            "concatenate along. Use strategy.experimental_local_results(value), or return "
            "x[None] (shape (1,)) from the step to gather one value per replica."
        )
    axis = normalize_axis(axis, x.ndim - 1)
    if value._masked(x) and axis == 0:
        rows = x.shape[1]
        keep = np.concatenate([r * rows + np.arange(n) for r, n in enumerate(value._lengths)]).astype(
            np.int32
        )
        return _on_every_process(strategy, lambda x: x.reshape((-1,) + x.shape[2:])[keep], x)
    return _on_every_process(strategy, lambda x: jnp.concatenate(list(x), axis), x)


def gather_to_host(strategy, value):
    """`np.asarray(strategy.gather(value, axis=0))` leaf by leaf, done on the host: one copy of
    each stacked array from its devices, then NumPy's reshape and row selection (no program on
    the devices, so a loop can queue many steps before reading their outputs). One process
    only (the caller's condition): a multi-process array is not all here.
    """
    replicas = strategy.num_replicas_in_sync

    def one(leaf):
        if isinstance(leaf, PerReplica):
            if leaf._ragged is not None:
                return np.asarray(gather_value(strategy, leaf, 0))
            return jax.tree.map(lambda x: _rows_on_host(leaf, x), leaf._value)
        value = leaf._value if isinstance(leaf, Mirrored) else leaf
        return jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * replicas), value)

    return jax.tree.map(one, value, is_leaf=is_distributed)


def _rows_on_host(value: PerReplica, x):
    if x.ndim == 1:
        return np.asarray(_gather_stacked(None, value, x, 0))  # raises the scalar message
    host = np.asarray(x)
    if value._masked(x):
        return np.concatenate([host[r, :n] for r, n in enumerate(value._lengths)])
    return host.reshape((-1,) + host.shape[2:])


def _on_every_process(strategy, fn, *args):
    """`fn(*args)` as a program whose result is replicated, so every process can read it."""
    if jax.process_count() == 1:
        return fn(*args)
    replicated = strategy.extended.replica_devices.replicated
    return jax.jit(fn, out_shardings=replicated)(*args)


def normalize_axis(axis, ndim: int) -> int:
    """`axis` in [0, ndim).

    Raises:
      TypeError: `axis` is not an int.
      ValueError: `axis` is outside [-ndim, ndim).
    """
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise errors.InvalidArgumentTypeError(f"axis must be an int or None; received {axis!r}.")
    if not -ndim <= axis < ndim:
        raise errors.InvalidArgumentError(
            f"axis {axis} is out of range for per-replica values of rank {ndim}; use an axis in "
            f"[{-ndim}, {ndim})."
        )
    return int(axis) % ndim


def check_axis_type(axis, what: str, optional: bool) -> None:
    """Refuses an `axis` argument that is not an int (or None where `optional`)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{what} must be an int{' or None' if optional else ''}; received {axis!r} of type "
            f"{type(axis).__name__}."
            + ("" if optional else " gather needs the axis to concatenate along, e.g. axis=0.")
        )
