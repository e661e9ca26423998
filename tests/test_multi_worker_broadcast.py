"""Mirrored state is made equal on every worker: worker 0's values at the strategy's first use.

As TF's own test of multi-worker mirrored variables (ones on worker 0, zeros elsewhere; after
creation every worker sees ones), in ONE launch of 2 workers x 2 CPU devices
(tests/multiworker/broadcast.py): Model.fit and evaluate, a custom loop, a Keras and an NNX
model, the sharded optimizer and replica-invariant mode. Then the broadcast itself, on one
process: its bits, and that a one-process run never takes it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from mirrax._src.distribute import broadcast
from tests.conftest import mirrored
from tests.multiworker import harness

pytestmark = pytest.mark.subprocess


def test_every_worker_holds_worker_0s_state_after_the_first_use(tmp_path):
    first, second = harness.run(
        "broadcast_mirrored",
        tmp_path,
        num_workers=2,
        cpu_devices=2,
        timeout=300,
        env={"MIRRAX_TEST_TIMEOUT": "60"},
    )
    ones_mlp = [[1.0] * 3, [1.0] * 12, [1.0] * 2, [1.0] * 6]  # l1 bias, kernel; l2 bias, kernel
    # fit as the first use: worker 1 started from zeros, so without the broadcast its weights
    # end elsewhere; with it, both trained worker 0's model on the same all-reduced gradients.
    assert first["fit"] == second["fit"]
    assert first["fit"] != ones_mlp  # it trained
    # Keras's unseeded initializers differ per worker; evaluate (first use) makes worker 0's.
    assert first["keras_initial"] != second["keras_initial"]
    assert second["keras_evaluated"] == first["keras_initial"] == first["keras_evaluated"]
    assert first["keras_fit"] == second["keras_fit"] != first["keras_evaluated"]
    # Custom loop: the first run reads 4 * 3 ones = 12 on every replica of both workers.
    assert first["custom_read"] == second["custom_read"] == 12.0
    assert first["custom_initial"] == second["custom_initial"] == ones_mlp
    assert first["custom_trained"] == second["custom_trained"] != ones_mlp
    # Assigned between steps (3 on worker 0, 5 on worker 1; then 2 and 7 in place): worker 0's
    # value is every worker's (3 * 12 = 36, 2 * 12 = 24), and worker 1 is told, twice.
    assert first["custom_reassigned"] == second["custom_reassigned"] == 36.0
    assert first["custom_updated"] == second["custom_updated"] == 24.0
    assert first["warnings"] == []
    assert len(second["warnings"]) == 2
    assert all(
        w.startswith(
            "strategy.run: on worker 1, the value assigned to MLP.l1.kernel "
            "differs from worker 0's, and worker 0's was taken"
        )
        for w in second["warnings"]
    )
    # Sharded optimizer: each worker holds 2 of the 4 row-shards of mu (4, 8), all ones (worker
    # 0's) on worker 1 too; the read is the sum of the (4, 8) kernel of ones = 32.
    for worker in (first, second):
        assert worker["sharded_mu_spec"] == ["replica"]
        assert worker["sharded_mu_local"] == [[1.0] * 8, [1.0] * 8]
        assert worker["sharded_read"] == 32.0
    # Replica-invariant mode: parameters ones, and the Dropout's RNG key (seeded with the
    # worker's index) worker 0's on both.
    assert first["invariant_initial_keys"] != second["invariant_initial_keys"]
    assert first["invariant_evaluated"] == second["invariant_evaluated"] == ones_mlp
    assert (
        second["invariant_evaluated_keys"]
        == first["invariant_evaluated_keys"]
        == first["invariant_initial_keys"]
    )


def test_workers_with_other_shapes_fail_at_the_first_use_on_every_worker(tmp_path):
    workers = harness.start(
        "broadcast_mismatched", tmp_path, num_workers=2, cpu_devices=1, env={"MIRRAX_TEST_TIMEOUT": "20"}
    )
    assert harness.wait(workers, timeout=120) == [1, 1]
    for worker in workers:
        assert (
            "DivergentWorkersError: The processes disagree about the shapes and dtypes of "
            "the mirrored state placed on the replicas at its first use" in worker.output
        )
        assert "at 'broadcast/0'" in worker.output


def _bits(x):
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x).tobytes()


def test_the_broadcast_keeps_every_bit_of_every_dtype():
    strategy = mirrored(4)
    xs = [
        jnp.asarray([-0.0, np.nan, 1.5, -np.inf], jnp.float32),  # sign of zero, NaN kept
        jnp.asarray([[1, -2, 3]], jnp.int8),  # 3 bytes: padded to one word
        jnp.asarray([True, False, True]),
        jnp.asarray([1.25, -3.0], jnp.bfloat16),
        jnp.asarray(7, jnp.uint32),
        jnp.zeros((0, 5), jnp.float32),
        jax.random.key(3),
        np.arange(6, dtype=np.int32).reshape(2, 3),  # a NumPy array enters too
        jnp.arange(300_000, dtype=jnp.float32) - 0.5,  # 1.2 MB > 1 MiB: its own buffer
        jnp.arange(600_000, dtype=jnp.int16),  # the same, bytes packed two to a word
    ]
    replicated = strategy.extended.replica_devices.replicated
    results, differing = broadcast.from_worker_zero(
        strategy, xs, [replicated] * len(xs), check=[True] * len(xs)
    )
    assert differing == []  # worker 0 does not compare with itself
    for x, result in zip(xs, results):
        assert result.sharding == replicated
        assert result.dtype == (x.dtype if not isinstance(x, np.ndarray) else jnp.int32)
        assert result.shape == x.shape
        for shard in result.addressable_shards:
            assert _bits(shard.data) == _bits(x)


def test_one_process_never_broadcasts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("broadcast taken in a one-process run")

    monkeypatch.setattr(broadcast, "from_worker_zero", refuse)
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        model.compile(optax.sgd(0.1), "mse")
    model.fit(np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32), batch_size=4, verbose=0)
    module = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    assert float(strategy.run(lambda m: jnp.sum(m.bias[...]), args=(module,)).values[0]) == 0.0


def test_a_missing_peer_is_an_error_within_the_timeout(monkeypatch):
    # Process 1 of 2 never publishes: the exchange before the collective gives up after the
    # timeout with the exchange's name, instead of waiting in the all-reduce forever.
    from mirrax._src.distribute import multihost

    calls = []

    def exchange(name, value, timeout_seconds=None):
        calls.append((name, timeout_seconds))
        raise errors.UnresponsivePeerError(f"Process 0 got no answer from process 1 at {name!r}")

    monkeypatch.setattr(multihost, "exchange", exchange)
    strategy = mirrored(2)
    strategy.communication_options = mirrax.CommunicationOptions(timeout_seconds=7)
    with pytest.raises(errors.UnresponsivePeerError, match="at 'broadcast/"):
        broadcast.from_worker_zero(strategy, [jnp.ones(3)], [strategy.extended.replica_devices.replicated])
    assert calls[0][1] == 7
