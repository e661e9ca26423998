"""`strategy.extended.carried_steps`: steps over the same NNX objects with their state carried
between steps and written into them at `release()` (what fit, evaluate and predict run on)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.test_run import MLP, mlp_data, sgd_step


def _setup(replicas):
    strategy = mirrax.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        model = MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset([(x, y), (x[::-1], y[::-1]), (x, y)]))
    return strategy, model, optimizer, batches


def _state(model, optimizer):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state((model, optimizer)))]


@pytest.mark.parametrize("replicas", [1, 4])
def test_carried_steps_end_where_the_same_strategy_run_steps_end_bitwise(replicas):
    strategy, model, optimizer, batches = _setup(replicas)
    losses = [
        strategy.reduce("sum", strategy.run(sgd_step, args=(model, optimizer, b)), None) for b in batches
    ]
    expected = _state(model, optimizer)

    strategy, model, optimizer, batches = _setup(replicas)
    carried = strategy.extended.carried_steps((model, optimizer))
    carried_losses = [strategy.reduce("sum", carried.run(sgd_step, b), None) for b in batches]
    assert carried.carrying
    carried.release()
    assert not carried.carrying
    carried.release()  # a second release writes nothing
    # The same program on the same arrays: the same bits, only written back later.
    for got, want in zip(_state(model, optimizer), expected):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(carried_losses), np.asarray(losses))


def _dict_step(model, optimizer, batch):
    return sgd_step(model, optimizer, (batch["x"], batch["y"]))


def test_a_step_of_another_batch_structure_starts_a_new_stretch_from_the_written_state():
    strategy, model, optimizer, batches = _setup(2)
    for b in batches:
        strategy.run(sgd_step, args=(model, optimizer, b))
    expected = _state(model, optimizer)

    strategy, model, optimizer, batches = _setup(2)
    carried = strategy.extended.carried_steps((model, optimizer))
    carried.run(sgd_step, batches[0])
    x, y = batches[1]
    carried.run(_dict_step, {"x": x, "y": y})  # another function and batch structure
    carried.run(sgd_step, batches[2])
    carried.release()
    for got, want in zip(_state(model, optimizer), expected):
        np.testing.assert_array_equal(got, want)


def test_an_array_the_user_held_before_the_stretch_keeps_its_value():
    strategy, model, optimizer, batches = _setup(2)
    held = model.l1.kernel.get_value()
    before = np.asarray(held).copy()
    carried = strategy.extended.carried_steps((model, optimizer))
    for b in batches:
        carried.run(sgd_step, b)
    carried.release()
    np.testing.assert_array_equal(np.asarray(held), before)  # copied for the step, not donated
    assert not np.array_equal(np.asarray(model.l1.kernel.get_value()), before)


def test_a_step_that_fails_leaves_the_last_completed_step_s_state_to_release():
    strategy, model, optimizer, batches = _setup(2)
    expected_model, expected_optimizer = _setup(2)[1:3]
    for b in batches[:2]:
        strategy.run(sgd_step, args=(expected_model, expected_optimizer, b))

    carried = strategy.extended.carried_steps((model, optimizer))
    for b in batches[:2]:
        carried.run(sgd_step, b)
    x, y = batches[2]
    wrong = mirrax.PerReplica(strategy, np.ones(x.stacked.shape[:2] + (5,), np.float32))
    with pytest.raises(TypeError, match="dot_general"):  # 5 features into Linear(4, 3)
        carried.run(sgd_step, (wrong, y))
    carried.release()
    for got, want in zip(_state(model, optimizer), _state(expected_model, expected_optimizer)):
        np.testing.assert_array_equal(got, want)


def _fails_from_the_third_step(step):
    if step >= 2:
        raise RuntimeError("the device failed")


def test_a_step_that_fails_on_the_device_after_taking_the_state_is_named_at_release():
    # One device: XLA:CPU runs the step, and raises its callback's error, inside the dispatch
    # that consumed the state (on several, the error reaches a later wait instead).
    strategy, model, optimizer, batches = _setup(1)

    def failing_step(model, optimizer, batch):
        loss = sgd_step(model, optimizer, batch)
        jax.debug.callback(_fails_from_the_third_step, optimizer.step[...])
        return loss

    carried = strategy.extended.carried_steps((model, optimizer))
    with pytest.raises(Exception, match="the device failed"):
        for b in batches + batches:
            carried.run(failing_step, b)
        jax.block_until_ready(carried.run(failing_step, batches[0]))
    # The failed step had consumed the carried arrays: nothing valid is left to write back.
    with pytest.warns(UserWarning, match="A step was interrupted while it ran"):
        carried.release()


def test_writing_without_release_in_a_stretch_is_overwritten_and_warned():
    strategy, model, optimizer, batches = _setup(2)
    carried = strategy.extended.carried_steps((model, optimizer))
    carried.run(sgd_step, batches[0])
    model.l1.kernel.set_value(np.zeros((4, 3), np.float32))  # not through a callback's hook
    carried.run(sgd_step, batches[1])
    with pytest.warns(UserWarning, match="the training overwrote the assignment"):
        carried.release()
    assert not np.array_equal(np.asarray(model.l1.kernel.get_value()), np.zeros((4, 3), np.float32))


def test_carry_false_writes_back_after_every_step():
    strategy, model, optimizer, batches = _setup(2)
    carried = strategy.extended.carried_steps((model, optimizer), carry=False)
    carried.run(sgd_step, batches[0])
    assert not carried.carrying
    after_one = np.asarray(model.l1.kernel.get_value())  # readable: written back
    carried.run(sgd_step, batches[1])
    assert not np.array_equal(np.asarray(model.l1.kernel.get_value()), after_one)
