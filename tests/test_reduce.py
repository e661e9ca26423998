"""Cross-replica operations: reduce, gather, local results, ReplicaContext collectives, values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrax
from tests.conftest import mirrored


def per_replica_scalars(strategy):
    """Replica i holds i + 1 (float32)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1)
    )


def test_reduce_sum_and_mean_of_per_replica_scalars(strategy):
    n = strategy.num_replicas_in_sync
    value = per_replica_scalars(strategy)
    # 1 + 2 + ... + n = n(n+1)/2; the mean is (n+1)/2.
    assert float(strategy.reduce("SUM", value)) == pytest.approx(n * (n + 1) / 2)
    assert float(strategy.reduce(mirrax.ReduceOp.MEAN, value)) == pytest.approx((n + 1) / 2)
    assert float(strategy.reduce("sum", value, axis=None)) == pytest.approx(n * (n + 1) / 2)


def test_reduce_on_four_replicas_gives_10_and_2_5():
    strategy = mirrored(4)
    value = per_replica_scalars(strategy)
    assert float(strategy.reduce("sum", value)) == 10.0  # 1 + 2 + 3 + 4
    assert float(strategy.reduce("mean", value)) == 2.5  # 10 / 4


def test_reduce_along_axis_is_a_mean_over_elements_not_of_means():
    strategy = mirrored(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0, 2.0, 3.0] if ctx.replica_id_in_sync_group == 0 else [10.0], np.float32)
    )
    # SUM: 1 + 2 + 3 + 10 = 16. MEAN over the 4 elements: 16 / 4 = 4.0
    # (a mean of the replicas' means would be (2 + 10) / 2 = 6).
    assert float(strategy.reduce("sum", value, axis=0)) == 16.0
    assert float(strategy.reduce("mean", value, axis=0)) == 4.0
    np.testing.assert_array_equal(np.asarray(value.values[0]), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(value.values[1]), [10.0])
    with pytest.raises(ValueError, match=r"different lengths along axis 0 \(\[3, 1\]\).*Pass axis=0"):
        strategy.reduce("sum", value)


def test_reduce_of_shapes_that_cannot_be_combined_is_a_clear_error():
    strategy = mirrored(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros((2, 3) if ctx.replica_id_in_sync_group == 0 else (2, 4), np.float32)
    )
    with pytest.raises(ValueError, match=r"shapes \[\(2, 3\), \(2, 4\)\], which cannot be combined"):
        strategy.reduce("sum", value)


def test_reduce_with_an_unknown_op_names_the_valid_ones():
    strategy = mirrored(2)
    with pytest.raises(
        ValueError,
        match=r"reduce_op must be one of mirrax.ReduceOp.SUM, mirrax.ReduceOp.MEAN.*received 'max'",
    ):
        strategy.reduce("max", per_replica_scalars(strategy))


def test_reduce_of_a_value_from_another_strategy_is_refused():
    value = per_replica_scalars(mirrored(2))
    with pytest.raises(mirrax.errors.MixedStrategyError, match="created by another strategy"):
        mirrored(4).reduce("sum", value)


def test_reduce_of_plain_values_follows_tf():
    strategy = mirrored(2)
    assert float(strategy.reduce("mean", 3.0)) == 3.0  # the same on every replica
    with pytest.raises(ValueError, match="cannot SUM the plain"):
        strategy.reduce("sum", 3.0)
    assert float(mirrored(1).reduce("sum", 3.0)) == 3.0


def test_reduce_of_mirrored_sums_the_replicas_copies(strategy):
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: jnp.float32(2.0))
    assert isinstance(out, mirrax.Mirrored)
    assert float(strategy.reduce("sum", out)) == pytest.approx(2.0 * n)  # n copies of 2
    assert float(strategy.reduce("mean", out)) == 2.0


def test_gather_concatenates_replicas_in_order():
    strategy = mirrored(4)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.int32)
    )
    np.testing.assert_array_equal(np.asarray(strategy.gather(value, axis=0)), [0, 0, 1, 1, 2, 2, 3, 3])


def test_replica_context_all_reduce_and_all_gather(strategy):
    n = strategy.num_replicas_in_sync

    def step():
        ctx = mirrax.get_replica_context()
        one_based = (ctx.replica_id_in_sync_group + 1).astype(jnp.float32)
        return (
            ctx.all_reduce("sum", one_based),
            ctx.all_reduce(mirrax.ReduceOp.MEAN, one_based),
            ctx.all_gather(one_based[None], axis=0),
        )

    total, mean, gathered = strategy.run(step)
    for value in strategy.experimental_local_results(total):
        assert float(value) == pytest.approx(n * (n + 1) / 2)  # N(N+1)/2 on every replica
    for value in strategy.experimental_local_results(mean):
        assert float(value) == pytest.approx((n + 1) / 2)  # (N+1)/2
    np.testing.assert_array_equal(np.asarray(gathered.values[0]), np.arange(1, n + 1))


def test_per_replica_outputs_and_local_results(strategy):
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: mirrax.get_replica_context().replica_id_in_sync_group * 10)
    assert isinstance(out, mirrax.PerReplica) or n == 1
    results = strategy.experimental_local_results(out)
    assert [int(v) for v in results] == [10 * i for i in range(n)]
    assert strategy.experimental_local_results(5) == (5,)


def test_per_replica_repr_is_tf_like():
    value = per_replica_scalars(mirrored(2))
    text = repr(value)
    assert text.startswith("PerReplica:{\n  0: ")
    assert "\n  1: " in text and text.endswith("\n}")


def test_per_replica_is_a_pytree(strategy):
    value = per_replica_scalars(strategy)
    doubled = jax.tree.map(lambda x: x * 2, value)
    n = strategy.num_replicas_in_sync
    assert float(strategy.reduce("sum", doubled)) == pytest.approx(n * (n + 1))  # 2 * n(n+1)/2


def test_reduce_op_accepts_strings_in_any_case():
    assert mirrax.ReduceOp.from_any("sUm") is mirrax.ReduceOp.SUM
    assert (
        mirrax.VariableAggregation.from_any("only_first_replica")
        is mirrax.VariableAggregation.ONLY_FIRST_REPLICA
    )
    assert mirrax.ReduceOp.from_variable_aggregation("mean") is mirrax.ReduceOp.MEAN


def test_gather_of_scalars_says_what_to_do():
    strategy = mirrored(2)
    with pytest.raises(ValueError, match=r"scalars.*x\[None\]"):
        strategy.gather(per_replica_scalars(strategy), axis=0)
