"""Distributed input: split global batches over replicas (or deal per-replica batches), pad
partial batches to a static shape with a mask, and move them to the devices ahead of use.

Accepted sources: a tuple/dict of arrays (ONE batch), any iterable of batches (list, generator,
Grain loader, PyTorch DataLoader), or an object with `as_numpy_iterator()` (tf.data). Leaves
may be NumPy or JAX arrays or anything with `.numpy()` (tf.Tensor, torch.Tensor).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import queue
import threading
import warnings
import zlib
from typing import Callable, Iterator

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import invariant, multihost
from mirrax._src.distribute.values import (
    PerReplica,
    by_replica,
    mask_from_lengths,
    put_stacked,
    stack_host_values,
)


class AutoShardPolicy(enum.Enum):
    """How a multi-worker run splits a dataset between workers, as TF's enum of that name.

    AUTO: FILE when the dataset is a `mirrax.data.FileDataset` with at least as many files as
    workers, else DATA. FILE: worker i reads only files i, i + W, ... (W workers), in batches of
    global_batch / W. DATA: every worker reads every global batch and keeps its replicas' part
    (as one process with all the devices would split it). OFF: no sharding; every worker reads
    all the data, global_batch / W examples per step (so each example is seen W times per epoch).
    With one worker every policy reads the data once.
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed input, as `tf.distribute.InputOptions`.

    Attributes:
      experimental_fetch_to_device: move batches to the replicas' devices in a background
        thread ahead of use (True), or when the iterator is advanced (False).
      experimental_per_replica_buffer_size: how many batches the background thread keeps ready
        on the devices (an int >= 1; default 2).
      experimental_auto_shard_policy: an `AutoShardPolicy` (or its name): how
        `experimental_distribute_dataset` splits the data between workers (default AUTO).
        `distribute_datasets_from_function` never shards (its function shards, as in TF).
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 2
    experimental_auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    # TF's other options, accepted so TF programs run, refused when they ask for a behaviour
    # mirrax does not have.
    experimental_place_dataset_on_device: bool = False
    experimental_replication_mode: object = None

    def __post_init__(self):
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise errors.InvalidArgumentTypeError(
                    f"InputOptions.{name} must be True or False; received "
                    f"{getattr(self, name)!r} of type {type(getattr(self, name)).__name__}."
                )
        if self.experimental_place_dataset_on_device:
            raise errors.UnsupportedArgumentError(
                "InputOptions(experimental_place_dataset_on_device=True) is not supported: "
                "mirrax's input pipeline runs on the host and a background thread moves each "
                "batch to the devices ahead of use. Use experimental_fetch_to_device=True (the "
                "default) instead."
            )
        mode = self.experimental_replication_mode
        if mode is not None and str(getattr(mode, "name", mode)).upper() != "PER_WORKER":
            raise errors.UnsupportedArgumentError(
                "InputOptions.experimental_replication_mode: only PER_WORKER (one input "
                f"pipeline per worker, TF's default) is supported; received {mode!r}. Leave it "
                "out."
            )
        policy = self.experimental_auto_shard_policy
        if isinstance(policy, str) and policy.upper() in AutoShardPolicy.__members__:
            object.__setattr__(self, "experimental_auto_shard_policy",
                               AutoShardPolicy[policy.upper()])
        elif not isinstance(policy, AutoShardPolicy):
            raise errors.InvalidArgumentError(
                "InputOptions.experimental_auto_shard_policy must be one of "
                f"{[m.name for m in AutoShardPolicy]}; received {policy!r}."
            )
        size = self.experimental_per_replica_buffer_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise errors.InvalidArgumentError(
                "InputOptions.experimental_per_replica_buffer_size must be an int >= 1; "
                f"received {size!r}."
            )


