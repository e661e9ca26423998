"""Writes to a Keras model after `mirrax.Model(keras_model)` wrapped it are read back at the
next use (fit, evaluate, predict, get_weights, saves), as in Keras, whose model is its variables.

Before, the wrapper's copies kept the values of the wrapping time: `kernel.assign(...)` and
`keras_model.set_weights(...)` had no effect on training, and the next `fit` wrote the stale
values back over them.
"""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mirrax  # noqa: E402


def _dense():
    # Dense(3) on 2 features: kernel (2, 3), bias (3,).
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])


@pytest.mark.slow
def test_assign_and_set_weights_on_the_keras_model_after_wrapping_are_used(tmp_path):
    keras_model = _dense()
    model = mirrax.Model(keras_model)
    keras_model.layers[0].kernel.assign(np.ones((2, 3), np.float32))
    keras_model.layers[0].bias.assign(np.zeros(3, np.float32))
    # [1, 2] @ ones(2, 3) + 0 = [3, 3, 3]
    np.testing.assert_array_equal(
        model.predict(np.array([[1.0, 2.0]], np.float32), verbose=0), [[3.0, 3.0, 3.0]]
    )
    np.testing.assert_array_equal(model.get_weights()[0], np.ones((2, 3)))

    keras_model.set_weights([np.full((2, 3), 2.0, np.float32), np.ones(3, np.float32)])
    model.compile(optax.sgd(0.0), "mse")  # a rate of 0: fit leaves the weights as they are
    x, y = np.ones((4, 2), np.float32), np.full((4, 3), 5.0, np.float32)
    # [1, 1] @ full(2.0) + 1 = 5 = y: the loss of the written weights is 0 exactly.
    assert model.evaluate(x, y, batch_size=4, verbose=0) == 0.0
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    # fit writes its values back to the Keras model: the written ones, not the wrapping time's.
    np.testing.assert_array_equal(keras_model.get_weights()[0], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(keras_model.get_weights()[1], np.ones(3))

    keras_model.layers[0].bias.assign(np.full(3, 7.0, np.float32))
    path = mirrax.Checkpoint(model=model).write(tmp_path / "ckpt")
    restored = mirrax.Model(_dense())
    mirrax.Checkpoint(model=restored).restore(path).expect_partial()
    np.testing.assert_array_equal(restored.get_weights()[1], np.full(3, 7.0))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", compile=False)
    np.testing.assert_array_equal(loaded.get_weights()[1], np.full(3, 7.0))
