"""Worker programs of tests/test_multi_worker_broadcast.py: mirrored state made equal from worker 0.

As TF's own test of a multi-worker mirrored variable: worker 0 holds ones, the others zeros (or
their own unseeded Keras initializers, or their own RNG seeds); after the strategy's first use
every worker holds worker 0's values. One launch checks Model.fit / evaluate, a custom loop
(strategy.run), a Keras and an NNX model, the sharded optimizer and replica-invariant mode.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")


def _strategy(**options):
    import mirrax

    timeout = float(os.environ.get("MIRRAX_TEST_TIMEOUT", 0)) or None
    return mirrax.MultiWorkerMirroredStrategy(
        communication_options=mirrax.CommunicationOptions(timeout_seconds=timeout), **options
    )


def _problem(n=32):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 2, n).astype(np.int32)


def _mlp(value: float, hidden: int = 3, dropout_seed=None):
    """Linear(4, hidden) -> relu -> [Dropout] -> Linear(hidden, 2), every parameter `value`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0, dropout=0 if dropout_seed is None else dropout_seed)
            self.l1 = nnx.Linear(4, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, 2, rngs=rngs)
            self.dropout = None if dropout_seed is None else nnx.Dropout(0.25, rngs=rngs)
            for _, p in nnx.to_flat_state(nnx.state(self, nnx.Param)):
                p[...] = jnp.full(p.shape, value, p.dtype)

        def __call__(self, x):
            h = jax.nn.relu(self.l1(x))
            return self.l2(h if self.dropout is None else self.dropout(h))

    return MLP()


def _params(module) -> list:
    import jax
    from flax import nnx

    return [np.asarray(p).ravel().tolist() for p in jax.tree.leaves(nnx.state(module, nnx.Param))]


def _keys(module) -> list:
    import jax
    from flax import nnx

    return [
        np.asarray(jax.random.key_data(k)).tolist() for k in jax.tree.leaves(nnx.state(module, nnx.RngKey))
    ]


def _read(module, *others):
    """A first use that changes nothing: the sum of the first kernel, on every replica."""
    import jax.numpy as jnp

    return jnp.sum(module.l1.kernel[...])


def mirrored(out_dir, index):
    import jax
    import keras
    import optax
    from flax import nnx

    import mirrax

    strategy = _strategy()
    mine = 1.0 if jax.process_index() == 0 else 0.0  # TF's test: ones on worker 0
    x, y = _problem()
    loss = mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}

    # Model.fit as the first use (NNX model, Adam: its state is placed too).
    with strategy.scope():
        model = mirrax.Model(_mlp(mine))
        model.compile(optax.adam(0.05), loss)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["fit"] = _params(model.module)

    # A Keras model with its own unseeded initializers: evaluate first, then fit.
    keras_model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)]
    )
    out["keras_initial"] = [w.ravel().tolist() for w in keras_model.get_weights()]
    with strategy.scope():
        wrapped = mirrax.Model(keras_model)
        wrapped.compile("adam", loss)
    wrapped.evaluate(x, y, batch_size=8, verbose=0)
    out["keras_evaluated"] = [np.asarray(w).ravel().tolist() for w in wrapped.get_weights()]
    wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out["keras_fit"] = [np.asarray(w).ravel().tolist() for w in wrapped.get_weights()]

    # A custom loop: a read first (sum of ones = 4 * 3 = 12 on worker 0), then training.
    with strategy.scope():
        module = _mlp(mine)
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    out["custom_read"] = float(strategy.run(_read, args=(module, optimizer)).values[0])
    out["custom_initial"] = _params(module)

    def step(module, optimizer, batch):
        def loss_fn(module):
            per_example = optax.softmax_cross_entropy_with_integer_labels(module(batch[0]), batch[1])
            return mirrax.compute_average_loss(per_example)

        value, grads = nnx.value_and_grad(loss_fn)(module)
        optimizer.update(module, grads)
        return value

    for batch in strategy.experimental_distribute_dataset(
        [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    ):
        strategy.run(step, args=(module, optimizer, batch))
    out["custom_trained"] = _params(module)
    # A host assignment that differs between workers after the first step: worker 0's wins,
    # the worker whose value was replaced is warned. 3 on worker 0: 3 * 12 = 36.
    # Both ways of assigning: a new local array, and an in-place update of the global one.
    module.l1.kernel.value = jax.numpy.full((4, 3), 3.0 if jax.process_index() == 0 else 5.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["custom_reassigned"] = float(strategy.run(_read, args=(module, optimizer)).values[0])
        module.l1.kernel[...] = jax.numpy.full((4, 3), 2.0 if jax.process_index() == 0 else 7.0)
        out["custom_updated"] = float(strategy.run(_read, args=(module, optimizer)).values[0])
    out["warnings"] = [str(w.message) for w in caught]

    # The sharded optimizer (Model.fit's path is the same strategy.run): Adam's first moment
    # of l1.kernel (4, 8) split by rows over the 4 replicas; worker 0's moments are ones, the
    # others' zeros.
    sharded = _strategy(shard_optimizer_state=True)
    with sharded.scope():
        module = _mlp(mine, hidden=8)
        optimizer = nnx.Optimizer(module, optax.adam(0.05), wrt=nnx.Param)
    mu = optimizer.opt_state[0].mu["l1"]["kernel"]
    mu[...] = jax.numpy.full(mu.shape, mine)
    out["sharded_read"] = float(sharded.run(_read, args=(module, optimizer)).values[0])
    mu = optimizer.opt_state[0].mu["l1"]["kernel"].get_value()
    out["sharded_mu_spec"] = list(mu.sharding.spec)
    out["sharded_mu_local"] = [np.asarray(s.data).ravel().tolist() for s in mu.addressable_shards]
    # Replica-invariant mode, with Dropout seeded by the worker's index: evaluate first (the
    # parameters become ones, the RNG keys worker 0's).
    invariant = _strategy(replica_invariant=True, micro_batches=4)
    with invariant.scope():
        inv_model = mirrax.Model(_mlp(mine, dropout_seed=jax.process_index()))
        inv_model.compile(optax.adam(0.05), loss)
    out["invariant_initial_keys"] = _keys(inv_model.module)
    inv_model.evaluate(x, y, batch_size=8, verbose=0)
    out["invariant_evaluated"] = _params(inv_model.module)
    out["invariant_evaluated_keys"] = _keys(inv_model.module)
    return out


def mismatched(out_dir, index):
    """Worker 1 builds a wider model: the first use fails on every worker, naming the cause."""
    import jax

    strategy = _strategy()
    module = _mlp(1.0, hidden=3 if jax.process_index() == 0 else 5)
    strategy.run(_read, args=(module,))
    return {}


SCENARIOS = {"broadcast_mirrored": mirrored, "broadcast_mismatched": mismatched}
