"""Keras glue in custom loops (model.losses, trainable_variables, KerasOptimizer, callable metrics,
reduction=None losses) and whole-model save of Keras models to .keras (round trip, bad input, a
save killed part-way)."""

import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from flax import nnx  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from tests.conftest import mirrored  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _regularized_dense():
    # One Dense unit on 2 inputs, weights 1, penalty L2(0.5): 0.5 * (1 + 1) = 1.0.
    return keras.Sequential(
        [
            keras.Input((2,)),
            layers.Dense(
                1, use_bias=False, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(0.5)
            ),
        ]
    )


def _penalty_step(model, optimizer, batch, use_update):
    """The custom-training tutorial's step with only the model's own loss (so the gradient is
    the regularizer's): each replica adds its share, as tf.nn.scale_regularization_loss."""
    x, _ = batch

    def loss_fn(model):
        model(x, training=True)
        return mirrax.scale_regularization_loss(sum(model.losses))

    loss, grads = mirrax.value_and_grad(loss_fn)(model)
    if use_update:
        optimizer.update(model, grads)
    else:
        optimizer.apply_gradients(zip(jax.tree.leaves(grads), model.trainable_variables))
    return loss


@pytest.mark.parametrize("replicas", [1, 4])
def test_losses_trainable_variables_and_a_keras_optimizer_in_a_custom_loop(replicas):
    strategy = mirrored(replicas)
    with strategy.scope():
        model = mirrax.Model(_regularized_dense())
        optimizer = mirrax.KerasOptimizer(model, keras.optimizers.SGD(0.1, momentum=0.9))
    # Keras's model.losses before any call: the weight regularizer, 0.5 * (1 + 1) = 1.0.
    assert [float(v) for v in model.losses] == [1.0]
    assert [v.get_value().shape for v in model.trainable_variables] == [(2, 1)]
    assert isinstance(model.trainable_variables[0], nnx.Param)
    batch = next(
        iter(
            strategy.experimental_distribute_dataset(
                [(np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32))]
            )
        )
    )
    # Keras's SGD with momentum: v = 0.9 v - 0.1 g, w = w + v. The gradient of 0.5 * sum(w²)
    # is w. Step 1 (apply_gradients): g = 1, v = -0.1, w = 0.9; penalty 1.0.
    loss = strategy.run(_penalty_step, args=(model.module, optimizer, batch, False))
    assert float(strategy.reduce("sum", loss)) == pytest.approx(1.0)
    np.testing.assert_allclose(model.get_weights()[0], np.full((2, 1), 0.9), rtol=1e-6)
    # Step 2 (update, nnx.Optimizer's spelling): g = 0.9, v = -0.09 - 0.09 = -0.18, w = 0.72;
    # penalty 0.5 * 2 * 0.81 = 0.81.
    loss = strategy.run(_penalty_step, args=(model.module, optimizer, batch, True))
    assert float(strategy.reduce("sum", loss)) == pytest.approx(0.81)
    np.testing.assert_allclose(model.get_weights()[0], np.full((2, 1), 0.72), rtol=1e-6)
    assert int(optimizer.iterations) == 2
    # model.losses after the steps: on the current weights, 0.5 * 2 * 0.72² = 0.5184.
    assert float(model.losses[0]) == pytest.approx(0.5184, rel=1e-6)


def test_a_pickled_keras_optimizer_is_built_again_and_steps_as_the_original():
    # A ParameterServerStrategy sends the held objects' structure to its workers pickled:
    # Keras pickles its optimizer from the config, unbuilt (Keras's stateless_apply refused
    # it: "RMSprop must be built"); the copy builds itself for the recorded shapes.
    strategy = mirrored(1)
    with strategy.scope():
        model = mirrax.Model(_regularized_dense())
        optimizer = mirrax.KerasOptimizer(model, keras.optimizers.SGD(0.1, momentum=0.9))
    graphdef, state = nnx.split((model.module, optimizer))
    module, copy = nnx.merge(pickle.loads(pickle.dumps(graphdef)), state)
    assert not copy.keras_optimizer.built
    batch = next(
        iter(
            strategy.experimental_distribute_dataset(
                [(np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32))]
            )
        )
    )
    for use_update in (False, True):
        strategy.run(_penalty_step, args=(module, copy, batch, use_update))
    # As the original's two steps above: w = 0.9, then 0.72; two updates counted.
    np.testing.assert_allclose(
        np.asarray(module.variable_list[0].get_value()), np.full((2, 1), 0.72), rtol=1e-6
    )
    assert int(copy.iterations) == 2 and copy.keras_optimizer.built


