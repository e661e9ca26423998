"""Batch-wide layers on a padded last batch see only its real rows: NNX BatchNorm (plain and
synchronized), Keras BatchNormalization and Keras activity regularizers give the statistics and
losses of the smaller batch (batch_stats.py); full batches give the same bits as before."""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax._src.distribute import batch_stats
from tests.conftest import mirrored

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from keras import layers  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)


def _data(n, features=3, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, features).astype(np.float32)
    return x, (x @ rs.randn(features, 1) + 0.5).astype(np.float32)


def _nnx_model(axis_name=None, momentum=0.9):
    # No bias before the BatchNorm: its gradient is 0 in exact arithmetic, rounding noise here.
    return nnx.Sequential(nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0)),
                          nnx.BatchNorm(4, momentum=momentum, axis_name=axis_name, rngs=nnx.Rngs(1)),
                          nnx.Linear(4, 1, rngs=nnx.Rngs(2)))


def _leaves(module):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(module))]


def test_nnx_batch_norm_on_the_padded_last_batch_steps_as_on_the_smaller_batch():
    # Seed 4: every batch's BatchNorm variance is >= 0.06 per feature, far from epsilon (1e-5);
    # on a near-constant feature the normalization amplifies rounding by 1 / sqrt(var + eps).
    x, y = _data(10, seed=4)
    module = _nnx_model()
    by_hand = nnx.clone(module)
    with mirrored(1).scope():
        model = mirrax.Model(module)
        model.compile(optax.sgd(0.1), "mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # batches 4, 4, 2 (+2 padding)
    optimizer = nnx.Optimizer(by_hand, optax.sgd(0.1), wrt=nnx.Param)
    by_hand.train()
    for start, stop in ((0, 4), (4, 8), (8, 10)):
        grads = nnx.grad(lambda m: jnp.mean((m(x[start:stop]) - y[start:stop]) ** 2))(by_hand)
        optimizer.update(by_hand, grads)
    # float32 against float32 on one device: the same sums in a masked form (1e-6).
    for got, want in zip(_leaves(model.module), _leaves(by_hand)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
