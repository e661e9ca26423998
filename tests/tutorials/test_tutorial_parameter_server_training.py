"""Port of tensorflow/docs site/en/tutorials/distribute/parameter_server_training.ipynb
("Parameter server training with ParameterServerStrategy"), as a TF user would port it, on a
local Ray cluster started by this module (as tests/test_parameter_server_ray.py does).

Translation (mechanical): `tf.distribute.X` -> `mirrax.X`; the in-process TF servers
(`create_in_process_cluster`) -> `mirrax.RayClusterResolver(num_workers, num_ps)` (2 workers
instead of 3, for time; 2 parameter servers); tf.keras layers, losses and optimizers -> Keras 3
on JAX (`optimizers.legacy.X` -> `optimizers.X`), models wrapped in `mirrax.Model`;
`tf.keras.metrics` -> `mirrax.metrics`; `tf.keras.callbacks` -> `mirrax.callbacks`;
the steps as docs/training.md translates them for Keras models ("Custom training
loops with Keras models": `mirrax.KerasOptimizer(model, keras_optimizer)`, `tf.GradientTape` ->
`mirrax.value_and_grad(loss_fn)(model.module)`, `zip(jax.tree.leaves(grads), ...)`);
`@tf.function` dropped; `tf.reduce_mean` ->
`keras.ops.mean`; tf.data pipelines -> functions that make a generator of batches (a tf.data
dataset is a description each worker builds: mirrax's workers call the function). The
`StringLookup` layers need TensorFlow (Keras 3 raises ImportError without it), which is not a
JAX step: their lookups are NumPy dictionary lookups with the same ids (OOV 0, words 1..7;
labels "yes" 0, "no" 1). LOGITS: the model's last layer gives logits and the loss takes
`from_logits=True`, which is what tf.keras computes for the notebook's sigmoid output and
`BinaryCrossentropy()` (its sigmoid keeps its logits, `_keras_logits`, and the loss uses
them); Keras 3 on JAX clips the probabilities instead, so a saturated output gets no gradient
and the notebook's RMSprop(0.1) stalls at chance (measured: accuracy 0.46-0.52 after 4
epochs, with or without mirrax); with the logits it reaches 1.0 from the second epoch.

Sections (11 with code, 12 tests): instantiate a ParameterServerStrategy (the in-process
cluster with it), input data, model construction and compiling, callbacks and training, set
up the data, build the model, define the training step, dispatch training steps to remote
workers, inline evaluation (two cells: on the coordinator, scheduled), sidecar evaluation
(prose in the notebook: `mirrax.SidecarEvaluator` on the training's checkpoint), set the
TF_CONFIG environment variable (a worker's and an evaluator's).
"""

import json
import os
import random
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
pytest.importorskip("ray", reason="ParameterServerStrategy needs Ray")

import mirrax  # noqa: E402
from mirrax import callbacks as mirrax_callbacks  # noqa: E402
from tests.tutorials import sections  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("tutorial_ps")]

tutorial = sections.Tutorial()
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
NUM_WORKERS, NUM_PS = 2, 2
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]


@tutorial.section
def instantiate_a_parameterserverstrategy(ns):
    cluster_resolver = mirrax.RayClusterResolver(NUM_WORKERS, NUM_PS, worker_env=ONE_DEVICE)
    ns.cluster_resolver = cluster_resolver  # the module's teardown stops the cluster with it
    variable_partitioner = mirrax.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10), max_shards=NUM_PS
    )
    ns.strategy = mirrax.ParameterServerStrategy(cluster_resolver, variable_partitioner=variable_partitioner)
    return {"strategy": type(ns.strategy).__name__}


@tutorial.section
def input_data(ns):
    global_batch_size = 64
    x = np.random.uniform(size=(10, 10)).astype(np.float32)
    y = np.random.uniform(size=(10,)).astype(np.float32)

    def dataset():  # .shuffle(10).repeat().batch(global_batch_size).prefetch(2)
        rng = np.random.default_rng()
        while True:
            rows = np.concatenate([rng.permutation(10) for _ in range(7)])[:global_batch_size]
            yield x[rows], y[rows]

    ns.dataset = dataset
    first = next(dataset())
    return {"shapes": [list(first[0].shape), list(first[1].shape)]}


