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
    return nnx.Sequential(
        nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(4, momentum=momentum, axis_name=axis_name, rngs=nnx.Rngs(1)),
        nnx.Linear(4, 1, rngs=nnx.Rngs(2)),
    )


def _leaves(module):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(module))]


@pytest.mark.slow
def test_nnx_batch_norm_on_the_padded_last_batch_steps_as_on_the_smaller_batch():
    # Seed 4: every batch's BatchNorm variance is >= 0.06 per feature, far from epsilon (1e-5);
    # on a near-constant feature the normalization amplifies rounding by 1 / sqrt(var + eps).
    x, y = _data(10, seed=4)
    module = _nnx_model()
    by_hand = nnx.clone(module)
    with mirrored(1).scope():
        model = mirrax.Model(module)
        model.compile(optax.sgd(0.1), "mse")
    # Batches of 4, 4 and 2 (padded to 4).
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    optimizer = nnx.Optimizer(by_hand, optax.sgd(0.1), wrt=nnx.Param)
    by_hand.train()
    for start, stop in ((0, 4), (4, 8), (8, 10)):
        grads = nnx.grad(lambda m: jnp.mean((m(x[start:stop]) - y[start:stop]) ** 2))(by_hand)
        optimizer.update(by_hand, grads)
    # float32 against float32 on one device: the same sums in a masked form (1e-6).
    for got, want in zip(_leaves(model.module), _leaves(by_hand)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _hand_steps(module, x, y, batches, lr=0.1):
    """SGD on mean squared error, one step per (start, stop) batch of real rows."""
    optimizer = nnx.Optimizer(module, optax.sgd(lr), wrt=nnx.Param)
    module.train()
    for start, stop in batches:
        grads = nnx.grad(lambda m: jnp.mean((m(x[start:stop]) - y[start:stop]) ** 2))(module)
        optimizer.update(module, grads)
    return module


@pytest.mark.slow
def test_synchronized_batch_norm_on_4_replicas_with_an_empty_one_fits_as_one_device():
    # 13 examples at batch 8 over 4 replicas: the last batch of 5 splits 2, 2, 1, 0 (padded to
    # 2 rows each); replica 3 holds only padding. Count-weighted statistics over the replicas
    # are those of the whole batch, so the fit is one device's on batches of 8 and 5.
    x, y = _data(13, seed=4)
    module = _nnx_model(axis_name=mirrax.REPLICA_AXIS)
    by_hand = _hand_steps(_nnx_model(), x, y, ((0, 8), (8, 13)))
    with mirrored(4).scope():
        model = mirrax.Model(module)
        model.compile(optax.sgd(0.1), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # Sums over 4 replicas are added in another order than on one device (1e-5).
    for got, want in zip(_leaves(model.module), _leaves(by_hand)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _step_outputs(strategy, module, batches):
    """Runs a BatchNorm training step (gradients of a masked loss) on each distributed batch;
    returns the last step's outputs and gradients, gathered."""

    def step(module, x):
        mask = mirrax.get_replica_context().batch_mask

        def loss_fn(module):
            y = module(x)
            return jnp.sum(jnp.where(mask[:, None], y**3, 0.0)), y

        (_, y), grads = nnx.value_and_grad(loss_fn, has_aux=True)(module)
        return y, grads.scale[...]

    for batch in strategy.experimental_distribute_dataset(batches):
        y, grads = strategy.run(step, args=(module, batch))
    return (
        np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(y)]),
        np.asarray(strategy.experimental_local_results(grads)[0]),
    )


@pytest.mark.parametrize("synchronized", [True, False])
def test_batch_norm_statistics_of_a_partial_batch_with_an_all_padding_replica(synchronized):
    strategy = mirrored(4)
    x = _data(13, seed=4)[0]
    first, last = x[:8], x[8:]  # the last batch of 5 splits 2, 2, 1, 0 over the 4 replicas
    # momentum 0: the moving statistics are the last batch's statistics.
    norm = nnx.BatchNorm(
        3, momentum=0.0, axis_name=mirrax.REPLICA_AXIS if synchronized else None, rngs=nnx.Rngs(0)
    )
    with strategy.scope():
        module = nnx.clone(norm)
    y, grads = _step_outputs(strategy, module, [first, last])
    assert y.shape == (5, 3) and np.isfinite(y).all() and np.isfinite(grads).all()
    mean, var = np.asarray(module.mean[...]), np.asarray(module.var[...])
    if synchronized:
        # The whole real batch's statistics, and its rows normalized by them (scale 1, bias 0).
        want_mean, want_var = last.mean(0), last.var(0)
        np.testing.assert_allclose(y, (last - want_mean) / np.sqrt(want_var + 1e-5), rtol=1e-5, atol=1e-5)
    else:
        # Each replica's own real rows ([0:2], [2:4], [4:5]); replica 3 has none and keeps the
        # statistics it held, the first step's average over the replicas (shards of 2 rows),
        # and the replicas' values are averaged.
        before = [first[i : i + 2] for i in (0, 2, 4, 6)]
        shards = [last[0:2], last[2:4], last[4:5]]
        want_mean = (sum(s.mean(0) for s in shards) + sum(s.mean(0) for s in before) / 4) / 4
        want_var = (sum(s.var(0) for s in shards) + sum(s.var(0) for s in before) / 4) / 4
    # float32 sums of at most 8 rows against float64 NumPy (1e-5).
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-6)


