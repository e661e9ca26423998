"""ParameterServerStrategy(update="gradients"), TF's update rule, on a local Ray cluster started
by this module: the servers apply each optimizer's optax update to the parameters they hold,
with the state they hold (laid out with its parameters); a worker pulls the parameters and the
optimizer's scalars, and pushes the gradients. Equality with MirroredStrategy, the bytes moved,
the refusals, and a worker killed mid-training."""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from tests import ray_cluster as cluster
from tests.ray_cluster import ray, ray_cluster  # noqa: F401 - the module's cluster
from tests.test_parameter_server_ray import MLP
from tests.test_parameter_server_ray import sgd_step as train_step

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("parameter_server_ray")]


def _strategy(num_workers, num_ps, partitioner=None):
    return cluster.strategy(num_workers, num_ps, partitioner, update="gradients")


def _training(strategy, coordinator, batches, pause_s=0.0):
    """A model, its Adam made under the strategy's scope, and a scheduled step over `batches`
    (each worker's dataset), with the iterator to pass it."""
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: iter(batches)))

    def step(iterator):
        time.sleep(pause_s)
        return strategy.reduce("sum", strategy.run(train_step, args=(model, optimizer, next(iterator))))

    return model, optimizer, step, iterator


def _batches(count):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
        for _ in range(count)
    ]


