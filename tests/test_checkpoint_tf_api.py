"""tf.train's checkpoint API (issue 26, items 3-5): `Checkpoint.save(prefix)` numbering and the
`checkpoint` state file, `write`, `mirrax.train.latest_checkpoint` / `checkpoints_iterator`,
`SidecarEvaluator`, the evaluator-only TF_CONFIG, a save killed part-way, and TF's multi-worker
pattern (tests/multiworker/checkpoints_tf.py) under 2 workers x 2 devices.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax._src import atomic_dirs
from tests.multiworker import harness

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _var(value):
    return nnx.Variable(jnp.asarray(value, jnp.float32))


def test_save_numbers_as_tf_and_latest_checkpoint_reads_the_state_file(tmp_path):
    w = _var(1.0)
    ckpt = mirrax.train.Checkpoint(w=w)
    first = ckpt.save(tmp_path / "ckpt")
    w[...] = 2.0
    second = ckpt.save(str(tmp_path / "ckpt"))
    assert (first, second) == (str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2"))
    assert ckpt.save_counter == 2
    # TF's text proto, paths relative to the directory.
    assert (tmp_path / "checkpoint").read_text() == (
        'model_checkpoint_path: "ckpt-2"\nall_model_checkpoint_paths: "ckpt-2"\n'
    )
    assert mirrax.train.latest_checkpoint(tmp_path) == second
    # write() writes exactly its path, leaves save_counter and the state file alone.
    w[...] = 3.0
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert ckpt.save_counter == 2 and mirrax.train.latest_checkpoint(tmp_path) == second
    # restore() brings save_counter back (the next save continues the numbering); read() not.
    fresh = mirrax.Checkpoint(w=_var(0.0))
    fresh.restore(first).assert_consumed()
    assert float(fresh.w[...]) == 1.0 and fresh.save_counter == 1
    assert fresh.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-2")  # 1 + 1, as TF's
    reader = mirrax.Checkpoint(w=_var(0.0))
    reader.read(tmp_path / "exact")
    assert float(reader.w[...]) == 3.0 and reader.save_counter == 0
    assert mirrax.train.Checkpoint is mirrax.Checkpoint
    assert mirrax.train.CheckpointManager is mirrax.CheckpointManager


def test_latest_checkpoint_of_a_manager_an_empty_and_a_missing_directory(tmp_path):
    assert mirrax.train.latest_checkpoint(tmp_path / "nowhere") is None  # as TF
    (tmp_path / "empty").mkdir()
    assert mirrax.train.latest_checkpoint(tmp_path / "empty") is None
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(w=_var(1.0)), tmp_path / "run")
    manager.save()
    manager.save()
    assert mirrax.train.latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "2")
    # A state file naming a checkpoint that is gone: None, as TF.
    path = mirrax.Checkpoint(w=_var(1.0)).save(tmp_path / "gone" / "ckpt")
    atomic_dirs.delete(path)
    assert mirrax.train.latest_checkpoint(tmp_path / "gone") is None


def test_bad_prefixes_and_directories_are_refused(tmp_path):
    ckpt = mirrax.Checkpoint(w=_var(1.0))
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match="received 123 of type int"):
        ckpt.save(123)
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="not a directory"):
        ckpt.save(str(tmp_path) + "/")
    with pytest.raises(mirrax.errors.InvalidArgumentError, match=r"os.path.join\(.*'ckpt'\)"):
        ckpt.save(tmp_path)
    assert ckpt.save_counter == 0  # nothing was saved
    (tmp_path / "f").write_text("x")
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="is a file, not a directory"):
        mirrax.train.latest_checkpoint(tmp_path / "f")
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match="checkpoint_dir must be"):
        mirrax.train.latest_checkpoint(None)
    with pytest.raises(mirrax.errors.MissingCheckpointError, match="no checkpoint directory"):
        ckpt.restore(tmp_path / "ckpt-7")
    for kwargs, match in (
        ({"min_interval_secs": -1}, "min_interval_secs must be"),
        ({"timeout": "5"}, "timeout must be"),
        ({"timeout_fn": 3}, "timeout_fn must be a function"),
    ):
        with pytest.raises(
            (mirrax.errors.InvalidArgumentError, mirrax.errors.InvalidArgumentTypeError), match=match
        ):
            mirrax.train.checkpoints_iterator(tmp_path, **kwargs)


def test_checkpoints_iterator_yields_each_new_one_and_stops_at_the_timeout(tmp_path):
    ckpt = mirrax.Checkpoint(w=_var(1.0))
    ckpt.save(tmp_path / "ckpt")
    assert list(mirrax.train.checkpoints_iterator(tmp_path, timeout=0)) == [str(tmp_path / "ckpt-1")]
    # timeout_fn: False keeps waiting, True stops (TF's rule); each call follows one timeout.
    calls = []
    seen = []
    for path in mirrax.train.checkpoints_iterator(
        tmp_path, timeout=0, timeout_fn=lambda: calls.append(1) or len(calls) == 2
    ):
        seen.append(path)
        if len(seen) == 1:
            ckpt.save(tmp_path / "ckpt")  # appears before the next poll
    assert seen == [str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2")] and len(calls) == 2


_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp
    from flax import nnx
    import mirrax
    from mirrax._src import atomic_dirs
    ckpt = mirrax.Checkpoint(w=nnx.Variable(jnp.asarray(1.0)))
    ckpt.save({prefix!r})
    ckpt.w[...] = 2.0
    real = atomic_dirs.rename
    def blocking(src, dst):
        if {point!r} in dst:
            print("BLOCKED", flush=True)
            sys.stdin.read()
        real(src, dst)
    atomic_dirs.rename = blocking
    ckpt.save({prefix!r})
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("point", ["ckpt-2", "checkpoint"])
def test_a_save_killed_before_its_commit_or_its_state_file_leaves_the_previous_latest(tmp_path, point):
    # "ckpt-2": the arrays are written (beside, as ckpt-2.mirrax-new), the rename into place
    # not done; "checkpoint": ckpt-2 is committed, the state file's rename not done.
    prefix = str(tmp_path / "ckpt")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(repo=_REPO, prefix=prefix, point=point)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([child.stdout], [], [], 120)
    assert ready and child.stdout.readline().strip() == "BLOCKED"
    child.send_signal(signal.SIGKILL)
    child.wait()
    latest = mirrax.train.latest_checkpoint(tmp_path)
    assert latest == prefix + "-1"
    restored = mirrax.Checkpoint(w=_var(0.0))
    restored.restore(latest).assert_consumed()
    assert float(restored.w[...]) == 1.0 and restored.save_counter == 1


def _model(seed=0):
    model = mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(seed)))
    model.compile(optax.sgd(0.1), loss="mse", metrics=["mae"])
    return model


def test_sidecar_evaluator_evaluates_each_checkpoint_and_stops_at_max_evaluations(tmp_path):
    x = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    y = np.array([[1.0], [2.0]], np.float32)
    trained = _model()
    ckpt = mirrax.train.Checkpoint(model=trained, optimizer=trained.optimizer.nnx_optimizer)
    seen = []

    class Record(mirrax.callbacks.Callback):
        def on_test_end(self, logs=None):
            seen.append(logs["loss"])

    for kernel in ([[1.0], [2.0]], [[0.0], [0.0]]):
        trained.module.kernel[...] = jnp.asarray(kernel)
        trained.module.bias[...] = jnp.zeros((1,))
        ckpt.save(tmp_path / "ckpt")
    evaluator = mirrax.SidecarEvaluator(
        _model(seed=3), data=[(x, y)], checkpoint_dir=tmp_path, max_evaluations=2, callbacks=[Record()]
    )
    # Only ckpt-2 is the latest when it starts (as TF's: superseded ones are skipped); its
    # kernel is 0: mse = (1 + 4) / 2 = 2.5.
    evaluator.start()
    assert seen == [pytest.approx(2.5)]
    np.testing.assert_array_equal(np.asarray(evaluator.model.module.kernel[...]), [[0.0], [0.0]])


def test_sidecar_evaluator_bad_input(tmp_path):
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match=r"mirrax.Model\(keras_model"):
        mirrax.SidecarEvaluator(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), None, tmp_path)
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="max_evaluations must be"):
        mirrax.SidecarEvaluator(_model(), None, tmp_path, max_evaluations=0)
    mirrax.Checkpoint(step=1).save(tmp_path / "ckpt")
    with pytest.raises(mirrax.errors.IncompatibleCheckpointError, match="holds no model"):
        mirrax.SidecarEvaluator(_model(), None, tmp_path, max_evaluations=1).start()


def test_an_evaluator_only_tf_config_is_accepted_and_the_strategy_refuses_it():
    config = '{"cluster": {"evaluator": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}'
    resolver = mirrax.TFConfigClusterResolver(tf_config=config)
    assert (resolver.task_type, resolver.worker_index, resolver.is_chief) == ("evaluator", None, False)
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="SidecarEvaluator"):
        mirrax.MultiWorkerMirroredStrategy(cluster_resolver=resolver)


@pytest.mark.subprocess
def test_tf_multi_worker_checkpoint_pattern(tmp_path):
    chief, worker = harness.run("checkpoints_tf", tmp_path, num_workers=2, cpu_devices=2)
    ckpt = str(tmp_path / "ckpt")
    assert (chief["chief"], worker["chief"]) == (True, False)
    for r in (chief, worker):
        assert r["latest_before"] is None
        # Item 4: saved before any step; the marker holds worker 0's value on every worker.
        assert r["untouched_path"] == os.path.join(ckpt, "1") and r["untouched_marker"] == 0.0
        # Item 3: the non-chief cleanup deleted only its stub.
        assert r["chief_dir_after_cleanup"] == ["1"]
        assert [n for n in r["chief_dir_after_training"] if not n.startswith(".")] == ["3"]
        assert r["latest_after_training"] == os.path.join(ckpt, "3")
        # The resume path: restored on every worker, nothing left, saved again.
        assert r["restored"] == r["trained"] == chief["trained"] and r["restored_epoch"] == 2
        assert r["resumed_path"] == os.path.join(ckpt, "4")
        assert r["saved_latest"] == str(tmp_path / "saved" / "ckpt-1")
        assert "worker process 1 saves to" in r["inside_refused"]
        assert "a_file is a file" in r["file_refused"]
    assert chief["own_dir_after_save"] != ["MIRRAX_CHIEF_CHECKPOINT.txt"]
    assert worker["own_dir_after_save"] == ["MIRRAX_CHIEF_CHECKPOINT.txt"]
    assert "is a non-chief worker's stub" in worker["stub_refused"] and ckpt in worker["stub_refused"]
    assert worker["prefix_path"] == str(tmp_path / "saved" / "workertemp_1" / "ckpt-1")
    assert worker["file_refused"].startswith(
        "InvalidArgumentError: Checkpoint.write: worker process 0 refused its save"
    )
    assert not (tmp_path / "workertemp_1").joinpath("ckpt").exists()
    # A prefix refused on worker 1 only (Checkpoint.save's check ran before the path exchange,
    # so the chief waited there): refused on both workers, then both save again.
    assert worker["prefix_refused"].startswith(
        "InvalidArgumentError: Checkpoint.save: file_prefix must be a path prefix inside a "
        "directory, not a directory"
    )
    assert chief["prefix_refused"].startswith(
        "InvalidArgumentError: Checkpoint.save: worker process 1 refused its save, so no worker "
        "saved: InvalidArgumentError: Checkpoint.save: file_prefix must be a path prefix"
    )
    assert chief["after_refusal"] == str(tmp_path / "after" / "ckpt")
    assert (tmp_path / "after" / "ckpt" / "_CHECKPOINT_METADATA").exists()