def test_a_keras_optimizers_learning_rate_is_read_and_set_in_its_state():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(_regularized_dense())
        optimizer = mirrax.KerasOptimizer(model, keras.optimizers.SGD(0.1))
    assert optimizer.learning_rate == pytest.approx(0.1)
    optimizer.learning_rate = 0.5
    batch = next(
        iter(
            strategy.experimental_distribute_dataset(
                [(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32))]
            )
        )
    )
    strategy.run(_penalty_step, args=(model.module, optimizer, batch, True))
    # Plain SGD on the penalty's gradient w = 1: w = 1 - 0.5 * 1 = 0.5.
    np.testing.assert_allclose(model.get_weights()[0], np.full((2, 1), 0.5), rtol=1e-6)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    scheduled = mirrax.KerasOptimizer(mirrax.Model(_regularized_dense()), keras.optimizers.SGD(schedule))
    with pytest.raises(AttributeError, match="has a learning-rate schedule"):
        _ = scheduled.learning_rate


def test_an_activity_loss_is_the_last_calls_and_nnx_models_have_none():
    # Keras divides an activity regularizer by the batch: L1(0.1) of outputs 3 and 5 (inputs
    # [1, 2] and [2, 3], weights 1) is 0.1 * (3 + 5) / 2 = 0.4.
    keras_model = keras.Sequential(
        [
            keras.Input((2,)),
            layers.Dense(
                1, use_bias=False, kernel_initializer="ones", activity_regularizer=keras.regularizers.L1(0.1)
            ),
        ]
    )
    model = mirrax.Model(keras_model)
    assert model.losses == []
    model(np.array([[1.0, 2.0], [2.0, 3.0]], np.float32))
    assert [float(v) for v in model.losses] == [pytest.approx(0.4)]
    assert mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0))).losses == []
    nnx_model = mirrax.Model(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert sorted(v.get_value().shape for v in nnx_model.trainable_variables) == [(2, 3), (3,)]


def test_keras_optimizer_bad_input():
    model = mirrax.Model(_regularized_dense())
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match="must be a keras.optimizers"):
        mirrax.KerasOptimizer(model, "adam")
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match="nnx.Optimizer"):
        mirrax.KerasOptimizer(mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0))), keras.optimizers.Adam())
    optimizer = mirrax.KerasOptimizer(model, keras.optimizers.SGD(0.1))
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="already built"):
        mirrax.KerasOptimizer(model, optimizer.keras_optimizer)
    with pytest.raises(mirrax.errors.InvalidArgumentError, match=r"received 0 \(gradient"):
        optimizer.apply_gradients([])
    with pytest.raises(mirrax.errors.InvalidArgumentError, match=r"pair 0 has a gradient of shape \(3,\)"):
        optimizer.apply_gradients(zip([jnp.ones(3)], model.trainable_variables))


def test_metrics_are_callable_and_reset_states_resets():
    accuracy = mirrax.metrics.SparseCategoricalAccuracy()
    # As Keras's metric(y_true, y_pred): both right -> 1.0; then one wrong -> 2 of 3.
    assert float(accuracy(np.array([0, 1]), np.array([[0.9, 0.1], [0.2, 0.8]]))) == 1.0
    assert float(accuracy(np.array([0]), np.array([[0.1, 0.9]]))) == pytest.approx(2 / 3)
    accuracy.reset_states()
    assert float(accuracy.result()) == 0.0
    mean = mirrax.metrics.Mean()
    assert float(mean(np.array([1.0, 2.0, 6.0]))) == 3.0


def test_reduction_none_gives_per_example_losses_for_compute_average_loss():
    y, p = np.array([1.0, 2.0, 3.0]), np.array([1.0, 4.0, 6.0])  # squared errors 0, 4, 9
    for reduction in (None, "none", mirrax.losses.Reduction.NONE):
        loss = mirrax.losses.MeanSquaredError(reduction=reduction)
        np.testing.assert_array_equal(loss(y[:, None], p[:, None]), [0.0, 4.0, 9.0])
    assert float(mirrax.losses.MeanSquaredError(reduction="sum")(y[:, None], p[:, None])) == 13.0
    # Weighted, reduction None: each loss times its weight.
    np.testing.assert_array_equal(
        mirrax.losses.MeanSquaredError(reduction=None)(
            y[:, None], p[:, None], sample_weight=np.array([1.0, 0.5, 2.0])
        ),
        [0.0, 2.0, 18.0],
    )
    # A partial batch of 6 over 4 replicas (2, 2, 2, 0 real rows): Keras's and mirrax's
    # per-example losses with compute_average_loss give the mean of the 6, (0+1+4+9+16+25)/6.
    strategy = mirrored(4)
    batch = next(
        iter(
            strategy.experimental_distribute_dataset(
                [(np.zeros((6, 1), np.float32), np.arange(6, dtype=np.float32)[:, None])]
            )
        )
    )
    for loss in (
        keras.losses.MeanSquaredError(reduction=None),
        mirrax.losses.MeanSquaredError(reduction=mirrax.losses.Reduction.NONE),
    ):

        def step(batch, loss=loss):
            y_true, y_pred = batch
            with jax.numpy_rank_promotion("allow"):
                per_example = loss(y_true, y_pred)
            assert per_example.shape == (2,)
            return mirrax.compute_average_loss(per_example)

        total = strategy.reduce("sum", strategy.run(step, args=(batch,)))
        assert float(total) == pytest.approx(55 / 6)


