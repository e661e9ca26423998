"""`mirrax devices`: the devices of this process, printed as TensorFlow prints them."""

from __future__ import annotations

import jax


def physical_device_lines() -> list[str]:
    """One line per device of this process, as `print(*tf.config.list_physical_devices())`.

    CPU devices first, then the accelerators of JAX's default backend (GPU, TPU), each numbered
    within its type: `PhysicalDevice(name='/physical_device:CPU:0', device_type='CPU')`. Unlike
    TensorFlow, which shows one physical CPU, every CPU device JAX made (set by
    `--cpu-devices` / `XLA_FLAGS=--xla_force_host_platform_device_count=N`) is listed, since
    each one can hold a replica.

    Returns:
      A list of str, one per device.
    """
    devices = list(jax.local_devices(backend="cpu"))
    if jax.default_backend() != "cpu":
        devices += jax.local_devices()
    lines: list[str] = []
    counts: dict[str, int] = {}
    for device in devices:
        kind = device.platform.upper()
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        name = f"/physical_device:{kind}:{index}"
        lines.append(f"PhysicalDevice(name='{name}', device_type='{kind}')")
    return lines
