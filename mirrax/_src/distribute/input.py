"""Distributed input: split global batches over replicas (or deal per-replica batches), pad
partial batches to a static shape with a mask, and move them to the devices ahead of use.

Accepted sources: a tuple/dict of arrays (ONE batch), any iterable of batches (list, generator,
Grain loader, PyTorch DataLoader), or an object with `as_numpy_iterator()` (tf.data). Leaves
may be NumPy or JAX arrays or anything with `.numpy()` (tf.Tensor, torch.Tensor).
"""

from __future__ import annotations

import collections.abc
import math
import queue
import threading
import warnings
from typing import Callable, Iterator

import jax
import numpy as np

from mirrax import errors
from mirrax._src.data.files import FileDataset
from mirrax._src.distribute.batching import (
    Placer,
    batch_fingerprint,
    invariant_rows,
    is_array,
    place_agreed,
    split_global_batch,
    split_invariant,
    to_host_batch,
)
from mirrax._src.distribute.input_options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    check_one_argument,
    check_options,
)
from mirrax._src.distribute.values import DistributedInput, PerReplica


def not_batches_hint(source) -> str:
    """How to turn `source`, refused as a dataset, into batches: "" when there is no better
    hint than the error's own. Hugging Face objects are told by their public class names."""
    kind = type(source)
    if kind.__module__.split(".")[0] == "datasets" and kind.__name__ == "Column":
        name = getattr(source, "column_name", "name")
        return (f" It is a Hugging Face Column (ds[{name!r}]), a lazy view of one column, not "
                f"an array; pass its values as an array: ds[{name!r}][:] (NumPy when the "
                "dataset has .with_format('numpy')).")
    if kind.__module__.split(".")[0] == "datasets" and kind.__name__ == "DatasetDict":
        return (f" It is a Hugging Face DatasetDict of the splits {list(source)}; pass one "
                "split, e.g. ds['train'], as batches.")
    if hasattr(source, "__getitem__") and hasattr(source, "__len__") and not hasattr(
            source, "__iter__"):
        return (" It has __len__ and __getitem__ but no __iter__: a map-style dataset of single "
                "examples (a torch Dataset); batch it: torch.utils.data.DataLoader(ds, "
                "batch_size=B), or grain.MapDataset.source(ds).batch(B).")
    return ""


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
        is_array(leaf) for leaf in jax.tree.leaves(dataset)
    ):
        return lambda: iter([dataset])
    if (isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__")
            or not_batches_hint(dataset)):
        hint = not_batches_hint(dataset)
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
    # Asked of the type, not by calling iter(): a loader's iter() may start worker processes.
    if not isinstance(dataset, collections.abc.Iterator):
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


class DatasetCreator:
    """A dataset function for `Model.fit`, as `tf.keras.utils.experimental.DatasetCreator`.

    `dataset_fn(input_context)` returns this input pipeline's batches (of the PER-REPLICA
    batch size, `input_context.get_per_replica_batch_size(global_batch_size)`): anything
    `experimental_distribute_dataset` accepts. `Model.fit` (every strategy) passes it to
    `strategy.distribute_datasets_from_function(creator, options=input_options)`, and so can
    the user. Calling the creator calls `dataset_fn` and checks what it returns.

    Args:
      dataset_fn: a callable of one `mirrax.InputContext`.
      input_options: None or a `mirrax.InputOptions`, used where the creator is distributed.

    Raises:
      InvalidArgumentTypeError: `dataset_fn` is not callable, `input_options` is not an
        `InputOptions`, or (when called) `dataset_fn` returns no dataset.
    """

    def __init__(self, dataset_fn, input_options=None):
        if not callable(dataset_fn):
            raise errors.InvalidArgumentTypeError(
                "DatasetCreator: dataset_fn must be a callable of one argument, the "
                f"InputContext, returning batches; received {type(dataset_fn).__name__} "
                f"({dataset_fn!r:.60}). Pass the function itself: DatasetCreator(dataset_fn).")
        if input_options is not None and not isinstance(input_options, InputOptions):
            raise errors.InvalidArgumentTypeError(
                "DatasetCreator: input_options must be a mirrax.InputOptions or None; "
                f"received {type(input_options).__name__} ({input_options!r:.60}).")
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, *args, **kwargs):
        dataset = self.dataset_fn(*args, **kwargs)
        try:
            _batch_source(dataset)
        except (errors.InvalidArgumentTypeError, errors.EmptyDatasetError) as e:
            name = getattr(self.dataset_fn, "__name__", "dataset_fn")
            raise errors.InvalidArgumentTypeError(
                f"DatasetCreator: {name} must return a dataset (batches: a tuple/dict of "
                "arrays, an iterable of such batches, a tf.data.Dataset); it returned "
                f"{type(dataset).__name__} ({dataset!r:.60}). ({e})") from None
        return dataset

    def __repr__(self) -> str:
        return f"DatasetCreator({getattr(self.dataset_fn, '__name__', self.dataset_fn)!r})"