@tutorial.section
def model_construction_and_compiling(ns):
    with ns.strategy.scope():
        ns.model = mirrax.Model(keras.models.Sequential([keras.layers.Dense(10)]))
        ns.model.compile(keras.optimizers.SGD(), loss="mse", steps_per_execution=10)
    return {"trainable_variables": len(ns.model.trainable_variables)}


@tutorial.section
def callbacks_and_training(ns):
    working_dir = ns.tmp_dir
    log_dir = os.path.join(working_dir, "log")
    ckpt_filepath = os.path.join(working_dir, "ckpt")
    backup_dir = os.path.join(working_dir, "backup")
    callbacks = [
        mirrax_callbacks.TensorBoard(log_dir=log_dir),
        mirrax_callbacks.ModelCheckpoint(filepath=ckpt_filepath),
        mirrax_callbacks.BackupAndRestore(backup_dir=backup_dir),
    ]
    history = ns.model.fit(ns.dataset, epochs=5, steps_per_epoch=20, callbacks=callbacks, verbose=0).history
    return {
        "loss": [float(v) for v in history["loss"]],
        "logs": os.path.isdir(log_dir),
        "checkpoint": os.path.exists(ckpt_filepath),
    }


def lookup(vocabulary, words, num_oov_indices=1):
    """StringLookup(vocabulary, mask_token=None[, num_oov_indices=0]) as a NumPy lookup."""
    ids = {word: i + num_oov_indices for i, word in enumerate(vocabulary)}
    return np.vectorize(lambda w: ids.get(w, 0))(np.asarray(words)).astype(np.int64)


@tutorial.section
def set_up_the_data(ns):
    def feature_preprocess_stage(features):
        return lookup(feature_vocab, features)

    def label_preprocess_stage(label):
        return lookup(label_vocab, label, num_oov_indices=0)

    def feature_and_label_gen(num_examples=200):
        examples = {"features": [], "label": []}
        for _ in range(num_examples):
            features = random.sample(feature_vocab, 3)
            label = ["yes"] if "avenger" in features else ["no"]
            examples["features"].append(features)
            examples["label"].append(label)
        return examples

    random.seed(0)
    examples = feature_and_label_gen()

    def dataset_fn(_):
        features = {"features": feature_preprocess_stage(examples["features"])}
        labels = label_preprocess_stage(examples["label"])

        def batches():  # .shuffle(200).batch(32).repeat()
            rng = np.random.default_rng()
            while True:
                order = rng.permutation(200)
                for i in range(0, 200, 32):
                    rows = order[i : i + 32]
                    yield {"features": features["features"][rows]}, labels[rows]

        return batches()

    ns.feature_and_label_gen, ns.dataset_fn = feature_and_label_gen, dataset_fn
    ns.feature_preprocess_stage = feature_preprocess_stage
    ns.label_preprocess_stage = label_preprocess_stage
    first = next(dataset_fn(None))
    return {
        "features": list(first[0]["features"].shape),
        "labels": list(first[1].shape),
        "ids": sorted({int(i) for i in first[0]["features"].ravel()} - set(range(1, 8))),
    }


