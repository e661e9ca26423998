"""tf.data inputs (TensorFlow is in the test extra on x86_64 Python 3.11; elsewhere this file
skips): `fit` on a batched, prefetched tf.data.Dataset, and the per-replica batches of
experimental_distribute_dataset and distribute_datasets_from_function, which follow TF's rules.

The data: 26 examples, x[i] = i, y = 0, in global batches of 16 (16, then an uneven 10). The
identity model's loss is x itself, so a logged mean of (0 + ... + 25) / 26 = 325 / 26 = 12.5
says each example counted once (a dropped last batch logs 120 / 16 = 7.5; 6 padding rows
counted as zeros, 325 / 32 = 10.15625). TensorFlow is imported once, for the whole module.
"""

import jax
import numpy as np
import optax
import pytest

import mirrax
from tests.conftest import mirrored
from tests.test_training_model import Linear1, identity_model

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed (the test extra has it on x86_64, Python 3.11)"
)
# TF sizes its op thread pools to the machine's cores; one each, so the tests' JAX devices
# keep the CPU (set before TF runs any op, which is at collection: before every test).
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

EXAMPLES = 26
MEAN = 12.5  # (0 + 1 + ... + 25) / 26 = 325 / 26


def _dataset():
    x = np.arange(EXAMPLES, dtype=np.float32)[:, None]
    y = np.zeros(EXAMPLES, np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).prefetch(2)


def _ids(strategy, batches):
    """Each step's per-replica example ids (x[i] = i)."""
    return [
        [np.asarray(v)[:, 0].astype(int).tolist() for v in strategy.experimental_local_results(batch[0])]
        for batch in batches
    ]


def test_importing_tensorflow_leaves_jax_its_8_cpu_devices():
    assert jax.device_count() == 8  # tests/conftest.py's fake CPU devices, unchanged
    assert [d.device_type for d in tf.config.list_physical_devices()] == ["CPU"]


@pytest.mark.slow
def test_fit_on_a_prefetched_tf_data_dataset_counts_every_example_once():
    dataset = _dataset()
    assert len(dataset) == 2  # known cardinality: 26 examples in batches of 16 -> 16, 10
    model = identity_model(mirrored(4))
    history = model.fit(dataset, epochs=2, verbose=0)
    assert history.history["loss"] == pytest.approx([MEAN, MEAN], rel=1e-6)  # float32 sums
    assert model.evaluate(dataset, verbose=0) == pytest.approx(MEAN, rel=1e-6)
    np.testing.assert_array_equal(model.predict(dataset, verbose=0)[:, 0], np.arange(EXAMPLES))


def test_fit_on_tf_data_trains_with_each_batch_mean_gradient():
    strategy = mirrored(4)
    with strategy.scope():
        model = mirrax.Model(Linear1())  # w = 1, prediction w * x
        model.compile(optax.sgd(0.01), loss=lambda y, y_pred: y_pred[:, 0])
    model.fit(_dataset(), epochs=1, verbose=0)
    # The loss w * x has gradient mean(x) over the batch's real examples: 120 / 16 = 7.5, then
    # (16 + ... + 25) / 10 = 205 / 10 = 20.5, so w = 1 - 0.01 * (7.5 + 20.5) = 0.72 (padding
    # in the mean would give 205 / 16 = 12.8125 and w = 0.79687...). Tolerance: float32 steps.
    assert float(model.get_weights()[0]) == pytest.approx(0.72, rel=1e-6)


def test_experimental_distribute_dataset_splits_by_tf_ceil_rule():
    # TF's rule: of a global batch of n rows over R replicas, replica r gets rows
    # [r*c, min(n, (r+1)*c)) with c = ceil(n / R).
    strategy = mirrored(4)
    # 16 rows: c = 4 each. The uneven 10: c = ceil(10 / 4) = 3 -> 3, 3, 3, 1.
    assert _ids(strategy, strategy.experimental_distribute_dataset(_dataset())) == [
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        [[16, 17, 18], [19, 20, 21], [22, 23, 24], [25]],
    ]
    strategy = mirrored(8)
    # 16 rows: c = 2 each. 10 rows: c = ceil(10 / 8) = 2 -> five replicas of 2, three empty.
    steps = _ids(strategy, strategy.experimental_distribute_dataset(_dataset()))
    assert steps == [
        [[2 * r, 2 * r + 1] for r in range(8)],
        [[16, 17], [18, 19], [20, 21], [22, 23], [24, 25], [], [], []],
    ]


def test_distribute_datasets_from_function_deals_per_replica_batches():
    strategy = mirrored(4)
    contexts = []

    def dataset_fn(input_context):
        contexts.append(input_context)
        batch = input_context.get_per_replica_batch_size(16)  # 16 / 4 replicas = 4
        x = np.arange(EXAMPLES, dtype=np.float32)[:, None]
        ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(EXAMPLES, np.float32)))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(batch).prefetch(2)

    steps = _ids(strategy, strategy.distribute_datasets_from_function(dataset_fn))
    # One process: one input pipeline (shard(1, 0) keeps all 26), batches of 4: 4 x 6 then 2,
    # dealt to the replicas in turn; the second round runs out after 2 batches, so replica 2
    # gets the last 2 rows and replica 3 an empty batch.
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts[:1]] == [(1, 0)]
    assert steps == [
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        [[16, 17, 18, 19], [20, 21, 22, 23], [24, 25], []],
    ]
