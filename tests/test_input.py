"""Distributed input: TF's split rule, static shapes with a mask, sources, prefetch, bad input."""

import gc
import math
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrax
from tests.conftest import mirrored


def batched_range(n, batch):
    """range(n).batch(batch) as a list of NumPy arrays (tf.data's drop_remainder=False)."""
    return [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]


def shards(strategy, dataset):
    """The true per-replica shards of every step, as lists of Python ints."""
    return [
        [np.asarray(v).tolist() for v in strategy.experimental_local_results(batch)]
        for batch in strategy.experimental_distribute_dataset(dataset)
    ]


def test_split_rule_of_tf(strategy):
    # Replica r gets min(max(n - r*ceil(n/R), 0), ceil(n/R)) consecutive elements.
    n, replicas = 10, strategy.num_replicas_in_sync
    per = math.ceil(n / replicas)
    (step,) = shards(strategy, [np.arange(n)])
    assert [len(s) for s in step] == [min(max(n - r * per, 0), per) for r in range(replicas)]
    assert sum(step, []) == list(range(n))  # nothing lost or duplicated


def test_ten_over_four_is_3_3_3_1():
    assert shards(mirrored(4), batched_range(10, 10)) == [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]]


def test_batches_of_four_over_four_replicas_end_with_empty_shards():
    assert shards(mirrored(4), batched_range(10, 4)) == [
        [[0], [1], [2], [3]],
        [[4], [5], [6], [7]],
        [[8], [9], [], []],
    ]


def test_batches_of_four_over_three_replicas():
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    assert shards(strategy, batched_range(8, 4)) == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]


def test_empty_shards_have_shape_zero_and_the_trailing_shape():
    strategy = mirrored(4)
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    last = list(strategy.experimental_distribute_dataset([x[:8], x[8:]]))[-1]
    assert [v.shape for v in strategy.experimental_local_results(last)] == [(1, 2), (1, 2), (0, 2), (0, 2)]


def test_partial_batch_is_padded_and_masked_without_recompiling():
    strategy = mirrored(4)
    traces = []

    def step(batch):
        traces.append(1)
        mask = mirrax.get_replica_context().batch_mask
        return batch.shape[0], mask.sum(), jnp.where(mask, batch, 0).sum()

    counts, sums = [], []
    for batch in strategy.experimental_distribute_dataset(batched_range(10, 8)):
        rows, valid, total = strategy.run(step, args=(batch,))
        assert [int(r) for r in strategy.experimental_local_results(rows)] == [2] * 4  # static size
        counts.append([int(v) for v in valid.values])
        sums.append(float(strategy.reduce("sum", total)))
    assert counts == [[2, 2, 2, 2], [1, 1, 0, 0]]  # batch 2 holds 8 and 9 only
    assert sums == [28.0, 17.0]  # 0+1+...+7 = 28; 8 + 9 = 17
    assert len(traces) == 2  # first call traces twice (probe + compile); the partial batch: 0


@pytest.mark.slow
def test_gather_returns_every_example_once(strategy):
    data = np.arange(30, dtype=np.float32).reshape(15, 2)
    for batch, expected in zip(strategy.experimental_distribute_dataset(batched_range(15, 6)), [0, 6, 12]):
        gathered = np.asarray(strategy.gather(batch, axis=0))
        np.testing.assert_array_equal(gathered, np.arange(expected, min(expected + 6, 15)))
    pairs = list(strategy.experimental_distribute_dataset((data, data[:, 0])))
    np.testing.assert_array_equal(np.asarray(strategy.gather(pairs[0], axis=0)[0]), data)


def test_dict_batches_and_mean_over_valid_examples():
    strategy = mirrored(4)
    batch = next(iter(strategy.experimental_distribute_dataset({"x": np.arange(6, dtype=np.float32)})))
    # Shards [0,1], [2,3], [4,5], [] padded to 2 rows: the mean of the real rows is 15 / 6 = 2.5.
    assert float(strategy.reduce("mean", batch, axis=0)["x"]) == 2.5
    assert float(strategy.reduce("sum", batch, axis=0)["x"]) == 15.0


# -- sources -------------------------------------------------------------------------------------


def test_python_generator_source():
    strategy = mirrored(2)

    def generator():
        for start in (0, 4):
            yield np.arange(start, start + 4)

    assert shards(strategy, generator()) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_grain_source():
    strategy = mirrored(2)
    loader = grain.MapDataset.range(6).map(lambda i: {"x": np.float32(i)}).batch(4)
    got = [
        [v["x"].tolist() for v in strategy.experimental_local_results(b)]
        for b in strategy.experimental_distribute_dataset(loader)
    ]
    assert got == [[[0.0, 1.0], [2.0, 3.0]], [[4.0], [5.0]]]


