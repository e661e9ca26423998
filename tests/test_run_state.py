"""strategy.run's state path: donated buffers, arrays the user holds, and graphs changed between
steps (the runner skips the NNX flatten while the same objects come back unchanged)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.test_run import MLP, mlp_data, sgd_step


def _two_replicas():
    """A strategy of this file's own, so its compiles do not count toward the retracing
    warning of the suite's shared strategies."""
    return mirrax.MirroredStrategy(["cpu:0", "cpu:1"])


def _trained(strategy):
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        model = MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    strategy.run(sgd_step, args=(model, optimizer, batch))  # compiles; state now placed
    return model, optimizer, batch


def _buffer(array) -> int:
    """The address of the array's first shard (an int: holds no reference to the array)."""
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


@pytest.mark.slow
def test_state_buffers_are_donated_when_nobody_else_holds_them():
    strategy = _two_replicas()
    model, optimizer, batch = _trained(strategy)
    lowered = strategy.experimental_lower(sgd_step, args=(model, optimizer, batch))
    assert "tf.aliasing_output" in lowered.as_text() or "jax.buffer_donor" in lowered.as_text()
    before = _buffer(model.l1.kernel.get_raw_value())
    strategy.run(sgd_step, args=(model, optimizer, batch))
    # Donated: the new value was written into the old buffer (without donation both would be
    # alive at once, at different addresses).
    assert _buffer(model.l1.kernel.get_raw_value()) == before


def test_an_array_the_user_holds_stays_valid_with_its_old_value():
    strategy = _two_replicas()
    model, optimizer, batch = _trained(strategy)
    kept = model.l1.kernel.get_value()  # as TF's variable.read_value(): a snapshot
    snapshot = np.asarray(jax.device_get(kept)).copy()
    strategy.run(sgd_step, args=(model, optimizer, batch))
    assert not kept.is_deleted()
    assert _buffer(model.l1.kernel.get_raw_value()) != _buffer(kept)
    np.testing.assert_array_equal(np.asarray(kept), snapshot)
    # The step did train: the Variable moved away from the value kept.
    assert not np.array_equal(np.asarray(model.l1.kernel.get_value()), snapshot)


def test_donation_gives_the_same_numbers_as_a_copy_of_every_array():
    """Holding every array (so nothing is donated) changes nothing in the results: bitwise,
    since both paths run the same program on the same values."""
    losses = {}
    for hold in (False, True):
        strategy = _two_replicas()
        model, optimizer, batch = _trained(strategy)
        held, out = [], []
        for _ in range(3):
            if hold:
                held.append(
                    [
                        v.get_raw_value()
                        for v in jax.tree.leaves(
                            nnx.state((model, optimizer)), is_leaf=lambda v: isinstance(v, nnx.Variable)
                        )
                    ]
                )
            out.append(
                np.asarray(strategy.reduce("sum", strategy.run(sgd_step, args=(model, optimizer, batch))))
            )
        losses[hold] = (out, np.asarray(model.l2.kernel.get_value()))
    np.testing.assert_array_equal(losses[False][0], losses[True][0])
    np.testing.assert_array_equal(losses[False][1], losses[True][1])


def test_a_submodule_replaced_between_steps_is_the_one_trained():
    strategy = _two_replicas()
    model, optimizer, batch = _trained(strategy)
    old_layer = model.l2
    before_old = np.asarray(old_layer.kernel.get_value()).copy()
    with strategy.scope():
        model.l2 = nnx.Linear(3, 2, rngs=nnx.Rngs(7))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before_new = np.asarray(model.l2.kernel.get_value()).copy()
    strategy.run(sgd_step, args=(model, optimizer, batch))
    np.testing.assert_array_equal(np.asarray(old_layer.kernel.get_value()), before_old)
    assert not np.array_equal(np.asarray(model.l2.kernel.get_value()), before_new)


def test_a_variable_replaced_in_place_is_the_one_updated():
    strategy = _two_replicas()
    model, optimizer, batch = _trained(strategy)
    old = model.l1.bias
    model.l1.bias = nnx.Param(jnp.full((3,), 5.0))  # same shape: same program structure
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    strategy.run(sgd_step, args=(model, optimizer, batch))
    assert model.l1.bias is not old
    assert not np.array_equal(np.asarray(model.l1.bias.get_value()), np.full((3,), 5.0))


class Stack(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(0))])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _grow_step(model, x):
    y = model(x)
    model.layers[-1].bias[...] = model.layers[-1].bias[...] + 1.0
    return y.sum()


