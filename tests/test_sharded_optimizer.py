"""Optimizer state sharded over the replicas (ZeRO-1, `shard_optimizer_state=True`): the same
numbers as the unsharded step, 1/R of the state per device, one all-reduce's bytes on the
wire, checkpoints of whole arrays across layouts, and every unsupported use named."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax._src.distribute import sharded_optimizer
from tests.multiworker import harness

# Sharded and unsharded steps add the same gradients in a different order (a reduce-scatter
# and an all-reduce may split the replica sum differently; XLA partitions the update), so
# values agree to float32 rounding over 10 steps, not bit for bit; 1e-6 is the bound.
TOLERANCE = 1e-6
GLOBAL_BATCH = 16


class MLP(nnx.Module):
    def __init__(self, sizes, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


SIZES = (8, 16, 16, 10)  # the 10-wide bias has no dimension 4 divides: it stays whole


def _strategy(replicas, shard=True, **options):
    return mirrax.MirroredStrategy(jax.devices()[:replicas], shard_optimizer_state=shard, **options)


def _data(seed=0, features=SIZES[0]):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((GLOBAL_BATCH, features)).astype(np.float32)
    y = rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32)
    return x, y


def _build(strategy, tx, sizes=SIZES):
    with strategy.scope():
        model = MLP(sizes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, optimizer


def _loss(model, x, y):
    return mirrax.compute_average_loss(optax.softmax_cross_entropy_with_integer_labels(model(x), y))


def _run_once(strategy, model, optimizer, step):
    batch = next(iter(strategy.experimental_distribute_dataset(_data())))
    return strategy.run(step, args=(model, optimizer, batch))


def _step(grad="mirrax", **options):
    """A train step: gradients from `mirrax.value_and_grad(_loss, **options)` (or
    `nnx.value_and_grad`), one `optimizer.update`; returns this replica's loss share."""

    def step(model, optimizer, batch):
        if grad == "mirrax":
            loss, grads = mirrax.value_and_grad(_loss, **options)(model, *batch)
        else:
            loss, grads = nnx.value_and_grad(_loss)(model, *batch)
        optimizer.update(model, grads)
        return loss

    return step


def _train(strategy, model, optimizer, steps, grad="mirrax", data=None):
    batch = next(iter(strategy.experimental_distribute_dataset(data or _data())))
    step = _step(grad)
    for _ in range(steps):
        strategy.run(step, args=(model, optimizer, batch))


def _arrays(*objects):
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(objects))]


def _assert_close(left, right, tolerance=TOLERANCE):
    assert len(left) == len(right)
    for a, b in zip(left, right):
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance)


TRANSFORMS = {
    "adam": lambda: optax.adam(1e-2),
    # The norm is global: XLA sums the squares over every slice of every gradient.
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "masked_weight_decay": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
    ),
}


def test_shard_dimension_is_the_first_one_the_replica_count_divides():
    assert sharded_optimizer.shard_dimension((16, 10), 4) == 0
    assert sharded_optimizer.shard_dimension((10, 16), 4) == 1  # 10 % 4 = 2, 16 % 4 = 0
    assert sharded_optimizer.shard_dimension((10,), 4) is None  # kept whole
    assert sharded_optimizer.shard_dimension((2,), 4) is None  # smaller than the count
    assert sharded_optimizer.shard_dimension((), 4) is None  # a scalar (a step count)
    assert sharded_optimizer.shard_dimension((9, 4), 3) == 0


@pytest.mark.slow
@pytest.mark.parametrize("grad", ["mirrax", "nnx"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_ten_steps_match_the_unsharded_step(transform, grad):
    results = []
    for shard in (False, True):
        strategy = _strategy(4, shard)
        model, optimizer = _build(strategy, TRANSFORMS[transform]())
        _train(strategy, model, optimizer, 10, grad)
        results.append(_arrays(model, optimizer))
    _assert_close(*results)


def test_state_arrays_are_split_and_small_ones_stay_whole():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))
    _train(strategy, model, optimizer, 1)
    specs = {
        "/".join(map(str, path)): variable.get_value().sharding.spec
        for path, variable in nnx.to_flat_state(nnx.state(optimizer))
    }
    replicated, split = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec("replica")
    assert specs["opt_state/0/count"] == replicated  # int32 scalar
    assert specs["opt_state/0/mu/layers/0/kernel"] == split  # (8, 16): dimension 0
    assert specs["opt_state/0/nu/layers/2/kernel"] == split  # (16, 10): dimension 0
    assert specs["opt_state/0/mu/layers/2/bias"] == replicated  # (10,): 4 divides nothing
    assert specs["step"] == replicated
    for variable in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        assert variable.get_value().sharding.spec == replicated  # parameters stay whole


