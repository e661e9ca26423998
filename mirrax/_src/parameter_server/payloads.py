"""What `ClusterCoordinator` sends to its workers: a scheduled function with its arguments, or a
dataset function, pickled with tokens for what each worker has its own copy of (the strategy,
`WorkerConstant`s, functions by content, per-worker iterators and datasets, held NNX objects),
and the argument that cannot be sent named in the error."""

from __future__ import annotations

import hashlib
import types

from flax import nnx

from mirrax import errors
from mirrax._src.parameter_server import serialization
from mirrax._src.parameter_server.closures import WorkerConstant
from mirrax._src.parameter_server.remote_values import (
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)


def pickle_scheduled(coordinator, store, constants: dict, constants_lock, fn, args: tuple, kwargs: dict):
    """(payload, new roots): `(fn, args, kwargs)` pickled for a worker of `coordinator`, and the
    NNX objects it reaches that `store` does not hold yet (their tokens number them from
    `store.count` on, in this order: the caller adds them to `store`). A `WorkerConstant` seen
    for the first time is pickled into `constants` (id -> (the object, its bytes), under
    `constants_lock`).

    Raises:
      InvalidArgumentTypeError: a part of the call cannot be pickled (named), or is refused
        (`serialization.refuse`).
      MixedStrategyError: a per-worker iterator of another coordinator.
    """
    new_roots: list = []
    base = store.count

    pickling: list = []  # the functions and constants being pickled now, outermost first

    def token_of(obj):
        if obj is coordinator.strategy:
            return ("strategy",)
        if any(obj is busy for busy in pickling):
            return None  # pickled inline (cloudpickle's memo handles the recursion)
        if isinstance(obj, WorkerConstant):
            if id(obj) not in constants:
                data = _dumps_nested(obj, token_of, pickling)
                with constants_lock:
                    constants[id(obj)] = (obj, data)
            return ("constant", id(obj))
        if isinstance(obj, types.FunctionType):
            # By content: the worker keeps the function it unpickled for these bytes, so
            # a function sent again is the same object there and `strategy.run` reuses
            # its compiled program instead of compiling one per scheduled function.
            data = _dumps_nested(obj, token_of, pickling)
            return ("function", hashlib.sha256(data).digest(), data)
        if isinstance(obj, RemoteValue):
            # TF passes a RemoteValue on as its value: wait for it here.
            return ("value", obj.get())
        if isinstance(obj, PerWorkerIterator):
            _check_mine(coordinator, obj.coordinator, "a PerWorkerIterator")
            return ("iterator", obj.iterator_id, obj.dataset_id)
        if isinstance(obj, PerWorkerDataset):
            return ("dataset", obj.dataset_id)
        if isinstance(obj, nnx.Pytree):
            store.check_not_held_elsewhere(obj)
            if store.holds(obj):
                return ("object", store.index(obj))
            for i, root in enumerate(new_roots):
                if root is obj:
                    return ("object", base + i)
            new_roots.append(obj)
            return ("object", base + len(new_roots) - 1)
        serialization.refuse(obj)
        return None

    try:
        payload = serialization.dumps((fn, args, kwargs), token_of)
    except errors.MirraxError:
        raise
    except Exception as e:  # noqa: BLE001 - any pickling failure: name the argument
        raise errors.InvalidArgumentTypeError(
            f"ClusterCoordinator.schedule: {serialization.culprit(fn, args, kwargs, token_of)} cannot "
            f"be sent to a worker ({type(e).__name__}: {e}). A scheduled function and "
            "its arguments are pickled: pass arrays, numbers, NNX objects and "
            "per-worker iterators, and create other objects inside the function."
        ) from None
    return payload, new_roots


def pickle_dataset_fn(strategy, dataset_fn) -> bytes:
    """`dataset_fn` pickled for the workers (`strategy` as its token; other coordinator objects
    refused).

    Raises:
      InvalidArgumentTypeError: `dataset_fn` cannot be pickled, or reaches a refused object.
    """

    def token_of(obj):
        if obj is strategy:
            return ("strategy",)
        serialization.refuse(obj)
        return None

    try:
        return serialization.dumps(dataset_fn, token_of)
    except errors.MirraxError:
        raise
    except Exception as e:  # noqa: BLE001
        raise errors.InvalidArgumentTypeError(
            f"create_per_worker_dataset: dataset_fn cannot be sent to the workers "
            f"({type(e).__name__}: {e}). Build the dataset inside the function."
        ) from None


def _dumps_nested(obj, token_of, pickling: list) -> bytes:
    """`obj` pickled on its own (its own token's payload), `token_of` applied inside it."""
    pickling.append(obj)
    try:
        return serialization.dumps(obj, token_of)
    finally:
        pickling.pop()


def _check_mine(coordinator, owner, what: str) -> None:
    if owner is not coordinator:
        raise errors.MixedStrategyError(
            f"ClusterCoordinator.schedule: {what} of another coordinator was passed; create "
            "it with this coordinator's create_per_worker_dataset."
        )
