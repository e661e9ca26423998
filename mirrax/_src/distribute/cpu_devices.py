"""The number of (fake) CPU devices JAX creates: set it before JAX starts, and notice when not.

JAX reads `XLA_FLAGS=--xla_force_host_platform_device_count=N` once, when it starts its
backends (at the first device query, not at import). A notebook user who edits `XLA_FLAGS`
after that is silently given the old count; `set_cpu_device_count` refuses instead, and a
`MirroredStrategy()` made while the environment asks for another count than JAX has warns.
"""

from __future__ import annotations

import os
import re
import warnings

import jax

from mirrax import errors
from mirrax._src.distribute import _compat

COUNT_FLAG = "--xla_force_host_platform_device_count"
_COUNT_PATTERN = re.compile(re.escape(COUNT_FLAG) + r"=(\S*)")
_warned: set = set()


def backends_started() -> bool:
    """Whether JAX has created its backends in this process (checked without starting them).

    Without the (private) query, JAX is assumed started once imported: the safe answer.
    """
    return _compat.backends_started(default=True)


def requested_cpu_device_count(flags: str | None = None) -> int | None:
    """The CPU device count `XLA_FLAGS` (or `flags`) asks for; None when it names none (or an
    unreadable one, which XLA itself rejects)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    found = _COUNT_PATTERN.findall(flags)
    if not found:
        return None
    try:
        return int(found[-1])
    except ValueError:
        return None


def with_cpu_device_count(flags: str, count: int) -> str:
    """`flags` with the device-count flag set to `count` (any earlier count removed)."""
    return " ".join(_COUNT_PATTERN.sub("", flags).split() + [f"{COUNT_FLAG}={count}"])


def set_cpu_device_count(count: int) -> None:
    """Makes JAX create `count` CPU devices, one replica each; call it before JAX starts.

    The notebook form of `XLA_FLAGS=--xla_force_host_platform_device_count=N` (and of the
    `mirrax` command's `--cpu-devices N`): it sets that flag in `os.environ["XLA_FLAGS"]`,
    keeping the other flags. JAX reads it at its first device query (`jax.devices()`, creating
    an array or a strategy), so call this first, e.g. in a notebook's first cell. Accelerators,
    when present, are used whatever `count` is.

    Args:
      count: the number of CPU devices, an int >= 1.

    Raises:
      InvalidArgumentTypeError: `count` is not an int.
      InvalidArgumentError: `count` < 1.
      StartedBackendError: JAX already started in this process with another number of CPU
        devices (restart the kernel or process, then call this first). Asking for the count
        JAX already has is accepted.
    """
    if isinstance(count, bool) or not isinstance(count, int):
        raise errors.InvalidArgumentTypeError(
            f"set_cpu_device_count: count must be an int >= 1 (the number of CPU devices); "
            f"received {count!r} of type {type(count).__name__}. Write e.g. "
            "mirrax.set_cpu_device_count(8)."
        )
    if count < 1:
        raise errors.InvalidArgumentError(
            f"set_cpu_device_count: count must be >= 1; received {count}. Pass the number of "
            "CPU devices (replicas) wanted, e.g. 8."
        )
    if backends_started():
        running = len(jax.devices("cpu"))
        if running == count:
            return
        raise errors.StartedBackendError(
            f"set_cpu_device_count({count}): JAX already started in this process with "
            f"{running} CPU device(s), and reads the count only when it starts. Restart the "
            "kernel (Jupyter: Kernel > Restart) or the process and call "
            f"mirrax.set_cpu_device_count({count}) before anything that uses devices (creating "
            "arrays, a strategy or a model)."
        )
    os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), count)


def warn_if_count_ignored(devices) -> None:
    """Warns (once per count) when `XLA_FLAGS` asks for another CPU device count than JAX has.

    Called by `MirroredStrategy()` when it chooses the devices itself and they are CPUs: the
    usual cause is `XLA_FLAGS` edited after JAX started, which JAX ignores silently.
    """
    if not devices or devices[0].platform != "cpu":
        return
    requested = requested_cpu_device_count()
    if requested is None:
        return
    running = len(jax.devices("cpu"))
    if requested == running or (requested, running) in _warned:
        return
    _warned.add((requested, running))
    warnings.warn(
        f"XLA_FLAGS asks for {requested} CPU devices ({COUNT_FLAG}={requested}) but JAX "
        f"started with {running}, so this strategy has {len(devices)} replica(s): JAX reads "
        "XLA_FLAGS once, when it starts, and ignores later changes. Restart the kernel (or "
        f"process) and call mirrax.set_cpu_device_count({requested}) (or set XLA_FLAGS) before "
        "anything that uses devices.",
        RuntimeWarning,
        stacklevel=3,
    )