def test_three_replicas_split_what_three_divides():
    # (6, 9): dimension 0; (9,): split; (9, 4): dimension 0; (4,): kept whole.
    sizes = (6, 9, 4)
    results = []
    for shard in (False, True):
        strategy = _strategy(3, shard)
        model, optimizer = _build(strategy, optax.adam(1e-2), sizes)
        data = _data(features=6)
        data = (data[0][:15], np.minimum(data[1][:15], 3))  # 15 rows: 5 per replica
        _train(strategy, model, optimizer, 5, data=data)
        results.append(_arrays(model, optimizer))
        mu = optimizer.opt_state[0].mu["layers"]
        if shard:
            assert mu[0]["bias"].get_value().sharding.spec == jax.sharding.PartitionSpec("replica")
            assert mu[1]["bias"].get_value().sharding.spec == jax.sharding.PartitionSpec()
    _assert_close(*results)


def test_fit_matches_the_unsharded_fit():
    x = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    y = np.random.default_rng(2).integers(0, 10, 64).astype(np.int32)
    histories, weights = [], []
    for shard in (False, True):
        strategy = _strategy(4, shard)
        with strategy.scope():
            model = mirrax.Model(MLP(SIZES, nnx.Rngs(0)))
            model.compile(
                optimizer=optax.adam(1e-2),
                metrics=["accuracy"],
                loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0)
        histories.append(history.history)
        weights.append([np.asarray(w) for w in model.get_weights()])
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=0, atol=TOLERANCE)
    assert histories[0]["accuracy"] == histories[1]["accuracy"]
    _assert_close(*weights)


@pytest.mark.slow
def test_replica_invariant_mode_is_bitwise_the_unsharded_one():
    results = []
    for shard in (False, True):
        strategy = _strategy(4, shard, replica_invariant=True)
        model, optimizer = _build(strategy, optax.adam(1e-2))
        _train(strategy, model, optimizer, 10)
        results.append(_arrays(model, optimizer))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def _device_bytes(objects, device) -> int:
    """Bytes of the objects' arrays held on `device` (their shards there)."""
    return sum(
        shard.data.nbytes
        for a in jax.tree.leaves(nnx.state(objects))
        for shard in a.addressable_shards
        if shard.device == device
    )


