"""The loaders users bring (a PyTorch DataLoader, a Hugging Face datasets.Dataset, Grain datasets
and loaders, tf.data when TensorFlow is installed, a generator) in Model.fit / evaluate / predict
and in experimental_distribute_dataset / distribute_datasets_from_function, on one process and
on 2 workers; and the refusal, naming the fix, of data in a shape fit cannot train on (issue 17).

The data set (tests/multiworker/scenarios.py, `loader_inputs`): 10 examples, example i has
x = 2**i and y = 0, in global batches of 4 (4, 4, 2). The test model's loss is x itself, so a
logged mean of 1023 / 10 = 102.3 says that each example counted exactly once (a dropped last
batch would log (1 + ... + 128) / 8 = 31.875; padding counted as examples, another value).
"""

# Imported, not importorskip'd: the test extra installs them, and a file skipped whole (as
# when tests/multiprocess shadowed the `multiprocess` that datasets imports) tests nothing.
import datasets
import grain
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils.data import DataLoader, TensorDataset

import mirrax
from mirrax import errors
from tests.conftest import mirrored
from tests.multiworker import harness, scenarios
from tests.test_training_model import identity_model

pytestmark = [pytest.mark.xdist_group("data_loaders"), pytest.mark.slow]

MEAN = 1023 / 10  # (2**0 + ... + 2**9) / 10 examples
# 10 examples in global batches of 4 over 4 replicas (TF's split, ceil(n / 4) each): one
# example per replica, and the last batch's 2 on the first two replicas.
IN_ORDER = [[[0], [1], [2], [3]], [[4], [5], [6], [7]], [[8], [9], [], []]]
RE_ITERABLE = ["torch", "torch_shuffled", "hf_batch", "hf_grain", "grain_map", "grain_iter", "grain_loader"]
FOR_FIT = ["torch", "torch_shuffled", "hf_grain", "grain_map", "grain_iter", "grain_loader", "generator"]


def _xy():
    return scenarios.loader_examples()[:2]


def _hf():
    return scenarios.loader_examples()[2]


@pytest.fixture(scope="module")
def single():
    """`loader_runs` on one process with 4 replicas (what 2 workers x 2 devices must match)."""
    return scenarios.loader_runs(mirrored(4))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """`loader_runs` on 2 worker processes x 2 CPU devices (Gloo on loopback)."""
    return harness.run("loaders", tmp_path_factory.mktemp("loaders"), num_workers=2, cpu_devices=2)


# -- one process -----------------------------------------------------------------------------


def test_each_loader_is_split_padded_and_read_again_each_pass(single):
    for name in ["torch", "hf_batch", "hf_grain", "grain_map", "grain_iter", "grain_loader"]:
        assert single[name]["steps"] == [IN_ORDER, IN_ORDER], name
    # One-shot sources (a generator, Hugging Face's .iter) make the one pass they can.
    assert single["generator"]["steps"] == [IN_ORDER]
    assert single["hf_iter"]["steps"] == [IN_ORDER]
    # A shuffling DataLoader draws a new order at each pass (as each epoch of a torch loop),
    # each a permutation of the 10 examples, still 4 + 4 + 2 per step.
    first, second = single["torch_shuffled"]["steps"]
    for one_pass in (first, second):
        assert sorted(sum(sum(one_pass, []), [])) == list(range(10))
        assert [sum(map(len, step)) for step in one_pass] == [4, 4, 2]
    assert first != second


def test_each_loader_trains_evaluates_and_predicts_every_example_once(single):
    for name in FOR_FIT:
        run = single[name]
        epochs = 1 if name == "generator" else 2  # a generator is one pass (Keras)
        assert run["fit"] == pytest.approx([MEAN] * epochs, rel=1e-6), name
        assert run["evaluate"] == pytest.approx(MEAN, rel=1e-6), name
        if name == "torch_shuffled":  # predict keeps the loader's (shuffled) order
            assert sorted(run["predict"]) == list(range(10))
        else:
            assert run["predict"] == list(range(10)), name


