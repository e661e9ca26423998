"""Distributed input: split global batches over replicas (or deal per-replica batches), pad
partial batches to a static shape with a mask, and move them to the devices ahead of use.

Accepted sources: a tuple/dict of arrays (ONE batch), any iterable of batches (list, generator,
Grain loader, PyTorch DataLoader), or an object with `as_numpy_iterator()` (tf.data). Leaves
may be NumPy or JAX arrays or anything with `.numpy()` (tf.Tensor, torch.Tensor).
"""

from __future__ import annotations

import collections.abc
import math
import warnings
from collections.abc import Callable, Iterator

import jax
import numpy as np

from mirrax import errors
from mirrax._src.data.files import FileDataset
from mirrax._src.distribute.batching import (
    Placer,
    invariant_rows,
    is_array,
    split_global_batch,
    split_invariant,
    to_host_batch,
)
from mirrax._src.distribute.input_agreement import batch_fingerprint, place_agreed
from mirrax._src.distribute.input_options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    check_one_argument,
    check_options,
)
from mirrax._src.distribute.iterator import DistributedIterator
from mirrax._src.distribute.values import DistributedInput


def not_batches_hint(source) -> str:
    """How to turn `source`, refused as a dataset, into batches: "" when there is no better
    hint than the error's own. Hugging Face objects are told by their public class names."""
    kind = type(source)
    if kind.__module__.split(".")[0] == "datasets" and kind.__name__ == "Column":
        name = getattr(source, "column_name", "name")
        return (
            f" It is a Hugging Face Column (ds[{name!r}]), a lazy view of one column, not "
            f"an array; pass its values as an array: ds[{name!r}][:] (NumPy when the "
            "dataset has .with_format('numpy'))."
        )
    if kind.__module__.split(".")[0] == "datasets" and kind.__name__ == "DatasetDict":
        return (
            f" It is a Hugging Face DatasetDict of the splits {list(source)}; pass one "
            "split, e.g. ds['train'], as batches."
        )
    if hasattr(source, "__getitem__") and hasattr(source, "__len__") and not hasattr(source, "__iter__"):
        return (
            " It has __len__ and __getitem__ but no __iter__: a map-style dataset of single "
            "examples (a torch Dataset); batch it: torch.utils.data.DataLoader(ds, "
            "batch_size=B), or grain.MapDataset.source(ds).batch(B)."
        )
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
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__") or not_batches_hint(dataset):
        hint = not_batches_hint(dataset)
        if callable(dataset):
            hint = (
                f" {getattr(dataset, '__name__', 'It')} is a function: pass what it returns, "
                f"e.g. experimental_distribute_dataset({getattr(dataset, '__name__', 'fn')}"
                "()), or use distribute_datasets_from_function for a function of the "
                "InputContext."
            )
        raise errors.InvalidArgumentTypeError(
            "The dataset must be a tuple/dict of arrays (one global batch), an iterable of such "
            "batches (list, generator, Grain loader, torch DataLoader) or a tf.data.Dataset; "
            f"received {type(dataset).__name__} ({dataset!r:.60}).{hint}"
        )
    # Asked of the type, not by calling iter(): a loader's iter() may start worker processes.
    if not isinstance(dataset, collections.abc.Iterator):
        return lambda: iter(dataset)
    passes: list = []

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
                f"({dataset_fn!r:.60}). Pass the function itself: DatasetCreator(dataset_fn)."
            )
        if input_options is not None and not isinstance(input_options, InputOptions):
            raise errors.InvalidArgumentTypeError(
                "DatasetCreator: input_options must be a mirrax.InputOptions or None; "
                f"received {type(input_options).__name__} ({input_options!r:.60})."
            )
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
                f"{type(dataset).__name__} ({dataset!r:.60}). ({e})"
            ) from None
        return dataset

    def __repr__(self) -> str:
        return f"DatasetCreator({getattr(self.dataset_fn, '__name__', self.dataset_fn)!r})"


