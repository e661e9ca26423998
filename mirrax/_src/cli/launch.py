"""`mirrax launch`: run one program as N local worker processes of a multi-worker job.

Each worker gets a `TF_CONFIG` (a "worker" job, no "chief": worker 0 is the chief, and its
address is the coordinator where `jax.distributed`'s coordination service listens), its output
prefixed `[worker i] ` line by line, the launcher's SIGINT/SIGTERM/SIGHUP, and is stopped when
another worker fails; with `--max-restarts N` the whole group is then started again, up to N
times. Standard library only: the launcher never imports or starts JAX, so the workers own
every device and `--cpu-devices` reaches them through their `XLA_FLAGS`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from mirrax._src import launch_progress
from mirrax._src.cli.worker_output import Output, relay_lines

GRACE_PERIOD_S = 10.0
RESTART_DELAY_S = 1.0
# Written independently of main.configure_cpu_devices (same flag, same pattern) so this module
# imports nothing from mirrax.
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_COUNT_PATTERN = re.compile(re.escape(_COUNT_FLAG) + r"=(\S*)")
_LOCALHOST = "127.0.0.1"
_MAX_PORT = 65535
_POLL_S = 0.1
# After SIGKILL a process dies at once unless it is stuck in the kernel; never wait forever.
_KILL_WAIT_S = 5.0
# Output still buffered in a pipe when the workers are gone (or held open by a grandchild).
_DRAIN_S = 5.0
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What a POSIX shell returns for a command it cannot find / cannot execute.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
# A bare interpreter name after '--' means the launcher's own interpreter, as torchrun runs
# scripts with sys.executable: `.venv/bin/mirrax launch -- python train.py` must not run
# whichever `python` PATH finds first (outside the venv, without jax).
_BARE_PYTHONS = ("python", "python3")


def parse_address(address: str, what: str = "--coordinator") -> tuple[str, int]:
    """Splits "host:port" (IPv6 as "[::1]:port") into (host, port).

    Raises:
      ValueError: no host, or a port that is not an integer in [1, 65535]; the message names
        `what` and echoes `address`.
    """
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= _MAX_PORT):
        raise ValueError(
            f"{what} must be 'host:port' with a port in [1, {_MAX_PORT}]; received "
            f"{address!r}. Write it as e.g. '10.0.0.1:1234' (the first node's address)."
        )
    return host, int(port)


def check_arguments(
    argv_command: Sequence[str],
    nproc: int,
    cpu_devices: int | None,
    port: int | None,
    nnodes: int,
    node_rank: int,
    coordinator: str | None,
    grace_period: float,
    max_restarts: int = 0,
    restart_delay: float = RESTART_DELAY_S,
    min_nproc: int | None = None,
) -> None:
    """Validates `launch`'s arguments (see there) without starting anything.

    Raises:
      ValueError: an empty command; nproc, nnodes or cpu_devices < 1; node_rank outside
        [0, nnodes); nnodes > 1 without a coordinator; a coordinator that is not "host:port";
        both port and coordinator; a port outside [1, 65535] or whose worker ports
        port .. port + nnodes * nproc - 1 pass 65535; a negative or infinite grace period or
        restart delay; max_restarts not an int >= 0; min_nproc outside [1, nproc], or below
        nproc with nnodes > 1.
    """
    if not argv_command:
        raise ValueError(
            "no program to run: put it after '--', e.g. mirrax launch --nproc 2 -- python train.py"
        )
    for name, value in (("--nproc", nproc), ("--nnodes", nnodes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; received {value}.")
    if cpu_devices is not None and cpu_devices < 1:
        raise ValueError(f"--cpu-devices must be >= 1; received {cpu_devices}.")
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f"--node-rank must be in [0, --nnodes) = [0, {nnodes}); received {node_rank}. "
            "Number the nodes 0, 1, ..., nnodes - 1; node 0 runs the coordinator."
        )
    if nnodes > 1 and coordinator is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --coordinator HOST:PORT, an address of node 0 that every "
            "node can reach (where worker 0 runs jax.distributed's coordination service)."
        )
    total = nnodes * nproc
    if coordinator is not None:
        if port is not None:
            raise ValueError(
                f"--port {port} and --coordinator {coordinator} both set the coordinator's "
                "port; give only --coordinator HOST:PORT."
            )
        _, port = parse_address(coordinator)
    elif port is not None and not 1 <= port <= _MAX_PORT:
        raise ValueError(f"--port must be in [1, {_MAX_PORT}]; received {port}.")
    if port is not None and port + total - 1 > _MAX_PORT:
        raise ValueError(
            f"the {total} workers' addresses use ports {port} .. {port + total - 1}, past "
            f"{_MAX_PORT}; choose a port <= {_MAX_PORT - total + 1}."
        )
    for name, seconds in (("--grace-period", grace_period), ("--restart-delay", restart_delay)):
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"{name} must be a finite number of seconds >= 0; received {seconds}.")
    if min_nproc is not None and not 1 <= min_nproc <= nproc:
        raise ValueError(
            f"--nproc MIN:MAX needs 1 <= MIN <= MAX; received {min_nproc}:{nproc}. Write e.g. "
            "--nproc 2:4 (start 4 workers, go on with no fewer than 2)."
        )
    if min_nproc is not None and min_nproc < nproc and nnodes > 1:
        raise ValueError(
            f"--nproc {min_nproc}:{nproc} with --nnodes {nnodes}: an elastic width works on one "
            "node only (the nodes' launchers do not agree on a width); give one count per node."
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            f"--max-restarts must be an integer >= 0 (0: never restart); received {max_restarts!r}."
        )


def free_port(host: str = _LOCALHOST) -> int:
    """A TCP port that is free on `host` now (the kernel's pick for port 0).

    Another process may take it before the coordinator binds it; pass --port to choose.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cluster_addresses(total: int, coordinator: str) -> list[str]:
    """The "host:port" of each of the `total` workers: worker k is the coordinator's port + k.

    Only worker 0's address (the coordinator) is ever bound or contacted; the others fill the
    cluster spec, which lists every task, and are informational.
    """
    host, port = parse_address(coordinator)
    return [f"{host}:{port + k}" for k in range(total)]


def tf_config(addresses: Sequence[str], index: int) -> dict:
    """The TF_CONFIG of worker `index`: a "worker" job only, so worker 0 is the chief."""
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}


