"""Padding rows and hand-written reductions: a step that never reads the batch mask is warned
(mirrax.PaddedBatchWarning, once per program, before it runs) when a partial batch reaches it;
the fixes (compute_average_loss, batch_mask) are exact; fit / evaluate / predict never warn."""

import math
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored

GLOBAL = 32
LN10 = math.log(10.0)


def zero_model():
    """Logits all zero over 10 classes: every example's cross-entropy is ln 10 = 2.302585."""
    model = nnx.Linear(4, 10, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((4, 10))
    return model


def two_batches(strategy):
    """A full batch of 32 and a partial one of 29 (tf.data's drop_remainder=False)."""
    x = np.ones((61, 4), np.float32)
    y = np.arange(61, dtype=np.int32) % 10
    return strategy.experimental_distribute_dataset([(x[:GLOBAL], y[:GLOBAL]), (x[GLOBAL:], y[GLOBAL:])])


def cross_entropy(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


def run_all(strategy, step, model):
    """The step's summed result per batch, with the warnings raised during each."""
    results = []
    for x, y in two_batches(strategy):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = strategy.run(step, args=(model, x, y))
        padded = [w for w in caught if issubclass(w.category, mirrax.PaddedBatchWarning)]
        results.append((float(strategy.reduce("sum", out, axis=None)), padded))
    return results


@pytest.mark.parametrize("replicas", [1, 4])
def test_hand_written_sum_is_warned_on_the_partial_batch_only(replicas):
    strategy = mirrored(replicas)

    def step(model, x, y):  # as TF's tutorial writes it: tf.reduce_sum(ce) * (1. / GLOBAL)
        return jnp.sum(cross_entropy(model, x, y)) * (1.0 / GLOBAL)

    (full, full_warnings), (partial, partial_warnings) = run_all(strategy, step, zero_model())
    assert full == pytest.approx(LN10)  # 32 * ln 10 / 32
    assert not full_warnings
    # The 3 padding rows (32 rows per step on 1 replica; 8,8,8,5 padded to 8 on 4) are summed:
    # 32 * ln 10 / 32 = 2.302585 where the 29 real examples give 29 * ln 10 / 32 = 2.086718.
    assert partial == pytest.approx(LN10)
    (warning,) = partial_warnings
    message = str(warning.message)
    per_replica = [29] if replicas == 1 else [8, 8, 8, 5]
    assert (
        f"step runs on a partial batch of 29 examples over {replicas} replicas (per replica "
        f"{per_replica}), padded to {GLOBAL // replicas} rows per replica"
    ) in message
    assert "mirrax.compute_average_loss(per_example_loss, global_batch_size=...)" in message
    assert "mirrax.get_replica_context().batch_mask" in message


@pytest.mark.parametrize("replicas", [1, 4])
def test_the_fixes_are_exact_and_not_warned(replicas):
    strategy = mirrored(replicas)

    def average(model, x, y):
        return mirrax.compute_average_loss(cross_entropy(model, x, y), global_batch_size=GLOBAL)

    def masked(model, x, y):
        mask = mirrax.get_replica_context().batch_mask
        return jnp.sum(jnp.where(mask, cross_entropy(model, x, y), 0.0)) * (1.0 / GLOBAL)

    for step in (average, masked):
        (full, w1), (partial, w2) = run_all(strategy, step, zero_model())
        assert full == pytest.approx(LN10)  # 32 * ln 10 / 32
        assert partial == pytest.approx(29 * LN10 / GLOBAL)  # 2.086718: the real examples only
        assert not w1 and not w2


def test_per_example_outputs_are_not_warned():
    # Per-example rows are trimmed of their padding by experimental_local_results.
    strategy = mirrored(4)
    model = zero_model()
    for x, y in two_batches(strategy):
        with warnings.catch_warnings():
            warnings.simplefilter("error", mirrax.PaddedBatchWarning)
            out = strategy.run(cross_entropy, args=(model, x, y))
    rows = sum(len(v) for v in strategy.experimental_local_results(out))
    assert rows == 29


def test_a_training_step_is_stopped_before_it_runs_when_the_warning_is_an_error():
    strategy = mirrored(4)
    with strategy.scope():
        model = zero_model()
        optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)

    def train_step(model, optimizer, x, y):  # no output: the update is the reduction
        loss_fn = lambda m: jnp.mean(cross_entropy(m, x, y))  # noqa: E731
        optimizer.update(model, nnx.grad(loss_fn)(model))

    batches = iter(two_batches(strategy))
    strategy.run(train_step, args=(model, optimizer) + next(batches))
    before = np.asarray(model.bias[...]).copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mirrax.PaddedBatchWarning)
        with pytest.raises(mirrax.PaddedBatchWarning, match="train_step never reads the batch"):
            strategy.run(train_step, args=(model, optimizer) + next(batches))
    np.testing.assert_array_equal(np.asarray(model.bias[...]), before)  # the step did not run


