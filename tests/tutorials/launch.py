"""Runs a tutorial's worker program under `mirrax launch` (2 workers x 2 CPU devices) and
returns each worker's section outcomes (tests/tutorials/sections.py) and the launcher's output.

The launch is killed at `timeout` seconds, so a worker that hangs fails the section tests
(those it never reported) instead of blocking the suite.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

from tests.tutorials import sections

ROOT = pathlib.Path(__file__).resolve().parents[2]


def launch(
    module: str, out_dir, *args: str, num_workers: int = 2, cpu_devices: int = 2, timeout: float = 150
) -> tuple[list, str]:
    """([outcomes of worker 0, worker 1, ...], the launcher's stdout + stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("TF_CONFIG", None)
    command = [
        sys.executable,
        "-m",
        "mirrax._src.cli.main",
        "launch",
        "--nproc",
        str(num_workers),
        "--cpu-devices",
        str(cpu_devices),
        "--",
        sys.executable,
        "-m",
        module,
        str(out_dir),
        *map(str, args),
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        output = f"exit {process.returncode}\n{output[-8000:]}"
    except subprocess.TimeoutExpired:
        # The launcher puts each worker in a process group of its own and stops them when it
        # gets SIGTERM (SIGKILL after its 10 s grace period): a kill of the launcher alone
        # would leave them running.
        process.terminate()
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        output = f"stopped after {timeout} s (a hang)\n{output[-8000:]}"
    return sections.read(str(out_dir), num_workers), output