@tutorial.section
def build_the_model(ns):
    # These variables created under the `Strategy.scope` will be placed on parameter servers.
    with ns.strategy.scope():
        model_input = keras.layers.Input(shape=(3,), dtype="int64", name="model_input")
        emb_layer = keras.layers.Embedding(input_dim=len(feature_vocab) + 1, output_dim=16384)
        emb_output = keras.ops.mean(emb_layer(model_input), axis=1)
        dense_output = keras.layers.Dense(
            units=1,  # the sigmoid goes into the loss: see LOGITS
            kernel_regularizer=keras.regularizers.L2(1e-4),
        )(emb_output)
        ns.model = mirrax.Model(keras.Model({"features": model_input}, dense_output))
        # A Keras optimizer in a custom loop: the documented one-line translation.
        ns.optimizer = mirrax.KerasOptimizer(ns.model, keras.optimizers.RMSprop(learning_rate=0.1))
        ns.accuracy = mirrax.metrics.Accuracy()
    ns.emb_layer = emb_layer
    # The notebook's checks: the (8, 16384) float32 table (512 KiB) is cut in 2 shards of
    # 256 KiB (min_shard_bytes), one per parameter server.
    assert len(emb_layer.weights) == 2
    assert emb_layer.weights[0].shape == (4, 16384)
    assert emb_layer.weights[1].shape == (4, 16384)
    return {"shards": [list(w.shape) for w in emb_layer.weights]}


@tutorial.section
def define_the_training_step(ns):
    strategy, model, optimizer, accuracy = ns.strategy, ns.model, ns.optimizer, ns.accuracy

    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            def loss_fn(model):  # tf.GradientTape -> value_and_grad
                pred = model(batch_data, training=True)
                per_example_loss = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)(
                    labels, pred
                )
                loss = mirrax.compute_average_loss(per_example_loss)
                model_losses = model.losses
                if model_losses:
                    loss += mirrax.scale_regularization_loss(sum(model_losses))
                return loss, pred

            # The documented translation (docs/training.md, "Custom training loops with Keras
            # models"): JAX differentiates the model's NNX module; the gradients come back as
            # NNX state shaped like it, its leaves in trainable_variables' order.
            (loss, pred), gradients = mirrax.value_and_grad(loss_fn, has_aux=True)(model.module)
            optimizer.apply_gradients(zip(jax.tree.leaves(gradients), model.trainable_variables))
            actual_pred = (pred > 0.0).astype("int64")  # sigmoid(pred) > 0.5
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(mirrax.ReduceOp.SUM, losses, axis=None)

    ns.step_fn = step_fn
    return {}


@tutorial.section
def dispatch_training_steps_to_remote_workers(ns):
    strategy = ns.strategy
    ns.coordinator = coordinator = mirrax.ClusterCoordinator(strategy)
    dataset_fn = ns.dataset_fn  # the notebook's global (the function pickles what it names)

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)
    num_epochs, steps_per_epoch = 4, 5
    accuracies = []
    for _ in range(num_epochs):
        ns.accuracy.reset_states()
        for _ in range(steps_per_epoch):
            coordinator.schedule(ns.step_fn, args=(per_worker_iterator,))
        coordinator.join()  # Wait at epoch boundaries.
        accuracies.append(float(ns.accuracy.result()))
    loss = coordinator.schedule(ns.step_fn, args=(per_worker_iterator,))
    return {"accuracies": accuracies, "final_loss": float(loss.fetch())}


@tutorial.section
def inline_evaluation(ns):
    rows = ns.feature_and_label_gen(num_examples=16)
    features = ns.feature_preprocess_stage(rows["features"])
    labels = ns.label_preprocess_stage(rows["label"])
    eval_dataset = [({"features": features[i : i + 8]}, labels[i : i + 8]) for i in range(0, 16, 8)]
    eval_accuracy = mirrax.metrics.Accuracy()
    for batch_data, labels in eval_dataset:
        pred = ns.model(batch_data, training=False)
        actual_pred = (np.asarray(pred) > 0.0).astype(np.int64)
        eval_accuracy.update_state(labels, actual_pred)
    return {"accuracy": float(eval_accuracy.result())}


