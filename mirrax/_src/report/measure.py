"""What the scaling report measures on this machine: the one-device step time (warm, median of
several timed windows, with the CPU cores it keeps busy) and, for the "local" link, the
all-reduce of this process's own devices fitted to the ring formula at each replica count."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrax._src.report import links
from mirrax._src.report import subject as subject_lib

# A timed window lasts about this long, so timer resolution and per-window noise stay small.
WINDOW_S = 0.1
MAX_STEPS_PER_WINDOW = 200
_SMALL_BYTES = 4096  # the latency point of a link's calibration
# XLA:CPU deadlocks with about 100 multi-device programs queued (its all-reduce is a
# rendezvous of host threads), so the calibration waits for every 4th.
_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The one-device step, measured.

    Attributes:
      ms: median milliseconds per step over the windows (warm: after compilation and 2 steps).
      windows_ms: each window's milliseconds per step.
      steps_per_window: steps in each window.
      cores_busy: median CPU time of all the process's threads / wall time over a window: the
        CPU cores the step keeps busy (XLA:CPU runs large operations on several threads).
      compile_s: seconds of the first step (tracing and compilation included).
      device: the device kind it ran on (e.g. "cpu", "NVIDIA H200").
    """

    ms: float
    windows_ms: tuple
    steps_per_window: int
    cores_busy: float
    compile_s: float
    device: str


def time_one_device(subject, strategy, windows: int) -> StepTime:
    """Runs the step on `strategy` (one replica), on copies of its objects (the caller's are
    not touched), and times `windows` windows of steps."""
    device = strategy.extended.replica_devices.devices[0]
    objects = subject.copy_objects(device)
    nodes = subject_lib.graph_nodes(objects)
    batch = subject_lib.distribute(strategy, subject.batch, 1)

    def steps(count: int) -> None:
        out = None
        for _ in range(count):
            out = strategy.run(subject.fn, args=objects + (batch,), kwargs=subject.kwargs)
        jax.block_until_ready((out, jax.tree.leaves(nnx.state(nodes))))

    start = time.perf_counter()
    steps(1)
    compile_s = time.perf_counter() - start
    steps(2)
    start = time.perf_counter()
    steps(1)
    once = max(time.perf_counter() - start, 1e-6)
    per_window = int(min(MAX_STEPS_PER_WINDOW, max(1, math.ceil(WINDOW_S / once))))
    wall, busy = [], []
    for _ in range(windows):
        cpu, start = time.process_time(), time.perf_counter()
        steps(per_window)
        seconds = time.perf_counter() - start
        wall.append(seconds / per_window * 1e3)
        busy.append((time.process_time() - cpu) / seconds)
    return StepTime(
        ms=statistics.median(wall),
        windows_ms=tuple(wall),
        steps_per_window=per_window,
        cores_busy=statistics.median(busy),
        compile_s=compile_s,
        device=device.device_kind,
    )


def local_link(devices, counts, payload_bytes: int, windows: int = 5) -> links.LinkModel:
    """The "local" link: an all-reduce of `payload_bytes` (at least 1 MiB) and one of 4 KiB
    timed over the first n of `devices` for each n in `counts` (each >= 2), fitted to the
    ring formula t = 2(n-1) latency + 2(n-1)/n bytes / bandwidth."""
    large = max(int(payload_bytes), 1 << 20)
    fits = []
    for n in counts:
        small_s, large_s = (_all_reduce_seconds(devices[:n], size, windows) for size in (_SMALL_BYTES, large))
        wire = 2 * (n - 1) / n
        # A large all-reduce that timed no slower than the small one (noise) leaves only the
        # large one's time to attribute to bandwidth.
        span = large_s - small_s if large_s > small_s else large_s
        bandwidth = wire * (large - _SMALL_BYTES) / span / 1e9
        latency = max(0.0, small_s - wire * _SMALL_BYTES / (bandwidth * 1e9)) / (2 * (n - 1))
        fits.append((n, bandwidth, latency * 1e6))
    kind = devices[0].device_kind
    return links.LinkModel(
        links.LOCAL,
        fits[-1][1],
        fits[-1][2],
        0.0,
        f"measured on this process's {len(devices)} {kind} device(s): an all-reduce of "
        f"{_SMALL_BYTES} B and of {large:,} B at each replica count, fitted to the ring "
        "formula",
        calibrated=tuple(fits),
    )


def _all_reduce_seconds(devices, nbytes: int, windows: int) -> float:
    """Median seconds of one float32 all-reduce of `nbytes` per device over `devices`."""
    mesh = Mesh(np.array(devices), ("replica",))
    program = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "replica"), mesh=mesh, in_specs=P("replica"), out_specs=P())
    )
    x = jax.device_put(
        np.ones((len(devices) * max(1, nbytes // 4),), np.float32), NamedSharding(mesh, P("replica"))
    )
    jax.block_until_ready(program(x))
    start = time.perf_counter()
    jax.block_until_ready(program(x))
    calls = int(
        min(MAX_STEPS_PER_WINDOW, max(1, math.ceil(WINDOW_S / max(time.perf_counter() - start, 1e-6))))
    )
    samples = []
    for _ in range(windows):
        start = time.perf_counter()
        for call in range(calls):
            out = program(x)
            if call % _IN_FLIGHT == _IN_FLIGHT - 1:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)
