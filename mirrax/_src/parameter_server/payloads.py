"""What `ClusterCoordinator` sends to its workers: a scheduled function with its arguments, or a
dataset function, pickled with tokens for what each worker has its own copy of (the strategy,
`WorkerConstant`s, functions by content, per-worker iterators and datasets, held NNX objects),
and the argument that cannot be sent named in the error.

Functions and constants travel once per worker (`SendOnce`): a payload names them by token, and
carries the bytes only of those its worker has not received yet. A function whose pickle cannot
change while what it captures stays the same objects is pickled once (`PickleCache`).
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
import types

import jax
from flax import nnx

from mirrax import errors
from mirrax._src.parameter_server import wire
from mirrax._src.parameter_server.closures import WorkerConstant
from mirrax._src.parameter_server.remote_values import (
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)

# Functions whose pickles are kept (the least recently scheduled dropped first).
PICKLE_CACHE_SIZE = 256
# Bytes of functions kept to send once; past it, a new function travels inside each payload
# (as a function that captures something mutable always does), so nothing grows without bound.
MAX_SENT_BYTES = 64 * 2**20
# Values whose pickle is their identity's.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, jax.Array)
_MISSING = object()


class SendOnce:
    """The bytes each worker receives once, by token: functions (`("function", digest)`) and
    `WorkerConstant`s (`("constant", id)`, the object kept alive so its id stays its own)."""

    def __init__(self, num_workers: int):
        self._lock = threading.Lock()
        self._data: dict = {}  # token -> bytes
        self._objects: dict = {}  # token -> the indices of the held objects named inside
        self._kept: list = []
        self._sent: list[set] = [set() for _ in range(num_workers)]
        self._function_bytes = 0

    def __contains__(self, token) -> bool:
        return token in self._data

    def add(self, token, data: bytes, objects=(), keep=None) -> bool:
        """Keeps `data` to send under `token`; False (not kept) for a function past
        `MAX_SENT_BYTES`."""
        with self._lock:
            if token in self._data:
                return True
            if token[0] == "function":
                if self._function_bytes + len(data) > MAX_SENT_BYTES:
                    return False
                self._function_bytes += len(data)
            self._data[token] = data
            self._objects[token] = frozenset(objects)
            if keep is not None:
                self._kept.append(keep)
            return True

    def objects(self, token) -> frozenset:
        """The indices of the held objects named inside what `token` stands for."""
        return self._objects[token]

    def unsent(self, worker: int) -> dict:
        """{token: bytes} of what `worker` has not received, marked as received (the caller
        sends it with the worker's next payload; `forget` after a restart)."""
        with self._lock:
            sent = self._sent[worker]
            new = {token: data for token, data in self._data.items() if token not in sent}
            sent.update(new)
            return new

    def forget(self, worker: int) -> None:
        """`worker` holds nothing any more (it was restarted)."""
        with self._lock:
            self._sent[worker] = set()


class _Entry:
    __slots__ = ("function", "captured", "token", "objects")

    def __init__(self, function, captured, token, objects):
        self.function, self.captured, self.token, self.objects = function, captured, token, objects


class PickleCache:
    """Per function code, its token and the held objects it names, while everything its pickle
    depends on (its code, closure cells, defaults, the globals it names, and so for the
    functions among them) is the same objects, each immutable or sent as a token. A new
    function object of the same code and the same captured objects (a `lambda` written in a
    scheduling loop: one per iteration) pickles to the same bytes, so it shares the entry."""

    def __init__(self):
        self._entries: dict = {}  # id(function.__code__) -> _Entry (its function keeps the code alive)

    def get(self, function, stable) -> _Entry | None:
        key = id(function.__code__)
        entry = self._entries.get(key)
        if entry is None or not _same_function(entry.function, function):
            return None
        now = captured(function, stable)
        if now is None or len(now) != len(entry.captured) or not all(map(operator.is_, now, entry.captured)):
            del self._entries[key]
            return None
        self._entries[key] = self._entries.pop(key)  # most recent last
        return entry

    def put(self, function, captured: list, token, objects) -> None:
        """Keeps `function`'s token while `captured` (its `captured(...)` now) holds."""
        if len(self._entries) >= PICKLE_CACHE_SIZE:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(function.__code__)] = _Entry(function, captured, token, frozenset(objects))


