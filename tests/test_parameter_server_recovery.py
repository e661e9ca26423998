"""ParameterServerStrategy's recovery flow (docs/parameter_server.md, "Failures"): shut a
strategy down, make a new one at once, go on training the same `mirrax.Model` on it, and what
Ray prints meanwhile (issue 27, items 7 and 8). One local Ray cluster of 3 CPUs for the
module, so that a new strategy of 2 workers and 1 parameter server needs every CPU the old one
held."""

import gc
import logging
import os
import subprocess
import sys
import time

import numpy as np
import optax
import pytest

import mirrax
from mirrax import errors
from tests.test_parameter_server_ray import Line

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("parameter_server_recovery")]

ray = pytest.importorskip("ray", reason="ParameterServerStrategy needs Ray: pip install 'mirrax[ray]'")

ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
CPUS = 3


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def ray_messages():
    """The local cluster, and what Ray's loggers say once it runs (`ray.init` sets up Ray's
    loggers anew, dropping a handler added before)."""
    resolver = mirrax.RayClusterResolver(num_workers=2, num_ps=1)
    # The cluster's size follows os.cpu_count() (here 2); CPUS whatever the machine.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "cpu_count", lambda: 1)
        resolver.connect()
    assert ray.cluster_resources()["CPU"] == CPUS
    records = _Records()
    logging.getLogger("ray").addHandler(records)
    yield records
    logging.getLogger("ray").removeHandler(records)
    resolver.shutdown()


def _strategy(num_workers):
    return mirrax.ParameterServerStrategy(mirrax.RayClusterResolver(num_workers, 1, worker_env=ONE_DEVICE))


def _all_free():
    return ray.available_resources().get("CPU", 0.0) == CPUS


def test_recovery_a_new_strategy_at_once_and_the_same_model_trains_on(ray_messages):
    records = ray_messages
    x, y = np.ones((8, 1), np.float32), np.full((8, 1), 5.0, np.float32)
    first = _strategy(1)
    with first.scope():
        model = mirrax.Model(Line())
        model.compile(optax.sgd(0.1), "mse")
    # One worker: synchronous SGD on (w + b - 5)^2, whose gradient is 2 (w + b - 5) for both:
    # w = b = 0 -> 1 -> 1.6.
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    first.shutdown()
    assert _all_free()  # shutdown() returned once Ray had freed the 2 CPUs
    np.testing.assert_allclose(model.get_weights(), [[1.6], [1.6]], rtol=1e-6)

    # Three strategies made back to back, each at once after the last one's shutdown; the
    # middle one has no coordinator (so no threads whose joining takes a second): before,
    # the next one was refused at once, "0 free CPU(s); this strategy needs 3".
    idle = _strategy(2)
    idle.shutdown()
    assert _all_free()
    second = _strategy(2)
    try:
        # The recovery flow: the same model under the new strategy's scope. It belongs to the
        # new strategy from then on (before: MixedStrategyError naming two identical reprs).
        with second.scope():
            model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
        assert model.distribute_strategy is second
        # 1.6 + 0.1 * 2 * (5 - 3.2) = 1.96 (one step: no second worker's update to race).
        np.testing.assert_allclose(model.get_weights(), [[1.96], [1.96]], rtol=1e-6)
        with second.scope():  # compiled again under the new scope: accepted too
            model.compile(optax.sgd(0.1), "mse")
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
        # 1.96 + 0.1 * 2 * (5 - 3.92) = 2.176.
        np.testing.assert_allclose(model.get_weights(), [[2.176], [2.176]], rtol=1e-6)

        # A dataset function that fails on both workers: its error is raised once, and Ray
        # prints no "Unhandled error" for the second worker's answer (it was never read).
        coordinator = mirrax.ClusterCoordinator(second)

        def broken():
            raise ValueError("no data here")

        with pytest.raises(ValueError, match="no data here"):
            coordinator.create_per_worker_dataset(broken)
        gc.collect()  # Ray reports an unread error when its reference is collected
        time.sleep(1.0)
        assert not [m for m in records.messages if m.startswith("Unhandled error")]
    finally:
        second.shutdown()
    assert _all_free()

    # The old strategy's model outside any scope: the error says to compile it under the new
    # strategy's scope (issue 27 item 8: the message says what differs and the fix).
    with pytest.raises(
        errors.MixedStrategyError,
        match=r"was shut down .* compile it under "
        r"the new strategy's scope",
    ):
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)


def test_a_new_local_cluster_prints_no_token_notice():
    # Ray prints its notice when it starts a local cluster with RAY_AUTH_MODE unset (the
    # module's cluster set it in this process), so a fresh process starts one.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    code = "import mirrax; r = mirrax.RayClusterResolver(1, 1); r.connect(); print('started'); r.shutdown()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "started" in done.stdout, done.stderr[-2000:]
    # Before: "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=...".
    # Ray's warning for a cluster without authentication is not filtered.
    assert "Token authentication is enabled" not in done.stderr + done.stdout
