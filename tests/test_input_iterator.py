"""The distributed iterator API of TF's input tutorial: get_next_as_optional, element_spec on the
distributed dataset and its iterator, and mirrax.DatasetCreator in fit and
distribute_datasets_from_function (as tf.keras.utils.experimental.DatasetCreator)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored


def batched_range(n, batch):
    """tf.data.Dataset.range(n).batch(batch), as a list of NumPy arrays."""
    return [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]


@pytest.mark.parametrize("replicas", [1, 4])
def test_get_next_as_optional_to_the_end_of_data(replicas):
    # The tutorial's cell: range(9).batch(4), a loop of 5 steps broken when the optional is empty.
    strategy = mirrored(replicas)
    iterator = iter(strategy.experimental_distribute_dataset(batched_range(9, 4)))
    seen = []

    def identity(x):
        return x

    for _ in range(5):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        out = strategy.run(identity, args=(optional.get_value(),))
        seen.append([np.asarray(v).tolist() for v in strategy.experimental_local_results(out)])
    # 4 over 1 replica: one shard; over 4: 1,1,1,1; the last batch [8]: 1 then 0,0,0.
    if replicas == 1:
        assert seen == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8]]]
    else:
        assert seen == [[[0], [1], [2], [3]], [[4], [5], [6], [7]], [[8], [], [], []]]
    assert optional.has_value() is False
    with pytest.raises(mirrax.errors.InvalidArgumentError) as info:
        optional.get_value()
    assert str(info.value) == (
        "Optional.get_value: the optional has no value (the distributed iterator was at the end "
        "of its data). Check optional.has_value() before get_value()."
    )
    assert not iterator.get_next_as_optional().has_value()  # stays at the end
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.parametrize("replicas", [1, 4])
def test_element_spec_of_dataset_and_iterator(replicas):
    # The tutorial's cell: from_tensors(([1.], [1.])).repeat(100).batch(16): 6 batches of 16, one of 4.
    strategy = mirrored(replicas)
    ones = np.ones((100, 1), np.float32)
    batches = [(ones[i : i + 16], ones[i : i + 16]) for i in range(0, 100, 16)]
    dist_dataset = strategy.experimental_distribute_dataset(batches)
    per_replica = jax.ShapeDtypeStruct((16 // replicas, 1), jnp.float32)
    assert dist_dataset.element_spec == (per_replica, per_replica)
    iterator = iter(dist_dataset)  # continues the pass element_spec started: nothing is lost
    assert iterator.element_spec == (per_replica, per_replica)

    def step_fn(x, y):
        return 2 * x

    outputs = [strategy.run(step_fn, args=batch) for batch in iterator]
    assert len(outputs) == 7
    assert float(strategy.reduce("sum", outputs[-1], axis=0).sum()) == 8.0  # 4 examples * 2
    assert iterator.element_spec == (per_replica, per_replica)  # kept after the end
    assert dist_dataset.element_spec == (per_replica, per_replica)


def test_element_spec_of_a_one_shot_generator_loses_no_batch():
    strategy = mirrored(2)
    dist_dataset = strategy.experimental_distribute_dataset(
        {"x": np.full((6, 3), i, np.int32)} for i in range(3)
    )
    assert dist_dataset.element_spec == {"x": jax.ShapeDtypeStruct((3, 3), jnp.int32)}
    firsts = [int(np.asarray(b["x"].values[0])[0, 0]) for b in dist_dataset]
    assert firsts == [0, 1, 2]


def test_element_spec_of_a_used_up_iterator_is_refused():
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(batched_range(4, 4)))
    next(iterator)
    with pytest.raises(mirrax.errors.EmptyDatasetError, match="no batch left to read"):
        _ = iterator.element_spec


def test_element_spec_of_distribute_datasets_from_function():
    strategy = mirrored(4)

    def dataset_fn(ctx):
        size = ctx.get_per_replica_batch_size(8)  # 8 / 4 replicas = 2
        return [np.zeros((size, 5), np.float16)] * 4

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert dist.element_spec == jax.ShapeDtypeStruct((2, 5), jnp.float16)


class Identity(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        return x + 0.0 * self.w[...]


@pytest.mark.parametrize("replicas", [1, 4])
def test_dataset_creator_in_fit(replicas):
    strategy = mirrored(replicas)
    contexts = []

    def dataset_fn(input_context):
        contexts.append(input_context)
        size = input_context.get_per_replica_batch_size(8)
        # Per-replica batches of x = 1, 2, ...: one round of `replicas` batches per step.
        return [
            (np.full((size, 1), i, np.float32), np.zeros(size, np.float32))
            for i in range(1, 2 * replicas + 1)
        ]

    with strategy.scope():
        model = mirrax.Model(Identity())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    creator = mirrax.DatasetCreator(
        dataset_fn, input_options=mirrax.InputOptions(experimental_fetch_to_device=False)
    )
    history = model.fit(creator, epochs=1, steps_per_epoch=2, verbose=0)
    # The loss is the mean of x over the 2 steps' 2 * replicas equal-sized batches:
    # mean(1 .. 2R) = (2R + 1) / 2 (1.5 on 1 replica, 4.5 on 4).
    assert history.history["loss"] == [pytest.approx((2 * replicas + 1) / 2)]
    assert contexts[0].num_replicas_in_sync == replicas
    assert contexts[0].num_input_pipelines == 1


def test_dataset_creator_in_distribute_datasets_from_function():
    strategy = mirrored(2)
    creator = mirrax.DatasetCreator(lambda ctx: [np.arange(3)] * 2)
    (batch,) = list(strategy.distribute_datasets_from_function(creator))
    assert [np.asarray(v).tolist() for v in batch.values] == [[0, 1, 2], [0, 1, 2]]


def test_dataset_creator_refusals():
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError) as info:
        mirrax.DatasetCreator([np.arange(3)])
    assert str(info.value) == (
        "DatasetCreator: dataset_fn must be a callable of one argument, the InputContext, "
        "returning batches; received list ([array([0, 1, 2])]). Pass the function itself: "
        "DatasetCreator(dataset_fn)."
    )
    with pytest.raises(mirrax.errors.InvalidArgumentTypeError) as info:
        mirrax.DatasetCreator(lambda ctx: [], input_options={"prefetch": 2})
    assert str(info.value) == (
        "DatasetCreator: input_options must be a mirrax.InputOptions or None; received dict "
        "({'prefetch': 2})."
    )

    def dataset_fn(ctx):
        return 3

    with pytest.raises(mirrax.errors.InvalidArgumentTypeError) as info:
        mirrored(2).distribute_datasets_from_function(mirrax.DatasetCreator(dataset_fn))
    assert str(info.value).startswith(
        "DatasetCreator: dataset_fn must return a dataset (batches: a tuple/dict of arrays, an "
        "iterable of such batches, a tf.data.Dataset); it returned int (3). (The dataset must "
    )


@pytest.mark.subprocess
def test_a_program_that_leaves_an_iterator_half_read_exits_cleanly():
    # Before: the prefetch thread, still placing the next batch while the interpreter tore JAX
    # down, aborted the finished program (C++ terminate, exit 134) in 6 runs of 6.
    import subprocess
    import sys

    program = (
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
        "import numpy as np, mirrax\n"
        "strategy = mirrax.MirroredStrategy()\n"
        "batches = [np.ones((8, 2), np.float32)] * 3\n"
        "it = iter(strategy.experimental_distribute_dataset(batches))\n"
        "next(it)\n"
        "print('done')\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
