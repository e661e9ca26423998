"""`compile(steps_per_execution=k)` as one `jax.lax.scan` over the k batches of a call
(training/multi_step.py, `make_multi_step`): compiled once whatever k, and the same training, state
and outputs as one step per call (tests/test_training_model.py has the hooks and the rows)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax._src.distribute import batching
from tests.conftest import mirrored


class DropoutBatchNormMLP(nnx.Module):
    """Every kind of state a scan's carry must thread: parameters, batch statistics, the
    dropout stream's key and count, the optimizer's momentum, the metrics and the loss tracker."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def _data(n=100):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return x, (np.arange(n) % 3).astype(np.int32)


def _model(strategy, k, model_cls=mirrax.Model):
    with strategy.scope():
        model = model_cls(DropoutBatchNormMLP(nnx.Rngs(0, dropout=1)))
        model.compile(
            optax.sgd(0.1, momentum=0.9),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=k,
        )
    return model


def _leaves(model):
    """Every leaf of the module's and the optimizer's state, as NumPy (keys as their data)."""

    def host(a):
        return np.asarray(
            jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
        )

    return [host(a) for a in jax.tree.leaves(nnx.state((model.module, model.optimizer.nnx_optimizer)))]


def test_k_steps_train_evaluate_and_predict_as_one_step_at_a_time():
    # 100 examples at batch 8: 12 full batches and one of 4. With k=5 the calls hold batches
    # 0-4, 5-9 and 10-12, one scan each (the partial batch is padded to the same shapes; its
    # mask marks its rows: 4 on replica 0, none on replica 1).
    x, y = _data()
    runs = []
    for k in (1, 5):
        model = _model(mirrored(2), k)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        runs.append((history.history, logs, model.predict(x, batch_size=8, verbose=0), _leaves(model)))
    (history_1, logs_1, predicted_1, state_1), (history_k, logs_k, predicted_k, state_k) = runs
    # The same values summed in the same order, in a scan's body or in one straight program:
    # equal to float32 rounding (XLA compiles the body on its own and may fuse it otherwise).
    assert history_1.keys() == history_k.keys() and logs_1.keys() == logs_k.keys()
    for key in history_1:
        np.testing.assert_allclose(history_k[key], history_1[key], rtol=1e-5, err_msg=key)
    for key in logs_1:
        assert logs_k[key] == pytest.approx(logs_1[key], rel=1e-5), key
    assert predicted_k.shape == predicted_1.shape == (100, 3)
    np.testing.assert_allclose(predicted_k, predicted_1, rtol=1e-5, atol=1e-6)
    # Every leaf: parameters, the momentum, batch statistics within rounding; the dropout
    # stream's count exactly (26 steps drew 26 masks either way: the count rode the carry, or
    # every step of a scan would have reused the first one's key and differed by far more).
    assert len(state_k) == len(state_1)
    for mine, reference in zip(state_k, state_1):
        if np.issubdtype(mine.dtype, np.floating):
            np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(mine, reference)


def test_the_step_is_traced_as_often_for_k_32_as_for_k_4():
    # Unrolled, a call of k steps traced the step k times (and compiled k copies); as a scan
    # it traces the body the same number of times whatever k. 64 examples at batch 2 over
    # 2 replicas: 32 batches, one call at k=32, eight at k=4, all full.
    traces = []

    class Counting(mirrax.Model):
        def train_step(self, data):
            traces[-1] += 1
            return super().train_step(data)

    x, y = _data(64)
    losses = []
    for k in (4, 32):
        model = _model(mirrored(2), k, Counting)
        traces.append(0)
        losses.append(model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0).history["loss"])
    assert traces[0] == traces[1] > 0
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)  # the same 32 steps


