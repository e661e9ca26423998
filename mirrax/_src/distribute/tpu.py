"""`TPUStrategy`: mirrored data parallelism over every TPU core JAX sees."""

from __future__ import annotations

import jax

from mirrax import errors
from mirrax._src.distribute.strategy import Strategy


class TPUStrategy(Strategy):
    """Synchronous data parallelism over TPU devices, as `tf.distribute.TPUStrategy`.

    On a TPU VM or slice JAX already knows the topology, so no resolver is needed: the mesh
    spans every TPU device JAX reports (`jax.devices("tpu")`, all hosts of a slice once
    `jax.distributed` is initialized).

    Args:
      tpu_cluster_resolver: accepted for compatibility with TF programs; ignored.

    Raises:
      InvalidDeviceError: JAX sees no TPU devices (the message names the backend it found).
    """

    def __init__(self, tpu_cluster_resolver=None):
        try:
            devices = jax.devices("tpu")
        except RuntimeError:
            devices = []
        if not devices:
            raise errors.InvalidDeviceError(
                f"TPUStrategy: JAX finds no TPU devices (its default backend is "
                f"{jax.default_backend()!r} with {jax.device_count()} device(s)). Run on a TPU "
                "VM with jax[tpu] installed, or use mirrax.MirroredStrategy() for GPUs and CPUs."
            )
        self.tpu_cluster_resolver = tpu_cluster_resolver
        super().__init__(devices)
