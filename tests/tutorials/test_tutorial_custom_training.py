"""Port of tensorflow/docs site/en/tutorials/distribute/custom_training.ipynb ("Custom training
with tf.distribute.Strategy"), as a TF user would port it.

Translation (mechanical): `tf.distribute.X` -> `mirrax.X`, `tf.nn.compute_average_loss` /
`scale_regularization_loss` -> `mirrax.`; tf.keras layers, losses and optimizers -> Keras 3 on
JAX, the model wrapped in `mirrax.Model`; `tf.keras.metrics` -> `mirrax.metrics` (same names:
a Keras metric's variables cannot be carried through a JAX step); for the steps, the
translation docs/training.md documents ("Custom training loops with Keras models"): a Keras
optimizer as `mirrax.KerasOptimizer(model, keras_optimizer)`, `tf.GradientTape` ->
`mirrax.value_and_grad(loss_fn)(model.module)`, `apply_gradients(zip(jax.tree.leaves(grads),
model.trainable_variables))` (TF's literal lines are one extra test); `@tf.function` ->
`@mirrax.function` (dropped in "iterating inside a tf.function": a dataset iterated inside a
function would be traced batch by batch into one program); `tf.train.*` -> `mirrax.train.*`;
Fashion-MNIST -> the bundled digits (8x8: both convolutions get padding="same", as 3x3
kernels leave nothing for the second pooling otherwise), 3 epochs instead of 10, 16 examples
per replica.
`Reduction.NONE` is Keras 3's `reduction=None`.

Sections (11, and one test of TF's literal step lines): dataset, strategy, input pipeline,
model, loss function, metrics, training loop, restore the latest checkpoint, using iterators,
iterating inside a tf.function, tracking training loss across replicas (prose only: its
statement is checked on the training loop's numbers).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

keras = pytest.importorskip("keras")

import mirrax  # noqa: E402
from tests.tutorials import sections  # noqa: E402

pytestmark = [pytest.mark.xdist_group("tutorial_custom_training"), pytest.mark.slow]

tutorial = sections.Tutorial()


@tutorial.section
def download_the_dataset(ns):
    (ns.train_images, ns.train_labels), (ns.test_images, ns.test_labels) = mirrax.data.load_digits()
    # The digits already are (N, 8, 8, 1) floats in [0, 1]: the tutorial's `[..., None]` and
    # `/ 255` are done by load_digits.
    return {
        "train": ns.train_images.shape,
        "test": ns.test_images.shape,
        "range": [float(ns.train_images.min()), float(ns.train_images.max())],
    }


@tutorial.section
def create_a_strategy(ns):
    ns.strategy = mirrax.MirroredStrategy()
    return {"replicas": ns.strategy.num_replicas_in_sync}


@tutorial.section
def setup_input_pipeline(ns):
    ns.BUFFER_SIZE = len(ns.train_images)
    ns.BATCH_SIZE_PER_REPLICA = 16
    ns.GLOBAL_BATCH_SIZE = ns.BATCH_SIZE_PER_REPLICA * ns.strategy.num_replicas_in_sync
    ns.EPOCHS = 3
    rng = np.random.default_rng(0)  # .shuffle(BUFFER_SIZE)
    order = rng.permutation(ns.BUFFER_SIZE)
    images, labels = ns.train_images[order], ns.train_labels[order]
    g = ns.GLOBAL_BATCH_SIZE
    train_dataset = [(images[i : i + g], labels[i : i + g]) for i in range(0, len(images), g)]
    test_dataset = [
        (ns.test_images[i : i + g], ns.test_labels[i : i + g]) for i in range(0, len(ns.test_images), g)
    ]
    ns.train_dist_dataset = ns.strategy.experimental_distribute_dataset(train_dataset)
    ns.test_dist_dataset = ns.strategy.experimental_distribute_dataset(test_dataset)
    first = next(iter(ns.train_dist_dataset))
    shards = [np.asarray(x).shape[0] for x in ns.strategy.experimental_local_results(first[0])]
    last = list(ns.test_dist_dataset)[-1]
    last_shards = [np.asarray(x).shape[0] for x in ns.strategy.experimental_local_results(last[1])]
    return {"global": g, "first_shards": shards, "test_last_shards": last_shards}


def create_model():
    regularizer = keras.regularizers.L2(1e-5)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),  # Keras 3 builds the model here (TF builds at the first call)
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Dense(10, kernel_regularizer=regularizer),
        ]
    )
    return model


@tutorial.section
def create_the_model(ns):
    ns.checkpoint_dir = ns.tmp_dir
    ns.checkpoint_prefix = os.path.join(ns.checkpoint_dir, "ckpt")
    keras.utils.set_random_seed(0)
    return {"outputs": create_model().output_shape}


@tutorial.section
def define_the_loss_function(ns):
    with ns.strategy.scope():
        # Set reduction to `NONE` so you can do the reduction yourself.
        ns.loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = ns.loss_object(labels, predictions)
            loss = mirrax.compute_average_loss(per_example_loss)
            if model_losses:
                loss += mirrax.scale_regularization_loss(sum(model_losses))
            return loss

    ns.compute_loss = compute_loss
    # Uniform logits over 10 classes: each example's loss is log(10) = 2.302585; the replicas'
    # shares of the average over a global batch of 8 examples sum to log(10).
    labels = np.arange(8, dtype=np.int32)
    logits = np.zeros((8, 10), np.float32)
    batch = next(iter(ns.strategy.experimental_distribute_dataset([(labels, logits)])))
    shares = ns.strategy.run(lambda b: compute_loss(b[0], b[1], []), args=(batch,))
    return {"loss": float(ns.strategy.reduce("SUM", shares, axis=None))}


@tutorial.section
def define_the_metrics(ns):
    with ns.strategy.scope():
        ns.test_loss = mirrax.metrics.Mean(name="test_loss")
        ns.train_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        ns.test_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="test_accuracy")
    return {"names": [ns.test_loss.name, ns.train_accuracy.name, ns.test_accuracy.name]}


@tutorial.section
def training_loop(ns):
    strategy = ns.strategy
    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = mirrax.Model(create_model())
        # The documented one-line translation of a Keras optimizer for custom loops: its state
        # becomes NNX state that strategy.run carries (docs/training.md).
        optimizer = mirrax.KerasOptimizer(model, keras.optimizers.Adam(learning_rate=0.001))
        checkpoint = mirrax.train.Checkpoint(optimizer=optimizer, model=model)
    ns.model, ns.optimizer = model, optimizer
    compute_loss, loss_object = ns.compute_loss, ns.loss_object
    train_accuracy, test_loss, test_accuracy = ns.train_accuracy, ns.test_loss, ns.test_accuracy

    def train_step(inputs):
        images, labels = inputs

        def loss_fn(model):  # tf.GradientTape -> value_and_grad
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
            return loss, predictions

        # The documented translation (docs/training.md, "Custom training loops with Keras
        # models"): JAX differentiates the model's NNX module; the gradients come back as NNX
        # state shaped like it, its leaves in trainable_variables' order.
        (loss, predictions), gradients = mirrax.value_and_grad(loss_fn, has_aux=True)(model.module)
        optimizer.apply_gradients(zip(jax.tree.leaves(gradients), model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    # `run` replicates the provided computation and runs it with the distributed input.
    @mirrax.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None)

    @mirrax.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    ns.train_step, ns.distributed_train_step = train_step, distributed_train_step
    history, saved = [], []
    for epoch in range(ns.EPOCHS):
        total_loss = 0.0
        num_batches = 0
        for x in ns.train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in ns.test_dist_dataset:
            distributed_test_step(x)
        if epoch % 2 == 0:
            saved.append(checkpoint.save(ns.checkpoint_prefix))
        history.append(
            [
                float(train_loss),
                float(train_accuracy.result()),
                float(test_loss.result()),
                float(test_accuracy.result()),
            ]
        )
        test_loss.reset_states()
        train_accuracy.reset_states()
        test_accuracy.reset_states()
    return {
        "history": history,
        "saved": saved,
        "prefix": ns.checkpoint_prefix,
        "test_accuracy": history[-1][3],
    }


@tutorial.section
def restore_the_latest_checkpoint_and_test(ns):
    eval_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = mirrax.Model(create_model())
    new_optimizer = mirrax.KerasOptimizer(new_model, keras.optimizers.Adam())
    g = ns.GLOBAL_BATCH_SIZE
    test_dataset = [
        (ns.test_images[i : i + g], ns.test_labels[i : i + g]) for i in range(0, len(ns.test_images), g)
    ]

    def eval_step(images, labels):
        predictions = new_model(images, training=False)
        eval_accuracy(labels, predictions)

    checkpoint = mirrax.train.Checkpoint(optimizer=new_optimizer, model=new_model)
    latest = mirrax.train.latest_checkpoint(ns.checkpoint_dir)
    checkpoint.restore(latest)
    for images, labels in test_dataset:
        eval_step(images, labels)
    return {"latest": latest, "accuracy": float(eval_accuracy.result())}


@tutorial.section
def using_iterators(ns):
    losses = []
    for _ in range(ns.EPOCHS):
        total_loss = 0.0
        num_batches = 0
        train_iter = iter(ns.train_dist_dataset)
        for _ in range(10):
            total_loss += ns.distributed_train_step(next(train_iter))
            num_batches += 1
        losses.append(float(total_loss / num_batches))
        ns.train_accuracy.reset_states()
    return {"losses": losses}


@tutorial.section
def iterating_inside_a_tf_function(ns):
    strategy = ns.strategy

    def distributed_train_epoch(dataset):  # @tf.function dropped: the loop runs in Python (see above)
        total_loss = 0.0
        num_batches = 0
        for x in dataset:
            per_replica_losses = strategy.run(ns.train_step, args=(x,))
            total_loss += strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None)
            num_batches += 1
        return total_loss / float(num_batches)

    losses, accuracies = [], []
    for _ in range(ns.EPOCHS):
        losses.append(float(distributed_train_epoch(ns.train_dist_dataset)))
        accuracies.append(float(ns.train_accuracy.result()))
        ns.train_accuracy.reset_states()
    return {"losses": losses, "accuracies": accuracies}


@tutorial.section
def the_training_step_as_tf_writes_it(ns):
    # Not a notebook section: the training loop's step with TF's own lines, differentiating
    # the mirrax.Model the step captures and zipping the gradients with the variables.
    model, optimizer, compute_loss = ns.model, ns.optimizer, ns.compute_loss

    def train_step(inputs):
        images, labels = inputs

        def loss_fn(model):
            predictions = model(images, training=True)
            return compute_loss(labels, predictions, model.losses)

        loss, gradients = nnx.value_and_grad(loss_fn)(model)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    loss = ns.strategy.run(train_step, args=(next(iter(ns.train_dist_dataset)),))
    return {"loss": float(ns.strategy.reduce("SUM", loss, axis=None))}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import types

    ns = types.SimpleNamespace(tmp_dir=str(tmp_path_factory.mktemp("custom_training")))
    return tutorial.run_all(ns)


def test_download_the_dataset(outcomes):
    values = sections.result(outcomes, "download_the_dataset")
    assert values == {"train": (1437, 8, 8, 1), "test": (360, 8, 8, 1), "range": [0.0, 1.0]}


def test_create_a_strategy(outcomes):
    # MirroredStrategy() takes every device: the suite's 8 fake CPU devices (tests/conftest.py).
    assert sections.result(outcomes, "create_a_strategy") == {"replicas": 8}


def test_setup_input_pipeline(outcomes):
    values = sections.result(outcomes, "setup_input_pipeline")
    # 16 per replica x 8 replicas = 128 per global batch, cut in 8 shards of 16; the test set's
    # last batch has 360 - 2 * 128 = 104 examples: ceil(104 / 8) = 13 per replica.
    assert values == {"global": 128, "first_shards": [16] * 8, "test_last_shards": [13] * 8}


def test_create_the_model(outcomes):
    assert sections.result(outcomes, "create_the_model") == {"outputs": (None, 10)}


def test_define_the_loss_function(outcomes):
    # Uniform logits: every example's loss is log(10); the shares sum to the global mean.
    values = sections.result(outcomes, "define_the_loss_function")
    assert values["loss"] == pytest.approx(np.log(10), rel=1e-6)


def test_define_the_metrics(outcomes):
    assert sections.result(outcomes, "define_the_metrics") == {
        "names": ["test_loss", "train_accuracy", "test_accuracy"]
    }


def test_training_loop(outcomes):
    values = sections.result(outcomes, "training_loop")
    history = values["history"]
    # The tutorial's statement: the loss falls and the accuracies rise epoch after epoch.
    assert history[-1][0] < history[0][0]
    assert history[-1][1] > history[0][1]
    # 3 epochs of 12 steps on the digits: far above chance (0.1); measured 0.786 with the
    # issue's branches merged.
    assert values["test_accuracy"] > 0.6
    # Saves at epochs 0 and 2, numbered as TF: ckpt-1, ckpt-2.
    assert values["saved"] == [values["prefix"] + "-1", values["prefix"] + "-2"]


def test_restore_the_latest_checkpoint_and_test(outcomes):
    training = sections.result(outcomes, "training_loop")
    values = sections.result(outcomes, "restore_the_latest_checkpoint_and_test")
    assert values["latest"] == training["saved"][-1]
    # The checkpoint of the last epoch (epoch 2, the last one) holds the weights the final
    # test accuracy was measured with: the same accuracy, without a strategy.
    assert values["accuracy"] == pytest.approx(training["test_accuracy"], abs=1e-6)


def test_using_iterators(outcomes):
    training = sections.result(outcomes, "training_loop")
    losses = sections.result(outcomes, "using_iterators")["losses"]
    # Training goes on from the trained model: the loss stays below the first epoch's.
    assert max(losses) < training["history"][0][0]


def test_iterating_inside_a_tf_function(outcomes):
    training = sections.result(outcomes, "training_loop")
    values = sections.result(outcomes, "iterating_inside_a_tf_function")
    assert max(values["losses"]) < training["history"][0][0]
    assert min(values["accuracies"]) > training["history"][0][1]


def test_tracking_training_loss_across_replicas(outcomes):
    # The tutorial: each replica's loss is scaled by 1 / GLOBAL_BATCH_SIZE and the replicas'
    # values are SUM-reduced, so the printed loss is the global-batch mean per example, of the
    # size of the test loss (a per-example mean too), not 8 times it (a sum of replica means)
    # nor an eighth of it (one replica's share).
    history = sections.result(outcomes, "training_loop")["history"]
    train_loss, test_loss = history[-1][0], history[-1][2]
    # The mean loss per example, not per replica (x 8) nor per-replica mean / 8.
    assert 0.5 * test_loss < train_loss < 2 * test_loss + 0.1


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26 (between items 7 and 8, open on the "
    "merged branches): nnx.value_and_grad over the captured mirrax.Model "
    "(TypeError: not a valid JAX type), and zip(gradients, "
    "model.trainable_variables) with NNX-state gradients (1 pair for 8 variables)",
)
def test_the_training_step_as_tf_writes_it(outcomes):
    # One more Adam step on the trained model: a finite loss below the first epoch's.
    training = sections.result(outcomes, "training_loop")
    loss = sections.result(outcomes, "the_training_step_as_tf_writes_it")["loss"]
    assert np.isfinite(loss) and loss < training["history"][0][0]
