"""mirrax.Model: compile / fit / evaluate / predict, distributed and exact."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored
from tests.test_run import MLP, mlp_data


def numpy_fit_history(epochs=3, batch=8, lr=0.1):
    """Float64 reference of fit: per epoch, the mean per-example loss seen during the epoch."""
    w1, w2, x, y = (a.astype(np.float64) for a in mlp_data())
    y = y.astype(int)
    b1, b2 = np.zeros(3), np.zeros(2)
    history = []
    for _ in range(epochs):
        losses = []
        for start in range(0, 16, batch):
            xb, yb = x[start : start + batch], y[start : start + batch]
            z = xb @ w1 + b1
            h = np.maximum(z, 0)
            logits = h @ w2 + b2
            logp = logits - logits.max(1, keepdims=True)
            logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
            losses.extend(-logp[np.arange(len(yb)), yb])
            d = np.exp(logp)
            d[np.arange(len(yb)), yb] -= 1
            d /= len(yb)
            dz = (d @ w2.T) * (z > 0)
            w2, b2 = w2 - lr * h.T @ d, b2 - lr * d.sum(0)
            w1, b1 = w1 - lr * xb.T @ dz, b1 - lr * dz.sum(0)
        history.append(np.mean(losses))
    return np.array(history), w1


def fit_mlp(strategy, **fit_kwargs):
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        model = mirrax.Model(MLP(w1, w2))
        model.compile(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, **fit_kwargs)
    return model, history


@pytest.mark.slow
def test_fit_matches_float64_numpy_for_every_replica_count():
    expected, w1 = numpy_fit_history()
    results = [fit_mlp(mirrored(r)) for r in (1, 2, 4, 8)]
    for model, history in results:
        np.testing.assert_allclose(history.history["loss"], expected, atol=1e-5)
        np.testing.assert_allclose(np.asarray(model.module.l1.kernel[...]), w1, atol=1e-5)
    base = results[0][1].history
    for _, history in results[1:]:
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(history.history[key], base[key], atol=1e-5)


class Identity(nnx.Module):
    """Returns its input (plus 0 * w, so there is a parameter to optimize)."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        return x + 0.0 * self.w[...]


def identity_model(strategy, **compile_kwargs):
    with strategy.scope():
        model = mirrax.Model(Identity())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0], **compile_kwargs)
    return model


def test_logged_loss_is_the_global_mean():
    model = identity_model(mirrored(2))
    x = np.array([[2.0], [3.0], [4.0], [5.0]], np.float32)  # replicas hold [2, 3] and [4, 5]
    history = model.fit(x, np.zeros(4, np.float32), batch_size=4, verbose=0)
    assert history.history["loss"] == [3.5]  # (2 + 3 + 4 + 5) / 4, not 1.75 or 7.0


def test_evaluate_and_predict_see_every_example_once(strategy):
    model = identity_model(strategy)
    x = np.arange(1.0, 11.0, dtype=np.float32)[:, None]  # 10 examples, batches of 4: 4, 4, 2
    assert model.evaluate(x, np.zeros(10, np.float32), batch_size=4, verbose=0) == pytest.approx(5.5)
    np.testing.assert_array_equal(model.predict(x, batch_size=4, verbose=0), x)  # input order
    dataset = [x[:3], x[3:]]  # an iterable of batches, the first of 3 examples
    np.testing.assert_array_equal(model.predict(dataset, verbose=0), x)


def test_predict_copies_outputs_at_the_end_unless_a_callback_reads_each_batch():
    """Without a batch callback, predict copies outputs to the host up to 32 steps late; with
    one, each batch's outputs reach the callback. Both give every example once, in order."""
    model = identity_model(mirrored(2))
    x = np.arange(1.0, 82.0, dtype=np.float32)[:, None]  # 81 examples, batches of 2: 41 steps
    np.testing.assert_array_equal(model.predict(x, batch_size=2, verbose=0), x)
    seen = []
    reader = mirrax.callbacks.LambdaCallback(
        on_predict_batch_end=lambda batch, logs: seen.append(logs["outputs"])
    )
    np.testing.assert_array_equal(model.predict(x, batch_size=2, verbose=0, callbacks=[reader]), x)
    assert len(seen) == 41 and seen[-1].shape == (1, 1)  # 81 = 40 * 2 + 1
    np.testing.assert_array_equal(np.concatenate(seen), x)


