"""`mirrax launch`: TF_CONFIG per worker, prefixed output, signals, failure handling, arguments.

Workers are tiny `python -c` programs that never import JAX. Tests of exits and signals run the
launcher as a subprocess with a timeout, so a launcher that hangs fails the test instead of
hanging the suite; the others call `main([...])` in this process. Workers that must be seen
stopped write their PID to a file first.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mirrax._src.cli import launch as launch_lib
from mirrax._src.cli.main import main

pytestmark = pytest.mark.subprocess

LAUNCH = [sys.executable, "-m", "mirrax._src.cli.main", "launch"]
# Generous: the launcher imports the mirrax package (JAX included) before it starts anything.
TIMEOUT_S = 30


def _script(*parts: str) -> list[str]:
    """`python -c` of the parts, each dedented on its own, one after the other."""
    return [sys.executable, "-c", "".join(textwrap.dedent(part) for part in parts)]


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)


def _wait_for(paths, timeout_s=TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"never written: {paths}"
        time.sleep(0.05)


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# A worker that writes its PID to <dir>/<rank>.pid, then sleeps (SIGTERM ends it).
_SLEEPER = """
    import os, sys, time
    rank = os.environ["MIRRAX_LAUNCH_RANK"]
    with open(os.path.join({dir!r}, rank + ".pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join({dir!r}, rank + ".pid.tmp"), os.path.join({dir!r}, rank + ".pid"))
    time.sleep(60)
"""


def _pid(directory, rank: int) -> int:
    with open(os.path.join(directory, f"{rank}.pid")) as f:
        return int(f.read())


# -- TF_CONFIG and the environment --------------------------------------------------------------


def test_three_workers_get_their_tf_config_and_cpu_devices(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
    program = _script("""
        import json, os, re
        config, flags = json.loads(os.environ["TF_CONFIG"]), os.environ["XLA_FLAGS"]
        count = re.findall(r"--xla_force_host_platform_device_count=(\\S+)", flags)
        print(config["task"]["type"], config["task"]["index"], len(config["cluster"]["worker"]),
              config["cluster"]["worker"][0], count, "--xla_dump_to=/tmp/x" in flags,
              os.environ["MIRRAX_LAUNCH_RANK"], os.environ["MIRRAX_LAUNCH_WORLD_SIZE"],
              os.environ["PYTHONUNBUFFERED"])
    """)
    code = main(["launch", "--nproc", "3", "--cpu-devices", "2", "--port", "23456", "--"] + program)
    out = capsys.readouterr().out
    assert code == 0
    # Worker i: task index i of 3 workers, worker 0 at 127.0.0.1:23456, the count 8 replaced by
    # 2 (once), the other flag kept.
    assert sorted(out.splitlines()) == [
        f"[worker {i}] worker {i} 3 127.0.0.1:23456 ['2'] True {i} 3 1" for i in range(3)
    ]
    # The launcher passes --cpu-devices on; its own XLA_FLAGS is untouched.
    assert os.environ["XLA_FLAGS"] == ("--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")


def test_local_tf_configs_of_node_1_of_2():
    configs = launch_lib.local_tf_configs(nproc=2, nnodes=2, node_rank=1, coordinator="10.0.0.1:1234")
    # Node 1 runs global workers 1*2 + 0 = 2 and 1*2 + 1 = 3 of 2*2 = 4.
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 2}, {"type": "worker", "index": 3}]
    addresses = ["10.0.0.1:1234", "10.0.0.1:1235", "10.0.0.1:1236", "10.0.0.1:1237"]
    assert [c["cluster"] for c in configs] == [{"worker": addresses}] * 2


def test_workers_of_node_1_print_under_their_global_index(capsys):
    program = _script("""
        import os
        print(os.environ["MIRRAX_LAUNCH_WORLD_SIZE"])
    """)
    assert (
        main(
            [
                "launch",
                "--nproc",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--coordinator",
                "10.0.0.1:1234",
                "--",
            ]
            + program
        )
        == 0
    )
    assert sorted(capsys.readouterr().out.splitlines()) == ["[worker 2] 4", "[worker 3] 4"]


def test_worker_env_reads_back_as_a_tf_config_cluster_resolver():
    from mirrax import TFConfigClusterResolver

    config = launch_lib.local_tf_configs(nproc=2, nnodes=2, node_rank=1, coordinator="10.0.0.1:1234")[1]
    env = launch_lib.worker_env({"XLA_FLAGS": "--xla_a=1"}, config, cpu_devices=None)
    assert env["XLA_FLAGS"] == "--xla_a=1"  # no --cpu-devices: inherited as is
    assert (env["MIRRAX_LAUNCH_RANK"], env["MIRRAX_LAUNCH_WORLD_SIZE"]) == ("3", "4")
    os.environ["TF_CONFIG"] = env["TF_CONFIG"]
    try:
        resolver = TFConfigClusterResolver()
    finally:
        del os.environ["TF_CONFIG"]
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (4, 3, False)
    assert resolver.coordinator_address == "10.0.0.1:1234"


def test_default_port_is_free_and_workers_follow_it(capsys):
    program = _script("""
        import json, os
        print(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    """)
    assert main(["launch", "--nproc", "2", "--"] + program) == 0
    lines = capsys.readouterr().out.splitlines()
    workers = json.loads(lines[0].split("] ", 1)[1].replace("'", '"'))
    port = int(workers[0].rpartition(":")[2])
    assert workers == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    assert 1 <= port <= 65535


# -- output -------------------------------------------------------------------------------------


def test_stderr_is_prefixed_undecodable_bytes_and_a_last_line_without_newline_kept(capsys):
    program = _script("""
        import sys
        print("to stdout")
        sys.stdout.flush()
        sys.stdout.buffer.write(b"bad \\xff byte\\n")
        sys.stdout.flush()
        sys.stderr.write("to stderr\\nno newline at the end")
    """)
    assert main(["launch", "--"] + program) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[worker 0] to stdout", "[worker 0] bad \ufffd byte"]
    assert captured.err.splitlines() == ["[worker 0] to stderr", "[worker 0] no newline at the end"]


def test_gloos_connected_lines_are_not_relayed(capsys):
    # What jax.distributed's Gloo collectives print (C++, on the worker's stdout or stderr) once
    # per worker: noise when every peer connected; kept when some are missing (why a run waits).
    program = _script("""
        import sys
        print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
        print("before training")
        sys.stdout.flush()
        sys.stderr.write("[Gloo] Rank 1 is connected to 3 peer ranks. "
                         "Expected number of connected peer ranks is : 3\\n")
        sys.stderr.write("[Gloo] Rank 1 is connected to 2 peer ranks. "
                         "Expected number of connected peer ranks is : 3\\n")
        sys.stderr.write("a warning\\n")
        # Two threads' lines interleaved by the C++ stream (seen under mirrax launch).
        sys.stderr.write("[Gloo] Rank [Gloo] Rank 3 is connected to 3 peer ranks. "
                         "Expected number of connected peer ranks is : 23 is connected to 3\\n")
        sys.stderr.write(" peer ranks. Expected number of connected peer ranks is : 3\\n")
        sys.stderr.write("3 peer ranks are fine\\n")
    """)
    assert main(["launch", "--"] + program) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[worker 0] before training"]
    assert captured.err.splitlines() == [
        "[worker 0] [Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected "
        "peer ranks is : 3",
        "[worker 0] a warning",
        "[worker 0] 3 peer ranks are fine",
    ]


def test_each_line_arrives_whole_after_its_workers_prefix(capsys):
    program = _script("""
        import os
        rank = os.environ["MIRRAX_LAUNCH_RANK"]
        for _ in range(2000):
            print(rank * 200)
    """)
    assert main(["launch", "--nproc", "2", "--"] + program) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2000
    assert all(re.fullmatch(r"\[worker (\d)\] \1{200}", line) for line in lines)


# -- failures -----------------------------------------------------------------------------------


def test_a_failed_worker_stops_the_others_and_gives_its_code(tmp_path):
    d = str(tmp_path)
    program = _script(
        f"""
        import os, sys, time
        if os.environ["MIRRAX_LAUNCH_RANK"] == "1":
            while not all(os.path.exists(os.path.join({d!r}, f"{{r}}.pid")) for r in (0, 2)):
                time.sleep(0.05)
            sys.exit(3)
    """,
        _SLEEPER.format(dir=d),
    )
    result = _run(["--nproc", "3", "--"] + program)
    assert result.returncode == 3
    assert (
        "mirrax launch: worker 1 exited with code 3; stopping the other 2 worker(s)"
        in result.stderr.splitlines()
    )
    _assert_gone(_pid(d, 0))
    _assert_gone(_pid(d, 2))


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    d = str(tmp_path)
    program = _script(
        f"""
        import os, signal, sys, time
        if os.environ["MIRRAX_LAUNCH_RANK"] == "1":
            while not os.path.exists(os.path.join({d!r}, "0.pid")):
                time.sleep(0.05)
            sys.exit(5)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """,
        _SLEEPER.format(dir=d),
    )
    result = _run(["--nproc", "2", "--grace-period", "1", "--"] + program)
    assert result.returncode == 5
    assert result.stderr.splitlines()[-2:] == [
        "mirrax launch: worker 1 exited with code 5; stopping the other 1 worker(s)",
        "mirrax launch: worker 0 still running 1 s after being asked to stop; sending SIGKILL",
    ]
    _assert_gone(_pid(d, 0))


def test_a_worker_killed_by_sigkill_gives_137():
    program = _script("""
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = _run(["--"] + program)
    assert result.returncode == 128 + 9 == 137
    assert result.stderr.splitlines() == ["mirrax launch: worker 0 was killed by signal SIGKILL"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_reaches_every_worker(tmp_path, signum):
    d = str(tmp_path)
    program = _script(f"""
        import os, signal, sys, time
        rank = os.environ["MIRRAX_LAUNCH_RANK"]
        def stop(signum, frame):
            open(os.path.join({d!r}, rank + ".got-" + signal.Signals(signum).name), "w").close()
            sys.exit(0)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join({d!r}, rank + ".ready"), "w").close()
        time.sleep(60)
    """)
    launcher = subprocess.Popen(
        LAUNCH + ["--nproc", "2", "--"] + program, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for([os.path.join(d, f"{r}.ready") for r in range(2)])
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        launcher.kill()
    name = signal.Signals(signum).name
    assert sorted(os.listdir(d)) == [f"0.got-{name}", "0.ready", f"1.got-{name}", "1.ready"]
    assert launcher.returncode == 128 + signum
    assert stderr.splitlines() == [f"mirrax launch: received {name}; forwarding it to 2 worker(s)"]


def test_a_second_signal_kills_workers_that_ignore_the_first(tmp_path):
    d = str(tmp_path)
    program = _script(
        """
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """,
        _SLEEPER.format(dir=d),
    )
    launcher = subprocess.Popen(
        LAUNCH + ["--grace-period", "600", "--"] + program,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for([os.path.join(d, "0.pid")])
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # forwarded (the launcher polls every 0.1 s), and ignored
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=TIMEOUT_S)  # not the 600 s grace period
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + 15
    assert stderr.splitlines() == [
        "mirrax launch: received SIGTERM; forwarding it to 1 worker(s)",
        "mirrax launch: worker 0 still running at SIGTERM, received while stopping; sending SIGKILL",
    ]
    _assert_gone(_pid(d, 0))


# -- arguments ----------------------------------------------------------------------------------


def test_a_bare_python_is_the_launchers_interpreter_not_the_first_on_path(capsys, monkeypatch, tmp_path):
    # The README's `.venv/bin/mirrax launch ... -- python train.py` with PATH's first `python`
    # outside the venv: before, every worker ran that one (and died of ModuleNotFoundError:
    # jax). Here PATH's `python` and `python3` are a script that says so and exits 3.
    for name in ("python", "python3"):
        fake = tmp_path / name
        fake.write_text('#!/bin/sh\necho "PATH\'s $0"\nexit 3\n')
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    show = ["-c", "import sys; print(sys.executable)"]
    for name in ("python", "python3"):
        assert main(["launch", "--nproc", "2", "--", name, *show]) == 0
        assert sorted(capsys.readouterr().out.splitlines()) == [
            f"[worker {i}] {sys.executable}" for i in range(2)
        ]
    # A path is run as given, whatever its name.
    assert main(["launch", "--", str(tmp_path / "python"), *show]) == 3
    assert capsys.readouterr().out == f"[worker 0] PATH's {tmp_path / 'python'}\n"
    assert launch_lib.resolve_program(["python3.11", "x.py"]) == ["python3.11", "x.py"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "2"], "no program to run: put it after '--'"),
        (["--nproc", "2", "--"], "no program to run: put it after '--'"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1", "--", "true"],
            "--node-rank must be in [0, --nnodes) = [0, 2); received 2.",
        ),
        (
            ["--nnodes", "2", "--node-rank", "-1", "--coordinator", "h:1", "--", "true"],
            "--node-rank must be in [0, --nnodes) = [0, 2); received -1.",
        ),
        (["--nnodes", "2", "--", "true"], "--nnodes 2 needs --coordinator HOST:PORT"),
        (
            ["--nnodes", "2", "--coordinator", "10.0.0.1", "--", "true"],
            "--coordinator must be 'host:port' with a port in [1, 65535]; received '10.0.0.1'.",
        ),
        (
            ["--port", "1234", "--coordinator", "h:1", "--", "true"],
            "--port 1234 and --coordinator h:1 both set the coordinator's port",
        ),
        (
            ["--nproc", "3", "--port", "65534", "--", "true"],
            "the 3 workers' addresses use ports 65534 .. 65536, past 65535; choose a port <= 65533.",
        ),
        (
            ["--grace-period", "-1", "--", "true"],
            "--grace-period must be a finite number of seconds >= 0; received -1",
        ),
        (
            ["--grace-period", "nan", "--", "true"],
            "--grace-period must be a finite number of seconds >= 0; received nan",
        ),
        (
            ["--grace-period", "inf", "--", "true"],
            "--grace-period must be a finite number of seconds >= 0; received inf",
        ),
        (["--nproc", "0", "--", "true"], "expected a positive integer, received '0'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch"] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_program_that_does_not_exist_gives_127(capsys, tmp_path):
    missing = str(tmp_path / "no-such-program")
    assert main(["launch", "--nproc", "2", "--", missing, "--flag"]) == 127
    assert capsys.readouterr().err == (
        f"mirrax launch: error: cannot start worker 0: {missing!r}: No such file or directory. "
        "Check the program after '--' (a path, or a name on PATH, that is executable).\n"
    )


def test_a_program_that_is_not_executable_gives_126(capsys, tmp_path):
    path = tmp_path / "not-executable"
    path.write_text("#!/bin/sh\n")
    assert main(["launch", "--", str(path)]) == 126
    assert "Permission denied" in capsys.readouterr().err


# -- the launcher stays light -------------------------------------------------------------------


def test_the_launch_module_imports_no_jax_and_main_applies_no_cpu_devices():
    # launch.py imported with the mirrax packages' __init__ files skipped (as with a lazy
    # mirrax package): it loads only its two standard-library helpers, and no JAX.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(launch_lib.__file__))))
    check_module = textwrap.dedent(f"""
        import importlib, os, sys, types
        for name in ("mirrax", "mirrax._src", "mirrax._src.cli"):
            package = types.ModuleType(name)
            package.__path__ = [os.path.join({root!r}, *name.split("."))]
            sys.modules[name] = package
        importlib.import_module("mirrax._src.cli.launch")
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "mirrax"))))
    """)
    result = subprocess.run(
        [sys.executable, "-c", check_module], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "['mirrax', 'mirrax._src', 'mirrax._src.cli', 'mirrax._src.cli.launch', "
        "'mirrax._src.cli.worker_output', 'mirrax._src.launch_progress']\n"
    )
    # Through main: JAX's backends never start and the launcher's XLA_FLAGS stay as they were.
    check_main = textwrap.dedent("""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        from mirrax._src.cli.main import main
        code = main(["launch", "--cpu-devices", "3", "--", sys.executable, "-c", "print(1)"])
        from jax._src import xla_bridge
        print(code, xla_bridge.backends_are_initialized(), os.environ["XLA_FLAGS"])
    """)
    result = subprocess.run(
        [sys.executable, "-c", check_main], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.stdout.splitlines() == [
        "[worker 0] 1",
        "0 False --xla_force_host_platform_device_count=1",
    ], result.stderr