def _element_spec(element):
    """The per-replica spec of a distributed batch: its structure with a
    `jax.ShapeDtypeStruct` per leaf, of shape (per-replica rows, ...)."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.stacked.shape[1:], v.stacked.dtype),
                        element, is_leaf=lambda v: isinstance(v, PerReplica))


class _SpecOfFirstPass:
    """`element_spec` of a distributed dataset: read from the first batch of a pass started
    for it, which the next `iter(dataset)` then continues (so a one-shot source loses nothing
    and every worker's passes stay in step)."""

    _pending = None
    _spec = None

    @property
    def element_spec(self):
        """The structure of one element, with a `jax.ShapeDtypeStruct` of the PER-REPLICA
        shape and dtype per leaf, as TF's `DistributedDataset.element_spec` (which gives
        `TensorSpec`s, wrapped in `PerReplicaSpec` for several replicas; mirrax's replicas
        share one static shape). The batch axis is the static per-replica row count of the
        first batch (TF: None when the last batch may be partial).

        Raises:
          EmptyDatasetError: the dataset yields no batch.
        """
        if self._spec is None:
            if self._pending is None:
                self._pending = self._start()
            self._spec = self._pending.element_spec
        return self._spec

    def __iter__(self) -> "DistributedIterator":
        pending, self._pending = self._pending, None
        return pending if pending is not None else self._start()


class DistributedDataset(_SpecOfFirstPass, DistributedInput):
    """A dataset of global batches, split over replicas; iterate it for `PerReplica` batches.

    Made by `strategy.experimental_distribute_dataset`. Iterable any number of times (each
    pass restarts the source, when the source can restart).
    """

    def __init__(self, strategy, dataset, options=None):
        self._strategy = strategy
        self._options = check_options(options)
        self._policy = _shard_policy(dataset, self._options.experimental_auto_shard_policy)
        if self._policy is AutoShardPolicy.FILE:
            workers = jax.process_count()
            dataset = dataset.shard(workers, jax.process_index(),
                                    _worker_batch_size(dataset.batch_size, workers))
        self._source = _batch_source(dataset)
        self._placer = Placer(strategy)
        self._rows = None  # replica-invariant mode: per-replica rows, fixed by the first batch
        self._uid = strategy.extended.pipeline_names.dataset("experimental_distribute_dataset")

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
                fingerprint = batch_fingerprint(host, n) if jax.process_count() > 1 else n
                if invariant_mode:
                    self._rows = invariant_rows(strategy, self._rows, n,
                                                "experimental_distribute_dataset")
                    shards, lengths = split_invariant(strategy, host, n, self._rows,
                                                      strategy.extended.replica_devices.local_replica_ids)
                    yield shards, name, fingerprint, lengths
                    continue
                shards = split_global_batch(
                    host, n, strategy.num_replicas_in_sync, strategy.extended.replica_devices.local_replica_ids
                )
                yield shards, name, fingerprint, None
            return
        # FILE and OFF: this worker's batches hold global_batch / W examples; its replicas split
        # them by TF's rule as if they were all the replicas there are.
        local = len(strategy.extended.replica_devices.local_replica_ids)
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

    def _start(self) -> "DistributedIterator":
        producer = place_agreed(self._strategy, self._placer, self._local_batches(),
                                self._uid, self._strategy.extended.pipeline_names.next_pass())
        return DistributedIterator(producer, self._options)


class DistributedDatasetsFromFunction(_SpecOfFirstPass, DistributedInput):
    """Per-worker datasets of per-replica batches, dealt to the local replicas in turn.

    Made by `strategy.distribute_datasets_from_function`; `dataset_fn` is called once, here.
    When the source ends part-way through a round, the remaining replicas get empty shards.
    """

    def __init__(self, strategy, dataset_fn, options=None, input_context=None):
        self._strategy = strategy
        if options is None and isinstance(dataset_fn, DatasetCreator):
            options = dataset_fn.input_options
        self._options = check_options(options)
        # A ParameterServerStrategy's worker is one process of its own job, so it passes its
        # own context; everywhere else there is one input pipeline per JAX process.
        self.input_context = input_context or InputContext(
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
        self._placer = Placer(strategy)
        self._uid = strategy.extended.pipeline_names.dataset("distribute_datasets_from_function")

    def _local_batches(self) -> Iterator[tuple[list, str]]:
        local = len(self._strategy.extended.replica_devices.local_replica_ids)
        round_: list = []
        for batch in self._source():
            round_.append(to_host_batch(batch)[0])
            if len(round_) == local:
                yield round_, "per-replica batch of 0", None, None
                round_ = []
        if round_:
            empty = jax.tree.map(lambda a: a[:0], round_[0])
            yield round_ + [empty] * (local - len(round_)), "per-replica batch of 0", None, None

    def _start(self) -> "DistributedIterator":
        producer = place_agreed(self._strategy, self._placer, self._local_batches(),
                                self._uid, self._strategy.extended.pipeline_names.next_pass())
        return DistributedIterator(producer, self._options)


def _shard_policy(dataset, policy: AutoShardPolicy) -> AutoShardPolicy:
    """The policy in effect for `dataset`: AUTO resolved; one worker → DATA (docs/design.md,
    "Input").

    Raises:
      ValueError: FILE on a dataset that is not a FileDataset, or with fewer files than
        workers (the message suggests DATA).
    """
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


class DistributedIterator(DistributedInput):
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
        self._peeked = None  # a batch read for element_spec, not yet handed out
        self._spec = None
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
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
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

    def get_next_as_optional(self) -> "Optional":
        """The next batch as an `Optional`, empty at the end of the data, as TF's
        `DistributedIterator.get_next_as_optional` (which returns a `tf.experimental.Optional`).

        Multi-worker: the iterator ends only when every worker's data has ended (a worker
        whose data ended earlier gets fully masked batches until then), so `has_value()` is
        the same on every worker.
        """
        try:
            return Optional(next(self))
        except StopIteration:
            return Optional(None, has_value=False)

    @property
    def element_spec(self):
        """The structure of one element with a `jax.ShapeDtypeStruct` of the per-replica
        shape and dtype per leaf (see `DistributedDataset.element_spec`); before the first
        batch is handed out it is read from that batch, which `next` then returns.

        Raises:
          EmptyDatasetError: the iterator has no batch to read the spec from.
        """
        if self._spec is None:
            if self._peeked is None:
                try:
                    self._peeked = self._next()
                except StopIteration:
                    raise errors.EmptyDatasetError(
                        "element_spec: this distributed iterator has no batch left to read the "
                        "element structure from (the dataset is empty or used up); ask the "
                        "dataset's element_spec, or a fresh iter(dataset)'s.") from None
            self._spec = _element_spec(self._peeked)
        return self._spec

    # -- mirrax's checkpoint protocol (checkpointing/parts.py): the position, not the data ---

    def checkpoint_state(self) -> dict:
        """{"position": int64 array}: the batches handed to the caller (prefetched ones are not
        counted), as `mirrax.Checkpoint` stores it."""
        return {"position": np.asarray(self._handed, np.int64)}

    def restore_checkpoint_state(self, state: dict) -> None:
        """Fast-forwards this fresh iterator to `state["position"]` (see `_skip_to`)."""
        self._skip_to(int(np.asarray(state["position"])))

    def check_restorable(self) -> None:
        """Raises ValueError if this iterator has handed out batches (a restore needs a fresh one)."""
        self._check_fresh()

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


class Optional:
    """A batch that may be absent: what `DistributedIterator.get_next_as_optional` returns, as
    `tf.experimental.Optional`."""

    def __init__(self, value, has_value: bool = True):
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """True when there is a batch (TF returns a scalar bool tensor; here a Python bool)."""
        return self._has_value

    def get_value(self):
        """The batch (its structure with a `PerReplica` per leaf).

        Raises:
          InvalidArgumentError: the optional is empty (the iterator was at its end), as TF's
            `get_value` raises InvalidArgumentError.
        """
        if not self._has_value:
            raise errors.InvalidArgumentError(
                "Optional.get_value: the optional has no value (the distributed iterator was at "
                "the end of its data). Check optional.has_value() before get_value().")
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"
