"""Shims over JAX and flax APIs that differ between the versions mirrax supports (jax 0.10 and
0.11, flax 0.12), and every use of a private third-party API (JAX, flax, Keras, NumPy, CPython),
each pinned by tests/test_compat.py; tests/test_layout.py refuses private uses anywhere else.

The private uses: flax's Variable slots (`_raw_value`, `_var_metadata`: the step's fast write-back
and identity checks) and its setter's `_unsafe_bypass_check`; jax's
`jax._src.distributed.global_state` (the coordination client, for the processes' exchanges, and
the layout jax.distributed was initialized with) and `jax._src.xla_bridge.backends_are_initialized`
(whether JAX started its backends, asked without starting them); the BatchNorm internals that
batch_stats.py wraps while a step is traced, flax's `normalization._compute_stats` and Keras 3's
`BatchNormalization._moments`; a Keras 3 metric's `_direction` (which way it improves, for
`mode="auto"`); NumPy's `numpy._core.multiarray._reconstruct` (the array constructor pickles
name, for the CIFAR-10 reader); and CPython's `threading._register_atexit` (exit hooks that run
before concurrent.futures shuts its executors down).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import operator
import sys
import threading

import jax
from flax import nnx
from jax._src import distributed as _distributed  # private: the public API exposes no client

try:  # NumPy >= 2 keeps the implementation in numpy._core; numpy.core is a deprecated alias.
    from numpy._core import multiarray as _multiarray
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core import multiarray as _multiarray


def varying_axes(x) -> frozenset:
    """The manual mesh axes along which `x` varies inside `shard_map` (its vma type)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def pvary(x, axis_name: str):
    """Marks an unvarying value as varying along `axis_name` (no data movement)."""
    if axis_name in varying_axes(x):
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    return jax.lax.pvary(x, axis_name)


def all_gather_invariant(x, axis_name: str, axis: int = 0):
    """`all_gather(x, axis_name, axis=axis, tiled=True)` typed as unvarying along `axis_name`.

    Every replica receives the same concatenation, so the result is replicated; JAX types a
    plain all-gather as varying, which `shard_map` would refuse to return as replicated.
    """
    for to in ("invarying", "invariant"):  # jax 0.10's spelling, then a later one's
        try:
            return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to=to)
        except (TypeError, ValueError, AssertionError):
            continue
    return jax.lax.all_gather_invariant(x, axis_name, axis=axis, tiled=True)


# -- flax's Variable internals -------------------------------------------------------------------
# `strategy.run` writes a step's new values straight into the caller's Variables and checks their
# metadata by identity; both live in slots of nnx.Variable (flax 0.12). Pinned by
# tests/test_compat.py; where a flax version lays Variables out differently, the public
# (slower) paths are used.

RAW_VALUE_SLOT = "_raw_value"
_METADATA_SLOT = "_var_metadata"
HAS_RAW_VALUE_SLOT = RAW_VALUE_SLOT in getattr(nnx.Variable, "__slots__", ())
_HAS_METADATA_SLOT = _METADATA_SLOT in getattr(nnx.Variable, "__slots__", ())


# C-level reader of the metadata slot, for the per-step identity checks (run/nodes.py).
metadata_dict = operator.attrgetter(_METADATA_SLOT)


def variable_metadata(variable):
    """The dict holding `variable`'s metadata (the object itself, for identity checks), or None
    where this flax keeps it elsewhere."""
    if not _HAS_METADATA_SLOT:
        return None
    metadata = getattr(variable, _METADATA_SLOT, None)
    return metadata if type(metadata) is dict else None


raw_value = (
    operator.attrgetter(RAW_VALUE_SLOT) if HAS_RAW_VALUE_SLOT else (lambda variable: variable.get_raw_value())
)


def set_raw_values(variables, values) -> None:
    """`variable.set_raw_value(value)` for each pair, outside any JAX trace (the caller checked
    that the values are concrete arrays, so no trace is open).

    NNX's setter runs its trace check on every set, even when told to bypass it (about 1.2 µs
    per Variable; 2-3 µs for the first): where the value lives in the slot, the slot is written
    directly.
    """
    if not variables:
        return
    if HAS_RAW_VALUE_SLOT and not getattr(variables[0], "hijax", False):
        collections.deque(
            map(object.__setattr__, variables, itertools.repeat(RAW_VALUE_SLOT), values), maxlen=0
        )
    else:
        for variable, value in zip(variables, values):
            variable.set_raw_value(value, _unsafe_bypass_check=True)


# -- jax's private process state ------------------------------------------------------------------


def distributed_state():
    """jax.distributed's global state (`.client`, `.num_processes`, `.process_id`)."""
    return _distributed.global_state


def backends_started(default: bool = True) -> bool:
    """Whether JAX has created its backends in this process, checked without starting them.

    `default` is the answer where this JAX version has no such query.
    """
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is None:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else default


# -- BatchNorm internals (batch_stats.py wraps them while a replica function is traced) ----------

# The name of flax's BatchNorm statistics function in `flax.nnx.nn.normalization`.
FLAX_COMPUTE_STATS = "_compute_stats"
# The name of Keras 3's BatchNormalization method computing the batch's mean and variance.
KERAS_MOMENTS = "_moments"


def keras_metric_direction(metric) -> str | None:
    """`"up"` or `"down"`, the way a Keras 3 metric declares it improves; None when it does not."""
    return getattr(metric, "_direction", None)


# -- NumPy's and CPython's private hooks ----------------------------------------------------------

# `numpy.core.multiarray._reconstruct`: the constructor a pickled ndarray names.
numpy_reconstruct = _multiarray._reconstruct


def register_before_executor_shutdown(function) -> None:
    """Runs `function` at interpreter exit before concurrent.futures shuts its executors down
    (threading's hooks run newest first); with plain `atexit` where this Python has no such
    hook."""
    register = getattr(threading, "_register_atexit", atexit.register)
    register(function)
