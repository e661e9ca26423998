"""Test set-up: 8 fake CPU devices (before JAX starts) and the named strategies of the suite.

Strategies are named by what they are, as tf.distribute's strategy_combinations
(`Mirrored2CPU` = MirroredStrategy over 2 CPU devices). The `strategy` fixture runs a test once
per strategy: one conformance suite that every strategy must pass. Expectations are written in
terms of `strategy.num_replicas_in_sync`, never a hard-coded count.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # read when Keras is first imported

import jax  # noqa: E402
import pytest  # noqa: E402

import mirrax  # noqa: E402

# Strict dtype promotion (equinox's habit) is left off: flax.nnx.metrics itself divides
# float32 totals by int32 counts, which strict mode refuses.
jax.config.update("jax_numpy_rank_promotion", "raise")

_FACTORIES = {
    "OneDevice": lambda: mirrax.OneDeviceStrategy("cpu:0"),
    "Mirrored1CPU": lambda: mirrax.MirroredStrategy(["cpu:0"]),
    "Mirrored2CPU": lambda: mirrax.MirroredStrategy(["cpu:0", "cpu:1"]),
    "Mirrored4CPU": lambda: mirrax.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "Mirrored8CPU": lambda: mirrax.MirroredStrategy(),
}
# The named strategies the `strategy` fixture runs a test under (tf.distribute's combinations).
STRATEGY_NAMES = tuple(_FACTORIES)
_made: dict = {}


def named_strategy(name: str) -> mirrax.Strategy:
    """The session's strategy of that name (shared, so compiled programs are reused)."""
    if name not in _made:
        _made[name] = _FACTORIES[name]()
    return _made[name]


def mirrored(replicas: int) -> mirrax.Strategy:
    """The shared MirroredStrategy over the first `replicas` CPU devices."""
    return named_strategy("OneDevice" if replicas == 0 else f"Mirrored{replicas}CPU")


@pytest.fixture(params=STRATEGY_NAMES)
def strategy(request) -> mirrax.Strategy:
    return named_strategy(request.param)


@pytest.fixture(params=["Mirrored2CPU", "Mirrored4CPU", "Mirrored8CPU"])
def multi_strategy(request) -> mirrax.Strategy:
    """Only strategies with more than one replica (for cross-replica behaviour)."""
    return named_strategy(request.param)
