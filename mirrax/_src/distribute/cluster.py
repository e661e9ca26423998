"""Cluster resolution: which tasks make up a multi-worker job, and which one this process is.

Pure Python (no `jax.distributed` here): `ClusterSpec` and the resolvers of
`tf.distribute.cluster_resolver` (TF_CONFIG and explicit here, SLURM in slurm.py), plus the
facts a multi-worker strategy needs from them: the training tasks (chief + workers; the chief
counts as a worker, evaluator and ps do not), this task's index among them, the chief, and the
coordinator address. Every error is a `ValueError` raised when the resolver is constructed,
never at first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from mirrax import errors

# Job names a multi-worker job may use, as tf.distribute's multi_worker_util.
_KNOWN_JOBS = ("chief", "worker", "evaluator", "ps")
_TRAINING_JOBS = ("chief", "worker")


def _check_address(job: str, index: int, address) -> str:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (sep and host and port.isdigit()):
        raise errors.InvalidArgumentError(
            f"ClusterSpec: task {index} of job {job!r} must have a 'host:port' string address; "
            f"received {address!r}. Write it as e.g. 'localhost:2222'."
        )
    if not 1 <= int(port) <= 65535:
        raise errors.InvalidArgumentError(
            f"ClusterSpec: task {index} of job {job!r} has port {port} in {address!r}; a TCP "
            "port is in [1, 65535]."
        )
    return address


class ClusterSpec:
    """The tasks of a cluster by job name, as `tf.train.ClusterSpec`.

    Args:
      cluster: a dict of job name -> list of "host:port" addresses (task i at position i) or
        dict of task index -> address (sparse jobs); another `ClusterSpec`; or None (empty).

    Raises:
      ValueError: a job name that is not a non-empty string, a job that is not a list or dict,
        a task index that is not an int >= 0, or an address that is not "host:port".
    """

    def __init__(self, cluster: Mapping | ClusterSpec | None = None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if cluster is None:
            cluster = {}
        if not isinstance(cluster, Mapping):
            raise errors.InvalidArgumentError(
                "ClusterSpec: cluster must be a dict of job name -> list of 'host:port' "
                f"addresses; received {type(cluster).__name__} {cluster!r}."
            )
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise errors.InvalidArgumentError(
                    f"ClusterSpec: job names must be non-empty strings; received {job!r}. "
                    "Use e.g. 'chief', 'worker', 'evaluator' or 'ps'."
                )
            if isinstance(tasks, (list, tuple)):
                tasks = dict(enumerate(tasks))
            elif not isinstance(tasks, Mapping):
                raise errors.InvalidArgumentError(
                    f"ClusterSpec: job {job!r} must be a list of 'host:port' addresses or a dict "
                    f"of task index -> address; received {type(tasks).__name__} {tasks!r}."
                )
            checked = {}
            for index, address in tasks.items():
                if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                    raise errors.InvalidArgumentError(
                        f"ClusterSpec: task indices of job {job!r} must be ints >= 0; received {index!r}."
                    )
                checked[index] = _check_address(job, index, address)
            self._jobs[job] = dict(sorted(checked.items()))
        owners: dict = {}
        for job, tasks in self._jobs.items():
            for index, address in tasks.items():
                if address in owners:
                    raise errors.InvalidArgumentError(
                        f"ClusterSpec: {owners[address]} and {job}:{index} have the same address "
                        f"{address!r}; every task needs its own host:port."
                    )
                owners[address] = f"{job}:{index}"

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A copy as a dict: a list for a job with tasks 0..n-1, else a dict index -> address."""
        out = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out

    def _tasks(self, job: str) -> dict[int, str]:
        if job not in self._jobs:
            raise errors.InvalidArgumentError(
                f"ClusterSpec: no job named {job!r} in the cluster; its jobs are {self.jobs}."
            )
        return self._jobs[job]

    def num_tasks(self, job: str) -> int:
        """The number of tasks of `job`. Raises ValueError for a job not in the cluster."""
        return len(self._tasks(job))

    def task_indices(self, job: str) -> list[int]:
        """The task indices of `job`, sorted. Raises ValueError for a job not in the cluster."""
        return list(self._tasks(job))

    def task_address(self, job: str, index: int) -> str:
        """The "host:port" of task `index` of `job`.

        Raises:
          ValueError: `job` is not in the cluster, or has no task `index`.
        """
        tasks = self._tasks(job)
        if index not in tasks:
            raise errors.InvalidArgumentError(
                f"ClusterSpec: job {job!r} has no task with index {index!r}; its task indices "
                f"are {list(tasks)}."
            )
        return tasks[index]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


