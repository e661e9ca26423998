"""The `Strategy` base class, `scope()`, and the module functions that find the current strategy.

A strategy owns a one-axis `jax.sharding.Mesh` (`REPLICA_AXIS`) over its devices; one replica
per device. Subclasses (MirroredStrategy, OneDeviceStrategy, TPUStrategy, the default strategy)
only choose the devices. Every public method validates its input and hands over to one private
helper (`_run.run`, the reductions below, `input.py`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute import _run
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute import invariant
from mirrax._src.distribute import multihost
from mirrax._src.distribute.reduce import ReduceOp
from mirrax._src.distribute.replica_context import (
    REPLICA_AXIS,
    ReplicaContext,
    _state,
    current_replica_context,
    current_strategy_in_scope,
)
from mirrax._src.distribute.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    by_replica,
    is_distributed,
    mask_from_lengths,
    put_stacked,
    stack_host_values,
)


class StrategyExtended:
    """Device facts about a strategy, as `tf.distribute.StrategyExtended` (the read-only part).

    Attributes:
      worker_devices: names of the devices of this process that run replicas, e.g.
        ('/job:localhost/replica:0/task:0/device:CPU:0', ...).
      parameter_devices: where variables live; the same devices (variables are mirrored).
    """

    def __init__(self, strategy: "Strategy"):
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple:
        s = self._strategy
        return tuple(device_name(s._devices[r]) for r in s._local_replica_ids)

    @property
    def parameter_devices(self) -> tuple:
        return self.worker_devices


class Strategy:
    """Base class of the strategies: runs one function on every replica, as `tf.distribute.Strategy`.

    Attributes:
      mesh: the `jax.sharding.Mesh` with the single axis `mirrax.REPLICA_AXIS` over the replicas'
        devices (replica r on `mesh.devices[r]`).
      num_replicas_in_sync: number of replicas (devices) over all workers, a Python int.
      extended: a `StrategyExtended` with the device names.
      replica_invariant: True when results are the same bits at every replica count that
        divides `micro_batches` (docs/design.md, "Replica invariance").
      micro_batches: the number of equal micro-batches each global batch is cut into in
        replica-invariant mode (a power of two).
    """

    def __init__(self, devices, replica_invariant: bool = False, micro_batches: int = 8):
        devices = tuple(devices)
        owner = type(self).__name__
        invariant.check_arguments(owner, replica_invariant, micro_batches)
        if replica_invariant:
            invariant.check_replicas(owner, int(micro_batches), len(devices))
        self._replica_invariant = bool(replica_invariant)
        self._micro_batches = int(micro_batches)
        self._devices = devices
        self.mesh = Mesh(np.array(devices, dtype=object), (REPLICA_AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self._local_replica_ids = tuple(
            i for i, d in enumerate(devices) if d.process_index == jax.process_index()
        )
        self._run_cache = _run.new_cache()
        self._example_counts: dict = {}  # int -> replicated int32 scalar (strategy.run)
        self._in_flight = _run.new_in_flight(devices)
        self._compile_counts: dict = {}
        self._datasets_made = 0  # names distributed datasets alike on every process
        self._iterations_started = 0  # passes over them, counted alike on every process
        self.extended = StrategyExtended(self)
        _live_strategies.add(self)

    def _clear_caches(self) -> None:
        """Drops the compiled programs and cached device values (`clear_session`)."""
        self._run_cache.clear()
        self._example_counts.clear()
        self._compile_counts.clear()

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def replica_invariant(self) -> bool:
        return self._replica_invariant

    @property
    def micro_batches(self) -> int:
        return self._micro_batches

    def __repr__(self) -> str:
        mode = (f", replica_invariant=True, micro_batches={self._micro_batches}"
                if self._replica_invariant else "")
        return (
            f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"devices=[{', '.join(short_device_name(d) for d in self._devices)}]{mode})"
        )

    # -- scope ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self):
        """Makes this the current strategy, as `tf.distribute.Strategy.scope`.

        Inside, `mirrax.get_strategy()` returns this strategy and code is in cross-replica
        context. Models and optimizers need not be created inside: their state is placed on the
        replicas on first use (in `run`, or when a `mirrax.Model` is compiled).

        Raises:
          MixedStrategyError: another strategy's scope is already open on this thread.
        """
        current = current_strategy_in_scope()
        if current is not None and current is not self:
            raise errors.MixedStrategyError(
                f"Cannot enter the scope of {self!r} inside the scope of {current!r}: mixing "
                "different strategies is not supported (as in tf.distribute). Close the outer "
                "`with strategy.scope():` block first."
            )
        _state.strategy_stack.append(self)
        try:
            yield self
        finally:
            _state.strategy_stack.pop()

    # -- run ----------------------------------------------------------------------------------

    def run(self, fn: Callable, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` once on every replica, as ONE compiled program.

        As `tf.distribute.Strategy.run`. `PerReplica` arguments (e.g. a batch from a distributed
        dataset) are split: each replica sees its own shard, of shape (per_replica_batch, ...).
        NNX objects (modules, `nnx.Optimizer`s, metrics) enter identical on every replica and are
        updated in place after the step; gradients of their parameters are summed over the
        replicas by JAX itself. Other arrays enter replicated; Python scalars and other hashable
        values are compile-time constants (a new value retraces, as with `tf.function`).
        Inside, `mirrax.get_replica_context()` gives the replica id, collectives and the batch
        mask. The program is compiled once per function and argument structure.

        Args:
          fn: the per-replica function. It must take the NNX objects it uses as arguments.
          args: tuple (or list) of positional arguments.
          kwargs: dict of keyword arguments, or None.

        Returns:
          `fn`'s output structure with each array leaf replaced by a `PerReplica` (when it differs
          across replicas; shape (num_replicas, ...) inside) or a `Mirrored` (when JAX proves it
          is the same on every replica).

        Raises:
          TypeError: `fn` is not callable, `args` is not a tuple/list, `kwargs` not a dict, or an
            argument or output is of an unsupported type.
          CapturedStateError: `fn` reaches NNX objects through a closure or global.
          VaryingVariableError: a variable with aggregation NONE differs across replicas after
            the step (the message names it).
          MixedStrategyError: an argument belongs to another strategy.
        """
        _check_run_arguments("strategy.run", fn, args, kwargs)
        return _run.run(self, fn, args, kwargs or {})

    def experimental_lower(self, fn: Callable, args=(), kwargs=None):
        """The program `run(fn, args, kwargs)` would execute, lowered, without running it.

        mirrax's own (TF has no equivalent): for reading the step's HLO (`.as_text()`), its
        collectives, cost and memory (`.compile().cost_analysis()`, `.memory_analysis()`).
        The program is compiled and cached as `run` would (the next `run` with the same
        argument structure reuses it); no step runs and the arguments are not changed.

        Args:
          fn, args, kwargs: as `run`.

        Returns:
          A `jax.stages.Lowered` of the one program `run` would call on these arguments.

        Raises:
          As `run`.
        """
        _check_run_arguments("strategy.experimental_lower", fn, args, kwargs)
        return _run.lower(self, fn, args, kwargs or {})

    # -- cross-replica operations ------------------------------------------------------------

    def reduce(self, reduce_op, value, axis: int | None = None):
        """Combines a per-replica value into one array, as `tf.distribute.Strategy.reduce`.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`, or "sum"/"mean" in any case.
          value: a `PerReplica` or `Mirrored` (or a pytree of them) from `run` or a distributed
            dataset, or a plain array (taken as the same on every replica).
          axis: None to combine the replicas' values elementwise (they must have one shape);
            an int to also reduce along that axis of each replica's value. With axis=0 on a
            batch, MEAN is the mean over all valid examples of all replicas, not a mean of the
            replicas' means, and padding rows of a partial batch are excluded.

        Returns:
          A `jax.Array` (replicated on the strategy's devices): the shape of one replica's
          value, without `axis` when given. MEAN of an empty selection is 0, never NaN.

        Raises:
          ValueError: unknown `reduce_op`; `axis` out of range; per-replica shapes that cannot
            be combined elementwise; SUM of a plain (non-distributed) value over several replicas.
          MixedStrategyError: `value` comes from another strategy.
        """
        op = ReduceOp.from_any(reduce_op)
        if axis is not None:
            _check_axis_type(axis, "strategy.reduce: axis", optional=True)
        if not jax.tree.leaves(value, is_leaf=is_distributed):
            raise errors.InvalidArgumentError(
                f"strategy.reduce: value holds no array to reduce; received {value!r}. Pass "
                "what strategy.run returned (a PerReplica or Mirrored, or a pytree of them)."
            )
        return jax.tree.map(
            lambda v: self._reduce_one(op, v, axis), value, is_leaf=is_distributed
        )

    def _reduce_one(self, op: ReduceOp, value, axis):
        replicas = self.num_replicas_in_sync
        if isinstance(value, DistributedValues):
            _run._check_owner(self, value, "strategy.reduce: value")
        if isinstance(value, PerReplica):
            if value._ragged is not None:
                shapes = [jax.tree.map(np.shape, v) for v in value._ragged]
                raise errors.InvalidArgumentError(
                    f"strategy.reduce: the replicas' values have shapes {shapes}, which cannot "
                    "be combined into one value. Make the shapes agree (except along axis 0, "
                    "which axis=0 reduces)."
                )
            return jax.tree.map(lambda x: self._reduce_stacked(op, value, x, axis), value._value)
        if isinstance(value, Mirrored):
            return jax.tree.map(lambda x: self._reduce_same(op, x, axis, replicas), value._value)
        if op is ReduceOp.SUM and replicas > 1:
            raise errors.InvalidArgumentError(
                f"strategy.reduce: cannot SUM the plain (non-distributed) value {value!r} over "
                f"{replicas} replicas: it is one value, not one per replica (as "
                "tf.distribute). Reduce the PerReplica value that strategy.run returned, or use "
                "MEAN."
            )
        return self._reduce_same(op, jnp.asarray(value), axis, 1)

    def _reduce_stacked(self, op: ReduceOp, value: PerReplica, x, axis):
        if self._replica_invariant:
            return self._reduce_invariant(op, value, x, axis)
        if axis is None:
            x = _elementwise_rows(value, x)
            return x.sum(0) if op is ReduceOp.SUM else x.mean(0)
        axis = _normalize_axis(axis, x.ndim - 1)
        if value._masked(x) and axis == 0:
            mask = value._mask.reshape(value._mask.shape + (1,) * (x.ndim - 2))
            total = jnp.where(mask, x, jnp.zeros((), x.dtype)).sum((0, 1))
            if op is ReduceOp.SUM:
                return total
            count = value._mask.sum()
            return total / jnp.maximum(count, 1).astype(jnp.result_type(total, jnp.float32))
        reduced = x.sum((0, axis + 1))
        if op is ReduceOp.SUM:
            return reduced
        return reduced / (x.shape[0] * x.shape[axis + 1] or 1)

    def _reduce_invariant(self, op: ReduceOp, value: PerReplica, x, axis):
        """`_reduce_stacked` in replica-invariant mode: every float sum in the fixed tree.

        Over replicas: the pairwise tree over the replica index (which continues each
        replica's tree over its micro-batches). Along a batch's axis 0: each micro-batch's
        rows are summed at the same shape, then the micro-batches in the pairwise tree, so
        the bits do not depend on the replica count.
        """
        replicas = x.shape[0]
        if axis is None:
            x = _elementwise_rows(value, x)
            total = invariant.pairwise_sum(x)
            return total if op is ReduceOp.SUM else total / jnp.asarray(replicas, total.dtype)
        axis = _normalize_axis(axis, x.ndim - 1)
        rows = x.shape[1] if x.ndim > 1 else 0
        local = self._micro_batches // replicas
        if axis == 0 and rows % local == 0:
            micro = x.reshape((self._micro_batches, rows // local) + x.shape[2:])
            if value._masked(x):
                mask = value._mask.reshape(micro.shape[:2] + (1,) * (x.ndim - 2))
                micro = jnp.where(mask, micro, jnp.zeros((), x.dtype))
                count = value._mask.sum()
            else:
                count = x.shape[0] * rows
            total = invariant.pairwise_sum(micro.sum(1))
        else:
            total = invariant.pairwise_sum(x.sum(axis + 1))
            count = replicas * x.shape[axis + 1]
        if op is ReduceOp.SUM:
            return total
        return total / jnp.maximum(count, 1).astype(jnp.result_type(total, jnp.float32))

    @staticmethod
    def _reduce_same(op: ReduceOp, x, axis, replicas: int):
        if axis is not None:
            axis = _normalize_axis(axis, x.ndim)
            x = x.sum(axis) if op is ReduceOp.SUM else x.mean(axis)
        return x * replicas if op is ReduceOp.SUM else x

    def gather(self, value, axis: int):
        """Concatenates the replicas' values along `axis`, as `tf.distribute.Strategy.gather`.

        Replica 0's value comes first. For a batch, only the real examples are gathered (the
        padding of a partial batch is dropped), so the result has the true global batch size.

        Args:
          value: a `PerReplica` or `Mirrored` (or a pytree of them); a plain array counts as the
            same value on every replica.
          axis: the axis of each replica's value to concatenate along (values need rank >= 1).

        Returns:
          A `jax.Array`: one replica's shape with dimension `axis` multiplied by the number of
          replicas (or, for a partial batch, the true total).

        Raises:
          ValueError: `axis` out of range, or scalar per-replica values.
          MixedStrategyError: `value` comes from another strategy.
        """
        _check_axis_type(axis, "strategy.gather: axis", optional=False)
        if not jax.tree.leaves(value, is_leaf=is_distributed):
            raise errors.InvalidArgumentError(
                f"strategy.gather: value holds no array to gather; received {value!r}. Pass "
                "what strategy.run returned (a PerReplica or Mirrored, or a pytree of them)."
            )
        return jax.tree.map(lambda v: self._gather_one(v, axis), value, is_leaf=is_distributed)

    def _gather_one(self, value, axis):
        if isinstance(value, DistributedValues):
            _run._check_owner(self, value, "strategy.gather: value")
        if isinstance(value, PerReplica):
            if value._ragged is not None:
                pieces = [jnp.asarray(v) for v in value._ragged]
                return jnp.concatenate(pieces, _normalize_axis(axis, pieces[0].ndim))
            return jax.tree.map(lambda x: self._gather_stacked(value, x, axis), value._value)
        if isinstance(value, Mirrored):
            value = value._value
        replicas = self.num_replicas_in_sync

        def repeat(x):
            if jnp.ndim(x) == 0:
                raise errors.InvalidArgumentError(
                    f"strategy.gather: {x!r} is a scalar, which has no axis to concatenate "
                    "along. Gather arrays of rank >= 1 (e.g. x[None], shape (1,))."
                )
            return jnp.concatenate([jnp.asarray(x)] * replicas, _normalize_axis(axis, jnp.ndim(x)))

        return jax.tree.map(repeat, value)

    def _gather_stacked(self, value: PerReplica, x, axis):
        if x.ndim == 1:
            raise errors.InvalidArgumentError(
                "strategy.gather: the per-replica values are scalars, which have no axis to "
                "concatenate along. Use strategy.experimental_local_results(value), or return "
                "x[None] (shape (1,)) from the step to gather one value per replica."
            )
        axis = _normalize_axis(axis, x.ndim - 1)
        if value._masked(x) and axis == 0:
            rows = x.shape[1]
            keep = np.concatenate(
                [r * rows + np.arange(n) for r, n in enumerate(value._lengths)]
            ).astype(np.int32)
            return self._on_every_process(lambda x: x.reshape((-1,) + x.shape[2:])[keep], x)
        return self._on_every_process(lambda x: jnp.concatenate(list(x), axis), x)

    def _on_every_process(self, fn, *args):
        """`fn(*args)` as a program whose result is replicated, so every process can read it."""
        if jax.process_count() == 1:
            return fn(*args)
        return jax.jit(fn, out_shardings=self._replicated)(*args)

    def experimental_local_results(self, value) -> tuple:
        """The values of this process's replicas, as `Strategy.experimental_local_results`.

        Args:
          value: a `PerReplica`/`Mirrored` or a pytree of them (e.g. what `run` returned), or
            any other value.

        Returns:
          A tuple with one entry per local replica, in replica order. Shards of a partial batch
          are returned unpadded (an empty shard has shape (0, ...)). A non-distributed value
          gives `(value,)`, as tf.distribute.
        """
        if isinstance(value, DistributedValues):
            return value.values
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
        if not any(is_distributed(leaf) for leaf in leaves):
            return (value,)
        count = len(self._local_replica_ids)
        columns = [
            leaf.values if is_distributed(leaf) else (leaf,) * count for leaf in leaves
        ]
        return tuple(
            jax.tree.unflatten(treedef, [column[i] for column in columns]) for i in range(count)
        )

    # -- input ----------------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of `dataset` over the replicas, as TF's method of that name.

        Args:
          dataset: batches of the GLOBAL batch size: a tuple/dict of arrays (one batch), any
            iterable of such batches (a list, a generator, a Grain loader, a PyTorch
            DataLoader), or an object with `as_numpy_iterator()` (a `tf.data.Dataset`).
          options: `mirrax.InputOptions` or None.

        Returns:
          A `DistributedDataset`; iterating it yields `PerReplica` batches. A batch of `n`
          examples gives replica r the consecutive examples from r*ceil(n/R), min(n - r*ceil(n/R),
          ceil(n/R)) of them (TF's rule), padded to the first batch's per-replica size, with
          `get_replica_context().batch_mask` marking the real ones.

        Raises:
          TypeError: `dataset` is not iterable or `options` is not an `InputOptions`.
        """
        return input_lib.DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options=None):
        """Builds one input pipeline per worker and deals its batches to the replicas.

        As `tf.distribute.Strategy.distribute_datasets_from_function`: `dataset_fn(ctx)` is
        called once per input pipeline (once per process) with an `InputContext`; it must return
        batches of the PER-REPLICA batch size (`ctx.get_per_replica_batch_size(global)`), which
        are dealt to this worker's replicas in turn and never split again.

        Raises:
          TypeError: `dataset_fn` is not callable or `options` is not an `InputOptions`.
        """
        if not callable(dataset_fn):
            raise errors.InvalidArgumentTypeError(
                "distribute_datasets_from_function: dataset_fn must be callable as "
                f"dataset_fn(input_context); received {type(dataset_fn).__name__}."
            )
        return input_lib.DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> PerReplica:
        """Makes a `PerReplica` from `value_fn(ctx)` called once per local replica.

        As TF's method of that name; `ctx` is a `ValueContext` with `replica_id_in_sync_group`
        and `num_replicas_in_sync`. Values whose first axes differ in length are padded and
        masked (so `reduce(..., axis=0)` counts only real elements); values with different
        trailing shapes are kept as they are (readable, but not reducible elementwise).

        Raises:
          TypeError: `value_fn` is not callable.
        """
        if not callable(value_fn):
            raise errors.InvalidArgumentTypeError(
                "experimental_distribute_values_from_function: value_fn must be callable as "
                f"value_fn(value_context); received {type(value_fn).__name__}."
            )
        input_lib.check_one_argument(
            value_fn, "experimental_distribute_values_from_function: value_fn", "ValueContext")
        values = [
            value_fn(input_lib.ValueContext(r, self.num_replicas_in_sync))
            for r in self._local_replica_ids
        ]
        stacked, lengths = stack_host_values(values)
        if jax.process_count() > 1:
            lengths = self._agree_value_lengths(values, stacked, lengths)
            if lengths is not None:
                stacked, _ = stack_host_values(values, rows=max(lengths))
        if stacked is None:
            placed = tuple(
                jax.device_put(v, self._devices[r]) for v, r in zip(values, self._local_replica_ids)
            )
            return PerReplica(self, None, ragged=placed)
        if lengths is None:
            return PerReplica(self, put_stacked(self, stacked))
        local_lengths = [lengths[r] for r in self._local_replica_ids]
        mask = put_stacked(self, mask_from_lengths(local_lengths, max(lengths)))
        return PerReplica(self, put_stacked(self, stacked), mask=mask, lengths=lengths)

    def _agree_value_lengths(self, values, stacked, lengths):
        """Every replica's first-axis length (all processes), or None when no padding is needed.

        Raises:
          ValueError: some process's values cannot be stacked (trailing shapes differ), which
            a multi-process PerReplica cannot hold.
        """
        self._values_made = getattr(self, "_values_made", 0) + 1
        mine = None if stacked is None else [
            int(jax.tree.leaves(v)[0].shape[0]) if jax.tree.leaves(v)[0].ndim else -1
            for v in values
        ]
        votes = multihost.exchange(f"values/{self._values_made}", mine)
        if any(v is None for v in votes):
            raise errors.InvalidArgumentError(
                "experimental_distribute_values_from_function: the replicas' values have "
                "different trailing shapes on some process, which a multi-process PerReplica "
                "cannot hold. Return values of one shape (first axis may differ)."
            )
        every = by_replica(self, votes)
        if len(set(every)) == 1 and lengths is None:
            return None
        return tuple(every)


def _elementwise_rows(value: PerReplica, x):
    """`x` (a leaf of `value`, stacked) without a batch's padding rows, for an elementwise
    reduce over the replicas.

    Raises:
      ValueError: the replicas hold batches of different lengths.
    """
    if not value._masked(x):
        return x
    if len(set(value._lengths)) > 1:
        raise errors.InvalidArgumentError(
            "strategy.reduce: the replicas' values have different lengths along axis 0 "
            f"({list(value._lengths)}), so they cannot be combined elementwise. Pass "
            "axis=0 to reduce along that axis too."
        )
    return x[:, : value._lengths[0]]


def _check_run_arguments(what: str, fn, args, kwargs) -> None:
    if not callable(fn):
        raise errors.InvalidArgumentTypeError(
            f"{what}: fn must be callable (a function, method or NNX module); received "
            f"{fn!r} of type {type(fn).__name__}. Call it as {what}(step_fn, args=(...))."
        )
    if not isinstance(args, (tuple, list)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: args must be a tuple or list of positional arguments; received a "
            f"{type(args).__name__}. For one argument write args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise errors.InvalidArgumentTypeError(
            f"{what}: kwargs must be a dict or None; received a {type(kwargs).__name__}."
        )


def _check_axis_type(axis, what: str, optional: bool) -> None:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{what} must be an int{' or None' if optional else ''}; received {axis!r} of type "
            f"{type(axis).__name__}."
            + ("" if optional else " gather needs the axis to concatenate along, e.g. axis=0.")
        )


def _normalize_axis(axis, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise errors.InvalidArgumentTypeError(f"axis must be an int or None; received {axis!r}.")
    if not -ndim <= axis < ndim:
        raise errors.InvalidArgumentError(
            f"axis {axis} is out of range for per-replica values of rank {ndim}; use an axis in "
            f"[{-ndim}, {ndim})."
        )
    return int(axis) % ndim


def device_name(device) -> str:
    """TF-style full device name: '/job:localhost/replica:0/task:P/device:CPU:i'."""
    return (
        f"/job:localhost/replica:0/task:{device.process_index}/device:"
        f"{device.platform.upper()}:{local_index(device)}"
    )


def short_device_name(device) -> str:
    """'cpu:3', 'gpu:0': platform and index among this process's devices of that platform."""
    return f"{device.platform}:{local_index(device)}"


def local_index(device) -> int:
    """The index of `device` among its process's devices of the same platform."""
    same = [d for d in jax.devices(device.platform) if d.process_index == device.process_index]
    return same.index(device)


# -- the default strategy and the context functions ------------------------------------------


class _DefaultStrategy(Strategy):
    """The strategy in effect outside every scope: one replica on JAX's default device."""

    def __init__(self):
        super().__init__([jax.devices()[0]])


_default: list = []
# Every strategy made in this process, for `clear_session` (weakly: a strategy nobody holds
# is collected with its programs).
_live_strategies: "weakref.WeakSet[Strategy]" = weakref.WeakSet()


def clear_session() -> None:
    """Drops every compiled program and cache, as `tf.keras.backend.clear_session()`.

    For notebooks, where cells that define new models, functions and strategies pile up
    compiled programs: clears the compiled `strategy.run` programs (so also those of
    `mirrax.Model` steps) and cached device values of every strategy, including the default
    strategy's, and JAX's own compilation caches (`jax.clear_caches()`). Nothing else changes:
    strategies, models, optimizers, distributed datasets and iterators keep working, and the
    next step compiles again (once). Multi-worker: call it on every worker, or on none.

    Raises:
      ReplicaContextError: called inside `strategy.run`.
    """
    if current_replica_context() is not None:
        raise errors.ReplicaContextError(
            "clear_session() was called inside strategy.run, where the running program cannot "
            "be dropped. Call it outside the step, e.g. between training runs."
        )
    for strategy in list(_live_strategies):
        strategy._clear_caches()
    jax.clear_caches()


def default_strategy() -> Strategy:
    """The process-wide default strategy (created on first use, so importing mirrax is cheap)."""
    if not _default:
        _default.append(_DefaultStrategy())
    return _default[0]


def get_strategy() -> Strategy:
    """The current strategy, as `tf.distribute.get_strategy`.

    Inside `strategy.run` or `strategy.scope()` that strategy; otherwise the default strategy
    (one replica on JAX's default device, so code written for strategies also runs without one).
    """
    ctx = current_replica_context()
    if ctx is not None:
        return ctx.strategy
    return current_strategy_in_scope() or default_strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's `scope()` or `run`, as `tf.distribute.has_strategy`."""
    return not isinstance(get_strategy(), _DefaultStrategy)


def in_cross_replica_context() -> bool:
    """True inside `strategy.scope()` but outside `strategy.run`, as TF's function of that name."""
    return current_replica_context() is None and current_strategy_in_scope() is not None


def get_replica_context() -> ReplicaContext | None:
    """The current `ReplicaContext`, as `tf.distribute.get_replica_context`.

    Inside `strategy.run`: the running replica's context. In cross-replica context (inside a
    scope, outside run): None. Outside every scope: the default strategy's replica context
    (one replica; its collectives return their input).
    """
    ctx = current_replica_context()
    if ctx is not None:
        return ctx
    if current_strategy_in_scope() is not None:
        return None
    return ReplicaContext(default_strategy(), traced=False)
