"""`MultiWorkerMirroredStrategy` on `jax.distributed`, and `CommunicationOptions`.

One process per training task (the chief and the workers of the cluster spec); the mesh spans
every device of every process, so `strategy.run` is one SPMD program whose gradient all-reduce
crosses hosts (NCCL on GPU, Gloo on CPU: XLA's collectives, no transport of our own). The
cluster comes from a resolver (`TF_CONFIG` by default, as TF); the chief's address is where
jax.distributed's coordination service listens, and only there.

Failure handling: the start-up barrier is bounded (`CommunicationOptions.timeout_seconds`,
default 300 s) by a watchdog that names the tasks being waited for, and a peer that dies later
is detected by the coordination service's heartbeat (timeout `timeout_seconds`, default 30 s),
which ends every surviving process with a non-zero status instead of a hang. A worker that
fails with an uncaught exception exits at once (see `_exit_at_once`) so the same happens.
"""

from __future__ import annotations

import enum
import math
import os
import signal
import socket
import sys
import threading
import time

import jax

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute import _compat, invariant, multihost, worker_exit
from mirrax._src.distribute.cluster import ClusterResolver, TFConfigClusterResolver
from mirrax._src.distribute.devices import tf_device_name
from mirrax._src.distribute.strategy import Strategy, StrategyExtended

DEFAULT_STARTUP_TIMEOUT_SECONDS = 300
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 30


