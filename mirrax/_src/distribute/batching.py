"""Global batches to per-replica shards on the devices: host conversion, the split (TF's ceil
split, or replica-invariant mode's contiguous one), padding to a static shape with a validity
mask and placement. The processes' agreement on each step's shards is input_agreement.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import host_tensors, invariant
from mirrax._src.distribute.values import PerReplica


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
    for _, other in flat[1:]:
        # jaxlib ships PyTreeDef (jaxlib/_jax.so) without type stubs: mypy cannot type its methods.
        if other != treedef:  # type: ignore[operator]
            raise errors.InvalidArgumentError(
                f"Per-replica values must all have the same structure; received {treedef} and "
                f"{other}. Return the same pytree structure for every replica."
            )
    # jaxlib ships PyTreeDef (jaxlib/_jax.so) without type stubs: mypy cannot type its methods.
    num_leaves = treedef.num_leaves  # type: ignore[attr-defined]
    columns = [[np.asarray(leaves[i]) for leaves, _ in flat] for i in range(num_leaves)]
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
    row r on replica r's device (sharded along `REPLICA_AXIS`). The arrays are new buffers
    (never views of the host arrays)."""
    replica_devices = strategy.extended.replica_devices
    sharding = replica_devices.stacked
    if not replica_devices.spans_processes:
        leaves = jax.tree.leaves(host)
        if (
            _jitted_placement(replica_devices)
            and all(type(a) is np.ndarray for a in leaves)
            and sum(a.nbytes for a in leaves) <= _JITTED_PLACEMENT_BYTES
        ):
            return _single_device_put(sharding)(host)
        return jax.device_put(host, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(
            sharding, a, (strategy.num_replicas_in_sync,) + a.shape[1:]
        ),
        host,
    )


# Small batches on one CPU device are placed by a jitted identity, which takes NumPy arrays in
# C++, where jax.device_put's Python costs about 100 µs per call (measured on 2 cores: 12 vs
# 112 µs for a batch of 8 rows of 32 floats and its labels; fit of a 32-64-10 MLP at batch 8
# 0.41 -> 0.20 ms/step). Its copy runs on the device's queue, behind the running step: at
# 128 rows of 784 floats (400 KB) evaluate was 1.31-1.39x the hand-written loop with
# device_put and 1.42-1.44x with the jitted copy, so larger batches keep device_put. With 4
# devices the jitted path is slower (220 vs 150 µs); on accelerators it is not measured yet.
_JITTED_PLACEMENT_BYTES = 64 * 1024


def _jitted_placement(replica_devices) -> bool:
    """Whether small NumPy batches go through `_single_device_put` (one CPU device)."""
    return len(replica_devices) == 1 and replica_devices.devices[0].platform == "cpu"


@functools.lru_cache(maxsize=16)
def _single_device_put(sharding):
    """`jax.device_put(host, sharding)` for NumPy pytrees on a one-device `sharding`, jitted."""
    return jax.jit(lambda host: host, in_shardings=sharding, out_shardings=sharding)


def by_replica(strategy, per_process: Sequence[Sequence]) -> tuple:
    """Lays out per-process lists (one entry per LOCAL replica of that process, in replica
    order) as one tuple over all of `strategy`'s replicas."""
    taken: dict = {}
    out = []
    for device in strategy.extended.replica_devices.devices:
        p = device.process_index
        out.append(per_process[p][taken.get(p, 0)])
        taken[p] = taken.get(p, 0) + 1
    return tuple(out)


def mask_from_lengths(lengths: Sequence[int], rows: int) -> np.ndarray:
    """Bool array (len(lengths), rows): True for the first lengths[r] rows of replica r."""
    return np.arange(rows)[None, :] < np.asarray(lengths)[:, None]


def is_array(x) -> bool:
    """True for a batch leaf that converts to a NumPy array (NumPy, JAX, tf.Tensor,
    torch.Tensor, anything with `__array__`)."""
    return isinstance(x, (np.ndarray, jax.Array)) or hasattr(x, "numpy") or hasattr(x, "__array__")


