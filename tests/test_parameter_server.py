"""ParameterServerStrategy's pieces that need no Ray cluster: the partitioners (TF's
arithmetic), how variables are cut and dealt to the parameter servers, and the update
arithmetic. The arguments refused before any task starts are in tests/bad_inputs/."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from mirrax._src.distribute import prng_keys
from mirrax._src.parameter_server import variables

pytestmark = pytest.mark.cluster

# -- partitioners: TF's examples and arithmetic ---------------------------------------------


def test_fixed_shards_partitioner():
    p = mirrax.partitioners.FixedShardsPartitioner(num_shards=2)
    assert p((10, 3), np.float32) == [2, 1]
    assert p((1, 3), np.float32) == [1, 1]  # never more shards than rows
    assert p((3, 10), np.float32, axis=1) == [1, 2]


def test_min_size_partitioner_matches_tf_examples():
    # TF's sharded_variable_test: float32 (6, 1) is 24 bytes.
    assert mirrax.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [
        2,
        1,
    ]  # min(6 rows, 2 shards, ceil(24 / 4) = 6)
    assert mirrax.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [
        6,
        1,
    ]
    # Default 256 KiB minimum: 1024 x 1024 float32 is 4 MiB -> 16 shards when allowed.
    assert mirrax.partitioners.MinSizePartitioner(max_shards=32)((1024, 1024), np.float32) == [16, 1]
    assert mirrax.partitioners.MinSizePartitioner()((1024, 1024), np.float32) == [1, 1]


def test_max_size_partitioner_matches_tf_arithmetic():
    p = mirrax.partitioners.MaxSizePartitioner
    # A row of (6, 1) float32 is 4 bytes: 8 bytes per shard holds 2 rows -> ceil(6 / 2) = 3.
    assert p(max_shard_bytes=8)((6, 1), np.float32) == [3, 1]
    assert p(max_shard_bytes=8, max_shards=2)((6, 1), np.float32) == [2, 1]
    # A row bigger than max_shard_bytes still makes one shard per row.
    assert p(max_shard_bytes=1)((6, 2), np.float32) == [6, 1]
    assert p(max_shard_bytes=100)((6, 2), np.int8) == [1, 1]


# -- layout: cutting, dealing, joining ---------------------------------------------------------


class _Net(nnx.Module):
    def __init__(self):
        self.kernel = nnx.Param(jnp.arange(10.0).reshape(5, 2))
        self.bias = nnx.Param(jnp.zeros((2,)))
        self.count = nnx.Variable(jnp.array(0, jnp.int32))


def _layout(num_ps, partitioner):
    _, _, leaves, paths = variables.split_roots((_Net(),))
    return variables.Layout(leaves, paths, num_ps, partitioner), leaves, paths


def test_layout_cuts_rows_as_tf_and_deals_round_robin():
    layout, leaves, paths = _layout(2, mirrax.partitioners.FixedShardsPartitioner(2))
    placement = layout.describe(paths)
    # Leaves in path order: bias (2 rows -> 1+1), count (scalar), kernel (5 rows -> 3+2, the
    # first shard one longer, TF's rule); shards dealt 0, 1, 0, 1, 0 in turn.
    assert placement == {
        "objects[0].bias": [(0, 1), (1, 1)],
        "objects[0].count": [(0, None)],
        "objects[0].kernel": [(1, 3), (0, 2)],
    }
    host = [variables.host_value(leaf) for leaf in leaves]
    per_ps = layout.split(host)
    np.testing.assert_array_equal(per_ps[1][(2, 0)], [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(per_ps[0][(2, 1)], [[6, 7], [8, 9]])
    for joined, original in zip(layout.join(per_ps), host):
        np.testing.assert_array_equal(joined, original)


def test_updates_are_differences_and_only_what_changed():
    layout, leaves, _ = _layout(1, None)
    old = [variables.host_value(leaf) for leaf in leaves]
    new = [old[0], old[1] + 3, old[2] - 0.5]  # bias unchanged, count + 3, kernel - 0.5
    (k0, u0), (k1, u1), (k2, u2) = layout.updates(old, new)
    assert (k0, u0) == (None, None)
    assert k1 == "add" and u1 == 3 and u1.dtype == np.int32
    assert k2 == "add"
    np.testing.assert_array_equal(u2, np.full((5, 2), -0.5, np.float32))


def test_a_difference_that_is_not_finite_travels_as_the_new_value():
    layout, leaves, _ = _layout(1, None)
    old = [variables.host_value(leaf) for leaf in leaves]
    # -inf -> 3 would push 3 - (-inf) = inf, and -inf + inf is NaN on the server.
    old[0] = np.array([-np.inf, 1.0], np.float32)
    new = [np.array([3.0, 1.0], np.float32), old[1], old[2]]
    kind, value = layout.updates(old, new)[0]
    assert kind == "assign"
    np.testing.assert_array_equal(value, [3.0, 1.0])
    # An unchanged NaN is no change.
    old[0] = new[0] = np.array([np.nan, 1.0], np.float32)
    assert layout.updates(old, new)[0] == (None, None)


def test_prng_keys_travel_as_key_data_and_are_assigned_not_added():
    rngs = nnx.Rngs(0)
    _, _, leaves, paths = variables.split_roots((rngs,))
    layout = variables.Layout(leaves, paths, 1, None)
    key_leaf = [i for i, leaf in enumerate(leaves) if prng_keys.is_key(leaf)][0]
    assert layout.additive[key_leaf] is False
    host = [variables.host_value(leaf) for leaf in leaves]
    back = layout.device_leaves(host)
    assert jax.random.key_impl(back[key_leaf]) == jax.random.key_impl(leaves[key_leaf])
    np.testing.assert_array_equal(jax.random.key_data(back[key_leaf]), jax.random.key_data(leaves[key_leaf]))


def test_a_partitioner_with_a_wrong_answer_is_named():
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"returned \[2, 2\] for objects\[0\]"
        r"\.kernel of shape \(5, 2\)",
    ):
        _layout(2, lambda shape, dtype, axis=0: [2] * len(shape))


def test_a_function_capturing_a_keras_model_is_sent_as_keras_pickles_it():
    # Keras pickles a model by writing it to an in-memory .keras file: the BytesIO met while
    # pickling is no iterator of the coordinator (before: refused as one, "a BytesIO (an
    # iterator or dataset of the coordinator) cannot be read on a worker").
    pytest.importorskip("ray", reason="the coordinator pickles with Ray's cloudpickle")
    keras = pytest.importorskip("keras")
    from mirrax._src.parameter_server import wire

    keras_model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
    )
    x = np.array([[1.0, 2.0]], np.float32)

    def dataset_fn():  # as create_per_worker_dataset pickles it: its refusals, no tokens
        return [np.asarray(keras_model(x))]

    def token_of(obj):
        wire.refuse(obj)
        return None

    copy = wire.loads(wire.dumps(dataset_fn, token_of))
    assert copy()[0].tolist() == [[3.0]]  # 1 * 1 + 1 * 2
    generator = (i for i in [1])
    with pytest.raises(errors.InvalidArgumentTypeError, match="a generator .* cannot be read"):
        wire.dumps(lambda: next(generator), token_of)  # still refused


def test_shutdown_names_what_ray_has_not_freed(monkeypatch):
    # shutdown()'s bounded wait for Ray to free the killed actors' CPUs, against a Ray that
    # never does: after the timeout, UnresponsivePeerError names the processes still running
    # (this test's own pid stands for a live actor; pid 0x7FFFFFFF runs nowhere).
    from mirrax._src.parameter_server import cluster as cluster_lib

    class NeverFrees:
        @staticmethod
        def cluster_resources():
            return {"CPU": 4.0}

        @staticmethod
        def available_resources():
            return {"CPU": 1.0}

    stuck = object.__new__(cluster_lib.Cluster)
    stuck.worker_pids, stuck.ps_pids = [os.getpid()], [0x7FFFFFFF]
    monkeypatch.setattr(cluster_lib, "RELEASE_TIMEOUT_S", 0.2)
    start = time.monotonic()
    with pytest.raises(errors.UnresponsivePeerError) as info:
        stuck.wait_released(NeverFrees, {"CPU": 2.0}, {"CPU": 1.0})
    assert time.monotonic() - start < 5.0  # bounded, never a hang
    message = str(info.value)
    # Expected 1 free before + 2 held = 3 of the 4 CPUs; 1 free now.
    assert "free now {'CPU': 1.0}, expected {'CPU': 3.0}" in message
    assert f"still running: worker 0 (pid {os.getpid()})" in message
    assert "parameter server" not in message and "ray status" in message


# -- the coordinator's queue -------------------------------------------------------------------


def test_an_error_is_raised_once_and_a_function_in_flight_then_does_not_fail_the_next_batch():
    # Three functions scheduled; two run (one per worker) and the first fails: join raises
    # its error once and cancels the third, still waiting. The second, in flight when the
    # error was raised, fails afterwards: its RemoteValue holds its error, but the next
    # schedule / join must not raise it (it belongs to the failed batch). A worker's death
    # hands back a function of the failed batch: it is cancelled, not run again.
    from mirrax._src.parameter_server import closures, remote_values

    queue = closures.Queue()
    first, second, third, fourth, fifth = (
        closures.Closure(b"", (), remote_values.RemoteValue()) for _ in range(5)
    )
    for closure in (first, second, third):
        queue.put(closure)
    assert queue.take() is first and queue.take() is second
    queue.finish(first, error=ValueError("bad batch"))
    with queue.cond, pytest.raises(ValueError, match="bad batch"):
        queue.raise_if_error()
    with pytest.raises(errors.CancelledFunctionError, match="cancelled before it ran"):
        third.value.fetch()
    queue.finish(second, error=ValueError("also bad"))
    with queue.cond:
        queue.raise_if_error()  # nothing left to raise: the next batch starts clean
    queue.put(fourth)
    assert queue.take() is fourth
    queue.finish(fourth, give_back=True)  # handed back within its batch: queued again
    queue.put(fifth)
    assert queue.take() is fourth and queue.take() is fifth
    queue.finish(fifth, error=ValueError("third bad"))
    with queue.cond, pytest.raises(ValueError, match="third bad"):
        queue.raise_if_error()
    queue.finish(fourth, give_back=True)  # its batch failed meanwhile: cancelled, not rerun
    with pytest.raises(errors.CancelledFunctionError):
        fourth.value.fetch()
    assert not queue.waiting


def test_a_lambda_made_anew_for_each_schedule_is_pickled_once():
    # A scheduling loop's `lambda` is a new function object per iteration, of the same code:
    # the same captured objects give the same pickle, so the entry is shared; a lambda that
    # captures another value, or one renamed, is pickled anew.
    from mirrax._src.parameter_server import payloads

    cache = payloads.PickleCache()
    always = lambda value: True  # noqa: E731 - every captured value counts as unchanging

    def make(x):
        return lambda: x

    first = make(1)
    cache.put(first, payloads.captured(first, always), ("function", b"1"), ())
    again = make(1)  # small ints are one object each: the same captured value
    assert again is not first and cache.get(again, always).token == ("function", b"1")
    assert cache.get(make(2), always) is None  # another value: another pickle
    cache.put(first, payloads.captured(first, always), ("function", b"1"), ())
    renamed = make(1)
    renamed.__qualname__ = "other"
    assert cache.get(renamed, always) is None
