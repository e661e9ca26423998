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

# A persistent XLA compilation cache shared by the suite's processes and every process they
# start (multi-worker runs, launch, examples, the notebook, Ray workers inherit the variables):
# they compile the same programs again and again. Under the checkout, so `make clean` removes
# it; MIRRAX_TEST_XLA_CACHE=0 turns it off (BENCHMARKS.md, The test suite's time).
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "xla")
if os.environ.get("MIRRAX_TEST_XLA_CACHE", "1") != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
    # JAX caches only programs that took >= 1 s to compile by default; the suite's are small.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


_TIER_MARKERS = ("subprocess", "cluster", "notebook")  # the ones that start processes


@pytest.fixture(autouse=True, scope="session")
def _quick_tier_starts_no_process():
    """Under `make test-quick` (MIRRAX_TEST_QUICK=1) starting a process fails the test, so a
    test that starts one cannot sit in the quick tier unmarked: the marker is not a promise."""
    if os.environ.get("MIRRAX_TEST_QUICK") != "1":
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "the quick tier (make test-quick) starts no process, but this test started one: "
            f"mark it with one of {', '.join('@pytest.mark.' + m for m in _TIER_MARKERS)} "
            "(pyproject.toml lists them), so the quick tier deselects it"
        )

    patch = pytest.MonkeyPatch()
    patch.setattr(subprocess.Popen, "__init__", refuse)
    patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
    patch.undo()


def pytest_collection_modifyitems(config, items):
    """The modules that start processes run first, then those with slow tests (a stable sort, so
    each module's tests stay together and its module-scoped fixtures are built once a process):
    under `--dist loadgroup` the two xdist processes then end on short tests, not one of them on
    a long multi-worker run while the other waits."""

    def modules_with(markers):
        return {item.module.__name__ for item in items if any(item.get_closest_marker(m) for m in markers)}

    processes, slow = modules_with(_TIER_MARKERS), modules_with(("slow",))
    items.sort(key=lambda item: (item.module.__name__ not in processes, item.module.__name__ not in slow))