@tutorial.section
def inline_evaluation_scheduled(ns):
    strategy, model, coordinator = ns.strategy, ns.model, ns.coordinator
    with strategy.scope():
        eval_accuracy = mirrax.metrics.Accuracy()  # Define the eval metric on parameter servers.

    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            actual_pred = (pred > 0.0).astype("int64")
            eval_accuracy.update_state(labels, actual_pred)

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    # The notebook's globals (the function pickles what it names).
    feature_and_label_gen = ns.feature_and_label_gen
    feature_preprocess_stage = ns.feature_preprocess_stage
    label_preprocess_stage = ns.label_preprocess_stage

    def eval_dataset_fn():
        rows = feature_and_label_gen(num_examples=16)
        features = feature_preprocess_stage(rows["features"])
        labels = label_preprocess_stage(rows["label"])

        def batches():  # .shuffle(16).repeat().batch(8)
            while True:
                for i in range(0, 16, 8):
                    yield {"features": features[i : i + 8]}, labels[i : i + 8]

        return batches()

    per_worker_eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))
    for _ in range(2):  # eval_steps_per_epoch
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()
    return {"accuracy": float(eval_accuracy.result())}


@tutorial.section
def sidecar_evaluation(ns):
    # The training writes checkpoints; an evaluator task watches them (here, this process).
    checkpoint_dir = os.path.join(ns.tmp_dir, "sidecar")
    mirrax.train.Checkpoint(model=ns.model).save(os.path.join(checkpoint_dir, "ckpt"))
    rows = ns.feature_and_label_gen(num_examples=16)
    # A dataset of batches, as TF's tf.data eval dataset (one batch of 16).
    data = [
        (
            {"features": ns.feature_preprocess_stage(rows["features"])},
            ns.label_preprocess_stage(rows["label"]).astype(np.float32),
        )
    ]
    with mirrax.OneDeviceStrategy("cpu:0").scope():
        eval_model = mirrax.Model(keras.Model.from_config(ns.model.keras_model.get_config()))
        eval_model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    evaluator = mirrax.SidecarEvaluator(
        eval_model, data=data, checkpoint_dir=checkpoint_dir, max_evaluations=1
    )
    evaluator.start()
    return {
        "weights_equal": all(
            np.array_equal(a, b) for a, b in zip(eval_model.get_weights(), ns.model.get_weights())
        )
    }


@tutorial.section
def set_the_tf_config_environment_variable(ns):
    worker = json.dumps(
        {
            "cluster": {
                "worker": ["host1:2222", "host2:2222", "host3:2222"],
                "ps": ["host4:2222", "host5:2222"],
                "chief": ["host6:2222"],
            },
            "task": {"type": "worker", "index": 1},
        }
    )
    resolver = mirrax.TFConfigClusterResolver(tf_config=worker)
    return {"worker": [resolver.task_type, resolver.task_id, resolver.cluster_spec().num_tasks("worker")]}


@tutorial.section
def set_the_tf_config_of_the_evaluator(ns):
    evaluator = json.dumps(
        {"cluster": {"evaluator": ["host7:2222"]}, "task": {"type": "evaluator", "index": 0}}
    )
    resolver = mirrax.TFConfigClusterResolver(tf_config=evaluator)
    # The "cluster" part is optional for the evaluator.
    bare = mirrax.TFConfigClusterResolver(tf_config=json.dumps({"task": {"type": "evaluator", "index": 0}}))
    return {"evaluator": [resolver.task_type, resolver.task_id], "bare": [bare.task_type, bare.task_id]}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    # The strategy starts a local Ray cluster and its actors (the first section); both stop
    # at the module's end.
    ns = types.SimpleNamespace(tmp_dir=str(tmp_path_factory.mktemp("ps")))
    try:
        yield tutorial.run_all(ns)
    finally:
        if hasattr(ns, "strategy"):
            ns.strategy.shutdown()
        if hasattr(ns, "cluster_resolver"):
            ns.cluster_resolver.shutdown()


def test_instantiate_a_parameterserverstrategy(outcomes):
    assert sections.result(outcomes, "instantiate_a_parameterserverstrategy") == {
        "strategy": "ParameterServerStrategy"
    }