def _same_function(kept, function) -> bool:
    """Whether `function` pickles as `kept` does when what they capture is the same: the same
    code, globals, names and documentation (cloudpickle writes these besides the captures)."""
    return function is kept or (
        function.__code__ is kept.__code__
        and function.__globals__ is kept.__globals__
        and (function.__name__, function.__qualname__, function.__module__, function.__doc__)
        == (kept.__name__, kept.__qualname__, kept.__module__, kept.__doc__)
        and function.__annotations__ == kept.__annotations__
    )


def _imported(module) -> bool:
    """Whether `module` pickles by reference (it is imported under its name)."""
    return sys.modules.get(module.__name__) is module


def _importable(cls) -> bool:
    """Whether the class `cls` pickles by reference (found by its module and qualified name),
    not by value with its methods (and the globals they read) as `__main__`'s classes do."""
    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ == "__main__":
        return False
    found: object = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple:
    """The names `code` and the code objects nested in it may read as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def captured(function, stable, seen=None) -> list | None:
    """What `function`'s pickle depends on, its nested functions' included, as a flat list to
    compare by identity; None when any of it may change without changing identity (a list,
    an array, an object that is not sent as a token: `stable(value)` says)."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return []
    seen.add(id(function))
    if function.__dict__ or function.__kwdefaults__:
        return None
    try:
        cells = [cell.cell_contents for cell in function.__closure__ or ()]
    except ValueError:  # an empty cell (a name bound later)
        return None
    found = [function.__code__, function.__defaults__]
    g = function.__globals__
    values = (
        cells
        + list(function.__defaults__ or ())
        + [g.get(n, _MISSING) for n in _global_names(function.__code__)]
    )
    for value in values:
        found.append(value)
        if isinstance(value, types.FunctionType):
            nested = captured(value, stable, seen)
            if nested is None:
                return None
            found.extend(nested)
        elif not _stable_value(value, stable):
            return None
    return found


def _stable_value(value, stable) -> bool:
    if value is _MISSING or isinstance(value, _IMMUTABLE):
        return True
    if isinstance(value, types.ModuleType):
        return _imported(value)
    if isinstance(value, type):
        return _importable(value)
    if isinstance(value, types.BuiltinFunctionType):  # `len`, not a bound `list.append`
        owner = value.__self__
        return owner is None or (isinstance(owner, types.ModuleType) and _imported(owner))
    if type(value) in (tuple, frozenset):
        return all(_stable_value(v, stable) and not isinstance(v, types.FunctionType) for v in value)
    return stable(value)


