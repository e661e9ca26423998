"""What a ClusterCoordinator hands back: `RemoteValue` (a scheduled function's result) and
the per-worker dataset and iterator that scheduled functions take."""

from __future__ import annotations

import itertools
import threading

import jax

from mirrax import errors


class RemoteValue:
    """The result of a scheduled function, as `tf.distribute.experimental.coordinator.RemoteValue`."""

    def __init__(self):
        self._ready = threading.Event()
        self._value = None
        self._error: BaseException | None = None

    def get(self):
        """Waits for the function and returns its result (NumPy arrays; a distributed value
        as the tuple of the worker's local replicas' values).

        Raises:
          the function's error, or CancelledFunctionError when it was cancelled.
        """
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def fetch(self):
        """As `get`, with every array leaf as a NumPy array (TF's `fetch`)."""
        return jax.device_get(self.get())

    def is_ready(self) -> bool:
        """Whether the function has finished (a result or an error), without waiting (mirrax's
        own)."""
        return self._ready.is_set()

    def set_value(self, value) -> None:
        """Hands the function's result to this RemoteValue: the coordinator's side, once (its
        dispatcher calls it when the worker answers); `get` returns it."""
        self._value = value
        self._ready.set()

    def set_error(self, error: BaseException) -> None:
        """Hands the function's error (it failed, was given up or cancelled) to this
        RemoteValue: the coordinator's side, once; `get` raises it."""
        self._error = error
        self._ready.set()

    def __repr__(self) -> str:
        state = "ready" if self.is_ready() else "pending"
        return f"RemoteValue({state})"


class PerWorkerDataset:
    """A dataset created on every worker by `create_per_worker_dataset`; `iter()` gives a
    `PerWorkerIterator`, a value to pass to scheduled functions."""

    def __init__(self, coordinator, dataset_id: int):
        self._coordinator = coordinator
        self.dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self._coordinator, self.dataset_id)

    def __repr__(self) -> str:
        return f"PerWorkerDataset(id={self.dataset_id})"


class PerWorkerIterator:
    """One iterator per worker over its `PerWorkerDataset`: inside a scheduled function it is
    the running worker's iterator (`next(iterator)` gives that worker's next batch)."""

    _ids = itertools.count()

    def __init__(self, coordinator, dataset_id: int):
        self.coordinator = coordinator
        self.dataset_id = dataset_id
        self.iterator_id = next(self._ids)

    def __next__(self):
        raise errors.UnsupportedArgumentError(
            "A PerWorkerIterator is read on the workers: pass it to coordinator.schedule(fn, "
            "args=(iterator,)) and call next(iterator) inside fn."
        )

    def __repr__(self) -> str:
        return f"PerWorkerIterator(dataset={self.dataset_id})"