class CommunicationImplementation(enum.Enum):
    """Which collective library carries the all-reduce, as TF's enum of that name.

    AUTO: NCCL on GPUs, Gloo on CPUs (XLA's choice). RING: TF's ring all-reduce; on CPU that is
    Gloo (whose all-reduce is a ring); on GPU XLA always uses NCCL. NCCL: requires GPUs.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Options of the cross-worker collectives, as `tf.distribute.experimental.CommunicationOptions`.

    Args:
      bytes_per_pack: accepted for compatibility; XLA's all-reduce combiner decides the packing.
      timeout_seconds: None or a number > 0 (seconds). Bounds the start-up barrier (every
        training task must join within it, default 300 s) and the detection of a dead peer
        (heartbeat timeout, default 30 s).
      implementation: a `CommunicationImplementation` or its name ("AUTO", "RING", "NCCL").

    Raises:
      ValueError: a non-positive timeout or an unknown implementation.
    """

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation=CommunicationImplementation.AUTO,
    ):
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float))
            or not timeout_seconds > 0
        ):
            raise errors.InvalidArgumentError(
                f"CommunicationOptions: timeout_seconds must be None or a number > 0 (seconds); "
                f"received {timeout_seconds!r}."
            )
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            # TF's meaning: a byte count, 0 for no packing; a fraction or a negative count is
            # a mistake even though mirrax ignores the value.
            raise errors.InvalidArgumentError(
                "CommunicationOptions: bytes_per_pack must be an int >= 0 (bytes; 0 = no "
                f"packing, as TF); received {bytes_per_pack!r}. mirrax ignores it (XLA packs "
                "the all-reduces): leave it out."
            )
        given = implementation
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation[implementation.upper()]
            except KeyError:
                implementation = None
        if not isinstance(implementation, CommunicationImplementation):
            implementation = given
            raise errors.InvalidArgumentError(
                "CommunicationOptions: implementation must be one of "
                f"{[m.name for m in CommunicationImplementation]}; received {implementation!r}."
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(timeout_seconds={self.timeout_seconds!r}, "
            f"implementation={self.implementation.name})"
        )


class MultiWorkerExtended(StrategyExtended):
    """Task facts of a multi-worker strategy, as TF's `strategy.extended`.

    Attributes:
      task_type: this task's job ("chief" or "worker"); "worker" for a one-task cluster.
      task_id: this task's index within its job.
      should_checkpoint: True on the chief only (as TF): the chief writes checkpoints.
      should_save_summary: True on the chief only (as TF): the chief writes summaries.
      should_init: True (every task initializes its variables, identically).
      experimental_between_graph: True (one program per task).
    """

    def __init__(self, strategy: MultiWorkerMirroredStrategy):
        super().__init__(strategy)
        resolver = strategy.cluster_resolver
        self.task_type = resolver.task_type or "worker"
        self.task_id = resolver.task_id or 0
        self.should_init = True
        self.experimental_between_graph = True

    @property
    def should_checkpoint(self) -> bool:
        return self._strategy.cluster_resolver.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._strategy.cluster_resolver.is_chief

    @property
    def worker_devices(self) -> tuple:
        return tuple(
            tf_device_name(d, job=self.task_type, task=self.task_id)
            for d in self.replica_devices.local_devices
        )


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of several processes (hosts).

    As `tf.distribute.MultiWorkerMirroredStrategy`: every training task (the chief and the
    workers) runs this same program; one replica per device of every task; variables are
    mirrored; gradients are all-reduced across all of them inside the compiled step. Create it
    at the start of the program, before any other JAX call (it initializes `jax.distributed`,
    which must come first). A one-task cluster (or none) is a `MirroredStrategy` on the local
    devices.

    Args:
      cluster_resolver: a `ClusterResolver` (`TFConfigClusterResolver`,
        `SlurmClusterResolver`, `SimpleClusterResolver`); None reads `TF_CONFIG`.
      communication_options: a `CommunicationOptions` or None.
      replica_invariant, micro_batches: as `MirroredStrategy`: with replica_invariant=True,
        the same bits on every layout whose total replica count divides `micro_batches`
        (1x4, 2x2 and 4x1 alike).
      shard_optimizer_state: as `MirroredStrategy`: optimizer state split over all replicas
        of all workers.

    Attributes:
      cluster_resolver: the resolver.
      num_replicas_in_sync: devices over all training tasks (e.g. 3 tasks x 2 devices = 6).
      extended: `MultiWorkerExtended` (task_type, task_id, should_checkpoint, ...).

    Raises:
      ValueError: a malformed or inconsistent cluster (TF_CONFIG not JSON, task index out of
        range, unknown task type); this task does not train (an evaluator or ps task); NCCL
        requested without GPUs.
      TypeError: arguments of the wrong type.
      RuntimeError: JAX was already used in this process with a different process layout, or
        before the strategy could initialize jax.distributed.

    Security: the coordination service (on the chief) has no authentication; run the cluster
    on a private network only.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        replica_invariant: bool = False,
        micro_batches: int = 8,
        shard_optimizer_state: bool = False,
    ):
        invariant.check_arguments(type(self).__name__, replica_invariant, micro_batches)
        argument_checks.flag(type(self).__name__, "shard_optimizer_state", shard_optimizer_state)
        if cluster_resolver is None:
            cluster_resolver = TFConfigClusterResolver()
        if not isinstance(cluster_resolver, ClusterResolver):
            raise errors.InvalidArgumentTypeError(
                "MultiWorkerMirroredStrategy: cluster_resolver must be a mirrax ClusterResolver "
                "(TFConfigClusterResolver, SlurmClusterResolver, SimpleClusterResolver) or None; "
                f"received {type(cluster_resolver).__name__}."
            )
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise errors.InvalidArgumentTypeError(
                "MultiWorkerMirroredStrategy: communication_options must be a "
                f"mirrax.CommunicationOptions or None; received "
                f"{type(communication_options).__name__}."
            )
        if cluster_resolver.worker_index is None:
            raise errors.InvalidArgumentError(
                f"MultiWorkerMirroredStrategy: this task is {cluster_resolver.task_type!r}:"
                f"{cluster_resolver.task_id}, which does not train (only 'chief' and 'worker' "
                "tasks do). Run the evaluator's own program without this strategy (e.g. "
                "mirrax.SidecarEvaluator over the chief's checkpoint directory)."
            )
        self.cluster_resolver = cluster_resolver
        self.communication_options = communication_options
        if cluster_resolver.num_workers > 1:
            _initialize(cluster_resolver, communication_options)
        if (
            communication_options.implementation is CommunicationImplementation.NCCL
            and jax.default_backend() != "gpu"
        ):
            raise errors.InvalidArgumentError(
                "MultiWorkerMirroredStrategy: CommunicationImplementation.NCCL needs GPUs, but "
                f"JAX's backend is {jax.default_backend()!r}. Use AUTO (Gloo on CPU)."
            )
        super().__init__(jax.devices(), replica_invariant, micro_batches, shard_optimizer_state)

    def _new_extended(self) -> MultiWorkerExtended:
        return MultiWorkerExtended(self)

    def __repr__(self) -> str:
        r = self.cluster_resolver
        return (
            f"MultiWorkerMirroredStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"num_workers={r.num_workers}, task={self.extended.task_type}:"
            f"{self.extended.task_id})"
        )


