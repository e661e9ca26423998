"""Optax transformations through `fit` and through a custom loop (`strategy.run` with
`mirrax.compute_average_loss`), on OneDevice, Mirrored(4) and Mirrored(4) with sharded optimizer
state, against `nnx.jit` + `nnx.Optimizer` on one device; and the transformations mirrax
cannot run, refused at `compile` with the reason (issue 27, item 2).

One tiny model (a Linear 4 -> 3: a 2-D kernel for muon's orthogonalized update, a 3-wide bias
that 4 replicas cannot split, so the sharded state has a split and a whole array), 3 steps of
a global batch of 8, one compiled program per (transformation, strategy, route).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import named_strategy

# Every transformation's state is another structure, so each makes a new program of the same
# step function: the catalogue is the retracing that warning is about, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:strategy.run has compiled:UserWarning")

# The replicas' gradient shares are summed by an all-reduce (and, with sharded state, a
# reduce-scatter and a partitioned update) in another order than the one-device mean, so the
# parameters agree to float32 rounding, not bit for bit (measured: at most 6e-8 after 3 steps).
TOLERANCE = 1e-6
BATCH, STEPS = 8, 3
LR = 0.1  # large enough that every trained parameter moves far more than the tolerance


def _labels(params):
    """multi_transform's groups: the bias frozen, the kernel trained (a callable over the
    parameters' tree, as optax documents)."""
    return jax.tree.map_with_path(lambda path, _: "frozen" if "bias" in str(path) else "train", params)


def _label_tree():
    """The same groups as a pytree of labels over the parameters' arrays (`nnx.as_pure`: the
    structure optax's update sees)."""
    return _labels(nnx.as_pure(nnx.state(_module(), nnx.Param)))


def _matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


CATALOGUE = {
    "adam": lambda: optax.adam(LR),
    "adamw_masked": lambda: optax.adamw(LR, weight_decay=0.5, mask=_matrices),
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adam(LR), "frozen": optax.set_to_zero()}, _labels
    ),
    "multi_transform_label_tree": lambda: optax.multi_transform(
        {"train": optax.sgd(LR, momentum=0.9), "frozen": optax.set_to_zero()}, _label_tree()
    ),
    "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(LR)),
    "multi_steps": lambda: optax.MultiSteps(optax.sgd(LR), every_k_schedule=2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=LR),
    "muon": lambda: optax.contrib.muon(LR),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(LR, warmup_steps=1),
    "lion": lambda: optax.lion(LR),
    "adafactor": lambda: optax.adafactor(LR),
    "sgd_nesterov": lambda: optax.sgd(LR, momentum=0.9, nesterov=True),
}
# Updates that need the loss (optax's extra arguments): a custom loop passes it, fit cannot.
NEEDS_VALUE = {
    "reduce_on_plateau": lambda: optax.chain(
        optax.adam(LR), optax.contrib.reduce_on_plateau(patience=0, factor=0.5)
    ),
}
FROZEN = {"multi_transform": ("bias",), "multi_transform_label_tree": ("bias",)}

_SHARDED = []


def _strategy(name):
    if name != "Mirrored4Sharded":
        return named_strategy(name)
    if not _SHARDED:
        _SHARDED.append(mirrax.MirroredStrategy(jax.devices()[:4], shard_optimizer_state=True))
    return _SHARDED[0]


STRATEGIES = ["OneDevice", "Mirrored4CPU", "Mirrored4Sharded"]


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, 4)).astype(np.float32)
    y = rng.standard_normal((BATCH * STEPS, 3)).astype(np.float32)
    return x, y


def _batches():
    x, y = _data()
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, BATCH * STEPS, BATCH)]


def _module():
    return nnx.Linear(4, 3, rngs=nnx.Rngs(0))


def _params(module):
    return {"kernel": np.asarray(module.kernel[...]), "bias": np.asarray(module.bias[...])}