def test_reduction_bad_input_and_compile_refuses_an_unreduced_loss():
    with pytest.raises(mirrax.errors.UnsupportedArgumentError, match=r"MeanSquaredError\(reduction='auto'\)"):
        mirrax.losses.MeanSquaredError(reduction="auto")
    model = mirrax.Model(_regularized_dense())
    with pytest.raises(mirrax.errors.UnsupportedArgumentError, match="has reduction=None; compile"):
        model.compile(optimizer="sgd", loss=mirrax.losses.MeanSquaredError(reduction=None))


# -- save / load -----------------------------------------------------------------------------


def _classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), layers.Dense(8, activation="relu"), layers.Dropout(0.1), layers.Dense(3)]
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [0, 4])  # OneDeviceStrategy, MirroredStrategy on 4
def test_save_and_load_round_trip_as_tfs_save_and_load_tutorial(tmp_path, replicas):
    strategy = mirrored(replicas)
    x, y = _data()
    with strategy.scope():
        model = mirrax.Model(_classifier())
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.optimizer.learning_rate = 5e-3  # as ReduceLROnPlateau would: the file keeps it
    expected = model.predict(x, batch_size=16, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]  # no temporary left beside it
    # The tutorial loads under the strategy's scope, then without one, then with Keras.
    with strategy.scope():
        restored = mirrax.models.load_model(path)
    assert restored.distribute_strategy is strategy
    without_scope = mirrax.models.load_model(path)
    by_keras = mirrax.Model(keras.models.load_model(path))
    # Same weights (the ones mirrax trained), same program: the same bits.
    np.testing.assert_array_equal(restored.predict(x, batch_size=16, verbose=0), expected)
    np.testing.assert_array_equal(by_keras.predict(x, batch_size=16, verbose=0), expected)
    # Compiled again from the file (loss, metrics, optimizer's class and current rate): evaluate
    # gives the trained model's numbers, and fit continues.
    assert restored.evaluate(x, y, batch_size=16, verbose=0) == model.evaluate(x, y, batch_size=16, verbose=0)
    assert restored.optimizer.learning_rate == pytest.approx(5e-3)
    history = restored.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    assert sorted(history) == ["accuracy", "learning_rate", "loss"]
    assert np.isfinite(history["loss"][0])
    assert without_scope.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)["loss"] > 0


def test_save_without_keras_compile_arguments_warns_and_loads_uncompiled(tmp_path):
    model = mirrax.Model(_classifier())
    model.compile(optimizer="adam", loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match="compile arguments loss are not Keras objects"):
        model.save(tmp_path / "m.keras")
    restored = mirrax.models.load_model(tmp_path / "m.keras")
    assert restored.optimizer is None


def test_save_and_load_bad_input(tmp_path):
    model = mirrax.Model(_classifier())
    with pytest.raises(mirrax.errors.InvalidArgumentError, match=r"the path must end in \.keras"):
        model.save(tmp_path / "m.h5")
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"NNX module.*save_weights.*mirrax.Checkpoint.*mirrax.export",
    ):
        mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0))).save(tmp_path / "n.keras")
    model.save(tmp_path / "m.keras")
    with pytest.raises(mirrax.errors.ExistingPathError, match="exists; pass overwrite=True"):
        model.save(tmp_path / "m.keras", overwrite=False)
    with pytest.raises(mirrax.errors.UnsupportedArgumentError, match="zipped"):
        model.save(tmp_path / "z.keras", zipped=False)
    with pytest.raises(mirrax.errors.MissingCheckpointError, match="no file at"):
        mirrax.models.load_model(tmp_path / "missing.keras")
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="mirrax reads Keras's .keras"):
        mirrax.models.load_model(tmp_path)


