"""The `Strategy` base class, `scope()`, and `clear_session` (the functions that find the current
strategy, and the default strategy: current.py).

A strategy owns a one-axis `jax.sharding.Mesh` (`REPLICA_AXIS`) over its devices; one replica
per device. Subclasses (MirroredStrategy, OneDeviceStrategy, TPUStrategy, the default strategy)
only choose the devices. `Strategy` is a facade: every public method validates its input and
hands over to a collaborator it owns (its `run.runner.Runner`, its `devices.ReplicaDevices`
and `input_options.PipelineNames`, both on `strategy.extended`) or to a module function
(values.py for reduce / gather, input.py for datasets).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import jax

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute import devices as devices_lib
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute import input_options, invariant, values_from_function
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.reduce import ReduceOp
from mirrax._src.distribute.replica_context import (
    current_replica_context,
    current_strategy_in_scope,
    strategy_scope,
)
from mirrax._src.distribute.run import runner as runner_lib
from mirrax._src.distribute.run.arguments import check_owner, check_run_arguments
from mirrax._src.distribute.run.carried import CarriedSteps
from mirrax._src.distribute.values import DistributedValues, PerReplica, is_distributed


class StrategyExtended:
    """Device facts about a strategy, as `tf.distribute.StrategyExtended` (the read-only part).

    Attributes:
      worker_devices: names of the devices of this process that run replicas, e.g.
        ('/job:localhost/replica:0/task:0/device:CPU:0', ...).
      parameter_devices: where variables live; the same devices (variables are mirrored).
      replica_devices: mirrax's own: a `ReplicaDevices` (the `jax.Device` of every replica,
        the mesh, the replicated sharding, this process's replica ids), for mirrax's input
        pipeline and distributed values.
      pipeline_names: mirrax's own: the `PipelineNames` that name this strategy's distributed
        datasets alike on every process.
      shard_optimizer_state: mirrax's own: optimizer state is split over the replicas (ZeRO-1).
    """

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self.replica_devices = strategy._replica_devices
        self.pipeline_names = strategy._pipeline_names
        self.shard_optimizer_state = strategy._shard_optimizer_state

    @property
    def worker_devices(self) -> tuple:
        return tuple(devices_lib.tf_device_name(d) for d in self.replica_devices.local_devices)

    @property
    def parameter_devices(self) -> tuple:
        return self.worker_devices

    def carried_steps(self, objects: tuple, carry: bool = True) -> CarriedSteps:
        """mirrax's own, for loops that run many steps over the same NNX objects (fit,
        evaluate, predict): a `CarriedSteps` whose `run(fn, batch)` is
        `strategy.run(fn, args=objects + (batch,))` with the objects' state carried between
        steps and written into them at `release()` (docs/design.md, "Carried state in fit,
        evaluate and predict"); `carry` False writes it back after every step."""
        return CarriedSteps(self._strategy._runner, objects, carry)


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

    def __init__(
        self,
        devices,
        replica_invariant: bool = False,
        micro_batches: int = 8,
        shard_optimizer_state: bool = False,
    ):
        owner = type(self).__name__
        devices = tuple(devices)
        invariant.check_arguments(owner, replica_invariant, micro_batches)
        argument_checks.flag(owner, "shard_optimizer_state", shard_optimizer_state)
        self._shard_optimizer_state = bool(shard_optimizer_state)
        if replica_invariant:
            invariant.check_replicas(owner, int(micro_batches), len(devices))
        self._replica_invariant = bool(replica_invariant)
        self._micro_batches = int(micro_batches)
        self._replica_devices = devices_lib.ReplicaDevices(devices)
        self._pipeline_names = input_options.PipelineNames(self._replica_devices.spans_processes)
        self.mesh = self._replica_devices.mesh
        self.extended = self._new_extended()
        self._runner = runner_lib.Runner(self)
        _live_strategies.add(self)

    def _new_extended(self) -> StrategyExtended:
        return StrategyExtended(self)

    def _clear_caches(self) -> None:
        """Drops the compiled programs and cached device values (`clear_session`)."""
        self._runner.clear()

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._replica_devices)

    @property
    def replica_invariant(self) -> bool:
        return self._replica_invariant

    @property
    def micro_batches(self) -> int:
        return self._micro_batches

    def __repr__(self) -> str:
        mode = (
            f", replica_invariant=True, micro_batches={self._micro_batches}"
            if self._replica_invariant
            else ""
        )
        return (
            f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"devices=[{devices_lib.listing(self._replica_devices.devices, limit=None)}]{mode})"
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
        with strategy_scope(self):
            yield self

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
        check_run_arguments("strategy.run", fn, args, kwargs)
        return self._runner.run(fn, args, kwargs or {})

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
        check_run_arguments("strategy.experimental_lower", fn, args, kwargs)
        return self._runner.lower(fn, args, kwargs or {})

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
            values_lib.check_axis_type(axis, "strategy.reduce: axis", optional=True)
        if not jax.tree.leaves(value, is_leaf=is_distributed):
            raise errors.InvalidArgumentError(
                f"strategy.reduce: value holds no array to reduce; received {value!r}. Pass "
                "what strategy.run returned (a PerReplica or Mirrored, or a pytree of them)."
            )
        return jax.tree.map(lambda v: self._reduce_one(op, v, axis), value, is_leaf=is_distributed)

    def _reduce_one(self, op: ReduceOp, value, axis):
        if isinstance(value, DistributedValues):
            check_owner(self, value, "strategy.reduce: value")
        return values_lib.reduce_value(self, op, value, axis)

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
        values_lib.check_axis_type(axis, "strategy.gather: axis", optional=False)
        if not jax.tree.leaves(value, is_leaf=is_distributed):
            raise errors.InvalidArgumentError(
                f"strategy.gather: value holds no array to gather; received {value!r}. Pass "
                "what strategy.run returned (a PerReplica or Mirrored, or a pytree of them)."
            )
        return jax.tree.map(lambda v: self._gather_one(v, axis), value, is_leaf=is_distributed)

    def _gather_one(self, value, axis):
        if isinstance(value, DistributedValues):
            check_owner(self, value, "strategy.gather: value")
        return values_lib.gather_value(self, value, axis)

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
        count = len(self._replica_devices.local_replica_ids)
        columns = [leaf.values if is_distributed(leaf) else (leaf,) * count for leaf in leaves]
        return tuple(jax.tree.unflatten(treedef, [column[i] for column in columns]) for i in range(count))

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
        input_options.check_one_argument(
            value_fn, "experimental_distribute_values_from_function: value_fn", "ValueContext"
        )
        return values_from_function.values_from_function(self, value_fn)


# -- clear_session (the default strategy and the context functions: current.py) ------------


# Every strategy made in this process, for `clear_session` (weakly: a strategy nobody holds
# is collected with its programs).
_live_strategies: weakref.WeakSet[Strategy] = weakref.WeakSet()


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