class Linear1(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(()))

    def __call__(self, x):
        return x * self.w[...]


def test_reduce_lr_on_plateau_changes_the_next_update():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(Linear1())
        model.compile(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), loss=lambda y, y_pred: y_pred[:, 0]
        )
    weights = []
    record = mirrax.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(float(model.get_weights()[0]))
    )
    # loss = w * x with x = 1: the gradient is 1, so each epoch (one step) moves w by -lr.
    # min_delta=10 makes every epoch "no improvement": with patience 0 the rate halves after
    # epochs 1 and 2 (Keras's rule), so the steps are 0.1, 0.1, 0.05, 0.025.
    plateau = mirrax.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)
    history = model.fit(
        np.ones((2, 1), np.float32),
        np.zeros(2, np.float32),
        batch_size=2,
        epochs=4,
        callbacks=[plateau, record],
        verbose=0,
    )
    steps = -np.diff([1.0] + weights)
    np.testing.assert_allclose(steps, [0.1, 0.1, 0.05, 0.025], atol=1e-7)
    # As Keras, the log holds the rate each epoch trained with.
    np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.1, 0.05, 0.025], atol=1e-7)


def test_early_stopping_restores_the_best_weights():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(Linear1())
        model.compile(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), loss=lambda y, y_pred: y_pred[:, 0]
        )
    weights = []
    record = mirrax.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(float(model.get_weights()[0]))
    )
    # The loss falls every epoch; with mode="max" the best epoch is the first (w = 0.9), and
    # with patience 1 training stops after epoch index 1 and goes back to 0.9.
    stop = mirrax.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True)
    history = model.fit(
        np.ones((2, 1), np.float32),
        np.zeros(2, np.float32),
        batch_size=2,
        epochs=10,
        callbacks=[record, stop],
        verbose=0,
    )
    assert len(history.history["loss"]) == 2
    assert weights == pytest.approx([0.9, 0.8])
    assert float(model.get_weights()[0]) == pytest.approx(0.9)


