"""strategy.run: one compiled program, in-place NNX updates, exact gradients, aggregation, RNG."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored, named_strategy

# -- the MLP of the issue ------------------------------------------------------------------------


def mlp_data():
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((3, 2)) * 0.5).astype(np.float32)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = rng.integers(0, 2, 16).astype(np.int32)
    return w1, w2, x, y


class MLP(nnx.Module):
    def __init__(self, w1, w2):
        self.l1 = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.l1.kernel[...] = jnp.asarray(w1)
        self.l2.kernel[...] = jnp.asarray(w2)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def sgd_step(model, optimizer, batch):
    x, y = batch

    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrax.compute_average_loss(per_example, global_batch_size=16)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def numpy_mlp_losses(steps=5, lr=0.1):
    """Float64 reference: forward, backward and SGD written out by hand."""
    w1, w2, x, y = (a.astype(np.float64) for a in mlp_data())
    y = y.astype(int)
    b1, b2 = np.zeros(3), np.zeros(2)
    losses = []
    for _ in range(steps):
        z = x @ w1 + b1
        h = np.maximum(z, 0)
        logits = h @ w2 + b2
        logp = logits - logits.max(1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
        losses.append(-logp[np.arange(16), y].mean())
        dlogits = np.exp(logp)
        dlogits[np.arange(16), y] -= 1
        dlogits /= 16  # mean over the global batch of 16
        dw2, db2 = h.T @ dlogits, dlogits.sum(0)
        dz = (dlogits @ w2.T) * (z > 0)
        dw1, db1 = x.T @ dz, dz.sum(0)
        w1, b1, w2, b2 = w1 - lr * dw1, b1 - lr * db1, w2 - lr * dw2, b2 - lr * db2
    return np.array(losses), w1, w2


def train_mlp(strategy, steps=5):
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        model = MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    losses = [
        float(strategy.reduce("sum", strategy.run(sgd_step, args=(model, optimizer, batch))))
        for _ in range(steps)
    ]
    return np.array(losses), model


@pytest.mark.slow
def test_mlp_losses_match_float64_numpy_and_the_issue(strategy):
    losses, model = train_mlp(strategy)
    expected, w1, w2 = numpy_mlp_losses()
    np.testing.assert_allclose(losses, expected, atol=1e-5)
    np.testing.assert_allclose(losses, [0.597392, 0.589593, 0.582181, 0.575144, 0.568381], atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.l1.kernel[...]), w1, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.l2.kernel[...]), w2, atol=1e-5)


def test_mlp_same_losses_and_weights_for_1_2_4_8_replicas():
    results = [train_mlp(mirrored(r)) for r in (1, 2, 4, 8)]
    base_losses, base_model = results[0]
    for losses, model in results[1:]:
        np.testing.assert_allclose(losses, base_losses, atol=1e-6)
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(base_model))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


# -- compilation and in-place updates -----------------------------------------------------------


def test_run_compiles_once_per_function_and_input_structure(strategy):
    traces = []

    def step(model, x):
        traces.append(1)  # a Python side effect runs only while tracing
        return model(x).sum()

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = np.ones((3, 2), np.float32)
    strategy.run(step, args=(model, x))
    after_first = len(traces)
    strategy.run(step, args=(model, x + 1))
    strategy.run(step, args=(model, x * 2))
    assert len(traces) == after_first  # same shapes: no retrace
    strategy.run(step, args=(model, np.ones((5, 2), np.float32)))
    assert len(traces) > after_first  # a new shape traces again


def test_module_optimizer_and_metric_are_updated_in_place(strategy):
    model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.ones((1, 1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    metric = nnx.metrics.Average()
    n = strategy.num_replicas_in_sync

    def step(model, optimizer, metric):
        # Each replica's share is w / n; the n shares' gradients sum to 1, so w <- 1 - 0.5 * 1.
        loss_fn = lambda m: mirrax.scale_regularization_loss(m.kernel[...].sum())  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metric.update(values=jnp.full((2,), 3.0))  # every replica adds total 6, count 2
        return loss

    strategy.run(step, args=(model, optimizer, metric))
    assert float(model.kernel[...][0, 0]) == pytest.approx(0.5)
    assert int(optimizer.step[...]) == 1
    # Metric state is SUM-aggregated: n replicas x (total 6, count 2) -> mean 3.
    assert float(metric.total[...]) == pytest.approx(6.0 * n)
    assert int(metric.count[...]) == 2 * n
    assert float(metric.compute()) == pytest.approx(3.0)


def test_closure_capture_of_nnx_state_is_carried(strategy):
    # Before: CapturedStateError. Now carried like an argument (tests/test_run_captures.py).
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(x):
        return model(x)

    x = np.ones((2, 2), np.float32)
    out = strategy.experimental_local_results(strategy.run(step, args=(x,)))[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(x)), rtol=1e-6)


class _Registry:
    """A plain object holding a module (or another plain object)."""


_registry = _Registry()
_registry.inner = _Registry()  # two levels down: the capture check does not look that deep


def test_mutation_through_an_attribute_is_refused(strategy):
    _registry.inner.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(x):
        _registry.inner.model.kernel[...] = _registry.inner.model.kernel[...] + x.sum()
        return x

    with pytest.raises(
        mirrax.errors.CapturedStateError, match="mutates an NNX object.*Pass the object in args"
    ):
        strategy.run(step, args=(np.ones((2, 2), np.float32),))


def test_a_module_read_through_a_plain_global_object_is_carried(strategy):
    # Before: refused (CapturedStateError); earlier still, compiled in as constants. Now the
    # object's attribute is carried, so a weight changed between calls is seen.
    _registry.model = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))

    def step(x):
        return _registry.model(x)

    x = np.ones((2, 2), np.float32)
    strategy.run(step, args=(x,))
    _registry.model.kernel[...] = jnp.ones((2, 2))
    out = strategy.run(step, args=(x,))
    # [1, 1] @ ones((2, 2)) = [2, 2] on every replica (the same replicated input).
    np.testing.assert_array_equal(np.asarray(strategy.experimental_local_results(out)[0]), [[2, 2], [2, 2]])


def test_gradient_through_an_unrelated_object_is_a_captured_state_error():
    # flax's own message was a bare ValueError "Cannot extract graph node from different trace
    # level"; the promise is CapturedStateError with the fix (docs/design.md, "strategy.run").
    _registry.inner.net = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def step(x):
        return nnx.grad(lambda m: m(x).sum())(_registry.inner.net)

    with pytest.raises(
        mirrax.errors.CapturedStateError,
        match=r"reaches through an object that is not one of its arguments.*args=\(model, optimizer",
    ):
        mirrored(2).run(step, args=(np.ones((2, 2), np.float32),))


class _Trainer:
    def __init__(self, model):
        self.model = model


def test_a_plain_object_holding_a_module_as_an_argument_is_refused():
    trainer = _Trainer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(
        mirrax.errors.CapturedStateError,
        match=r"args\[0\] is a _Trainer that holds NNX state \(args\[0\].model \(Linear\)\)"
        r".*args=\(args\[0\].model",
    ):
        mirrored(2).run(lambda t, x: t.model(x), args=(trainer, np.ones((2, 2), np.float32)))


def test_a_module_can_be_the_function(strategy):
    model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.array([[1.0], [2.0]])
    data = np.arange(2 * strategy.num_replicas_in_sync * 2, dtype=np.float32).reshape(-1, 2)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    out = strategy.run(model, args=(batch,))
    # Row [a, b] -> a + 2b; gathered over replicas it is every row of `data` in order.
    np.testing.assert_allclose(np.asarray(strategy.gather(out, axis=0))[:, 0], data @ [1.0, 2.0])


def test_non_callable_fn_is_a_type_error():
    with pytest.raises(TypeError, match=r"fn must be callable.*received 3 of type int"):
        mirrored(2).run(3)
    with pytest.raises(TypeError, match="args must be a tuple or list"):
        mirrored(2).run(lambda x: x, args=np.ones(2))


# -- write-back aggregation -------------------------------------------------------------------


class Counter(nnx.Module):
    def __init__(self, aggregation=None):
        extra = {} if aggregation is None else {"aggregation": aggregation}
        self.param = nnx.Param(jnp.zeros(()), **extra)
        self.stat = nnx.BatchStat(jnp.zeros(()))


def replica_value(x):
    """1, 2, ..., R on replicas 0 .. R-1, as a float32 scalar."""
    return (mirrax.get_replica_context().replica_id_in_sync_group + 1).astype(jnp.float32) + x


def test_varying_param_is_an_error_naming_its_path(multi_strategy):
    counter = Counter()

    def step(counter):
        counter.param[...] = replica_value(counter.param[...])

    with pytest.raises(
        mirrax.errors.VaryingVariableError,
        match=r"args\[0\]\.param \(Param, aggregation NONE\).*aggregation=mirrax.VariableAggregation",
    ):
        multi_strategy.run(step, args=(counter,))


def test_batch_stat_is_averaged_and_override_through_metadata(strategy):
    n = strategy.num_replicas_in_sync
    for aggregation, expected in [
        ("MEAN", (n + 1) / 2),  # mean of 1..n
        (mirrax.VariableAggregation.SUM, n * (n + 1) / 2),  # 0 + sum of the updates 1..n
        ("only_first_replica", 1.0),  # replica 0's value
    ]:
        counter = Counter(aggregation)

        def step(counter):
            counter.param[...] = replica_value(counter.param[...])
            counter.stat[...] = replica_value(counter.stat[...])

        strategy.run(step, args=(counter,))
        assert float(counter.param[...]) == pytest.approx(expected), aggregation
        assert float(counter.stat[...]) == pytest.approx((n + 1) / 2)  # BatchStat: MEAN


# -- randomness -----------------------------------------------------------------------------------


def dropout_masks(strategy, seed, steps=2):
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))
    ones = np.ones((strategy.num_replicas_in_sync, 64), np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset(ones)))
    outs = []
    for _ in range(steps):
        out = strategy.run(lambda d, x: d(x), args=(dropout, batch))
        outs.append([np.asarray(v) for v in strategy.experimental_local_results(out)])
    return outs


def test_dropout_masks_differ_across_replicas_and_steps_and_reproduce(multi_strategy):
    first = dropout_masks(multi_strategy, seed=3)
    again = dropout_masks(multi_strategy, seed=3)
    step0, step1 = first
    assert not np.array_equal(step0[0], step0[1])  # replicas differ
    assert not np.array_equal(step0[0], step1[0])  # steps differ
    for a, b in zip(step0 + step1, again[0] + again[1]):
        np.testing.assert_array_equal(a, b)  # same seed, same masks


def test_dropout_keeps_parameters_identical_on_every_replica(multi_strategy):
    class Net(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    net = Net()
    optimizer = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)
    data = np.ones((multi_strategy.num_replicas_in_sync * 2, 4), np.float32)
    batch = next(iter(multi_strategy.experimental_distribute_dataset(data)))

    def step(net, optimizer, x):
        loss_fn = lambda n: mirrax.compute_average_loss(n.drop(n.dense(x)).sum(1))  # noqa: E731
        optimizer.update(net, nnx.grad(loss_fn)(net))

    multi_strategy.run(step, args=(net, optimizer, batch))
    kernel = net.dense.kernel[...]
    shards = [np.asarray(s.data) for s in kernel.addressable_shards]
    assert len(shards) == multi_strategy.num_replicas_in_sync
    for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])


# -- synchronized batch norm ----------------------------------------------------------------------


def test_sync_batch_norm_uses_global_statistics():
    strategy = mirrored(2)
    # Replica batches [0, 2] and [4, 6]: global mean (0+2+4+6)/4 = 3,
    # variance ((-3)^2 + (-1)^2 + 1^2 + 3^2) / 4 = 5.
    data = np.array([[0.0], [2.0], [4.0], [6.0]], np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    synced = nnx.BatchNorm(1, momentum=0.0, axis_name=mirrax.REPLICA_AXIS, rngs=nnx.Rngs(0))
    strategy.run(lambda bn, x: bn(x), args=(synced, batch))
    assert float(synced.mean[...][0]) == pytest.approx(3.0)
    assert float(synced.var[...][0]) == pytest.approx(5.0)


def test_plain_batch_norm_keeps_per_replica_statistics_averaged_on_write_back():
    strategy = mirrored(2)
    data = np.array([[0.0], [2.0], [4.0], [6.0]], np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    plain = nnx.BatchNorm(1, momentum=0.0, rngs=nnx.Rngs(0))

    def step(bn, x):
        bn(x)
        return bn.mean[...]

    local_means = strategy.run(step, args=(plain, batch))
    # Inside the step each replica saw its own statistics: means 1 and 5 ...
    np.testing.assert_allclose([float(v[0]) for v in local_means.values], [1.0, 5.0])
    # ... written back as their average (BatchStat aggregation MEAN): (1 + 5) / 2 = 3,
    # variances (1 + 1) / 2 = 1.
    assert float(plain.mean[...][0]) == pytest.approx(3.0)
    assert float(plain.var[...][0]) == pytest.approx(1.0)


# -- regularization -------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_scale_regularization_loss_counts_the_penalty_once(replicas):
    strategy = mirrored(replicas)
    w = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    w.kernel[...] = jnp.full((1, 1), 2.0)

    def step(w):
        def penalty(m):
            return mirrax.scale_regularization_loss(0.5 * 0.01 * (m.kernel[...] ** 2).sum())

        return nnx.grad(penalty)(w).kernel[...]

    grad = strategy.run(step, args=(w,))
    # d/dw 0.5 * 0.01 * w^2 = 0.01 * w = 0.02, whatever the replica count.
    assert float(grad.values[0][0, 0]) == pytest.approx(0.02)


# -- placement and strategy mixing ----------------------------------------------------------------


@pytest.mark.slow
def test_objects_created_outside_scope_work_as_if_created_inside(strategy):
    inside_losses, inside_model = train_mlp(strategy)
    w1, w2, x, y = mlp_data()
    model = MLP(w1, w2)  # no scope
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    losses = [
        float(strategy.reduce("sum", strategy.run(sgd_step, args=(model, optimizer, batch))))
        for _ in range(5)
    ]
    np.testing.assert_allclose(losses, inside_losses, atol=1e-7)


def test_mixing_two_multi_replica_strategies_is_refused():
    first = named_strategy("Mirrored2CPU")
    second = mirrax.MirroredStrategy(["cpu:2", "cpu:3"])
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = np.ones((2, 2), np.float32)
    first.run(lambda m, x: m(x), args=(model, x))  # places model on cpu:0, cpu:1
    with pytest.raises(
        mirrax.errors.MixedStrategyError, match=r"another strategy's devices \(cpu:0, cpu:1\)"
    ):
        second.run(lambda m, x: m(x), args=(model, x))
    batch = next(iter(first.experimental_distribute_dataset(x)))
    with pytest.raises(mirrax.errors.MixedStrategyError, match="created by another strategy"):
        second.run(lambda x: x, args=(batch,))


class _Net(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x)


def test_a_module_trained_under_one_strategy_names_itself_and_the_fix_works_under_another():
    first = named_strategy("Mirrored2CPU")
    second = mirrax.MirroredStrategy(["cpu:2", "cpu:3"])
    x, y = np.ones((4, 2), np.float32), np.full((4, 1), 2.0, np.float32)
    with first.scope():
        trained = mirrax.Model(_Net())
        trained.compile(optimizer="sgd", loss="mse")
        trained.fit(x, y, batch_size=4, epochs=1, verbose=0)
    net = trained.module
    batch = next(iter(second.experimental_distribute_dataset(x)))
    # Before: "the state of args[0], args[2][0] lives on ... create (or restore) them for this
    # strategy, e.g. under `with strategy.scope():`", which does not help (placement does not
    # depend on the scope).
    with pytest.raises(mirrax.errors.MixedStrategyError) as info:
        second.run(lambda model, x: model(x), args=(), kwargs={"model": net, "x": batch})
    message = str(info.value)
    assert "kwargs['model'] (a _Net): variable dense." in message
    assert "(Param) lives on another strategy's devices (cpu:0, cpu:1)" in message
    assert "runs on cpu:2, cpu:3" in message
    fix = "nnx.update(obj, jax.device_get(nnx.state(obj)))"
    assert fix in message
    with second.scope(), pytest.raises(mirrax.errors.MixedStrategyError):
        second.run(lambda model, x: model(x), args=(net, batch))  # the old advice: no help
    expected = np.asarray(net(x))  # computed on the host: the same weights, one device
    nnx.update(net, jax.device_get(nnx.state(net)))  # the fix the message gives
    out = second.run(lambda model, x: model(x), args=(net, batch))
    # Both compute x @ kernel + bias from the same float32 weights; XLA may order the
    # 2-term dot differently on each path, hence the tolerance of a few float32 ulps.
    np.testing.assert_allclose(np.asarray(second.gather(out, axis=0)), expected, rtol=1e-6)
    with second.scope():  # and a Model of the module trains under the new strategy
        moved = mirrax.Model(net)
        moved.compile(optimizer="sgd", loss="mse")
        assert np.isfinite(moved.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"][0])


def test_nested_scopes_of_different_strategies_are_refused():
    with mirrored(2).scope():
        with pytest.raises(mirrax.errors.MixedStrategyError, match="mixing different strategies"):
            with mirrored(4).scope():
                pass


# -- graphs a pytree cannot express, and graphs that change -------------------------------------


def test_shared_variables_are_updated_once(strategy):
    first = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    second = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    second.kernel = first.kernel  # one Variable in two modules
    before = np.asarray(first.kernel[...])

    def step(first, second):
        first.kernel[...] = first.kernel[...] + 1.0
        return second.kernel[...].sum()

    total = strategy.run(step, args=(first, second))
    assert second.kernel is first.kernel
    np.testing.assert_allclose(np.asarray(first.kernel[...]), before + 1.0)
    assert float(total.values[0]) == pytest.approx(float((before + 1.0).sum()))


def test_a_module_that_gains_a_variable_is_retraced(strategy):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(model, x):
        extra = model.extra[...] if hasattr(model, "extra") else 0.0
        return (model(x) * 0.0).sum() + extra

    x = np.ones((1, 2), np.float32)
    assert float(strategy.run(step, args=(model, x)).values[0]) == 0.0
    model.extra = nnx.Param(jnp.float32(5.0))
    assert float(strategy.run(step, args=(model, x)).values[0]) == 5.0


# -- mistakes a TF user makes -------------------------------------------------------------------


def test_wrapping_run_in_jit_says_to_call_it_directly():
    strategy = mirrored(2)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    @nnx.jit
    def wrapped(model, x):
        return strategy.run(lambda m, x: m(x), args=(model, x))

    with pytest.raises(mirrax.errors.ReplicaContextError, match="call it directly"):
        wrapped(model, jnp.ones((2, 2)))


def test_a_jitted_step_around_run_on_a_captured_model_is_a_replica_context_error():
    # The TF habit: @tf.function around strategy.run, the model captured. Before: flax's
    # TraceContextError ("Cannot mutate Param from a different trace level").
    strategy = mirrored(2)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset(np.ones((4, 2), np.float32))))

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: mirrax.compute_average_loss(m(batch).sum(-1)))(model)
        optimizer.update(model, grads)
        return loss

    @jax.jit
    def train_step():
        return strategy.run(step, args=(model, optimizer, batch))

    kernel = np.asarray(model.kernel[...])
    with pytest.raises(
        mirrax.errors.ReplicaContextError,
        match="inside jax.jit.*call it directly with the plain step function",
    ):
        train_step()
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)  # nothing half-written
    # The fix the message gives works: the same call without the decorator trains.
    strategy.run(step, args=(model, optimizer, batch))
    assert not np.array_equal(np.asarray(model.kernel[...]), kernel)


def test_passing_the_dataset_instead_of_a_batch():
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(np.ones((4, 2), np.float32))
    with pytest.raises(
        TypeError, match=r"args\[0\] is a DistributedDataset, not a batch.*for batch in dist_dataset"
    ):
        strategy.run(lambda b: b, args=(dataset,))


def test_gradients_can_be_returned():
    strategy = mirrored(2)
    model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.full((1, 1), 3.0)
    batch = next(iter(strategy.experimental_distribute_dataset(np.array([[1.0], [2.0]], np.float32))))

    def step(model, x):
        return nnx.grad(lambda m: mirrax.compute_average_loss(m(x)[:, 0]))(model)

    grads = strategy.run(step, args=(model, batch))
    # d/dw mean(w * x) over x = [1, 2] is (1 + 2) / 2 = 1.5, summed over both replicas' shares.
    assert float(strategy.reduce("mean", grads["kernel"])[0, 0]) == pytest.approx(1.5)


def test_recompiling_one_function_again_and_again_warns():
    strategy = mirrored(2)

    def step(x, k):
        return x * k

    with pytest.warns(UserWarning, match=r"compiled step 6 times.*values: 5\..*jnp.int32\(step\)"):
        for value in range(6):  # a Python int is a compile-time constant: 6 programs
            strategy.run(step, args=(np.ones(2, np.float32), value))


def test_a_function_defined_anew_every_call_warns_when_its_captures_change():
    # Before: six lambdas of one code were six programs. Now one program serves a function
    # defined anew with the same captures (tests/test_run_captures.py); a capture that is a
    # new array every time still makes a new program each time, and warns.
    strategy = mirrored(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            strategy.run(lambda x: x * 3, args=(np.ones(2, np.float32),))
    with pytest.warns(UserWarning, match=r"compiled <lambda> 6 times.*defined anew for every call"):
        for i in range(6):
            scale = np.float32(i)
            strategy.run(lambda x: x * scale, args=(np.ones(2, np.float32),))


def test_zero_padding_would_give_nan_gradients_but_padding_repeats_real_rows():
    strategy = mirrored(4)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    data = np.arange(1.0, 11.0, dtype=np.float32).reshape(5, 2)  # 5 over 4 replicas: 2, 2, 1, 0

    def step(model, optimizer, x):
        # Normalising the input is undefined on an all-zero row.
        def loss_fn(m):
            return mirrax.compute_average_loss(m(x / jnp.linalg.norm(x, axis=1, keepdims=True))[:, 0] ** 2)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(model, optimizer, batch))
    assert np.isfinite(np.asarray(model.kernel[...])).all()


def test_experimental_lower_gives_the_program_run_executes_without_running_it():
    strategy = mirrax.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        module = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset(np.ones((4, 3), np.float32))))

    def step(module, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: mirrax.compute_average_loss(m(x)[:, 0]))(module)
        optimizer.update(module, grads)
        return loss

    before = np.asarray(module.kernel[...])
    lowered = strategy.experimental_lower(step, args=(module, optimizer, batch))
    assert isinstance(lowered, jax.stages.Lowered)
    assert np.array_equal(np.asarray(module.kernel[...]), before)  # nothing ran
    # 2 replicas: the gradient sum is an all-reduce in the program.
    assert " all-reduce(" in lowered.compile().as_text()
    strategy.run(step, args=(module, optimizer, batch))
    assert not np.array_equal(np.asarray(module.kernel[...]), before)
    with pytest.raises(
        mirrax.errors.InvalidArgumentTypeError,
        match=re.escape(
            "strategy.experimental_lower: fn must be callable (a function, method or NNX "
            "module); received 3 of type int."
        ),
    ):
        strategy.experimental_lower(3)


def test_none_arguments_reach_the_function_as_none_among_objects_and_batches():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    model = MLP(w1, w2)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))

    def step(first, model, second, batch, third):
        assert first is None and second is None and third is None
        return model(batch[0]).sum()

    total = strategy.reduce("sum", strategy.run(step, args=(None, model, None, batch, None)), axis=None)
    # The same sum computed on the host: relu(x w1 + b1) w2 + b2 over all 16 examples (biases 0).
    expected = (np.maximum(x @ w1, 0.0) @ w2).sum()
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)  # float32 sums in another order
