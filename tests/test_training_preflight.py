"""The check `fit` / `evaluate` / `predict` make before the first step (one abstract run of the
module on one example): it is traced in the strategy's replica mesh, as the step is, so
synchronized BatchNorm trains on every replica count, and an error of the module's own code is
not reported as an input that does not fit (issue 27, item 1)."""

import jax
import numpy as np
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from tests.conftest import mirrored

# 16 examples 0, 1, ..., 15: mean 7.5, (biased) variance (16^2 - 1) / 12 = 21.25.
X = np.arange(16, dtype=np.float32).reshape(16, 1)


class SyncedNorm(nnx.Module):
    """Synchronized BatchNorm alone (the README's recipe), keeping each batch's statistics."""

    def __init__(self):
        self.norm = nnx.BatchNorm(1, momentum=0.0, axis_name=mirrax.REPLICA_AXIS, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.norm(x)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [0, 1, 2, 4])  # 0: OneDeviceStrategy
def test_synchronized_batch_norm_fits_with_the_global_batchs_statistics(replicas):
    strategy = mirrored(replicas)
    with strategy.scope():
        model = mirrax.Model(SyncedNorm())
        model.compile("sgd", "mse")
    # One step on the whole batch, cut over the replicas (on 2: rows 0-7 and 8-15, whose own
    # variances are (8^2 - 1) / 12 = 5.25 each, so per-replica statistics would give 5.25).
    history = model.fit(X, X, batch_size=16, shuffle=False, verbose=0)
    assert float(model.module.norm.mean[...][0]) == pytest.approx(7.5)
    assert float(model.module.norm.var[...][0]) == pytest.approx(21.25)
    # The first step's loss is computed before the update, with scale 1, bias 0:
    # mean((x - 7.5) / sqrt(21.25 + 1e-5) - x)^2), in float32 (hence the tolerance).
    z = (X - 7.5) / np.sqrt(21.25 + 1e-5)
    assert history.history["loss"][0] == pytest.approx(float(np.mean((z - X) ** 2)), rel=1e-5)
    # Evaluate and predict use the moving statistics, and pass their own pre-flight.
    predictions = model.predict(X, batch_size=16, verbose=0)
    scale, bias = float(model.module.norm.scale[...][0]), float(model.module.norm.bias[...][0])
    expected = (X - 7.5) / np.sqrt(21.25 + 1e-5) * scale + bias
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-5)
    assert model.evaluate(X, X, batch_size=16, verbose=0) == pytest.approx(
        float(np.mean((expected - X) ** 2)), rel=1e-5
    )


class _Undefined(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(1, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x) * undefined_scale  # noqa: F821 (the module's own bug)


class _PythonBranch(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(1, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        if x.sum() > 0:  # Python control flow on a traced value
            return self.dense(x)
        return x


@pytest.mark.parametrize(
    "module, error, text",
    [
        (_Undefined, NameError, "name 'undefined_scale' is not defined"),
        (_PythonBranch, jax.errors.TracerBoolConversionError, "Attempted boolean conversion"),
    ],
)
def test_an_error_of_the_modules_own_code_is_not_reported_as_an_input_error(module, error, text):
    with mirrored(2).scope():
        model = mirrax.Model(module())
        model.compile("sgd", "mse")
    with pytest.raises(error, match=text) as info:
        model.fit(X, X, batch_size=16, verbose=0)
    assert not isinstance(info.value, errors.IncompatibleInputError)


def test_an_input_that_does_not_fit_is_still_named_inside_the_replica_mesh():
    with mirrored(2).scope():
        model = mirrax.Model(SyncedNorm())
        model.compile("sgd", "mse")
    # BatchNorm(1) cannot take 3 features: flax's shape error, as an input error.
    with pytest.raises(
        errors.IncompatibleInputError, match=r"fit: the model cannot take x of shape \(16, 3\) \(float32\)"
    ):
        model.fit(np.zeros((16, 3), np.float32), X, batch_size=16, verbose=0)