@functools.cache
def _reference(name):
    """(initial, final) parameters of `nnx.jit` + `nnx.Optimizer` on one device, each step
    the mean squared error of one whole global batch (Keras's "mse": mean over the outputs,
    then over the batch)."""
    factory = {**CATALOGUE, **NEEDS_VALUE, "sgd": lambda: optax.sgd(LR)}[name]
    module = _module()
    optimizer = nnx.Optimizer(module, factory(), wrt=nnx.Param)
    initial = _params(module)

    @nnx.jit
    def step(module, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(module)
        optimizer.update(module, grads, **({"value": loss} if name in NEEDS_VALUE else {}))

    for x, y in _batches():
        step(module, optimizer, jnp.asarray(x), jnp.asarray(y))
    assert int(optimizer.step[...]) == STEPS
    return initial, _params(module)


def _custom_loop(strategy, name, factory):
    with strategy.scope():
        module = _module()
        optimizer = nnx.Optimizer(module, factory(), wrt=nnx.Param)

    def step(module, optimizer, batch):
        x, y = batch

        def loss_fn(module):
            return mirrax.compute_average_loss(jnp.mean((module(x) - y) ** 2, axis=-1))

        loss, grads = nnx.value_and_grad(loss_fn)(module)
        if name in NEEDS_VALUE:  # the global batch's loss, the same on every replica
            optimizer.update(module, grads, value=mirrax.get_replica_context().all_reduce("sum", loss))
        else:
            optimizer.update(module, grads)
        return loss

    for batch in strategy.experimental_distribute_dataset(_batches()):
        strategy.run(step, args=(module, optimizer, batch))
    assert int(optimizer.step[...]) == STEPS
    return _params(module)


def _check(name, got, route):
    initial, expected = _reference(name)
    for key in ("kernel", "bias"):
        np.testing.assert_allclose(
            got[key], expected[key], rtol=0, atol=TOLERANCE, err_msg=f"{name}, {route}: {key}"
        )
        if key in FROZEN.get(name, ()):
            # set_to_zero's update is 0: the frozen group keeps its initial bits.
            np.testing.assert_array_equal(got[key], initial[key])
        else:
            assert np.abs(got[key] - initial[key]).max() > 100 * TOLERANCE, (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_matches_nnx_jit(name, strategy_name):
    strategy = _strategy(strategy_name)
    with strategy.scope():
        model = mirrax.Model(_module())
        model.compile(optimizer=CATALOGUE[name](), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert model.optimizer.iterations == STEPS
    _check(name, _params(model.module), f"fit on {strategy_name}")
    _check(name, _custom_loop(strategy, name, CATALOGUE[name]), f"custom loop on {strategy_name}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_an_update_that_needs_the_loss_runs_in_a_custom_loop(strategy_name):
    # reduce_on_plateau(patience=0) halves the rate whenever the loss does not improve.
    strategy = _strategy(strategy_name)
    name = "reduce_on_plateau"
    _check(name, _custom_loop(strategy, name, NEEDS_VALUE[name]), f"custom loop on {strategy_name}")


def _sgd_through_a_replica_max():
    """optax.sgd(LR) written with a collective over the replicas: the max over them of a
    gradient that is already summed (the same on every replica) is the gradient itself."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -LR * jax.lax.pmax(g, mirrax.REPLICA_AXIS), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("strategy_name", ["OneDevice", "Mirrored4CPU"])
def test_an_update_with_a_collective_over_the_replicas_is_not_refused(strategy_name):
    # compile's check traces the update outside the replicas, where the axis is unbound; the
    # step runs it inside them (without sharded state), so it must not be refused.
    strategy = _strategy(strategy_name)
    with strategy.scope():
        model = mirrax.Model(_module())
        model.compile(optimizer=_sgd_through_a_replica_max(), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _check("sgd", _params(model.module), f"fit on {strategy_name}")


REFUSED = {
    "reduce_on_plateau": (
        NEEDS_VALUE["reduce_on_plateau"],
        [
            "needs 'value' (optax's extra arguments), which fit does not pass",
            "ReduceLROnPlateau callback",
            "optimizer.update(model, grads, value=",
        ],
    ),
    "backtracking_linesearch": (
        lambda: optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(5)),
        ["needs 'value', 'grad', and 'value_fn'", "custom loop"],
    ),
    "lookahead": (
        lambda: optax.lookahead(optax.adam(LR), sync_period=2, slow_step_size=0.5),
        [
            "optax.lookahead, whose update takes optax.LookaheadParams",
            "AttributeError: No attribute 'fast' in State",
            "Use the fast optimizer alone",
        ],
    ),
}


@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("name", list(REFUSED))
def test_what_fit_cannot_run_is_refused_at_compile(name, strategy_name):
    factory, fragments = REFUSED[name]
    strategy = _strategy(strategy_name)
    with strategy.scope():
        model = mirrax.Model(_module())
        with pytest.raises(mirrax.errors.UnsupportedArgumentError) as raised:
            model.compile(optimizer=factory(), loss="mse")
    message = str(raised.value)
    assert message.startswith("compile: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_lookahead_fails_under_nnx_jit_too():
    # The refusal's claim: flax's own nnx.Optimizer cannot pass LookaheadParams either.
    module = _module()
    optimizer = nnx.Optimizer(module, REFUSED["lookahead"][0](), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 4)))))(module)
    with pytest.raises(AttributeError, match="'fast'"):
        nnx.jit(lambda m, o, g: o.update(m, g))(module, optimizer, grads)


def test_state_a_sharded_optimizer_cannot_follow_is_refused_at_compile():
    # sm3 keeps a list of arrays in one state variable; unsharded it trains.
    with _strategy("Mirrored4Sharded").scope():
        model = mirrax.Model(_module())
        with pytest.raises(
            mirrax.errors.UnsupportedArgumentError,
            match=r"^compile: the state of Optimizer's transformation \(chain, "
            r"in its ScaleBySM3State\) holds nested lists or tuples .*"
            r"Use shard_optimizer_state=False",
        ):
            model.compile(optimizer=optax.sm3(LR), loss="mse")
