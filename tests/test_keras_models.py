"""Keras 3 models in `mirrax.Model`: the tutorial's Keras CNN equals its NNX twin, Keras's own
losses count once on any replica count, dropout and batch statistics across replicas, Keras
losses / optimizers / metrics in compile, checkpoints, export, mixed precision, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from flax import nnx  # noqa: E402
from keras import layers  # noqa: E402
from mirrax.examples import keras_fit, keras_model  # noqa: E402

import mirrax  # noqa: E402
from mirrax._src.training import steps  # noqa: E402
from tests.conftest import mirrored  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)

DIGITS = mirrax.data.load_digits()


def _copy_keras_weights_to_nnx(keras_cnn, module):
    """The NNX TutorialCNN with the Keras CNN's weights: Conv2D and nnx.Conv both keep kernels
    as (height, width, in, out), Dense and nnx.Linear as (in, out); both flatten NHWC."""
    kernels = [layer for layer in keras_cnn.layers if layer.weights]
    for layer, target in zip(
        kernels, [module.conv1, module.conv2, module.conv3, module.dense1, module.dense2]
    ):
        target.kernel[...] = jnp.asarray(layer.kernel.value)
        target.bias[...] = jnp.asarray(layer.bias.value)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 4])
def test_the_tutorial_keras_cnn_fits_as_its_nnx_twin_with_the_same_weights(replicas):
    (x, y), (x_test, y_test) = DIGITS
    x, y = x[:320], y[:320]
    strategy = mirrored(replicas)
    histories, predictions = [], []
    keras.utils.set_random_seed(0)
    with strategy.scope():
        keras_cnn = keras_model.build_model((8, 8, 1))
        twin = keras_fit.TutorialCNN((8, 8, 1), rngs=nnx.Rngs(1))
        _copy_keras_weights_to_nnx(keras_cnn, twin)
        for model, loss, optimizer in (
            (
                mirrax.Model(keras_cnn),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.Adam(learning_rate=1e-3),
            ),
            (
                mirrax.Model(twin),
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                keras.optimizers.Adam(learning_rate=1e-3),
            ),
        ):
            model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
            histories.append(
                model.fit(x, y, batch_size=64, epochs=2, validation_split=0.2, verbose=0).history
            )
            predictions.append(model.predict(x_test, batch_size=64, verbose=0))
    keras_history, nnx_history = histories
    assert sorted(keras_history) == sorted(nnx_history)
    # The same arithmetic in two layer libraries: equal up to float rounding of the convolutions.
    for key in nnx_history:
        np.testing.assert_allclose(keras_history[key], nnx_history[key], atol=1e-5, err_msg=key)
    np.testing.assert_allclose(predictions[0], predictions[1], atol=1e-4)
    # fit wrote the trained weights back into the Keras model itself (Keras's own predict
    # broadcasts by rank, which this suite's strict setting would refuse).
    with jax.numpy_rank_promotion("allow"):
        np.testing.assert_allclose(keras_cnn.predict(x_test, verbose=0), predictions[0], atol=1e-5)


@pytest.mark.slow
def test_the_keras_example_program_trains_the_tutorial_model(capsys):
    # examples/keras_model.py's train, in this process (its script form is what
    # tests/test_examples.py runs for the NNX examples).
    _, history, accuracy = keras_model.train(mirrored(2), *DIGITS, epochs=1)
    assert sorted(history) == ["accuracy", "learning_rate", "loss", "val_accuracy", "val_loss"]
    # One epoch of ceil(1293 / 32) = 41 steps: far above chance (0.1); measured 0.67.
    assert accuracy >= 0.5
    assert capsys.readouterr().out.splitlines()[-1] == f"Test accuracy: {accuracy:.4f}"


def _regularized_dense():
    # One Dense unit on 2 inputs, weights 1, penalty 0.5 * sum(w ** 2) = 0.5 * (1 + 1) = 1.0.
    return keras.Sequential(
        [
            keras.Input((2,)),
            layers.Dense(
                1, use_bias=False, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(0.5)
            ),
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options",
    [
        ("Mirrored1CPU", {}),
        ("Mirrored2CPU", {}),
        ("Mirrored8CPU", {}),
        ("invariant", {"replica_invariant": True, "micro_batches": 8}),
    ],
)
def test_keras_regularization_losses_count_once_on_any_replica_count(name, options):
    strategy = mirrax.MirroredStrategy(jax.devices()[:4], **options) if options else mirrored(int(name[8]))
    with strategy.scope():
        model = mirrax.Model(_regularized_dense())
        model.compile(optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), loss="mse")
    # x = 0 and y = 0: the data loss is 0, so the loss is the penalty alone, 1.0.
    x, y = np.zeros((16, 2), np.float32), np.zeros((16, 1), np.float32)
    assert model.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(1.0)
    logs = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    assert logs["loss"] == [pytest.approx(1.0)]
    # d(penalty)/dw = 2 * 0.5 * w = 1 per weight: one SGD step gives 1 - 0.1 * 1 = 0.9, not
    # 1 - 0.1 * replicas (what summing a penalty added on every replica would give).
    np.testing.assert_allclose(model.get_weights()[0], [[0.9], [0.9]], rtol=1e-6)


@pytest.mark.slow
def test_a_keras_model_with_dropout_gives_the_same_bits_on_1_and_4_replicas_when_invariant():
    (x, y), _ = DIGITS
    runs = []
    for replicas in (1, 4):
        keras.utils.set_random_seed(0)
        strategy = mirrax.MirroredStrategy(jax.devices()[:replicas], replica_invariant=True, micro_batches=4)
        with strategy.scope():
            model = mirrax.Model(
                keras.Sequential(
                    [
                        keras.Input((8, 8, 1)),
                        layers.Conv2D(8, 3, activation="relu"),
                        layers.Flatten(),
                        layers.Dropout(0.3),
                        layers.Dense(10, kernel_regularizer=keras.regularizers.L2(1e-3)),
                    ]
                )
            )
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0).history
        runs.append((history["loss"], model.get_weights()))
    (losses_1, weights_1), (losses_4, weights_4) = runs
    assert losses_1 == losses_4
    assert all(np.array_equal(a, b) for a, b in zip(weights_1, weights_4))


def test_keras_dropout_draws_a_mask_per_replica_and_per_step():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(keras.Sequential([keras.Input((64,)), layers.Dropout(0.5)]))
    module = model.module
    module.train()  # Keras's training=True
    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((4, 64), np.float32)])))
    first, second = (
        np.asarray(strategy.gather(strategy.run(lambda m, x: m(x), args=(module, batch)), axis=0))
        for _ in range(2)
    )
    # Kept values are scaled by 1 / (1 - 0.5) = 2; dropped ones are 0.
    assert set(np.unique(first)) == {0.0, 2.0}
    assert not np.array_equal(first[:2], first[2:])  # replica 0's rows vs replica 1's
    assert not np.array_equal(first, second)  # the next step draws anew
    module.eval()
    np.testing.assert_array_equal(
        strategy.gather(strategy.run(lambda m, x: m(x), args=(module, batch)), axis=0), np.ones((4, 64))
    )


def test_keras_batch_norm_moving_statistics_are_averaged_over_replicas():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(keras.Sequential([keras.Input((1,)), layers.BatchNormalization()]))
        model.compile(optimizer="sgd", loss="mse")
    # Replica 0 gets rows [0, 0], replica 1 rows [2, 2]: batch means 0 and 2. Each replica
    # moves its mean to 0.99 * 0 + 0.01 * its batch mean; the MEAN over replicas is 0.01.
    model.train_on_batch(np.array([[0.0], [0.0], [2.0], [2.0]], np.float32), np.zeros((4, 1), np.float32))
    moving_mean = model.get_weights()[2]  # gamma, beta, moving_mean, moving_variance
    np.testing.assert_allclose(moving_mean, [0.01], rtol=1e-5)
    # get_weights lists what Keras's get_weights lists, in its order (seed states left out).
    assert [w.shape for w in model.get_weights()] == [(1,)] * 4
    model.set_weights([np.full((1,), v, np.float32) for v in (1.0, 2.0, 3.0, 4.0)])
    model.module.write_to_keras()
    assert [float(v.value[0]) for v in model.keras_model.weights] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), "sgd momentum"),
        (lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True), "nesterov"),
        (lambda: keras.optimizers.Adam(learning_rate=0.01), "adam"),
        (lambda: keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1), "adamw"),
        (lambda: keras.optimizers.RMSprop(learning_rate=0.01), "rmsprop"),
        (lambda: keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.5, centered=True), "centered"),
    ],
)
def test_a_keras_optimizer_is_translated_to_the_update_keras_computes(make, rule):
    from mirrax._src.training import keras_objects

    tx = keras_objects.optimizer_from_keras(make())
    # Gradients near epsilon's size (1e-7) make its placement count (Adam's eps after the
    # bias correction, RMSprop's inside the square root); the rate drops to a tenth after two
    # steps, as a callback would set it (SGD's velocity keeps the steps taken at the old rate).
    grads = [
        np.array([5e-7, -1.0, 2e-6], np.float32),
        np.array([1e-7, 0.2, -3e-7], np.float32),
        np.array([1.0, 1e-6, 1.0], np.float32),
        np.array([-2e-7, 0.5, 0.1], np.float32),
    ]
    variable = keras.Variable(np.array([1.0, 2.0, 3.0], np.float32))
    keras_optimizer = make()
    params = jnp.array([1.0, 2.0, 3.0])
    state = tx.init(params)
    for step, g in enumerate(grads):
        if step == 2:
            keras_optimizer.learning_rate.assign(keras_optimizer.learning_rate / 10)
            state.hyperparams["learning_rate"] = state.hyperparams["learning_rate"] / 10
        keras_optimizer.apply_gradients([(jnp.asarray(g), variable)])
        updates, state = tx.update(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, updates)
    # The same formulas in float32: equal up to the rounding of a few operations.
    np.testing.assert_allclose(params, np.asarray(variable.value), rtol=1e-6, err_msg=rule)
    assert "learning_rate" in state.hyperparams  # callbacks can change the rate


def test_keras_losses_and_metrics_in_compile_compute_keras_values():
    y = np.array([0, 1, 2, 1], np.int32)
    logits = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [1.0, 1.0, 3.0], [0.0, 4.0, 0.0]], np.float32)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with mirrored(2).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Identity()]))
        model.compile(optimizer="sgd", loss=keras_loss, metrics=[keras.metrics.SparseCategoricalAccuracy()])
    loss, accuracy = model.evaluate(logits, y, batch_size=4, verbose=0)
    assert loss == pytest.approx(float(keras_loss(y, logits)), rel=1e-6)
    # argmax of the rows: 0, 2, 2, 1 against labels 0, 1, 2, 1: 3 of 4 right.
    assert accuracy == pytest.approx(0.75)
    assert model.metrics[0].name == "sparse_categorical_accuracy"


@pytest.mark.slow
def test_a_keras_model_checkpoints_and_exports_like_an_nnx_module(tmp_path):
    (x, y), (x_test, _) = DIGITS
    strategy = mirrored(4)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mirrax.Model(
            keras.Sequential(
                [
                    keras.Input((8, 8, 1)),
                    layers.Conv2D(4, 3, activation="relu"),
                    layers.BatchNormalization(),
                    layers.Flatten(),
                    layers.Dropout(0.3),
                    layers.Dense(10),
                ]
            )
        )
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:256], y[:256], batch_size=64, verbose=0)
    mirrax.Checkpoint(model=model).write(tmp_path / "ckpt")
    saved = model.predict(x_test, verbose=0)
    model.fit(x[:256], y[:256], batch_size=64, verbose=0)
    assert not np.array_equal(model.predict(x_test, verbose=0), saved)
    mirrax.Checkpoint(model=model).restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(model.predict(x_test, verbose=0), saved)
    mirrax.export(
        model, tmp_path / "served", input_signature=[jax.ShapeDtypeStruct((None, 8, 8, 1), np.float32)]
    )
    served = mirrax.load_exported(tmp_path / "served")
    # The artifact runs the same program on one device; the rows are independent (eval mode).
    np.testing.assert_allclose(np.asarray(served(x_test)), saved, atol=1e-6)


@pytest.fixture
def float32_afterwards():
    yield
    mirrax.mixed_precision.set_global_policy("float32")


def test_mixed_precision_set_before_building_computes_the_keras_model_in_bfloat16(float32_afterwards):
    mirrax.mixed_precision.set_global_policy("mixed_bfloat16")
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"  # set for Keras too
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(
            keras.Sequential(
                [keras.Input((8, 8, 1)), layers.Conv2D(4, 3), layers.Flatten(), layers.Dense(10)]
            )
        )
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    module = model.module
    batch = next(iter(strategy.experimental_distribute_dataset([np.zeros((4, 8, 8, 1), np.float32)])))
    lowered = strategy.experimental_lower(
        lambda m, x: steps.forward(m, x, model.dtype_policy), args=(module, batch)
    )
    convolutions = [line for line in lowered.as_text().splitlines() if "convolution" in line]
    assert convolutions and all("bf16" in line for line in convolutions)
    assert model.predict(np.zeros((2, 8, 8, 1), np.float32), verbose=0).dtype == np.float32


def test_a_keras_model_built_under_another_policy_is_refused_at_compile(float32_afterwards):
    with mirrored(1).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Dense(2)]))
    mirrax.mixed_precision.set_global_policy("mixed_float16")
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"policy is 'mixed_float16' but the Keras model .* built under "
        r"Keras's policy 'float32'.*BEFORE building",
    ):
        model.compile(optimizer="adam", loss="mse")
    assert model.optimizer is None  # nothing half-compiled


# -- bad input ----------------------------------------------------------------------------------


def test_an_unbuilt_keras_model_is_refused_with_the_fix():
    with pytest.raises(
        mirrax.errors.InvalidArgumentError,
        match=r"Keras model 'sequential.*' is not built .*keras.Input\(shape=...\)",
    ):
        mirrax.Model(keras.Sequential([layers.Dense(2)]))


def test_a_subclassed_keras_model_whose_layers_wait_for_a_call_is_refused():
    model = _PenalizedLinear()
    with pytest.warns(UserWarning, match=r"does not have a `build\(\)` method"):  # Keras's
        model.build((None, 3))  # marks the model built; its Dense still has no kernel
    with pytest.raises(
        mirrax.errors.InvalidArgumentError, match=r"is not built .*call the model once on a batch"
    ):
        mirrax.Model(model)


def test_a_keras_model_on_another_backend_is_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"Keras's 'torch' backend.*KERAS_BACKEND=jax before Keras is first imported",
    ):
        mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Dense(2)]))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(optimizer=keras.optimizers.Adagrad()), r"Adagrad has no translation.*optax.adagrad"),
        (dict(optimizer=keras.optimizers.Adam(clipnorm=1.0)), r"clipnorm=1.0.*optax"),
        (dict(optimizer=keras.optimizers.Adam(amsgrad=True)), r"amsgrad=True\) is not translated"),
        (dict(optimizer=keras.optimizers.SGD(weight_decay=0.1)), r"weight_decay=0.1.*AdamW only"),
        (
            dict(optimizer=keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9))),
            r"learning_rate=.*constant learning rate only.*LearningRateScheduler",
        ),
        (dict(loss=keras.losses.MeanSquaredError(reduction="sum")), r"reduction='sum'.*default reduction"),
        (
            dict(loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0)),
            r"ignore_class=0.*sample_weight 0",
        ),
        (
            dict(metrics=[keras.metrics.AUC(multi_label=True, num_labels=2)]),
            r"AUC has \{.*'multi_label': True.*does not take",
        ),
        (dict(metrics=[keras.metrics.MeanIoU(num_classes=3)]), r"no metric like the Keras metric MeanIoU"),
    ],
)
def test_keras_objects_without_a_mirrax_equal_are_refused_with_the_alternative(arguments, message):
    with mirrored(1).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Dense(2)]))
    compile_arguments = dict(optimizer="adam", loss="mse") | arguments
    with pytest.raises(mirrax.errors.UnsupportedArgumentError, match=message):
        model.compile(**compile_arguments)


def test_a_keras_callback_is_refused_with_the_mirrax_one_named():
    with mirrored(1).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Dense(2)]))
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(
        mirrax.errors.InvalidArgumentTypeError,
        match=r"EarlyStopping is a Keras callback.*mirrax.callbacks.EarlyStopping",
    ):
        model.fit(np.zeros((4, 3)), np.zeros((4, 2)), callbacks=[keras.callbacks.EarlyStopping()], verbose=0)


def test_tensorboard_profile_batch_traces_those_steps_of_a_keras_model_fit(tmp_path):
    (x, y), _ = DIGITS
    with mirrored(2).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((8, 8, 1)), layers.Flatten(), layers.Dense(10)]))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(
        x[:128],
        y[:128],
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[mirrax.callbacks.TensorBoard(tmp_path, profile_batch=(2, 3))],
    )
    # TensorBoard's profile plugin reads <log_dir>/train/plugins/profile/<run>/<host>.xplane.pb.
    traces = list((tmp_path / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


class _PenalizedLinear(keras.Model):
    """A subclassed Keras model whose call adds a loss of 0.25 (and takes no `training`)."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(1, use_bias=False, kernel_initializer="zeros")

    def call(self, x):
        self.add_loss(keras.ops.convert_to_tensor(0.25))
        return self.dense(x)