# A leaf without a batch axis, or leaves of different lengths, usually mean that a dataset of
# single examples was given where batches go.
UNBATCHED_HINT = (
    "If the dataset yields single examples rather than batches (a Hugging Face "
    "datasets.Dataset, a torch Dataset or a Grain MapDataset iterated directly), batch it "
    "first: ds.iter(batch_size=B) or ds.batch(B) (Hugging Face), DataLoader(ds, batch_size=B) "
    "(torch), dataset.batch(B) (Grain, tf.data)."
)


def to_host_batch(batch):
    """Converts a batch's leaves to NumPy and checks they share one leading (batch) size.

    Returns:
      (host_batch, n): the batch with NumPy leaves, and its number of examples.

    Raises:
      InvalidBatchError: a leaf is not an array, is a scalar, or the leading sizes differ.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not with_paths:
        raise errors.InvalidBatchError(f"A batch must contain at least one array; received {batch!r}.")
    leaves, sizes = [], {}
    for path, leaf in with_paths:
        name = "batch" + jax.tree_util.keystr(path)
        leaf = host_tensors.to_numpy(leaf)
        if not isinstance(leaf, (np.ndarray, jax.Array, np.generic)):
            raise errors.InvalidBatchError(
                f"{name} is a {type(leaf).__name__} ({leaf!r:.60}); every leaf of a batch must be "
                "an array whose first axis is the batch (NumPy, JAX, tf.Tensor, torch.Tensor). "
                "Convert it with np.asarray, or drop it from the batch."
            )
        leaf = np.asarray(leaf)
        if not host_tensors.is_numeric(leaf.dtype):
            raise errors.InvalidBatchError(
                f"{name} has dtype {leaf.dtype}, which is not numeric; batches must hold "
                "numbers (bool, int, float, complex). Encode text or objects as numbers before "
                "distributing the dataset."
            )
        if leaf.ndim == 0:
            raise errors.InvalidBatchError(
                f"{name} is a scalar ({leaf!r}); every leaf of a batch needs a leading batch "
                "axis. Give it shape (batch_size, ...), e.g. np.full(batch_size, value). " + UNBATCHED_HINT
            )
        leaves.append(leaf)
        sizes[name] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise errors.InvalidBatchError(
            f"The leaves of a batch have different leading (batch) sizes ({listing}); every "
            "leaf must hold the same number of examples along its first axis. " + UNBATCHED_HINT
        )
    return jax.tree.unflatten(treedef, leaves), leaves[0].shape[0]


class Placer:
    """Pads per-replica shards to a static row count and places them, with the mask."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.rows: int | None = None
        self._full_masks: dict = {}

    def place(self, shards: list, first_size_name: str, lengths=None, all_lengths=None):
        """The batch as its structure with a `PerReplica` per leaf (TF's element structure).

        Every leaf shares one mask and the true lengths, so `for x, y in dist_dataset` works as
        in TF and `strategy.run` finds the mask on any of them.

        Args:
          shards: one host pytree per local replica.
          first_size_name: how the first batch is described when it is empty.
          lengths: the true rows of each local shard; None reads them from `shards` (given
            when `shards` are filler rows of a worker whose data has ended).
          all_lengths: the true rows of EVERY replica (all processes), agreed between the
            processes; None in a single-process run (then `lengths`).
        """
        if lengths is None:
            lengths = tuple(jax.tree.leaves(s)[0].shape[0] for s in shards)
        all_lengths = tuple(lengths) if all_lengths is None else tuple(all_lengths)
        if self.rows is None and self.strategy.replica_invariant:
            # Shards come padded to the mode's fixed rows (split_invariant), even a first
            # batch that is partial.
            self.rows = max(jax.tree.leaves(s)[0].shape[0] for s in shards)
        if self.rows is None:
            if max(all_lengths) == 0:
                raise errors.InvalidBatchError(
                    f"The first batch gives every replica 0 examples ({first_size_name}); "
                    "nothing can be trained on. Check the batch size and that the dataset is "
                    "not empty."
                )
            self.rows = max(all_lengths)
        # A later batch larger than the first grows the static size (one recompilation).
        self.rows = max(self.rows, max(all_lengths))
        # Padding rows repeat a real example: finite wherever the model is finite on real data.
        stacked, _ = stack_host_values(shards, rows=self.rows, fill_with_first_row=True)
        mask = self.mask(tuple(lengths))
        return jax.tree.map(
            lambda a: PerReplica(self.strategy, a, mask, all_lengths),
            put_stacked(self.strategy, stacked),
        )

    def mask(self, lengths):
        """The placed bool (num_replicas, rows) mask of a batch with these per-replica lengths
        (full batches' mask made once)."""
        rows = self.rows
        assert rows is not None  # the first batch placed fixed it
        if all(n == rows for n in lengths):
            key = (rows, len(lengths))
            if key not in self._full_masks:
                self._full_masks[key] = put_stacked(self.strategy, mask_from_lengths(lengths, rows))
            return self._full_masks[key]
        return put_stacked(self.strategy, mask_from_lengths(lengths, rows))

    def group_mask(self, count: int):
        """The placed all-True bool (num_replicas, count, rows) mask of `count` full batches
        placed as one (`place_group`), made once per count."""
        rows = self.rows
        assert rows is not None  # a HostBatch exists only once the rows are fixed
        key = ("group", rows, count)  # not a one-batch mask's (rows, replicas)
        if key not in self._full_masks:
            replicas = len(self.strategy.extended.replica_devices.local_replica_ids)
            self._full_masks[key] = put_stacked(self.strategy, np.ones((replicas, count, rows), bool))
        return self._full_masks[key]