def _keras_pair(build, lr=0.05):
    """A Keras model wrapped in mirrax and its clone with the same weights, compiled by Keras."""
    model = build()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    twin.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model, twin


def _keras_fit(model, x, y, batch_size):
    # Keras's layers broadcast by rank, which this suite's rank promotion setting refuses.
    with jax.numpy_rank_promotion("allow"):
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)


def _keras_bn():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), layers.Dense(8, use_bias=False), layers.BatchNormalization(), layers.Dense(1)]
    )


@pytest.mark.slow
def test_keras_batch_normalization_fits_as_keras_with_a_partial_last_batch():
    # 500 examples at batch 64: 7 batches of 64 and one of 52 (padded to 64 rows).
    x, y = _data(500, seed=4)
    model, twin = _keras_pair(_keras_bn)
    with mirrored(1).scope():
        wrapped = mirrax.Model(model)
        wrapped.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    wrapped.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    _keras_fit(twin, x, y, batch_size=64)
    # Weights, gamma, beta, moving mean and variance; float32 sums of 64 rows in a masked
    # form against Keras's on the smaller batch (measured: 1.2e-7 apart at most).
    for got, want in zip(wrapped.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_keras_activity_regularizer_counts_only_the_real_rows(replicas):
    # 10 examples at batch 4: the last batch has 2 real rows padded to 4 (1 + 1 over 2
    # replicas). Keras divides the penalty by the rows it sees, 2 on its own fit.
    x, y = _data(10, seed=4)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((3,)),
                layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1)),
                layers.Dense(1),
            ]
        )

    model, twin = _keras_pair(build)
    with mirrored(replicas).scope():
        wrapped = mirrax.Model(model)
        wrapped.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    wrapped.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    _keras_fit(twin, x, y, batch_size=4)
    # One device: the same float32 arithmetic (1e-6); 2 replicas add their halves (1e-5).
    tolerance = 1e-6 if replicas == 1 else 1e-5
    for got, want in zip(wrapped.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


def _activity_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,)),
            layers.Dense(4, use_bias=False, activity_regularizer=keras.regularizers.L2(0.1)),
            layers.BatchNormalization(),
            layers.Dense(1),
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, replicas",
    [
        (_nnx_model, 1),
        (lambda: _nnx_model(axis_name=mirrax.REPLICA_AXIS), 2),
        (_nnx_model, 4),
        (_activity_model, 1),
        (_activity_model, 2),
    ],
)
def test_full_batches_train_as_without_masking(make, replicas, monkeypatch):
    # 32 examples at batch 16: no partial batch (4 rows per replica on 4). A full batch takes
    # the cond's branch of the layer's own statistics; the masked ones are not computed.
    x, y = _data(32, seed=4)
    results = []
    for masking in (False, True):
        if not masking:
            monkeypatch.setattr(batch_stats, "masked_batch_layers", contextlib.nullcontext)
        else:
            monkeypatch.undo()
        with mirrax.MirroredStrategy(jax.devices()[:replicas]).scope():  # programs of its own
            model = mirrax.Model(make())
            model.compile(optax.sgd(0.1), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    # Not always the same bits: the program holds the cond beside the unmasked arithmetic, and
    # XLA fuses (and contracts into FMAs) that arithmetic differently around it. Measured on
    # CPU after 2 epochs: mostly the same bits, at most 1.2e-7 apart.
    for without, with_masking in zip(*results):
        np.testing.assert_allclose(with_masking, without, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_replica_invariant_batch_norm_on_a_partial_batch_gives_the_same_bits_on_1_and_2():
    # 12 examples at batch 8 in 4 micro-batches of 2: the last batch of 4 fills micro-batches
    # 0 and 1; 2 and 3 are padding only and keep their running statistics.
    x, y = _data(12, seed=4)
    results = []
    for replicas in (1, 2):
        strategy = mirrax.MirroredStrategy(jax.devices()[:replicas], replica_invariant=True, micro_batches=4)
        with strategy.scope():
            model = mirrax.Model(_nnx_model())
            model.compile(optax.sgd(0.1), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for one, two in zip(*results):
        assert np.isfinite(one).all()
        np.testing.assert_array_equal(one, two)


def test_batch_norm_of_sequences_with_the_two_pass_variance_uses_the_real_rows():
    # Inputs (rows, 2 steps, 3 features), use_fast_variance=False (mean of squared deviations):
    # 5 examples over 2 replicas (3 + 2 real rows, padded to 3), statistics over rows and steps.
    strategy = mirrored(2)
    x = np.random.RandomState(4).randn(5, 2, 3).astype(np.float32)
    with strategy.scope():
        norm = nnx.BatchNorm(
            3, momentum=0.0, use_fast_variance=False, axis_name=mirrax.REPLICA_AXIS, rngs=nnx.Rngs(0)
        )

    def step(norm, x):
        return norm(x)

    with warnings.catch_warnings():  # the step itself reads no mask (it sums nothing)
        warnings.simplefilter("ignore", mirrax.PaddedBatchWarning)
        for batch in strategy.experimental_distribute_dataset([x]):
            strategy.run(step, args=(norm, batch))
    # float32 sums of 10 values against float64 NumPy (1e-5).
    np.testing.assert_allclose(np.asarray(norm.mean[...]), x.mean((0, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(norm.var[...]), x.var((0, 1)), rtol=1e-5, atol=1e-6)
