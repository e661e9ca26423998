"""The one wire between the coordinator and a worker: cloudpickle, with the coordinator's own
objects replaced by tokens that each worker resolves to its local counterpart. Every token
kind is made and read here, side by side (the coordinator's `payloads` decides which objects
become which token, and what travels once; the worker's `worker_side` holds what they stand
for):

| token | made for, on the coordinator | read as, on a worker |
| --- | --- | --- |
| `("strategy",)` | the ParameterServerStrategy | the worker's `WorkerStrategy` |
| `("object", i)` | the i-th held NNX object | the worker's copy of it |
| `("iterator", it, ds)` | a `PerWorkerIterator` | this worker's iterator `it` over its dataset `ds` |
| `("dataset", ds)` | a `PerWorkerDataset` | this worker's dataset `ds` |
| `("value", v)` | a `RemoteValue` (waited for) | its value `v` |
| `("function", digest)` | a function sent once, by content | the function unpickled once for those bytes |
| `("function", digest, bytes)` | a function that may change, in its payload | the same, kept by content |
| `("constant", id)` | a `WorkerConstant`, sent once | it, unpickled once per layout |

Also here: an error raised on a worker, packed with its traceback, and unpacked on the
coordinator.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
import traceback
import types
from typing import Protocol

from flax import nnx

from mirrax import errors
from mirrax._src.distribute.input import DistributedInput, DistributedIterator
from mirrax._src.parameter_server.ray_calls import import_ray

STRATEGY = ("strategy",)


def held_object(index: int) -> tuple:
    """The token of the `index`-th held object."""
    return ("object", index)


def iterator(per_worker_iterator) -> tuple:
    """The token of a `PerWorkerIterator`."""
    return ("iterator", per_worker_iterator.iterator_id, per_worker_iterator.dataset_id)


def dataset(per_worker_dataset) -> tuple:
    """The token of a `PerWorkerDataset`."""
    return ("dataset", per_worker_dataset.dataset_id)


def value(remote_value) -> tuple:
    """The token of a `RemoteValue` passed to a scheduled function: its value (waited for), as
    TF passes it on."""
    return ("value", remote_value.get())


def function(data: bytes) -> tuple:
    """The token of a function whose pickle is `data`: by content, so that a function sent
    again is the same function on the worker (and `strategy.run` reuses its program)."""
    return ("function", hashlib.sha256(data).digest())


def with_bytes(token: tuple, data: bytes) -> tuple:
    """A function's token carrying its pickle (a function that may change, kept nowhere)."""
    return token + (data,)


def constant(obj) -> tuple:
    """The token of a `WorkerConstant` (the coordinator keeps it alive, so its id stays its own)."""
    return ("constant", id(obj))


class Receiver(Protocol):
    """What a worker resolves tokens against (`worker_side.WorkerState`)."""

    @property
    def strategy(self) -> object: ...

    def held(self, index: int): ...

    def iterator(self, iterator_id: int, dataset_id: int): ...

    def dataset(self, dataset_id: int): ...

    def function(self, key: tuple, data: bytes | None): ...

    def constant(self, token: tuple): ...


def resolve(token: tuple, receiver: Receiver):
    """The worker's object a token stands for.

    Raises:
      InvalidArgumentError: an unknown token kind.
    """
    kind = token[0]
    if kind == "strategy":
        return receiver.strategy
    if kind == "object":
        return receiver.held(token[1])
    if kind == "iterator":
        return receiver.iterator(token[1], token[2])
    if kind == "dataset":
        return receiver.dataset(token[1])
    if kind == "value":
        return token[1]
    if kind == "function":
        return receiver.function(token[:2], token[2] if len(token) > 2 else None)
    if kind == "constant":
        return receiver.constant(token)
    raise errors.InvalidArgumentError(f"unknown token {token!r}")