class DropoutNet(nnx.Module):
    """Linear 4 -> 3, BatchNorm, Dropout: parameters, batch statistics and PRNG state."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.dense(x)))


def test_weights_of_a_dropout_model_leave_out_its_prng_state_as_keras():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(DropoutNet(nnx.Rngs(0)))
        model.compile("sgd", "mse")
    # Kernel (4, 3) and bias (3,); BatchNorm's scale, bias, mean and var (3,); no PRNG key or
    # count (typed keys cannot become NumPy arrays; Keras's weights leave seed state out too).
    weights = model.get_weights()
    assert [w.shape for w in weights] == [(3,), (4, 3), (3,), (3,), (3,), (3,)]
    assert model.count_params() == 4 * 3 + 3 + 4 * 3  # kernel, bias, 4 BatchNorm vectors
    with pytest.raises(mirrax.errors.UnsupportedArgumentError, match=r"save_weights\(path\)"):
        model.save("model.keras")
    model.set_weights([w + 1.0 for w in weights])
    np.testing.assert_array_equal(model.module.dense.kernel[...], weights[1] + 1.0)
    # EarlyStopping's restore_best_weights and TensorBoard's histograms go through them.
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    y = np.zeros((8, 3), np.float32)
    stop = mirrax.callbacks.EarlyStopping(monitor="loss", mode="max", patience=0, restore_best_weights=True)
    history = model.fit(x, y, batch_size=4, epochs=3, callbacks=[stop], verbose=0)
    assert len(history.history["loss"]) <= 3 and stop.best_weights is not None


def test_callbacks_changes_to_weights_are_used_by_the_next_step():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(Linear1())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    seen = []
    reset = mirrax.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: model.set_weights([np.float32(5.0)]),
        on_train_batch_begin=lambda batch, logs: seen.append(float(model.get_weights()[0])),
    )
    model.fit(
        np.ones((2, 1), np.float32),
        np.zeros(2, np.float32),
        batch_size=2,
        epochs=2,
        callbacks=[reset],
        verbose=0,
    )
    assert seen == pytest.approx([1.0, 5.0])  # epoch 2 starts from the weights the callback set


def test_terminate_on_nan_stops_after_the_batch(capsys):
    x = np.array([[1.0], [1.0], [np.nan], [1.0]], np.float32)
    model = identity_model(mirrored(2))
    history = model.fit(
        x,
        np.zeros(4, np.float32),
        batch_size=1,
        epochs=3,
        shuffle=False,
        callbacks=[mirrax.callbacks.TerminateOnNaN()],
        verbose=0,
    )
    assert "Batch 2: Invalid loss, terminating training" in capsys.readouterr().out
    assert np.isnan(history.history["loss"][0]) and len(history.history["loss"]) == 1
    model = identity_model(mirrored(2))
    history = model.fit(x, np.zeros(4, np.float32), batch_size=1, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isnan(history.history["loss"]).all()


def test_progress_output_is_keras_style(capsys):
    model = identity_model(mirrored(2), metrics=None)
    model.fit(np.ones((4, 1), np.float32), np.zeros(4, np.float32), batch_size=2, epochs=1, verbose=2)
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and "loss: 1.0000" in out


# -- mixed precision -----------------------------------------------------------------------------


def test_float16_overflow_on_one_replica_skips_the_step_everywhere():
    strategy = mirrored(2)
    mirrax.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = mirrax.Model(Linear1())
            model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    finally:
        mirrax.mixed_precision.set_global_policy("float32")
    # Replica 1's example overflows float16 (1e6 > 65504): its gradient is inf.
    x = np.array([[1.0], [1e6]], np.float32)
    model.fit(x, np.zeros(2, np.float32), batch_size=2, verbose=0)
    assert float(model.get_weights()[0]) == 1.0  # the step was skipped on every replica
    assert float(model.optimizer.dynamic_scale.scale[...]) == 16384.0  # 2**15 / 2
    model.fit(np.ones((2, 1), np.float32), np.zeros(2, np.float32), batch_size=2, verbose=0)
    assert float(model.get_weights()[0]) == pytest.approx(1.0 - 0.01)  # Keras SGD: lr 0.01, grad 1


def test_mixed_bfloat16_trains_close_to_float32():
    float32_model, float32_history = fit_mlp(mirrored(2))
    mirrax.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model, history = fit_mlp(mirrored(2))
    finally:
        mirrax.mixed_precision.set_global_policy(None)
    assert model.dtype_policy.compute_dtype == "bfloat16"
    assert model.module.l1.kernel[...].dtype == jnp.float32  # variables stay float32
    np.testing.assert_allclose(history.history["loss"], float32_history.history["loss"], atol=2e-2)


# -- bad input -----------------------------------------------------------------------------------


def test_bad_input_gets_clear_errors():
    model = mirrax.Model(Identity())
    with pytest.raises(RuntimeError, match=r"not compiled.*model.compile"):
        model.fit(np.ones((2, 1)), np.ones(2))
    with pytest.raises(ValueError, match=r"Unknown optimizer 'adamax'.*adam, adamw, rmsprop, sgd"):
        model.compile("adamax", loss="mse")
    with pytest.raises(ValueError, match="Unknown loss 'msee'|'msee'"):
        model.compile("adam", loss="msee")
    with pytest.raises(ValueError, match="'accuracyy'"):
        model.compile("adam", loss="mse", metrics=["accuracyy"])
    model.compile("sgd", loss="mse")
    with pytest.raises(ValueError, match="x has 3 examples but y has 2"):
        model.fit(np.ones((3, 1)), np.ones(2), verbose=0)
    with pytest.raises(ValueError, match="validation_split is only supported for NumPy array inputs"):
        model.fit((b for b in [(np.ones((2, 1)), np.ones(2))]), validation_split=0.5, verbose=0)
    with pytest.raises(ValueError, match="batch_size=4 was given with a list"):
        model.fit([(np.ones((2, 1)), np.ones(2))], batch_size=4, verbose=0)


def test_sparse_labels_out_of_range_are_refused():
    strategy = mirrored(2)
    w1, w2, x, _ = mlp_data()
    with strategy.scope():
        model = mirrax.Model(MLP(w1, w2))
        model.compile("sgd", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels = np.zeros(16, np.int32)
    labels[5] = 7  # the MLP has 2 classes
    with pytest.raises(ValueError, match=r"\[0, 2\): values 7; the first is at flat index 5"):
        model.fit(x, labels, batch_size=8, verbose=0)


def test_early_stopping_without_an_inferable_mode_says_to_pass_mode():
    # A logged metric whose name tells no direction ("weird_quantity" is neither a loss nor
    # an accuracy-like name).
    weird = mirrax.metrics.MeanMetricWrapper(lambda y, y_pred: y_pred[:, 0], name="weird_quantity")
    model = identity_model(mirrored(2), metrics=[weird])
    stop = mirrax.callbacks.EarlyStopping(monitor="weird_quantity")
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="mode"):
        model.fit(np.ones((2, 1), np.float32), np.zeros(2, np.float32), callbacks=[stop], verbose=0)


# -- steps_per_execution and gradient accumulation ----------------------------------------------


def test_steps_per_execution_gives_the_same_training():
    expected, w1 = numpy_fit_history()
    w1_init, w2, x, y = mlp_data()
    strategy = mirrored(4)
    with strategy.scope():
        model = mirrax.Model(MLP(w1_init, w2))
        model.compile(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=2,
        )
    batches_seen = []
    record = mirrax.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches_seen.append(batch)
    )
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[record])
    np.testing.assert_allclose(history.history["loss"], expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.module.l1.kernel[...]), w1, atol=1e-5)
    assert batches_seen == [1, 1, 1]  # one call per epoch: steps 0 and 1 together


def test_steps_per_execution_with_a_partial_last_batch_divides_by_its_own_examples():
    w1, w2, x, y = mlp_data()
    x, y = x[:12], y[:12]  # batches of 8 and 4: one call of two micro-steps of different sizes
    strategy = mirrored(4)
    results = []
    for steps_per_execution in (1, 2):
        with strategy.scope():
            model = mirrax.Model(MLP(w1, w2))
            model.compile(
                optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
            )
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], model.get_weights()))
    # The second micro-step's loss is its sum over 4 examples / 4 (the first step's 8 would halve
    # its gradient): the same training as one step per call.
    np.testing.assert_allclose(results[0][0], results[1][0], atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


class _StepRecorder(mirrax.callbacks.Callback):
    """Records the step indices the test and predict batch hooks get, and predict's outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test end", batch))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict end", batch, np.asarray(logs["outputs"]).ravel().tolist()))


