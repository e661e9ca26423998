"""Recurrent layers and `jax.lax.scan` under the strategy (mirrax/_src/distribute/scan_carry.py).

A scan whose initial carry is the same on every replica (zeros) but whose new carry differs per
replica (it adds the batch) runs unchanged: the runtime marks that carry per-replica. Results on
1, 2 and 4 replicas agree; gradients through the carry stay the global sum.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from flax import nnx
from keras import layers

import mirrax
from tests.conftest import mirrored


def _rows(strategy, x):
    return next(iter(strategy.experimental_distribute_dataset([x])))


@pytest.mark.parametrize("unroll", [1, True])
def test_a_scan_from_zeros_over_the_batch_sums_each_replicas_rows(unroll):
    strategy = mirrored(2)
    x = np.arange(8, dtype=np.float32)  # replica 0 holds rows 0..3, replica 1 rows 4..7

    def step(rows, w):
        def final(w):
            # carry' = w * carry + row, from 0: c4 = w^3 a + w^2 b + w c + d
            carry, _ = jax.lax.scan(lambda c, r: (w * c + r, None), jnp.zeros(()), rows, unroll=unroll)
            return carry

        return final(w), jax.grad(final)(w)

    carry, grad = strategy.run(step, args=(_rows(strategy, x), jnp.float32(1.0)))
    # At w = 1: 0+1+2+3 = 6 and 4+5+6+7 = 22.
    assert [float(v) for v in carry.values] == [6.0, 22.0]
    # dc4/dw at w = 1 is 3a + 2b + c: 0+2+2 = 4 and 12+10+6 = 28; w is the same on every
    # replica, so its gradient is their sum, 32 (the carry's pcast transposes to a psum).
    assert isinstance(grad, mirrax.Mirrored) and float(grad.values[0]) == 32.0


def test_fori_loop_and_while_loop_from_zeros_over_the_batch_run_too():
    strategy = mirrored(2)
    x = np.arange(8, dtype=np.float32)  # replica 0 holds rows 0..3, replica 1 rows 4..7

    def step(rows):
        fori = jax.lax.fori_loop(0, 4, lambda i, c: c + rows[i], jnp.zeros(()))
        total, _ = jax.lax.while_loop(
            lambda c: c[1] < 4, lambda c: (c[0] + rows[c[1]], c[1] + 1), (jnp.zeros(()), 0)
        )
        return fori, total

    fori, total = strategy.run(step, args=(_rows(strategy, x),))
    # 0+1+2+3 = 6 and 4+5+6+7 = 22, both ways; the counter stays the same on every replica.
    assert [float(v) for v in fori.values] == [float(v) for v in total.values] == [6.0, 22.0]


def _series(n=16, steps=5):
    t = np.linspace(0, 4 * np.pi, n * steps + 1, dtype=np.float32)
    x = np.stack([np.sin(t[:-1]), np.cos(t[:-1])], -1).reshape(n, steps, 2)
    return x, np.sin(t[steps::steps])[:, None].astype(np.float32)


_KERAS_STACKS = {
    "lstm": lambda: [layers.LSTM(4)],
    "gru_simple_bidirectional": lambda: [
        layers.GRU(4, return_sequences=True),
        layers.SimpleRNN(3, return_sequences=True),
        layers.Bidirectional(layers.LSTM(3, return_sequences=True)),
        layers.Flatten(),
    ],
}


def _keras_fitted(strategy, stack="lstm", batch_size=8, epochs=2, **compile_kwargs):
    x, y = _series()
    keras.utils.set_random_seed(0)
    with strategy.scope(), jax.numpy_rank_promotion("allow"):
        model = mirrax.Model(
            keras.Sequential([keras.Input((5, 2)), *_KERAS_STACKS[stack](), layers.Dense(1)])
        )
        model.compile(optimizer="adam", loss="mse", **compile_kwargs)
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def _keras_fit(strategy, stack):
    return _keras_fitted(strategy, stack).get_weights()


@pytest.mark.slow
@pytest.mark.parametrize("stack, replicas", [("lstm", (1, 2, 4)), ("gru_simple_bidirectional", (1, 4))])
def test_keras_recurrent_layers_fit_alike_on_1_2_and_4_replicas(stack, replicas):
    one, *others = [_keras_fit(mirrored(r), stack) for r in replicas]
    for weights in others:
        assert len(weights) == len(one)
        for a, b in zip(weights, one):
            # 1e-6: the gradients' cross-replica sum adds the same terms in another order.
            np.testing.assert_allclose(a, b, atol=1e-6)


class _Forecaster(nnx.Module):
    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(2, 4, rngs=rngs))
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x)[:, -1])


def _nnx_loop(strategy):
    x, y = _series()
    with strategy.scope():
        model = _Forecaster(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def step(model, optimizer, batch):
        xb, yb = batch
        loss_fn = lambda m: mirrax.compute_average_loss(  # noqa: E731
            jnp.mean((m(xb) - yb) ** 2, axis=-1), global_batch_size=8
        )
        loss, grads = mirrax.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for batch in strategy.experimental_distribute_dataset([(x[:8], y[:8]), (x[8:], y[8:])]):
        strategy.run(step, args=(model, optimizer, batch))
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.slow
def test_an_nnx_rnn_trains_alike_on_1_2_and_4_replicas():
    one, *others = [_nnx_loop(mirrored(r)) for r in (1, 2, 4)]
    for params in others:
        for a, b in zip(params, one):
            np.testing.assert_allclose(a, b, atol=1e-6)  # 1e-6: float sums in another order


@pytest.mark.slow
def test_replica_invariant_mode_fits_an_lstm_to_the_same_bits_on_1_and_4_replicas():
    results = [
        _keras_fit(strategy, "lstm")
        for strategy in (
            mirrax.OneDeviceStrategy("cpu:0", replica_invariant=True, micro_batches=4),
            mirrax.MirroredStrategy(jax.devices()[:4], replica_invariant=True, micro_batches=4),
        )
    ]
    for a, b in zip(*results):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_an_lstm_fits_with_the_sharded_optimizer_and_evaluates_and_predicts_alike():
    x, y = _series()
    results = []
    for strategy in (mirrored(1), mirrax.MirroredStrategy(jax.devices()[:4], shard_optimizer_state=True)):
        model = _keras_fitted(strategy)
        with jax.numpy_rank_promotion("allow"):
            # 6 rows at a batch of 4: a padded, masked last batch on 4 replicas (1,1,0,0).
            results.append(
                (
                    model.get_weights(),
                    model.evaluate(x[:6], y[:6], batch_size=4, verbose=0),
                    model.predict(x[:6], batch_size=4, verbose=0),
                )
            )
    (w1, loss1, p1), (w4, loss4, p4) = results
    assert p4.shape == p1.shape == (6, 1)
    # 1e-6: the same terms summed in another order across replicas (and the sharded update).
    for a, b in zip(w4, w1):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(p4, p1, atol=1e-6)
    np.testing.assert_allclose(loss4, loss1, atol=1e-6)


@pytest.mark.slow
def test_an_lstm_fits_k_steps_per_execution_as_one_at_a_time():
    results = [
        _keras_fitted(mirrored(4), batch_size=4, epochs=1, steps_per_execution=k).get_weights()
        for k in (1, 2)
    ]
    for a, b in zip(*results):
        assert np.array_equal(a, b)  # the same steps in the same order: k only groups them
