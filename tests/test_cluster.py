"""Cluster resolution (issue 5, the part testable without jax.distributed): ClusterSpec, the
TF_CONFIG / SLURM / explicit resolvers, and the training-task facts a multi-worker strategy uses.
"""

import json
import re

import pytest

import mirrax

# The issue's test 1: a chief, two workers and an evaluator; this task is worker 1.
ISSUE_CONFIG = {
    "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "evaluator": ["h3:2222"]},
    "task": {"type": "worker", "index": 1},
}


def test_issue_config_from_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(ISSUE_CONFIG))
    resolver = mirrax.TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    # Training tasks: chief + 2 workers = 3; the evaluator does not train.
    assert resolver.num_workers == 3
    # Order chief, worker 0, worker 1: worker 1 is the third task, index 2.
    assert resolver.worker_index == 2
    assert resolver.is_chief is False
    assert resolver.coordinator_address == "h0:2222"
    assert resolver.num_input_pipelines == 3
    assert resolver.input_pipeline_id == 2
    # With 2 devices per task: 3 tasks * 2 = 6 replicas; 48 / 6 = 8 per replica, 2 replicas
    # per worker -> 16 examples per worker.
    context = mirrax.InputContext(
        resolver.num_input_pipelines, resolver.input_pipeline_id, resolver.num_workers * 2
    )
    assert context.num_replicas_in_sync == 6
    assert context.get_per_replica_batch_size(48) == 8
    assert context.get_per_replica_batch_size(48) * 2 == 16


def test_every_task_of_the_issue_config():
    def resolve(task_type, index):
        config = dict(ISSUE_CONFIG, task={"type": task_type, "index": index})
        return mirrax.TFConfigClusterResolver(tf_config=json.dumps(config))

    chief = resolve("chief", 0)
    assert (chief.worker_index, chief.is_chief) == (0, True)
    assert (resolve("worker", 0).worker_index, resolve("worker", 0).is_chief) == (1, False)
    evaluator = resolve("evaluator", 0)
    assert (evaluator.worker_index, evaluator.is_chief, evaluator.num_workers) == (None, False, 3)


def test_no_chief_key_makes_worker_0_the_chief():
    config = {"cluster": {"worker": ["h1:2222", "h2:2222"]}, "task": {"type": "worker", "index": 0}}
    resolver = mirrax.TFConfigClusterResolver(tf_config=config)
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (2, 0, True)
    assert resolver.coordinator_address == "h1:2222"
    other = mirrax.TFConfigClusterResolver(tf_config=dict(config, task={"type": "worker", "index": 1}))
    assert (other.worker_index, other.is_chief) == (1, False)


def test_arguments_override_tf_config_and_rpc_layer():
    config = dict(ISSUE_CONFIG, rpc_layer="grpc")
    resolver = mirrax.TFConfigClusterResolver(task_type="chief", task_id=0, tf_config=config)
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")
    assert resolver.master() == "grpc://h0:2222"
    assert resolver.master("worker", 1) == "grpc://h2:2222"
    assert resolver.cluster_spec().as_dict() == ISSUE_CONFIG["cluster"]


@pytest.mark.parametrize(
    "task, match",
    [
        ({"type": "worker", "index": 2}, r"task index 2 is out of range for job 'worker'.*\[0, 1\]"),
        ({"type": "worker", "index": -1}, "task index -1 is out of range"),
        ({"type": "trainer", "index": 0}, r"unknown task type 'trainer'.*\['chief', 'evaluator'"),
        ({"type": "worker", "index": "1"}, r"task 'index' must be an int.*received '1'"),
        ({"type": 3, "index": 0}, r"task 'type' must be a string"),
        ({}, "this task's type and index are not set"),
    ],
)
def test_bad_task_raises_on_construction(task, match):
    with pytest.raises(ValueError, match=match):
        mirrax.TFConfigClusterResolver(tf_config=dict(ISSUE_CONFIG, task=task))


@pytest.mark.parametrize(
    "tf_config, match",
    [
        ('{"cluster": {"worker": ["h1:2222"]', "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (
            '{"cluster": {"worker": "h1:2222"}, "task": {"type": "worker", "index": 0}}',
            "job 'worker' must be a list",
        ),
        (
            '{"cluster": {"worker": ["h1"]}, "task": {"type": "worker", "index": 0}}',
            r"'host:port' string address; received 'h1'",
        ),
        (
            '{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}',
            "at most one 'chief'",
        ),
        (
            '{"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}}',
            r"unknown job names \['master'\]",
        ),
        ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "no training task"),
    ],
)
def test_malformed_tf_config_raises(tf_config, match):
    with pytest.raises(ValueError, match=match):
        mirrax.TFConfigClusterResolver(tf_config=tf_config)