def test_functional_and_subclassed_keras_models_train_and_count_add_loss():
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, layers.Dense(2, kernel_initializer="ones")(inputs))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    subclassed = _PenalizedLinear()
    subclassed(x[:1])  # builds its Dense (Keras's way for a subclassed model)
    with mirrored(2).scope():
        models = [mirrax.Model(functional), mirrax.Model(subclassed)]
    for model in models:
        model.compile(optimizer="sgd", loss="mse")
    # Kernel of ones: each output is the row's sum, 0+1+2 = 3, 3+4+5 = 12, ...
    np.testing.assert_allclose(models[0].predict(x, verbose=0), [[3, 3], [12, 12], [21, 21], [30, 30]])
    # Kernel of zeros and y = 0: the mse is 0, the loss is add_loss's 0.25 alone.
    assert models[1].evaluate(x, np.zeros((4, 1), np.float32), verbose=0) == pytest.approx(0.25)
    history = models[0].fit(x, np.zeros((4, 2), np.float32), batch_size=4, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


def test_keras_s_own_predict_after_wrapping_leaves_the_mirrax_model_intact():
    keras_cnn = keras.Sequential([keras.Input((4,)), layers.Dense(3)])
    model = mirrax.Model(keras_cnn)
    x = np.ones((8, 4), np.float32)
    with jax.numpy_rank_promotion("allow"):
        expected = keras_cnn.predict(x, verbose=0)  # Keras's jitted step donates its buffers
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)
    assert len(model.get_weights()) == 2


