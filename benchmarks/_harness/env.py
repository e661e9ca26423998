"""A benchmark's environment: its command line, the device counts (one fresh subprocess per
count, since the fake CPU device count is fixed when JAX starts), the JSON output, the machine
and versions under each table, and the lock that keeps two timed benchmarks apart.

JAX-free at import: `configure_jax_environment` must run before JAX starts.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LOCK_PATH = "/tmp/mirrax_bench.lock"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # progress; tables go to stdout


def add_device_arguments(parser: argparse.ArgumentParser, default: str = "1,4") -> None:
    """--devices (comma-separated replica counts), --platform and --json."""
    parser.add_argument(
        "--devices", default=default, help=f"replica counts, one subprocess each (default: {default})"
    )
    parser.add_argument(
        "--platform",
        default="cpu",
        choices=["cpu", "gpu", "tpu"],
        help="cpu: N fake host devices; gpu/tpu: the first N accelerators",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")


def parse_device_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets `args.device_counts` from --devices, or exits with the usage error."""
    try:
        args.device_counts = [int(n) for n in args.devices.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--devices must be comma-separated integers like 1,4; got {args.devices!r}")
    if not args.device_counts or min(args.device_counts) < 1:
        parser.error(f"--devices needs at least one count >= 1; got {args.devices!r}")


def check_divides(parser, args, global_batches: dict) -> None:
    """Usage error unless every --devices count divides each workload's global batch."""
    for name, batch in global_batches.items():
        bad = [n for n in args.device_counts if batch % n]
        if bad:
            fits = [n for n in range(1, 9) if batch % n == 0]
            parser.error(
                f"--devices {args.devices}: the {name + ' ' if name else ''}global batch of "
                f"{batch} does not split evenly over {bad} replicas; use counts that divide it, "
                f"e.g. {fits}"
            )


def names_option(parser, flag: str, value: str, allowed) -> list:
    """The comma-separated names of `value` (lower case) in `allowed`'s order; a usage error
    names any unknown one."""
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    return [n for n in allowed if n in names]


def check_json_path(path) -> None:
    """Exits before any measuring when --json names a file in a folder that does not exist."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        raise SystemExit(
            f"--json {path}: the folder {folder} does not exist; create it or give another path."
        )


def write_json(path, results) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(results, indent=2))


def configure_jax_environment(platform_name: str, devices: int) -> None:
    """Asks JAX for `devices` fake CPU devices (cpu only); call it before JAX is imported."""
    if platform_name == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
        ).strip()


def local_devices(platform_name: str, devices: int, script: str) -> list:
    """The first `devices` local JAX devices, or exit naming what is missing and the fix."""
    import jax  # after configure_jax_environment, by design

    local = jax.local_devices()
    if local[0].platform != platform_name:
        raise SystemExit(
            f"{script}: asked for --platform {platform_name} but JAX's devices are "
            f"{local[0].platform} ({local[0].device_kind}). Install the matching jax extra "
            "(e.g. jax[cuda12]) or pass --platform cpu."
        )
    if len(local) < devices:
        raise SystemExit(
            f"{script}: asked for {devices} devices but this process has {len(local)} "
            f"{platform_name} device(s)."
        )
    return local[:devices]


def processor_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(devices=None) -> dict:
    """Date, versions, platform and host CPU of this run, for the note under a results table.
    With `devices` (JAX devices) JAX's versions and the device kind are included."""
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "processor": processor_name(),
    }
    if devices is not None:
        import flax  # JAX has started: the caller holds its devices
        import jax
        import optax

        env.update(
            jax=jax.__version__,
            flax=flax.__version__,
            optax=optax.__version__,
            platform=devices[0].platform,
            device_kind=devices[0].device_kind,
        )
    return env


def environment_note(env: dict) -> str:
    """The machine and versions of `environment(devices)`, as the first words under a table."""
    return (
        f"{env['platform']} ({env['device_kind']}), {env['host_cpus']} host CPUs "
        f"({env['processor']}); jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, "
        f"Python {env['python']}."
    )


def forward_arguments(args, options, flags=()) -> list:
    """The command line that passes `options` (valued) and `flags` (on/off) of `args` on."""
    argv = []
    for name in options:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv + ["--" + name.replace("_", "-") for name in flags if getattr(args, name)]


def module_command(module: str, *argv, python: str = sys.executable) -> list:
    """`python -m benchmarks.<name> ...` for a module's `__name__` (or `__spec__.name`)."""
    return [python, "-m", module, *map(str, argv)]


def child_environment(extra: dict | None = None) -> dict:
    """This process's environment with the repository first on PYTHONPATH (so `-m benchmarks.x`
    resolves from any folder) and `extra` set (a None value removes the variable)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _run_subprocess(module: str, child_argv: list, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        command = module_command(module, "--devices", devices, *child_argv, "--json", path)
        # The child prints its own table on stdout; only its progress lines (stderr) show here.
        done = subprocess.run(command, stdout=subprocess.DEVNULL, env=child_environment())
        if done.returncode != 0:
            raise SystemExit(f"{module}: the run with --devices {devices} failed (exit {done.returncode}).")
        with open(path) as f:
            return json.load(f)[0]


def run_benchmark(args, measure, markdown, child_argv: list, module: str) -> int:
    """Measures every count in `args.device_counts`, prints the table, writes --json.

    One count runs here (`measure(args, devices)` after `configure_jax_environment`); several
    run one fresh subprocess each (`python -m <module> --devices N *child_argv --json tmp`),
    because the fake CPU device count is fixed when JAX starts. `markdown(results)` makes the
    table.
    """
    check_json_path(args.json)
    start = time.perf_counter()
    if len(args.device_counts) == 1:
        configure_jax_environment(args.platform, args.device_counts[0])
        results = [measure(args, args.device_counts[0])]
    else:
        results = [_run_subprocess(module, child_argv, n) for n in args.device_counts]
    print(markdown(results))
    if len(args.device_counts) > 1:
        log(f"(total {time.perf_counter() - start:.0f} s)")
    write_json(args.json, results)
    return 0


def markdown_table(header: list, rows: list, align: list | None = None) -> list:
    """Lines of a markdown table; `align`: "l" or "r" per column (default: the first left)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(map(str, cells)) + " |" for cells in [header, rule, *rows]]


@contextlib.contextmanager
def bench_lock():
    """Holds /tmp/mirrax_bench.lock (flock), so no other timed benchmark runs meanwhile."""
    with open(LOCK_PATH, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"  waiting for {LOCK_PATH} (another benchmark is running)...")
            start = time.perf_counter()
            fcntl.flock(f, fcntl.LOCK_EX)
            log(f"  got the lock after {time.perf_counter() - start:.0f} s")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_in_process(args, measure, markdown) -> int:
    """A benchmark that measures in this process: `measure(args)` under the lock, its
    `markdown(result)` printed, the total time logged, the JSON written (--json)."""
    start = time.perf_counter()
    with bench_lock():
        result = measure(args)
    print(markdown(result))
    log(f"(total {time.perf_counter() - start:.0f} s)")
    write_json(args.json, [result])
    return 0