@functools.cache
def _pickler_class():
    """cloudpickle's pickler (Ray's copy: Ray is imported only when a strategy needs it)."""
    import_ray()
    from ray import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        def __init__(self, file, token_of):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self._token_of = token_of

        def persistent_id(self, obj):
            return self._token_of(obj)

    return Pickler


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, resolve):
        super().__init__(file)
        self._resolve = resolve

    def persistent_load(self, token):
        return self._resolve(token)


def dumps(value, token_of=lambda obj: None) -> bytes:
    """`value` pickled; `token_of(obj)` returns a picklable token for objects that must not be
    copied (None for the others)."""
    buffer = io.BytesIO()
    _pickler_class()(buffer, token_of).dump(value)
    return buffer.getvalue()


def loads(data: bytes, resolve=None):
    """The value `dumps` wrote, each token replaced by `resolve(token)`."""

    def refuse(token):
        raise pickle.UnpicklingError(f"no resolver for the token {token!r}")

    return _Unpickler(io.BytesIO(data), resolve or refuse).load()


class RemoteTraceback(Exception):
    """The traceback of an error raised on a worker, attached as the `__cause__` of the error
    the coordinator re-raises (as `concurrent.futures` does for process pools)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def pack_error(error: BaseException) -> bytes:
    """A worker's exception and its formatted traceback, pickled apart, so the traceback
    reaches the coordinator even when the exception cannot be pickled or unpickled."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        data = dumps(error)
    except Exception:  # noqa: BLE001 - any pickling failure falls back to the text
        data = None
    return pickle.dumps((data, f"{type(error).__name__}: {error}", text))


def unpack_error(data: bytes) -> BaseException:
    """The worker's exception (a `RuntimeError` with its type and message when it cannot be
    rebuilt here), with the worker's traceback as its `__cause__`."""
    pickled, summary, text = pickle.loads(data)
    try:
        error = loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - e.g. an exception class whose __init__ takes 2 args
        error = None
    if not isinstance(error, BaseException):
        error = RuntimeError(
            f"{summary} (raised on a worker; the exception could not be sent to the coordinator as it is)"
        )
    elif not isinstance(error, Exception):
        # SystemExit or KeyboardInterrupt on a worker must not end or interrupt this process.
        error = RuntimeError(f"{summary} (raised on a worker by the scheduled function)")
    error.__cause__ = RemoteTraceback(f'\n"""\n{text}"""')
    return error


def refuse(obj) -> None:
    """Objects that cannot be read on a worker: say what to do instead."""
    # In-memory files pickle by value (Keras pickles a model or optimizer into a BytesIO),
    # and a class is pickled by reference (an iterator's class has a `__next__` too).
    if isinstance(obj, (DistributedInput, DistributedIterator, types.GeneratorType)) or (
        hasattr(obj, "__next__") and not isinstance(obj, (str, bytes, type, io.BytesIO, io.StringIO))
    ):
        raise errors.InvalidArgumentTypeError(
            f"ClusterCoordinator.schedule: a {type(obj).__name__} (an iterator or dataset of the "
            "coordinator) cannot be read on a worker. Create the dataset on every worker with "
            "coordinator.create_per_worker_dataset(dataset_fn) and pass "
            "iter(per_worker_dataset) to the scheduled function."
        )
    if isinstance(obj, nnx.Variable):
        raise errors.InvalidArgumentTypeError(
            "ClusterCoordinator.schedule: a bare nnx.Variable cannot be held by the parameter "
            "servers; pass (or capture) the module or optimizer that owns it."
        )


def culprit(fn, args: tuple, kwargs: dict, token_of) -> str:
    """The first of fn, args[i], kwargs[k] that fails to pickle, as text."""
    named = (
        [("fn", fn)]
        + [(f"args[{i}]", a) for i, a in enumerate(args)]
        + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    )
    for name, value in named:
        try:
            dumps(value, token_of)
        except Exception:  # noqa: BLE001
            return f"{name} (a {type(value).__name__})"
    return "the function or its arguments"
