"""What the ParameterServerStrategy test modules share: Ray (skipped without it), the workers'
one CPU device, and one local Ray cluster per module, on which each strategy starts its own
actors (import `ray_cluster` into the module to start it)."""

import pytest

import mirrax

ray = pytest.importorskip("ray", reason="ParameterServerStrategy needs Ray: pip install 'mirrax[ray]'")

ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    resolver = mirrax.RayClusterResolver(num_workers=6, num_ps=6)
    resolver.connect()
    yield
    resolver.shutdown()


def strategy(num_workers, num_ps, partitioner=None, update="differences"):
    """A ParameterServerStrategy on the module's cluster, its workers with one CPU device."""
    return mirrax.ParameterServerStrategy(
        mirrax.RayClusterResolver(num_workers, num_ps, worker_env=ONE_DEVICE), partitioner, update=update
    )
