"""mirrax.losses: Keras's values, per-example shapes, string resolution, masking, label check.

Expected numbers are Keras's documented values for the same inputs (keras.losses.* docstrings),
with the arithmetic written out.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import mirrax
from mirrax import losses

Y_SPARSE = np.array([1, 2])
P3 = np.array([[0.05, 0.95, 0.0], [0.1, 0.8, 0.1]], np.float32)


def test_sparse_categorical_crossentropy_matches_keras():
    loss = losses.SparseCategoricalCrossentropy()
    # -log(0.95) = 0.0513, -log(0.1) = 2.3026; mean 1.177 (Keras's docstring value).
    np.testing.assert_allclose(loss.per_example(Y_SPARSE, P3), [-math.log(0.95), -math.log(0.1)], rtol=1e-5)
    assert float(loss(Y_SPARSE, P3)) == pytest.approx(1.177, abs=1e-3)
    # Weights [0.3, 0.7] divide by 2 examples: (0.3*0.0513 + 0.7*2.3026) / 2 = 0.814 (Keras).
    assert float(loss(Y_SPARSE, P3, sample_weight=np.array([0.3, 0.7]))) == pytest.approx(0.814, abs=1e-3)
    # Labels of shape (batch, 1) are accepted, as Keras.
    np.testing.assert_allclose(loss.per_example(Y_SPARSE[:, None], P3), loss.per_example(Y_SPARSE, P3))


def test_sparse_from_logits_equals_probabilities_of_the_softmax():
    logits = np.array([[1.0, 2.0, 0.5], [-1.0, 0.0, 3.0]], np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    by_logits = losses.SparseCategoricalCrossentropy(from_logits=True).per_example(Y_SPARSE, logits)
    by_probs = losses.SparseCategoricalCrossentropy().per_example(Y_SPARSE, probs)
    np.testing.assert_allclose(by_logits, by_probs, rtol=1e-5)
    # log_softmax by hand: row 0 picks 2 - log(e^1 + e^2 + e^0.5).
    assert float(by_logits[0]) == pytest.approx(-(2.0 - math.log(math.e + math.e**2 + math.e**0.5)), rel=1e-5)


def test_probabilities_are_clipped_with_keras_epsilon():
    # The true class has probability 0: clipped to 1e-7, loss -log(1e-7) = 16.118, not inf.
    value = losses.SparseCategoricalCrossentropy().per_example(np.array([2]), np.array([[0.5, 0.5, 0.0]]))
    assert float(value[0]) == pytest.approx(-math.log(1e-7), rel=1e-4)
    # Unnormalised probabilities are divided by their sum first, as Keras: [2, 2] -> [0.5, 0.5].
    value = losses.CategoricalCrossentropy().per_example(np.array([[1.0, 0.0]]), np.array([[2.0, 2.0]]))
    assert float(value[0]) == pytest.approx(math.log(2), rel=1e-6)
    bce = losses.BinaryCrossentropy().per_example(np.array([0.0, 1.0]), np.array([1.0, 0.0]))
    assert np.all(np.isfinite(bce)) and float(bce[1]) == pytest.approx(-math.log(1e-7), rel=1e-4)


def test_categorical_crossentropy_matches_keras_and_label_smoothing():
    onehot = np.array([[0, 1, 0], [0, 0, 1]], np.float32)
    loss = losses.CategoricalCrossentropy()
    assert float(loss(onehot, P3)) == pytest.approx(1.177, abs=1e-3)  # as the sparse case
    assert float(loss(onehot, P3, np.array([0.3, 0.7]))) == pytest.approx(0.814, abs=1e-3)
    # Smoothing 0.3 over 3 classes: labels become y * 0.7 + 0.1; row 0 = [0.1, 0.8, 0.1]:
    # -(0.1 log 0.05 + 0.8 log 0.95 + 0.1 log 1e-7) = 0.2996 + 0.0410 + 1.6118 = 1.9524.
    smooth = losses.CategoricalCrossentropy(label_smoothing=0.3).per_example(onehot, P3)
    expected = -(0.1 * math.log(0.05) + 0.8 * math.log(0.95) + 0.1 * math.log(1e-7))
    assert float(smooth[0]) == pytest.approx(expected, rel=1e-4)
    logits = np.log(P3[1:] + 0.0)
    by_logits = losses.CategoricalCrossentropy(from_logits=True).per_example(onehot[1:], logits)
    assert float(by_logits[0]) == pytest.approx(-math.log(0.1), rel=1e-5)


def test_binary_crossentropy_matches_keras():
    y_true = np.array([[0.0, 1.0], [0.0, 0.0]])
    logits = np.array([[-18.6, 0.51], [2.94, -12.8]])
    loss = losses.BinaryCrossentropy(from_logits=True)
    assert float(loss(y_true, logits)) == pytest.approx(0.865, abs=1e-3)  # Keras's docstring value
    assert float(loss(y_true, logits, np.array([0.8, 0.2]))) == pytest.approx(0.243, abs=1e-3)
    probs = np.array([[0.6, 0.4], [0.4, 0.6]])
    # Row 0: -(log 0.4 + log 0.4) / 2 = 0.9163; row 1: -(log 0.6 + log 0.4) / 2 = 0.7136; mean 0.815.
    per = losses.BinaryCrossentropy().per_example(y_true, probs)
    np.testing.assert_allclose(per, [-math.log(0.4), -(math.log(0.6) + math.log(0.4)) / 2], rtol=1e-5)
    assert float(losses.BinaryCrossentropy()(y_true, probs)) == pytest.approx(0.815, abs=1e-3)
    assert float(losses.BinaryCrossentropy()(y_true, probs, np.array([1.0, 0.0]))) == pytest.approx(
        0.458, abs=1e-3
    )
    # (batch,) labels fit (batch, 1) predictions (Keras's rank matching).
    np.testing.assert_allclose(
        losses.BinaryCrossentropy().per_example(np.array([0.0, 1.0]), np.array([[0.6], [0.6]])),
        [-math.log(0.4), -math.log(0.6)],
        rtol=1e-5,
    )


def test_regression_losses_match_keras():
    y_true = np.array([[0.0, 1.0], [0.0, 0.0]])
    y_pred = np.array([[1.0, 1.0], [1.0, 0.0]])
    mse = losses.MeanSquaredError()
    np.testing.assert_allclose(mse.per_example(y_true, y_pred), [0.5, 0.5])  # (1 + 0) / 2, (1 + 0) / 2
    assert float(mse(y_true, y_pred)) == 0.5
    assert float(mse(y_true, y_pred, np.array([0.7, 0.3]))) == pytest.approx(0.25)  # (0.35 + 0.15) / 2
    mae = losses.MeanAbsoluteError()
    assert float(mae(y_true, y_pred)) == 0.5
    assert float(mae(y_true, y_pred, np.array([0.7, 0.3]))) == pytest.approx(0.25)
    probs = np.array([[0.6, 0.4], [0.4, 0.6]])
    # All errors 0.4, 0.6 <= delta 1: 0.5 e^2 = [0.18, 0.18], [0.08, 0.18] -> 0.18, 0.13; mean 0.155.
    huber = losses.Huber()
    np.testing.assert_allclose(huber.per_example(y_true, probs), [0.18, 0.13], rtol=1e-5)
    assert float(huber(y_true, probs)) == pytest.approx(0.155, rel=1e-5)
    assert float(huber(y_true, probs, np.array([1.0, 0.0]))) == pytest.approx(0.09, rel=1e-5)  # 0.18 / 2
    # Beyond delta the loss is linear: |e| = 3, delta 1: 1 * (3 - 0.5) = 2.5.
    assert float(huber.per_example(np.array([0.0]), np.array([3.0]))[0]) == pytest.approx(2.5)


def test_per_example_averages_trailing_axes_in_float32():
    y_true = np.zeros((2, 3, 2), np.float32)
    y_pred = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    per = losses.MeanSquaredError().per_example(y_true, jnp.asarray(y_pred, jnp.bfloat16))
    assert per.shape == (2,) and per.dtype == jnp.float32
    np.testing.assert_allclose(per, [(0 + 1 + 4 + 9 + 16 + 25) / 6, (36 + 49 + 64 + 81 + 100 + 121) / 6])
    # Weights per time step (batch, 3) weigh each step before the mean, as Keras:
    # example 0 keeps only step 0: (0 + 1) / 2 * 1 / 3 = 1/6; example 1 nothing; mean over 2 = 1/12.
    weights = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(losses.MeanSquaredError()(y_true, y_pred, weights)) == pytest.approx(1 / 12)


def test_shape_errors_name_the_shapes_and_the_fix():
    with pytest.raises(ValueError, match=r"y_true of shape \(2, 3\).*CategoricalCrossentropy"):
        losses.SparseCategoricalCrossentropy().per_example(np.eye(3)[Y_SPARSE], P3)
    with pytest.raises(ValueError, match=r"y_true of shape \(2,\).*SparseCategoricalCrossentropy"):
        losses.CategoricalCrossentropy().per_example(Y_SPARSE, P3)
    with pytest.raises(ValueError, match=r"\(2, 3\) does not match y_pred of shape \(2, 2\)"):
        losses.MeanSquaredError().per_example(np.zeros((2, 3)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="sample_weight has 3 entries but the batch has 2 examples"):
        losses.MeanSquaredError()(np.zeros(2), np.zeros(2), np.ones(3))
    with pytest.raises(ValueError, match="leading batch axis"):
        losses.MeanSquaredError().per_example(1.0, 1.0)
    with pytest.raises(ValueError, match="label_smoothing must be a float in \\[0, 1\\]; received 1.5"):
        losses.CategoricalCrossentropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match="delta must be a positive float; received 0"):
        losses.Huber(delta=0)


def test_out_of_range_labels_give_nan_in_the_step_and_an_error_on_the_host():
    for from_logits in (False, True):
        per = losses.SparseCategoricalCrossentropy(from_logits=from_logits).per_example(
            np.array([1, 3, -1]), np.full((3, 3), 1 / 3, np.float32)
        )
        assert float(per[0]) == pytest.approx(math.log(3), rel=1e-5)
        assert np.isnan(per[1]) and np.isnan(per[2])  # never a silent wrap-around or 0
    check = losses.SparseCategoricalCrossentropy.check_labels
    check(np.array([0, 1, 2, 2]), 3)  # valid: no error
    check(np.array([[0.0], [2.0]]), 3)  # integer-valued floats, (n, 1)
    with pytest.raises(
        ValueError,
        match=r"3 of 6 labels .* valid range \[0, 3\): values -1, 3, 7; "
        r"the first is at flat index 1",
    ):
        check(np.array([0, 3, 1, 7, -1, 2]), 3)
    with pytest.raises(mirrax.errors.MirraxError, match=r"values 1.5"):
        check(np.array([1.5, 0.0]), 3)
    with pytest.raises(ValueError, match="num_classes must be a positive int.*received 0"):
        check(np.array([0]), 0)


def test_get_resolves_keras_names_and_aliases():
    expected = {
        "sparse_categorical_crossentropy": losses.SparseCategoricalCrossentropy,
        "SparseCategoricalCrossentropy": losses.SparseCategoricalCrossentropy,
        "categorical_crossentropy": losses.CategoricalCrossentropy,
        "binary_crossentropy": losses.BinaryCrossentropy,
        "bce": losses.BinaryCrossentropy,
        "mse": losses.MeanSquaredError,
        "MSE": losses.MeanSquaredError,
        "mean_squared_error": losses.MeanSquaredError,
        "mae": losses.MeanAbsoluteError,
        "mean_absolute_error": losses.MeanAbsoluteError,
        "MeanAbsoluteError": losses.MeanAbsoluteError,
        "huber": losses.Huber,
        "Huber": losses.Huber,
    }
    for name, cls in expected.items():
        assert type(losses.get(name)) is cls, name
    assert losses.get("mse").name == "mean_squared_error"
    assert losses.get("huber").name == "huber_loss"
    instance = losses.Huber(delta=2.0)
    assert losses.get(instance) is instance
    assert losses.get(None) is None


def test_get_wraps_functions_and_refuses_unknown_names():
    def squared(y_true, y_pred):
        return (y_true - y_pred) ** 2

    loss = losses.get(squared)
    assert isinstance(loss, losses.LossFunctionWrapper) and loss.name == "squared"
    # Per example (0 - 1)^2 = 1 and (0 - 3)^2 = 9; mean (1 + 9) / 2 = 5.
    assert float(loss(np.array([0.0, 0.0]), np.array([1.0, 3.0]))) == 5.0
    with pytest.raises(ValueError, match="returned a scalar"):
        losses.get(lambda t, p: jnp.mean(t - p)).per_example(np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="Unknown loss 'cross_entropy'. Known names: .*huber.*mse"):
        losses.get("cross_entropy")
    with pytest.raises(mirrax.errors.MirraxError, match="Could not interpret loss identifier 3"):
        losses.get(3)


def _replica_loss(y, p, w):
    return losses.SparseCategoricalCrossentropy()(y, p, w)


def test_distributed_partial_batch_gives_the_unsplit_mean(strategy):
    # 5 examples: over 4 replicas the shards are 2, 2, 1, 0 (+ padding); every example counts once.
    labels = np.array([0, 1, 2, 1, 0])
    probs = np.array(
        [[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25], [0.4, 0.4, 0.2]], np.float32
    )
    weights = np.array([1.0, 2.0, 0.5, 1.0, 0.0], np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset((labels, probs, weights))))
    shares = strategy.run(lambda b: _replica_loss(*b), args=(batch,))
    # (1 (-log .7) + 2 (-log .8) + .5 (-log .6) + 1 (-log .25) + 0) / 5 examples.
    expected = -(math.log(0.7) + 2 * math.log(0.8) + 0.5 * math.log(0.6) + math.log(0.25)) / 5
    assert float(strategy.reduce("sum", shares, axis=None)) == pytest.approx(expected, rel=1e-5)
    # Outside every strategy: the plain weighted mean over the batch, the same number.
    assert float(_replica_loss(labels, probs, weights)) == pytest.approx(expected, rel=1e-5)


def test_a_loss_or_metric_class_given_for_an_instance_is_instantiated_as_keras():
    # Keras's `get` instantiates a class; before, the class was taken for a loss function and
    # failed inside the step ("name must be a string; received JitTracer(...)").
    loss = mirrax.losses.get(mirrax.losses.MeanSquaredError)
    assert isinstance(loss, mirrax.losses.MeanSquaredError)
    # (1 - 0)^2 and (3 - 1)^2 per example: mean (1 + 4) / 2 = 2.5.
    assert float(loss(np.array([[0.0], [1.0]]), np.array([[1.0], [3.0]]))) == 2.5
    metric = mirrax.metrics.get(mirrax.metrics.MeanSquaredError)
    assert isinstance(metric, mirrax.metrics.MeanSquaredError)