def test_warned_once_per_program():
    strategy = mirrored(2)

    def step(model, x, y):
        return jnp.sum(cross_entropy(model, x, y))

    model = zero_model()
    warned = [w for _ in range(2) for _, w in run_all(strategy, step, model)]
    assert [len(w) for w in warned] == [0, 1, 0, 0]


@pytest.mark.slow
def test_fit_evaluate_predict_never_warn_on_partial_batches():
    strategy = mirrored(4)
    with strategy.scope():
        model = mirrax.Model(
            nnx.Sequential(
                nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
                nnx.BatchNorm(8, rngs=nnx.Rngs(3)),
                nnx.Dropout(0.5, rngs=nnx.Rngs(1)),
                nnx.Linear(8, 10, rngs=nnx.Rngs(2)),
            )
        )
        model.compile("sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.random.default_rng(0).normal(size=(61, 4)).astype(np.float32)
    y = np.arange(61) % 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", mirrax.PaddedBatchWarning)
        model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=0)  # batches of 32 and 29
        model.fit(two_batches(strategy), epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=GLOBAL, verbose=0)
        assert model.predict(x, batch_size=GLOBAL, verbose=0).shape == (61, 10)


def test_the_warning_is_a_user_warning():
    assert issubclass(mirrax.PaddedBatchWarning, UserWarning)
    assert mirrax.PaddedBatchWarning is mirrax.errors.PaddedBatchWarning


def test_replica_invariant_mode_warns_a_hand_written_sum():
    # The micro-batch split reads the mask for mirrax; the loss itself never does.
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1"], replica_invariant=True, micro_batches=4)

    def step(model, x, y):
        loss_fn = lambda m, x, y: jnp.sum(cross_entropy(m, x, y)) * (1.0 / GLOBAL)  # noqa: E731
        return mirrax.value_and_grad(loss_fn)(model, x, y)[0]

    def fixed(model, x, y):
        loss_fn = lambda m, x, y: mirrax.compute_average_loss(  # noqa: E731
            cross_entropy(m, x, y), global_batch_size=GLOBAL
        )
        return mirrax.value_and_grad(loss_fn)(model, x, y)[0]

    (_, w1), (_, w2) = run_all(strategy, step, zero_model())
    assert (len(w1), len(w2)) == (0, 1)
    (_, w1), (partial, w2) = run_all(strategy, fixed, zero_model())
    assert partial == pytest.approx(29 * LN10 / GLOBAL)  # 2.086718
    assert not w1 and not w2


def test_a_full_batch_of_another_size_is_not_called_padded():
    # One program serves batches of 2 and 3 rows per replica (jax.jit retraces it per shape).
    # Before: the batch of 12 (3 rows on each of 4 replicas, none padded) was warned about as
    # "padded to 2 rows per replica", the first batch's size.
    strategy = mirrored(4)

    def total(batch):
        return jnp.sum(batch)

    def run(n):
        batch = next(iter(strategy.experimental_distribute_dataset(np.ones((n, 1), np.float32))))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = float(strategy.reduce("sum", strategy.run(total, args=(batch,)), axis=None))
        return result, [w for w in caught if issubclass(w.category, mirrax.PaddedBatchWarning)]

    assert run(8) == (8.0, []) and run(12) == (12.0, [])
    # 10 examples: per replica 3, 3, 3, 1 (TF's split), the last padded to 3 rows with copies of
    # a real example, which the unmasked sum counts: 10 + 2 = 12, and the warning says so.
    result, padded = run(10)
    assert (
        result == 12.0
        and len(padded) == 1
        and "per replica [3, 3, 3, 1]), padded to 3 rows" in str(padded[0].message)
    )