class InputContext:
    """What an input pipeline needs to know to shard itself, as `tf.distribute.InputContext`.

    Attributes:
      num_input_pipelines: number of input pipelines (one per worker process).
      input_pipeline_id: this pipeline's index in [0, num_input_pipelines).
      num_replicas_in_sync: replicas over all workers.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        for name, value, low in (("num_input_pipelines", num_input_pipelines, 1),
                                 ("input_pipeline_id", input_pipeline_id, 0),
                                 ("num_replicas_in_sync", num_replicas_in_sync, 1)):
            _check_count(f"InputContext: {name}", value, low)
        if input_pipeline_id >= num_input_pipelines:
            raise errors.InvalidArgumentError(
                f"InputContext: input_pipeline_id must be in [0, num_input_pipelines) = [0, "
                f"{num_input_pipelines}); received {input_pipeline_id}."
            )
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync` (examples per replica per step).

        Raises:
          ValueError: `global_batch_size` is not divisible by `num_replicas_in_sync`.
        """
        _check_count("get_per_replica_batch_size: global_batch_size", global_batch_size, 1)
        if global_batch_size % self.num_replicas_in_sync:
            raise errors.InvalidArgumentError(
                f"The global_batch_size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}. Use a multiple of "
                f"{self.num_replicas_in_sync}, e.g. "
                f"{math.ceil(global_batch_size / self.num_replicas_in_sync) * self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
            f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def check_one_argument(fn, what: str, argument: str) -> None:
    """Raises when `fn` cannot be called with one positional argument (`argument`).

    Checked before the call, so a TypeError raised inside `fn` is never mistaken for this.
    """
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"{what} must take one argument, the {argument}; received "
            f"{getattr(fn, '__name__', fn)!r} with signature {inspect.signature(fn)}. Define it "
            f"as def fn(ctx): ... (ctx is a mirrax.{argument})."
        ) from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass


def _check_count(what: str, value, low: int) -> None:
    """Raises unless `value` is an int >= `low` (a count; bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{what} must be an int >= {low}; received {value!r} of type {type(value).__name__}."
        )
    if value < low:
        raise errors.InvalidArgumentError(f"{what} must be an int >= {low}; received {value}.")


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """The argument of `experimental_distribute_values_from_function`'s `value_fn`.

    As `tf.distribute.experimental.ValueContext`.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def _check_options(options) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise errors.InvalidArgumentTypeError(
            f"options must be a mirrax.InputOptions or None; received {type(options).__name__}."
        )
    return options


def _batch_source(dataset) -> Callable[[], Iterator]:
    """A function that starts a fresh pass over `dataset`'s batches.

    A one-shot iterator (a generator) can make one pass only; a second pass raises instead of
    silently yielding nothing (which would train later epochs on no data).
    """
    if hasattr(dataset, "as_numpy_iterator"):
        return lambda: iter(dataset.as_numpy_iterator())
    if isinstance(dataset, list) and not dataset:
        raise errors.EmptyDatasetError(
            "The dataset is an empty list: it holds no batch, so a loop over it would train on "
            "nothing. Pass a list of batches (tuples/dicts of arrays of the global batch size), "
            "or one batch as a tuple of arrays, e.g. (x, y)."
        )
    if isinstance(dataset, (tuple, dict, np.ndarray, jax.Array)) and all(
        _is_array(leaf) for leaf in jax.tree.leaves(dataset)
    ):
        return lambda: iter([dataset])
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__"):
        hint = ""
        if callable(dataset):
            hint = (f" {getattr(dataset, '__name__', 'It')} is a function: pass what it returns, "
                    f"e.g. experimental_distribute_dataset({getattr(dataset, '__name__', 'fn')}"
                    "()), or use distribute_datasets_from_function for a function of the "
                    "InputContext.")
        raise errors.InvalidArgumentTypeError(
            "The dataset must be a tuple/dict of arrays (one global batch), an iterable of such "
            "batches (list, generator, Grain loader, torch DataLoader) or a tf.data.Dataset; "
            f"received {type(dataset).__name__} ({dataset!r:.60}).{hint}"
        )
    if iter(dataset) is not dataset:
        return lambda: iter(dataset)
    passes = []

    def one_pass():
        if passes:
            raise RuntimeError(
                f"This distributed dataset was made from a one-shot iterator "
                f"({type(dataset).__name__}), which was used up by the previous pass; a second "
                "pass would yield no batches. Pass something that can be iterated again (a "
                "list of batches, a Grain dataset, a tf.data.Dataset), or call "
                "experimental_distribute_dataset(make_generator()) once per epoch."
            )
        passes.append(1)
        return dataset

    return one_pass


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) or hasattr(x, "numpy") or hasattr(x, "__array__")


