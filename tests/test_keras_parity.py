"""The "Keras 3 models" table of docs/training.md, row by row: each model shape trained by
`mirrax.Model.fit` on one replica ends with the weights Keras's own `fit` gives it.

Both start from the same weights (the Keras model is cloned and given the original's weights
before mirrax wraps it) and see the same batches (shuffle=False, a batch size that divides the
data, so no partial batch), with plain SGD (no epsilon to amplify float rounding). The
tolerance 1e-5 covers float sums in another order: Keras's jitted step and mirrax's compiled
step fuse the same arithmetic differently."""

import jax
import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from tests.conftest import mirrored  # noqa: E402

pytestmark = pytest.mark.slow

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)


@pytest.fixture(autouse=True)
def _keras_broadcasts_by_rank():
    # Keras's layers add (batch, units) + (units,); the suite's strict setting would refuse it.
    with jax.numpy_rank_promotion("allow"):
        yield


N, BATCH, EPOCHS = 64, 16, 2  # 4 full batches an epoch


def _dense_relu():
    return keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="relu"), layers.Dense(3)])


def _cnn():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(4, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(3),
        ]
    )


def _regularized():
    return keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(
                8,
                activation="tanh",
                kernel_regularizer=keras.regularizers.L2(1e-2),
                activity_regularizer=keras.regularizers.L1(1e-3),
            ),
            layers.Dense(3, bias_regularizer=keras.regularizers.L2(1e-2)),
        ]
    )


def _batch_norm():
    return keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(8),
            layers.BatchNormalization(),
            layers.Activation("relu"),
            layers.Dense(3),
        ]
    )


def _recurrent(layer):
    return lambda: keras.Sequential([keras.Input((5, 3)), layer(), layers.Dense(3)])


def _stacked_recurrent():
    return keras.Sequential(
        [
            keras.Input((5, 3)),
            layers.GRU(4, return_sequences=True),
            layers.Bidirectional(layers.LSTM(3, return_sequences=True)),
            layers.SimpleRNN(4),
            layers.Dense(3),
        ]
    )


def _embedding_attention():
    # A transformer block over token ids: embedding, self-attention, residual + layer norm.
    tokens = keras.Input((5,), dtype="int32")
    h = layers.Embedding(11, 8)(tokens)
    h = layers.LayerNormalization()(h + layers.MultiHeadAttention(2, 4)(h, h))
    return keras.Model(tokens, layers.Dense(3)(layers.GlobalAveragePooling1D()(h)))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.head = layers.Dense(8, activation="relu"), layers.Dense(3)

    def call(self, x):
        return self.head(self.hidden(x))


def _subclassed():
    model = _Subclassed()
    model(np.zeros((1, 6), np.float32))  # built: mirrax takes built models only
    return model


def _inputs(kind, rng):
    if kind == "vector":
        return rng.normal(size=(N, 6)).astype(np.float32)
    if kind == "image":
        return rng.normal(size=(N, 8, 8, 1)).astype(np.float32)
    if kind == "sequence":
        return rng.normal(size=(N, 5, 3)).astype(np.float32)
    return rng.integers(0, 11, size=(N, 5)).astype(np.int32)  # tokens


ROWS = {
    "Dense (Sequential)": (_dense_relu, "vector"),
    "Conv2D, MaxPooling2D, Flatten": (_cnn, "image"),
    "kernel / bias / activity regularizers": (_regularized, "vector"),
    "BatchNormalization (full batches)": (_batch_norm, "vector"),
    "LSTM": (_recurrent(lambda: layers.LSTM(4)), "sequence"),
    "GRU": (_recurrent(lambda: layers.GRU(4)), "sequence"),
    "SimpleRNN, unroll=True": (_recurrent(lambda: layers.SimpleRNN(4, unroll=True)), "sequence"),
    "GRU, Bidirectional(LSTM), SimpleRNN stacked": (_stacked_recurrent, "sequence"),
    "Embedding, MultiHeadAttention, LayerNormalization": (_embedding_attention, "tokens"),
    "subclassed keras.Model": (_subclassed, "vector"),
}


def _twins(build):
    """Two Keras models with the same weights: one for Keras's fit, one for mirrax's."""
    keras.utils.set_random_seed(0)
    first = build()
    keras.utils.set_random_seed(0)
    second = build()
    second.set_weights(first.get_weights())
    return first, second


def _compile_args():
    return dict(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


@pytest.mark.parametrize("row", list(ROWS))
def test_the_row_trains_to_keras_weights_on_one_replica(row):
    build, kind = ROWS[row]
    rng = np.random.default_rng(0)
    x, y = _inputs(kind, rng), rng.integers(0, 3, size=(N,)).astype(np.int32)
    reference, twin = _twins(build)
    reference.compile(**_compile_args())
    expected = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    with mirrored(1).scope():
        model = mirrax.Model(twin)
        model.compile(**_compile_args())
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    for want, got in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=row)
    np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5, err_msg=row)
