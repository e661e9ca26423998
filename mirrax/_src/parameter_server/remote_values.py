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

    def __repr__(self) -> str:
        state = "ready" if is_ready(self) else "pending"
        return f"RemoteValue({state})"


def is_ready(remote_value: RemoteValue) -> bool:
    """Whether `remote_value`'s function has finished (a result or an error), without waiting."""
    return remote_value._ready.is_set()


def resolve(remote_value: RemoteValue, value) -> None:
    """Hands `value` to `remote_value` (the coordinator's side: the function returned it)."""
    remote_value._value = value
    remote_value._ready.set()


def reject(remote_value: RemoteValue, error: BaseException) -> None:
    """Hands `error` to `remote_value` (the coordinator's side: the function failed or was
    cancelled); `get` raises it."""
    remote_value._error = error
    remote_value._ready.set()


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
