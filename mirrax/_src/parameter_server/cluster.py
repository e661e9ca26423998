"""Where a ParameterServerStrategy's tasks run: a Ray cluster (a local one, or an existing
one joined by address), described by `RayClusterResolver` or by a TF-style resolver with
'ps' and 'worker' jobs (`TFConfigClusterResolver`, `SimpleClusterResolver`).

The coordinator is the user's process. Parameter servers are Ray actors that are never
restarted (their variables would be gone); workers are Ray actors that Ray restarts when
their process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import socket
import sys
import time
import warnings
import weakref

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute.cluster import ClusterResolver
from mirrax._src.parameter_server import actors, start_logs
from mirrax._src.parameter_server.ray_calls import import_ray

# Seconds to wait for every actor of a new strategy to start (a worker imports JAX).
START_TIMEOUT_S = 180.0
# Seconds between two looks at the starting tasks (and at the logs of any that died).
START_POLL_S = 1.0
# Seconds `strategy.shutdown()` waits for Ray to give the killed actors' resources back to a
# local cluster (`ray.kill` returns at once; Ray frees them when the processes have ended).
RELEASE_TIMEOUT_S = 30.0

# Every started cluster, stopped before Ray shuts down (a thread that calls Ray after
# `ray.shutdown()` makes Ray end the process with exit code 1).
_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


def stop_all() -> None:
    """Stops every live cluster's threads and actors (before `ray.shutdown()`, and at exit)."""
    for cluster in list(_live):
        cluster.stop()


class _TokenNotice(logging.Filter):
    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray")


@contextlib.contextmanager
def _without_token_notice():
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice = _TokenNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