def test_fit_knows_the_steps_of_the_loaders_that_have_a_length(single):
    # len(DataLoader) = ceil(10 / 4) = 3, len(MapDataset.batch(4)) = 3: the progress bar's
    # total and the steps_per_epoch bound. Grain iterators and generators have no length.
    steps = {name: single[name]["fit_steps"] for name in FOR_FIT}
    assert steps == {
        "torch": 3,
        "torch_shuffled": 3,
        "hf_grain": 3,
        "grain_map": 3,
        "grain_iter": None,
        "grain_loader": None,
        "generator": None,
    }


def test_per_worker_loaders_from_function_on_one_process(single):
    # One input pipeline: each function reads all 10 examples in per-replica batches of
    # 4 / 4 = 1, dealt to the 4 replicas in turn.
    for name in ("torch", "hf", "grain"):
        assert single[f"from_function_{name}"] == IN_ORDER, name
    assert single["from_function_evaluate"] == pytest.approx(MEAN, rel=1e-6)


def test_hugging_face_columns_as_arrays_are_arrays():
    # The fix the errors below name for a Dataset in memory: its columns, ds["x"][:].
    ds = _hf()
    model = identity_model(mirrored(2))
    assert model.evaluate(ds["x"][:], ds["y"][:], batch_size=4, verbose=0) == pytest.approx(MEAN, rel=1e-6)


