"""MultiWorkerMirroredStrategy: several local processes on loopback (Gloo), each with fake CPUs.

Every test starts real worker processes (tests/multiprocess/harness.py) running a program of
tests/multiprocess/scenarios.py, and compares what they report with hand arithmetic or with the
same program run as ONE process over the same number of devices.
"""

import json

import numpy as np
import pytest

import mirrax
from tests.multiprocess import harness


def test_cluster_facts_of_the_issue_tf_config(tmp_path):
    # Chief + 2 workers (+ an evaluator that does not train) with 2 devices each.
    results = harness.run("facts", tmp_path, num_workers=3, cpu_devices=2, chief=True,
                          evaluator=True)
    chief, worker0, worker1 = results
    assert [r["num_workers"] for r in results] == [3, 3, 3]
    assert [(r["task_type"], r["task_id"]) for r in results] == [
        ("chief", 0), ("worker", 0), ("worker", 1)]
    assert [r["is_chief"] for r in results] == [True, False, False]
    assert [r["should_checkpoint"] for r in results] == [True, False, False]
    # The issue's task (worker index 1) is training task 2 of 3.
    assert worker1["worker_index"] == 2 and worker1["process_index"] == 2
    assert all(r["num_replicas_in_sync"] == 3 * 2 and r["local_replicas"] == 2 for r in results)
    assert worker1["worker_devices"] == ["/job:worker/replica:0/task:1/device:CPU:0",
                                         "/job:worker/replica:0/task:1/device:CPU:1"]
    assert [(r["num_input_pipelines"], r["input_pipeline_id"]) for r in results] == [
        (3, 0), (3, 1), (3, 2)]
    assert all(r["per_replica_batch_48"] == 48 // 6 == 8 for r in results)
    # Two global batches of 48 (examples 0..95): each worker gets 2 replicas x 8 = 16 of each.
    assert worker1["examples_seen"] == list(range(32, 48)) + list(range(80, 96))
    assert chief["examples_seen"] == list(range(0, 16)) + list(range(48, 64))
    assert sorted(sum((r["examples_seen"] for r in results), [])) == list(range(96))


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    """The `fit` scenario on 2 processes x 2 devices, and on 1 process x 4 devices."""
    two = harness.run("fit", tmp_path_factory.mktemp("fit2x2"), num_workers=2, cpu_devices=2)
    one = harness.run("fit", tmp_path_factory.mktemp("fit1x4"), num_workers=1, cpu_devices=4)
    return two, one[0]


def test_fit_on_two_workers_equals_one_process_with_as_many_devices(fit_runs):
    (worker0, worker1), single = fit_runs
    for worker in (worker0, worker1):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            np.testing.assert_allclose(worker["history"][key], single["history"][key],
                                       atol=1e-6, err_msg=key)
        for mine, reference in zip(worker["weights"], single["weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)
        np.testing.assert_allclose(worker["evaluate"]["loss"], single["evaluate"]["loss"],
                                   atol=1e-6)
        # 23 of the 36 labels are predicted right: the same count on every worker.
        assert worker["evaluate"]["accuracy"] == single["evaluate"]["accuracy"]
        # predict gathers every worker's replicas: all 13 rows, in order, on every worker.
        assert np.shape(worker["predictions"]) == (13, 2)
        np.testing.assert_allclose(worker["predictions"], single["predictions"], atol=1e-6)


def test_custom_training_loop_on_two_workers_equals_one_process(fit_runs):
    (worker0, worker1), single = fit_runs
    # 36 examples in global batches of 8 = 5 steps per pass (the last one of 4), 2 passes.
    assert len(single["custom_losses"]) == 2 * 5
    for worker in (worker0, worker1):
        np.testing.assert_allclose(worker["custom_losses"], single["custom_losses"], atol=1e-6)
        for mine, reference in zip(worker["custom_weights"], single["custom_weights"]):
            np.testing.assert_allclose(mine, reference, atol=1e-6)


def test_a_task_that_does_not_train_cannot_build_the_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"], "evaluator": ["h3:2222"]},
        "task": {"type": "evaluator", "index": 0}}))
    with pytest.raises(ValueError, match="'evaluator':0, which does not train"):
        mirrax.MultiWorkerMirroredStrategy()


@pytest.mark.parametrize("task, message", [
    ({"type": "worker", "index": 2}, "task index 2 is out of range for job 'worker'"),
    ({"type": "master", "index": 0}, "unknown task type 'master'"),
])
def test_a_bad_task_is_refused_when_the_strategy_is_built(monkeypatch, task, message):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}, "task": task}))
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
        mirrax.CommunicationImplementation.RING)
    with pytest.raises(ValueError, match="timeout_seconds must be None or a number > 0"):
        mirrax.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        mirrax.CommunicationOptions(implementation="mpi")
    with pytest.raises(ValueError, match="NCCL needs GPUs"):
        mirrax.MultiWorkerMirroredStrategy(
            communication_options=mirrax.CommunicationOptions(implementation="NCCL"))
