"""Starts several local worker processes (one per training task) and collects what they report.

Each worker runs `python -m tests.multiworker.scenarios NAME OUT_DIR` with its own `TF_CONFIG`
and its own fake CPU device count, so JAX in the worker never sees the test process's 8
devices. A worker writes its results to OUT_DIR/<task index>.json; the harness returns them
together with each worker's exit code and output. Every worker is killed at the timeout, so a
hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tf_config(port: int, num_workers: int, index: int, chief: bool = False, evaluator: bool = False) -> str:
    """TF_CONFIG for task `index` of a loopback cluster (the first task's port is `port`).

    With `chief`, task 0 is the "chief" and tasks 1.. are workers 0..; else all are workers.
    """
    addresses = [f"127.0.0.1:{port + i}" for i in range(num_workers)]
    if chief:
        cluster = {"chief": addresses[:1], "worker": addresses[1:]}
        task = {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
    else:
        cluster = {"worker": addresses}
        task = {"type": "worker", "index": index}
    if evaluator:
        cluster["evaluator"] = [f"127.0.0.1:{port + num_workers}"]
    return json.dumps({"cluster": cluster, "task": task})


class Worker:
    def __init__(self, index: int, process: subprocess.Popen, log: pathlib.Path):
        self.index = index
        self.process = process
        self.log = log

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start(
    scenario: str,
    out_dir,
    num_workers: int = 2,
    cpu_devices: int = 2,
    chief: bool = False,
    evaluator: bool = False,
    only: list[int] | None = None,
    args: list[str] | None = None,
    port: int | None = None,
    env: dict | None = None,
):
    """Starts the workers (all, or the task indices in `only`) of `scenario`; returns them."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    workers = []
    for index in range(num_workers) if only is None else only:
        worker_env = dict(os.environ)
        worker_env.update(env or {})
        worker_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
        worker_env["JAX_PLATFORMS"] = "cpu"
        worker_env["PYTHONUNBUFFERED"] = "1"
        worker_env["PYTHONPATH"] = str(ROOT) + os.pathsep + worker_env.get("PYTHONPATH", "")
        if num_workers > 1:
            worker_env["TF_CONFIG"] = tf_config(port, num_workers, index, chief, evaluator)
        else:
            worker_env.pop("TF_CONFIG", None)
        log = out_dir / f"log{index}.txt"
        with open(log, "wb") as sink:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.multiworker.scenarios",
                    scenario,
                    str(out_dir),
                    str(index),
                    *(args or []),
                ],
                cwd=ROOT,
                env=worker_env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        workers.append(Worker(index, process, log))
    return workers


def wait(workers, timeout: float = 240) -> list[int]:
    """Waits for every worker (killing all of them at `timeout` seconds); their exit codes."""
    deadline = time.monotonic() + timeout
    codes = []
    for w in workers:
        try:
            codes.append(w.process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as err:
            for other in workers:
                other.process.kill()
            for other in workers:
                other.process.wait()
            raise AssertionError(
                f"worker {w.index} still running after {timeout} s (a hang). Output:\n"
                + "\n".join(f"--- worker {o.index}\n{o.output[-3000:]}" for o in workers)
            ) from err
    return codes


def run(scenario: str, out_dir, num_workers: int = 2, timeout: float = 240, **kwargs) -> list:
    """Runs `scenario` on `num_workers` processes; each worker's JSON result, in task order.

    Raises:
      AssertionError: a worker failed or hung (its output is in the message).
    """
    workers = start(scenario, out_dir, num_workers, **kwargs)
    codes = wait(workers, timeout)
    if any(codes):
        raise AssertionError(
            f"worker exit codes {codes}. Output:\n"
            + "\n".join(f"--- worker {w.index}\n{w.output[-3000:]}" for w in workers)
        )
    return [json.loads((pathlib.Path(out_dir) / f"{w.index}.json").read_text()) for w in workers]
