"""`ParameterServerStrategy`: asynchronous data parallelism on Ray, as
`tf.distribute.ParameterServerStrategy`.

Parameter servers (Ray actors) hold the variables, large ones cut into shards by the
`variable_partitioner`; workers (Ray actors, restarted by Ray when they die) run the
functions a `ClusterCoordinator` schedules, each on its own devices, never waiting for each
other. This process, the coordinator, runs no step itself: `run` and the dataset methods are
used inside scheduled functions, where the strategy is the worker's MirroredStrategy.
"""

from __future__ import annotations

import jax

from mirrax import errors
from mirrax._src.distribute.strategy import Strategy, StrategyExtended
from mirrax._src.parameter_server import cluster as cluster_lib
from mirrax._src.parameter_server import gradient_rule
from mirrax._src.parameter_server.remote_values import RemoteValue
from mirrax._src.parameter_server.store import VariableStore


def is_shut_down(strategy) -> bool:
    """True for a ParameterServerStrategy after `shutdown()`: its objects and the models
    compiled under it are the coordinator's own again, free to move to another strategy."""
    return isinstance(strategy, ParameterServerStrategy) and strategy.extended.cluster.stopped


class ParameterServerExtended(StrategyExtended):
    """`strategy.extended` of a ParameterServerStrategy.

    Attributes (mirrax's own, besides StrategyExtended's):
      cluster: the started Ray actors (`parameter_servers`, `workers`, their `ps_pids` and
        `worker_pids` at start).
      variable_store: the coordinator's record of the held objects.
      coordinator: the strategy's `ClusterCoordinator`, once made.
      update: the update rule, "differences" or "gradients".
    """

    def __init__(self, strategy):
        super().__init__(strategy)
        self.update = strategy._update
        self.cluster = strategy._cluster
        self.variable_store = strategy._store
        self.coordinator = None

    @property
    def parameter_devices(self) -> tuple:
        return tuple(
            f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(len(self.cluster.parameter_servers))
        )

    def variable_placement(self) -> dict:
        """{variable path: [(parameter server, rows of its shard), ...]} of the held objects
        (rows None for a scalar), e.g. {"objects[0].kernel": [(0, 3), (1, 2)]}."""
        return self.variable_store.placement()

    def lost_server(self, reason: str) -> errors.LostParameterServerError:
        return errors.LostParameterServerError(
            f"ParameterServerStrategy: {reason}. The variables it held are lost, so training "
            "cannot continue with this strategy. Make a new strategy and coordinator, restore "
            "the last checkpoint (mirrax.Checkpoint(...).restore(path)) and schedule again; "
            "docs/parameter_server.md, 'Failures'."
        )


