"""Strategy construction, device names, scopes and the context functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrax
from tests.conftest import mirrored


def test_mirrored_defaults_to_every_local_device():
    strategy = mirrax.MirroredStrategy()
    assert strategy.num_replicas_in_sync == len(jax.local_devices()) == 8
    assert strategy.mesh.axis_names == (mirrax.REPLICA_AXIS,) == ("replica",)


@pytest.mark.parametrize(
    "names",
    [
        ["cpu:0", "cpu:1"],
        ["/cpu:0", "/CPU:1"],
        ["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"],
    ],
)
def test_device_strings_in_tf_spellings(names):
    strategy = mirrax.MirroredStrategy(names)
    assert list(strategy.mesh.devices.flat) == jax.local_devices()[:2]
    assert strategy.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    )


def test_jax_devices_are_accepted():
    devices = jax.local_devices()[2:5]
    assert list(mirrax.MirroredStrategy(devices).mesh.devices.flat) == devices


@pytest.mark.parametrize("bad", ["gpu:0", "cpu:99", "banana"])
def test_unknown_device_string_lists_the_devices_there_are(bad):
    with pytest.raises(
        mirrax.errors.InvalidDeviceError,
        match=rf"'{bad}' names no device of this process.*this process has: cpu:0, cpu:1",
    ):
        mirrax.MirroredStrategy([bad])


def test_empty_and_duplicate_device_lists_are_refused():
    with pytest.raises(mirrax.errors.InvalidDeviceError, match=r"devices=\[\] gives no replicas"):
        mirrax.MirroredStrategy([])
    with pytest.raises(mirrax.errors.InvalidDeviceError, match="more than once"):
        mirrax.MirroredStrategy(["cpu:0", "/cpu:0"])


@pytest.mark.parametrize(
    "ops",
    [mirrax.NcclAllReduce(), mirrax.HierarchicalCopyAllReduce(num_packs=2), mirrax.ReductionToOneDevice()],
)
def test_cross_device_ops_are_accepted_and_change_nothing(ops):
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    assert strategy.cross_device_ops is ops
    value = strategy.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group)
    )
    assert float(strategy.reduce("sum", value)) == 1.0  # 0 + 1
    with pytest.raises(TypeError, match="cross_device_ops must be a mirrax.CrossDeviceOps"):
        mirrax.MirroredStrategy(cross_device_ops="nccl")


def test_one_device_strategy_runs_on_its_device():
    strategy = mirrax.OneDeviceStrategy("cpu:3")
    assert strategy.num_replicas_in_sync == 1
    out = strategy.run(lambda x: x * 2, args=(jnp.ones(2),))
    assert {d.id for d in out.values[0].devices()} == {jax.local_devices()[3].id}
    with pytest.raises(mirrax.errors.InvalidDeviceError, match="device: 'tpu:0'"):
        mirrax.OneDeviceStrategy("tpu:0")


def test_tpu_strategy_without_tpus_says_what_to_use():
    with pytest.raises(
        mirrax.errors.InvalidDeviceError, match="no TPU devices.*'cpu' with 8 device.*MirroredStrategy"
    ):
        mirrax.TPUStrategy()


def test_default_strategy_outside_every_scope():
    strategy = mirrax.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    assert not mirrax.has_strategy()
    assert not mirrax.in_cross_replica_context()
    ctx = mirrax.get_replica_context()
    assert ctx.num_replicas_in_sync == 1 and ctx.replica_id_in_sync_group == 0
    assert float(ctx.all_reduce("sum", 3.0)) == 3.0
    out = strategy.run(lambda x: x + 1, args=(np.float32(1.0),))
    assert float(strategy.reduce("sum", out)) == 2.0
    # This process's own first device, and no other process's (a multi-worker run gives each
    # worker its own; tests/test_multi_worker.py checks 3 workers).
    devices = strategy.extended.replica_devices
    assert devices.devices == (jax.local_devices()[0],)
    assert devices.process_indices == (jax.process_index(),)
    assert devices.spans_processes is False


def test_contexts_inside_scope_and_run():
    strategy = mirrored(2)
    seen = {}

    def step():
        seen["strategy"] = mirrax.get_strategy()
        seen["cross"] = mirrax.in_cross_replica_context()
        seen["ctx"] = mirrax.get_replica_context()
        return jnp.zeros(())

    with strategy.scope() as entered:
        assert entered is strategy and mirrax.get_strategy() is strategy
        assert mirrax.has_strategy() and mirrax.in_cross_replica_context()
        assert mirrax.get_replica_context() is None  # cross-replica context, as TF
        strategy.run(step)
    assert seen["strategy"] is strategy and seen["cross"] is False
    assert isinstance(seen["ctx"], mirrax.ReplicaContext) and seen["ctx"].num_replicas_in_sync == 2
    assert mirrax.get_strategy() is not strategy


def test_nested_run_is_refused():
    strategy = mirrored(2)
    with pytest.raises(mirrax.errors.ReplicaContextError, match="nested run"):
        strategy.run(lambda: strategy.run(lambda: jnp.zeros(())))


def test_repr_names_the_devices():
    assert repr(mirrored(2)) == "MirroredStrategy(num_replicas_in_sync=2, devices=[cpu:0, cpu:1])"