def test_tf_data_like_source_with_as_numpy_iterator():
    class FakeTFDataset:
        """What tf.data.Dataset offers without TensorFlow installed: as_numpy_iterator()."""

        def as_numpy_iterator(self):
            return iter(batched_range(6, 3))

    assert shards(mirrored(2), FakeTFDataset()) == [[[0, 1], [2]], [[3, 4], [5]]]


def test_tensors_with_a_numpy_method_are_accepted():
    class FakeTensor:
        def __init__(self, array):
            self.array = array

        def numpy(self):
            return self.array

    assert shards(mirrored(2), [(FakeTensor(np.arange(4)),)]) == [[[[0, 1]], [[2, 3]]]]


def test_dataset_can_be_iterated_again():
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(batched_range(4, 2))
    assert len(list(dataset)) == 2
    assert len(list(dataset)) == 2


def test_batches_are_prefetched_ahead_of_use():
    strategy = mirrored(2)
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield np.arange(2 * i, 2 * i + 2)

    iterator = iter(strategy.experimental_distribute_dataset(source()))
    next(iterator)
    deadline = time.monotonic() + 30
    # Buffer of 2 on the devices + 1 waiting to be put: the source runs ahead by 3.
    while len(pulled) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pulled) >= 4
    assert sum(1 for _ in iterator) == 5  # the rest, none lost
    assert [t.name for t in threading.enumerate()].count("mirrax-prefetch") <= 1


@pytest.mark.slow
def test_an_abandoned_iterator_stops_its_thread():
    strategy = mirrored(2)
    before = set(threading.enumerate())
    iterator = iter(strategy.experimental_distribute_dataset(batched_range(40, 2)))
    next(iterator)  # 19 batches left; the thread blocks on the full buffer
    (thread,) = [t for t in threading.enumerate() if t.name == "mirrax-prefetch" and t not in before]
    del iterator
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_source_errors_are_raised_in_the_caller():
    strategy = mirrored(2)

    def broken():
        yield np.arange(2)
        raise OSError("disk gone")

    iterator = iter(strategy.experimental_distribute_dataset(broken()))
    next(iterator)
    with pytest.raises(OSError, match="disk gone"):
        next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)


def test_without_fetch_to_device_batches_are_made_on_demand():
    strategy = mirrored(2)
    options = mirrax.InputOptions(experimental_fetch_to_device=False)
    dataset = strategy.experimental_distribute_dataset(batched_range(4, 2), options)
    assert [[v.tolist() for v in b.values] for b in dataset] == [[[0], [1]], [[2], [3]]]


# -- distribute_datasets_from_function ----------------------------------------------------------


def test_datasets_from_function_deals_per_replica_batches_in_turn():
    strategy = mirrored(2)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(4)
        return [np.full(per_replica, i) for i in range(5)]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    got = [[v.tolist() for v in b.values] for b in dataset]
    assert len(contexts) == 1  # once per input pipeline (one process)
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
    # Batches 0..4 dealt to replicas 0, 1, 0, 1, 0; replica 1 is empty in the last step.
    assert got == [[[0, 0], [1, 1]], [[2, 2], [3, 3]], [[4, 4], []]]


def test_input_context_batch_size():
    ctx = mirrax.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16  # 64 / 4
    with pytest.raises(
        ValueError, match=r"global_batch_size 10 is not divisible by num_replicas_in_sync 4.*e\.g\. 12"
    ):
        ctx.get_per_replica_batch_size(10)


# -- bad input ----------------------------------------------------------------------------------


def test_non_array_leaf_is_named():
    dataset = mirrored(2).experimental_distribute_dataset([{"x": np.zeros(4), "name": "cat"}])
    with pytest.raises(
        mirrax.errors.InvalidBatchError, match=r"batch\['name'\] is a str \('cat'\).*np.asarray"
    ):
        next(iter(dataset))


def test_leaves_with_different_leading_sizes_are_listed():
    dataset = mirrored(2).experimental_distribute_dataset([(np.zeros((4, 2)), np.zeros(3))])
    with pytest.raises(mirrax.errors.InvalidBatchError, match=r"batch\[0\]: 4, batch\[1\]: 3"):
        next(iter(dataset))