class ParameterServerStrategy(Strategy):
    """Asynchronous training with parameter servers and workers on Ray.

    As `tf.distribute.ParameterServerStrategy`: NNX objects (modules, optimizers, metrics)
    that scheduled functions use are held by the parameter servers, variables of more than
    one row cut into shards by `variable_partitioner` and dealt round-robin; each worker pulls
    the current values when a function starts and pushes what the function changed when it
    ends, without waiting for the other workers. Use it with a `ClusterCoordinator`.

    Two update rules (docs/parameter_server.md, "Update rules"): "gradients", the default,
    is TF's: `optimizer.update` records the gradients, the worker pushes them, and each
    parameter server runs the optax update on the parameters it holds with the optimizer
    state it holds (the worker neither pulls nor pushes that state); "differences" pushes what
    the step changed (new - pulled), which a parameter server adds to its current values (for
    SGD exactly TF's gradient application; Adam computes its step from the state the worker
    pulled). Every other held state (metrics, batch statistics) travels as differences.

    Args:
      cluster_resolver: a `mirrax.RayClusterResolver`, or a TF-style resolver
        (`TFConfigClusterResolver`, `SimpleClusterResolver`) whose cluster has 'ps' and
        'worker' jobs; their hosts must be nodes of the Ray cluster (RAY_ADDRESS, or a local
        one).
      variable_partitioner: None (no variable is cut) or a partitioner from
        `mirrax.partitioners` (or any callable with their contract).
      update: "gradients" (the default: TF's rule, which trains better under staleness,
        BENCHMARKS.md; make the optimizers after the strategy, under its scope, so that each
        one's model is known) or "differences".

    Attributes:
      num_replicas_in_sync: the replicas of one worker (its local devices): the replicas that
        one scheduled step runs on, as in TF.

    Raises:
      TypeError: `cluster_resolver` or `variable_partitioner` is of the wrong type.
      ValueError: the cluster has no 'ps' or no 'worker' tasks, or `update` is not a rule.
      MissingDependencyError: Ray is not installed.
      UnresponsivePeerError: a task did not start within 180 s.
    """

    extended: ParameterServerExtended  # made by _new_extended

    def __init__(self, cluster_resolver, variable_partitioner=None, update: str = gradient_rule.GRADIENTS):
        if not isinstance(update, str) or update not in gradient_rule.RULES:
            raise errors.InvalidArgumentError(
                f"ParameterServerStrategy: update must be one of {list(gradient_rule.RULES)} "
                f"(how a worker's step reaches the parameter servers; docs/parameter_server.md, "
                f"'Update rules'); received {update!r}."
            )
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise errors.InvalidArgumentTypeError(
                "ParameterServerStrategy: variable_partitioner must be None or a partitioner "
                "such as mirrax.partitioners.FixedShardsPartitioner(2); received "
                f"{type(variable_partitioner).__name__}."
            )
        self._cluster = cluster_lib.Cluster(cluster_resolver)
        if update == gradient_rule.GRADIENTS:
            gradient_rule.watch_optimizers()  # before the optimizers are made, under scope()
        self._store = VariableStore(
            self._cluster.parameter_servers,
            variable_partitioner,
            lambda reason: self.extended.lost_server(reason),
            update,
        )
        self._variable_partitioner = variable_partitioner
        self._update = update
        self._cluster.before_stop.append(self._store.detach)
        super().__init__([jax.devices()[0]])

    def _new_extended(self) -> ParameterServerExtended:
        return ParameterServerExtended(self)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._cluster.num_replicas

    @property
    def cluster_resolver(self):
        return self._cluster.resolver

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(num_workers={len(self._cluster.workers)}, "
            f"num_ps={len(self._cluster.parameter_servers)}, "
            f"variable_partitioner={self._variable_partitioner!r}, update={self._update!r})"
        )

    def __reduce__(self):
        raise errors.UnsupportedArgumentError(
            "A ParameterServerStrategy cannot be pickled. Inside a function given to "
            "coordinator.schedule it is replaced by the worker's strategy automatically."
        )

    def _on_coordinator(self, method: str, fix: str):
        raise errors.UnsupportedArgumentError(
            f"ParameterServerStrategy.{method} runs on the workers, not on the coordinator: {fix}"
        )

    def run(self, fn, args=(), kwargs=None):
        """Raises here: call `strategy.run` inside a function given to `coordinator.schedule`,
        where it runs on the worker's devices (as TF's).

        Raises:
          UnsupportedArgumentError: always, on the coordinator.
        """
        self._on_coordinator(
            "run", "call it inside a function you pass to mirrax.ClusterCoordinator(strategy).schedule(fn)."
        )

    def reduce(self, reduce_op, value, axis: int | None = None):
        """As `Strategy.reduce`, on values of the coordinator; inside a scheduled function
        `strategy.reduce` is the worker's.

        Raises:
          TypeError: `value` holds a `RemoteValue` (fetch it first), and as `Strategy.reduce`.
        """
        if any(isinstance(v, RemoteValue) for v in jax.tree.leaves(value)):
            raise errors.InvalidArgumentTypeError(
                "ParameterServerStrategy.reduce: value holds a RemoteValue, a scheduled "
                "function's result on its way from a worker. Reduce inside the scheduled "
                "function (strategy.reduce there is the worker's), or fetch it first: "
                "coordinator.fetch(value)."
            )
        return super().reduce(reduce_op, value, axis)

    def experimental_lower(self, fn, args=(), kwargs=None):
        self._on_coordinator(
            "experimental_lower", "lower the step on a MirroredStrategy of the workers' devices instead."
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        self._on_coordinator(
            "experimental_distribute_dataset",
            "create the dataset on every worker with coordinator.create_per_worker_dataset(dataset_fn).",
        )

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        self._on_coordinator(
            "distribute_datasets_from_function",
            "call it inside the "
            "dataset_fn given to coordinator.create_per_worker_dataset, or pass "
            "that dataset_fn to create_per_worker_dataset directly.",
        )

    def shutdown(self) -> None:
        """Kills the strategy's Ray actors and stops its coordinator's threads (mirrax's own;
        also done at exit, and by the resolver's `shutdown()`, which then stops a local Ray
        cluster it started). Scheduling afterwards is an error. On a local Ray cluster it
        returns once Ray has freed the actors' CPUs (and GPUs), so a strategy made next can
        start at once.

        Raises:
          UnresponsivePeerError: Ray has not freed them within 30 s (the message names the
            processes still running).
        """
        self._cluster.stop(wait_release=True)
