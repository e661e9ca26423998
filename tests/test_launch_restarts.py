"""`mirrax launch --max-restarts`: the group started again after a failure, the attempt lines,
the position in fit a failed worker is named with, what stops the restarts, bad arguments.

Workers are tiny `python -c` programs that never import JAX (the end-to-end restart of a
multi-worker fit is in test_multi_worker_restarts.py). Each launcher runs as a subprocess with a
timeout, so a launcher that hangs fails the test instead of hanging the suite.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mirrax._src import launch_progress
from mirrax._src.cli import launch as launch_lib
from mirrax._src.cli.main import main

pytestmark = pytest.mark.subprocess

LAUNCH = [sys.executable, "-m", "mirrax._src.cli.main", "launch"]
TIMEOUT_S = 30  # the launcher imports the mirrax package (JAX included) before it starts


def _script(text: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(text)]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=TIMEOUT_S)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(LAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Worker 1 fails with code 3 in the attempts before FAIL_UNTIL; worker 0 waits to be stopped
# there. In the attempts from FAIL_UNTIL on both exit 0. Every start is counted in a file.
_FLAKY = """
    import os, sys, time
    rank, attempt = os.environ["MIRRAX_LAUNCH_RANK"], int(os.environ["MIRRAX_LAUNCH_RESTART_COUNT"])
    with open(os.path.join({dir!r}, f"start-{{attempt}}-{{rank}}"), "w") as f:
        f.write(os.environ["MIRRAX_LAUNCH_MAX_RESTARTS"])
    if attempt < {fail_until}:
        if rank == "1":
            sys.exit(3)
        time.sleep(60)
    print("done", attempt)
"""


def _starts(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("start-"))


def test_a_failed_group_is_restarted_until_it_succeeds(tmp_path):
    d = str(tmp_path)
    program = _script(_FLAKY.format(dir=d, fail_until=2))
    result = _run(["--nproc", "2", "--max-restarts", "3", "--restart-delay", "0", "--"] + program)
    assert result.returncode == 0, result.stderr
    # Attempts 1 and 2 (restart counts 0 and 1) fail; attempt 3 (count 2) succeeds; the 4th
    # allowed attempt is never needed.
    assert result.stderr.splitlines() == [
        "mirrax launch: worker 1 exited with code 3; stopping the other 1 worker(s)",
        "mirrax launch: attempt 1/4: worker 1 exited with code 3; restarting the group's 2 worker(s) "
        "in 0 s (attempt 2/4)",
        "mirrax launch: worker 1 exited with code 3; stopping the other 1 worker(s)",
        "mirrax launch: attempt 2/4: worker 1 exited with code 3; restarting the group's 2 worker(s) "
        "in 0 s (attempt 3/4)",
    ]
    assert sorted(result.stdout.splitlines()) == ["[worker 0] done 2", "[worker 1] done 2"]
    assert _starts(d) == [f"start-{a}-{r}" for a in range(3) for r in range(2)]
    assert {open(os.path.join(d, name)).read() for name in _starts(d)} == {"3"}


def test_a_worker_that_fails_every_attempt_ends_the_job_with_its_status(tmp_path):
    d = str(tmp_path)
    program = _script(_FLAKY.format(dir=d, fail_until=99))
    result = _run(["--nproc", "2", "--max-restarts", "1", "--restart-delay", "0", "--"] + program)
    assert result.returncode == 3
    assert result.stderr.splitlines()[-1] == (
        "mirrax launch: attempt 2/2: worker 1 exited with code 3; no restart left "
        "(--max-restarts 1), exiting with status 3"
    )
    assert _starts(d) == ["start-0-0", "start-0-1", "start-1-0", "start-1-1"]


def test_an_elastic_width_goes_on_without_a_slot_killed_twice_in_a_row(tmp_path):
    d = str(tmp_path)
    # Worker 1 is killed whenever there are 2 workers (a lost slot); alone, worker 0 succeeds.
    program = _script(
        _FLAKY.format(dir=d, fail_until=99)
        .replace("if attempt < 99:", 'if os.environ["MIRRAX_LAUNCH_WORLD_SIZE"] == "2":')
        .replace("sys.exit(3)", "os.kill(os.getpid(), 9)")
    )
    result = _run(["--nproc", "1:2", "--max-restarts", "3", "--restart-delay", "0", "--"] + program)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "attempt" in line] == [
        "mirrax launch: attempt 1/4: worker 1 was killed by signal SIGKILL; restarting the group's 2 "
        "worker(s) in 0 s (attempt 2/4)",
        "mirrax launch: attempt 2/4: worker 1 was killed by signal SIGKILL, as in the attempt before; "
        "restarting with 1 of --nproc 1:2 worker(s) in 0 s (attempt 3/4)",
    ]
    assert result.stdout.splitlines() == ["[worker 0] done 2"]
    assert _starts(d) == ["start-0-0", "start-0-1", "start-1-0", "start-1-1", "start-2-0"]


def test_an_elastic_width_keeps_its_workers_when_one_exits_with_an_error(tmp_path):
    # An exit status is the program's own error (every worker of a width would hit it: a bad
    # backup, a bug), not a lost slot: the width stays.
    d = str(tmp_path)
    program = _script(_FLAKY.format(dir=d, fail_until=99))
    result = _run(["--nproc", "1:2", "--max-restarts", "2", "--restart-delay", "0", "--"] + program)
    assert result.returncode == 3
    assert "as in the attempt before" not in result.stderr
    assert _starts(d) == [f"start-{a}-{r}" for a in range(3) for r in range(2)]


def test_the_failed_worker_is_named_with_the_epoch_and_step_fit_was_running():
    # What fit does (loops.py): mark (epoch index 2, step index 4) before the step, then die.
    # The module is loaded from its file, without the mirrax package (and JAX), to start fast.
    program = _script(f"""
        import importlib.util, os, signal
        spec = importlib.util.spec_from_file_location("progress", {launch_progress.__file__!r})
        progress = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(progress)
        progress.Progress.from_environment().mark(2, 4)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = _run(["--max-restarts", "1", "--restart-delay", "0", "--"] + program)
    assert result.returncode == 128 + 9
    assert result.stderr.splitlines() == [
        "mirrax launch: worker 0 was killed by signal SIGKILL at epoch 3, step 5",
        "mirrax launch: attempt 1/2: worker 0 was killed by signal SIGKILL at epoch 3, step 5; "
        "restarting the group's 1 worker(s) in 0 s (attempt 2/2)",
        "mirrax launch: worker 0 was killed by signal SIGKILL at epoch 3, step 5",
        "mirrax launch: attempt 2/2: worker 0 was killed by signal SIGKILL at epoch 3, step 5; "
        "no restart left (--max-restarts 1), exiting with status 137",
    ]