def to_host_batch(batch):
    """Converts a batch's leaves to NumPy and checks they share one leading (batch) size.

    Returns:
      (host_batch, n): the batch with NumPy leaves, and its number of examples.

    Raises:
      InvalidBatchError: a leaf is not an array, is a scalar, or the leading sizes differ.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not with_paths:
        raise errors.InvalidBatchError(
            f"A batch must contain at least one array; received {batch!r}."
        )
    leaves, sizes = [], {}
    for path, leaf in with_paths:
        name = "batch" + jax.tree_util.keystr(path)
        if hasattr(leaf, "numpy") and not isinstance(leaf, (np.ndarray, jax.Array)):
            # A torch tensor that tracks gradients or lives on a GPU has no direct .numpy().
            if hasattr(leaf, "detach"):
                leaf = leaf.detach()
            if hasattr(leaf, "cpu"):
                leaf = leaf.cpu()
            leaf = leaf.numpy()
        if not isinstance(leaf, (np.ndarray, jax.Array, np.generic)):
            raise errors.InvalidBatchError(
                f"{name} is a {type(leaf).__name__} ({leaf!r:.60}); every leaf of a batch must be "
                "an array whose first axis is the batch (NumPy, JAX, tf.Tensor, torch.Tensor). "
                "Convert it with np.asarray, or drop it from the batch."
            )
        leaf = np.asarray(leaf)
        if leaf.dtype.kind not in "biufc":
            raise errors.InvalidBatchError(
                f"{name} has dtype {leaf.dtype}, which is not numeric; batches must hold "
                "numbers (bool, int, float, complex). Encode text or objects as numbers before "
                "distributing the dataset."
            )
        if leaf.ndim == 0:
            raise errors.InvalidBatchError(
                f"{name} is a scalar ({leaf!r}); every leaf of a batch needs a leading batch "
                "axis. Give it shape (batch_size, ...), e.g. np.full(batch_size, value)."
            )
        leaves.append(leaf)
        sizes[name] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise errors.InvalidBatchError(
            f"The leaves of a batch have different leading (batch) sizes ({listing}); every "
            "leaf must hold the same number of examples along its first axis."
        )
    return jax.tree.unflatten(treedef, leaves), leaves[0].shape[0]


class _Placer:
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
        mask = self._mask(tuple(lengths))
        return jax.tree.map(
            lambda a: PerReplica(self.strategy, a, mask, all_lengths),
            put_stacked(self.strategy, stacked),
        )

    def _mask(self, lengths):
        if all(n == self.rows for n in lengths):
            key = (self.rows, len(lengths))
            if key not in self._full_masks:
                self._full_masks[key] = put_stacked(
                    self.strategy, mask_from_lengths(lengths, self.rows)
                )
            return self._full_masks[key]
        return put_stacked(self.strategy, mask_from_lengths(lengths, self.rows))


def split_global_batch(host_batch, n: int, num_replicas: int, replica_ids) -> list:
    """TF's split rule: replica r gets examples [r*c, min(n, (r+1)*c)) with c = ceil(n/R)."""
    per = math.ceil(n / num_replicas)
    return [
        jax.tree.map(lambda a: a[min(r * per, n) : min(n, (r + 1) * per)], host_batch)
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
    shards = [jax.tree.map(lambda a: a[r * rows:(r + 1) * rows], padded) for r in replica_ids]
    lengths = [min(max(n - r * rows, 0), rows) for r in replica_ids]
    return shards, lengths


class DistributedDataset:
    """A dataset of global batches, split over replicas; iterate it for `PerReplica` batches.

    Made by `strategy.experimental_distribute_dataset`. Iterable any number of times (each
    pass restarts the source, when the source can restart).
    """

    def __init__(self, strategy, dataset, options=None):
        self._strategy = strategy
        self._options = _check_options(options)
        self._policy = _shard_policy(dataset, self._options.experimental_auto_shard_policy)
        if self._policy is AutoShardPolicy.FILE:
            workers = jax.process_count()
            dataset = dataset.shard(workers, jax.process_index(),
                                    _worker_batch_size(dataset.batch_size, workers))
        self._source = _batch_source(dataset)
        self._placer = _Placer(strategy)
        self._rows = None  # replica-invariant mode: per-replica rows, fixed by the first batch
        self._uid = _new_dataset_uid(strategy, "experimental_distribute_dataset")

    def _local_batches(self) -> Iterator[tuple]:
        strategy = self._strategy
        invariant_mode = strategy.replica_invariant
        if invariant_mode and self._policy is not AutoShardPolicy.DATA and jax.process_count() > 1:
            raise errors.UnsupportedArgumentError(
                f"experimental_distribute_dataset: replica_invariant=True needs every worker to "
                f"read the same global batches (AutoShardPolicy.DATA), so that each batch is cut "
                f"by position; this dataset is sharded by {self._policy.name}. Pass "
                "InputOptions(experimental_auto_shard_policy=mirrax.AutoShardPolicy.DATA) or a "
                "dataset every worker reads whole."
            )
        if self._policy is AutoShardPolicy.DATA or invariant_mode:
            for batch in self._source():
                host, n = to_host_batch(batch)
                name = f"global batch of {n} over {strategy.num_replicas_in_sync} replicas"
                fingerprint = _fingerprint(host, n) if jax.process_count() > 1 else n
                if invariant_mode:
                    self._rows = invariant_rows(strategy, self._rows, n,
                                                "experimental_distribute_dataset")
                    shards, lengths = split_invariant(strategy, host, n, self._rows,
                                                      strategy._local_replica_ids)
                    yield shards, name, fingerprint, lengths
                    continue
                shards = split_global_batch(
                    host, n, strategy.num_replicas_in_sync, strategy._local_replica_ids
                )
                yield shards, name, fingerprint, None
            return
        # FILE and OFF: this worker's batches hold global_batch / W examples; its replicas split
        # them by TF's rule as if they were all the replicas there are.
        local = len(strategy._local_replica_ids)
        for batch in self._source():
            host, n = to_host_batch(batch)
            if self._policy is AutoShardPolicy.OFF:
                per_worker = math.ceil(n / jax.process_count())
                pieces = [jax.tree.map(lambda a: a[i : i + per_worker], host)
                          for i in range(0, n, per_worker)]
            else:
                pieces = [host]
            for piece in pieces:
                size = jax.tree.leaves(piece)[0].shape[0]
                yield (split_global_batch(piece, size, local, range(local)),
                       f"worker batch of {size} over {local} replicas", None, None)

    def __iter__(self) -> "DistributedIterator":
        producer = place_agreed(self._strategy, self._placer, self._local_batches(),
                                self._uid, _next_iteration(self._strategy))
        return DistributedIterator(producer, self._options)


class DistributedDatasetsFromFunction:
    """Per-worker datasets of per-replica batches, dealt to the local replicas in turn.

    Made by `strategy.distribute_datasets_from_function`; `dataset_fn` is called once, here.
    When the source ends part-way through a round, the remaining replicas get empty shards.
    """

    def __init__(self, strategy, dataset_fn, options=None):
        self._strategy = strategy
        self._options = _check_options(options)
        self.input_context = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        check_one_argument(dataset_fn, "distribute_datasets_from_function: dataset_fn",
                           "InputContext")
        if strategy.replica_invariant:
            warnings.warn(
                "distribute_datasets_from_function on a strategy with replica_invariant=True: "
                "its batches are per replica, so which examples share a step depends on the "
                "replica count and results are not replica-invariant. Use "
                "experimental_distribute_dataset with global batches for that.", stacklevel=3)
        self._source = _batch_source(dataset_fn(self.input_context))
        self._placer = _Placer(strategy)
        self._uid = _new_dataset_uid(strategy, "distribute_datasets_from_function")

    def _local_batches(self) -> Iterator[tuple[list, str]]:
        local = len(self._strategy._local_replica_ids)
        round_: list = []
        for batch in self._source():
            round_.append(to_host_batch(batch)[0])
            if len(round_) == local:
                yield round_, "per-replica batch of 0", None, None
                round_ = []
        if round_:
            empty = jax.tree.map(lambda a: a[:0], round_[0])
            yield round_ + [empty] * (local - len(round_)), "per-replica batch of 0", None, None

    def __iter__(self) -> "DistributedIterator":
        producer = place_agreed(self._strategy, self._placer, self._local_batches(),
                                self._uid, _next_iteration(self._strategy))
        return DistributedIterator(producer, self._options)


def _fingerprint(host_batch, n: int) -> str:
    """A short digest of a global batch's bytes: DATA-sharded workers must all read the same.

    CRC-32 of every leaf's bytes (about 5 GB/s: 0.6 ms for a 3 MB batch of 256 CIFAR-10 images
    in float32), computed in the prefetch thread; equal data give equal digests on any host.
    """
    crc = 0
    for leaf in jax.tree.leaves(host_batch):
        crc = zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8), crc)
    return f"{n} examples, CRC-32 {crc:08x}"


