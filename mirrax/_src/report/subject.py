"""What the scaling report studies: one training step (a compiled `mirrax.Model`'s, or a user
function for `strategy.run` with its arguments) and one per-replica batch, checked, with the
byte counts of its state; copies of its objects, so the user's are never changed; the batch
made into the distributed global batch of N replicas."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import prng_keys, sharded_optimizer
from mirrax._src.training import keras_checks
from mirrax._src.training import model as model_lib

WHAT = "scaling_report"


@dataclasses.dataclass(frozen=True)
class Subject:
    """The step under study.

    Attributes:
      fn: the per-replica step, run as `strategy.run(fn, args=objects + (batch,), kwargs)`.
      objects: the arguments before the batch: copies of the caller's (NNX objects, arrays),
        their arrays on one device.
      kwargs: keyword arguments of `fn`.
      batch: one per-replica batch, a pytree of NumPy arrays with `per_replica_batch` rows.
      label: what the step is, for the table's title.
      per_replica_batch: the rows of `batch` (examples per replica per step).
      params_bytes: bytes of every `nnx.Param` of the objects: the gradients' bytes too.
      parameters: the number of values in them.
      param_arrays: the number of arrays in them (of gradients: one operand each of the
        combined all-reduce XLA makes).
      optimizer_arrays: (shape, bytes) of every array of the `nnx.Optimizer`s' state
        (`nnx.OptState`); `shard_optimizer_state=True` splits those it can.
      other_state_bytes: bytes of every other array of the objects (metrics, statistics, keys).
      batch_bytes: bytes of one per-replica batch.
    """

    fn: Callable
    objects: tuple
    kwargs: dict
    batch: Any
    label: str
    per_replica_batch: int
    params_bytes: int
    parameters: int
    param_arrays: int
    optimizer_arrays: tuple
    other_state_bytes: int
    batch_bytes: int

    def optimizer_state_bytes(self, replicas: int, sharded: bool) -> int:
        """Bytes of optimizer state one device holds: all of it, or with the state sharded over
        `replicas` each splittable array's 1/replicas (the rule of `shard_optimizer_state`:
        an array splits along its first dimension that `replicas` divides)."""
        total = 0
        for shape, nbytes in self.optimizer_arrays:
            splits = (
                sharded
                and replicas > 1
                and len(shape) > 0
                and sharded_optimizer.shard_dimension(shape, replicas) is not None
            )
            total += nbytes // replicas if splits else nbytes
        return total

    def copy_objects(self, device) -> tuple:
        """Fresh copies of `objects`, their arrays on `device` (one per strategy that runs it)."""
        return copy_objects(self.objects, device)


def from_model(model, batch) -> Subject:
    """The training step `fit` runs for a compiled `mirrax.Model`, on `batch` = (x, y) or
    (x, y, sample_weight) of one replica.

    Raises:
      NotCompiledError: the model is not compiled.
      InvalidBatchError: `batch` is not such a tuple of arrays with equal first dimensions.
    """
    fn, objects = model_lib.train_call(model, WHAT)
    if not (isinstance(batch, (tuple, list)) and len(batch) in (2, 3)):
        raise errors.InvalidBatchError(
            f"{WHAT}: a mirrax.Model's batch is (x, y) or (x, y, sample_weight) of ONE replica, "
            f"as fit's steps receive it; received a {type(batch).__name__}"
            f"{f' of {len(batch)} items' if isinstance(batch, (tuple, list)) else ''}. Pass e.g. "
            "(x_train[:32], y_train[:32]) for a per-replica batch of 32."
        )
    label = f"mirrax.Model({type(model.module).__name__}) train step (fit's)"
    return _subject(fn, objects, {}, tuple(batch), label)


def from_step(fn, batch, args, kwargs) -> Subject:
    """A user step for `strategy.run(fn, args=(*args, batch), kwargs=kwargs)`.

    Raises:
      InvalidArgumentTypeError: `fn` is not callable; `fn` is a bare model (an `nnx.Module` or
        a Keras model: callable, but its call is a forward pass, not a training step); `args`
        not a tuple or list, `kwargs` not a dict, or the arguments cannot be copied (no NNX
        graph or arrays).
      InvalidBatchError: `batch` holds no arrays, or arrays with different first dimensions.
    """
    if isinstance(fn, nnx.Module) or keras_checks.is_keras_model(fn):
        # Called as a step it would run the forward pass on the batch tuple and fail deep in
        # JAX ("Cannot concatenate arrays ..."), naming neither the model nor the fix.
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: step_or_model is a bare model ({type(fn).__name__}); the report needs a "
            "training step (loss, gradients, optimizer update). Wrap it in a compiled "
            "mirrax.Model: model = mirrax.Model(module); model.compile(optimizer='adam', "
            "loss=...); scaling_report(model, (x, y)); or pass your step function with "
            "args=(module, optimizer)."
        )
    if not callable(fn):
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: step_or_model must be a compiled mirrax.Model or a step function for "
            f"strategy.run; received {type(fn).__name__}. Pass model (after model.compile) or "
            "train_step with args=(model, optimizer)."
        )
    if not isinstance(args, (tuple, list)):
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: args must be a tuple of the step's arguments before the batch, e.g. "
            f"args=(model, optimizer); received {type(args).__name__}."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: kwargs must be a dict or None; received {type(kwargs).__name__}."
        )
    label = (
        f"{getattr(fn, '__qualname__', type(fn).__name__)}("
        + ", ".join([type(a).__name__ for a in args] + ["batch"])
        + ")"
    )
    return _subject(fn, tuple(args), dict(kwargs or {}), batch, label)


def _subject(fn, objects: tuple, kwargs: dict, batch, label: str) -> Subject:
    batch, rows = _host_batch(batch)
    copies = copy_objects(objects, jax.local_devices()[0])
    params = _variables(copies, nnx.Param)
    optimizer = _optimizer_variables(copies)
    seen = {id(v) for v in params} | {id(v) for v in optimizer}
    others = [v for v in _variables(copies, nnx.Variable) if id(v) not in seen]
    return Subject(
        fn=fn,
        objects=copies,
        kwargs=kwargs,
        batch=batch,
        label=label,
        per_replica_batch=rows,
        params_bytes=_bytes(params),
        parameters=sum(int(np.prod(np.shape(x))) for v in params for x in _arrays(v)),
        param_arrays=sum(len(_arrays(v)) for v in params),
        optimizer_arrays=tuple((tuple(np.shape(x)), _nbytes(x)) for v in optimizer for x in _arrays(v)),
        other_state_bytes=_bytes(others),
        # What the device receives: 64-bit host arrays become 32-bit without jax_enable_x64.
        batch_bytes=sum(
            int(np.prod(np.shape(leaf))) * jax.dtypes.canonicalize_dtype(np.result_type(leaf)).itemsize
            for leaf in jax.tree.leaves(batch)
        ),
    )


def _host_batch(batch) -> tuple:
    """(batch as NumPy arrays, its rows), or InvalidBatchError saying what is wrong."""
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        raise errors.InvalidBatchError(
            f"{WHAT}: batch holds no array; received {batch!r}. Pass one per-replica batch, "
            "e.g. (images[:32], labels[:32])."
        )
    arrays = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        array = np.asarray(leaf)
        if array.ndim == 0 or array.dtype == object:
            raise errors.InvalidBatchError(
                f"{WHAT}: every leaf of the batch must be an array with the examples along its "
                f"first axis; batch{jax.tree_util.keystr(path)} is {leaf!r} "
                f"({type(leaf).__name__}, shape {np.shape(leaf)}). Pass arrays of shape "
                "(per_replica_batch, ...)."
            )
        arrays.append(array)
    rows = {a.shape[0] for a in arrays}
    if len(rows) > 1 or 0 in rows:
        shapes = ", ".join(str(a.shape) for a in arrays)
        raise errors.InvalidBatchError(
            f"{WHAT}: the batch's arrays must all hold the same number (>= 1) of examples along "
            f"their first axis; received shapes {shapes}. Pass one per-replica batch whose "
            "leaves share their first dimension."
        )
    return jax.tree.unflatten(treedef, arrays), rows.pop()


def copy_objects(objects: tuple, device) -> tuple:
    """`objects` rebuilt with copies of their arrays on `device` (nothing shared with them).

    Raises:
      InvalidArgumentTypeError: the arguments are not NNX objects, arrays, or plain values.
    """
    try:
        graphdef, state = nnx.split(objects)
    except Exception as error:  # flax's error names the object it cannot split
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: the step's arguments must be NNX objects (modules, nnx.Optimizer, metrics), "
            f"arrays or Python values, which the report copies (it never runs your objects); "
            f"copying {', '.join(type(o).__name__ for o in objects)} failed: {error}. Pass those "
            "objects, or make the other values constants of the step."
        ) from error
    state = jax.tree.map(
        lambda x: jax.device_put(x, device, may_alias=False) if isinstance(x, (jax.Array, np.ndarray)) else x,
        state,
    )
    # Merged apart from tuple(): inside it, mypy takes the node type from tuple's Iterable and
    # refuses the tuple's GraphDef (flax's GraphDef is invariant in it).
    merged = nnx.merge(graphdef, state)
    return tuple(merged)


def distribute(strategy, batch, replicas: int):
    """The distributed batch of `replicas` copies of the per-replica `batch` (weak scaling),
    split by the strategy's input pipeline as `fit` and a distributed dataset split it."""
    global_batch = jax.tree.map(lambda leaf: np.concatenate([leaf] * replicas), batch)
    iterator = iter(strategy.experimental_distribute_dataset([global_batch]))
    try:
        return next(iterator)
    finally:
        iterator.close()


