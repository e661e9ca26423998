"""Packed gradient all-reduce (mirrax/_src/distribute/gradients.py): same gradients, one buffer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored
from tests.test_run import MLP, mlp_data


def _grads_both_ways(module, batch):
    x, y = batch

    def loss_fn(module):
        per_example = optax.softmax_cross_entropy_with_integer_labels(module(x), y)
        return mirrax.compute_average_loss(per_example)

    loss, packed = mirrax.value_and_grad(loss_fn, pack=True)(module)
    _, plain = nnx.value_and_grad(loss_fn)(module)
    return loss, packed, plain


def _program_text(strategy, fn, args, compiled=True) -> str:
    """The HLO of the program `strategy.run(fn, args=args)` runs (strategy.experimental_lower)."""
    lowered = strategy.experimental_lower(fn, args=args)
    return lowered.compile().as_text() if compiled else lowered.as_text()


@pytest.mark.slow
def test_packed_gradients_equal_jax_per_array_sums():
    strategy = mirrored(4)
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        module = MLP(w1, w2)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    _, packed, plain = strategy.run(_grads_both_ways, args=(module, batch))
    distributed = lambda v: isinstance(v, (mirrax.Mirrored, mirrax.PerReplica))  # noqa: E731
    packed = jax.tree.leaves(packed, is_leaf=distributed)
    plain = jax.tree.leaves(plain, is_leaf=distributed)
    # The 4 parameter arrays (2 kernels, 2 biases) come back as Mirrored: summed everywhere.
    assert len(packed) == 4 and all(isinstance(g, mirrax.Mirrored) for g in packed)
    for a, b in zip(packed, plain):
        np.testing.assert_allclose(np.asarray(a.values[0]), np.asarray(b.values[0]), atol=1e-6)


def test_packed_gradients_use_one_all_reduce_of_all_parameter_bytes():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        module = MLP(w1, w2)

    def packed_only(module, batch):
        xb, yb = batch
        loss_fn = lambda m: mirrax.compute_average_loss(  # noqa: E731
            optax.softmax_cross_entropy_with_integer_labels(m(xb), yb), global_batch_size=16
        )
        return mirrax.value_and_grad(loss_fn, pack=True)(module)[1]

    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    text = _program_text(strategy, packed_only, (module, batch))
    # 4x3 + 3 + 3x2 + 2 = 23 float32 parameters: ONE all-reduce of an f32[23] vector.
    reduces = [line for line in text.splitlines() if " all-reduce(" in line]
    assert len(reduces) == 1 and "f32[23]" in reduces[0], reduces


@pytest.mark.slow
def test_outside_replica_context_it_is_nnx_value_and_grad():
    w1, w2, x, y = mlp_data()
    module = MLP(w1, w2)
    loss_fn = lambda m: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m(x), y))  # noqa: E731
    (a, ga), (b, gb) = mirrax.value_and_grad(loss_fn)(module), nnx.value_and_grad(loss_fn)(module)
    assert a == b
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_array_equal(u, v)


def test_bfloat16_all_reduce_halves_the_bytes_and_stays_close():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        module = MLP(w1, w2)

    def both(module, batch):
        xb, yb = batch
        loss_fn = lambda m: mirrax.compute_average_loss(  # noqa: E731
            optax.softmax_cross_entropy_with_integer_labels(m(xb), yb), global_batch_size=16
        )
        exact = mirrax.value_and_grad(loss_fn, pack=True)(module)[1]
        cheap = mirrax.value_and_grad(loss_fn, all_reduce_dtype="bfloat16")(module)[1]
        return exact, cheap

    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    exact, cheap = strategy.run(both, args=(module, batch))
    for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(cheap)):
        a, b = np.asarray(a), np.asarray(b)
        # bfloat16 keeps 8 significant bits: relative error below 2**-7 per element, and
        # float32 again after the sum.
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=2**-7, atol=1e-6)
    lowered = _program_text(strategy, both, (module, batch), compiled=False)
    # The program mirrax emits sums a bf16 vector of the 23 gradients. (XLA:CPU then promotes
    # bf16 all-reduces back to f32, so on CPU no bytes are saved; NCCL sums bf16 natively.)
    assert re.search(r"stablehlo.all_reduce.*\n(.*\n){0,12}.*tensor<23xbf16>", lowered)
    with pytest.raises(TypeError, match="all_reduce_dtype must be None or a floating dtype"):
        mirrax.value_and_grad(lambda m: 0.0, all_reduce_dtype="int8")


def test_within_one_cpu_process_it_does_not_pack_by_default():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    with strategy.scope():
        module = MLP(w1, w2)

    def default(module, batch):
        xb, yb = batch
        loss_fn = lambda m: mirrax.compute_average_loss(  # noqa: E731
            optax.softmax_cross_entropy_with_integer_labels(m(xb), yb), global_batch_size=16
        )
        return mirrax.value_and_grad(loss_fn)(module)[1]

    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    text = _program_text(strategy, default, (module, batch))
    # JAX's own per-array sums, combined by XLA into one all-reduce of 4 operands.
    (line,) = [line for line in text.splitlines() if " all-reduce(" in line]
    assert "f32[23]" not in line and "f32[4,3]" in line