def test_a_layer_appended_between_steps_takes_part_in_the_next_step():
    strategy = _two_replicas()
    with strategy.scope():
        model = Stack()
    x = jnp.ones((2, 4))
    strategy.run(_grow_step, args=(model, x))
    first = model.layers[0]
    model.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(1)))
    strategy.run(_grow_step, args=(model, x))
    # The step adds 1 to the last layer's bias: after the append that is the new layer.
    np.testing.assert_array_equal(np.asarray(first.bias.get_value()), np.ones(4))
    np.testing.assert_array_equal(np.asarray(model.layers[1].bias.get_value()), np.ones(4))


def test_variable_metadata_changed_between_steps_is_seen():
    """A Variable's aggregation is metadata; changing it between steps makes a new program."""
    strategy = _two_replicas()

    class Counter(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(()), aggregation=mirrax.VariableAggregation.SUM)

    def add_one(counter):
        counter.total[...] = counter.total[...] + 1.0

    with strategy.scope():
        counter = Counter()
    strategy.run(add_one, args=(counter,))
    # SUM: each of the 2 replicas' +1 counts: 0 + 2 = 2.
    assert float(counter.total.get_value()) == 2.0
    counter.total.set_metadata("aggregation", mirrax.VariableAggregation.MEAN)
    strategy.run(add_one, args=(counter,))
    # MEAN of the replicas' 2 + 1 = 3.
    assert float(counter.total.get_value()) == 3.0


def test_an_array_held_before_the_first_step_stays_valid():
    """The first step places the fresh (single-device) weights on the replicas: the placed
    copy must not share the held array's buffer, or donating it would delete the array."""
    strategy = _two_replicas()
    w1, w2, x, y = mlp_data()
    model = MLP(w1, w2)  # outside any scope: its arrays live on one device
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kept = [model.l1.kernel.get_value()]
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    strategy.run(sgd_step, args=(model, optimizer, batch))
    assert not kept[0].is_deleted()
    np.testing.assert_array_equal(np.asarray(kept[0]), w1)


def test_variables_holding_no_array_or_several_are_written_back_to_themselves():
    """A Variable holding an empty pytree (optax.MaskedNode, as multi_transform's state keeps
    for a parameter outside a group) carries no array, one holding a tuple carries two; the
    step's new values go to their own Variables (on main the flat list was written in order
    into the three Variables, each getting another's value)."""

    class Held(nnx.Module):
        def __init__(self):
            self.empty = nnx.Variable(optax.MaskedNode())
            self.pair = nnx.Variable((jnp.zeros(2), jnp.ones(3)))
            self.w = nnx.Param(jnp.ones(2))

    def step(module):
        a, b = module.pair.get_value()
        module.pair.set_value((a + 1.0, b * 2.0))
        module.w[...] += 1.0

    strategy = _two_replicas()
    module = Held()
    for _ in range(2):
        strategy.run(step, args=(module,))
    a, b = module.pair.get_value()
    np.testing.assert_array_equal(np.asarray(a), [2.0, 2.0])  # 0 + 1 + 1
    np.testing.assert_array_equal(np.asarray(b), [4.0, 4.0, 4.0])  # 1 * 2 * 2
    np.testing.assert_array_equal(np.asarray(module.w[...]), [3.0, 3.0])  # 1 + 1 + 1
    assert module.empty.get_value() == optax.MaskedNode()


def test_a_model_nobody_holds_is_freed_with_its_weights_after_fit_and_run():
    import gc
    import weakref

    strategy = _two_replicas()
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)
    refs = []
    for seed in range(2):
        with strategy.scope():
            model = mirrax.Model(nnx.Linear(4, 2, rngs=nnx.Rngs(seed)))
            model.compile(optax.sgd(0.1), "mse")
        model.fit(x, y, batch_size=4, verbose=0)
        model.evaluate(x, y, batch_size=4, verbose=0)
        model.predict(x, batch_size=4, verbose=0)
        module = MLP(*mlp_data()[:2])
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
        batch = next(iter(strategy.experimental_distribute_dataset(mlp_data()[2:])))
        strategy.run(sgd_step, args=(module, optimizer, batch))
        refs += [weakref.ref(model), weakref.ref(model.module), weakref.ref(module), weakref.ref(optimizer)]
        del model, module, optimizer
    gc.collect()
    # Before: the program caches held the step functions, which held the model, and the NNX
    # graph cache held the objects it checks, so both models stayed alive with their weights.
    assert [ref() is None for ref in refs] == [True] * 8