@pytest.mark.slow
def test_a_keras_lstm_runs_scanned_and_unrolled_alike():
    x = np.linspace(-1, 1, 8 * 6 * 3, dtype=np.float32).reshape(8, 6, 3)
    # Keras builds the LSTM by calling it symbolically, broadcasting by rank.
    with mirrored(2).scope(), jax.numpy_rank_promotion("allow"):
        scanned = mirrax.Model(keras.Sequential([keras.Input((6, 3)), layers.LSTM(4), layers.Dense(2)]))
        unrolled = mirrax.Model(
            keras.Sequential([keras.Input((6, 3)), layers.LSTM(4, unroll=True), layers.Dense(2)])
        )
    unrolled.set_weights(scanned.get_weights())
    # Same arithmetic in the same order, one loop rolled and one not; 1e-6: XLA may fuse the
    # unrolled steps' float ops differently.
    np.testing.assert_allclose(scanned.predict(x, verbose=0), unrolled.predict(x, verbose=0), atol=1e-6)


@pytest.mark.slow
def test_trainable_changed_after_wrapping_takes_effect_at_the_next_compile():
    (x, y), _ = DIGITS
    base = keras.Sequential([keras.Input((8, 8, 1)), layers.Flatten(), layers.Dense(16)])
    with mirrored(2).scope():
        model = mirrax.Model(keras.Sequential([base, layers.Dense(10)]))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base.trainable = False  # Keras's fine-tuning recipe: freeze, compile, fit
    model.compile(optimizer="adam", loss=loss)
    before = model.get_weights()
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    after = model.get_weights()
    assert [np.array_equal(a, b) for a, b in zip(before, after)] == [True, True, False, False]
    base.trainable = True  # unfrozen without compiling again: fit refuses, evaluate runs
    with pytest.raises(
        mirrax.errors.InvalidArgumentError,
        match=r"changed its `trainable` after compile \(2 trainable variables then, "
        r"4 now\).*call model.compile\(...\) again",
    ):
        model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    model.evaluate(x[:64], y[:64], batch_size=32, verbose=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-5), loss=loss)
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    assert not np.array_equal(model.get_weights()[0], after[0])


