"""Worker program of the multi_worker_with_keras port (the notebook's main.py and the in-depth
sections that follow it), run in every worker by `mirrax launch` from
tests/tutorials/test_tutorial_multi_worker_with_keras.py.

    python -m tests.tutorials.mw_keras_main OUT_DIR WORK_DIR

Each notebook section is one function; the worker writes its outcomes to OUT_DIR/<task
index>.json after each (tests/tutorials/sections.py). Translation: see the test module's
docstring. The notebook's /tmp paths are under WORK_DIR (a directory both workers see).
"""

import json
import os
import shutil
import sys
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mirrax  # noqa: E402
from mirrax import callbacks as mirrax_callbacks  # noqa: E402
from tests.tutorials import sections  # noqa: E402

tutorial = sections.Tutorial()
PER_WORKER_BATCH_SIZE = 16  # 64 in the notebook
EPOCHS, STEPS_PER_EPOCH = 3, 5  # 3 and 70 in the notebook


# -- mnist_setup.py -----------------------------------------------------------------------------


def mnist_dataset(batch_size):
    (x_train, y_train), _ = mirrax.data.load_digits()
    x_train = x_train[..., 0]  # (N, 8, 8) as MNIST's (N, 28, 28); already in [0, 1]
    y_train = y_train.astype(np.int64)

    def batches():  # .shuffle(60000).repeat().batch(batch_size); the same seed on every worker
        rng = np.random.default_rng(0)
        while True:
            order = rng.permutation(len(x_train))
            for i in range(0, len(order) - batch_size + 1, batch_size):
                yield x_train[order[i : i + batch_size]], y_train[order[i : i + batch_size]]

    return batches()


def build_and_compile_cnn_model():
    model = mirrax.Model(
        keras.Sequential(
            [
                keras.layers.InputLayer(shape=(8, 8)),  # Keras 3's name for input_shape
                keras.layers.Reshape(target_shape=(8, 8, 1)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model


def weight_sums(model):
    return [float(np.abs(np.asarray(w)).sum()) for w in model.get_weights()]


def fit_logs(history):
    return {k: [float(v) for v in values] for k, values in history.history.items()}


# -- the sections -------------------------------------------------------------------------------


@tutorial.section
def a_cluster_with_jobs_and_tasks(ns):
    tf_config = json.loads(os.environ["TF_CONFIG"])
    ns.num_workers = len(tf_config["cluster"]["worker"])
    return {"num_workers": ns.num_workers, "task": tf_config["task"]}


@tutorial.section
def train_the_model(ns):
    ns.strategy = mirrax.MultiWorkerMirroredStrategy()
    global_batch_size = PER_WORKER_BATCH_SIZE * ns.num_workers
    ns.multi_worker_dataset = mnist_dataset(global_batch_size)
    with ns.strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        ns.multi_worker_model = build_and_compile_cnn_model()
    history = ns.multi_worker_model.fit(
        ns.multi_worker_dataset, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0
    )
    return {
        "replicas": ns.strategy.num_replicas_in_sync,
        "history": fit_logs(history),
        "weights": weight_sums(ns.multi_worker_model),
    }


@tutorial.section
def dataset_sharding(ns):
    options = mirrax.InputOptions(experimental_auto_shard_policy=mirrax.AutoShardPolicy.OFF)
    multi_worker_dataset = mnist_dataset(batch_size=64)
    dataset_no_auto_shard = ns.strategy.experimental_distribute_dataset(multi_worker_dataset, options)
    _, labels = next(iter(dataset_no_auto_shard))
    local = [np.asarray(v).tolist() for v in ns.strategy.experimental_local_results(labels)]
    return {"local_labels": local}


def _is_chief(task_type, task_id):
    # Only `worker` tasks here: worker 0 is the chief (task_type None: a single worker).
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


@tutorial.section
def model_saving_and_loading(ns):
    # Keras 3 saves to a ".keras" file (the notebook's SavedModel directory /tmp/keras-model).
    model_path = os.path.join(ns.work_dir, "keras-model.keras")
    ns.task_type, ns.task_id = (ns.strategy.cluster_resolver.task_type, ns.strategy.cluster_resolver.task_id)
    write_model_path = write_filepath(model_path, ns.task_type, ns.task_id)
    ns.multi_worker_model.save(write_model_path)
    if not _is_chief(ns.task_type, ns.task_id):
        shutil.rmtree(os.path.dirname(write_model_path))  # tf.io.gfile.rmtree
    loaded_model = mirrax.models.load_model(model_path)
    loaded_weights = weight_sums(loaded_model)
    # Now that the model is restored, and can continue with the training.
    single_worker_dataset = mnist_dataset(PER_WORKER_BATCH_SIZE)
    history = loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=3, verbose=0)
    return {
        "loaded_weights": loaded_weights,
        "history": fit_logs(history),
        "loaded_replicas": loaded_model.distribute_strategy.num_replicas_in_sync,
        "chief_file": os.path.exists(model_path),
    }


@tutorial.section
def checkpoint_saving_and_restoring(ns):
    checkpoint_dir = os.path.join(ns.work_dir, "ckpt")
    checkpoint = mirrax.train.Checkpoint(model=ns.multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, ns.task_type, ns.task_id)
    checkpoint_manager = mirrax.train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1
    )
    checkpoint_manager.save()
    if not _is_chief(ns.task_type, ns.task_id):
        shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree
    saved = weight_sums(ns.multi_worker_model)
    latest_checkpoint = mirrax.train.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    restored = weight_sums(ns.multi_worker_model)
    history = ns.multi_worker_model.fit(ns.multi_worker_dataset, epochs=2, steps_per_epoch=3, verbose=0)
    return {
        "latest": latest_checkpoint and os.path.relpath(latest_checkpoint, ns.work_dir),
        "saved": saved,
        "restored": restored,
        "history": fit_logs(history),
    }


@tutorial.section
def the_backupandrestore_callback(ns):
    runs = []
    # The notebook's first cell (save_freq "epoch", the default). Its second (the same again)
    # and third (save_freq=30) are not repeated: each run compiles a new model, ~9 s here, and
    # tests/test_checkpoint_callbacks.py covers an int save_freq.
    for save_freq in ("epoch",):
        callbacks = [
            mirrax_callbacks.BackupAndRestore(
                backup_dir=os.path.join(ns.work_dir, "backup"), save_freq=save_freq
            )
        ]
        with ns.strategy.scope():
            multi_worker_model = build_and_compile_cnn_model()
        history = multi_worker_model.fit(
            ns.multi_worker_dataset,
            epochs=EPOCHS,
            steps_per_epoch=STEPS_PER_EPOCH,
            callbacks=callbacks,
            verbose=0,
        )
        runs.append({"epochs": len(history.history["loss"]), "weights": weight_sums(multi_worker_model)})
    return {"runs": runs, "backup_left": os.path.exists(os.path.join(ns.work_dir, "backup"))}


def main(out_dir, work_dir):
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    ns = types.SimpleNamespace(work_dir=work_dir)
    tutorial.run_all(ns, on_result=lambda outcomes: sections.write(out_dir, index, outcomes))


if __name__ == "__main__":
    main(*sys.argv[1:3])