def test_missing_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        mirrax.TFConfigClusterResolver(required=True)
    # Not required: one local task, the chief, with no coordinator.
    local = mirrax.TFConfigClusterResolver()
    assert not local.cluster_spec()
    assert (local.num_workers, local.worker_index, local.is_chief) == (1, 0, True)
    assert (local.coordinator_address, local.master()) == (None, "")


def test_cluster_spec():
    spec = mirrax.ClusterSpec({"worker": ["a:1", "b:1"], "ps": {3: "c:1"}})
    assert spec.jobs == ["ps", "worker"]
    assert (spec.num_tasks("worker"), spec.num_tasks("ps")) == (2, 1)
    assert spec.task_address("worker", 1) == "b:1"
    assert spec.task_indices("ps") == [3]
    assert spec.as_dict() == {"worker": ["a:1", "b:1"], "ps": {3: "c:1"}}
    assert mirrax.ClusterSpec(spec) == spec
    with pytest.raises(ValueError, match=r"no job named 'chief'.*\['ps', 'worker'\]"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match=r"job 'ps' has no task with index 0.*\[3\]"):
        spec.task_address("ps", 0)


def test_sparse_job_in_tf_config_json():
    tf_config = '{"cluster": {"worker": {"1": "b:1", "0": "a:1"}}, "task": {"type": "worker", "index": 1}}'
    resolver = mirrax.TFConfigClusterResolver(tf_config=tf_config)
    assert resolver.cluster_spec().as_dict() == {"worker": ["a:1", "b:1"]}
    assert resolver.worker_index == 1


def test_simple_cluster_resolver():
    resolver = mirrax.SimpleClusterResolver({"chief": ["c:1"], "worker": ["w:1"]}, "worker", 0)
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (2, 1, False)
    assert resolver.coordinator_address == "c:1"
    with pytest.raises(ValueError, match="task index 1 is out of range for job 'worker'"):
        mirrax.SimpleClusterResolver({"worker": ["w:1"]}, "worker", 1)
    with pytest.raises(ValueError, match="unknown task type 'chief'"):
        mirrax.SimpleClusterResolver({"worker": ["w:1"]}, "chief", 0)


def test_slurm_one_task_per_node():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[01-03,07]"}
    resolver = mirrax.SlurmClusterResolver(port=9000, environ=env)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["node01:9000", "node02:9000", "node03:9000", "node07:9000"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (4, 2, False)
    assert resolver.coordinator_address == "node01:9000"
    chief = mirrax.SlurmClusterResolver(port=9000, environ=dict(env, SLURM_PROCID="0"))
    assert chief.is_chief is True


def test_slurm_several_tasks_per_node_and_step_nodelist_first():
    # 3 tasks: 2 on a1, 1 on b; the k-th task on a node gets port + k.
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "3",
        "SLURM_JOB_NODELIST": "ignored[1-9]",
        "SLURM_STEP_NODELIST": "a1,b",
        "SLURM_TASKS_PER_NODE": "2,1",
    }
    resolver = mirrax.SlurmClusterResolver(port=8888, environ=env)
    assert resolver.cluster_spec().as_dict() == {"worker": ["a1:8888", "a1:8889", "b:8888"]}
    # 4 tasks evenly on 2 nodes, "2(x2)" or no per-node variable alike.
    even = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[8-9]"}
    expected = {"worker": ["n8:1000", "n8:1001", "n9:1000", "n9:1001"]}
    assert mirrax.SlurmClusterResolver(1000, environ=even).cluster_spec().as_dict() == expected
    spelled = dict(even, SLURM_TASKS_PER_NODE="2(x2)")
    assert mirrax.SlurmClusterResolver(1000, environ=spelled).cluster_spec().as_dict() == expected


@pytest.mark.parametrize(
    "env, match",
    [
        ({}, r"SLURM variables \['SLURM_PROCID', 'SLURM_NTASKS', .*srun"),
        (
            {"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-4]"},
            "task index 4 is out of range for job 'worker'",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-2]"},
            "3 tasks do not fit the 2 nodes",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n[1-2"},
            "unbalanced or nested brackets",
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n[3-1]"}, "malformed range '3-1'"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}, "must be integers"),
    ],
)
def test_slurm_errors(env, match):
    with pytest.raises(ValueError, match=match):
        mirrax.SlurmClusterResolver(environ=env)


@pytest.mark.parametrize(
    "cluster, message",
    [
        ({"worker": ["127.0.0.1:99999"]}, "has port 99999 in '127.0.0.1:99999'; a TCP port is in"),
        ({"worker": ["h:1", "h:1"]}, "worker:0 and worker:1 have the same address 'h:1'"),
        ({"chief": ["h:1"], "worker": ["h:1"]}, "chief:0 and worker:0 have the same address 'h:1'"),
    ],
)
def test_bad_ports_and_shared_addresses_are_refused(cluster, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mirrax.ClusterSpec(cluster)
