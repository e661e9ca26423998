"""Single-host strategies: `MirroredStrategy`, `OneDeviceStrategy`, and the `CrossDeviceOps` family.

Device names follow TF: a `jax.Device`, or a string "cpu:0", "gpu:1", "/gpu:1",
"/device:GPU:1" or "/job:localhost/replica:0/task:0/device:CPU:0". The index counts this
process's devices of that platform.
"""

from __future__ import annotations

import jax

from mirrax import errors
from mirrax._src.distribute import cpu_devices
from mirrax._src.distribute.devices import resolve_device, short_name
from mirrax._src.distribute.strategy import Strategy


class CrossDeviceOps:
    """Base of the all-reduce implementations `MirroredStrategy` accepts, as TF's class.

    In mirrax every one of them lowers to the same thing: the gradient sum is an XLA
    `all-reduce` inside the step's compiled program, which XLA implements with the platform's
    collective library (NCCL on GPU, the ICI on TPU, in-process copies on CPU) and combines
    into as few collectives as it can. The classes exist so TF programs run unchanged; the
    choice does not change the numbers.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_num_packs(owner: str, num_packs) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 0:
        raise errors.InvalidArgumentError(
            f"{owner}: num_packs must be an int >= 0 (as TF: 0 = no packing); received "
            f"{num_packs!r}. mirrax ignores it (XLA packs the all-reduces): leave it out."
        )
    return num_packs


class NcclAllReduce(CrossDeviceOps):
    """TF's NCCL all-reduce: here XLA's all-reduce, which uses NCCL on GPU (the default).

    Args:
      num_packs: accepted for compatibility; XLA's all-reduce combiner decides the packing.
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _check_num_packs(type(self).__name__, num_packs)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """TF's hierarchical copy (for DGX-1 topologies): here the same XLA all-reduce.

    Args:
      num_packs: accepted for compatibility; XLA's all-reduce combiner decides the packing.
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _check_num_packs(type(self).__name__, num_packs)


class ReductionToOneDevice(CrossDeviceOps):
    """TF's reduce-on-one-device-then-broadcast: here the same XLA all-reduce (same result).

    Args:
      reduce_to_device: accepted for compatibility; ignored.
      accumulation_fn: accepted for compatibility; only summation is supported.
    """

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn


class MirroredStrategy(Strategy):
    """Synchronous data parallelism on one host, as `tf.distribute.MirroredStrategy`.

    One replica per device; variables are mirrored (identical on every device); gradients are
    all-reduced inside the compiled step.

    Args:
      devices: None for every local accelerator (GPUs/TPUs), else every local CPU device; or a
        list of `jax.Device`s / strings like "gpu:0", "/device:CPU:1".
      cross_device_ops: None or a `CrossDeviceOps` (`NcclAllReduce`, `HierarchicalCopyAllReduce`,
        `ReductionToOneDevice`); all map to XLA's all-reduce.
      replica_invariant: True for results that are the same bits on every replica count that
        divides `micro_batches` (docs/design.md, "Replica invariance"; mirrax's own, not TF's).
        Each global batch is cut into `micro_batches` equal micro-batches, each computed as
        one virtual replica; its size must be a multiple of `micro_batches`. Default False:
        exact to float rounding per step, and the fastest.
      micro_batches: a power of two (default 8), the virtual replica count of
        replica-invariant mode; ignored (but checked) when `replica_invariant` is False.
      shard_optimizer_state: True to split every optimizer state array over the replicas
        (ZeRO-1; mirrax's own, not TF's): each device keeps 1/R of Adam's moments, gradients
        are reduce-scattered and the new parameters all-gathered, with the numbers of the
        unsharded step (docs/design.md, "Sharded optimizer state"). Inside `run`,
        `optimizer.update` then takes effect when the function returns (and returns None),
        once per optimizer per step; changing the parameters after it in the step is
        refused. No effect with one replica. Default False.

    Raises:
      InvalidDeviceError: `devices` is empty, names an unknown device, or repeats one.
      TypeError: `cross_device_ops` is not a `CrossDeviceOps`; `replica_invariant` or
        `shard_optimizer_state` not a bool;
        `micro_batches` not an int.
      InvalidArgumentError: `micro_batches` is not a power of two, or (replica_invariant=True)
        the replica count does not divide it.
    """

    def __init__(
        self,
        devices=None,
        cross_device_ops=None,
        replica_invariant: bool = False,
        micro_batches: int = 8,
        shard_optimizer_state: bool = False,
    ):
        if devices is None:
            resolved = list(jax.local_devices())
            cpu_devices.warn_if_count_ignored(resolved)
        else:
            if isinstance(devices, (str, jax.Device)):
                devices = [devices]
            if not isinstance(devices, (list, tuple)):
                raise errors.InvalidArgumentTypeError(
                    "MirroredStrategy: devices must be None (every local device) or a list of "
                    f"devices such as ['cpu:0', 'cpu:1']; received {devices!r} of type "
                    f"{type(devices).__name__}. For the first N devices write "
                    "devices=jax.local_devices()[:N]."
                )
            resolved = [resolve_device(d) for d in devices]
            if not resolved:
                raise errors.InvalidDeviceError(
                    "MirroredStrategy: devices=[] gives no replicas. Pass None for every local "
                    "device, or a non-empty list such as ['cpu:0', 'cpu:1']."
                )
            if len(set(resolved)) != len(resolved):
                names = [short_name(d) for d in resolved]
                raise errors.InvalidDeviceError(
                    f"MirroredStrategy: devices lists a device more than once ({names}); each "
                    "device holds one replica. Remove the duplicates."
                )
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise errors.InvalidArgumentTypeError(
                "MirroredStrategy: cross_device_ops must be a mirrax.CrossDeviceOps such as "
                f"mirrax.NcclAllReduce(); received {type(cross_device_ops).__name__}."
            )
        self.cross_device_ops = cross_device_ops or NcclAllReduce()
        super().__init__(resolved, replica_invariant, micro_batches, shard_optimizer_state)


class OneDeviceStrategy(Strategy):
    """One replica on one device, as `tf.distribute.OneDeviceStrategy`.

    Args:
      device: a `jax.Device` or a string like "gpu:0" / "/cpu:0".
      replica_invariant, micro_batches: as `MirroredStrategy` (so one device reproduces the
        bits of 2, 4 or 8).

    Raises:
      InvalidDeviceError: `device` names no local device.
      TypeError: `replica_invariant` is not a bool or `micro_batches` not an int.
      InvalidArgumentError: `micro_batches` is not a power of two.
    """

    def __init__(self, device, replica_invariant: bool = False, micro_batches: int = 8):
        if isinstance(device, (list, tuple)):
            raise errors.InvalidArgumentTypeError(
                f"OneDeviceStrategy: device must be ONE device (a jax.Device or a string like "
                f"'cpu:0'); received a {type(device).__name__} {device!r}. For several devices "
                "use mirrax.MirroredStrategy(devices)."
            )
        super().__init__([resolve_device(device, "device")], replica_invariant, micro_batches)