def _signature(shards: list) -> str:
    """The batch's structure, trailing shapes and dtypes: what every worker must agree on."""
    leaves, treedef = jax.tree.flatten(shards[0])
    return f"{treedef} " + ", ".join(f"{a.dtype}{list(a.shape[1:])}" for a in leaves)


def _shard_policy(dataset, policy: AutoShardPolicy) -> AutoShardPolicy:
    """The policy in effect for `dataset`: AUTO resolved; one worker → DATA (docs/design.md,
    "Input").

    Raises:
      ValueError: FILE on a dataset that is not a FileDataset, or with fewer files than
        workers (the message suggests DATA).
    """
    from mirrax._src.data.files import FileDataset

    workers = jax.process_count()
    if workers == 1:
        return AutoShardPolicy.DATA
    files = len(dataset.files) if isinstance(dataset, FileDataset) else None
    if policy is AutoShardPolicy.AUTO:
        return AutoShardPolicy.FILE if files is not None and files >= workers else (
            AutoShardPolicy.DATA)
    if policy is AutoShardPolicy.FILE and files is None:
        raise errors.InvalidArgumentError(
            f"AutoShardPolicy.FILE needs a dataset made of files (mirrax.data.FileDataset); "
            f"received a {type(dataset).__name__}. Use AutoShardPolicy.DATA (every worker reads "
            "each global batch and keeps its part) or wrap the files in FileDataset."
        )
    if policy is AutoShardPolicy.FILE and files < workers:
        raise errors.InvalidArgumentError(
            f"AutoShardPolicy.FILE: the dataset has {files} file(s) for {workers} workers, so "
            "some workers would get no file. Use AutoShardPolicy.DATA (or AUTO, which falls "
            "back to DATA), or split the data into at least as many files as workers."
        )
    return policy


