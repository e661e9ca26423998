"""strategy.run on steps written as TF writes them: the model, optimizer and metrics captured from
the closure or globals are carried like arguments; a step defined anew compiles once."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored, named_strategy
from tests.test_run import MLP, mlp_data, sgd_step

GLOBAL_BATCH = 16


def _setup(strategy):
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        model = MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset((x, y)))
    return model, optimizer, batches[0]


def _weights(model):
    return [
        np.asarray(v)
        for v in (model.l1.kernel[...], model.l1.bias[...], model.l2.kernel[...], model.l2.bias[...])
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["OneDevice", "Mirrored4CPU"])
def test_the_tutorials_captured_step_trains_the_same_bits_as_arguments(name):
    strategy = named_strategy(name)
    model, optimizer, batch = _setup(strategy)
    accuracy = mirrax.metrics.SparseCategoricalAccuracy()

    # custom_training.ipynb as ported: the step captures model, optimizer and metric; the
    # @tf.function around distributed_train_step is dropped.
    def train_step(inputs):
        images, labels = inputs

        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
            return mirrax.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        loss, grads = mirrax.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        accuracy.update_state(labels, model(images))
        return loss

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None)

    ref_model, ref_optimizer, _ = _setup(strategy)

    def ref_step(model, optimizer, inputs):
        images, labels = inputs

        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
            return mirrax.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        loss, grads = mirrax.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for _ in range(3):
        loss = distributed_train_step(batch)
        ref = strategy.reduce(
            "sum", strategy.run(ref_step, args=(ref_model, ref_optimizer, batch)), axis=None
        )
        # The same program arithmetic (only the order of the state arguments differs).
        assert np.asarray(loss).tobytes() == np.asarray(ref).tobytes()
    for a, b in zip(_weights(model), _weights(ref_model)):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.step[...]) == 3
    # The metric saw 3 steps x 16 examples (SUM over replicas of counts).
    assert float(accuracy.count[...]) == 3 * GLOBAL_BATCH
    assert 0.0 <= float(accuracy.result()) <= 1.0


# -- globals ----------------------------------------------------------------------------------

_g_model = _g_optimizer = None


def _global_loss(model, batch):
    x, y = batch
    per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return mirrax.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def _global_step(batch):
    loss, grads = nnx.value_and_grad(_global_loss)(_g_model, batch)
    _g_optimizer.update(_g_model, grads)
    return loss


@pytest.mark.slow
def test_a_step_reaching_globals_trains_as_the_argument_step_and_follows_a_rebound_global():
    global _g_model, _g_optimizer
    strategy = mirrored(2)
    _g_model, _g_optimizer, batch = _setup(strategy)
    ref_model, ref_optimizer, _ = _setup(strategy)
    for _ in range(2):
        strategy.run(_global_step, args=(batch,))
        strategy.run(sgd_step, args=(ref_model, ref_optimizer, batch))
    for a, b in zip(_weights(_g_model), _weights(ref_model)):
        np.testing.assert_array_equal(a, b)
    # A global rebound to a fresh model: the next call trains the new one, not the old one.
    old = _g_model
    before = _weights(old)
    _g_model, _g_optimizer, _ = _setup(strategy)
    fresh = _weights(_g_model)
    strategy.run(_global_step, args=(batch,))
    for a, b in zip(_weights(old), before):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(_weights(_g_model)[0], fresh[0])


def test_captured_weights_are_read_at_every_call_not_compiled_in():
    strategy = mirrored(2)
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.ones((2, 1))

    def forward(x):
        return model(x)

    x = np.ones((2, 2), np.float32)
    assert _total(strategy, forward_run(strategy, forward, x)) == 4.0
    model.kernel[...] = 2 * jnp.ones((2, 1))  # changed outside: the program reads the new value
    # 2 rows x (1*2 + 1*2) = 8
    assert _total(strategy, forward_run(strategy, forward, x)) == 8.0


def _total(strategy, per_example):
    """The sum of every element of every example's output (all replicas)."""
    return float(np.asarray(strategy.reduce("sum", per_example, axis=0)).sum())


def forward_run(strategy, fn, x):
    batch = next(iter(strategy.experimental_distribute_dataset(x)))
    return strategy.run(fn, args=(batch,))


# -- aggregation and randomness ---------------------------------------------------------------


def test_captured_batch_norm_statistics_are_averaged_over_replicas():
    strategy = mirrored(4)
    bn = nnx.BatchNorm(1, momentum=0.5, use_bias=False, use_scale=False, rngs=nnx.Rngs(0))
    bn.train()
    x = np.arange(8, dtype=np.float32).reshape(8, 1)  # replicas see [0,1] [2,3] [4,5] [6,7]

    def step(batch):
        return bn(batch)

    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset(x))),))
    # Per-replica means 0.5, 2.5, 4.5, 6.5 -> MEAN 3.5; new mean = 0.5 * 0 + 0.5 * 3.5.
    assert float(bn.mean[...][0]) == pytest.approx(1.75)