# The child saves once (weights 1), then saves again (weights 2) but blocks inside Keras's
# write of the archive (its metadata and config entries written, before the weights: Keras's
# saving_lib._save_state), prints BLOCKED and waits to be killed.
_KILL_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import keras
    import mirrax
    path = sys.argv[1]
    model = mirrax.Model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, kernel_initializer="ones", bias_initializer="ones")]))
    model.save(path)
    model.set_weights([w * 2 for w in model.get_weights()])
    from keras.src.saving import saving_lib
    def blocking(*args, **kwargs):
        print("BLOCKED", flush=True)
        threading.Event().wait()  # until SIGKILL
    saving_lib._save_state = blocking
    model.save(path)
    """
)


@pytest.mark.subprocess
def test_a_save_killed_while_writing_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "m.keras"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD.format(repo=_REPO), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "BLOCKED"
        leftovers = [n for n in os.listdir(tmp_path) if n != "m.keras"]
        assert len(leftovers) == 1 and leftovers[0].startswith(".m.keras.mirrax-tmp-")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # The path holds the first save, whole (weights 1), and the next save clears the leftover.
    restored = mirrax.models.load_model(path)
    assert [w.tolist() for w in restored.get_weights()] == [[[1.0], [1.0]], [1.0]]
    restored.save(path)
    assert os.listdir(tmp_path) == ["m.keras"]


# -- TF's custom-training tutorial, ported mechanically (docs/training.md, "Custom training
# loops with Keras models") --------------------------------------------------------------------


@pytest.mark.slow
def test_the_custom_training_tutorial_ported_with_a_keras_model(tmp_path):
    (x, y), (x_test, y_test) = mirrax.data.load_digits()
    x, y, x_test, y_test = x[:256], y[:256], x_test[:128], y_test[:128]
    strategy = mirrored(4)
    global_batch_size = 16 * strategy.num_replicas_in_sync
    train_dist_dataset = strategy.experimental_distribute_dataset(
        [
            (x[i : i + global_batch_size], y[i : i + global_batch_size])
            for i in range(0, len(x), global_batch_size)
        ]
    )

    def create_model():
        regularizer = keras.regularizers.L2(1e-5)
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),  # Keras 3 on mirrax: the model must be built
                layers.Conv2D(8, 3, activation="relu", kernel_regularizer=regularizer),
                layers.Flatten(),
                layers.Dense(32, activation="relu", kernel_regularizer=regularizer),
                layers.Dense(10, kernel_regularizer=regularizer),
            ]
        )

    with strategy.scope():
        loss_object = mirrax.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=mirrax.losses.Reduction.NONE
        )

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = mirrax.compute_average_loss(per_example_loss)
            if model_losses:
                loss += mirrax.scale_regularization_loss(sum(model_losses))
            return loss

        train_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        model = mirrax.Model(create_model())
        optimizer = mirrax.KerasOptimizer(model, keras.optimizers.Adam(learning_rate=0.001))
        checkpoint = mirrax.Checkpoint(optimizer=optimizer, model=model)

    def train_step(model, optimizer, train_accuracy, inputs):
        images, labels = inputs

        def loss_fn(model):
            predictions = model(images, training=True)
            return compute_loss(labels, predictions, model.losses), predictions

        (loss, predictions), gradients = mirrax.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, gradients)
        train_accuracy.update_state(labels, predictions)
        return loss

    losses = []
    for _ in range(6):
        total_loss, num_batches = 0.0, 0
        for batch in train_dist_dataset:
            per_replica_losses = strategy.run(
                train_step, args=(model.module, optimizer, train_accuracy, batch)
            )
            total_loss += float(strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None))
            num_batches += 1
        losses.append(total_loss / num_batches)
        train_accuracy.reset_states()
    saved = checkpoint.save(str(tmp_path / "ckpt"))  # TF numbers it: ckpt-1
    # The tutorial's claims: the loss falls; a restored model, without a strategy, classifies as
    # the trained one (the same weights).
    assert losses[-1] < losses[0]
    eval_accuracy = mirrax.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
    new_model = mirrax.Model(create_model())
    new_optimizer = mirrax.KerasOptimizer(new_model, keras.optimizers.Adam())
    mirrax.Checkpoint(optimizer=new_optimizer, model=new_model).restore(saved)
    eval_accuracy(y_test, new_model(x_test, training=False))
    trained = mirrax.metrics.SparseCategoricalAccuracy()
    trained(y_test, model(x_test, training=False))
    assert float(eval_accuracy.result()) == float(trained.result())
    # The optimizer's state came back too: 6 epochs of 256 / 64 = 4 steps.
    assert int(new_optimizer.iterations) == 24


@pytest.mark.subprocess
def test_a_multi_worker_save_is_written_by_the_chief_only(tmp_path):
    from tests.multiworker import harness

    results = harness.run("keras_save", tmp_path, num_workers=2, cpu_devices=1)
    assert [r["same_predictions"] for r in results] == [True, True]
    assert [r["wrote_own_path"] for r in results] == [False, False]
    assert sorted(
        p.name for p in tmp_path.iterdir() if p.suffix == ".keras" or p.name.startswith(".m.keras")
    ) == ["m.keras"]