@pytest.mark.slow
def test_adam_state_per_device_is_a_quarter_at_four_replicas():
    sizes = (64, 256, 256, 10)
    sizes_by_mode = {}
    lowered = {}
    for shard in (False, True):
        strategy = _strategy(4, shard)
        model, optimizer = _build(strategy, optax.adam(1e-3), sizes)
        data = _data(features=64)
        _train(strategy, model, optimizer, 1, data=data)
        sizes_by_mode[shard] = _device_bytes((model, optimizer), jax.devices()[0])
        batch = next(iter(strategy.experimental_distribute_dataset(data)))
        lowered[shard] = (
            strategy.experimental_lower(_step(), args=(model, optimizer, batch)).compile().memory_analysis()
        )
    # P = 64*256 + 256 + 256*256 + 256 + 256*10 + 10 = 84,746 float32 parameters. Unsharded:
    # P + 2P (Adam's moments) + 2 scalars. Sharded: P + 2(P - 10)/4 + 2*10 (the 10-wide
    # bias's moments stay whole) + 2 scalars: 0.5000x of 3P to four digits, <= 0.55 required.
    p = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert sizes_by_mode[False] == 4 * 3 * p + 4 + 4
    assert sizes_by_mode[True] == 4 * (p + 2 * (p - 10) // 4 + 2 * 10) + 4 + 4
    assert sizes_by_mode[True] <= 0.55 * sizes_by_mode[False]
    if lowered[True] is not None:  # XLA's own count of the program's inputs per device
        assert (
            lowered[True].argument_size_in_bytes
            <= 0.55 * lowered[False].argument_size_in_bytes + 4 * 16 * 64 // 4 + 1024
        )


_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")
_ARRAY = re.compile(r"(f32|s32|u32|bf16|f16)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}


def _wire_bytes(hlo: str, replicas: int) -> dict:
    """Bytes each device sends per step in a ring implementation, by collective kind: an
    all-reduce of S bytes sends 2(R-1)/R S; a reduce-scatter of S bytes in (S/R out) and an
    all-gather of S/R in (S out) send (R-1)/R S each. (Operand bytes would count an
    all-gather by its slice and a reduce-scatter by its whole input, which is no measure of
    traffic.) Shapes read are the instructions' results."""
    sent = {"all-reduce": 0.0, "reduce-scatter": 0.0, "all-gather": 0.0}
    for shape, kind in _COLLECTIVE.findall(hlo):
        size = sum(
            _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for t, dims in _ARRAY.findall(shape)
        )
        whole = size * replicas if kind == "reduce-scatter" else size
        factor = 2 if kind == "all-reduce" else 1
        sent[kind] += factor * (replicas - 1) / replicas * whole
    return sent


@pytest.mark.slow
def test_the_bytes_on_the_wire_are_one_all_reduces():
    sent = {}
    for shard in (False, True):
        strategy = _strategy(4, shard)
        model, optimizer = _build(strategy, optax.adam(1e-3))
        batch = next(iter(strategy.experimental_distribute_dataset(_data())))
        hlo = strategy.experimental_lower(_step(), args=(model, optimizer, batch)).compile().as_text()
        sent[shard] = _wire_bytes(hlo, 4)
    assert sent[False]["reduce-scatter"] == sent[False]["all-gather"] == 0
    assert sent[True]["reduce-scatter"] > 0 and sent[True]["all-gather"] > 0
    # Only the arrays 4 does not divide (the 10-wide bias) and scalars are all-reduced.
    assert sent[True]["all-reduce"] < 0.05 * sent[False]["all-reduce"]
    assert sum(sent[True].values()) <= 1.05 * sum(sent[False].values())


@pytest.mark.slow
def test_checkpoints_hold_whole_arrays_and_restore_into_any_layout(tmp_path):
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))
    _train(strategy, model, optimizer, 10)
    path = str(tmp_path / "sharded")
    mirrax.Checkpoint(model=model, optimizer=optimizer).write(path)
    _train(strategy, model, optimizer, 1)  # step 11, continuing under 4
    expected = _arrays(model, optimizer)
    for replicas, shard in ((1, False), (2, True), (8, True)):
        other = _strategy(replicas, shard)
        restored_model, restored_optimizer = _build(other, optax.adam(1e-2))
        mirrax.Checkpoint(model=restored_model, optimizer=restored_optimizer).restore(path)
        _train(other, restored_model, restored_optimizer, 1)
        _assert_close(_arrays(restored_model, restored_optimizer), expected)


@pytest.mark.slow
def test_an_unsharded_checkpoint_restores_into_a_sharded_strategy(tmp_path):
    plain = _strategy(4, shard=False)
    model, optimizer = _build(plain, optax.adam(1e-2))
    _train(plain, model, optimizer, 3)
    path = str(tmp_path / "plain")
    mirrax.Checkpoint(model=model, optimizer=optimizer).write(path)
    _train(plain, model, optimizer, 1)
    sharded = _strategy(4)
    restored_model, restored_optimizer = _build(sharded, optax.adam(1e-2))
    mirrax.Checkpoint(model=restored_model, optimizer=restored_optimizer).restore(path)
    _train(sharded, restored_model, restored_optimizer, 1)
    _assert_close(_arrays(restored_model, restored_optimizer), _arrays(model, optimizer))
    kernel_mu = restored_optimizer.opt_state[0].mu["layers"][0]["kernel"].get_value()
    assert kernel_mu.sharding.spec == jax.sharding.PartitionSpec("replica")


@pytest.mark.subprocess
def test_two_workers_of_two_devices_equal_one_process_of_four(tmp_path):
    two = harness.run("sharded", tmp_path / "2x2", num_workers=2, cpu_devices=2)
    (single,) = harness.run("sharded", tmp_path / "1x4", num_workers=1, cpu_devices=4)
    for worker in two:
        # Each worker holds 2 of the 4 rows of the (4, 8) kernel's first moment: one per device.
        assert worker["mu_spec"] == single["mu_spec"] == ["replica"]
        assert worker["mu_local_rows"] == [1, 1] and single["mu_local_rows"] == [1, 1, 1, 1]
        np.testing.assert_allclose(
            worker["history"]["loss"], single["history"]["loss"], rtol=0, atol=TOLERANCE
        )
        np.testing.assert_allclose(worker["custom_losses"], single["custom_losses"], rtol=0, atol=TOLERANCE)
        for key in ("weights", "custom_weights"):
            for mine, reference in zip(worker[key], single[key]):
                np.testing.assert_allclose(mine, reference, rtol=0, atol=TOLERANCE)