def test_captured_dropout_draws_per_replica_masks_as_the_argument_step():
    strategy = mirrored(2)

    def make():
        return nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))

    captured, passed = make(), make()
    x = next(iter(strategy.experimental_distribute_dataset(np.ones((8, 16), np.float32))))

    def step(batch):
        return captured(batch)

    for _ in range(2):
        out = strategy.experimental_local_results(strategy.run(step, args=(x,)))
        ref = strategy.experimental_local_results(strategy.run(lambda d, b: d(b), args=(passed, x)))
        for a, b in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(np.asarray(out[0]), np.asarray(out[1]))  # folded per replica


# -- compiling once -------------------------------------------------------------------------


def test_a_step_defined_inside_a_function_compiles_once():
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1"])  # its own: counts only these traces
    model, optimizer, batch = _setup(strategy)
    traces = []

    def train_once():
        def step(inputs):
            traces.append(1)  # a Python side effect runs only while tracing
            return sgd_step(model, optimizer, inputs)

        return strategy.run(step, args=(batch,))

    for _ in range(3):
        train_once()
    assert len(traces) == 2  # one program: its abstract trace and its compile
    assert int(optimizer.step[...]) == 3


def test_a_changed_captured_constant_recompiles():
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1"])
    x = next(iter(strategy.experimental_distribute_dataset(np.ones((2, 1), np.float32))))

    def scaled(scale):
        def step(batch):
            return batch * scale

        return _total(strategy, strategy.run(step, args=(x,)))

    assert scaled(2.0) == 4.0  # 2 rows x 2.0
    assert scaled(2.0) == 4.0
    assert scaled(3.0) == 6.0  # a new constant: a new program, not the 2.0 one
    assert scaled(3) == 6.0


def test_a_capture_that_is_also_an_argument_is_one_object():
    strategy = mirrored(2)
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.ones((2, 1))

    def step(m, batch):
        m.kernel[...] = m.kernel[...] + 1.0  # through the argument ...
        return model(batch)  # ... seen through the capture

    x = next(iter(strategy.experimental_distribute_dataset(np.ones((2, 2), np.float32))))
    out = strategy.run(step, args=(model, x))
    # kernel 2: each row gives 2 + 2 = 4; 2 rows.
    assert _total(strategy, out) == 8.0
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), 2 * np.ones((2, 1)))


class _Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def step(self, batch):
        return sgd_step(self.model, self.optimizer, batch)


def test_a_method_of_a_plain_object_trains_through_self():
    strategy = mirrored(2)
    model, optimizer, batch = _setup(strategy)
    ref_model, ref_optimizer, _ = _setup(strategy)
    trainer = _Trainer(model, optimizer)
    strategy.run(trainer.step, args=(batch,))
    strategy.run(sgd_step, args=(ref_model, ref_optimizer, batch))
    for a, b in zip(_weights(model), _weights(ref_model)):
        np.testing.assert_array_equal(a, b)


# -- what cannot be carried -------------------------------------------------------------------


class _Uncopyable:
    def __init__(self, model):
        self.model = model

    def __copy__(self):
        raise TypeError("no copies")


def test_state_held_by_an_object_that_cannot_be_copied_is_refused_with_the_fix():
    holder = _Uncopyable(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))

    def step(x):
        return holder.model(x)

    with pytest.raises(
        mirrax.errors.CapturedStateError,
        match=r"through a _Uncopyable \(model\).*could not copy.*Pass the NNX objects",
    ):
        mirrored(2).run(step, args=(np.ones((2, 2), np.float32),))


def test_the_caller_objects_are_unchanged_by_a_failing_captured_step():
    strategy = mirrored(2)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    kernel = np.asarray(model.kernel[...]).copy()

    def step(x):
        model.kernel[...] = model.kernel[...] + 1.0
        raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="the step's own error"):
        strategy.run(step, args=(np.ones((2, 2), np.float32),))
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)


def test_a_captured_mirrax_model_is_carried_through_its_module():
    strategy = mirrored(2)
    model = mirrax.Model(nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0)))
    model.module.kernel[...] = jnp.ones((2, 1))

    def forward(x):
        return model(x)  # mirrax.Model.__call__ reads model.module

    x = np.ones((2, 2), np.float32)
    assert _total(strategy, forward_run(strategy, forward, x)) == 4.0  # 2 rows x (1 + 1)
    model.module.kernel[...] = 3 * jnp.ones((2, 1))
    assert _total(strategy, forward_run(strategy, forward, x)) == 12.0  # 2 rows x (3 + 3)


_g_scale = 2.0


def _global_scaled(batch):
    return batch * _g_scale


def test_a_changed_global_constant_recompiles():
    # Unlike TF (which keeps the value it traced with): the walk re-reads globals each call.
    global _g_scale
    strategy = mirrored(2)
    x = next(iter(strategy.experimental_distribute_dataset(np.ones((2, 1), np.float32))))
    _g_scale = 2.0
    assert _total(strategy, strategy.run(_global_scaled, args=(x,))) == 4.0  # 2 rows x 2.0
    _g_scale = 5.0
    assert _total(strategy, strategy.run(_global_scaled, args=(x,))) == 10.0  # 2 rows x 5.0
