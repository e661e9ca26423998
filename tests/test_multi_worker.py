"""MultiWorkerMirroredStrategy: several local processes on loopback (Gloo), each with fake CPUs.

Every test starts real worker processes (tests/multiworker/harness.py) running a program of
tests/multiworker/scenarios.py, and compares what they report with hand arithmetic or with the
same program run as ONE process over the same number of devices.
"""

import json
import zlib

import numpy as np
import pytest

import mirrax
from tests.multiworker import harness

pytestmark = pytest.mark.subprocess


def test_cluster_facts_of_the_issue_tf_config(tmp_path):
    # Chief + 2 workers (+ an evaluator that does not train) with 2 devices each.
    results = harness.run("facts", tmp_path, num_workers=3, cpu_devices=2, chief=True, evaluator=True)
    chief, worker0, worker1 = results
    assert [r["num_workers"] for r in results] == [3, 3, 3]
    assert [(r["task_type"], r["task_id"]) for r in results] == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert [r["is_chief"] for r in results] == [True, False, False]
    assert [r["should_checkpoint"] for r in results] == [True, False, False]
    # The issue's task (worker index 1) is training task 2 of 3.
    assert worker1["worker_index"] == 2 and worker1["process_index"] == 2
    assert all(r["num_replicas_in_sync"] == 3 * 2 and r["local_replicas"] == 2 for r in results)
    assert worker1["worker_devices"] == [
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:1",
    ]
    assert [(r["num_input_pipelines"], r["input_pipeline_id"]) for r in results] == [(3, 0), (3, 1), (3, 2)]
    assert all(r["per_replica_batch_48"] == 48 // 6 == 8 for r in results)
    # Two global batches of 48 (examples 0..95): each worker gets 2 replicas x 8 = 16 of each.
    assert worker1["examples_seen"] == list(range(32, 48)) + list(range(80, 96))
    assert chief["examples_seen"] == list(range(0, 16)) + list(range(48, 64))
    assert sorted(sum((r["examples_seen"] for r in results), [])) == list(range(96))
    # Outside every scope each worker runs alone on its own first device, as TF's default
    # strategy (issue 26: it was worker 0's device, so worker 1 failed with an IndexError and
    # worker 0 waited for it): one input pipeline, the whole batch of 48 on its one replica,
    # and predict of a model built outside the scope: 2 * x + 1 for x = 0..5.
    for r in results:
        assert r["default_worker_devices"] == [
            f"/job:localhost/replica:0/task:{r['process_index']}/device:CPU:0"
        ]
        assert r["default_pipelines"] == (1, 0) or r["default_pipelines"] == [1, 0]
        assert r["default_rows"] == [48]
        assert r["predicted"] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    # A strategy on the devices of processes 0 and 1: process 2 has no replica, and every
    # process says so (process 2 at once, the others at their first exchange), no hang.
    for r in results:
        assert r["no_replica_refused"].startswith(
            "InvalidBatchError: MirroredStrategy's replicas are on the devices of process(es) "
            "[0, 1] only, so process(es) [2] have no replica to feed a batch to."
        ), r


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    """The `fit` scenario on 2 processes x 2 devices, and on 1 process x 4 devices."""
    two = harness.run("fit", tmp_path_factory.mktemp("fit2x2"), num_workers=2, cpu_devices=2)
    one = harness.run("fit", tmp_path_factory.mktemp("fit1x4"), num_workers=1, cpu_devices=4)
    return two, one[0]


@pytest.mark.xdist_group("multi_worker_fit_runs")  # one fit_runs for both
def test_fit_on_two_workers_equals_one_process_with_as_many_devices(fit_runs):
    (worker0, worker1), single = fit_runs
    for worker in (worker0, worker1):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            np.testing.assert_allclose(worker["history"][key], single["history"][key], atol=1e-6, err_msg=key)
        for mine, reference in zip(worker["weights"], single["weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)
        np.testing.assert_allclose(worker["evaluate"]["loss"], single["evaluate"]["loss"], atol=1e-6)
        # 23 of the 36 labels are predicted right: the same count on every worker.
        assert worker["evaluate"]["accuracy"] == single["evaluate"]["accuracy"]
        # predict gathers every worker's replicas: all 13 rows, in order, on every worker.
        assert np.shape(worker["predictions"]) == (13, 2)
        np.testing.assert_allclose(worker["predictions"], single["predictions"], atol=1e-6)
        # x as a list of two column blocks (several inputs) trains as the one array does (the
        # same rows on each worker; 1e-6: XLA may fuse the join into the matmul differently).
        for key in ("loss", "val_loss"):
            np.testing.assert_allclose(
                worker["joined_history"][key], worker["history"][key], atol=1e-6, err_msg=key
            )
        for mine, reference in zip(worker["joined_weights"], worker["weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)
        np.testing.assert_allclose(worker["joined_predictions"], worker["predictions"], atol=1e-6)


@pytest.mark.xdist_group("multi_worker_fit_runs")  # one fit_runs for both
def test_custom_training_loop_on_two_workers_equals_one_process(fit_runs):
    (worker0, worker1), single = fit_runs
    # 36 examples in global batches of 8 = 5 steps per pass (the last one of 4), 2 passes.
    assert len(single["custom_losses"]) == 2 * 5
    for worker in (worker0, worker1):
        np.testing.assert_allclose(worker["custom_losses"], single["custom_losses"], atol=1e-6)
        for mine, reference in zip(worker["custom_weights"], single["custom_weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)


def test_a_task_that_does_not_train_cannot_build_the_strategy(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"], "evaluator": ["h3:2222"]},
                "task": {"type": "evaluator", "index": 0},
            }
        ),
    )
    with pytest.raises(ValueError, match="'evaluator':0, which does not train"):
        mirrax.MultiWorkerMirroredStrategy()


@pytest.mark.parametrize(
    "task, message",
    [
        ({"type": "worker", "index": 2}, "task index 2 is out of range for job 'worker'"),
        ({"type": "master", "index": 0}, "unknown task type 'master'"),
    ],
)
def test_a_bad_task_is_refused_when_the_strategy_is_built(monkeypatch, task, message):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}, "task": task}),
    )
    with pytest.raises(ValueError, match=message):
        mirrax.MultiWorkerMirroredStrategy()


def test_tf_config_that_is_not_json_is_refused(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{'cluster': __import__('os')}")
    with pytest.raises(ValueError, match="not valid JSON"):
        mirrax.MultiWorkerMirroredStrategy()


def test_one_task_cluster_is_a_mirrored_strategy_on_the_local_devices(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = mirrax.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 8  # conftest's 8 fake CPU devices
    assert strategy.extended.should_checkpoint and strategy.cluster_resolver.is_chief


def test_communication_options_are_checked():
    assert mirrax.CommunicationOptions(implementation="ring").implementation is (
        mirrax.CommunicationImplementation.RING
    )
    with pytest.raises(ValueError, match="timeout_seconds must be None or a number > 0"):
        mirrax.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        mirrax.CommunicationOptions(implementation="mpi")
    with pytest.raises(ValueError, match="NCCL needs GPUs"):
        mirrax.MultiWorkerMirroredStrategy(
            communication_options=mirrax.CommunicationOptions(implementation="NCCL")
        )


def test_auto_shard_policies_split_files_and_batches_as_tf(tmp_path):
    # 2 workers x 1 replica, global batch 4, examples 0..11, no shuffling.
    worker0, worker1 = harness.run("autoshard", tmp_path, num_workers=2, cpu_devices=1)
    # FILE: files [0..5] and [6..11]; each worker reads its own file, 4 / 2 = 2 per step.
    assert worker0["FILE"] == [[0, 1], [2, 3], [4, 5]]
    assert worker1["FILE"] == [[6, 7], [8, 9], [10, 11]]
    assert worker0["AUTO_two_files"] == worker0["FILE"]
    # DATA on one file: every worker reads each global batch and keeps its half.
    assert worker0["DATA"] == [[0, 1], [4, 5], [8, 9]]
    assert worker1["DATA"] == [[2, 3], [6, 7], [10, 11]]
    assert worker1["AUTO_one_file"] == worker1["DATA"]
    assert worker1["numpy_batches_DATA"] == worker1["DATA"]
    # OFF: both workers see all six batches of 2.
    assert worker0["OFF"] == worker1["OFF"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert "1 file(s) for 2 workers" in worker0["FILE_one_file_error"]
    assert "Use AutoShardPolicy.DATA" in worker0["FILE_one_file_error"]
    # distribute_datasets_from_function is not sharded again: range(20i, 20i + 20) in 4s.
    assert worker0["from_function"] == [list(range(j, j + 4)) for j in range(0, 20, 4)]
    assert worker1["from_function"] == [list(range(j, j + 4)) for j in range(20, 40, 4)]


def test_uneven_data_never_hangs_and_every_example_counts_once(tmp_path):
    # Worker 0: 5 per-replica batches of 4 (ids 0..19); worker 1: 3 (ids 100..111); 2 local
    # replicas each, so worker 0 needs ceil(5 / 2) = 3 steps and worker 1 needs 2.
    worker0, worker1 = harness.run("uneven", tmp_path, num_workers=2, cpu_devices=2)
    assert worker0["steps"] == worker1["steps"] == 3
    ids = list(range(20)) + list(range(100, 112))
    assert sorted(worker0["gathered"]) == sorted(worker1["gathered"]) == ids
    assert sum(worker0["totals"]) == sum(ids) == 190 + 1266
    # Evaluation: mean of x**2 over the 32 examples = (2470 + 133706) / 32.
    assert worker0["evaluate_mse"] == worker1["evaluate_mse"] == (2470 + 133706) / 32


def test_callbacks_take_the_same_decision_on_every_worker(tmp_path):
    worker0, worker1 = harness.run("decisions", tmp_path, num_workers=2, cpu_devices=1)
    # Each worker trains on its own data, but the logs are all-reduced: one history, so one
    # decision. SGD at 3.0 diverges: loss up at epoch 2, so the learning rate halves there and
    # EarlyStopping (patience 1) stops after it.
    assert worker0 == worker1
    assert worker0["loss"][1] > worker0["loss"][0]
    assert worker0["rates"] == [3.0, 1.5]
    assert worker0["stopped_epoch"] == 1


def _peer_loss_reported(output: str) -> bool:
    """Whichever comes first: Gloo's broken connection or the coordination service's heartbeat."""
    return (
        "stopped sending heartbeats" in output
        or "mirrax: worker 0 lost a peer worker during a collective" in output
    )


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_checkpoints_are_written_once_and_only_the_chief_prints(tmp_path):
    results = harness.run("chief_writes", tmp_path, num_workers=3, cpu_devices=1)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch01", "epoch02", "final"]
    assert not [p for p in _tree(ckpt) if "tmp" in p.lower()]
    for name in ("epoch01", "epoch02", "final"):
        assert (ckpt / name / "commit_success.txt").exists()
    # The final checkpoint holds the weights every worker ended with.
    strategy = mirrax.OneDeviceStrategy("cpu:0")
    from tests.multiworker.scenarios import mlp, mlp_problem

    w1, w2, _, _ = mlp_problem()
    with strategy.scope():
        model = mirrax.Model(mlp(np.zeros_like(w1), np.zeros_like(w2)))
    model.load_weights(str(ckpt / "final"))
    for worker in results:
        np.testing.assert_array_equal(np.asarray(model.module.l1.kernel[...]), worker["weights"][0])
    chief_log = (tmp_path / "log0.txt").read_text()
    assert "Epoch 2/2" in chief_log and "Epoch 2: saving model to" in chief_log
    for index in (1, 2):
        log = (tmp_path / f"log{index}.txt").read_text()
        assert "Epoch" not in log and "loss" not in log


def test_missing_peer_is_named_within_the_timeout(tmp_path):
    # Only the chief of a 2-task cluster starts; CommunicationOptions(timeout_seconds=10).
    workers = harness.start(
        "facts", tmp_path, num_workers=2, cpu_devices=1, only=[0], env={"MIRRAX_TEST_TIMEOUT": "10"}
    )
    codes = harness.wait(workers, timeout=60)
    assert codes == [1]
    output = workers[0].output
    assert "waited 10 s for the other training tasks to join" in output
    assert "still missing: worker:1 (127.0.0.1:" in output


def test_killed_worker_makes_the_others_exit_and_the_rerun_resumes_from_the_backup(tmp_path):
    plain = harness.run("killed", tmp_path / "plain", num_workers=2, cpu_devices=1, args=["plain"])
    # Worker 1 SIGKILLs itself after batch 3 of epoch 3 (0-based epoch 2); worker 0 fails in
    # its next all-reduce or by the heartbeat (timeout_seconds=15): non-zero, no hang.
    workers = harness.start("killed", tmp_path / "run", num_workers=2, cpu_devices=1, args=["kill"])
    codes = harness.wait(workers, timeout=90)
    assert codes[1] == -9 and codes[0] != 0
    assert _peer_loss_reported(workers[0].output)
    # The chief's backup holds the end of epoch 2 (epoch index 1): resume at epoch index 2;
    # the one before it (end of epoch 1) is kept as the fallback, as Keras keeps its previous.
    assert sorted(p.name for p in (tmp_path / "run" / "backup").iterdir()) == ["1", "2"]
    resumed = harness.run("killed", tmp_path / "run", num_workers=2, cpu_devices=1, args=["resume"])
    for worker in resumed:
        # Epochs 2 and 3 again, 5 steps each: every worker at the same epoch and step.
        assert worker["seen"] == [[e, b] for e in (2, 3) for b in range(5)]
        for mine, reference in zip(worker["weights"], plain[0]["weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)
    assert not (tmp_path / "run" / "backup").exists()


def test_with_default_options_a_dead_worker_ends_the_job_within_a_minute(tmp_path):
    # Worker 1 dies after its first batch; the default heartbeat timeout (30 s) ends worker 0.
    workers = harness.start("killed", tmp_path, num_workers=2, cpu_devices=1, args=["default"])
    codes = harness.wait(workers, timeout=60 + 15)  # 15 s for the start-up on a busy machine
    assert codes[1] == -9 and codes[0] != 0
    assert _peer_loss_reported(workers[0].output)


def test_mirrax_launch_stops_the_job_when_a_worker_dies(tmp_path):
    import subprocess
    import sys

    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mirrax._src.cli.main",
            "launch",
            "--nproc",
            "2",
            "--cpu-devices",
            "1",
            "--grace-period",
            "2",
            "--",
            sys.executable,
            "-m",
            "tests.multiworker.scenarios",
            "killed",
            str(tmp_path),
            "auto",
            "default",
        ],
        cwd=harness.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(harness.ROOT), "JAX_PLATFORMS": "cpu"},
    )
    # Whichever failure the launcher sees first: worker 1's SIGKILL (128 + 9), or worker 0
    # exiting with status 1 once its all-reduce lost the peer.
    assert completed.returncode in (128 + 9, 1), completed.stderr[-2000:]
    import re

    assert re.search(
        r"mirrax launch: worker (1 was killed by signal SIGKILL|0 exited with "
        r"code 1)",
        completed.stderr,
    ), completed.stderr[-2000:]


def test_a_worker_that_raises_exits_at_once_and_its_peer_does_not_hang(tmp_path):
    # Without mirrax's excepthook, worker 1 would wait in jax.distributed's shutdown barrier
    # (300 s) while worker 0 waits for it in the next all-reduce: a hang of minutes.
    workers = harness.start("killed", tmp_path, num_workers=2, cpu_devices=1, args=["raise"])
    codes = harness.wait(workers, timeout=75)
    # Worker 0 fails in its next all-reduce (status 1) or is ended by the heartbeat (SIGABRT).
    assert codes[1] == 1 and codes[0] in (1, -6)
    assert "RuntimeError: worker 1 fails on purpose" in workers[1].output
    assert "mirrax: worker 1 failed with RuntimeError; exiting now with status 1" in (workers[1].output)


def test_main_job_under_mirrax_launch_equals_one_process(tmp_path):
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    mirrax_cmd = [sys.executable, "-m", "mirrax._src.cli.main"]
    train = ["train", "--epochs", "1", "--loop", "custom"]
    launched = subprocess.run(
        mirrax_cmd + ["launch", "--nproc", "2", "--cpu-devices", "2", "--"] + mirrax_cmd + train,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    # Gloo's "[Gloo] Rank N is connected to ..." lines (one per worker) are not relayed.
    assert "[Gloo]" not in launched.stdout + launched.stderr
    single = subprocess.run(
        mirrax_cmd + train + ["--cpu-devices", "4"], capture_output=True, text=True, timeout=240, env=env
    )
    assert single.returncode == 0, single.stderr[-3000:]
    # 2 workers x 2 devices and 1 process x 4 devices: the same global batch (4 x 16), the same
    # test accuracy (to the 4 printed digits) on both workers.
    expected = re.findall(r"Test accuracy: (\d\.\d+)", single.stdout)
    assert len(expected) == 1
    reported = re.findall(r"\[worker (\d)\] .*Test accuracy: (\d\.\d+)", launched.stdout)
    assert sorted(reported) == [("0", expected[0]), ("1", expected[0])]
    assert "MultiWorkerMirroredStrategy(num_replicas_in_sync=4, num_workers=2" in launched.stdout


@pytest.mark.parametrize(
    "mode, message",
    [
        ("order", "The processes disagree about which distributed dataset is read"),
        ("dtype", "The processes disagree about the structure, trailing shapes and dtypes"),
        ("data", "The processes disagree about the global batch every worker reads"),
        # Same shape, other values: at the first step ('input/0/0') the digests of the global
        # batch differ: CRC-32 of the bytes of np.ones((4, 2), float32) on process 0, of zeros on
        # process 1; the message names the fix.
        (
            "values",
            "for each worker to read its own data, use distribute_datasets_from_function) "
            "at 'input/0/0' (process 0: '4 examples, CRC-32 "
            f"{zlib.crc32(np.ones((4, 2), np.float32).tobytes()):08x}'; process 1: "
            f"'4 examples, CRC-32 {zlib.crc32(np.zeros((4, 2), np.float32).tobytes()):08x}')",
        ),
    ],
)
def test_a_divergent_input_program_fails_on_every_worker(tmp_path, mode, message):
    workers = harness.start(
        "divergent", tmp_path, num_workers=2, cpu_devices=1, args=[mode], env={"MIRRAX_TEST_TIMEOUT": "20"}
    )
    codes = harness.wait(workers, timeout=90)
    assert codes == [1, 1]
    for worker in workers:
        assert message in worker.output


def test_sigterm_stops_a_worker_at_once(tmp_path):
    import signal
    import time

    # A short collective timeout: the survivor's exit, not its timeout, is under test.
    workers = harness.start(
        "divergent",
        tmp_path,
        num_workers=2,
        cpu_devices=1,
        args=["sigterm"],
        env={"MIRRAX_TEST_TIMEOUT": "5"},
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(w.process.poll() is None for w in workers)
        time.sleep(0.2)
    time.sleep(1)  # training
    # jax.distributed's preemption notifier would catch SIGTERM and only log it.
    workers[1].process.send_signal(signal.SIGTERM)
    assert workers[1].process.wait(timeout=10) == -signal.SIGTERM
    codes = harness.wait(workers, timeout=60)
    assert codes[0] != 0


def test_coordinator_port_in_use_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        workers = harness.start("facts", tmp_path, num_workers=2, cpu_devices=1, only=[0], port=port)
        codes = harness.wait(workers, timeout=60)
    assert codes == [1]
    assert f"this task is the chief and must run the coordinator at 127.0.0.1:{port}" in workers[0].output
    assert "Free the port or choose another one" in workers[0].output