def pickle_scheduled(coordinator, store, sent: SendOnce, cache: PickleCache, fn, args: tuple, kwargs: dict):
    """(payload, new roots, objects): `(fn, args, kwargs)` pickled for a worker of `coordinator`;
    the NNX objects it reaches that `store` does not hold yet (their tokens number them from
    `store.count` on, in this order: the caller adds them to `store`); and the indices of the
    held objects it names (what the worker pulls). The functions and `WorkerConstant`s it
    reaches go to `sent`, the payload holding their tokens.

    Raises:
      InvalidArgumentTypeError: a part of the call cannot be pickled (named), or is refused
        (`wire.refuse`).
      MixedStrategyError: a per-worker iterator of another coordinator.
      the error of a function whose RemoteValue is an argument, when that function failed.
    """
    new_roots: list = []
    base = store.count
    used: set = set()
    # The functions and constants being pickled now, outermost first, with the objects each names.
    pickling: list = []
    naming: list[set] = [used]

    def name(indices) -> None:
        for names in naming:
            names.update(indices)

    def stable(value) -> bool:
        return (
            value is coordinator.strategy
            or isinstance(value, (PerWorkerIterator, PerWorkerDataset))
            or (isinstance(value, WorkerConstant) and ("constant", id(value)) in sent)
            or (isinstance(value, nnx.Pytree) and store.holds(value))
        )

    def token_of(obj):
        if obj is coordinator.strategy:
            return wire.STRATEGY
        if any(obj is busy for busy in pickling):
            return None  # pickled inline (cloudpickle's memo handles the recursion)
        if isinstance(obj, WorkerConstant):
            constant = wire.constant(obj)
            if constant not in sent:
                data, objects = _dumps_nested(obj, token_of, pickling, naming)
                sent.add(constant, data, objects, keep=obj)
            name(sent.objects(constant))
            return constant
        if isinstance(obj, types.FunctionType):
            entry = cache.get(obj, stable)
            if entry is not None:
                name(entry.objects)
                return entry.token
            data, objects = _dumps_nested(obj, token_of, pickling, naming)
            token = wire.function(data)
            # The objects' tokens are final once they are held.
            now = None if new_roots else captured(obj, stable)
            if now is not None and sent.add(token, data, objects):
                cache.put(obj, now, token, objects)
                return token
            return wire.with_bytes(token, data)  # may change: sent with the payload, kept nowhere
        if isinstance(obj, RemoteValue):
            try:
                return wire.value(obj)
            except Exception as e:  # noqa: BLE001 - raised as it is, not as a pickling error
                raise _FailedInput(e) from None
        if isinstance(obj, PerWorkerIterator):
            _check_mine(coordinator, obj.coordinator, "a PerWorkerIterator")
            return wire.iterator(obj)
        if isinstance(obj, PerWorkerDataset):
            return wire.dataset(obj)
        if isinstance(obj, nnx.Pytree):
            store.check_not_held_elsewhere(obj)
            if store.holds(obj):
                index = store.index(obj)
            else:
                index = next((base + i for i, root in enumerate(new_roots) if root is obj), None)
                if index is None:
                    new_roots.append(obj)
                    index = base + len(new_roots) - 1
            name((index,))
            return wire.held_object(index)
        wire.refuse(obj)
        return None

    try:
        payload = wire.dumps((fn, args, kwargs), token_of)
    except _FailedInput as failed:
        # As TF: a function given the RemoteValue of one that failed fails with its error
        # (whose cause, the worker's traceback, is kept).
        raise failed.error  # noqa: B904
    except errors.MirraxError:
        raise
    except Exception as e:  # noqa: BLE001 - any pickling failure: name the argument
        raise errors.InvalidArgumentTypeError(
            f"ClusterCoordinator.schedule: {wire.culprit(fn, args, kwargs, token_of)} cannot "
            f"be sent to a worker ({type(e).__name__}: {e}). A scheduled function and "
            "its arguments are pickled: pass arrays, numbers, NNX objects and "
            "per-worker iterators, and create other objects inside the function."
        ) from None
    return payload, new_roots, tuple(sorted(used))


class _FailedInput(Exception):
    """A RemoteValue argument whose function failed: its `error`, carried out of the pickler."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def pickle_dataset_fn(strategy, dataset_fn) -> bytes:
    """`dataset_fn` pickled for the workers (`strategy` as its token; other coordinator objects
    refused).

    Raises:
      InvalidArgumentTypeError: `dataset_fn` cannot be pickled, or reaches a refused object.
    """

    def token_of(obj):
        if obj is strategy:
            return wire.STRATEGY
        wire.refuse(obj)
        return None

    try:
        return wire.dumps(dataset_fn, token_of)
    except errors.MirraxError:
        raise
    except Exception as e:  # noqa: BLE001
        raise errors.InvalidArgumentTypeError(
            f"create_per_worker_dataset: dataset_fn cannot be sent to the workers "
            f"({type(e).__name__}: {e}). Build the dataset inside the function."
        ) from None


def _dumps_nested(obj, token_of, pickling: list, naming: list) -> tuple[bytes, set]:
    """`obj` pickled on its own (its own token's payload), `token_of` applied inside it, and
    the held objects' indices named inside it."""
    objects: set = set()
    pickling.append(obj)
    naming.append(objects)
    try:
        return wire.dumps(obj, token_of), objects
    finally:
        pickling.pop()
        naming.pop()


def _check_mine(coordinator, owner, what: str) -> None:
    if owner is not coordinator:
        raise errors.MixedStrategyError(
            f"ClusterCoordinator.schedule: {what} of another coordinator was passed; create "
            "it with this coordinator's create_per_worker_dataset."
        )