def _initialize(resolver: ClusterResolver, options: CommunicationOptions) -> None:
    """Initializes jax.distributed for `resolver`'s task (once per process).

    Raises:
      RuntimeError: jax.distributed is already initialized with another layout, or JAX's
        backends started before it (jax.distributed must come first).
    """
    count, index = resolver.num_workers, resolver.worker_index
    state = _compat.distributed_state()
    if state.client is not None:
        if (state.num_processes, state.process_id) != (count, index):
            raise RuntimeError(
                "MultiWorkerMirroredStrategy: jax.distributed is already initialized as process "
                f"{state.process_id} of {state.num_processes}, but the cluster says this task is "
                f"{index} of {count}. Create the strategy once per process, with one cluster."
            )
        return
    if _compat.backends_started(default=False):
        raise RuntimeError(
            "MultiWorkerMirroredStrategy: JAX was already used in this process (its devices are "
            "initialized), so jax.distributed can no longer join the cluster. Create the "
            "strategy first thing in the program, before any jax call (jax.devices(), creating "
            "arrays, building models)."
        )
    coordinator = resolver.coordinator_address
    if resolver.is_chief:
        _check_coordinator_port(coordinator)
    # Gloo carries cross-process collectives on CPU; GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    startup = options.timeout_seconds or DEFAULT_STARTUP_TIMEOUT_SECONDS
    heartbeat = options.timeout_seconds or DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    done = threading.Event()
    watchdog = threading.Thread(
        target=_startup_watchdog,
        args=(resolver, startup, done),
        daemon=True,
        name="mirrax-startup-watchdog",
    )
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=count,
            process_id=index,
            # JAX's own deadline comes after the watchdog's, which says which tasks are missing.
            initialization_timeout=int(math.ceil(startup)) + 30,
            heartbeat_timeout_seconds=max(1, int(math.ceil(heartbeat))),
            coordinator_bind_address=coordinator,
        )
    finally:
        done.set()
    sys.excepthook = _exit_at_once(sys.excepthook)
    sys.exit = worker_exit.exit_at_once_on_failure(sys.exit)
    if threading.current_thread() is threading.main_thread():
        # jax.distributed's preemption notifier catches SIGTERM and only logs it, so a scheduler's
        # or `mirrax launch`'s SIGTERM would not stop the worker: restore termination.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_coordinator_port(address: str) -> None:
    """Raises when the chief cannot listen on the coordinator's address (port in use, or an
    address of another machine); JAX would fail with a bare "Failed to start RPC server" or
    crash."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
            probe.listen(1)
    except OSError as e:
        raise RuntimeError(
            f"MultiWorkerMirroredStrategy: this task is the chief and must run the coordinator "
            f"at {address} (its address in the cluster spec), but cannot listen there: "
            f"{e.strerror or e}. Another process may use port {port} (an earlier job still "
            "running?), or the address is not one of this machine's. Free the port or choose "
            "another one (mirrax launch --port P, or the chief's address in TF_CONFIG)."
        ) from None


def _exit_at_once(previous):
    """An excepthook that ends a failed worker at once, after printing the traceback.

    A normal exit would first wait in jax.distributed's shutdown barrier for peers that are
    themselves blocked in the next collective, waiting for this process: a hang of minutes.
    Exiting at once stops this process's heartbeat, so the coordination service ends the peers
    (or `mirrax launch` does, immediately).
    """

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        status = 130 if issubclass(kind, KeyboardInterrupt) else 1
        me = jax.process_index()
        if _is_lost_peer(value):
            what = (
                f"worker {me} lost a peer worker during a collective (the peer exited or "
                "crashed; see its log for why)"
            )
        else:
            what = f"worker {me} failed with {kind.__name__}"
        print(
            f"mirrax: {what}; exiting now with status {status}, so that no peer waits for it "
            "(they fail at their next collective, or when the heartbeat times out). Rerun the "
            "job; with callbacks.BackupAndRestore, training resumes from the last backup.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # A disagreement found at a host exchange is found by every process (each holds all
        # the values), so every report is certain to come.
        _let_failing_peers_report(shared=isinstance(value, errors.DivergentWorkersError))
        os._exit(status)

    return hook


# How long the chief, which hosts the coordination service, waits at a failure for the other
# workers to report theirs before it exits (its exit ends the service, and JAX then aborts the
# peers, possibly before they print their own error).
_PEER_REPORT_SECONDS = 3.0
# The same for a failure every process detects (a DivergentWorkersError): the reports are
# sure to come, but can be late on a loaded machine (a CI run once saw a worker of such a
# failure end by SIGABRT with 3 s). The wait ends as soon as every peer has reported.
_SHARED_FAILURE_REPORT_SECONDS = 30.0
_PEER_EXIT_GRACE_SECONDS = 0.2


def _let_failing_peers_report(shared: bool) -> None:
    """Marks this worker failed in the coordination service's store; the chief then waits up
    to `_PEER_REPORT_SECONDS` in all (`_SHARED_FAILURE_REPORT_SECONDS` when `shared`: a
    failure every process detects) for the others' marks, so that workers that fail at the
    same step all print their error before the chief's exit ends the service.

    Only the chief waits: a peer that waited too (for the chief's mark) could be aborted by
    JAX while the chief exits (tried: a SIGABRT in each of 3 runs of the divergent-input tests).
    """
    try:
        client = multihost.coordination_client()
        me, count = jax.process_index(), jax.process_count()
        client.key_value_set(f"mirrax/failed/{me}", "1")
        if me != 0:
            return
        seconds = _SHARED_FAILURE_REPORT_SECONDS if shared else _PEER_REPORT_SECONDS
        deadline = time.monotonic() + seconds
        for peer in range(1, count):
            left_ms = int(1000 * (deadline - time.monotonic()))
            if left_ms <= 0:
                return
            client.blocking_key_value_get(f"mirrax/failed/{peer}", left_ms)
        # A peer's mark is stored before its set call returns to it: give it the moment to
        # reach its own exit before this one ends the service.
        time.sleep(_PEER_EXIT_GRACE_SECONDS)
    except Exception:  # a lost coordinator or a peer that never fails: exit anyway
        return


def _startup_watchdog(resolver: ClusterResolver, timeout: float, done: threading.Event):
    """Ends the process with a clear message when the cluster has not formed within `timeout`.

    jax.distributed.initialize blocks in C++ (Python cannot interrupt it) and, at its own
    deadline, aborts with a bare "Deadline Exceeded"; this names the tasks instead.
    """
    if done.wait(timeout):
        return
    spec = resolver.cluster_spec()
    me = (resolver.task_type, resolver.task_id)
    others = [
        f"{job}:{i} ({spec.task_address(job, i)})" for job, i in resolver.training_tasks() if (job, i) != me
    ]
    if resolver.is_chief:
        what = (
            f"this task ({me[0]}:{me[1]}) runs the coordinator at "
            f"{resolver.coordinator_address} and waited {timeout:g} s for the other training "
            f"tasks to join; still missing: {', '.join(others)} (at least one of them did not "
            "start, crashed, or cannot reach the coordinator)"
        )
    else:
        what = (
            f"this task ({me[0]}:{me[1]}) could not join the cluster within {timeout:g} s: the "
            f"coordinator (chief) at {resolver.coordinator_address} is not reachable, or one of "
            f"the other tasks ({', '.join(others)}) did not join"
        )
    print(
        f"mirrax: MultiWorkerMirroredStrategy: {what}. Start every task of the cluster (same "
        "TF_CONFIG cluster, each with its own task index), check the addresses and the "
        "firewall, or raise CommunicationOptions(timeout_seconds=...). Exiting with status 1.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


def _is_lost_peer(error: BaseException) -> bool:
    """A collective failed because a peer's connection closed (Gloo on CPU, NCCL on GPU)."""
    text = str(error)
    return ("Gloo" in text or "NCCL" in text or "nccl" in text) and any(
        sign in text
        for sign in (
            "closed by peer",
            "reset by peer",
            "Connection refused",
            "remote process exited",
            "Broken pipe",
        )
    )