def _worker_batch_size(global_batch_size: int, workers: int) -> int:
    if global_batch_size % workers:
        raise errors.InvalidArgumentError(
            f"AutoShardPolicy.FILE: the global batch size {global_batch_size} is not divisible "
            f"by the {workers} workers; use a multiple of {workers}."
        )
    return global_batch_size // workers


def _new_dataset_uid(strategy, kind: str) -> str:
    """A name for a distributed dataset, the same on every process of an SPMD program."""
    strategy._datasets_made += 1
    return f"{kind}#{strategy._datasets_made}"


def _next_iteration(strategy) -> int:
    """The number of this pass over any of `strategy`'s distributed datasets (0, 1, ...).

    Counted in the thread that calls `iter()` (the program's own order), so it is the same on
    every process of an SPMD program; the exchanges of a pass are named by it, and each carries
    its dataset's name, so processes that read different datasets at the same point disagree
    visibly instead of waiting on different names.
    """
    strategy._iterations_started += 1
    return strategy._iterations_started - 1


def place_agreed(strategy, placer: _Placer, local_batches: Iterator, uid: str,
                 iteration: int) -> Iterator:
    """Places each local batch; with several processes, first agrees with the peers on it.

    Multi-worker (docs/design.md, "Input"): before each step every process publishes the true
    lengths of its local shards, or that its data has ended. The step happens while ANY process
    still has data; a process whose data has ended feeds fully masked filler rows (copies of its
    last real example), so no worker blocks in a collective its peers never join, and every
    example is counted exactly once. All processes then know every replica's length (for
    `gather`) and the same static row count.
    """
    if jax.process_count() == 1:
        for shards, name, _, lengths in local_batches:
            yield placer.place(shards, name, lengths=lengths)
        return
    local = len(strategy._local_replica_ids)
    options = getattr(strategy, "communication_options", None)
    timeout = getattr(options, "timeout_seconds", None)
    last = None  # one row of this process's last batch (a real example when it had one)
    ended = False
    step = 0
    while True:
        item = None if ended else next(local_batches, None)
        ended = item is None
        lengths = None if ended else item[3] or [
            int(jax.tree.leaves(s)[0].shape[0]) for s in item[0]]
        name = f"input/{iteration}/{step}"
        votes = multihost.exchange(name, {
            "dataset": uid, "lengths": lengths, "had_data": last is not None or not ended,
            "batch": None if ended else _signature(item[0]),
            "global": None if ended else item[2],
        }, timeout)
        if step >= 3:
            multihost.forget(f"input/{iteration}/{step - 3}")
        multihost.check_same(name, "which distributed dataset is read",
                             [v["dataset"] for v in votes])
        multihost.check_same(name, "the structure, trailing shapes and dtypes of the batches",
                             [v["batch"] for v in votes if v["batch"] is not None])
        if any(v["global"] is not None for v in votes):
            # DATA sharding: every worker reads the same global batches (their size and a
            # digest of their bytes); a difference means the workers read different data, and
            # each would train on its own part of a batch that exists nowhere: a silent mix.
            multihost.check_same(
                name, "the global batch every worker reads (AutoShardPolicy.DATA: every worker "
                "must read the same batches, in the same order: the same files and the same "
                "shuffle seed; for each worker to read its own data, use "
                "distribute_datasets_from_function)",
                [v["global"] for v in votes])
        if all(v["lengths"] is None for v in votes):
            return
        empty = [p for p, v in enumerate(votes) if not v["had_data"]]
        if empty:
            raise errors.InvalidBatchError(
                f"The input pipelines of process(es) {empty} yielded no batch at all while the "
                "others have data; a worker needs at least one batch (its examples set the "
                "shapes it feeds once its data has ended). Give every worker data, e.g. shard "
                "with fewer, larger pieces."
            )
        all_lengths = by_replica(strategy, [v["lengths"] or [0] * local for v in votes])
        if ended:
            yield placer.place([last] * local, "filler", lengths=(0,) * local,
                               all_lengths=all_lengths)
        else:
            shards, first_name, _, given = item
            real = next((s for s in shards if jax.tree.leaves(s)[0].shape[0]), None)
            if real is not None:
                last = jax.tree.map(lambda a: a[:1], real)
            elif last is None:
                last = jax.tree.map(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), shards[0])
            yield placer.place(shards, first_name, lengths=given, all_lengths=all_lengths)
        step += 1