@pytest.mark.parametrize("change", ["new variable", "int32 to float32"])
def test_a_step_that_changes_the_state_s_structure_or_types_runs_unrolled(change):
    # A scan's carry keeps its structure and types; a step that adds a variable on its first
    # trace, or turns an int32 count into a float32 one, runs its k batches unrolled instead
    # (as before the scan), and trains as k=1: 40 examples at batch 8 = 5 steps per epoch, 2
    # epochs = 10 steps, so the added counter reaches 10 and the count 10 x 0.5 = 5.0.
    class Counting(mirrax.Model):
        def train_step(self, data):
            super().train_step(data)
            module = self.module
            if change == "new variable":
                if not hasattr(module, "steps_seen"):
                    module.steps_seen = nnx.BatchStat(jnp.zeros((), jnp.int32))
                module.steps_seen[...] += 1
            else:
                module.count.set_value(module.count.get_value() + 0.5)

    x, y = _data(40)
    for k in (1, 2):
        with mirrored(2).scope():
            module = DropoutBatchNormMLP(nnx.Rngs(0, dropout=1))
            module.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
            model = Counting(module)
            model.compile(
                optax.sgd(0.1),
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=k,
            )
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        if change == "new variable":
            assert int(model.module.steps_seen[...]) == 10, k
        else:
            count = model.module.count.get_value()
            assert (float(count), count.dtype) == (5.0, jnp.float32), k


def test_a_step_that_never_reads_the_mask_is_warned_about_a_partial_batch_in_any_call():
    # 44 examples at batch 8 over 2 replicas: 5 full batches and one of 4 (2 rows on each
    # replica, padded to 4). A hand-written mean over the rows counts the padding; at k=3 the
    # partial batch is the third of the second call, and the warning names it (and the step) as at
    # k=1.
    class UnmaskedMean(mirrax.Model):
        def train_step(self, data):
            x, y = data

            def loss_fn(module):
                return optax.softmax_cross_entropy_with_integer_labels(module(x), y).sum() / 8.0

            loss, grads = mirrax.value_and_grad(loss_fn)(self.module)
            self.optimizer.nnx_optimizer.update(self.module, grads)

    x, y = _data(44)
    for k in (1, 3):
        with mirrored(2).scope():
            model = UnmaskedMean(DropoutBatchNormMLP(nnx.Rngs(0, dropout=1)))
            model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", steps_per_execution=k)
        with pytest.warns(
            mirrax.PaddedBatchWarning,
            match=re.escape(
                "strategy.run: train_step runs on a partial batch of 4 examples over 2 replicas (per "
                "replica [2, 2]), padded to 4"
            ),
        ):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_k_full_array_batches_are_placed_as_one_and_a_partial_one_alone():
    # 36 examples at batch 8 over 2 replicas: 4 full batches (4 rows per replica) and one of
    # 4 examples (2 rows each, padded to 4). fit with steps_per_execution=4 defers the full
    # ones (HostBatch) and places the 4 of a call with one device_put per leaf: leaves of
    # shape (replicas, k, rows, ...) = (2, 4, 4, 6) and an all-True (2, 4, 4) mask; the
    # partial batch is placed on its own, so a group holding it is not stacked.
    strategy = mirrored(2)
    x, y = _data(36)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 36, 8)]
    placed = list(batching.place_host_batches(strategy, batches, defer=True))
    assert [type(b).__name__ for b in placed] == ["HostBatch"] * 4 + ["tuple"]
    stacked = batching.place_group(placed[:4])
    assert stacked[0].stacked.shape == (2, 4, 4, 6) and stacked[1].stacked.shape == (2, 4, 4)
    assert stacked[0].mask.shape == (2, 4, 4) and bool(np.asarray(stacked[0].mask).all())
    assert stacked[0].lengths == (4, 4)
    np.testing.assert_array_equal(
        np.asarray(stacked[0].stacked)[1, 2], x[16 + 4 : 16 + 8]
    )  # batch 2, replica 1
    assert batching.place_group(placed[3:]) is None
    alone = placed[0].place()
    np.testing.assert_array_equal(np.asarray(alone[0].stacked), x[:8].reshape(2, 4, 6))
    # Replica-invariant mode keeps its own (unrolled) path: nothing is deferred.
    invariant = mirrax.MirroredStrategy(["cpu:0", "cpu:1"], replica_invariant=True, micro_batches=2)
    assert not any(
        isinstance(b, batching.HostBatch)
        for b in batching.place_host_batches(invariant, batches, batch_size=8, defer=True)
    )
