"""What a worker process does with a scheduled function: pull the held objects' values from
the parameter servers, resolve the coordinator's tokens to local objects, run the function
on the worker's own MirroredStrategy, and push back what the step changed."""

from __future__ import annotations

import collections
import inspect
from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute import prng_keys
from mirrax._src.distribute.input_options import InputContext
from mirrax._src.distribute.mirrored import MirroredStrategy
from mirrax._src.distribute.values import is_distributed
from mirrax._src.parameter_server import serialization, variables
from mirrax._src.parameter_server.ray_calls import (
    PARAMETER_SERVER_TIMEOUT_S,
    LostParameterServer,
    call_servers,
)

# Functions kept per worker (by their pickled bytes), the least recently used dropped first.
FUNCTION_CACHE_SIZE = 256


class WorkerStrategy(MirroredStrategy):
    """A worker's view of the ParameterServerStrategy inside a scheduled function: a
    MirroredStrategy over this worker's devices whose input pipeline knows it is worker
    `index` of `num_workers` (the `InputContext` given to dataset functions)."""

    def __init__(self, index: int, num_workers: int):
        super().__init__()
        self.worker_index = index
        self.num_workers = num_workers

    def input_context(self) -> InputContext:
        return InputContext(
            num_input_pipelines=self.num_workers,
            input_pipeline_id=self.worker_index,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        if not callable(dataset_fn):
            return super().distribute_datasets_from_function(dataset_fn, options)
        return input_lib.DistributedDatasetsFromFunction(
            self, dataset_fn, options, input_context=self.input_context()
        )


def call_dataset_fn(dataset_fn, strategy: WorkerStrategy):
    """`dataset_fn()` or `dataset_fn(input_context)`, distributed over the worker's replicas
    unless it already is a distributed dataset."""
    try:
        takes_context = len(inspect.signature(dataset_fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_context = False
    with strategy.scope():
        dataset = dataset_fn(strategy.input_context()) if takes_context else dataset_fn()
    if isinstance(dataset, input_lib.DistributedInput):
        return dataset
    return strategy.experimental_distribute_dataset(dataset)


class WorkerState:
    """One worker's side of the strategy (the `Worker` actor's state): its strategy, its
    datasets and iterators, its copies of the held objects, and the functions and constants
    it has unpickled; `run(payload)` runs one scheduled function."""

    def __init__(self, index: int, num_workers: int):
        self.strategy = WorkerStrategy(index, num_workers)
        self.parameter_servers: list = []
        self.datasets: dict = {}
        self.iterators: dict = {}
        self.version = None
        self.structure: tuple | None = None  # (graphdef, treedef, layout) of the held objects
        self.roots: Any = None  # the held objects (a tuple of NNX objects), made from structure
        self.constant_bytes: dict = {}
        self.constants: dict = {}  # unpickled on first use, against the current roots
        self.functions: collections.OrderedDict = collections.OrderedDict()  # by content

    def create_dataset(self, dataset_id: int, dataset_fn: bytes) -> None:
        fn = serialization.loads(dataset_fn, self._resolve)
        self.datasets[dataset_id] = call_dataset_fn(fn, self.strategy)

    def _iterator(self, iterator_id: int, dataset_id: int):
        if iterator_id not in self.iterators:
            self.iterators[iterator_id] = iter(self.datasets[dataset_id])
        return self.iterators[iterator_id]

    def _resolve(self, token):
        kind = token[0]
        if kind == "strategy":
            return self.strategy
        if kind == "object":
            return self.roots[token[1]]
        if kind == "iterator":
            return self._iterator(token[1], token[2])
        if kind == "dataset":
            return self.datasets[token[1]]
        if kind == "value":
            return token[1]
        if kind == "function":
            _, key, data = token
            if key in self.functions:
                self.functions.move_to_end(key)
            else:
                self.functions[key] = serialization.loads(data, self._resolve)
                if len(self.functions) > FUNCTION_CACHE_SIZE:
                    self.functions.popitem(last=False)
            return self.functions[key]
        if kind == "constant":
            if token[1] not in self.constants:
                self.constants[token[1]] = serialization.loads(self.constant_bytes[token[1]], self._resolve)
            return self.constants[token[1]]
        raise errors.InvalidArgumentError(f"unknown token {token!r}")

    def _pull(self) -> tuple[int, list]:
        answers = call_servers(
            self.parameter_servers, "pull", [()] * len(self.parameter_servers), PARAMETER_SERVER_TIMEOUT_S
        )
        assert self.structure is not None  # the first payload carried it
        _, _, layout = self.structure
        return answers[0][0], layout.join([values for _, values in answers])

    def run(self, payload: dict) -> tuple:
        if not self.parameter_servers:
            # A process Ray restarted before the coordinator saw the old one die (it died
            # between two functions): nothing was attached or created here yet.
            return ("restarted",)
        if payload["structure"] is not None:
            self.structure = serialization.loads(payload["structure"])
            self.version = payload["version"]
            self.roots = None
            self.constants = {}
            self.functions.clear()  # they may hold the old roots
        self.constant_bytes.update(payload["constants"])
        try:
            return self._run(payload)
        except LostParameterServer as e:
            return ("lost", str(e))

    def _run(self, payload: dict) -> tuple:
        assert self.structure is not None  # the first payload carried it
        graphdef, treedef, layout = self.structure
        pulled_version = 0
        if layout is not None:
            pulled_version, pulled = self._pull()
            # Writable copies: the pulled arrays are Ray's read-only buffers (an in-place
            # write, `v[...] = ...` outside strategy.run, would fail on them), and they stay
            # apart from what the function changes in place, which the push compares them to.
            state = variables.state_of(
                treedef,
                [leaf if prng_keys.is_key(leaf) else np.array(leaf) for leaf in layout.device_leaves(pulled)],
            )
            if self.roots is None:
                self.roots = nnx.merge(graphdef, state)
            else:
                nnx.update(self.roots, state)
        try:
            fn, args, kwargs = serialization.loads(payload["closure"], self._resolve)
            with self.strategy.scope():
                try:
                    result = fn(*args, **kwargs)
                except StopIteration:
                    raise errors.EmptyDatasetError(
                        f"A scheduled function on worker {self.strategy.worker_index} read past "
                        "the end of its per-worker dataset (StopIteration). Make dataset_fn's "
                        "dataset endless (repeat it), or schedule fewer steps."
                    ) from None
            data = _result_bytes(result)
            new = self._new_leaves(treedef, layout) if layout is not None else None
        except LostParameterServer:
            raise
        except BaseException as e:  # noqa: BLE001 - the coordinator re-raises it
            # The function may have left the local copies half changed (or changed their
            # structure): rebuild them, and what refers to them, for the next function.
            self.roots = None
            self.constants = {}
            self.functions.clear()
            return ("error", serialization.pack_error(e))
        staleness = None
        if layout is not None:
            staleness = self._push(layout, pulled, new, pulled_version)
        return ("ok", data, staleness)

    def _new_leaves(self, treedef, layout) -> list:
        _, state = nnx.split(self.roots)
        leaves, now = jax.tree.flatten(state)
        if now != treedef:
            raise errors.UnsupportedArgumentError(
                "A scheduled function changed the structure of the objects the "
                "ParameterServerStrategy holds (it added, removed or replaced a variable or "
                "submodule). Build them completely on the coordinator, before scheduling."
            )
        host = [variables.host_value(leaf) for leaf in leaves]
        for path, leaf, (shape, dtype) in zip(layout.paths, host, layout.signatures):
            if (leaf.shape, leaf.dtype) != (shape, dtype):
                raise errors.UnsupportedArgumentError(
                    f"A scheduled function changed {path} from shape {shape} and dtype {dtype} "
                    f"to shape {leaf.shape} and dtype {leaf.dtype}; the parameter servers keep "
                    "each variable's shape and dtype. Cast the new value (e.g. "
                    "`v[...] = new.astype(v.dtype)`). Nothing of this function was pushed."
                )
        return host

    def _push(self, layout, pulled: list, new: list, pulled_version: int) -> int | None:
        updates = layout.updates(pulled, new)
        if all(kind is None for kind, _ in updates):
            return None  # nothing changed: no push (and no staleness to report)
        adds = layout.split([u if kind == "add" else None for kind, u in updates])
        assigns = layout.split([u if kind == "assign" else None for kind, u in updates])
        before = call_servers(
            self.parameter_servers, "push", list(zip(adds, assigns)), PARAMETER_SERVER_TIMEOUT_S
        )
        return before[0] - pulled_version


def _result_bytes(result) -> bytes:
    try:
        return serialization.dumps(_to_host(result))
    except Exception as e:  # noqa: BLE001 - name what cannot travel
        raise errors.InvalidArgumentTypeError(
            f"A scheduled function's result cannot be sent to the coordinator ({type(e).__name__}"
            f": {e}). Return arrays, numbers and containers of them."
        ) from None


def _to_host(result):
    """A function's result with device arrays as NumPy arrays and each distributed value as
    the tuple of its local replicas' values."""

    def leaf(value):
        if is_distributed(value):
            return tuple(jax.device_get(v) for v in value.values)
        return jax.device_get(value)

    return jax.tree.map(leaf, result, is_leaf=is_distributed)