class _SpecOfFirstPass:
    """`element_spec` of a distributed dataset: read from the first batch of a pass started
    for it, which the next `iter(dataset)` then continues (so a one-shot source loses nothing
    and every worker's passes stay in step)."""

    _pending: DistributedIterator | None = None
    _spec = None

    def _start(self) -> DistributedIterator:
        raise NotImplementedError  # each dataset class starts its passes its own way

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

    def __iter__(self) -> DistributedIterator:
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
        workers, index = _workers(strategy)
        self._policy = _shard_policy(dataset, self._options.experimental_auto_shard_policy, workers)
        if self._policy is AutoShardPolicy.FILE:
            dataset = dataset.shard(workers, index, _worker_batch_size(dataset.batch_size, workers))
        self._source = _batch_source(dataset)
        self._placer = Placer(strategy)
        self._rows = None  # replica-invariant mode: per-replica rows, fixed by the first batch
        self._uid = strategy.extended.pipeline_names.dataset("experimental_distribute_dataset")

    def _local_batches(self) -> Iterator[tuple]:
        strategy = self._strategy
        invariant_mode = strategy.replica_invariant
        workers = _workers(strategy)[0]
        if invariant_mode and self._policy is not AutoShardPolicy.DATA and workers > 1:
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
                fingerprint = batch_fingerprint(host, n) if workers > 1 else n
                if invariant_mode:
                    self._rows = invariant_rows(strategy, self._rows, n, "experimental_distribute_dataset")
                    shards, lengths = split_invariant(
                        strategy, host, n, self._rows, strategy.extended.replica_devices.local_replica_ids
                    )
                    yield shards, name, fingerprint, lengths
                    continue
                shards = split_global_batch(
                    host,
                    n,
                    strategy.num_replicas_in_sync,
                    strategy.extended.replica_devices.local_replica_ids,
                )
                yield shards, name, fingerprint, None
            return
        # FILE and OFF: this worker's batches hold global_batch / W examples; its replicas split
        # them by TF's rule as if they were all the replicas there are.
        local = len(strategy.extended.replica_devices.local_replica_ids)
        for batch in self._source():
            host, n = to_host_batch(batch)
            if self._policy is AutoShardPolicy.OFF:
                per_worker = math.ceil(n / workers)
                pieces = [
                    jax.tree.map(lambda a, i=i, per_worker=per_worker: a[i : i + per_worker], host)
                    for i in range(0, n, per_worker)
                ]
            else:
                pieces = [host]
            for piece in pieces:
                size = jax.tree.leaves(piece)[0].shape[0]
                yield (
                    split_global_batch(piece, size, local, range(local)),
                    f"worker batch of {size} over {local} replicas",
                    None,
                    None,
                )

    def _start(self) -> DistributedIterator:
        producer = place_agreed(
            self._strategy,
            self._placer,
            self._local_batches(),
            self._uid,
            self._strategy.extended.pipeline_names.next_pass(),
        )
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
        workers, index = (1, 0) if input_context is not None else _workers(strategy)
        self.input_context = input_context or InputContext(
            num_input_pipelines=workers,
            input_pipeline_id=index,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        check_one_argument(dataset_fn, "distribute_datasets_from_function: dataset_fn", "InputContext")
        if strategy.replica_invariant:
            warnings.warn(
                "distribute_datasets_from_function on a strategy with replica_invariant=True: "
                "its batches are per replica, so which examples share a step depends on the "
                "replica count and results are not replica-invariant. Use "
                "experimental_distribute_dataset with global batches for that.",
                stacklevel=3,
            )
        self._source = _batch_source(dataset_fn(self.input_context))
        self._placer = Placer(strategy)
        self._uid = strategy.extended.pipeline_names.dataset("distribute_datasets_from_function")

    def _local_batches(self) -> Iterator[tuple[list, str, None, None]]:
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

    def _start(self) -> DistributedIterator:
        producer = place_agreed(
            self._strategy,
            self._placer,
            self._local_batches(),
            self._uid,
            self._strategy.extended.pipeline_names.next_pass(),
        )
        return DistributedIterator(producer, self._options)


def _workers(strategy) -> tuple[int, int]:
    """(the number of workers `strategy`'s input is read by, this worker's index among them):
    one per process that holds its replicas, so (1, 0) for a strategy on this process's devices
    only (the default strategy in a multi-worker run reads its input whole, as TF's)."""
    processes = strategy.extended.replica_devices.process_indices
    me = jax.process_index()
    return len(processes), processes.index(me) if me in processes else 0


def _shard_policy(dataset, policy: AutoShardPolicy, workers: int) -> AutoShardPolicy:
    """The policy in effect for `dataset`: AUTO resolved; one worker → DATA (docs/design.md,
    "Input").

    Raises:
      ValueError: FILE on a dataset that is not a FileDataset, or with fewer files than
        workers (the message suggests DATA).
    """
    if workers == 1:
        return AutoShardPolicy.DATA
    files = len(dataset.files) if isinstance(dataset, FileDataset) else None
    if policy is AutoShardPolicy.AUTO:
        return AutoShardPolicy.FILE if files is not None and files >= workers else (AutoShardPolicy.DATA)
    if policy is AutoShardPolicy.FILE and files is None:
        raise errors.InvalidArgumentError(
            f"AutoShardPolicy.FILE needs a dataset made of files (mirrax.data.FileDataset); "
            f"received a {type(dataset).__name__}. Use AutoShardPolicy.DATA (every worker reads "
            "each global batch and keeps its part) or wrap the files in FileDataset."
        )
    if policy is AutoShardPolicy.FILE and files is not None and files < workers:
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
