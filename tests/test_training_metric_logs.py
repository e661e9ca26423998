"""Metrics of several thresholds in fit / evaluate logs: one scalar entry per threshold
(`precision_0.3`, `precision_0.6`), where Keras 3 logs one vector; other non-scalar results are
refused at compile, before any step trains."""

import csv

import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax import errors

# Predictions are x itself (the weight is 0 and the learning rate 0): p = [0.2, 0.4, 0.7, 0.9].
X = np.array([[0.2], [0.4], [0.7], [0.9]], np.float32)
Y = np.array([[0], [1], [0], [1]], np.float32)
# Threshold 0.3: positive 0.4, 0.7, 0.9 -> tp 2 (0.4, 0.9), fp 1 (0.7) -> 2 / 3.
# Threshold 0.6: positive 0.7, 0.9 -> tp 1 (0.9), fp 1 (0.7) -> 1 / 2.
EXPECTED = {"precision_0.3": 2 / 3, "precision_0.6": 0.5}


class _Identity(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((1, 1)))

    def __call__(self, x):
        return x + self.w[...]


def _model(metric):
    model = mirrax.Model(_Identity())
    model.compile(optax.sgd(0.0), "binary_crossentropy", metrics=[metric])
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: mirrax.metrics.Precision(thresholds=[0.3, 0.6]),
        lambda: keras.metrics.Precision(thresholds=[0.3, 0.6]),
    ],
    ids=["mirrax", "keras"],
)
def test_several_thresholds_log_one_scalar_per_threshold(make, tmp_path):
    model = _model(make())
    path = tmp_path / "log.csv"
    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=1,
        verbose=0,
        validation_data=(X, Y),
        callbacks=[
            mirrax.callbacks.CSVLogger(str(path)),
            mirrax.callbacks.EarlyStopping(monitor="val_precision_0.6"),
        ],
    )
    assert set(history.history) - {"learning_rate"} == {
        "loss",
        *EXPECTED,
        "val_loss",
        *(f"val_{key}" for key in EXPECTED),
    }
    for key, value in EXPECTED.items():
        assert history.history[key] == [pytest.approx(value)]
        assert history.history[f"val_{key}"] == [pytest.approx(value)]
    with open(path) as f:
        header = next(csv.reader(f))
    assert {"precision_0.3", "precision_0.6", "val_precision_0.3"} <= set(header)
    logs = model.evaluate(X, Y, batch_size=4, verbose=0, return_dict=True)
    assert {k: logs[k] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert model.metrics_names == ["loss", "precision_0.3", "precision_0.6"]
    assert len(model.evaluate(X, Y, batch_size=4, verbose=0)) == 3  # loss, then one per threshold


def test_the_progress_bar_shows_each_threshold(capsys):
    _model(mirrax.metrics.Precision(thresholds=[0.3, 0.6])).fit(X, Y, batch_size=4, verbose=2)
    out = capsys.readouterr().out
    assert "precision_0.3: 0.6667" in out and "precision_0.6: 0.5000" in out


@pytest.mark.slow
def test_several_thresholds_under_a_mirrored_strategy():
    with mirrax.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = _model(mirrax.metrics.Precision(thresholds=[0.3, 0.6]))
    # Each replica counts 2 rows; the summed counts give the single-device values above.
    logs = model.evaluate(X, Y, batch_size=4, verbose=0, return_dict=True)
    assert {k: logs[k] for k in EXPECTED} == pytest.approx(EXPECTED)


@pytest.mark.slow
def test_one_threshold_in_a_list_keeps_the_plain_name():
    logs = _model(mirrax.metrics.Recall(thresholds=[0.3])).evaluate(
        X, Y, batch_size=4, verbose=0, return_dict=True
    )
    # Threshold 0.3: labels 1 at 0.4 and 0.9, both above -> recall 2 / 2.
    assert logs["recall"] == pytest.approx(1.0)


class _VectorMetric(mirrax.metrics.Mean):
    def result(self):
        return jnp.stack([super().result(), super().result()])


def test_a_vector_result_is_refused_at_compile_naming_the_metric():
    with pytest.raises(errors.InvalidArgumentError) as info:
        _model(_VectorMetric(name="pair"))
    message = str(info.value)
    assert "'pair' (_VectorMetric)" in message
    assert "shape (2,)" in message
    assert "Return a scalar from result()" in message
