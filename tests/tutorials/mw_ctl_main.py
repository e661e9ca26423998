"""Worker program of the multi_worker_with_ctl port (its "Complete code at a glance" main.py),
run in every worker by `mirrax launch` from tests/tutorials/test_tutorial_multi_worker_with_ctl.py.

    python -m tests.tutorials.mw_ctl_main OUT_DIR CHECKPOINT_BASE

Each notebook section is one function; the worker writes its outcomes to OUT_DIR/<task
index>.json after each (tests/tutorials/sections.py). Translation: see the test module's
docstring. `checkpoint_dir` is `os.path.join(CHECKPOINT_BASE, "ckpt")`, as the notebook's
`os.path.join(util.get_temp_dir(), 'ckpt')` (a directory both workers see).
"""

import json
import os
import shutil
import sys
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import mirrax  # noqa: E402
from tests.tutorials import sections  # noqa: E402

tutorial = sections.Tutorial()
PER_WORKER_BATCH_SIZE = 16  # 64 in the notebook
NUM_EPOCHS, NUM_STEPS_PER_EPOCH = 3, 5  # 3 and 70 in the notebook


# -- mnist.py -----------------------------------------------------------------------------------


def mnist_dataset(batch_size):
    (x_train, y_train), _ = mirrax.data.load_digits()
    x_train = x_train[..., 0]  # (N, 8, 8) as MNIST's (N, 28, 28); already in [0, 1]
    y_train = y_train.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x_train))  # .shuffle(60000)
    return x_train[order], y_train[order]


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x, y = mnist_dataset(batch_size)
    # .shard(num_input_pipelines, input_pipeline_id)
    x = x[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    y = y[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def build_cnn_model():
    regularizer = keras.regularizers.L2(1e-5)
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8)),
            keras.layers.Reshape(target_shape=(8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Dense(10, kernel_regularizer=regularizer),
        ]
    )


def weight_sums(model):
    return [float(np.abs(np.asarray(w)).sum()) for w in model.get_weights()]


# -- the sections -------------------------------------------------------------------------------


@tutorial.section
def dataset_and_model_definition(ns):
    x, y = mnist_dataset(PER_WORKER_BATCH_SIZE)
    # (mnist.py only defines its functions: JAX must not start before the strategy joins.)
    return {"x": list(x.shape), "y": [list(y.shape), str(y.dtype)]}


@tutorial.section
def describe_your_cluster(ns):
    ns.tf_config = json.loads(os.environ["TF_CONFIG"])
    ns.num_workers = len(ns.tf_config["cluster"]["worker"])
    return {"num_workers": ns.num_workers, "task": ns.tf_config["task"]}


@tutorial.section
def multiworkermirroredstrategy(ns):
    ns.strategy = mirrax.MultiWorkerMirroredStrategy()
    with ns.strategy.scope():
        # Model building needs to be within `strategy.scope()`.
        ns.multi_worker_model = mirrax.Model(build_cnn_model())
    return {
        "replicas": ns.strategy.num_replicas_in_sync,
        "processes": jax.process_count(),
        "params": ns.multi_worker_model.count_params(),
    }


@tutorial.section
def auto_shard_your_data_across_workers(ns):
    ns.global_batch_size = PER_WORKER_BATCH_SIZE * ns.num_workers
    with ns.strategy.scope():
        ns.multi_worker_dataset = ns.strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(ns.global_batch_size, input_context)
        )
    x, y = next(iter(ns.multi_worker_dataset))
    local = ns.strategy.experimental_local_results(y)
    return {
        "global_batch_size": ns.global_batch_size,
        "local_shards": [int(np.asarray(v).shape[0]) for v in local],
    }


@tutorial.section
def define_a_custom_training_loop_and_train_the_model(ns):
    strategy, multi_worker_model = ns.strategy, ns.multi_worker_model
    with strategy.scope():
        # The optimizer and train_accuracy create variables: built under the scope too.
        # A Keras optimizer in a custom loop: the documented one-line translation.
        optimizer = mirrax.KerasOptimizer(multi_worker_model, keras.optimizers.RMSprop(learning_rate=0.001))
        train_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    ns.optimizer, ns.train_accuracy = optimizer, train_accuracy
    before = weight_sums(multi_worker_model)

    @mirrax.function  # @tf.function
    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs

            def loss_fn(multi_worker_model):  # tf.GradientTape -> value_and_grad
                predictions = multi_worker_model(x, training=True)
                per_example_loss = keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=None
                )(y, predictions)
                loss = mirrax.compute_average_loss(per_example_loss)
                model_losses = multi_worker_model.losses
                if model_losses:
                    loss += mirrax.scale_regularization_loss(sum(model_losses))
                return loss, predictions

            # The documented translation (docs/training.md, "Custom training loops with Keras
            # models"): JAX differentiates the model's NNX module; the gradients come back as
            # NNX state shaped like it, its leaves in trainable_variables' order.
            (loss, predictions), grads = mirrax.value_and_grad(loss_fn, has_aux=True)(
                multi_worker_model.module
            )
            optimizer.apply_gradients(zip(jax.tree.leaves(grads), multi_worker_model.trainable_variables))
            train_accuracy.update_state(y, predictions)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None)

    ns.train_step = train_step
    loss = float(train_step(iter(ns.multi_worker_dataset)))  # one step, to check it runs
    return {"loss": loss, "weights_before": before, "weights_after": weight_sums(multi_worker_model)}