def local_tf_configs(nproc: int, nnodes: int, node_rank: int, coordinator: str) -> list[dict]:
    """The TF_CONFIG of each of this node's `nproc` workers, in order.

    Node `node_rank` runs the workers with global indices node_rank * nproc .. + nproc - 1 of
    nnodes * nproc; worker 0 (on node 0) is the chief, at `coordinator`.
    """
    addresses = cluster_addresses(nnodes * nproc, coordinator)
    return [tf_config(addresses, node_rank * nproc + i) for i in range(nproc)]


def resolve_program(argv_command: Sequence[str]) -> list[str]:
    """The argv the workers run: `argv_command` with a bare `python` or `python3` as its
    program replaced by this interpreter (`sys.executable`), so the workers run in the
    launcher's environment (its virtual environment, with mirrax and JAX) whatever PATH holds.
    Any other program, a path (`/usr/bin/python3`, `./python`) or a versioned name
    (`python3.11`) included, is run as given."""
    argv = list(argv_command)
    if argv and argv[0] in _BARE_PYTHONS and sys.executable:
        argv[0] = sys.executable
    return argv


def worker_env(
    base: Mapping[str, str],
    config: dict,
    cpu_devices: int | None,
    restart_count: int = 0,
    max_restarts: int = 0,
    progress_file: str | None = None,
) -> dict[str, str]:
    """The environment of one worker: `base` plus TF_CONFIG and the launcher's variables.

    Sets TF_CONFIG (JSON of `config`), MIRRAX_LAUNCH_RANK (the global worker index),
    MIRRAX_LAUNCH_WORLD_SIZE (the number of workers on all nodes), MIRRAX_LAUNCH_RESTART_COUNT
    (how many times the group was restarted before this attempt: 0 at first, as torchrun's
    TORCHELASTIC_RESTART_COUNT), MIRRAX_LAUNCH_MAX_RESTARTS, MIRRAX_LAUNCH_PROGRESS (where
    `fit` records its epoch and step, `launch_progress.py`) when `progress_file` is given,
    PYTHONUNBUFFERED=1 (lines reach the launcher as they are printed) and, when `cpu_devices`
    is set, XLA_FLAGS with `--xla_force_host_platform_device_count=cpu_devices` in place of any
    count already there (the other flags are kept).
    """
    env = dict(base)
    env["TF_CONFIG"] = json.dumps(config)
    env["MIRRAX_LAUNCH_RANK"] = str(config["task"]["index"])
    env["MIRRAX_LAUNCH_WORLD_SIZE"] = str(len(config["cluster"]["worker"]))
    env[launch_progress.RESTART_COUNT_ENV] = str(restart_count)
    env["MIRRAX_LAUNCH_MAX_RESTARTS"] = str(max_restarts)
    if progress_file is not None:
        env[launch_progress.ENV] = progress_file
    else:
        env.pop(launch_progress.ENV, None)
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_devices is not None:
        flags = _COUNT_PATTERN.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join(flags + [f"{_COUNT_FLAG}={cpu_devices}"])
    return env


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: a death by signal S is 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"was killed by signal {name}"


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to a worker's process group (the worker and anything it started)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    argv_command: Sequence[str],
    nproc: int = 1,
    cpu_devices: int | None = None,
    port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    grace_period: float = GRACE_PERIOD_S,
    max_restarts: int = 0,
    restart_delay: float = RESTART_DELAY_S,
    min_nproc: int | None = None,
) -> int:
    """Runs `argv_command` as this node's `nproc` workers of a multi-worker job; waits for them.

    Worker i of this node (global index g = node_rank * nproc + i, of nnodes * nproc) runs
    `argv_command` (an argv list, no shell; a bare `python` or `python3` as the program is this
    interpreter, `sys.executable`: see `resolve_program`) with the environment of
    `worker_env`: TF_CONFIG names g and every worker's address, worker 0's being the
    coordinator (`coordinator`, else 127.0.0.1:`port`, else 127.0.0.1 and a free port). Each
    line a worker prints goes to the launcher's stdout (stderr for stderr lines) after
    `[worker g] `. Workers read no stdin.

    SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every worker (each runs
    in its own process group, which receives the signal); a second one kills them at once. When
    a worker exits non-zero or by a signal, the others get SIGTERM. Either way, workers still
    running `grace_period` seconds later get SIGKILL. A failed worker is named with the epoch
    and step `fit` was running (`launch_progress.py`), when it was in `fit`.

    With `max_restarts` N > 0, a group that ended by a worker's failure (not by a signal to the
    launcher, nor a program that cannot be started) is started again with the same command
    after `restart_delay` seconds, up to N times, each attempt's end in one line
    (`attempt 1/3: worker 1 was killed by signal SIGKILL at epoch 2, step 5; restarting ...`).
    The program resumes its own work (`BackupAndRestore` in fit: docs/multi_worker.md,
    "Failures"). Without --port or --coordinator each attempt takes a new free port. With
    `min_nproc` M < nproc (one node: an elastic width), a worker killed by a signal in two
    attempts in a row is taken as a lost slot: the next attempt runs one worker fewer, down to
    M (the program resumes on the new layout; in replica-invariant mode with the same bits).

    Args:
      argv_command: the program and its arguments, e.g. ["python", "train.py", "--epochs", "2"].
      nproc: worker processes on this node (>= 1).
      cpu_devices: (fake) CPU devices per worker, through XLA_FLAGS; None keeps XLA_FLAGS.
      port: the coordinator's port on a single node (workers' addresses are 127.0.0.1:port+k).
      nnodes: nodes running `mirrax launch` with the same arguments (>= 1).
      node_rank: this node's index, in [0, nnodes); node 0 runs worker 0, the coordinator.
      coordinator: "host:port" of worker 0 on node 0; required when nnodes > 1.
      grace_period: seconds between SIGTERM (or a forwarded signal) and SIGKILL (>= 0).
      max_restarts: times the group is started again after a failure (>= 0; 0: never).
      restart_delay: seconds between the end of a failed attempt and the next start (>= 0).
      min_nproc: the fewest workers a restart may run (1 <= min_nproc <= nproc; one node only);
        None: always nproc.

    Returns:
      The last attempt's exit status: 0 when every worker exited 0; else the first failed
      worker's code (128 + S for a death by signal S); 128 + S when the launcher received
      signal S (and no worker had failed before); 127 when the program is not found, 126 when
      it cannot be executed.

    Raises:
      ValueError: invalid arguments, as `check_arguments` (nothing started).
    """
    check_arguments(
        argv_command,
        nproc,
        cpu_devices,
        port,
        nnodes,
        node_rank,
        coordinator,
        grace_period,
        max_restarts,
        restart_delay,
        min_nproc,
    )
    program = resolve_program(argv_command)
    output = Output(sys.stdout, sys.stderr)
    received: list[int] = []
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        # Installed before any worker starts, so no signal can kill the launcher alone.
        for signum in _FORWARDED_SIGNALS:
            previous_handlers[signum] = signal.signal(signum, lambda signum, frame: received.append(signum))
    progress_dir = tempfile.mkdtemp(prefix="mirrax-launch-")
    attempts = max_restarts + 1
    width, failed_before = nproc, None
    try:
        for attempt in range(attempts):
            address = coordinator or f"{_LOCALHOST}:{port if port is not None else free_port()}"
            configs = local_tf_configs(width, nnodes, node_rank, address)
            code, failure = _attempt(
                program, argv_command, configs, cpu_devices, (attempt, max_restarts), progress_dir,
                received, output, grace_period,
            )  # fmt: skip
            if failure is None or attempts == 1:
                return code
            ended = f"attempt {attempt + 1}/{attempts}: {failure.cause}"
            if attempt + 1 == attempts:
                output.message(
                    f"{ended}; no restart left (--max-restarts {max_restarts}), exiting with status {code}"
                )
                return code
            lost = failure.by_signal and failure.worker == failed_before
            if lost and min_nproc is not None and width > min_nproc:
                # The same worker killed by a signal twice in a row: a lost slot (a device, the
                # OOM killer). An exit status is the program's own error, which every width hits.
                width -= 1
                ended += f", as in the attempt before; restarting with {width} of --nproc {min_nproc}:{nproc}"
            else:
                ended += f"; restarting the group's {width}"
            failed_before = failure.worker if failure.by_signal else None
            output.message(f"{ended} worker(s) in {restart_delay:g} s (attempt {attempt + 2}/{attempts})")
            if not _sleep_unless_signalled(restart_delay, received):
                name = signal.Signals(received[0]).name
                output.message(f"received {name} before the restart; not restarting")
                return 128 + received[0]
        raise AssertionError("unreachable: the last attempt returns")
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        shutil.rmtree(progress_dir, ignore_errors=True)