# -- what is refused, and how ------------------------------------------------------------------


def test_a_flag_that_is_not_a_bool_is_refused():
    with pytest.raises(
        mirrax.errors.InvalidArgumentTypeError,
        match=r"MirroredStrategy: shard_optimizer_state must be True or False; "
        r"received str 'yes'",
    ):
        mirrax.MirroredStrategy(shard_optimizer_state="yes")


def test_two_updates_in_one_step_are_refused():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))

    def twice(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(_loss)(model, *batch)
        optimizer.update(model, grads)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"twice calls optimizer.update twice in one step .* "
        r"shard_optimizer_state=True",
    ):
        _run_once(strategy, model, optimizer, twice)


def test_gradients_that_differ_across_replicas_are_refused():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))

    def skewed(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, *batch)
        replica = mirrax.get_replica_context().replica_id_in_sync_group
        optimizer.update(model, jax.tree.map(lambda g: g * (1 + replica), grads))
        return loss

    with pytest.raises(
        mirrax.errors.VaryingVariableError,
        match=r"skewed passes optimizer.update gradients that differ across "
        r"replicas",
    ):
        _run_once(strategy, model, optimizer, skewed)


def test_fit_refuses_several_steps_per_execution_and_dynamic_loss_scaling():
    strategy = _strategy(2)
    with strategy.scope():
        model = mirrax.Model(MLP(SIZES, nnx.Rngs(0)))
        with pytest.raises(
            mirrax.errors.UnsupportedArgumentError,
            match=r"steps_per_execution=2 is not supported on a strategy with "
            r"shard_optimizer_state=True",
        ):
            model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
        mirrax.mixed_precision.set_global_policy("mixed_float16")
        try:
            with pytest.raises(
                mirrax.errors.UnsupportedArgumentError,
                match=r"'mixed_float16' policy's dynamic loss scaling is not "
                r"supported",
            ):
                model.compile(optimizer="adam", loss="mse")
        finally:
            mirrax.mixed_precision.set_global_policy("float32")


def test_the_flag_is_reported_on_extended():
    assert _strategy(2).extended.shard_optimizer_state is True
    assert _strategy(2, shard=False).extended.shard_optimizer_state is False


@pytest.mark.slow
def test_a_step_that_creates_a_variable_is_refused():
    strategy = _strategy(2)
    model, optimizer = _build(strategy, optax.adam(1e-2))
    batch = next(iter(strategy.experimental_distribute_dataset(_data())))

    def grows(model, optimizer, batch):
        model.extra = nnx.Param(jnp.zeros(3))
        return batch[0].sum()

    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"grows creates or removes variables, which a strategy with "
        r"shard_optimizer_state=True does not support",
    ):
        strategy.run(grows, args=(model, optimizer, batch))


@pytest.mark.slow
def test_the_update_is_deferred_whatever_splits():
    # optax.sgd keeps no state, and three replicas divide none of SIZES' arrays: the update
    # is still applied when the step returns, so the step sees the old parameters.
    def step(model, optimizer, batch):
        before = model.layers[0].kernel[...]
        _, grads = mirrax.value_and_grad(_loss)(model, *batch)
        returned = optimizer.update(model, grads)
        return jnp.abs(model.layers[0].kernel[...] - before).max(), jnp.array(returned is None)

    for replicas, tx in ((4, optax.sgd(0.1)), (3, optax.adam(1e-2))):
        strategy = _strategy(replicas)
        model, optimizer = _build(strategy, tx)
        batch = next(iter(strategy.experimental_distribute_dataset((_data()[0][:12], _data()[1][:12]))))
        change, returned_none = strategy.run(step, args=(model, optimizer, batch))
        assert float(strategy.experimental_local_results(change)[0]) == 0.0
        assert bool(strategy.experimental_local_results(returned_none)[0])


