"""A strategy's devices: parsing TF-style device strings, naming devices, and the replica mesh.

Two name formats, each with one home here: TF's full name for `strategy.extended.worker_devices`
('/job:localhost/replica:0/task:0/device:CPU:1', as TF reports it), and the short name
('cpu:1') used in every repr and message. Both count a device among its process's devices of
the same platform, as TF does, so 'gpu:1' means the same device in a name and in a
`MirroredStrategy(devices=["gpu:1"])` argument.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute.replica_context import REPLICA_AXIS

_DEVICE_PATTERN = re.compile(r"(?:.*/)?(?:device:)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$")


class ReplicaDevices:
    """The devices of a strategy's replicas (replica r on `devices[r]`) and the mesh over them.

    Attributes:
      devices: tuple of `jax.Device`, one per replica, over all processes.
      mesh: the one-axis `jax.sharding.Mesh` (`REPLICA_AXIS`) over `devices`.
      replicated: the `NamedSharding` that puts a value whole on every replica.
      stacked: the `NamedSharding` that puts row r of a (num_replicas, ...) array on replica r.
      local_replica_ids: the replica indices whose devices belong to this process, ascending.
      process_indices: the processes (workers) that hold the replicas' devices, ascending.
      spans_processes: whether the replicas involve a process other than this one (a
        multi-worker strategy). False for a strategy on this process's devices only, such as
        the default strategy or a `MirroredStrategy` in a multi-worker run: it runs on this
        worker alone, as TF's (no host exchange, no broadcast, its input read whole).
    """

    def __init__(self, devices):
        self.devices = tuple(devices)
        self.mesh = Mesh(np.array(self.devices, dtype=object), (REPLICA_AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        self.stacked = NamedSharding(self.mesh, P(REPLICA_AXIS))
        me = jax.process_index()
        self.local_replica_ids = tuple(i for i, d in enumerate(self.devices) if d.process_index == me)
        self.process_indices = tuple(sorted({d.process_index for d in self.devices}))
        self.spans_processes = self.process_indices != (me,)

    @property
    def local_devices(self) -> tuple:
        """This process's replica devices, in replica order."""
        return tuple(self.devices[r] for r in self.local_replica_ids)

    def __len__(self) -> int:
        return len(self.devices)


def resolve_device(device, argument: str = "devices") -> jax.Device:
    """A `jax.Device` of this process for a `jax.Device` or a TF-style device string.

    Accepted strings: "cpu:0", "gpu:1", "/gpu:1", "/device:GPU:1",
    "/job:localhost/replica:0/task:0/device:CPU:0"; the index counts this process's devices of
    that platform.

    Raises:
      InvalidDeviceError: the string is malformed or names no local device; the message lists
        the devices there are.
    """
    if isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        match = _DEVICE_PATTERN.match(device.strip())
        if match:
            kind, index = match["kind"].lower(), int(match["index"])
            try:
                local = list(jax.local_devices(backend=kind))
            except RuntimeError:
                local = []
            if index < len(local):
                return local[index]
    raise errors.InvalidDeviceError(
        f"{argument}: {device!r} names no device of this process. Use a jax.Device or a string "
        f"like 'cpu:0' or 'gpu:1'; this process has: {listing(jax.local_devices())}. (For more "
        "CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts.)"
    )


def local_index(device) -> int:
    """The index of `device` among its process's devices of the same platform."""
    same = [d for d in jax.devices(device.platform) if d.process_index == device.process_index]
    return same.index(device)


def tf_device_name(device, job: str = "localhost", task: int | None = None) -> str:
    """TF's full device name: '/job:localhost/replica:0/task:P/device:CPU:i'.

    `task` defaults to the device's process index.
    """
    task = device.process_index if task is None else task
    return f"/job:{job}/replica:0/task:{task}/device:{device.platform.upper()}:{local_index(device)}"


def short_name(device) -> str:
    """'cpu:3', 'gpu:0': platform and index among its process's devices of that platform."""
    return f"{device.platform}:{local_index(device)}"


def listing(devices, limit: int | None = 8) -> str:
    """Short names of `devices`, comma-separated: the first `limit` and '...' (None: all)."""
    devices = list(devices)
    shown = devices if limit is None else devices[:limit]
    return ", ".join(map(short_name, shown)) + (", ..." if len(shown) < len(devices) else "")