def test_progress_reads_back_what_was_marked_and_nothing_after_clear(tmp_path):
    path = str(tmp_path / "worker-0")
    launch_progress.create(path)
    assert launch_progress.read(path) is None  # not in fit yet
    progress = launch_progress.Progress(path)
    progress.mark(0, 0)
    assert launch_progress.read(path) == (1, 1)
    progress.mark(6, 16)
    assert launch_progress.read(path) == (7, 17)
    assert launch_progress.describe((7, 17)) == " at epoch 7, step 17"
    progress.mark(7, -1)  # epoch index 7 begins
    assert launch_progress.read(path) == (8, 0)
    assert launch_progress.describe((8, 0)) == " at the start of epoch 8"
    progress.clear()
    assert launch_progress.read(path) is None
    assert launch_progress.read(str(tmp_path / "missing")) is None
    (tmp_path / "short").write_bytes(b"\x01")
    assert launch_progress.read(str(tmp_path / "short")) is None


def test_a_signal_during_the_restart_delay_stops_the_job_without_a_restart(tmp_path):
    d = str(tmp_path)
    program = _script(_FLAKY.format(dir=d, fail_until=99))
    launcher = _start(["--nproc", "2", "--max-restarts", "2", "--restart-delay", "60", "--"] + program)
    try:
        for line in launcher.stderr:  # until the launcher waits for the restart
            if "restarting" in line:
                break
        launcher.send_signal(signal.SIGTERM)
        _, rest = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert rest.splitlines() == ["mirrax launch: received SIGTERM before the restart; not restarting"]
    assert _starts(d) == ["start-0-0", "start-0-1"]


def test_a_signal_to_the_launcher_is_never_followed_by_a_restart(tmp_path):
    d = str(tmp_path)
    program = _script(_FLAKY.format(dir=d, fail_until=99).replace('rank == "1"', "False"))
    launcher = _start(["--nproc", "2", "--max-restarts", "2", "--restart-delay", "0", "--"] + program)
    try:
        while len(_starts(d)) < 2:
            assert launcher.poll() is None, launcher.communicate()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert err.splitlines() == ["mirrax launch: received SIGTERM; forwarding it to 2 worker(s)"]
    assert _starts(d) == ["start-0-0", "start-0-1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-restarts", "-1"], "argument --max-restarts: expected an integer >= 0, received '-1'"),
        (["--max-restarts", "two"], "argument --max-restarts: expected an integer >= 0, received 'two'"),
        *(
            (
                ["--restart-delay", text],
                f"argument --restart-delay: expected a finite number >= 0 (e.g. 5), received '{text}'",
            )
            for text in ("-1", "inf", "abc")
        ),
        (["--nproc", "3:2"], "--nproc MIN:MAX needs 1 <= MIN <= MAX; received 3:2."),
        (["--nproc", "0:2"], "--nproc MIN:MAX needs 1 <= MIN <= MAX; received 0:2."),
        (["--nproc", "a:2"], "--nproc: expected a positive integer or MIN:MAX (e.g. 2:4), received 'a:2'"),
        (["--nproc", "0"], "argument --nproc: expected a positive integer, received '0'"),
        (
            ["--nproc", "1:2", "--nnodes", "2", "--coordinator", "h:1"],
            "--nproc 1:2 with --nnodes 2: an elastic width works on one node only",
        ),
    ],
)
def test_bad_restart_arguments_exit_2_naming_the_problem(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch"] + args + ["--", "true"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("max_restarts", [-1, True, 1.5, "2"])
def test_the_python_api_refuses_a_max_restarts_that_is_not_a_count(max_restarts):
    with pytest.raises(ValueError, match=r"--max-restarts must be an integer >= 0 \(0: never restart\)"):
        launch_lib.launch(["true"], max_restarts=max_restarts)