class PickX(nnx.Module):
    """Returns batch["x"] (plus 0 * w): a model whose input is a dict, as Keras's x."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        return x["x"] + 0.0 * self.w[...]


def test_predict_takes_a_dict_batch_as_x_as_keras():
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(PickX())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    x, _ = _xy()
    ds = _hf()
    np.testing.assert_array_equal(model.predict(ds.batch(4), verbose=0), x)
    # Distributed first, the same: a dict (or a bare array) batch is x (it used to fail with
    # KeyError: 0, or "'ShapeDtypeStruct' object is not subscriptable").
    np.testing.assert_array_equal(
        model.predict(strategy.experimental_distribute_dataset(ds.batch(4)), verbose=0), x
    )
    bare = strategy.experimental_distribute_dataset(DataLoader(torch.from_numpy(x), batch_size=4))
    np.testing.assert_array_equal(identity_model(strategy).predict(bare, verbose=0), x)


def test_tf_data_in_fit_and_experimental_distribute_dataset():
    tf = pytest.importorskip(
        "tensorflow", reason="TensorFlow is not installed (the test extra has it on x86_64, Python 3.11)"
    )
    x, y = _xy()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    strategy = mirrored(4)
    steps = [
        [
            np.log2(np.asarray(v)[:, 0]).astype(int).tolist()
            for v in strategy.experimental_local_results(batch[0])
        ]
        for batch in strategy.experimental_distribute_dataset(dataset)
    ]
    assert steps == IN_ORDER
    model = identity_model(strategy)
    assert model.fit(dataset, epochs=2, verbose=0).history["loss"] == pytest.approx([MEAN, MEAN], rel=1e-6)
    assert model.evaluate(dataset, verbose=0) == pytest.approx(MEAN, rel=1e-6)
    np.testing.assert_array_equal(model.predict(dataset, verbose=0), x)
    as_dicts = tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(4)
    with pytest.raises(errors.InvalidBatchError, match=r"a dict with keys \['x', 'y'\]"):
        model.fit(as_dicts, verbose=0)


# -- two workers -----------------------------------------------------------------------------


@pytest.mark.subprocess
def test_two_workers_split_each_global_batch_as_one_process_does(workers, single):
    worker0, worker1 = workers
    # AutoShardPolicy.DATA (AUTO for anything but a FileDataset): every worker reads each
    # global batch and keeps its 2 replicas' rows; replicas 0-1 are worker 0's, 2-3 worker 1's.
    assert worker0["torch"]["steps"][0] == [[[0], [1]], [[4], [5]], [[8], [9]]]
    assert worker1["torch"]["steps"][0] == [[[2], [3]], [[6], [7]], [[], []]]
    for name in RE_ITERABLE + ["generator", "hf_iter"]:
        for mine, theirs, one in zip(worker0[name]["steps"], worker1[name]["steps"], single[name]["steps"]):
            # Together, step by step, the 4 replicas of one process with 4 devices.
            assert [a + b for a, b in zip(mine, theirs)] == one, name
            seen = sum(sum(mine, []) + sum(theirs, []), [])
            assert sorted(seen) == list(range(10)), name  # each example once per pass


@pytest.mark.subprocess
def test_two_workers_fit_evaluate_predict_as_one_process(workers, single):
    for worker in workers:
        for name in FOR_FIT:
            for key in ("fit", "evaluate", "predict", "fit_steps"):
                assert worker[name][key] == single[name][key], (name, key)
        assert worker["grain_map"]["fit"] == pytest.approx([MEAN, MEAN], rel=1e-6)


@pytest.mark.subprocess
def test_two_workers_read_their_own_examples_from_function(workers):
    worker0, worker1 = workers
    # torch Subset(range(i, 10, 2)), Grain [i::2]: worker 0 the even ids, worker 1 the odd,
    # one per replica per step (per-replica batch 4 / 4 = 1), 5 over 2 replicas = 3 steps.
    for name in ("torch", "grain"):
        assert worker0[f"from_function_{name}"] == [[[0], [2]], [[4], [6]], [[8], []]]
        assert worker1[f"from_function_{name}"] == [[[1], [3]], [[5], [7]], [[9], []]]
    # Hugging Face ds.shard(2, i, contiguous=True): worker 0 ids 0-4, worker 1 ids 5-9.
    assert worker0["from_function_hf"] == [[[0], [1]], [[2], [3]], [[4], []]]
    assert worker1["from_function_hf"] == [[[5], [6]], [[7], [8]], [[9], []]]
    # Evaluated together: each example counted once across the workers.
    assert (
        worker0["from_function_evaluate"]
        == worker1["from_function_evaluate"]
        == (pytest.approx(MEAN, rel=1e-6))
    )


@pytest.mark.subprocess
def test_workers_shuffling_with_their_own_seeds_are_stopped(workers):
    # An unseeded DataLoader(shuffle=True) draws another order on each worker: under DATA each
    # would keep its part of a different batch (examples lost and repeated). Refused at step 1.
    for worker in workers:
        message = worker["unseeded_shuffle_error"]
        assert message.startswith("The processes disagree about the global batch every worker reads")
        assert "the same shuffle seed" in message and "at 'input/" in message


# -- bad input -------------------------------------------------------------------------------


def test_a_hugging_face_dataset_of_rows_is_refused_naming_its_columns():
    ds = _hf()
    model = identity_model(mirrored(2))
    # Iterated directly, a Dataset yields one example at a time: {"x": (1,), "y": a scalar}.
    with pytest.raises(errors.InvalidBatchError) as info:
        model.fit(ds, verbose=0)
    message = str(info.value)
    assert message.startswith(
        "fit: x (Dataset) yields single examples, not batches: its first element's leaf ['y'] is a scalar"
    )
    assert "fit(ds['x'][:], ds['y'][:], batch_size=B)" in message
    assert "grain.MapDataset.source(ds).map(lambda b: (b['x'], b['y'])).batch(B)" in message
    with pytest.raises(
        errors.InvalidBatchError, match=r"batch\['y'\] is a scalar .*ds.iter\(batch_size=B\) or ds.batch"
    ):
        list(mirrored(2).experimental_distribute_dataset(ds))
    # A column is a lazy view, not an array (datasets >= 4): named, with ds['x'][:].
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"received Column .*Hugging Face Column \(ds\['x'\]\).*ds\['x'\]\[:\]",
    ):
        model.fit(ds["x"], ds["y"], batch_size=4, verbose=0)
    splits = datasets.DatasetDict({"train": ds, "test": ds})
    for call in (
        lambda: model.fit(splits, verbose=0),
        lambda: mirrored(2).experimental_distribute_dataset(splits),
    ):
        with pytest.raises(
            errors.InvalidArgumentTypeError,
            match=r"DatasetDict of the splits \['train', 'test'\]; pass one split",
        ):
            call()
    assert model.optimizer.iterations == 0


def test_dict_batches_are_refused_by_fit_with_the_tuple_to_make():
    ds = _hf()
    model = identity_model(mirrored(2))
    # As in Keras, a dict batch is x alone: no labels. Hugging Face's .iter, a DataLoader over
    # the torch-formatted dataset, and the same distributed first, all yield such dicts.
    sources = [
        ds.iter(batch_size=4),
        DataLoader(ds.with_format("torch"), batch_size=4),
        mirrored(2).experimental_distribute_dataset(ds.batch(4)),
    ]
    for source, where in zip(sources, ["a dataset", "a dataset", "a distributed dataset"]):
        with pytest.raises(errors.InvalidBatchError) as info:
            model.fit(source, verbose=0)
        message = str(info.value)
        assert message.startswith(
            f"fit/evaluate: each batch of {where} must be a tuple or list (x, y) or (x, y, "
            "sample_weight); received a dict with keys ['x', 'y']."
        )
        assert "dataset.map(lambda b: (b['x'], b['y']))" in message
        assert "fit(ds['x'][:], ds['y'][:], batch_size=B)" in message
    # Keys that name no labels: the tuple is written with placeholders.
    with pytest.raises(errors.InvalidBatchError, match=r"\(b\['<inputs>'\], b\['<labels>'\]\)"):
        model.evaluate([{"pixels": np.ones((2, 1), np.float32)}], verbose=0)
    assert model.optimizer.iterations == 0


def test_batches_of_the_wrong_structure_are_named_before_any_step():
    strategy = mirrored(2)
    model = identity_model(strategy)
    x, y = _xy()
    # A TensorDataset of 4 tensors collates to a list of 4: not (x, y[, sample_weight]).
    four = DataLoader(TensorDataset(*(torch.from_numpy(a) for a in (x, y, y, y))), batch_size=4)
    with pytest.raises(
        errors.InvalidBatchError,
        match=r"received a list of 4\. For a "
        r"multi-input model, make x a dict",
    ):
        model.fit(four, verbose=0)
    # Distributed first, the same check (they used to be IndexError / TypeError from the step).
    for batches, received in (([(x[:4],)], "a tuple of 1"), ([x[:4]], "a PerReplica")):
        with pytest.raises(
            errors.InvalidBatchError,
            match=rf"each batch of a distributed dataset must be a tuple or list "
            rf"\(x, y\).*received {received}",
        ):
            model.evaluate(strategy.experimental_distribute_dataset(batches), verbose=0)
    assert model.optimizer.iterations == 0


def test_examples_given_where_batches_go_are_refused_with_how_to_batch_them():
    strategy = mirrored(2)
    model = identity_model(strategy)
    x, y = _xy()
    examples = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))  # no DataLoader
    for call in (
        lambda: model.fit(examples, verbose=0),
        lambda: strategy.experimental_distribute_dataset(examples),
    ):
        with pytest.raises(
            errors.InvalidArgumentTypeError,
            match=r"received TensorDataset .*a map-style dataset of single "
            r"examples \(a torch Dataset\); batch it: "
            r"torch.utils.data.DataLoader\(ds, batch_size=B\)",
        ):
            call()
    # A Grain pipeline without .batch yields examples: y is a 0-d array.
    unbatched = grain.MapDataset.range(10).map(lambda i: (x[i], y[i]))
    with pytest.raises(
        errors.InvalidBatchError,
        match=r"fit: x \(MapMapDataset\) yields single examples, not batches: its "
        r"first element's leaf \[1\] is a scalar .*dataset.batch\(B\) "
        r"\(Grain, tf.data\)",
    ):
        model.fit(unbatched, verbose=0)
    assert model.optimizer.iterations == 0