class HostBatch:
    """A full global batch cut for the replicas, not yet placed: host arrays of shape
    (num_replicas, rows, ...) (`place_host_batches(..., defer=True)`). `place()` places it as
    the distributed batch it stands for; `place_group` places several consecutive ones as one.
    """

    __slots__ = ("host", "placer", "rows", "signature")

    def __init__(self, host, placer: Placer, rows: int, signature: tuple):
        # signature: the structure, shapes and dtypes (what batches placed as one share).
        self.host, self.placer, self.rows, self.signature = host, placer, rows, signature

    def place(self):
        """The distributed batch (a `PerReplica` per leaf, every row real)."""
        strategy = self.placer.strategy
        lengths = (self.rows,) * strategy.num_replicas_in_sync
        mask = self.placer.mask(lengths)
        return jax.tree.map(
            lambda a: PerReplica(strategy, a, mask, lengths), put_stacked(strategy, self.host)
        )


def place_group(batches: list):
    """Consecutive batches of one call (`steps_per_execution`) placed as ONE distributed batch
    of (num_replicas, k, rows, ...) arrays, its mask (num_replicas, k, rows), when all k are
    `HostBatch`es of one signature (one `device_put` per leaf for the k, not k of them); else
    None. A replica's value is then its k batches stacked on a leading axis, and its lengths
    those of one batch (every row real)."""
    first = batches[0]
    if len(batches) < 2 or not isinstance(first, HostBatch):
        return None
    if not all(
        isinstance(b, HostBatch) and b.placer is first.placer and b.signature == first.signature
        for b in batches
    ):
        return None
    strategy = first.placer.strategy
    host = jax.tree.map(lambda *parts: np.stack(parts, axis=1), *(b.host for b in batches))
    mask = first.placer.group_mask(len(batches))
    lengths = (first.rows,) * strategy.num_replicas_in_sync
    return jax.tree.map(lambda a: PerReplica(strategy, a, mask, lengths), put_stacked(strategy, host))


def split_global_batch(host_batch, n: int, num_replicas: int, replica_ids) -> list:
    """TF's split rule: replica r gets examples [r*c, min(n, (r+1)*c)) with c = ceil(n/R)."""
    per = math.ceil(n / num_replicas)
    return [
        jax.tree.map(lambda a, r=r: a[min(r * per, n) : min(n, (r + 1) * per)], host_batch)
        for r in replica_ids
    ]


def invariant_rows(strategy, rows, n: int, what: str) -> int:
    """The per-replica rows of replica-invariant mode: the first global batch / replicas.

    Raises:
      InvalidBatchError: the first global batch is not a multiple of `strategy.micro_batches`.
    """
    if rows is not None:
        return rows
    invariant.check_global_batch(what, n, strategy.micro_batches)
    return n // strategy.num_replicas_in_sync


