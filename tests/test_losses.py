"""compute_average_loss and scale_regularization_loss: the arithmetic of each replica's share."""

import jax.numpy as jnp
import numpy as np
import pytest

import mirrax
from tests.conftest import mirrored


def two_replica_losses():
    strategy = mirrored(2)
    batch = next(
        iter(
            strategy.experimental_distribute_dataset(
                (np.array([2.0, 3.0, 4.0, 5.0], np.float32), np.array([1.0, 0.0, 1.0, 1.0], np.float32))
            )
        )
    )
    return strategy, batch


def test_global_batch_size_divides_each_replicas_sum():
    strategy, batch = two_replica_losses()
    shares = strategy.run(lambda b: mirrax.compute_average_loss(b[0], global_batch_size=4), args=(batch,))
    # Replica 0: (2 + 3) / 4 = 1.25; replica 1: (4 + 5) / 4 = 2.25; SUM 3.5.
    assert [float(v) for v in shares.values] == [1.25, 2.25]
    assert float(strategy.reduce("sum", shares)) == 3.5


def test_sample_weights_do_not_change_the_divisor():
    strategy, batch = two_replica_losses()
    shares = strategy.run(
        lambda b: mirrax.compute_average_loss(b[0], sample_weight=b[1], global_batch_size=4), args=(batch,)
    )
    # (2*1 + 3*0) / 4 + (4*1 + 5*1) / 4 = 0.5 + 2.25 = 2.75 (divide by 4 examples, not the weight sum 3).
    assert float(strategy.reduce("sum", shares)) == 2.75


def test_divisor_defaults_to_the_valid_examples_of_all_replicas():
    strategy = mirrored(4)
    data = np.array([2.0, 3.0, 4.0, 5.0, 6.0], np.float32)  # 5 over 4 replicas: 2, 2, 1, 0
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    shares = strategy.run(lambda b: mirrax.compute_average_loss(b), args=(batch,))
    # Each share divides by the 5 real examples: (2+3)/5, (4+5)/5, 6/5, 0.
    np.testing.assert_allclose([float(v) for v in shares.values], [1.0, 1.8, 1.2, 0.0])
    assert float(strategy.reduce("sum", shares)) == pytest.approx(4.0)  # (2+3+4+5+6) / 5
    # TF divides each sum by its own shard size x 4 replicas: 5/8 + 9/8 + 6/4 = 3.25, not 4.0.


def test_the_example_count_comes_from_the_host_without_a_collective():
    strategy = mirrored(4)
    data = np.array([2.0, 3.0, 4.0, 5.0, 6.0], np.float32)  # 5 over 4 replicas: 2, 2, 1, 0
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    step = lambda b: mirrax.compute_average_loss(b)  # noqa: E731
    shares = strategy.run(step, args=(batch,))
    np.testing.assert_allclose([float(v) for v in shares.values], [1.0, 1.8, 1.2, 0.0])
    # The program strategy.run runs, on its arguments: the batch, its mask and the step's count
    # of real examples (5, from the batch's lengths on the host).
    text = strategy.experimental_lower(step, args=(batch,)).compile().as_text()
    assert "all-reduce" not in text  # no psum of the count: nothing crosses replicas


def test_empty_shard_gives_zero_not_nan():
    strategy = mirrored(4)
    batch = next(iter(strategy.experimental_distribute_dataset(np.array([1.0], np.float32))))
    for kwargs in ({}, {"global_batch_size": 4}):
        shares = strategy.run(lambda b, kw=kwargs: mirrax.compute_average_loss(b, **kw), args=(batch,))
        values = [float(v) for v in shares.values]
        assert values[1:] == [0.0, 0.0, 0.0]
        assert not any(np.isnan(values))


def test_nan_in_padding_rows_is_ignored():
    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset(np.array([1.0, 4.0, 9.0], np.float32))))
    # log(0) = -inf in the padding row of replica 1 must not reach the loss: (1 + 2 + 3) / 3 = 2.
    shares = strategy.run(
        lambda b: mirrax.compute_average_loss(jnp.where(b > 0, jnp.sqrt(b), jnp.log(b))), args=(batch,)
    )
    assert float(strategy.reduce("sum", shares)) == pytest.approx(2.0)


def test_outside_replica_context():
    strategy = mirrored(2)
    losses = np.array([1.0, 2.0, 3.0], np.float32)
    with strategy.scope():
        with pytest.raises(
            mirrax.errors.ReplicaContextError, match="cross-replica context.*without global_batch_size"
        ):
            mirrax.compute_average_loss(losses)
        assert float(mirrax.compute_average_loss(losses, global_batch_size=6)) == 1.0  # 6 / 6
        with pytest.raises(mirrax.errors.ReplicaContextError, match="scale_regularization_loss"):
            mirrax.scale_regularization_loss(1.0)
    # No scope: the default replica context, one replica: the plain mean 6 / 3 = 2.
    assert float(mirrax.compute_average_loss(losses)) == 2.0
    assert float(mirrax.scale_regularization_loss(3.0)) == 3.0


def test_scalar_loss_is_refused():
    with pytest.raises(ValueError, match="leading batch axis.*received a scalar"):
        mirrax.compute_average_loss(jnp.float32(1.0))


def test_bad_arguments_are_named():
    strategy, batch = two_replica_losses()
    with pytest.raises(TypeError, match="per_example_loss is a PerReplica.*inside the function"):
        mirrax.compute_average_loss(batch[0])
    with pytest.raises(ValueError, match="global_batch_size must be positive; received 0"):
        mirrax.compute_average_loss(np.ones(2, np.float32), global_batch_size=0)
    with pytest.raises(
        ValueError, match=r"sample_weight of shape \(3,\) does not fit per_example_loss of shape \(4,\)"
    ):
        mirrax.compute_average_loss(np.ones(4, np.float32), sample_weight=np.ones(3, np.float32))