def test_one_synchronous_worker_with_adam_equals_mirrored_strategy_and_moves_no_moments(tmp_path):
    """One worker, each step fetched before the next: the servers' Adam updates are
    MirroredStrategy's. Within 1e-6: a server runs the update as its own compiled program,
    which may round differently from the update fused into the step."""
    strategy = _strategy(1, 2, mirrax.partitioners.FixedShardsPartitioner(2))
    try:
        coordinator = mirrax.ClusterCoordinator(strategy)
        batches = _batches(10)
        model, optimizer, step, iterator = _training(strategy, coordinator, batches * 2)
        losses = [float(coordinator.schedule(step, args=(iterator,)).fetch()) for _ in batches]
        coordinator.join()
        # The moments live with their parameter, in its shards; the scalars on both servers.
        placement = strategy.extended.variable_placement()
        assert placement["objects[0].hidden.kernel"] == [(0, 2), (1, 2)]
        for moment in ("mu", "nu"):
            for name in ("hidden.kernel", "hidden.bias", "out.kernel", "out.bias"):
                assert placement[f"objects[1].opt_state.0.{moment}.{name}"] == placement[f"objects[0].{name}"]
        # Parameters: 4*8 + 8 + 8*1 + 1 = 49 float32 = 196 bytes. A step pulls them and the two
        # scalars (Adam's count, int32, and optimizer.step, uint32: 8 bytes), and pushes the 49
        # gradients; the moments (2 * 196 bytes) never travel.
        assert coordinator.transferred_bytes[-1] == (196 + 8, 196)

        mirrored = mirrax.MirroredStrategy(["cpu:0"])
        twin = MLP(nnx.Rngs(0))
        twin_optimizer = nnx.Optimizer(twin, optax.adam(0.01), wrt=nnx.Param)
        twin_losses = [
            float(mirrored.reduce("sum", mirrored.run(train_step, args=(twin, twin_optimizer, batch))))
            for batch in mirrored.experimental_distribute_dataset(batches)
        ]
        np.testing.assert_allclose(losses, twin_losses, rtol=1e-6)
        # A checkpoint reads the servers' values: the parameters and Adam's state they hold.
        mirrax.Checkpoint(model=model, optimizer=optimizer).write(tmp_path / "ckpt")
        for a, b in zip(
            jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(nnx.state((twin, twin_optimizer)))
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert int(optimizer.step[...]) == 10 and int(optimizer.opt_state[0].count[...]) == 10

        # A value assigned on the coordinator reaches every copy of a scalar: Adam's count on
        # both servers (each applies its slice's bias correction with its own copy).
        optimizer.opt_state[0].count[...] = jnp.asarray(100, jnp.int32)
        coordinator.schedule(step, args=(iterator,)).fetch()
        counts = [
            int(values[key])
            for _, values in ray.get([ps.pull.remote() for ps in strategy.extended.cluster.parameter_servers])
            for key in values
            if placement_key(strategy, key) == "objects[1].opt_state.0.count"
        ]
        assert counts == [101, 101]
    finally:
        strategy.shutdown()


def placement_key(strategy, key):
    """The path of a server's (leaf, shard) key."""
    return list(strategy.extended.variable_placement())[key[0]]


@pytest.fixture(scope="module")
def single():
    strategy = _strategy(1, 1)
    yield strategy, mirrax.ClusterCoordinator(strategy)
    strategy.shutdown()


def test_what_the_gradients_rule_cannot_apply_is_refused(single):
    strategy, coordinator = single
    batch = _batches(1)[0]
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    # An optimizer held without its model forms its group once the model is held too.
    coordinator.schedule(lambda: optimizer.step[...]).fetch()
    # An optimizer whose update the servers cannot apply keeps the differences rule, said once:
    # nnx.clone makes an optimizer without its __init__ (its model is unknown), and L-BFGS's
    # memory (10 past updates per parameter) mirrors no parameter's shape.
    with strategy.scope():
        clone_model = MLP(nnx.Rngs(3))
        cloned = nnx.clone(nnx.Optimizer(clone_model, optax.adam(0.01), wrt=nnx.Param))
        lbfgs_model = MLP(nnx.Rngs(1))
        lbfgs = nnx.Optimizer(lbfgs_model, optax.lbfgs(linesearch=None), wrt=nnx.Param)
    for model_, optimizer_, why in (
        (clone_model, cloned, "was made before the strategy"),
        (lbfgs_model, lbfgs, "neither mirrors one of its model's parameters"),
    ):
        with pytest.warns(RuntimeWarning, match=why):
            coordinator.schedule(lambda m=model_, o=optimizer_: strategy.run(train_step, args=(m, o, batch)))
        coordinator.join()
        strategy.extended.variable_store.refresh()
        assert int(optimizer_.step[...]) == 1  # trained: its state pulled and pushed as differences

    def with_value(model, optimizer, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads, value=loss)

    # A function's error is raised by the next join (as TF), which then lets later ones run.
    coordinator.schedule(lambda: strategy.run(with_value, args=(model, optimizer, batch)))
    with pytest.raises(errors.UnsupportedArgumentError, match=r"without \['value'\]"):
        coordinator.join()
    with strategy.scope():
        other = MLP(nnx.Rngs(2))

    def another_model(model, other, optimizer, batch):
        x, y = batch
        _, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(other)
        optimizer.update(other, grads)

    coordinator.schedule(lambda: strategy.run(another_model, args=(model, other, optimizer, batch)))
    with pytest.raises(errors.InvalidArgumentError, match="is not a parameter of the model this optimizer"):
        coordinator.join()
    # After the errors the rule still trains: one update moves the parameters (step 1).
    before = np.asarray(model.out.bias[...]).copy()
    coordinator.schedule(lambda: strategy.run(train_step, args=(model, optimizer, batch))).fetch()
    coordinator.join()
    strategy.extended.variable_store.refresh()
    assert int(optimizer.step[...]) == 1 and not np.array_equal(np.asarray(model.out.bias[...]), before)


def test_a_killed_worker_under_the_gradients_rule_loses_no_update():
    # At least once, as under "differences": a function whose worker died runs again, and a
    # worker that died after its push counts twice, so the servers' step count is >= 30.
    strategy = _strategy(2, 1)
    try:
        coordinator = mirrax.ClusterCoordinator(strategy)
        model, optimizer, step, iterator = _training(strategy, coordinator, _batches(4) * 100, pause_s=0.05)
        victim = coordinator.schedule(os.getpid).fetch()
        values = [coordinator.schedule(step, args=(iterator,)) for _ in range(30)]
        while sum(v.is_ready() for v in values) < 5:
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        coordinator.join()
        losses = [float(v.fetch()) for v in values]
        assert all(np.isfinite(losses))
        strategy.extended.variable_store.refresh()
        assert int(optimizer.step[...]) >= 30
        assert int(optimizer.step[...]) == int(optimizer.opt_state[0].count[...])
    finally:
        strategy.shutdown()


def test_after_a_masked_optimizer_the_next_one_trains_and_the_servers_state_is_not_written_on_a_worker(
    single,
):
    # optax.masked's state holds MaskedNode Variables, which have no array: each worker tag
    # after them was shifted, so an optimizer held later found no group and trained on its own.
    strategy, coordinator = single
    batch = _batches(1)[0]
    with strategy.scope():
        masked_model = MLP(nnx.Rngs(0))
        masked = nnx.Optimizer(
            masked_model,
            optax.masked(optax.adam(0.01), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
            wrt=nnx.Param,
        )
    coordinator.schedule(lambda: strategy.run(train_step, args=(masked_model, masked, batch))).fetch()
    with strategy.scope():
        model = MLP(nnx.Rngs(1))
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    seen = [
        coordinator.schedule(
            lambda: (strategy.run(train_step, args=(model, optimizer, batch)), int(optimizer.step[...]))[1]
        ).fetch()
        for _ in range(3)
    ]
    coordinator.join()
    # The worker reads the step its servers hold (0, 1, 2 before its own update: + 1).
    assert seen == [1, 2, 3]
    assert int(optimizer.step[...]) == 3 and int(optimizer.opt_state[0].count[...]) == 3
    assert int(masked.step[...]) == 1

    # Adam's moments are the servers' (a worker's copy is zeros): assigning them there is refused.
    def reset_moment():
        optimizer.opt_state[0].mu["out"]["bias"][...] = jnp.full((1,), 5.0)

    coordinator.schedule(reset_moment)
    with pytest.raises(
        errors.UnsupportedArgumentError, match=r"assigned objects\[\d+\]\.opt_state\.0\.mu\.out\.bias"
    ):
        coordinator.join()
    assert int(coordinator.schedule(lambda: int(optimizer.step[...])).fetch()) == 3  # nothing pushed