def graph_nodes(objects: tuple) -> tuple:
    """The NNX objects among `objects` (what a step's end waits for)."""
    return tuple(o for o in objects if nnx.graph.is_graph_node(o))


def _variables(objects: tuple, kind) -> list:
    """Every `Variable` of `kind` reachable from the objects, once each."""
    found, seen = [], set()
    for _, node in nnx.iter_graph(graph_nodes(objects)):
        if isinstance(node, kind) and id(node) not in seen:
            seen.add(id(node))
            found.append(node)
    return found


def _optimizer_variables(objects: tuple) -> list:
    found, seen = [], set()
    for _, node in nnx.iter_graph(graph_nodes(objects)):
        if isinstance(node, nnx.Optimizer):
            for variable in jax.tree.leaves(node.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
                if isinstance(variable, nnx.OptState) and id(variable) not in seen:
                    seen.add(id(variable))
                    found.append(variable)
    return found


def _arrays(variable) -> list:
    return [x for x in jax.tree.leaves(variable.get_value()) if hasattr(x, "shape")]


def _nbytes(x) -> int:
    if prng_keys.is_key(x):
        return int(prng_keys.to_data(x)[0].nbytes)
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _bytes(variables) -> int:
    return sum(_nbytes(x) for v in variables for x in _arrays(v))