class ClusterResolver:
    """Base of the resolvers: a cluster spec, this task's type and index, and what follows.

    An empty cluster is one local task: one worker, index 0, the chief, no coordinator.
    Subclasses set `_cluster`, `task_type`, `task_id`, `rpc_layer`, then call `_validate()`.
    """

    _cluster: ClusterSpec
    task_type: str | None
    task_id: int | None
    rpc_layer: str | None

    def cluster_spec(self) -> ClusterSpec:
        """The cluster, as `tf.distribute.cluster_resolver.ClusterResolver.cluster_spec`."""
        return self._cluster

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (this one by default), prefixed "rpc_layer://" when one is set.

        Returns "" for an empty cluster, as TF.
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if not self._cluster or task_type is None:
            return ""
        address = self._cluster.task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def training_tasks(self) -> list[tuple[str, int]]:
        """The `(job, index)` pairs of the tasks that train, in `worker_index` order: the chief
        (when present), then the workers; empty for an empty cluster."""
        return [
            (job, index)
            for job in _TRAINING_JOBS
            if job in self._cluster.jobs
            for index in self._cluster.task_indices(job)
        ]

    @property
    def num_workers(self) -> int:
        """The number of training tasks: chief + workers (1 for an empty cluster)."""
        return len(self.training_tasks()) or 1

    @property
    def worker_index(self) -> int | None:
        """This task's index among the training tasks, in [0, num_workers).

        The chief, when present, is 0 and worker i is i + 1; with no chief, worker i is i.
        None for an evaluator or ps task, which do not train.
        """
        if not self._cluster:
            return 0
        tasks = self.training_tasks()
        key = (self.task_type, self.task_id)
        return tasks.index(key) if key in tasks else None

    @property
    def is_chief(self) -> bool:
        """This task is the chief: the "chief" task, or worker 0 when there is no chief job."""
        return self.worker_index == 0

    @property
    def coordinator_address(self) -> str | None:
        """The "host:port" of the chief (or of worker 0 with no chief); None for an empty cluster.

        This is where `jax.distributed`'s coordination service will listen.
        """
        tasks = self.training_tasks()
        return self._cluster.task_address(*tasks[0]) if tasks else None

    @property
    def num_input_pipelines(self) -> int:
        """One input pipeline per training task: `num_workers`."""
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int | None:
        """This task's input pipeline: `worker_index` (None for a task that does not train)."""
        return self.worker_index

    def _validate(self, source: str) -> None:
        cluster = self._cluster
        if not cluster:
            return
        unknown = [job for job in cluster.jobs if job not in _KNOWN_JOBS]
        if unknown:
            raise errors.InvalidArgumentError(
                f"{source}: unknown job names {unknown} in the cluster {cluster.as_dict()}. "
                f"Use only {list(_KNOWN_JOBS)}."
            )
        for job in ("chief", "evaluator"):
            if job in cluster.jobs and cluster.num_tasks(job) > 1:
                raise errors.InvalidArgumentError(
                    f"{source}: the cluster may have at most one {job!r} task; received "
                    f"{cluster.as_dict()[job]!r}. Make the others 'worker' tasks."
                )
        # An evaluator-only cluster is TF's sidecar evaluator task (parameter_server_training
        # tutorial): it trains nothing and joins no collective, so TF accepts it.
        if not self.training_tasks() and self.task_type != "evaluator":
            raise errors.InvalidArgumentError(
                f"{source}: the cluster {cluster.as_dict()} has no training task. Add a 'chief' "
                "or 'worker' job."
            )
        if self.task_type is None or self.task_id is None:
            raise errors.InvalidArgumentError(
                f"{source}: the cluster has {len(self.training_tasks())} training tasks but "
                f"this task's type and index are not set (received task_type="
                f"{self.task_type!r}, task_id={self.task_id!r}). Set both, e.g. "
                '"task": {"type": "worker", "index": 0} in TF_CONFIG.'
            )
        if self.task_type not in cluster.jobs:
            raise errors.InvalidArgumentError(
                f"{source}: unknown task type {self.task_type!r}; the cluster's jobs are "
                f"{cluster.jobs}. Set the task type to one of them."
            )
        if not isinstance(self.task_id, int) or isinstance(self.task_id, bool):
            raise errors.InvalidArgumentTypeError(
                f"{source}: the task index must be an int; received {self.task_id!r} of type "
                f'{type(self.task_id).__name__}. Write e.g. task_id=0 (or "index": 0 in '
                "TF_CONFIG)."
            )
        if self.task_id not in cluster.task_indices(self.task_type):
            indices = cluster.task_indices(self.task_type)
            raise errors.InvalidArgumentError(
                f"{source}: task index {self.task_id!r} is out of range for job "
                f"{self.task_type!r}, whose task indices are {indices}. Set the index to one "
                "of them."
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(cluster_spec={self._cluster!r}, task_type="
            f"{self.task_type!r}, task_id={self.task_id!r})"
        )


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit arguments.

    As `tf.distribute.cluster_resolver.SimpleClusterResolver`.

    Args:
      cluster_spec: a `ClusterSpec` or a dict accepted by it.
      task_type: this task's job ("chief", "worker", "evaluator" or "ps").
      task_id: this task's index in its job.
      rpc_layer: e.g. "grpc"; only prefixes `master()`.

    Raises:
      ValueError: unknown job names or task type, a task index out of range, more than one
        chief or evaluator, no training task, or type/index unset in a non-empty cluster.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ):
        self._cluster = ClusterSpec(cluster_spec)
        self.task_type = task_type
        self.task_id = task_id
        self.rpc_layer = rpc_layer
        check_rpc_layer("SimpleClusterResolver", rpc_layer)
        self._validate("SimpleClusterResolver")