def _is_chief(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def make_checkpoint(ns, model):
    """The notebook's epoch / step_in_epoch variables, Checkpoint and CheckpointManager."""
    epoch = nnx.Variable(jnp.asarray(0, jnp.int64 if jax.config.x64_enabled else jnp.int32))
    step_in_epoch = nnx.Variable(jnp.zeros_like(epoch.value))
    resolver = ns.strategy.cluster_resolver
    task_type, task_id, cluster_spec = (resolver.task_type, resolver.task_id, resolver.cluster_spec())
    checkpoint = mirrax.train.Checkpoint(model=model, epoch=epoch, step_in_epoch=step_in_epoch)
    write_checkpoint_dir = write_filepath(ns.checkpoint_dir, task_type, task_id, cluster_spec)
    checkpoint_manager = mirrax.train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1
    )
    return types.SimpleNamespace(
        epoch=epoch,
        step_in_epoch=step_in_epoch,
        task_type=task_type,
        task_id=task_id,
        cluster_spec=cluster_spec,
        checkpoint=checkpoint,
        manager=checkpoint_manager,
        write_checkpoint_dir=write_checkpoint_dir,
    )


def train(ns, state):
    """The notebook's resumable training loop; the epochs it ran and their printed numbers."""
    printed = []
    while int(state.epoch.value) < NUM_EPOCHS:
        iterator = iter(ns.multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0
        while int(state.step_in_epoch.value) < NUM_STEPS_PER_EPOCH:
            total_loss += ns.train_step(iterator)
            num_batches += 1
            state.step_in_epoch.value = state.step_in_epoch.value + 1  # assign_add(1)
        train_loss = total_loss / num_batches
        printed.append([int(state.epoch.value), float(ns.train_accuracy.result()), float(train_loss)])
        ns.train_accuracy.reset_states()
        # Save, and remove the checkpoints non-chief workers saved.
        state.manager.save()
        if not _is_chief(state.task_type, state.task_id, state.cluster_spec):
            shutil.rmtree(state.write_checkpoint_dir)  # tf.io.gfile.rmtree
        state.epoch.value = state.epoch.value + 1
        state.step_in_epoch.value = jnp.zeros_like(state.step_in_epoch.value)  # assign(0)
    return printed


@tutorial.section
def checkpoint_saving_and_restoring(ns):
    ns.state = make_checkpoint(ns, ns.multi_worker_model)
    latest_checkpoint = mirrax.train.latest_checkpoint(ns.checkpoint_dir)
    if latest_checkpoint:
        ns.state.checkpoint.restore(latest_checkpoint)
    printed = train(ns, ns.state)
    return {
        "latest_before": latest_checkpoint,
        "printed": printed,
        "weights": weight_sums(ns.multi_worker_model),
        "latest_after": mirrax.train.latest_checkpoint(ns.checkpoint_dir),
        "chief_dir": sorted(os.listdir(ns.checkpoint_dir)),
        # What the tutorial's tf.io.gfile.rmtree(write_checkpoint_dir) deleted (it leaves the
        # empty workertemp_<i> that _get_temp_dir made, as TF's does).
        "workertemp_left": os.path.exists(ns.state.write_checkpoint_dir)
        and not _is_chief(ns.state.task_type, ns.state.task_id, ns.state.cluster_spec),
    }


@tutorial.section
def complete_code_at_a_glance(ns):
    # main.py started again (a restarted worker): a fresh model restores the latest
    # checkpoint. The notebook's loop saves BEFORE epoch.assign_add(1), so the last checkpoint
    # holds epoch 2 with all 5 of its steps done: the loop enters epoch 2, runs no step and
    # divides 0.0 by num_batches = 0, a ZeroDivisionError in TF's code as here.
    with ns.strategy.scope():
        restarted_model = mirrax.Model(build_cnn_model())
    state = make_checkpoint(ns, restarted_model)
    latest_checkpoint = mirrax.train.latest_checkpoint(ns.checkpoint_dir)
    if latest_checkpoint:
        state.checkpoint.restore(latest_checkpoint)
    restored = {"epoch": int(state.epoch[...]), "step_in_epoch": int(state.step_in_epoch[...])}
    try:
        printed, error = train(ns, state), None
    except ZeroDivisionError as e:
        printed, error = None, f"{type(e).__name__}: {e}"
    return {
        "latest": latest_checkpoint,
        "restored": restored,
        "printed": printed,
        "error": error,
        "weights": weight_sums(restarted_model),
    }


def main(out_dir, checkpoint_base):
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    ns = types.SimpleNamespace(checkpoint_dir=os.path.join(checkpoint_base, "ckpt"))
    tutorial.run_all(ns, on_result=lambda outcomes: sections.write(out_dir, index, outcomes))


if __name__ == "__main__":
    main(*sys.argv[1:3])
