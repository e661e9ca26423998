"""Port of tensorflow/docs site/en/tutorials/distribute/multi_worker_with_ctl.ipynb ("Custom
training loop with Keras and MultiWorkerMirroredStrategy"), as a TF user would port it.

The notebook's main.py is tests/tutorials/mw_ctl_main.py, run ONCE for the module under
`mirrax launch --nproc 2 --cpu-devices 2` (2 workers x 2 CPU devices = 4 replicas, in place of
the notebook's two `python main.py` with their TF_CONFIG); each test reads one section's
outcome on both workers. Translation (mechanical): `tf.distribute.X` -> `mirrax.X`,
`tf.nn.compute_average_loss` -> `mirrax.`; tf.keras layers, losses and optimizers -> Keras 3 on
JAX, the model wrapped in `mirrax.Model`; `tf.keras.metrics` -> `mirrax.metrics`;
the steps as docs/training.md translates them for Keras models ("Custom training
loops with Keras models": `mirrax.KerasOptimizer(model, keras_optimizer)`, `tf.GradientTape` ->
`mirrax.value_and_grad(loss_fn)(model.module)`, `zip(jax.tree.leaves(grads), ...)`);
`@tf.function` -> `@mirrax.function` (its `next(iterator)` inside); `tf.Variable` ->
`nnx.Variable` (`assign_add(1)` -> `.value = .value + 1`); `tf.train.*` -> `mirrax.train.*`;
`tf.io.gfile` -> `os` / `shutil`; MNIST -> the bundled digits as (N, 8, 8) images; 16 examples
per worker and 5 steps per epoch instead of 64 and 70.

Sections (8, 7 ported): dataset and model definition, describe your cluster,
MultiWorkerMirroredStrategy, auto-shard your data across workers, define a custom training loop
and train the model, checkpoint saving and restoring, complete code at a glance (the restarted
main.py: it restores epoch 2 with its steps done, and the notebook's loop then divides by zero,
in TF as here). Not ported: "Environment variables and subprocesses
in notebooks" (shell magics only).
"""

import os

import pytest

from tests.tutorials import launch, sections

pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("tutorial_mw_ctl")]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("mw_ctl")
    base = tmp_path_factory.mktemp("mw_ctl_checkpoints")
    outcomes, output = launch.launch("tests.tutorials.mw_ctl_main", out_dir, base)
    return outcomes, output


def both(workers, name):
    """The section's values on worker 0 and worker 1 (the launcher's output when one failed)."""
    outcomes, output = workers
    try:
        return [sections.result(worker, name) for worker in outcomes]
    except sections.SectionError as e:
        raise sections.SectionError(f"{e}\n--- launcher output\n{output}") from None


def test_dataset_and_model_definition(workers):
    first, second = both(workers, "dataset_and_model_definition")
    # 1437 digits of 8 x 8, int64 labels as the notebook's astype(np.int64).
    assert first == second == {"x": [1437, 8, 8], "y": [[1437], "int64"]}


def test_describe_your_cluster(workers):
    first, second = both(workers, "describe_your_cluster")
    assert first["num_workers"] == second["num_workers"] == 2
    assert [first["task"], second["task"]] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]


def test_multiworkermirroredstrategy(workers):
    # 2 workers x 2 devices; the model's parameters: conv 32 * (3 * 3 + 1) = 320, dense
    # 6 * 6 * 32 * 128 + 128 = 147584, output 128 * 10 + 10 = 1290: 149194.
    assert (
        both(workers, "multiworkermirroredstrategy")
        == [{"replicas": 4, "processes": 2, "params": 149194}] * 2
    )


def test_auto_shard_your_data_across_workers(workers):
    # 16 per worker x 2 workers = 32 per global batch: 32 / 4 replicas = 8 for each of a
    # worker's 2 local replicas.
    assert (
        both(workers, "auto_shard_your_data_across_workers")
        == [{"global_batch_size": 32, "local_shards": [8, 8]}] * 2
    )


def test_define_a_custom_training_loop_and_train_the_model(workers):
    first, second = both(workers, "define_a_custom_training_loop_and_train_the_model")
    # The all-reduced loss is the same on both workers; so are the weights, before the step
    # (broadcast from worker 0 at the strategy's first use) and after it.
    assert first["loss"] == second["loss"]
    assert first["weights_after"] == second["weights_after"]
    assert first["weights_after"] != first["weights_before"]


def test_checkpoint_saving_and_restoring(workers):
    first, second = both(workers, "checkpoint_saving_and_restoring")
    assert first["latest_before"] is None and second["latest_before"] is None
    # The notebook's printed lines: 3 epochs (0, 1, 2) on each worker with the same numbers;
    # the loss falls from the first epoch to the last.
    assert [p[0] for p in first["printed"]] == [0, 1, 2]
    assert first["printed"] == second["printed"]
    assert first["printed"][-1][2] < first["printed"][0][2]
    assert first["weights"] == second["weights"]
    # The chief's directory holds the one checkpoint kept (max_to_keep=1): number 3, the
    # manager's third save; worker 1's temporary copy (workertemp_1/ckpt) is gone and deleting
    # it took nothing of the chief's.
    assert first["latest_after"] == second["latest_after"]
    assert first["latest_after"].endswith(os.path.join("ckpt", "3"))
    assert "3" in first["chief_dir"]
    assert second["workertemp_left"] is False


def test_complete_code_at_a_glance(workers):
    trained = both(workers, "checkpoint_saving_and_restoring")
    first, second = both(workers, "complete_code_at_a_glance")
    # Both workers restore the chief's checkpoint 3, saved in epoch 2 after its 5 steps and
    # before epoch.assign_add(1) (the notebook's order): epoch 2, step_in_epoch 5.
    assert first["latest"] == second["latest"] == trained[0]["latest_after"]
    assert first["restored"] == second["restored"] == {"epoch": 2, "step_in_epoch": 5}
    assert first["weights"] == trained[0]["weights"] == second["weights"]
    # The notebook's loop then runs no step in epoch 2 and computes total_loss / num_batches =
    # 0.0 / 0: TF's code raises the same ZeroDivisionError (a bug of the tutorial, not mirrax's).
    assert first["error"] == second["error"] == "ZeroDivisionError: float division by zero"