def test_changing_parameters_after_the_update_is_refused():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))

    def constrained(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(_loss)(model, *batch)
        optimizer.update(model, grads)
        model.layers[0].kernel[...] = jnp.clip(model.layers[0].kernel[...], -0.05, 0.05)
        return loss

    def guarded(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(_loss)(model, *batch)
        finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        before = jax.tree.map(lambda a: a, nnx.state((model, optimizer)))
        optimizer.update(model, grads)
        nnx.update(
            (model, optimizer),
            jax.tree.map(lambda new, old: jnp.where(finite, new, old), nnx.state((model, optimizer)), before),
        )
        return loss

    for step in (constrained, guarded):
        with pytest.raises(
            mirrax.errors.UnsupportedArgumentError,
            match=rf"{step.__name__} changes parameters or optimizer state after "
            r"optimizer.update .*optax.apply_if_finite",
        ):
            _run_once(strategy, model, optimizer, step)


def test_unsupported_optimizers_are_named():
    class Counting(nnx.Optimizer):
        def update(self, model, grads, **kwargs):
            super().update(model, grads, **kwargs)

    strategy = _strategy(4)
    step = _step()
    with strategy.scope():
        model = MLP(SIZES, nnx.Rngs(0))
        counting = Counting(model, optax.adam(1e-2), wrt=nnx.Param)
        nested = nnx.Optimizer(model, optax.sm3(1e-2), wrt=nnx.Param)
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"takes a Counting, a subclass of nnx.Optimizer that overrides "
        r"update",
    ):
        _run_once(strategy, model, counting, step)
    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"the state of Optimizer's transformation \(chain, in its "
        r"ScaleBySM3State\) holds nested lists or tuples",
    ):
        _run_once(strategy, model, nested, step)


def test_an_update_inside_a_transformation_and_varying_keywords_are_refused():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-2))

    def inside_cond(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(_loss)(model, *batch)
        nnx.cond(loss < 100.0, lambda m, o, g: o.update(m, g), lambda m, o, g: None, model, optimizer, grads)
        return loss

    with pytest.raises(
        mirrax.errors.UnsupportedArgumentError,
        match=r"inside a JAX or NNX transformation \(nnx.cond, nnx.fori_loop",
    ):
        _run_once(strategy, model, optimizer, inside_cond)

    plateau = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=0))
    model, optimizer = _build(strategy, plateau)

    def local_value(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(_loss)(model, *batch)
        optimizer.update(model, grads, value=loss)  # this replica's share: it varies
        return loss

    with pytest.raises(
        mirrax.errors.VaryingVariableError, match=r"keyword arguments that differ across replicas \(value\)"
    ):
        _run_once(strategy, model, optimizer, local_value)


@pytest.mark.slow
def test_the_sharded_step_donates_its_state():
    strategy = _strategy(4)
    model, optimizer = _build(strategy, optax.adam(1e-3), (64, 256, 256, 10))
    _train(strategy, model, optimizer, 1, data=_data(features=64))  # placed: sharded
    batch = next(iter(strategy.experimental_distribute_dataset(_data(features=64))))
    analysis = (
        strategy.experimental_lower(_step(), args=(model, optimizer, batch)).compile().memory_analysis()
    )
    if analysis is None:
        pytest.skip("no memory analysis on this backend")
    # Parameters (replicated) and this device's moments are rewritten in place: the aliased
    # bytes are all the state bytes one device holds: P + 2 (P - 10) / 4 + 2 * 10 floats and
    # two scalars, P = 64*256 + 256 + 256*256 + 256 + 256*10 + 10 = 85,002: 510,080 bytes.
    p = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    state = _device_bytes((model, optimizer), jax.devices()[0])
    assert state == 4 * (p + 2 * (p - 10) // 4 + 2 * 10) + 4 + 4 == 510_080
    assert analysis.alias_size_in_bytes >= state - 8


@pytest.mark.slow
def test_packed_gradients_are_one_reduce_scatter_with_the_same_numbers():
    # pack=True (the default across processes on CPU, where each collective is a Gloo round
    # trip): every split gradient travels in ONE reduce-scatter, the whole ones (the 10-wide
    # bias) in one all-reduce.
    step = _step(pack=True)
    results = []
    for shard in (False, True):
        strategy = _strategy(4, shard)
        model, optimizer = _build(strategy, optax.adam(1e-2))
        batch = next(iter(strategy.experimental_distribute_dataset(_data())))
        for _ in range(10):
            strategy.run(step, args=(model, optimizer, batch))
        results.append(_arrays(model, optimizer))
        if shard:
            hlo = strategy.experimental_lower(step, args=(model, optimizer, batch)).compile().as_text()
            kinds = [kind for _, kind in _COLLECTIVE.findall(hlo)]
            assert kinds.count("reduce-scatter") == 1
    _assert_close(*results)
