"""A multi-worker fit that survives its workers (`mirrax launch --max-restarts`): killed mid-step,
during a backup and between epochs, restarted, shrunk (`--nproc MIN:MAX`) and grown, it ends with
the same bits as a run that never failed (replica-invariant mode: the result does not depend on
the layout, so the reference is one process with 4 devices). The worker program is
tests/multiworker/restarts.py.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.multiworker import harness

pytestmark = pytest.mark.subprocess

COMPARED = ("weights", "history", "epochs", "predictions")


def _launch(out, nproc, cpu_devices, plan, *flags):
    env = dict(os.environ, PYTHONPATH=str(harness.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "mirrax._src.cli.main", "launch", "--nproc", str(nproc)]
        + ["--cpu-devices", str(cpu_devices), "--restart-delay", "0", *flags, "--"]
        + [sys.executable, "-m", "tests.multiworker.scenarios", "restarted", str(out), "auto", plan],
        cwd=harness.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _reports(out, workers):
    return [json.loads((out / f"{i}.json").read_text()) for i in range(workers)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that never failed: one process, 4 devices, 4 epochs of 4 steps."""
    (report,) = harness.run(
        "restarted", tmp_path_factory.mktemp("plain"), num_workers=1, cpu_devices=4, args=["plain"]
    )
    assert len(report["seen"]) == 4 * 4 and report["epochs"] == [0, 1, 2, 3]
    return report


def test_killed_mid_step_during_a_backup_and_between_epochs_it_restarts_to_the_same_bits(
    tmp_path, uninterrupted
):
    launched = _launch(tmp_path, 2, 2, "three", "--max-restarts", "3")
    assert launched.returncode == 0, launched.stderr[-4000:]
    attempts = [line for line in launched.stderr.splitlines() if line.startswith("mirrax launch: attempt")]
    # restarts.py's KILLS["three"]: epoch index 1 batch 2 (worker 1), the backup after epoch
    # index 2 batch 1 (worker 0, the writer), the start of epoch index 3 (worker 1).
    assert [re.sub(r"; restarting.*", "", line) for line in attempts] == [
        "mirrax launch: attempt 1/4: worker 1 was killed by signal SIGKILL at epoch 2, step 3",
        "mirrax launch: attempt 2/4: worker 0 was killed by signal SIGKILL at epoch 3, step 2",
        "mirrax launch: attempt 3/4: worker 1 was killed by signal SIGKILL at the start of epoch 4",
    ]
    for report in _reports(tmp_path, 2):
        assert report["attempt"] == 3
        # The last attempt resumed at the start of epoch index 3 (the backup after its last
        # batch): 4 steps.
        assert report["seen"] == [[3, b] for b in range(4)]
        assert {k: report[k] for k in COMPARED} == {k: uninterrupted[k] for k in COMPARED}
    assert not (tmp_path / "backup").exists()  # the finished fit deleted it


def test_an_elastic_job_shrinks_from_2x2_to_1x2_and_ends_with_the_same_bits(tmp_path, uninterrupted):
    # Worker 1 dies in attempts 1 and 2 (restarts.py's KILLS["twice"]): its slot is taken as
    # lost, and attempt 3 runs worker 0 alone, with 2 replicas instead of 4.
    launched = _launch(tmp_path, "1:2", 2, "twice", "--max-restarts", "2")
    assert launched.returncode == 0, launched.stderr[-4000:]
    assert "as in the attempt before; restarting with 1 of --nproc 1:2 worker(s)" in launched.stderr
    (report,) = _reports(tmp_path, 1)
    # Killed in epoch index 2's batch 1 end hook, before its backup: the last one was taken at
    # the end of epoch index 1.
    assert report["attempt"] == 2 and report["seen"][0] == [2, 0]
    assert {k: report[k] for k in COMPARED} == {k: uninterrupted[k] for k in COMPARED}


@pytest.mark.parametrize(
    "before, after",
    [((2, 2, "once"), (1, 4)), ((1, 2, "chief_once"), (2, 2))],
    ids=["shrink_2x2_to_1x4", "grow_1x2_to_2x2"],
)
def test_a_job_started_again_on_another_layout_ends_with_the_same_bits(
    tmp_path, uninterrupted, before, after
):
    # The job dies; its operator (or a scheduler, with another allocation) starts it again on
    # another layout, from the same backup.
    nproc, cpu_devices, plan = before
    failed = _launch(tmp_path, nproc, cpu_devices, plan)  # no --max-restarts: the job ends
    assert failed.returncode == 128 + 9, failed.stderr[-4000:]
    assert (tmp_path / "backup").is_dir()
    # Started again by hand (or by a cluster manager) on another layout, from the same backup:
    # resumes at epoch index 1, batch 2 (the backup after its batch 1, global batch 6).
    resumed = _launch(tmp_path, after[0], after[1], "plain")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for report in _reports(tmp_path, after[0]):
        assert report["seen"][0] == [1, 2] and len(report["seen"]) == 2 + 2 * 4
        assert {k: report[k] for k in COMPARED} == {k: uninterrupted[k] for k in COMPARED}


def test_sys_exit_on_one_worker_ends_the_job_at_once_with_its_status(tmp_path):
    # Without mirrax's sys.exit wrapper, worker 1 would wait in jax.distributed's shutdown
    # barrier (300 s) for worker 0, which waits for it in the next collective; then JAX aborts
    # worker 0 and the launcher blames it (SIGABRT), and the status 3 is lost.
    launched = _launch(tmp_path, 2, 1, "exit_once")
    assert launched.returncode == 3, launched.stderr[-4000:]
    assert "mirrax launch: worker 1 exited with code 3 at epoch 2, step 3" in launched.stderr
    assert (
        "mirrax: worker 1 called sys.exit(3); exiting now with status 3" in launched.stdout + launched.stderr
    )


def test_the_sys_exit_wrapper_keeps_a_normal_exit_and_prints_a_message_status():
    from mirrax._src.distribute import worker_exit

    calls = []
    wrapped = worker_exit.exit_at_once_on_failure(calls.append)
    wrapped()
    wrapped(0)
    assert calls == [None, 0]  # a normal exit: the previous sys.exit, so the shutdown barrier
    program = (
        "import sys; from mirrax._src.distribute import worker_exit; "
        "sys.exit = worker_exit.exit_at_once_on_failure(sys.exit); sys.exit('bad input file')"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    # As Python: a message status is printed and gives status 1.
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "bad input file",
        "mirrax: worker 0 called sys.exit with a message; exiting now with status 1, so that no peer "
        "waits for it in jax.distributed's shutdown barrier.",
    ]
