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

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute.replica_context import REPLICA_AXIS


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
        replicas = strategy._local_replica_ids

        def per_replica(leaf):
            rows = local_rows(leaf, strategy)
            if self._masked(leaf):
                rows = [row[: self._lengths[r]] for row, r in zip(rows, replicas)]
            return rows

        leaves, treedef = jax.tree.flatten(self._value)
        columns = [per_replica(leaf) for leaf in leaves]
        return tuple(
            jax.tree.unflatten(treedef, [column[i] for column in columns])
            for i in range(len(replicas))
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
    def values(self) -> tuple:
        strategy = self._strategy
        leaves, treedef = jax.tree.flatten(self._value)
        columns = [local_rows(leaf, strategy, stacked=False) for leaf in leaves]
        return tuple(
            jax.tree.unflatten(treedef, [column[i] for column in columns])
            for i in range(len(strategy._local_replica_ids))
        )


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
    by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
    rows = [by_device[strategy._devices[r]] for r in strategy._local_replica_ids]
    return [row[0] for row in rows] if stacked else rows


def stack_host_values(values: Sequence, rows: int | None = None, fill_with_first_row=False):
    """Stacks per-replica host values into arrays with a leading replica axis.

    Args:
      values: one pytree per local replica, all with the same structure; leaves are array-likes.
      rows: pad every replica's first axis to this many rows (a distributed batch's static
        per-replica size); None pads to the largest replica when first axes differ.
      fill_with_first_row: pad with copies of the first real row of the first non-empty value
        instead of zeros (a batch: padding rows then look like real data, so a model that is
        undefined on all-zero inputs gives finite values, and gradients, there).

    Returns:
      (stacked, lengths): `stacked` is a pytree of NumPy arrays of shape (len(values), ...) or
      None when the values cannot be stacked (trailing shapes differ); `lengths` is the tuple of
      true first-axis sizes when padding was needed (or `rows` was given), else None.
    """
    flat = [jax.tree.flatten(v) for v in values]
    treedef = flat[0][1]
    for leaves, other in flat[1:]:
        if other != treedef:
            raise errors.InvalidArgumentError(
                f"Per-replica values must all have the same structure; received {treedef} and "
                f"{other}. Return the same pytree structure for every replica."
            )
    columns = [[np.asarray(leaves[i]) for leaves, _ in flat] for i in range(treedef.num_leaves)]
    same = all(len({(a.shape, a.dtype) for a in column}) == 1 for column in columns)
    if same and rows is None:
        return jax.tree.unflatten(treedef, [np.stack(column) for column in columns]), None
    lengths = None
    for column in columns:
        if any(a.ndim == 0 or a.shape[1:] != column[0].shape[1:] for a in column):
            return None, None
        column_lengths = tuple(a.shape[0] for a in column)
        if lengths is not None and column_lengths != lengths:
            return None, None
        lengths = column_lengths
    target = rows if rows is not None else max(lengths)
    donor = next((i for i, n in enumerate(lengths) if n), None)
    stacked = []
    for column in columns:
        out = np.zeros((len(column), target) + column[0].shape[1:], np.result_type(*column))
        if fill_with_first_row and donor is not None:
            out[...] = column[donor][0]
        for i, a in enumerate(column):
            out[i, : a.shape[0]] = a
        stacked.append(out)
    return jax.tree.unflatten(treedef, stacked), lengths


def put_stacked(strategy, host):
    """Places host arrays of shape (num_local_replicas, ...) as global (num_replicas, ...) arrays,
    row r on replica r's device (sharded along `REPLICA_AXIS`)."""
    sharding = NamedSharding(strategy.mesh, P(REPLICA_AXIS))
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(
            sharding, a, (strategy.num_replicas_in_sync,) + a.shape[1:]
        ),
        host,
    )


def by_replica(strategy, per_process: Sequence[Sequence]) -> tuple:
    """Lays out per-process lists (one entry per LOCAL replica of that process, in replica
    order) as one tuple over all of `strategy`'s replicas."""
    taken: dict = {}
    out = []
    for device in strategy._devices:
        p = device.process_index
        out.append(per_process[p][taken.get(p, 0)])
        taken[p] = taken.get(p, 0) + 1
    return tuple(out)


def mask_from_lengths(lengths: Sequence[int], rows: int) -> np.ndarray:
    """Bool array (len(lengths), rows): True for the first lengths[r] rows of replica r."""
    return np.arange(rows)[None, :] < np.asarray(lengths)[:, None]