def split_invariant(strategy, host_batch, n: int, rows: int, replica_ids) -> tuple[list, list]:
    """Replica-invariant mode's split: replica r gets the global batch's rows [r*rows, (r+1)*rows).

    A partial batch fills the micro-batches in order and is padded at its end with copies of
    its first example, so real examples and padding sit at the same global positions whatever
    the replica count (TF's ceil split would move them).

    Returns:
      (shards, lengths): one shard of exactly `rows` rows per replica of `replica_ids`, and the
      number of real examples in each.

    Raises:
      InvalidBatchError: the batch is larger than the first one (the micro-batch size is
        fixed by the first batch).
    """
    total = rows * strategy.num_replicas_in_sync
    if n > total:
        raise errors.InvalidBatchError(
            f"replica_invariant=True: a global batch of {n} examples is larger than the first "
            f"batch ({total}), which fixed the micro-batch size at {total // strategy.micro_batches}. "
            "Give every batch at most the first batch's size (only the last may be smaller)."
        )

    def pad(a):
        a = np.asarray(a)
        if n == total:
            return a
        filler = a[:1] if n else np.zeros((1,) + a.shape[1:], a.dtype)
        return np.concatenate([a, np.repeat(filler, total - n, axis=0)])

    padded = jax.tree.map(pad, host_batch)
    shards = [jax.tree.map(lambda a, r=r: a[r * rows : (r + 1) * rows], padded) for r in replica_ids]
    lengths = [min(max(n - r * rows, 0), rows) for r in replica_ids]
    return shards, lengths


def place_host_batches(
    strategy, batches, batch_size: int | None = None, what: str = "the input", defer: bool = False
) -> Iterator:
    """Distributed batches of host global batches, made in the caller's thread, one process.

    The same batches `experimental_distribute_dataset(batches)` yields (TF's split rule, the
    first batch's per-replica size, padding and mask), made more cheaply: a global batch that
    splits evenly over the replicas is reshaped to (replicas, rows, ...) and placed with one
    `device_put` per leaf; others (the first and the partial last batch) go through the general
    `Placer`. On CPU `device_put` may alias a NumPy array instead of copying it, so the batches
    must not be modified while their steps run. `batch_size` fixes the micro-batch size in
    replica-invariant mode (default: the first batch's size); `what` names the input in errors.
    `defer` (not in replica-invariant mode): yield each batch that splits evenly as a
    `HostBatch`, placed later by its consumer (alone, or k at once by `place_group`); the first
    batch fixes the rows as the general path would.
    """
    placer = Placer(strategy)
    replicas = strategy.num_replicas_in_sync
    local = strategy.extended.replica_devices.local_replica_ids
    defer = defer and not strategy.replica_invariant
    checked = False
    for batch in batches:
        if not checked:
            batch, n = to_host_batch(batch)  # dtypes and sizes, once per pass
            checked = True
            if batch_size is None:
                batch_size = n
        leaves, treedef = jax.tree.flatten(batch)
        n = len(leaves[0])
        rows = n // replicas
        if defer and placer.rows is None and n % replicas == 0 and rows > 0:
            placer.rows = rows  # what Placer.place fixes for an even first batch
        if n % replicas == 0 and rows == placer.rows:
            if defer:  # flatten / unflatten: a tree.map here cost as much as the rest per batch
                cut = [a.reshape((replicas, rows) + a.shape[1:]) for a in leaves]
                signature = (treedef, tuple((a.shape, a.dtype) for a in cut))
                yield HostBatch(jax.tree.unflatten(treedef, cut), placer, rows, signature)
                continue
            lengths = (rows,) * replicas
            mask = placer.mask(lengths)
            # On the flat leaves, unflattened once: two tree.maps cost 5 µs of a 60 µs batch.
            placed = put_stacked(strategy, [a.reshape((replicas, rows) + a.shape[1:]) for a in leaves])
            yield jax.tree.unflatten(treedef, [PerReplica(strategy, a, mask, lengths) for a in placed])
        elif strategy.replica_invariant:
            # The batch size, not the first batch (which may be the only, partial, one), fixes
            # the micro-batch size.
            rows = invariant_rows(strategy, placer.rows, batch_size, f"{what} (batch_size)")
            shards, lengths = split_invariant(strategy, batch, n, rows, local)
            yield placer.place(shards, f"global batch of {n} over {replicas} replicas", lengths=lengths)
        else:
            shards = split_global_batch(batch, n, replicas, local)
            yield placer.place(shards, f"global batch of {n} over {replicas} replicas")