def check_rpc_layer(source: str, rpc_layer) -> None:
    """Refuses an `rpc_layer` that is neither None nor a string; `source` names the caller.

    Raises:
      InvalidArgumentTypeError: any other type.
    """
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise errors.InvalidArgumentTypeError(
            f"{source}: rpc_layer must be None or a string such as 'grpc'; received "
            f"{rpc_layer!r} of type {type(rpc_layer).__name__}."
        )


def _parse_tf_config(tf_config) -> dict:
    if isinstance(tf_config, Mapping):
        config = tf_config
    else:
        try:
            config = json.loads(tf_config)
        except (TypeError, json.JSONDecodeError) as e:
            raise errors.InvalidArgumentError(
                f"TF_CONFIG is not valid JSON ({e}); received {tf_config!r}. Set it to e.g. "
                '\'{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
                '"task": {"type": "worker", "index": 0}}\'.'
            ) from None
    if not isinstance(config, Mapping):
        raise errors.InvalidArgumentError(
            f"TF_CONFIG must be a JSON object with keys 'cluster' and 'task'; received {config!r}."
        )
    cluster = config.get("cluster") or {}
    task = config.get("task") or {}
    if not isinstance(task, Mapping):
        raise errors.InvalidArgumentError(
            f'TF_CONFIG \'task\' must be an object like {{"type": "worker", "index": 0}}; received {task!r}.'
        )
    task_type, task_id = task.get("type"), task.get("index")
    if task_type is not None and not isinstance(task_type, str):
        raise errors.InvalidArgumentError(
            f"TF_CONFIG task 'type' must be a string such as \"worker\"; received {task_type!r}."
        )
    if task_id is not None and (not isinstance(task_id, int) or isinstance(task_id, bool)):
        raise errors.InvalidArgumentError(
            f"TF_CONFIG task 'index' must be an int such as 0; received {task_id!r}."
        )
    rpc_layer = config.get("rpc_layer")
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise errors.InvalidArgumentError(f"TF_CONFIG 'rpc_layer' must be a string; received {rpc_layer!r}.")
    # JSON object keys are strings: a sparse job {"1": "h:2222"} means task index 1.
    if isinstance(cluster, Mapping):
        cluster = {
            job: ({_json_index(job, k): v for k, v in tasks.items()} if isinstance(tasks, Mapping) else tasks)
            for job, tasks in cluster.items()
        }
    return {"cluster": cluster, "type": task_type, "index": task_id, "rpc_layer": rpc_layer}


def _json_index(job, key):
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if isinstance(key, int):
        return key
    raise errors.InvalidArgumentError(
        f'TF_CONFIG: the task indices of sparse job {job!r} must be digit strings such as "0"; '
        f"received {key!r}."
    )


class TFConfigClusterResolver(ClusterResolver):
    """A resolver from TF's `TF_CONFIG` JSON.

    As `tf.distribute.cluster_resolver.TFConfigClusterResolver`.

    TF_CONFIG is `{"cluster": {job: [addresses]}, "task": {"type": job, "index": i},
    "rpc_layer": optional}`. Without TF_CONFIG (and `required=False`) the cluster is empty: one
    local task.

    Args:
      task_type, task_id, rpc_layer: override TF_CONFIG's values when not None.
      tf_config: the JSON string or an already-parsed dict; None reads `os.environ["TF_CONFIG"]`.
      required: raise when there is no TF_CONFIG instead of resolving a one-task cluster.

    Raises:
      ValueError: TF_CONFIG is missing (with `required=True`), not valid JSON, or has wrong
        types; or any error of `SimpleClusterResolver` (unknown task type, index out of range).
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        *,
        tf_config: str | Mapping | None = None,
        required: bool = False,
    ):
        if tf_config is None:
            tf_config = os.environ.get("TF_CONFIG", "")
        if isinstance(tf_config, str) and not tf_config.strip():
            if required:
                raise errors.InvalidArgumentError(
                    "TF_CONFIG is not set (received an empty or missing TF_CONFIG). Set the "
                    "TF_CONFIG environment variable on every task, start the job with "
                    "`mirrax launch`, or use SlurmClusterResolver / SimpleClusterResolver."
                )
            tf_config = {}
        config = _parse_tf_config(tf_config)
        try:
            self._cluster = ClusterSpec(config["cluster"])
        except ValueError as e:
            raise errors.InvalidArgumentError(f"TF_CONFIG 'cluster': {e}") from None
        self.task_type = config["type"] if task_type is None else task_type
        self.task_id = config["index"] if task_id is None else task_id
        self.rpc_layer = config["rpc_layer"] if rpc_layer is None else rpc_layer
        self._validate("TFConfigClusterResolver")