def test_steps_per_execution_runs_evaluate_and_predict_k_steps_per_call_as_keras():
    # 10 examples x = 1..10 at batch 4 over 4 replicas: batches of 4, 4 and 2 (the last one
    # partial: replicas hold 1, 1, 0, 0 of its rows). steps_per_execution=3 runs all three in
    # one call; each keeps its own rows (the partial one is not read with the first's mask).
    model = identity_model(mirrored(4), steps_per_execution=3)
    x = np.arange(1.0, 11.0, dtype=np.float32)[:, None]
    y = np.zeros(10, np.float32)
    recorder = _StepRecorder()
    # The loss is the identity's output, so the mean loss is (1 + ... + 10) / 10 = 5.5.
    assert model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[recorder]) == 5.5
    # The identity's outputs: every example once, in order; Keras's hooks run once per call,
    # with the first and last step's index, and predict's gets all three steps' outputs.
    assert model.predict(x, batch_size=4, verbose=0, callbacks=[recorder]).tolist() == x.tolist()
    assert recorder.calls == [
        ("test begin", 0),
        ("test end", 2),
        ("predict begin", 0),
        ("predict end", 2, list(range(1, 11))),
    ]
    # Without hooks that read the outputs, predict copies them late: the same rows.
    assert model.predict(x, batch_size=4, verbose=0).tolist() == x.tolist()
    # fit's validation is evaluate's loop: the same 5.5 (the identity's w gets zero gradient).
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y))
    assert history.history["val_loss"] == [5.5]


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_steps_per_execution_gives_evaluate_and_predict_of_one_step_per_call(steps_per_execution):
    # The same computation per batch, in one program or several: equal to float32 rounding
    # (XLA may fuse one program's ops differently; the sums are of the same values).
    w1, w2, x, y = mlp_data()
    x, y = x[:14], y[:14]  # batches of 4, 4, 4, 2 at batch_size 4
    results = []
    for k in (1, steps_per_execution):
        with mirrored(2).scope():
            model = mirrax.Model(MLP(w1, w2))
            model.compile(
                "sgd",
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=k,
            )
        results.append(
            (
                model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True),
                model.predict(x, batch_size=4, verbose=0),
            )
        )
    (logs_1, predicted_1), (logs_k, predicted_k) = results
    assert logs_1.keys() == logs_k.keys()
    for key in logs_1:
        assert logs_k[key] == pytest.approx(logs_1[key], rel=1e-6), key
    assert predicted_k.shape == predicted_1.shape == (14, 2)
    np.testing.assert_allclose(predicted_k, predicted_1, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_equals_one_step_on_the_larger_batch():
    w1, w2, x, y = mlp_data()
    strategy = mirrored(2)
    results = []
    for batch_size, accumulation in ((16, 1), (4, 4)):
        with strategy.scope():
            model = mirrax.Model(MLP(w1, w2))
            model.compile(
                optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                gradient_accumulation_steps=accumulation,
            )
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        results.append(model.get_weights())
        assert model.optimizer.learning_rate == pytest.approx(0.1)
    # 4 micro-batches of 4, averaged, applied once == one SGD step on all 16.
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_generator_is_read_across_epochs_with_steps_per_epoch():
    model = identity_model(mirrored(2))

    def endless():
        value = 0.0
        while True:
            value += 1.0
            yield np.full((2, 1), value, np.float32), np.zeros(2, np.float32)

    history = model.fit(endless(), steps_per_epoch=2, epochs=2, verbose=0)
    # Epoch 1 sees batches of 1s and 2s (mean 1.5), epoch 2 the 3s and 4s (mean 3.5).
    assert history.history["loss"] == [1.5, 3.5]
    # A finite generator over 2 epochs without steps_per_epoch: epoch 2 would find it
    # exhausted, so fit refuses before any step (Keras trains epoch 2 on nothing).
    finite = ((np.ones((2, 1), np.float32), np.zeros(2, np.float32)) for _ in range(2))
    model = identity_model(mirrored(2))
    with pytest.raises(
        mirrax.errors.EmptyDatasetError, match="x is a generator .* read 2 times without steps_per_epoch"
    ):
        model.fit(finite, epochs=2, verbose=0)
    with pytest.raises(
        mirrax.errors.EmptyDatasetError,
        match="validation_data is a generator .* read 3 times without validation_steps",
    ):
        model.fit(endless(), steps_per_epoch=1, epochs=3, validation_data=finite, verbose=0)
    assert model.optimizer.iterations == 0
    # With steps_per_epoch, a finite generator that runs dry in a later epoch says so then.
    short = ((np.ones((2, 1), np.float32), np.zeros(2, np.float32)) for _ in range(2))
    with pytest.raises(mirrax.errors.EmptyDatasetError, match="generator given as x is exhausted"):
        model.fit(short, steps_per_epoch=2, epochs=2, verbose=0)


def test_save_and_load_weights_round_trip_and_refuse_other_structures(tmp_path):
    model, _ = fit_mlp(mirrored(4))
    model.save_weights(tmp_path / "weights")
    w1, w2, _, _ = mlp_data()
    fresh = mirrax.Model(MLP(w1, w2))  # untrained, default strategy
    fresh.load_weights(tmp_path / "weights")
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    other = mirrax.Model(nnx.Linear(4, 5, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"\['kernel'\] is in the checkpoint but not in the model|\['l1'\]"):
        other.load_weights(tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match="no weights directory"):
        fresh.load_weights(tmp_path / "missing")


def test_summary_lists_variables_and_the_total():
    lines = []
    w1, w2, _, _ = mlp_data()
    mirrax.Model(MLP(w1, w2)).summary(print_fn=lines.append)
    assert lines[0] == 'Model: "MLP"'
    assert any(line.startswith("l1.kernel") and line.rstrip().endswith("12") for line in lines)
    # 4*3 + 3 + 3*2 + 2 = 23 values.
    assert lines[-1] == "Total: 23 values"


def test_fit_and_evaluate_take_an_already_distributed_dataset():
    strategy = mirrored(2)
    model = identity_model(strategy)
    x = np.array([[2.0], [3.0], [4.0], [5.0], [6.0]], np.float32)
    dataset = strategy.experimental_distribute_dataset(
        [(x[:4], np.zeros(4, np.float32)), (x[4:], np.zeros(1, np.float32))]
    )
    history = model.fit(dataset, epochs=1, verbose=0)
    assert history.history["loss"] == [4.0]  # (2 + 3 + 4 + 5 + 6) / 5, the partial batch counted once
    assert model.evaluate(dataset, verbose=0) == pytest.approx(4.0)


def test_fits_array_batches_are_those_of_experimental_distribute_dataset():
    from mirrax._src.distribute.batching import place_host_batches

    strategy = mirrored(4)
    x = np.arange(23 * 2, dtype=np.float32).reshape(23, 2)
    y = np.arange(23, dtype=np.int32)
    for size in (8, 10):  # 8, 8, 7 (4 rows per replica); 10, 10, 3 (3, 3, 3, 1 per replica)
        batches = [(x[i : i + size], y[i : i + size]) for i in range(0, 23, size)]
        fast = list(place_host_batches(strategy, batches))
        general = list(strategy.experimental_distribute_dataset(batches))
        assert len(fast) == len(general) == 3
        for a, b in zip(fast, general):
            for leaf_a, leaf_b in zip(a, b):
                np.testing.assert_array_equal(np.asarray(leaf_a.stacked), np.asarray(leaf_b.stacked))
                np.testing.assert_array_equal(np.asarray(leaf_a.mask), np.asarray(leaf_b.mask))
                assert leaf_a.lengths == leaf_b.lengths
                assert leaf_a.stacked.sharding == leaf_b.stacked.sharding
        # TF's split rule on the last batch: 7 -> ceil(7/4) = 2: 2, 2, 2, 1 (of 2 rows);
        # 3 -> 1, 1, 1, 0 (of the first batch's ceil(10/4) = 3 rows).
        assert fast[-1][0].lengths == {8: (2, 2, 2, 1), 10: (1, 1, 1, 0)}[size]
        assert fast[-1][0].stacked.shape == {8: (4, 2, 2), 10: (4, 3, 2)}[size]


def test_fit_and_evaluate_refuse_arrays_without_examples():
    model = identity_model(mirrored(2))
    empty_x, empty_y = np.zeros((0, 1), np.float32), np.zeros((0,), np.float32)
    for call in (model.fit, model.evaluate):
        with pytest.raises(ValueError, match=r"x has 0 examples \(shape \(0, 1\)\)"):
            call(empty_x, empty_y, verbose=0)


# -- the hooks fit asks callbacks (Callback.needs_batch_logs, Callback.resume_point) -------------


class _Recorder(mirrax.callbacks.Callback):
    def __init__(self, needs: bool, point=None):
        super().__init__()
        self.needs, self.point, self.batch_logs, self.epochs = needs, point, [], []

    def needs_batch_logs(self, hook):
        return self.needs

    def resume_point(self):
        return self.point

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def test_fit_makes_batch_logs_only_for_a_callback_that_needs_them():
    model = identity_model(mirrored(2))
    x = np.array([[2.0], [3.0], [4.0], [5.0]], np.float32)
    quiet, reader = _Recorder(needs=False), _Recorder(needs=True)
    model.fit(x, np.zeros(4, np.float32), batch_size=4, verbose=0, callbacks=[quiet])
    assert quiet.batch_logs == [{}]  # its hook ran, without logs: no wait for the step
    model.fit(x, np.zeros(4, np.float32), batch_size=4, verbose=0, callbacks=[reader])
    # The identity model's loss is the mean of its inputs: (2 + 3 + 4 + 5) / 4.
    assert reader.batch_logs == [{"loss": 3.5}]


def test_fit_resumes_where_a_callback_says():
    model = identity_model(mirrored(2))
    x = np.ones((4, 1), np.float32)
    resumer = _Recorder(needs=False, point=(2, 0))
    history = model.fit(x, np.zeros(4, np.float32), batch_size=4, epochs=4, verbose=0, callbacks=[resumer])
    assert resumer.epochs == [2, 3]  # epochs 0 and 1 were done before the resume point
    assert len(history.history["loss"]) == 2


class _ClippedModel(mirrax.Model):
    """A Keras-style override: the default step, then every weight clipped to [0, 1.5]."""

    def train_step(self, data):
        super().train_step(data)
        for variable in jax.tree.leaves(
            nnx.state(self.module, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
        ):
            variable[...] = jnp.clip(variable[...], 0.0, 1.5)


def test_an_overridden_train_step_is_what_fit_runs_on_every_replica():
    strategy = mirrored(2)
    with strategy.scope():
        model = _ClippedModel(Linear1())
        model.compile(optax.sgd(1.0), loss=lambda y, y_pred: y_pred[:, 0])
    # loss = w * x with x = -1: the gradient is -1, so SGD(1.0) moves w from 1 to 2 each step;
    # the override clips it to 1.5, and the loss tracker (the default step's) logs -w * 1 = -1.
    history = model.fit(
        -np.ones((4, 1), np.float32), np.zeros(4, np.float32), batch_size=4, epochs=2, verbose=0
    )
    assert float(model.get_weights()[0]) == 1.5
    assert history.history["loss"] == [-1.0, -1.5]
    train_function = model.make_train_function()
    batch = next(
        iter(
            strategy.experimental_distribute_dataset((-np.ones((4, 1), np.float32), np.zeros(4, np.float32)))
        )
    )
    train_function(batch)
    assert float(model.get_weights()[0]) == 1.5 and model.get_metrics_result()["loss"] == -1.5


def test_train_step_outside_fit_says_where_it_runs():
    model = identity_model(mirrored(2))
    with pytest.raises(mirrax.errors.ReplicaContextError, match="runs inside strategy.run"):
        model.train_step((np.ones((2, 1)), np.zeros(2)))


@pytest.mark.parametrize("point", [(-1, 0), (1,), "ab", (1.5, 0), (True, 0), (0, -2)])
def test_a_malformed_resume_point_is_refused_by_name(point):
    model = identity_model(mirrored(2))
    with pytest.raises(
        mirrax.errors.InvalidArgumentError, match=r"_Recorder.resume_point\(\) returned .* two ints >= 0"
    ):
        model.fit(
            np.ones((4, 1), np.float32),
            np.zeros(4, np.float32),
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[_Recorder(needs=False, point=point)],
        )


def test_a_resume_point_past_the_last_epoch_warns_that_nothing_trains():
    model = identity_model(mirrored(2))
    with pytest.warns(UserWarning, match="at or after epochs=3: training is already done"):
        history = model.fit(
            np.ones((4, 1), np.float32),
            np.zeros(4, np.float32),
            batch_size=4,
            epochs=3,
            verbose=0,
            callbacks=[_Recorder(needs=False, point=(3, 0))],
        )
    assert history.history == {}


def test_train_function_refuses_a_batch_that_is_not_distributed():
    model = identity_model(mirrored(2))
    train_function = model.make_train_function()
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError, match="a distributed batch"):
        train_function((np.ones((4, 1), np.float32), np.zeros(4, np.float32)))


class _DropoutIdentity(nnx.Module):
    """The identity through a Dropout that, in training mode, drops about every example."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))
        self.dropout = nnx.Dropout(0.999, rngs=nnx.Rngs(dropout=0))

    def __call__(self, x):
        return self.dropout(x) + 0.0 * self.w[...]


def test_test_function_runs_evaluate_steps_on_distributed_batches_as_keras():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(_DropoutIdentity())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    model.module.train()  # each call puts the module in inference mode
    test_function = model.make_test_function()
    x = np.arange(1.0, 7.0, dtype=np.float32)[:, None]
    model.reset_metrics()
    for batch in strategy.experimental_distribute_dataset(
        [(x[:4], np.zeros(4, np.float32)), (x[4:], np.zeros(2, np.float32))]
    ):
        assert test_function(batch) is None
    # Dropout off (inference): the mean loss is the mean of x, (1 + ... + 6) / 6 = 3.5.
    assert model.get_metrics_result() == {"loss": 3.5}
    with pytest.raises(
        mirrax.errors.InvalidArgumentTypeError, match="test_function: batch must be a distributed batch"
    ):
        test_function((x, np.zeros(6, np.float32)))
    with pytest.raises(mirrax.errors.NotCompiledError, match="make_test_function"):
        mirrax.Model(_DropoutIdentity()).make_test_function()


def test_train_and_test_functions_alternate_modes_and_name_a_batch_without_labels():
    # A custom loop of Keras's kind: each function sets the module's mode at its call, so
    # a test function made (or run) in between does not leave the training steps without
    # Dropout.
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(_DropoutIdentity())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    train_function, test_function = model.make_train_function(), model.make_test_function()
    x = np.ones((4, 1), np.float32)
    (batch,) = strategy.experimental_distribute_dataset([(x, np.zeros(4, np.float32))])
    test_function(batch)
    assert model.module.dropout.deterministic is True
    train_function(batch)
    assert model.module.dropout.deterministic is False
    test_function(batch)
    assert model.module.dropout.deterministic is True
    (inputs_only,) = strategy.experimental_distribute_dataset([x])
    for function in (train_function, test_function):
        with pytest.raises(
            mirrax.errors.InvalidBatchError,
            match=r"\(and train_function / test_function\): each batch must be a "
            r"tuple \(x, y\) or \(x, y, sample_weight\); received an array "
            r"\(x alone\)\. Give the labels",
        ):
            function(inputs_only)
