"""Worker processes a benchmark drives: JSON commands on each one's stdin, JSON replies on its
stdout (lines marked with REPLY, since frameworks print there too), its stderr in a log file;
a failed or silent worker raises with the tail of its log. Also the child's side (`serve`),
loopback ports, and workers pinned one per core talking over loopback Gloo (`multi_worker`,
`allreduce`, `peers`' 2-process group): their environment and TF_CONFIG, a `Pool` that starts
them and times their windows, and a run's bookends (cores 0 and 1, load average, the JSON).
JAX-free."""

from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from benchmarks._harness import env

REPLY = "@@bench "


class WorkerFailedError(RuntimeError):
    """A worker process (`.worker`) exited, sent an error or did not answer; the message ends
    with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One worker process running `command`; its replies go to the shared `replies` queue as
    (worker, reply), and (worker, None) when it exits. `log` None: its stderr passes through."""

    def __init__(self, command: list, *, env: dict, log: str | None, label: str, replies: queue.Queue):
        self.label, self.log = label, log
        sink = open(log, "wb") if log else None
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, text=True, env=env
            )
        finally:
            if sink:
                sink.close()
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _read(self, replies: queue.Queue):
        for line in self.process.stdout:
            if line.startswith(REPLY):
                replies.put((self, json.loads(line[len(REPLY) :])))
        replies.put((self, None))

    def send(self, obj):
        self.process.stdin.write(json.dumps(obj) + "\n")
        self.process.stdin.flush()

    def fail(self, what: str):
        tail = ""
        if self.log:
            with open(self.log, errors="replace") as f:
                tail = f" Its log ({self.log}) ends:\n{f.read()[-4000:]}"
        error = WorkerFailedError(f"worker {self.label!r} (exit code {self.process.poll()}): {what}.{tail}")
        error.worker = self
        raise error

    def close(self):
        if self.process.poll() is None:
            try:
                self.send({"op": "quit"})
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def receive(workers: list, replies: queue.Queue, timeout: float, answers=None) -> list:
    """The next reply of every worker in `workers`, in their order; raises WorkerFailedError as
    soon as one exits or errs, or when one has not answered within `timeout` seconds. Replies
    of workers not in the list (a replaced worker's last words) are dropped. `answers`: a dict
    {worker: reply} that keeps the replies received before a failure."""
    answers = {} if answers is None else answers
    deadline = time.monotonic() + timeout
    while any(w not in answers for w in workers):
        try:
            worker, answer = replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            next(w for w in workers if w not in answers).fail(f"no answer within {timeout} s")
        if worker not in workers:
            continue
        if answer is None or "error" in answer:
            worker.fail("exited" if answer is None else answer["error"])
        answers[worker] = answer
    return [answers[w] for w in workers]


def serve(build, handle, core: int | None = None) -> None:
    """The worker's side: `build()` -> (ready reply dict, state); then, for each command read
    from stdin until {"op": "quit"}, reply `handle(state, command)`. An exception while
    building is sent as {"error": traceback} and the process exits at once (frameworks'
    cluster threads would keep it alive). `core` pins the process before any thread starts."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # frameworks may print on stdout; keep the reply channel clean

    def reply(obj):
        reply_to.write(REPLY + json.dumps(obj) + "\n")
        reply_to.flush()

    try:
        ready, state = build()
    except BaseException:
        reply({"error": traceback.format_exc()})
        os._exit(1)
    reply(dict(ready, ready=True))
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            reply(handle(state, command))
        except BaseException:
            reply({"error": traceback.format_exc()})
            os._exit(1)
    reply({"bye": True})
    sys.stdout.flush()
    os._exit(0)  # jax.distributed's and torch.distributed's shutdown would wait for peers


# -- workers on one core each, over loopback Gloo (multi_worker, allreduce, peers' pairs) --

STARTUP_TIMEOUT_S = 600  # a worker's start: imports, a cluster's rendezvous, compiles
WINDOW_TIMEOUT_S = 300


def environment(devices: int = 1, one_core: bool = True, **extra) -> dict:
    """`env.child_environment` of a worker: JAX on `devices` fake CPU devices, no GPU, output
    unbuffered, TensorFlow's info logs off; `one_core`: one XLA intra-op and one OpenMP thread.
    `extra` sets more variables (None removes one)."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    return env.child_environment(
        {
            "JAX_PLATFORMS": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            **({"OMP_NUM_THREADS": "1"} if one_core else {}),
            "XLA_FLAGS": flags + (" --xla_cpu_multi_thread_eigen=false" if one_core else ""),
            **extra,
        }
    )