def test_a_keras_sparse_categorical_crossentropy_checks_the_labels():
    with mirrored(1).scope():
        model = mirrax.Model(keras.Sequential([keras.Input((3,)), layers.Dense(4)]))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.loss, mirrax.losses.SparseCategoricalCrossentropy)
    with pytest.raises(mirrax.errors.InvalidLabelError):
        model.fit(np.zeros((4, 3), np.float32), np.array([0, 1, 2, 7]), verbose=0)  # 7 >= 4 classes


def test_set_weights_reaches_the_keras_model_and_a_keras_weights_file_is_refused(tmp_path):
    keras_model = keras.Sequential([keras.Input((2,)), layers.Dense(1)])
    model = mirrax.Model(keras_model)
    model.set_weights([np.full((2, 1), 3.0, np.float32), np.full((1,), 1.0, np.float32)])
    np.testing.assert_array_equal(keras_model.layers[0].kernel.value, np.full((2, 1), 3.0))
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError, match=r"Keras weights file.*keras_model.load_weights\(path\)"
    ):
        model.load_weights(tmp_path / "model.weights.h5")


class _OwnTrainStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, *args, **kwargs):  # Keras's fit would call it; mirrax's does not
        raise AssertionError("not called")


def test_a_keras_model_with_its_own_train_step_warns_that_mirrax_does_not_call_it():
    keras_model = _OwnTrainStep()
    with jax.numpy_rank_promotion("allow"):  # Keras's own call broadcasts by rank
        keras_model(np.zeros((1, 2), np.float32))
    with pytest.warns(UserWarning, match=r"overrides train_step, which mirrax's fit"):
        mirrax.Model(keras_model)
