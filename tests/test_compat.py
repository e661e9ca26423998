"""The private third-party APIs mirrax uses (all in mirrax/_src/distribute/_compat.py), pinned to
the versions it supports: jax 0.10 (here) and 0.11 (the GPU machine), flax 0.12. A new version
that moves one of them fails here, by name, instead of somewhere deep in a step."""

import pathlib
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn import normalization as flax_normalization

from mirrax._src.distribute import _compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUPPORTED_JAX = ("0.10.", "0.11.")
SUPPORTED_FLAX = ("0.12.",)


def test_the_installed_versions_are_the_supported_ones():
    assert jax.__version__.startswith(SUPPORTED_JAX), (
        f"jax {jax.__version__}: re-check every private use in _compat.py, then add it here"
    )
    assert flax.__version__.startswith(SUPPORTED_FLAX), (
        f"flax {flax.__version__}: re-check every private use in _compat.py, then add it here"
    )


def test_a_variable_keeps_its_value_and_metadata_in_the_slots_compat_reads():
    variable = nnx.Param(jnp.arange(3.0), note="x")
    assert _compat.HAS_RAW_VALUE_SLOT
    assert _compat.raw_value(variable) is variable.get_raw_value()
    metadata = _compat.metadata_dict(variable)
    assert type(metadata) is dict and metadata["note"] == "x"
    assert _compat.variable_metadata(variable) is metadata
    # In-place metadata changes land in that same dict (the runner's identity check relies on
    # either the dict or its values changing).
    variable.set_metadata("note", "y")
    assert _compat.metadata_dict(variable)["note"] == "y"


def test_set_raw_values_is_what_the_public_getter_then_reads():
    a, b = nnx.Param(jnp.zeros(2)), nnx.Param(jnp.zeros(3))
    new_a, new_b = jnp.ones(2), jnp.full(3, 2.0)
    _compat.set_raw_values([a, b], [new_a, new_b])
    assert a.get_value() is new_a and b.get_value() is new_b


def test_jax_distributed_state_has_the_fields_mirrax_reads():
    state = _compat.distributed_state()
    # A single process that never called jax.distributed.initialize: no client.
    assert state.client is None
    assert hasattr(state, "num_processes") and hasattr(state, "process_id")


def test_the_backends_started_probe_answers_without_starting_them():
    jax.devices()  # the suite's JAX is started by now in any case
    assert _compat.backends_started(default=False) is True


def test_flax_batch_norm_statistics_are_where_batch_stats_wraps_them():
    compute_stats = getattr(flax_normalization, _compat.FLAX_COMPUTE_STATS)
    x = jnp.array([[1.0], [3.0]])
    mean, var = compute_stats(x, (0,), None, None, None, True, True, None)
    # rows 1 and 3: mean (1 + 3) / 2 = 2, variance ((1 - 2)² + (3 - 2)²) / 2 = 1
    assert mean.tolist() == [2.0] and var.tolist() == [1.0]


def test_keras_batch_norm_moments_and_metric_directions_are_where_compat_reads_them():
    keras = pytest.importorskip("keras")
    assert callable(keras.layers.BatchNormalization.__dict__[_compat.KERAS_MOMENTS])
    assert _compat.keras_metric_direction(keras.metrics.Accuracy()) == "up"
    assert _compat.keras_metric_direction(keras.metrics.MeanSquaredError()) == "down"
    assert _compat.keras_metric_direction(object()) is None


def test_numpy_pickles_arrays_with_the_reconstructor_compat_names():
    constructor, arguments, _ = np.arange(3).__reduce__()
    assert constructor is _compat.numpy_reconstruct
    assert constructor(*arguments).shape == (0,)  # the state (values) comes after


@pytest.mark.subprocess
def test_an_exit_hook_runs_before_the_executors_shut_down():
    # With plain atexit, the hook would run after concurrent.futures' shutdown and its submit
    # would raise "cannot schedule new futures after interpreter shutdown".
    program = (
        "import concurrent.futures\n"
        "from mirrax._src.distribute import _compat\n"
        "pool = concurrent.futures.ThreadPoolExecutor(1)\n"
        "_compat.register_before_executor_shutdown(lambda: print(pool.submit(lambda: 6 * 7).result()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert (done.returncode, done.stdout) == (0, "42\n"), done.stderr
