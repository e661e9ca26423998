"""`ClusterCoordinator`: schedules functions on a ParameterServerStrategy's workers, as
`tf.distribute.coordinator.ClusterCoordinator`.

`schedule` pickles the function at once (payloads.py; so a bad argument is named at the call) and queues
it; one dispatcher thread per worker takes the next queued function whenever its worker is
free. A worker that dies while running a function gives that function back to the queue
(another worker, or the same one restarted, runs it: at-least-once execution), and its
per-worker datasets are created again when Ray has restarted it. An error raised by a
function is raised by the next `join`, `done` or `schedule` (and the functions still queued
are cancelled), as TF; a lost parameter server is raised by every later call.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import warnings

import jax

from mirrax import errors
from mirrax._src.parameter_server import payloads, wire
from mirrax._src.parameter_server.closures import Closure, Queue
from mirrax._src.parameter_server.ray_calls import LostParameterServer, call_servers, import_ray
from mirrax._src.parameter_server.remote_values import (
    PerWorkerDataset,
    RemoteValue,
)
from mirrax._src.parameter_server.strategy import ParameterServerStrategy

# Seconds between two health checks of the parameter servers, and the longest a check waits.
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# Seconds a dead worker may take to come back before it is given up.
WORKER_RESTART_TIMEOUT_S = 300.0
# Runs of one function that may end with its worker dead before the function is given up
# (at-least-once, but not forever: a function that kills every worker would never finish).
MAX_WORKER_DEATHS = 3
# Functions sent to one worker before the oldest is answered.
IN_FLIGHT = 2


class ClusterCoordinator:
    """Schedules functions on the workers of a ParameterServerStrategy.

    As `tf.distribute.coordinator.ClusterCoordinator`; one coordinator per strategy (making a
    second one returns the first). A scheduled function runs on one worker: it may use the
    strategy (there, a MirroredStrategy over the worker's devices: `strategy.run` and
    `strategy.reduce` work as usual), NNX objects (their values come from the parameter
    servers when the function starts, and what the function changes is pushed back when it
    ends), per-worker iterators, and picklable values.

    Args:
      strategy: a `mirrax.ParameterServerStrategy`.

    Attributes:
      strategy: that strategy.
      update_staleness: mirrax's own: per completed function that changed something, the
        number of pushes other workers made between its pull and its push (0: it updated
        the values it read), in completion order.
      transferred_bytes: mirrax's own: per completed function, (bytes pulled, bytes pushed)
        between its worker and the parameter servers, in completion order. A function pulls
        the variables of the held objects it names (all of them when its worker builds its
        copies: its first function, and after one failed there) and pushes those it changed.

    Raises:
      TypeError: `strategy` is not a ParameterServerStrategy.
    """

    def __new__(cls, strategy):
        if not isinstance(strategy, ParameterServerStrategy):
            raise errors.InvalidArgumentTypeError(
                "ClusterCoordinator: strategy must be a mirrax.ParameterServerStrategy; "
                f"received {type(strategy).__name__}. MirroredStrategy and "
                "MultiWorkerMirroredStrategy run their steps with strategy.run directly."
            )
        existing = strategy.extended.coordinator
        if existing is not None:
            return existing
        self = super().__new__(cls)
        self._start(strategy)
        strategy.extended.coordinator = self
        return self

    def __init__(self, strategy):
        pass  # __new__ did the work (and returns the existing coordinator unchanged)

    def _start(self, strategy) -> None:
        self.strategy = strategy
        self._cluster = strategy.extended.cluster
        self._store = strategy.extended.variable_store
        self._queue = Queue()
        self._datasets: dict = {}  # dataset id -> pickled dataset_fn
        self._dataset_ids = itertools.count()
        self._sent_version = [None] * len(self._cluster.workers)
        self._sent = payloads.SendOnce(len(self._cluster.workers))  # functions and constants
        self._pickles = payloads.PickleCache()
        self._lost_workers: set = set()
        self._register_lock = threading.Lock()
        self.update_staleness: list = []
        self.transferred_bytes: list = []
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), daemon=True, name=f"mirrax-worker-{w}")
            for w in range(len(self._cluster.workers))
        ]
        self._threads.append(
            threading.Thread(target=self._watch_servers, daemon=True, name="mirrax-ps-health")
        )
        for thread in self._threads:
            thread.start()
        self._cluster.before_stop.append(self._stop_threads)
        self._cluster.after_stop.append(self._join_threads)

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self, fn, args=(), kwargs=None) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` to run on a free worker; returns at once.

        As `ClusterCoordinator.schedule`. The function runs at least once (again, on another
        worker, if its worker dies while running it). NNX objects it reaches (arguments or
        closure) are held by the parameter servers from their first use. A `RemoteValue`
        argument is passed on as its value (this call waits for it).

        Returns:
          A `RemoteValue` of the function's result.

        Raises:
          the error an earlier function raised (once; queued functions are then cancelled);
          LostParameterServerError: a parameter server is lost (every call, from then on).
          TypeError: `fn` is not callable, an argument cannot be pickled, or it is an
            iterator or dataset of the coordinator (use `create_per_worker_dataset`).
        """
        with self._queue.cond:
            self._queue.raise_if_error()
        if not callable(fn):
            raise errors.InvalidArgumentTypeError(
                f"ClusterCoordinator.schedule: fn must be callable; received {type(fn).__name__}."
            )
        if not isinstance(args, (tuple, list)):
            raise errors.InvalidArgumentTypeError(
                "ClusterCoordinator.schedule: args must be a tuple or list; received "
                f"{type(args).__name__}. Write args=(x,) for one argument."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise errors.InvalidArgumentTypeError(
                "ClusterCoordinator.schedule: kwargs must be a dict or None; received "
                f"{type(kwargs).__name__}."
            )
        value = RemoteValue()
        with self._register_lock:  # one schedule at a time numbers the new held objects
            payload, objects = self._pickle(fn, tuple(args), dict(kwargs or {}))
        self._queue.put(Closure(payload, objects, value))
        return value

    def _pickle(self, fn, args: tuple, kwargs: dict) -> tuple[bytes, tuple]:
        payload, new_roots, objects = payloads.pickle_scheduled(
            self, self._store, self._sent, self._pickles, fn, args, kwargs
        )
        if new_roots:
            self._drain()
            self._store.add(new_roots)
        else:
            self._store.write_assigned()  # also refuses a changed structure
        return payload, objects

    def _drain(self) -> None:
        """Waits until no function runs (new objects change the parameter servers' layout)."""
        with self._queue.cond:
            while (
                (self._queue.waiting or self._queue.running)
                and self._queue.fatal is None
                and self._queue.error is None
            ):
                self._queue.cond.wait(0.5)
            if self._queue.fatal is not None:
                raise self._queue.fatal

    # -- waiting ---------------------------------------------------------------------------

    def join(self) -> None:
        """Waits until every scheduled function has finished, as `ClusterCoordinator.join`.

        Then reads the held objects' values back into the coordinator's objects.

        Raises:
          the first error a function raised since the last `join`/`done` (with the worker's
          traceback as its `__cause__`); queued functions are cancelled, later schedules work.
          LostParameterServerError: a parameter server is lost.
          LostWorkersError: every worker is gone.
        """
        with self._queue.cond:
            while (
                (self._queue.waiting or self._queue.running)
                and self._queue.fatal is None
                and self._queue.error is None
            ):
                self._queue.cond.wait(0.5)
            self._queue.raise_if_error()
        self._store.refresh()

    def done(self) -> bool:
        """True when no scheduled function is queued or running, as `ClusterCoordinator.done`.

        Raises:
          as `join`.
        """
        with self._queue.cond:
            self._queue.raise_if_error()
            return not self._queue.waiting and not self._queue.running

    def fetch(self, values):
        """`RemoteValue.fetch()` of every RemoteValue in the structure `values` (other leaves
        as they are), as `ClusterCoordinator.fetch`."""
        return jax.tree.map(
            lambda v: v.fetch() if isinstance(v, RemoteValue) else v,
            values,
            is_leaf=lambda v: isinstance(v, RemoteValue),
        )

    # -- datasets --------------------------------------------------------------------------

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Creates a dataset on every worker, as `ClusterCoordinator.create_per_worker_dataset`.

        Args:
          dataset_fn: called on each worker as `dataset_fn()` or, when it takes an argument,
            `dataset_fn(input_context)` (an `InputContext` whose `input_pipeline_id` is the
            worker's index among `num_input_pipelines` workers, to shard by). It returns
            global batches for the worker's replicas (any dataset `experimental_distribute_dataset`
            takes; it is distributed over the worker's devices) or a distributed dataset made
            with `strategy.distribute_datasets_from_function`. A worker that restarts calls it
            again (its iterators start over).

        Returns:
          A `PerWorkerDataset`; `iter()` of it is what scheduled functions take.

        Raises:
          TypeError: `dataset_fn` is not callable or cannot be pickled.
          the error `dataset_fn` raised on a worker.
        """
        if not callable(dataset_fn):
            raise errors.InvalidArgumentTypeError(
                "create_per_worker_dataset: dataset_fn must be a function that builds the "
                f"dataset on a worker; received {type(dataset_fn).__name__}. Wrap a dataset as "
                "`lambda: dataset`."
            )
        with self._queue.cond:
            self._queue.raise_if_error()

        data = payloads.pickle_dataset_fn(self.strategy, dataset_fn)
        dataset_id = next(self._dataset_ids)
        ray = import_ray()
        # Registered first: a worker that is restarting now gets it when it is back.
        self._datasets[dataset_id] = data
        live = [w for w in range(len(self._cluster.workers)) if w not in self._lost_workers]
        failed = None
        # Every answer is read, also after a failure: Ray prints the traceback of an error no
        # one read ("Unhandled error"), once per other worker.
        for ref in [self._cluster.workers[w].create_dataset.remote(dataset_id, data) for w in live]:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                failed = failed or e
            except ray.exceptions.RayActorError:
                pass  # dead or restarting: its dispatcher creates the datasets when it is back
        if failed is not None:
            del self._datasets[dataset_id]
            cause = getattr(failed, "cause", None)
            raise (cause if isinstance(cause, Exception) else failed.as_instanceof_cause()) from None
        return PerWorkerDataset(self, dataset_id)

    # -- the dispatcher threads -----------------------------------------------------------

    def _serve(self, w: int) -> None:
        ray = import_ray()
        worker = self._cluster.workers[w]
        # Sent to the worker and not answered yet, oldest first: Ray queues the next one at the
        # worker while it runs one, so the round trip between them costs the worker nothing.
        flight: collections.deque = collections.deque()
        while True:
            while len(flight) < IN_FLIGHT:
                closure = self._queue.take(block=not flight)
                if closure is None:
                    break
                payload = self._payload(w, closure)
                flight.append((closure, worker.run.remote(payload)))
            if not flight:
                return  # stopped
            closure, ref = flight.popleft()
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayActorError:
                if self._queue.stopped:  # killed by shutdown(): the functions are dropped
                    for dropped, _ in [(closure, ref), *flight]:
                        dropped.value.set_error(self._queue.fatal)
                        self._queue.finish(dropped)
                    return
                self._give_back(flight)  # sent after the one that was running: not run
                flight.clear()
                closure.deaths += 1
                if closure.deaths < MAX_WORKER_DEATHS:
                    self._queue.finish(closure, give_back=True)
                else:
                    error = errors.WorkerCrashError(
                        f"A scheduled function was given up: the workers running it died "
                        f"{closure.deaths} times, so the function itself most likely "
                        "kills its process (out of memory, a crash in native code, os._exit). "
                        "Check the workers' logs (/tmp/ray/session_latest/logs)."
                    )
                    closure.value.set_error(error)
                    self._queue.finish(closure, error)
                if not self._recover(w):
                    return
                continue
            except Exception as e:  # noqa: BLE001 - raised by join, as the function's error
                # The call failed in Ray: what its payload carried may not have arrived.
                self._sent_version[w] = None
                self._sent.forget(w)
                closure.value.set_error(e)
                self._queue.finish(closure, e)
                continue
            if answer[0] == "restarted":  # died between functions: this one did not run
                self._give_back(flight)  # nor those sent after it (answered "restarted" too)
                flight.clear()
                self._queue.finish(closure, give_back=True)
                if not self._recover(w):
                    return
                continue
            self._settle(closure, answer)

    def _give_back(self, flight) -> None:
        """Returns closures sent but not run to the front of the queue, in their order."""
        for closure, _ in reversed(flight):
            self._queue.finish(closure, give_back=True)

    def _payload(self, w: int, closure: Closure) -> dict:
        """What worker `w` gets: the function, and what it has not seen yet (the held
        objects' structure after a change, the constants)."""
        version = self._store.version
        payload = {
            "version": version,
            "closure": closure.payload,
            "objects": closure.objects,
            "structure": None,
            "sent": self._sent.unsent(w),
        }
        if self._sent_version[w] != version:
            payload["structure"] = self._store.structure()
            self._sent_version[w] = version
        return payload

    def _settle(self, closure: Closure, answer: tuple) -> None:
        status = answer[0]
        if status == "ok":
            try:
                result = wire.loads(answer[1])
            except Exception as e:  # noqa: BLE001 - the function ran; its result is unreadable
                error: BaseException = errors.InvalidArgumentTypeError(
                    "A scheduled function's result could not be unpickled on the coordinator "
                    f"({type(e).__name__}: {e}). Return arrays, numbers and containers of them."
                )
                closure.value.set_error(error)
                self._queue.finish(closure, error)
                return
            closure.value.set_value(result)
            if answer[2] is not None:
                self.update_staleness.append(answer[2])
            self.transferred_bytes.append(answer[3])
            self._queue.finish(closure)
        elif status == "error":
            error = wire.unpack_error(answer[1])
            closure.value.set_error(error)
            self._queue.finish(closure, error)
        else:
            error = self.strategy.extended.lost_server(answer[1])
            closure.value.set_error(error)
            self._queue.finish(closure)
            self._queue.fail_all(error)

    def _recover(self, w: int) -> bool:
        """Waits for Ray to restart worker `w`, then creates its datasets again."""
        ray = import_ray()
        worker = self._cluster.workers[w]
        deadline = time.monotonic() + WORKER_RESTART_TIMEOUT_S
        while time.monotonic() < deadline and not self._queue.stopped:
            try:
                pid = ray.get(worker.attach.remote(self._cluster.parameter_servers), timeout=10)
                self._cluster.worker_pids[w] = pid
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        else:
            return False if self._queue.stopped else self._give_up(w)
        try:
            ray.get([worker.create_dataset.remote(i, data) for i, data in list(self._datasets.items())])
        except ray.exceptions.RayError:
            return self._recover(w) if time.monotonic() < deadline else self._give_up(w)
        self._sent_version[w] = None
        self._sent.forget(w)
        return True

    def _give_up(self, w: int) -> bool:
        self._lost_workers.add(w)
        if len(self._lost_workers) == len(self._cluster.workers):
            self._queue.fail_all(
                errors.LostWorkersError(
                    f"Every worker of the ParameterServerStrategy is gone: none came back within "
                    f"{WORKER_RESTART_TIMEOUT_S:.0f} s of dying. Check the Ray cluster "
                    "(`ray status`), then make a new strategy and restore the last checkpoint."
                )
            )
        return False

    def _watch_servers(self) -> None:
        servers = self._cluster.parameter_servers
        while not self._queue.stopped:
            try:
                call_servers(servers, "ping", [()] * len(servers), HEALTH_CHECK_TIMEOUT_S)
            except LostParameterServer as e:
                if not self._queue.stopped:  # not killed by shutdown()
                    self._queue.fail_all(self.strategy.extended.lost_server(str(e)))
                return
            time.sleep(HEALTH_CHECK_PERIOD_S)

    def _stop_threads(self) -> None:
        pending = self._queue.stop(
            errors.UnsupportedArgumentError(
                "The ParameterServerStrategy was shut down (strategy.shutdown(), or the program "
                "exited); make a new strategy and coordinator to schedule again."
            )
        )
        if pending:
            warnings.warn(
                f"ParameterServerStrategy shut down with {pending} scheduled function(s) not "
                "finished; they were dropped. Call coordinator.join() first to finish them.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _join_threads(self) -> None:
        for thread in self._threads:
            thread.join(timeout=30)