def tf_config(ports: list, index: int) -> str:
    """TF_CONFIG of worker `index` in a cluster on the loopback `ports` (as mirrax's and TF's
    MultiWorkerMirroredStrategy read it)."""
    return json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def timed(run, times: int = 1) -> dict:
    """A worker's reply to a window: the wall seconds of `times` calls of `run()` and the CPU
    seconds of all the process's threads (XLA, Gloo's I/O, Python), which barely move when
    other jobs share the machine."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(times):
        run()
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


class Pool:
    """Worker processes sharing one reply queue, their logs in one temporary folder; leaving
    the `with` block closes them all."""

    def __init__(self, name: str):
        self.replies, self.started = queue.Queue(), []
        self._logs = tempfile.TemporaryDirectory(prefix=f"mirrax-{name}-")

    def start(self, command: list, label: str, environment: dict) -> Worker:
        log = os.path.join(self._logs.name, f"{len(self.started)} {label}.log".replace(" ", "_"))
        self.started.append(Worker(command, env=environment, log=log, label=label, replies=self.replies))
        return self.started[-1]

    def ready(self, timeout: float = STARTUP_TIMEOUT_S) -> dict:
        """{worker: its ready reply} of every worker started."""
        return dict(zip(self.started, receive(self.started, self.replies, timeout)))

    def ask(self, group: list, command: dict, timeout: float = WINDOW_TIMEOUT_S) -> list:
        """Sends `command` to every worker of `group`; their replies, in order. A worker that
        cannot take it (its stdin is closed: it died) raises WorkerFailedError too."""
        for worker in group:
            try:
                worker.send(command)
            except OSError as error:
                worker.fail(f"cannot take a command ({error})")
        return receive(group, self.replies, timeout)

    def windows(self, groups: dict, cases: list, steps: int, repeats: int, warmup: int) -> dict:
        """Times `cases` [(group name, task)] with {"op": "window", "task", "steps"} commands
        answered by `timed`: one window of `warmup` steps per case, then `repeats` rounds of
        every case, each round starting at the next group. {"ms" | "cpu_ms": {"group | task":
        [ms per step, one per round]}}: the slowest worker's wall time, the workers' mean CPU
        time."""

        def window(group, task, n):
            return self.ask(groups[group], {"op": "window", "task": task, "steps": n})

        if warmup:
            for case in cases:
                window(*case, warmup)
        order = list(dict.fromkeys(group for group, _ in cases))
        samples = {unit: {f"{g} | {t}": [] for g, t in cases} for unit in ("ms", "cpu_ms")}
        for r in range(repeats):
            turn = order[r % len(order) :] + order[: r % len(order)]
            for group, task in sorted(cases, key=lambda case: turn.index(case[0])):
                answers = window(group, task, steps)
                samples["ms"][f"{group} | {task}"].append(max(a["seconds"] for a in answers) / steps * 1e3)
                samples["cpu_ms"][f"{group} | {task}"].append(
                    statistics.mean(a["cpu_seconds"] for a in answers) / steps * 1e3
                )
        return samples

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for worker in self.started:
            worker.close()
        self._logs.cleanup()


def fmt(value, digits: int = 2) -> str:
    """A table cell: `value` with `digits` decimals, or n/a for None."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def begin(script: str, pinned: bool = True) -> tuple:
    """The start time and load average that `finish` reports; with `pinned`, first exits unless
    this process may use cores 0 and 1 (a worker pinned on each)."""
    if pinned and not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit(
            f"{script}: needs cores 0 and 1, a worker on each; this process may use "
            f"{sorted(os.sched_getaffinity(0))}."
        )
    return time.perf_counter(), os.getloadavg()[0]


def finish(began: tuple, what: str, path, results: dict) -> None:
    """Logs `what`, the total time and the load average before and after (other work on the
    machine distorts every number); writes them, the command and the machine to --json `path`."""
    total, load = time.perf_counter() - began[0], [began[1], os.getloadavg()[0]]
    env.log(f"\n{what}; total {total:.0f} s; load average {load[0]:.2f} before, {load[1]:.2f} after")
    env.write_json(
        path,
        {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            **env.environment(),
            **results,
            "total_s": total,
            "load_average_before_after": load,
        },
    )
