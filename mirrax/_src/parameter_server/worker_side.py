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
from mirrax._src.parameter_server import gradient_rule, variables, wire
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
        self.treedef: Any = None  # the structure of this worker's copies (tagged under "gradients")
        self.recorders: list = []  # (optimizer copy, group) recording gradients (gradient_rule.attach)
        self.roots: Any = None  # the held objects (a tuple of NNX objects), made from structure
        # Their leaves as this worker last pulled or changed them (host arrays), in the
        # structure's order: a function that names some objects pulls only theirs.
        self.leaves: list = []
        self.sent: dict = {}  # token -> bytes: the functions and constants received
        self.constants: dict = {}  # unpickled on first use, against the current roots
        self.functions: collections.OrderedDict = collections.OrderedDict()  # by content

    def create_dataset(self, dataset_id: int, dataset_fn: bytes) -> None:
        fn = wire.loads(dataset_fn, self._resolve)
        self.datasets[dataset_id] = call_dataset_fn(fn, self.strategy)

    def _resolve(self, token):
        return wire.resolve(token, self)

    # -- what the tokens stand for here (wire.Receiver) ------------------------------------

    def held(self, index: int):
        return self.roots[index]

    def iterator(self, iterator_id: int, dataset_id: int):
        if iterator_id not in self.iterators:
            self.iterators[iterator_id] = iter(self.datasets[dataset_id])
        return self.iterators[iterator_id]

    def dataset(self, dataset_id: int):
        return self.datasets[dataset_id]

    def function(self, key: tuple, data: bytes | None):
        """The function sent once under `key`, or with its payload (`data`), unpickled once."""
        if key in self.functions:
            self.functions.move_to_end(key)
        else:
            self.functions[key] = wire.loads(self.sent[key] if data is None else data, self._resolve)
            if len(self.functions) > FUNCTION_CACHE_SIZE:
                self.functions.popitem(last=False)
        return self.functions[key]

    def constant(self, token: tuple):
        if token not in self.constants:
            self.constants[token] = wire.loads(self.sent[token], self._resolve)
        return self.constants[token]

    def _pull(self, layout, indices: list) -> tuple[list, dict, list]:
        """(servers asked, their push counts by server, the leaves `indices`' host values)."""
        keys = layout.shard_keys(indices)
        asked = [ps for ps, k in enumerate(keys) if k]
        answers = call_servers(
            [self.parameter_servers[ps] for ps in asked],
            "pull",
            [(keys[ps],) for ps in asked],
            PARAMETER_SERVER_TIMEOUT_S,
        )
        per_ps: list[dict] = [{} for _ in keys]
        for ps, (_, values) in zip(asked, answers):
            per_ps[ps] = values
        versions = {ps: version for ps, (version, _) in zip(asked, answers)}
        return asked, versions, layout.join(per_ps, indices)

    def run(self, payload: dict) -> tuple:
        if not self.parameter_servers:
            # A process Ray restarted before the coordinator saw the old one die (it died
            # between two functions): nothing was attached or created here yet.
            return ("restarted",)
        if payload["structure"] is not None:
            self.structure = wire.loads(payload["structure"])
            self.version = payload["version"]
            self.roots = None
            self.constants = {}
            self.functions.clear()  # they may hold the old roots
        self.sent.update(payload["sent"])
        try:
            return self._run(payload)
        except LostParameterServer as e:
            return ("lost", str(e))

    def _run(self, payload: dict) -> tuple:
        assert self.structure is not None  # the first payload carried it
        graphdef, treedef, layout = self.structure
        groups = layout.groups if layout is not None else []
        # update="gradients": the servers own their optimizers' state mirroring parameters
        # (never pulled or pushed here) and their scalars (pulled to be read, not pushed).
        owned = {j for g in groups for j, _, _ in g.mirrored}
        indices: list = []
        if layout is not None:
            # The leaves of the objects the function names (all of them to build the copies).
            named = range(len(layout.shards)) if self.roots is None else layout.leaves_of(payload["objects"])
            indices = [i for i in named if i not in owned]
        if indices:
            asked, versions, pulled = self._pull(layout, indices)
            if self.roots is None:
                self.leaves = [None] * len(layout.shards)
                for j in owned:
                    shape, dtype = layout.signatures[j]
                    self.leaves[j] = np.zeros(shape, dtype)
            # Writable copies: the pulled arrays are Ray's read-only buffers (an in-place
            # write, `v[...] = ...` outside strategy.run, would fail on them), and they stay
            # apart from what the function changes in place, which the push compares them to.
            for i, leaf in zip(indices, layout.device_leaves(pulled, indices)):
                self.leaves[i] = leaf if prng_keys.is_key(leaf) else np.array(leaf)
            if self.roots is None:
                state = variables.state_of(treedef, self.leaves)
                if groups:
                    gradient_rule.tag(state)
                self.treedef = jax.tree.structure(state)  # with the tags: nnx.update keeps them
                self.roots = nnx.merge(graphdef, state)
                self.recorders = gradient_rule.attach(self.roots, groups, self.leaves) if groups else []
            else:
                nnx.update(self.roots, variables.state_of(self.treedef, self.leaves))
        try:
            fn, args, kwargs = wire.loads(payload["closure"], self._resolve)
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
            new = self._new_leaves(layout, indices) if indices else None
            gradients = gradient_rule.collect(self.recorders, groups) if groups and indices else {}
        except LostParameterServer:
            raise
        except BaseException as e:  # noqa: BLE001 - the coordinator re-raises it
            # The function may have left the local copies half changed (or changed their
            # structure): rebuild them, and what refers to them, for the next function.
            self.roots = None
            self.constants = {}
            self.functions.clear()
            return ("error", wire.pack_error(e))
        staleness, pushed = None, 0
        if new is not None:
            staleness, pushed = self._push(layout, indices, pulled, new, asked, versions, gradients)
        moved = (sum(leaf.nbytes for leaf in pulled) if indices else 0, pushed)
        return ("ok", data, staleness, moved)

    def _new_leaves(self, layout, indices: list) -> list:
        """The host values of the leaves `indices` after the function."""
        state = nnx.state(self.roots, nnx.Not(gradient_rule.GradientSum))
        leaves, now = jax.tree.flatten(state)
        if now != self.treedef:
            raise errors.UnsupportedArgumentError(
                "A scheduled function changed the structure of the objects the "
                "ParameterServerStrategy holds (it added, removed or replaced a variable or "
                "submodule). Build them completely on the coordinator, before scheduling."
            )
        written = gradient_rule.assigned_owned(leaves, layout.groups, layout.paths)
        if written is not None:
            raise errors.UnsupportedArgumentError(
                f"A scheduled function assigned {written}, optimizer state that the parameter "
                "servers hold and update under update='gradients' (a worker neither pulls nor "
                "pushes it: there it reads as zeros). Assign it on the coordinator (it reaches "
                "the servers with the next function), or use update='differences'. Nothing of "
                "this function was pushed."
            )
        host = [variables.host_value(leaves[i]) for i in indices]
        for i, leaf in zip(indices, host):
            path, (shape, dtype) = layout.paths[i], layout.signatures[i]
            if (leaf.shape, leaf.dtype) != (shape, dtype):
                raise errors.UnsupportedArgumentError(
                    f"A scheduled function changed {path} from shape {shape} and dtype {dtype} "
                    f"to shape {leaf.shape} and dtype {leaf.dtype}; the parameter servers keep "
                    "each variable's shape and dtype. Cast the new value (e.g. "
                    "`v[...] = new.astype(v.dtype)`). Nothing of this function was pushed."
                )
        return host

    def _push(
        self, layout, indices: list, pulled: list, new: list, asked: list, versions: dict, gradients: dict
    ):
        """Pushes what changed among the leaves `indices`, and the optimizers' recorded
        `gradients` (`gradient_rule.collect`), to the servers that hold them; returns the
        pushes other workers made meanwhile on the first server asked at the pull (None:
        nothing was pushed) and the bytes pushed."""
        for i, leaf in zip(indices, new):
            self.leaves[i] = leaf
        read_only = {j for g in layout.groups for j, _ in g.scalars} | {g.step for g in layout.groups}
        updates = [
            (None, None) if i in read_only else u for i, u in zip(indices, layout.updates(pulled, new))
        ]
        if not gradients and all(kind is None for kind, _ in updates):
            return None, 0  # nothing changed: no push (and no staleness to report)
        adds: list = [None] * len(layout.shards)
        assigns: list = [None] * len(layout.shards)
        for i, (kind, update) in zip(indices, updates):
            if kind is not None:
                (adds if kind == "add" else assigns)[i] = update
        adds, assigns = layout.split(adds), layout.split(assigns)
        sums: list[dict] = [{} for _ in range(layout.num_ps)]
        for g, (count, by_leaf) in gradients.items():
            for ps, part in enumerate(layout.split([by_leaf.get(i) for i in range(len(layout.shards))])):
                if part:
                    sums[ps][g] = (count, part)
        targets = sorted(set(asked) | {ps for ps in range(layout.num_ps) if sums[ps]})
        before = call_servers(
            [self.parameter_servers[ps] for ps in targets],
            "push",
            [(adds[ps], assigns[ps], sums[ps]) for ps in targets],
            PARAMETER_SERVER_TIMEOUT_S,
        )
        pushed = sum(u.nbytes for _, u in updates if u is not None)
        pushed += sum(a.nbytes for _, by_leaf in gradients.values() for a in by_leaf.values())
        return before[targets.index(asked[0])] - versions[asked[0]], pushed


def _result_bytes(result) -> bytes:
    try:
        return wire.dumps(_to_host(result))
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
