"""The iterator of a distributed dataset: batches prefetched to the devices by a background
thread, TF's `DistributedIterator` API on them (`next`, `get_next`, `get_next_as_optional`,
`element_spec`), and its position for checkpoints."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Iterator

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute.input_options import InputOptions
from mirrax._src.distribute.run import tracing
from mirrax._src.distribute.values import DistributedInput, PerReplica


def element_spec_of(element):
    """The per-replica spec of a distributed batch: its structure with a
    `jax.ShapeDtypeStruct` per leaf, of shape (per-replica rows, ...)."""
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.stacked.shape[1:], v.stacked.dtype),
        element,
        is_leaf=lambda v: isinstance(v, PerReplica),
    )


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


# Iterators whose prefetch thread may still run. At exit each thread is stopped and joined:
# a daemon thread still placing a batch while the interpreter tears JAX down aborts the
# process (C++ terminate, exit 134) after the program itself finished.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_JOIN_AT_EXIT_S = 2.0


def _stop_all_at_exit() -> None:
    iterators = list(_LIVE)
    for iterator in iterators:
        iterator.close()
    for iterator in iterators:
        iterator.join(_JOIN_AT_EXIT_S)


atexit.register(_stop_all_at_exit)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class DistributedIterator(DistributedInput):
    """Iterator over `PerReplica` batches, prefetched to the devices by a background thread.

    As TF's `DistributedIterator`: `next(it)` / `it.get_next()` return the next batch and raise
    `StopIteration` at the end; `it.get_next_as_optional()` returns it as an `Optional`, empty
    at the end; `it.element_spec` describes one element. An error in the source is raised here,
    in the caller's thread. The thread holds no reference to the iterator, so an abandoned
    iterator is collected and its thread stops (or call `close()`).

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
                target=_fill,
                args=(producer, self._queue, self._stop),
                daemon=True,
                name="mirrax-prefetch",
            )
            self._thread.start()
            _LIVE.add(self)

    def __iter__(self):
        return self

    def __next__(self) -> PerReplica:
        trace = tracing.current()
        if trace is not None:
            # Inside a mirrax.function's trace the batch would become a constant of the program:
            # every later call would run on it. An iterator argument is advanced per call.
            raise errors.InvalidArgumentTypeError(
                f"mirrax.function: {trace.name} calls next() on a distributed iterator it captures "
                "(a closure variable or global), so its batch would be traced into the program "
                f"once and reused at every call. Pass the iterator as an argument: {trace.name}("
                "iterator), with next(iterator) inside, as TF's train_step(iterator)."
            )
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

    def get_next_as_optional(self) -> Optional:
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
                        "dataset's element_spec, or a fresh iter(dataset)'s."
                    ) from None
            self._spec = element_spec_of(self._peeked)
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

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a stopped prefetch thread to end."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

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
                "the end of its data). Check optional.has_value() before get_value()."
            )
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"


def prefetched_count(iterator: DistributedIterator) -> int:
    """The batches placed on the devices and waiting in `iterator`'s prefetch buffer (0 when it
    does not prefetch); approximate while its thread runs, for measurements."""
    return iterator._queue.qsize() if iterator._thread is not None else 0