class _End:
    pass


def _fill(producer: Iterator, out: queue.Queue, stop: threading.Event):
    """The prefetch thread: runs the producer ahead, handing items (or its error) to `out`."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in producer:
            if not put(item):
                return
        put(_End())
    except BaseException as e:  # handed to the consumer, raised there
        put(_Failure(e))


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class DistributedIterator:
    """Iterator over `PerReplica` batches, prefetched to the devices by a background thread.

    As TF's `DistributedIterator`: `next(it)` / `it.get_next()` return the next batch and raise
    `StopIteration` at the end. An error in the source is raised here, in the caller's thread.
    The thread holds no reference to the iterator, so an abandoned iterator is collected and
    its thread stops (or call `close()`).

    Its position (the batches handed to the caller, not those prefetched) is what
    `mirrax.Checkpoint(iterator=it)` saves, as TF checkpoints a tf.data iterator.
    """

    def __init__(self, producer: Iterator, options: InputOptions):
        self._producer = producer
        self._handed = 0  # batches returned by __next__: the position a checkpoint saves
        self._thread = None
        if options.experimental_fetch_to_device:
            self._queue: queue.Queue = queue.Queue(options.experimental_per_replica_buffer_size)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_fill, args=(producer, self._queue, self._stop), daemon=True,
                name="mirrax-prefetch",
            )
            self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> PerReplica:
        item = self._next()
        self._handed += 1
        return item

    def _next(self) -> PerReplica:
        if self._thread is None:
            return next(self._producer)
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None
        if isinstance(item, _End):
            self._queue.put(item)  # later calls also stop
            raise StopIteration
        if isinstance(item, _Failure):
            self._queue.put(_End())
            raise item.error
        return item

    def get_next(self) -> PerReplica:
        """The next `PerReplica` batch; raises `StopIteration` at the end (TF: OutOfRangeError)."""
        return next(self)

    def _check_fresh(self) -> None:
        """Raises ValueError if this iterator has handed out batches (a restore needs a fresh one)."""
        if self._handed:
            raise errors.InvalidArgumentError(
                f"Cannot restore an iterator position into a DistributedIterator that has "
                f"already handed out {self._handed} batches; restore into a fresh one, "
                "iter(dist_dataset), before taking batches from it."
            )

    def _skip_to(self, position: int) -> None:
        """Fast-forwards a fresh iterator to `position` by reading and discarding batches
        (they are re-read from the source; a shuffling source must be seeded to match).

        Raises:
          ValueError: this iterator has already handed out batches, or the source ends first.
        """
        self._check_fresh()
        for _ in range(position):
            try:
                next(self)
            except StopIteration:
                raise errors.InvalidArgumentError(
                    f"The checkpoint's iterator position is {position} batches, but the dataset "
                    f"ended after {self._handed}; restore into an iterator over the same "
                    "(deterministic) dataset that was saved."
                ) from None

    def close(self):
        """Stops the prefetch thread (also done when the iterator is garbage-collected)."""
        if self._thread is not None:
            self._stop.set()

    def __del__(self):
        self.close()