def test_input_data(outcomes):
    assert sections.result(outcomes, "input_data") == {"shapes": [[64, 10], [64]]}


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26: mirrax.Model refuses a Keras model "
    "that is not built (Sequential([Dense(10)]) without an input shape; TF "
    "builds it at the first fit)",
)
def test_model_construction_and_compiling(outcomes):
    # Dense(10) built: its kernel and its bias.
    assert sections.result(outcomes, "model_construction_and_compiling") == {"trainable_variables": 2}


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26: needs the model of the previous section (an unbuilt Keras model is refused)",
)
def test_callbacks_and_training(outcomes):
    values = sections.result(outcomes, "callbacks_and_training")
    # 5 epochs of 20 steps of SGD on a fixed 10-example regression: the loss falls.
    assert len(values["loss"]) == 5 and values["loss"][-1] < values["loss"][0]
    assert values["logs"] and values["checkpoint"]


def test_set_up_the_data(outcomes):
    # Batches of 32 examples of 3 words; every word is in the vocabulary (ids 1..7, none OOV).
    assert sections.result(outcomes, "set_up_the_data") == {"features": [32, 3], "labels": [32, 1], "ids": []}


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26: a partitioned Keras variable is "
    "not seen as shards (len(emb_layer.weights) == 1, not 2 of (4, 16384)); "
    "partitioning is placement only",
)
def test_build_the_model(outcomes):
    # The (8, 16384) table in 2 shards of 4 rows, one per parameter server.
    assert sections.result(outcomes, "build_the_model") == {"shards": [[4, 16384], [4, 16384]]}


def test_define_the_training_step(outcomes):
    # replica_fn captures the model, the Keras optimizer and the metric; the section that
    # schedules it runs it on the workers.
    sections.result(outcomes, "define_the_training_step")
    values = sections.result(outcomes, "dispatch_training_steps_to_remote_workers")
    assert np.isfinite(values["final_loss"])


def test_dispatch_training_steps_to_remote_workers(outcomes):
    values = sections.result(outcomes, "dispatch_training_steps_to_remote_workers")
    # The label is a function of the features ("avenger" among them). Predicting the majority
    # class scores only 0.57 (no avenger among 3 of 7 words: C(6,3)/C(7,3) = 20/35), with a
    # standard deviation of sqrt(0.57 * 0.43 / 160) = 0.039 over an epoch's 5 x 32 examples,
    # so 0.70 (3.3 of them above it) proves learning. The two workers' asynchronous RMSprop(0.1)
    # updates and the unseeded shuffle (the notebook's) make each run differ: measured over 53
    # runs, the last epoch scored 1.0 in 50 and 0.816 at the least; the last scheduled step's
    # single-batch loss ran 0.07-0.73, so it proves nothing beyond being finite (the trained
    # model is judged by the inline evaluations below: 16 of 16 in every run measured).
    assert len(values["accuracies"]) == 4
    assert values["accuracies"][-1] >= 0.70
    assert np.isfinite(values["final_loss"])


def test_inline_evaluation(outcomes):
    sections.result(outcomes, "dispatch_training_steps_to_remote_workers")
    # 16 examples: at most one wrong (measured 16 of 16).
    assert sections.result(outcomes, "inline_evaluation")["accuracy"] >= 15 / 16


def test_inline_evaluation_scheduled(outcomes):
    # eval_step captures the trained model and a metric made under strategy.scope().
    sections.result(outcomes, "dispatch_training_steps_to_remote_workers")
    assert sections.result(outcomes, "inline_evaluation_scheduled")["accuracy"] >= 15 / 16


def test_sidecar_evaluation(outcomes):
    # The evaluator loaded the checkpoint the training wrote: the trained weights.
    assert sections.result(outcomes, "sidecar_evaluation") == {"weights_equal": True}


def test_set_the_tf_config_environment_variable(outcomes):
    assert sections.result(outcomes, "set_the_tf_config_environment_variable") == {"worker": ["worker", 1, 3]}


def test_set_the_tf_config_of_the_evaluator(outcomes):
    assert sections.result(outcomes, "set_the_tf_config_of_the_evaluator") == {
        "evaluator": ["evaluator", 0],
        "bare": ["evaluator", 0],
    }
