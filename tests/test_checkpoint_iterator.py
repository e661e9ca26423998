"""mirrax.Checkpoint(iterator=...): a DistributedIterator's position, as TF's tf.data iterator."""

import numpy as np
import pytest

import mirrax
from tests.conftest import mirrored

# 10 global batches of 4 examples; batch b holds the examples 4b, 4b+1, 4b+2, 4b+3.
_BATCHES = [np.arange(4 * b, 4 * b + 4, dtype=np.float32).reshape(4, 1) for b in range(10)]


def _shards(strategy, batch):
    return [np.asarray(v).ravel().tolist() for v in strategy.experimental_local_results(batch)]


def test_restored_iterator_continues_with_the_next_batch(tmp_path):
    strategy = mirrored(2)
    dist_dataset = strategy.experimental_distribute_dataset(_BATCHES)
    iterator = iter(dist_dataset)
    for _ in range(3):  # batches 0, 1, 2 handed out; the prefetch thread has read further
        next(iterator)
    mirrax.Checkpoint(iterator=iterator).write(tmp_path / "ckpt")

    fresh = iter(dist_dataset)
    mirrax.Checkpoint(iterator=fresh).restore(tmp_path / "ckpt").assert_consumed()

    # Batch 3 is examples 12..15; 2 replicas take ceil(4/2) = 2 each: [12, 13] and [14, 15].
    assert _shards(strategy, next(fresh)) == [[12.0, 13.0], [14.0, 15.0]]
    assert _shards(strategy, next(iterator)) == [[12.0, 13.0], [14.0, 15.0]]  # same as the original
    # 10 - 4 = 6 batches are left in the restored iterator.
    assert sum(1 for _ in fresh) == 6


def test_restore_into_a_used_iterator_raises(tmp_path):
    strategy = mirrored(2)
    dist_dataset = strategy.experimental_distribute_dataset(_BATCHES)
    iterator = iter(dist_dataset)
    next(iterator)
    mirrax.Checkpoint(iterator=iterator).write(tmp_path / "ckpt")

    used = iter(dist_dataset)
    next(used)
    with pytest.raises(ValueError, match="already handed out 1 batches; restore into a fresh one"):
        mirrax.Checkpoint(iterator=used).restore(tmp_path / "ckpt")
    # Nothing was skipped: the used iterator's next batch is still batch 1 (examples 4..7).
    assert _shards(strategy, next(used)) == [[4.0, 5.0], [6.0, 7.0]]


def test_restore_past_the_end_of_a_shorter_dataset_raises(tmp_path):
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(_BATCHES))
    for _ in range(3):
        next(iterator)
    mirrax.Checkpoint(iterator=iterator).write(tmp_path / "ckpt")

    short = iter(strategy.experimental_distribute_dataset(_BATCHES[:2]))
    with pytest.raises(ValueError, match="position is 3 batches, but the dataset ended after 2"):
        mirrax.Checkpoint(iterator=short).restore(tmp_path / "ckpt")


def test_a_failed_iterator_restore_changes_no_other_object(tmp_path):
    """The iterator is restored first: when its dataset is too short, the counter tracked
    with it keeps its value (Checkpoint.restore changes nothing unless everything fits)."""
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(_BATCHES))
    for _ in range(3):
        next(iterator)
    mirrax.Checkpoint(iterator=iterator, weights=mirrax.metrics.Sum()).write(tmp_path / "ckpt")
    short = iter(strategy.experimental_distribute_dataset(_BATCHES[:2]))
    total = mirrax.metrics.Sum()
    total.update_state(np.float32(7.0))
    with pytest.raises(ValueError, match="dataset ended after 2"):
        mirrax.Checkpoint(iterator=short, weights=total).restore(tmp_path / "ckpt")
    assert float(total.result()) == 7.0  # not the saved 0.0


@pytest.mark.slow
def test_iterator_position_and_a_dropout_model_restore_together(tmp_path):
    from tests.test_checkpoint import RngNet, assert_same_state, used_rng_net

    strategy = mirrored(2)
    dist_dataset = strategy.experimental_distribute_dataset(_BATCHES)
    iterator = iter(dist_dataset)
    next(iterator)
    with strategy.scope():
        net = used_rng_net(0, legacy=False)
    mirrax.Checkpoint(iterator=iterator, net=net).write(tmp_path / "ckpt")
    fresh, target = iter(dist_dataset), RngNet(1)
    mirrax.Checkpoint(iterator=fresh, net=target).restore(tmp_path / "ckpt").assert_consumed()
    assert_same_state(target, net)
    # Batch 1 is examples 4..7: [4, 5] and [6, 7] on the 2 replicas.
    assert _shards(strategy, next(fresh)) == [[4.0, 5.0], [6.0, 7.0]]