def _sleep_unless_signalled(seconds: float, received: list[int]) -> bool:
    """Sleeps `seconds`; False as soon as the launcher received a signal (then no restart)."""
    deadline = time.monotonic() + seconds
    while not received and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return not received


class Failure(NamedTuple):
    """An attempt's first failed worker, whether a signal killed it, and the words printed."""

    worker: int
    by_signal: bool
    cause: str


def _attempt(
    program, argv_command, configs, cpu_devices, restarts, progress_dir, received, output, grace_period
) -> tuple[int, Failure | None]:
    """Starts this node's workers once and waits for them: (exit status, the failure a restart
    may cure, or None: success, a signal to the launcher, a program that cannot be started)."""
    restart_count, max_restarts = restarts
    workers: list[tuple[int, subprocess.Popen, str]] = []
    relays: list[threading.Thread] = []
    try:
        for config in configs:
            index = config["task"]["index"]
            progress_file = os.path.join(progress_dir, f"worker-{index}")
            launch_progress.create(progress_file)
            env = worker_env(os.environ, config, cpu_devices, restart_count, max_restarts, progress_file)
            try:
                process = subprocess.Popen(
                    program,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as e:
                code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE
                output.message(
                    f"error: cannot start worker {index}: {argv_command[0]!r}: {e.strerror}. "
                    "Check the program after '--' (a path, or a name on PATH, that is "
                    "executable)."
                )
                for _, started, _ in workers:
                    _signal_group(started, signal.SIGKILL)
                    started.wait()
                return code, None
            workers.append((index, process, progress_file))
            prefix = f"[worker {index}] "
            for pipe, stream in ((process.stdout, output.stdout), (process.stderr, output.stderr)):
                relay = threading.Thread(target=relay_lines, args=(pipe, prefix, output, stream), daemon=True)
                relay.start()
                relays.append(relay)
        return _supervise(workers, received, output, grace_period)
    finally:
        for _, process, _ in workers:  # only on an unexpected error: _supervise reaps them all
            _signal_group(process, signal.SIGKILL)
        drain_until = time.monotonic() + _DRAIN_S
        for relay in relays:
            relay.join(max(0.0, drain_until - time.monotonic()))


def _supervise(
    workers: list[tuple[int, subprocess.Popen, str]], received: list[int], output: Output, grace_period: float
) -> tuple[int, Failure | None]:
    """Polls the workers until all have exited: (the exit status, the first failure, or None
    when none failed or the launcher was signalled first)."""
    failure: int | None = None
    cause: Failure | None = None
    stop_signal: int | None = None
    forwarded = 0
    kill_at: float | None = None
    why_kill = f"still running {grace_period:g} s after being asked to stop"
    killed_at: float | None = None
    while True:
        running = [(i, p) for i, p, _ in workers if p.poll() is None]
        while forwarded < len(received):
            signum, forwarded = received[forwarded], forwarded + 1
            name = signal.Signals(signum).name
            if stop_signal is None and failure is None:
                stop_signal = signum
            if kill_at is None:
                output.message(f"received {name}; forwarding it to {len(running)} worker(s)")
                for _, process in running:
                    _signal_group(process, signum)
                kill_at = time.monotonic() + grace_period
            elif killed_at is None:  # a signal while stopping: do not wait any longer
                kill_at = time.monotonic()
                why_kill = f"still running at {name}, received while stopping"
        if failure is None and stop_signal is None:
            failed = [(i, p.returncode, f) for i, p, f in workers if p.returncode not in (None, 0)]
            if failed:
                index, returncode, progress_file = failed[0]
                failure = exit_code(returncode)
                where = launch_progress.describe(launch_progress.read(progress_file))
                cause = Failure(index, returncode < 0, f"worker {index} {_describe(returncode)}{where}")
                output.message(
                    cause.cause + (f"; stopping the other {len(running)} worker(s)" if running else "")
                )
                for _, process in running:
                    _signal_group(process, signal.SIGTERM)
                kill_at = time.monotonic() + grace_period
        if not running:
            break
        now = time.monotonic()
        if kill_at is not None and now >= kill_at and killed_at is None:
            for index, process in running:
                output.message(f"worker {index} {why_kill}; sending SIGKILL")
                _signal_group(process, signal.SIGKILL)
            killed_at = now
        if killed_at is not None and now - killed_at > _KILL_WAIT_S:
            output.message(
                "worker(s) " + ", ".join(str(i) for i, _ in running) + " survived "
                f"SIGKILL for {_KILL_WAIT_S:g} s (stuck in the kernel?); giving up"
            )
            break
        time.sleep(_POLL_S)
    if failure is not None:
        return failure, cause
    if stop_signal is not None:
        return 128 + stop_signal, None
    return 0, None