def test_empty_first_batch_is_refused():
    dataset = mirrored(2).experimental_distribute_dataset([np.zeros((0, 3))])
    with pytest.raises(mirrax.errors.InvalidBatchError, match="gives every replica 0 examples"):
        next(iter(dataset))


def test_not_a_dataset_is_a_type_error():
    with pytest.raises(TypeError, match="received int"):
        mirrored(2).experimental_distribute_dataset(5)
    with pytest.raises(TypeError, match="options must be a mirrax.InputOptions"):
        mirrored(2).experimental_distribute_dataset([np.zeros(2)], options={"prefetch": 2})
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1; received 0"):
        mirrax.InputOptions(experimental_per_replica_buffer_size=0)


def test_batches_unpack_as_in_tf():
    strategy = mirrored(2)
    x, y = np.arange(4, dtype=np.float32), np.arange(4, 8)
    for images, labels in strategy.experimental_distribute_dataset([(x, y)]):
        assert [v.tolist() for v in images.values] == [[0.0, 1.0], [2.0, 3.0]]
        assert [v.tolist() for v in labels.values] == [[4, 5], [6, 7]]


def test_a_generator_cannot_be_iterated_twice_silently():
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(np.arange(2 * i, 2 * i + 2) for i in range(3))
    assert len(list(dataset)) == 3
    with pytest.raises(RuntimeError, match="one-shot iterator.*used up by the previous pass"):
        list(dataset)


def test_non_numeric_leaves_are_named():
    dataset = mirrored(2).experimental_distribute_dataset([np.array(["a", "b"])])
    with pytest.raises(mirrax.errors.InvalidBatchError, match=r"batch has dtype <U1, which is not numeric"):
        next(iter(dataset))


def test_torch_tensors_that_track_gradients_are_batches():
    torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
    strategy = mirrored(2)
    # A tensor that requires grad has no direct .numpy(); the pipeline detaches it first.
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2).requires_grad_()
    (batch,) = strategy.experimental_distribute_dataset([(x, torch.arange(4))])
    shards = strategy.experimental_local_results(batch[0])
    np.testing.assert_array_equal(np.concatenate(shards), np.arange(8, dtype=np.float32).reshape(4, 2))
    assert [len(s) for s in strategy.experimental_local_results(batch[1])] == [2, 2]


def test_a_distributed_batch_exposes_its_stacked_rows_mask_and_lengths():
    # 10 examples over 4 replicas by TF's rule: ceil(10/4) = 3 rows each, 3, 3, 3, 1 real.
    strategy = mirrored(4)
    batch = next(iter(strategy.experimental_distribute_dataset(np.arange(10, dtype=np.float32))))
    assert batch.stacked.shape == (4, 3)
    assert batch.lengths == (3, 3, 3, 1)
    assert np.asarray(batch.mask).tolist() == [[True] * 3] * 3 + [[True, False, False]]
    assert np.asarray(batch.stacked)[3, 0] == 9.0  # the last replica's one real example


@pytest.mark.parametrize("device", [0, 3])
def test_a_one_device_batch_is_the_same_bits_in_new_buffers_on_that_device(device):
    # One device: batches are placed by a jitted identity (cheaper than jax.device_put); they
    # must hold exactly what device_put would: the same dtypes (float64 -> float32, int64 ->
    # int32 with x64 off), the same bits (NaN, -0.0, a float32 denormal, the largest float32),
    # on the strategy's device, in buffers of their own (a later write to the host array does
    # not reach them).
    strategy = mirrax.MirroredStrategy([jax.devices()[device]])
    x = np.array([[np.nan, -0.0, 1e-45, 3.4028235e38]], np.float64)
    y = np.array([[7, -1, 2**31 - 1, 0]], np.int64)
    (batch,) = strategy.experimental_distribute_dataset([(x[0], y[0])])
    (placed_x,), (placed_y,) = (strategy.experimental_local_results(v) for v in batch)
    reference = jax.device_put((x[0], y[0]), jax.devices()[device])
    assert (placed_x.dtype, placed_y.dtype) == (np.float32, np.int32)
    assert np.asarray(placed_x).tobytes() == np.asarray(reference[0]).tobytes()
    assert np.asarray(placed_y).tolist() == [7, -1, 2**31 - 1, 0]
    assert batch[0].stacked.devices() == {jax.devices()[device]}
    x[...] = 5.0
    assert np.asarray(placed_x).tobytes() == np.asarray(reference[0]).tobytes()