class RayClusterResolver:
    """The tasks of a ParameterServerStrategy on a Ray cluster (mirrax's own resolver).

    Args:
      num_workers: worker tasks (Ray actors), >= 1.
      num_ps: parameter-server tasks (Ray actors), >= 1.
      address: None starts a local Ray cluster on this machine when the strategy is made (and
        `shutdown()` stops it); "auto" or "host:port" joins an existing cluster (`ray.init`'s
        `address`). A Ray already initialized in this process is used as it is.
      num_cpus_per_worker, num_gpus_per_worker: the Ray resources each worker asks for (a GPU
        worker sees only its GPUs, through CUDA_VISIBLE_DEVICES set by Ray).
      worker_env: environment variables for the worker processes, e.g.
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"} for two CPU devices each;
        None inherits this process's environment.
      runtime_env: a Ray `runtime_env` for every task (e.g. {"working_dir": "."} to ship the
        code to a remote cluster).

    Raises:
      ValueError: a count is not an int >= 1 (>= 0 for the resources).
    """

    task_type = "chief"
    task_id = 0

    def __init__(
        self,
        num_workers: int,
        num_ps: int,
        address: str | None = None,
        *,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        worker_env: dict | None = None,
        runtime_env: dict | None = None,
    ):
        self.num_workers = argument_checks.count("RayClusterResolver", "num_workers", num_workers, 1)
        self.num_ps = argument_checks.count("RayClusterResolver", "num_ps", num_ps, 1)
        if address is not None and not isinstance(address, str):
            raise errors.InvalidArgumentTypeError(
                f"RayClusterResolver: address must be None, 'auto' or 'host:port'; received {address!r}."
            )
        for name, value in (
            ("num_cpus_per_worker", num_cpus_per_worker),
            ("num_gpus_per_worker", num_gpus_per_worker),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise errors.InvalidArgumentError(
                    f"RayClusterResolver: {name} must be a finite number >= 0; received {value!r}."
                )
        for name, value in (("worker_env", worker_env), ("runtime_env", runtime_env)):
            if value is not None and not isinstance(value, dict):
                raise errors.InvalidArgumentTypeError(
                    f"RayClusterResolver: {name} must be a dict or None; received {type(value).__name__}."
                )
        bad = {
            k: v for k, v in (worker_env or {}).items() if not isinstance(k, str) or not isinstance(v, str)
        }
        if bad:
            raise errors.InvalidArgumentTypeError(
                f"RayClusterResolver: worker_env maps variable names to strings; received "
                f"{bad!r}. Write the values as strings, e.g. {{'XLA_FLAGS': '...'}}."
            )
        self.address = address
        self.num_cpus_per_worker = num_cpus_per_worker
        self.num_gpus_per_worker = num_gpus_per_worker
        self.worker_env = dict(worker_env or {})
        self.runtime_env = dict(runtime_env or {})
        self._started_here = False

    def connect(self):
        """Starts or joins the Ray cluster (once); returns the `ray` module.

        Ray's start-up banner ("Started a local Ray instance", "Connected to Ray cluster") and
        its notice that a new local cluster uses token authentication (printed at every start,
        with nothing to do about it) are left out; its warnings (a cluster without
        authentication) are not.
        """
        ray = import_ray()
        if not ray.is_initialized():
            with warnings.catch_warnings(), _without_token_notice():
                # JAX warns at every fork; Ray forks only to exec its own programs at once.
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
                if self.address is None:
                    needed = self.num_workers * max(1, self.num_cpus_per_worker) + self.num_ps
                    ray.init(
                        num_cpus=max(int(needed), os.cpu_count() or 1),
                        include_dashboard=False,
                        configure_logging=False,
                    )
                    self._started_here = True
                else:
                    ray.init(address=self.address, include_dashboard=False, configure_logging=False)
        return ray

    def shutdown(self) -> None:
        """Stops every ParameterServerStrategy's actors and threads, then the local Ray
        cluster this resolver started (nothing more otherwise)."""
        if self._started_here:
            stop_all()
            import_ray().shutdown()
            self._started_here = False

    def __repr__(self) -> str:
        return (
            f"RayClusterResolver(num_workers={self.num_workers}, num_ps={self.num_ps}, "
            f"address={self.address!r})"
        )


class _TaskSpec:
    def __init__(self, host: str | None = None):
        self.host = host  # None: anywhere; else a host name or IP to pin the actor to


def _from_tf_cluster(resolver: ClusterResolver) -> tuple[RayClusterResolver, list, list]:
    """A TF-style cluster as Ray tasks: each 'worker' and 'ps' address names the host its
    actor is pinned to (localhost: this machine); the coordinator is this process."""
    if resolver.task_type not in (None, "chief"):
        raise errors.InvalidArgumentError(
            f"ParameterServerStrategy: the cluster resolver says this process is "
            f"{resolver.task_type}:{resolver.task_id}, but the strategy is made only by the "
            "coordinator (task type 'chief'). Under mirrax the 'worker' and 'ps' "
            "tasks are Ray actors the coordinator starts on their hosts: run the script only as "
            'the chief (TF_CONFIG\'s task {"type": "chief", "index": 0}), and start a Ray '
            "node on each worker and ps host instead (`ray start --address=...`)."
        )
    cluster = resolver.cluster_spec()
    jobs = cluster.jobs
    for job in ("ps", "worker"):
        if job not in jobs or cluster.num_tasks(job) == 0:
            raise errors.InvalidArgumentError(
                f"ParameterServerStrategy: the cluster {cluster.as_dict()} has no {job!r} tasks. "
                "A parameter-server cluster needs 'ps' and 'worker' jobs (and optionally a "
                "'chief', the coordinator: this process), e.g. TF_CONFIG={\"cluster\": "
                '{"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": '
                '["host2:2222"]}, "task": {"type": "chief", "index": 0}}.'
            )
    hosts = {
        job: [cluster.task_address(job, i).rsplit(":", 1)[0] for i in cluster.task_indices(job)]
        for job in ("worker", "ps")
    }
    ray_resolver = RayClusterResolver(
        len(hosts["worker"]), len(hosts["ps"]), address=os.environ.get("RAY_ADDRESS") or None
    )
    return (ray_resolver, [_TaskSpec(h) for h in hosts["worker"]], [_TaskSpec(h) for h in hosts["ps"]])


def _placement(ray, host: str | None):
    """Ray scheduling options pinning an actor to `host` (none for a local host)."""
    if host is None:
        return {}
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        raise errors.InvalidArgumentError(
            f"ParameterServerStrategy: cannot resolve the task host {host!r}."
        ) from None
    if ip.startswith("127.") or ip == ray.util.get_node_ip_address():
        return {}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for node in nodes:
        if node.get("NodeManagerAddress") == ip:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
    raise errors.InvalidArgumentError(
        f"ParameterServerStrategy: the task host {host!r} ({ip}) is not a node of the Ray "
        f"cluster, whose nodes are {[n.get('NodeManagerAddress') for n in nodes]}. Start a "
        "Ray node there (`ray start --address=...`) or fix the cluster's addresses."
    )


def _process_exists(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, TypeError):
        return True  # another user's process, or no pid recorded: assume it runs
    return True


class Cluster:
    """The started actors: `parameter_servers` and `workers` (Ray actor handles), their
    process ids when they started, and the replicas of each worker."""

    def __init__(self, resolver):
        if isinstance(resolver, RayClusterResolver):
            self.resolver = resolver
            worker_specs = [_TaskSpec() for _ in range(resolver.num_workers)]
            ps_specs = [_TaskSpec() for _ in range(resolver.num_ps)]
        elif isinstance(resolver, ClusterResolver):
            self.resolver, worker_specs, ps_specs = _from_tf_cluster(resolver)
        else:
            raise errors.InvalidArgumentTypeError(
                "ParameterServerStrategy: cluster_resolver must be a mirrax.RayClusterResolver "
                "or a TF-style resolver with 'ps' and 'worker' jobs (TFConfigClusterResolver, "
                f"SimpleClusterResolver); received {type(resolver).__name__}."
            )
        ray = self.resolver.connect()
        self._check_free_cpus(ray, len(worker_specs), len(ps_specs))
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        runtime_env = dict(self.resolver.runtime_env)
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        worker_env = dict(runtime_env, env_vars={**runtime_env["env_vars"], **self.resolver.worker_env})
        since = time.time()
        local = self.resolver.address is None
        free_before = ray.available_resources() if local else None
        requested = {"CPU": len(worker_specs) * self.resolver.num_cpus_per_worker + len(ps_specs)}
        if self.resolver.num_gpus_per_worker:
            requested["GPU"] = len(worker_specs) * self.resolver.num_gpus_per_worker
        server_cls = ray.remote(actors.ParameterServer)
        self.parameter_servers = [
            server_cls.options(
                max_restarts=0, num_cpus=1, runtime_env=runtime_env, **_placement(ray, spec.host)
            ).remote(i)
            for i, spec in enumerate(ps_specs)
        ]
        worker_cls = ray.remote(actors.Worker)
        self.workers = [
            worker_cls.options(
                max_restarts=-1,
                max_task_retries=0,
                num_cpus=self.resolver.num_cpus_per_worker,
                num_gpus=self.resolver.num_gpus_per_worker,
                runtime_env=worker_env,
                **_placement(ray, spec.host),
            ).remote(i, len(worker_specs))
            for i, spec in enumerate(worker_specs)
        ]
        self._stopped = False
        # What stop() calls before killing the actors (to stop the threads that use them) and
        # after (to wait for those threads): the strategy's and the coordinator's.
        self.before_stop: list = []
        self.after_stop: list = []
        self.ps_pids: list = []
        self.worker_pids: list = []
        try:
            self.ps_pids = self._wait("parameter server", self.parameter_servers, since=since)
            self.worker_pids = self._wait("worker", self.workers, self.parameter_servers, since=since)
        except BaseException:
            # A failed start leaves no actor holding the cluster's resources, and returns once
            # Ray has freed them (as shutdown() does), so a corrected strategy can start at once.
            self.stop()
            if free_before is not None:
                # Free again as before the actors were made: `requested` on top of what was
                # free without them.
                without = {name: free_before.get(name, 0.0) - amount for name, amount in requested.items()}
                with contextlib.suppress(errors.UnresponsivePeerError):
                    self.wait_released(ray, requested, without)
            raise
        self.num_replicas = ray.get(self.workers[0].num_replicas.remote())
        if not _live:
            atexit.register(stop_all)  # after ray.init's own exit hook, so it runs before it
        _live.add(self)

    def _check_free_cpus(self, ray, workers: int, servers: int) -> None:
        """On a local cluster, refuses at once a strategy the free CPUs cannot start (its
        actors would wait for resources until the start timeout)."""
        if self.resolver.address is not None:
            return  # a real cluster may be autoscaling
        needed = workers * self.resolver.num_cpus_per_worker + servers
        free = ray.available_resources().get("CPU", 0.0)
        if needed > free:
            raise errors.InvalidArgumentError(
                f"ParameterServerStrategy: the local Ray cluster has {free:g} free CPU(s); this "
                f"strategy needs {needed:g} (num_cpus_per_worker={self.resolver.num_cpus_per_worker:g}"
                f" for each of {workers} workers, 1 for each of {servers} parameter servers). "
                "Shut down the strategies you no longer use (strategy.shutdown()), or start Ray "
                "with more CPUs (ray.init(num_cpus=...)) before making the strategy."
            )

    @staticmethod
    def _wait(kind: str, handles: list, servers: list | None = None, since: float = 0.0) -> list:
        """The answers of `handles`' first call (ping, or attach to `servers`), once all have
        started; `since` (a `time.time()`): when they were created, to find their crashes.

        Raises:
          UnresponsivePeerError: a task did not start within START_TIMEOUT_S, its process died
            twice while starting (with the first lines of its stderr), or it failed to start.
        """
        ray = import_ray()

        def call(handle):
            return handle.ping.remote() if servers is None else handle.attach.remote(servers)

        refs = [call(h) for h in handles]
        answers: list = [None] * len(refs)
        done = [False] * len(refs)
        deadline = time.monotonic() + START_TIMEOUT_S
        crashes: list = []
        failed = None
        while not all(done) and time.monotonic() < deadline:
            pending = [r for r, d in zip(refs, done) if not d]
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=START_POLL_S)
            for i, ref in enumerate(refs):
                if done[i] or ref not in ready:
                    continue
                try:  # each one read (an error no one reads, Ray prints again)
                    answers[i], done[i] = ray.get(ref), True
                except ray.exceptions.ActorUnavailableError:
                    refs[i] = call(handles[i])  # its process is being restarted: ask it again
                except ray.exceptions.RayActorError as e:
                    failed, done[i] = failed or e, True
            # Ray restarts a worker that dies, forever: two deaths while starting are a crash.
            crashes = start_logs.crashes_since(ray, since)
            if not all(done) and len(crashes) >= 2:
                break
        late = [i for i, d in enumerate(done) if not d]
        if crashes and (late or failed is not None):
            pid, lines = crashes[-1]
            raise errors.UnresponsivePeerError(
                f"ParameterServerStrategy: {kind} task(s) {late or 'of this job'} did not start: "
                f"{len(crashes)} process(es) of this job died while starting (Ray restarts a "
                f"worker that dies). The last (pid {pid}) wrote to its stderr:\n  "
                + "\n  ".join(lines)
                + "\nFix the cause (e.g. RayClusterResolver's worker_env) and make the strategy again."
            )
        if failed is not None:
            raise errors.UnresponsivePeerError(
                f"ParameterServerStrategy: a {kind} task failed to start: {start_logs.plain(str(failed))}"
            )
        if late:
            raise errors.UnresponsivePeerError(
                f"ParameterServerStrategy: {kind} task(s) {late} did not start within "
                f"{START_TIMEOUT_S:.0f} s. Check the Ray cluster's resources (`ray status`) and "
                "the tasks' logs (/tmp/ray/session_latest/logs)."
            )
        return answers

    @property
    def stopped(self) -> bool:
        """Whether `stop()` ran (the actors are killed)."""
        return self._stopped

    def _held(self) -> dict:
        """The Ray resources this cluster's live actors hold now ({"CPU": ..., "GPU": ...}):
        an actor whose process is gone (a parameter server that died, a worker Ray is
        restarting) holds none, or its release would be waited for twice."""
        workers = sum(map(_process_exists, self.worker_pids))
        held = {"CPU": workers * self.resolver.num_cpus_per_worker + sum(map(_process_exists, self.ps_pids))}
        if self.resolver.num_gpus_per_worker:
            held["GPU"] = workers * self.resolver.num_gpus_per_worker
        return held

    def stop(self, wait_release: bool = False) -> None:
        """Kills the actors and waits for the threads that use them (once); with
        `wait_release`, on a local cluster, also until Ray has freed the actors' resources,
        so that a strategy made right afterwards can start (`strategy.shutdown()`).

        Raises:
          UnresponsivePeerError: the resources are not free within RELEASE_TIMEOUT_S (the
            message names the actors' processes still running).
        """
        if self._stopped:
            return
        self._stopped = True
        ray = import_ray()
        wait_release = wait_release and self.resolver.address is None and ray.is_initialized()
        held = self._held() if wait_release else {}
        free_before = ray.available_resources() if wait_release else {}
        for stop in self.before_stop:
            stop()
        for handle in self.workers + self.parameter_servers:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for wait in self.after_stop:
            wait()
        if wait_release:
            self.wait_released(ray, held, free_before)

    def wait_released(self, ray, held: dict, free_before: dict) -> None:
        """Waits, at most RELEASE_TIMEOUT_S, until `ray` (the module, or anything with its
        `cluster_resources` / `available_resources`) shows the resources this cluster `held`
        free again, on top of the `free_before` it started with.

        Raises:
          UnresponsivePeerError: not freed in time; the message names the processes still
            running.
        """
        total = ray.cluster_resources()
        wanted = {
            name: min(total.get(name, 0.0), free_before.get(name, 0.0) + amount)
            for name, amount in held.items()
        }
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while True:
            free = ray.available_resources()  # a resource none of is free is left out
            if all(free.get(name, 0.0) >= amount - 1e-9 for name, amount in wanted.items()):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        running = [
            f"{kind} {i} (pid {pid})"
            for kind, pids in (("worker", self.worker_pids), ("parameter server", self.ps_pids))
            for i, pid in enumerate(pids)
            if _process_exists(pid)
        ]
        raise errors.UnresponsivePeerError(
            f"ParameterServerStrategy.shutdown: Ray has not freed the resources of the killed "
            f"actors within {RELEASE_TIMEOUT_S:.0f} s: free now "
            f"{ {name: free.get(name, 0.0) for name in wanted} }, expected {wanted} (this "
            f"strategy held {held}); still running: "
            f"{', '.join(running) if running else 'none of its processes'}. Another program "
            "may be using the cluster: check `ray status` before making a new strategy."
        )
