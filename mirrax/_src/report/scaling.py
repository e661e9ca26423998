"""`mirrax.experimental.scaling_report`: what a training step will cost on 1, 2, 4 ... N replicas
(collectives and their bytes, per-device memory, predicted step time and speedup on a link),
read from the step's compiled programs and one measured one-device step, before paying for
the devices. The model and its assumptions: docs/report.md."""

from __future__ import annotations

import os

import jax

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.report import links, measure, programs
from mirrax._src.report import subject as subject_lib
from mirrax._src.report.report import Memory, ScalingReport, ScalingRow
from mirrax._src.training.model import Model

WHAT = subject_lib.WHAT


def scaling_report(
    step_or_model,
    batch,
    args=(),
    kwargs=None,
    *,
    max_replicas: int = 8,
    link=None,
    bandwidth_gbps=None,
    latency_us=None,
    overlap: float = 0.0,
    shard_optimizer_state: bool = False,
    shared_cores="auto",
    timing_windows: int = 5,
    devices=None,
) -> ScalingReport:
    """What training this step on 1, 2, 4 ... `max_replicas` replicas will cost (weak scaling).

    For each replica count N (powers of two) the step is lowered with
    `strategy.experimental_lower` on a `MirroredStrategy` over N local devices and compiled
    (never run), with and without `shard_optimizer_state`; its collectives and their bytes
    are read from the optimized HLO and its per-device memory from
    `compiled.memory_analysis()`. N beyond this process's devices is extrapolated from the
    largest program compiled (marked in the table). The step is timed once on one device
    (warm, median of `timing_windows` windows), and each N's step time is predicted as that
    time plus the collectives' cost on `link` (a ring model), less the `overlap` hidden
    behind compute. Nothing of the caller's changes: the report runs copies of the objects.

    Args:
      step_or_model: a compiled `mirrax.Model` (its training step, as `fit` runs it), or a
        per-replica step function for `strategy.run`, called as
        `strategy.run(step, args=(*args, batch), kwargs=kwargs)`: the batch comes last, as in
        `strategy.run(train_step, args=(model, optimizer, batch))`.
      batch: ONE PER-REPLICA batch (not a global one): a pytree of arrays (NumPy or JAX) whose
        leaves share their first dimension, the per-replica batch size B, e.g. (images of
        shape (B, 8, 8, 1) float32, labels (B,) int32); for a `mirrax.Model`, (x, y) or
        (x, y, sample_weight). N replicas get N copies of it (global batch N x B), the field's
        default for scaling (weak scaling). Only shapes and dtypes matter to the report.
      args: with a step function, its arguments before the batch (NNX modules, optimizers,
        metrics, arrays); must be () with a Model.
      kwargs: with a step function, its keyword arguments, or None.
      max_replicas: the largest replica count, a power of two >= 1 (rows 1, 2, 4 ... it).
      link: a preset, "nvlink" (450 GB/s), "pcie" (31.5 GB/s, PCIe 4.0 x16), "ethernet-100g"
        (12.5 GB/s), or "local" (this process's own devices, measured now), or a
        `mirrax.experimental.LinkModel`; None: "nvlink", or the user link of
        `bandwidth_gbps` / `latency_us` when those are given. Numbers and sources:
        `mirrax.experimental.LINK_PRESETS`, docs/report.md.
      bandwidth_gbps: a user link's bandwidth, GB/s (1e9 bytes/s) each device sends in one
        direction, > 0; with a preset `link`, replaces its bandwidth.
      latency_us: a user link's latency per ring step, microseconds, >= 0 (default 0); with a
        preset `link`, replaces its latency.
      overlap: the share of communication hidden behind compute, in [0, 1]; 0 (default): the
        collectives run after the backward pass, as XLA:CPU runs them.
      shard_optimizer_state: predict the step of `MirroredStrategy(..., shard_optimizer_state=
        True)` (its collectives and time); memory is given for both either way.
      shared_cores: the number of CPU cores the replicas share (fake CPU devices are threads
        of one process), which adds the compute term max(T1, N x T1 x cores_busy / cores);
        None: every replica has its own device; "auto" (default): this process's cores with
        link "local" on CPU devices, else None.
      timing_windows: timed windows of the one-device step, an int >= 1.
      devices: the devices programs are compiled for (the first times the step), a list of
        `jax.Device`s of this process; None: all of `jax.local_devices()`.

    Returns:
      A `ScalingReport`: `.rows` (one `ScalingRow` per N: collectives, bytes, memory in
      bytes, times in milliseconds, speedup), `str()` the table with its assumptions,
      `.to_dict()` / `.to_json()`, `.plot(path)`.

    Raises:
      NotCompiledError: a `mirrax.Model` that is not compiled.
      InvalidArgumentTypeError: `step_or_model` neither a Model nor callable, or a bare
        `nnx.Module` / Keras model (wrap it in a compiled `mirrax.Model`); `args` not a
        tuple; a number of the wrong type.
      InvalidArgumentError: `max_replicas` not a power of two >= 1; an unknown link; a
        bandwidth <= 0 or a negative latency; `overlap` outside [0, 1]; `args` with a Model;
        link "local" with fewer than 2 devices; `devices` not this process's devices.
      InvalidBatchError: `batch` holds no arrays, or arrays with different first dimensions.
      IncompatibleInputError: the step fails on `batch` (e.g. 9 features for a layer of 8);
        the step's own error is chained.
      UnsupportedArgumentError: `shard_optimizer_state=True` for a step that cannot run with
        sharded optimizer state (the message says why); called in a multi-process job.
    """
    max_replicas = _check_power_of_two(max_replicas)
    timing_windows = argument_checks.count(WHAT, "timing_windows", timing_windows)
    overlap = _check_overlap(overlap)
    if not isinstance(shard_optimizer_state, bool):
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: shard_optimizer_state must be True or False; received {shard_optimizer_state!r}."
        )
    resolved = links.resolve(link, bandwidth_gbps, latency_us, WHAT)
    devices = _check_devices(devices)
    if resolved == links.LOCAL and len(devices) < 2:
        raise errors.InvalidArgumentError(
            f"{WHAT}: link 'local' measures an all-reduce between this process's devices, and "
            f"it has {len(devices)} ({devices[0].device_kind}). Give a preset link or "
            "bandwidth_gbps=, or more CPU devices (XLA_FLAGS=--xla_force_host_platform_"
            "device_count=8, or mirrax report --cpu-devices 8)."
        )
    cores = _check_cores(shared_cores, resolved, devices)
    if jax.process_count() > 1:
        raise errors.UnsupportedArgumentError(
            f"{WHAT}: this process is one of {jax.process_count()} of a multi-worker job; the "
            "report compiles and times the step on this process's own devices, alone. Run it "
            "in a single process (without TF_CONFIG), e.g. `mirrax report` or a script."
        )
    if isinstance(step_or_model, Model):
        if args not in ((), None) or kwargs:
            raise errors.InvalidArgumentError(
                f"{WHAT}: args and kwargs belong to a step function; a mirrax.Model brings its "
                f"own (received args={args!r}, kwargs={kwargs!r}). Drop them, or pass the step "
                "function instead of the Model."
            )
        subject = subject_lib.from_model(step_or_model, batch)
    else:
        subject = subject_lib.from_step(step_or_model, batch, args, kwargs)

    counts = [2**i for i in range(max_replicas.bit_length())]
    compiled_counts = [n for n in counts if n <= len(devices)]
    one_device = programs.strategy_for(devices[:1], False)
    first = programs.compile_program(subject, one_device, read_only=False)
    variants: dict = {}
    notes: list[str] = []
    for sharded in (False, True):
        variants[sharded] = _programs(
            subject, devices, counts, compiled_counts, first, sharded, sharded == shard_optimizer_state, notes
        )
    if resolved == links.LOCAL:
        largest = max(compiled_counts)
        biggest = max(
            (p for _, p, _ in variants[shard_optimizer_state][largest].collectives),
            default=subject.params_bytes,
        )
        resolved = measure.local_link(devices, [n for n in compiled_counts if n > 1] or [2], biggest)
    # On the one-device strategy just compiled for: its program is reused, not compiled again.
    timed = measure.time_one_device(subject, one_device, timing_windows)
    rows = tuple(
        _row(subject, variants, n, shard_optimizer_state, resolved, timed, overlap, cores) for n in counts
    )
    return ScalingReport(
        step=subject.label,
        per_replica_batch=subject.per_replica_batch,
        parameters=subject.parameters,
        gradient_bytes=subject.params_bytes,
        one_device_ms=timed.ms,
        one_device_windows_ms=timed.windows_ms,
        cores_busy=timed.cores_busy,
        device=timed.device,
        local_devices=len(devices),
        link=resolved,
        overlap=overlap,
        shared_cores=cores,
        shard_optimizer_state=shard_optimizer_state,
        rows=rows,
        assumptions=tuple(
            _assumptions(subject, timed, resolved, overlap, cores, len(devices), compiled_counts, counts)
            + notes
        ),
    )


def _programs(
    subject, devices, counts, compiled_counts, first, sharded: bool, required: bool, notes: list
) -> dict:
    """{N: Program} for every count: compiled where there are devices (`first` is the one-
    replica program, which sharding does not change), else carried over; {} when the step
    cannot run sharded and only its memory columns asked for it (`required` False: the
    reason goes to `notes`)."""
    found = {1: first}
    for n in compiled_counts[1:]:
        try:
            found[n] = programs.compile_program(subject, programs.strategy_for(devices[:n], sharded))
        except errors.UnsupportedArgumentError as error:
            if required:
                raise
            notes.append(
                f"shard_optimizer_state=True does not apply to this step, so its columns are n/a: {error}"
            )
            return {}
    largest = max(compiled_counts)
    base = found[largest] if largest > 1 else programs.assumed(found[1], subject, sharded)
    for n in counts:
        if n not in found:
            found[n] = programs.extrapolate(base, subject, n)
    return found


def _row(subject, variants, replicas, sharded, link, timed, overlap, cores) -> ScalingRow:
    program = variants[sharded][replicas]
    one_device_s = timed.ms / 1e3
    communication_s = sum(
        link.seconds(kind, payload, replicas, operands) for kind, payload, operands in program.collectives
    )
    compute_s = (
        one_device_s
        if cores is None
        else links.shared_compute_seconds(one_device_s, timed.cores_busy, replicas, cores)
    )
    step_s = links.step_seconds(compute_s, communication_s, overlap)
    speedup = replicas * one_device_s / step_s
    payload = sum(p for _, p, _ in program.collectives)
    return ScalingRow(
        replicas=replicas,
        global_batch=replicas * subject.per_replica_batch,
        source=program.source,
        collectives=program.counts(),
        payload_bytes=payload,
        gradient_bytes=subject.params_bytes,
        sent_bytes=sum(links.sent_bytes(kind, p, replicas) for kind, p, _ in program.collectives),
        minimum_sent_bytes=links.sent_bytes("all-reduce", subject.params_bytes, replicas),
        memory={
            "unsharded": _memory(subject, variants[False].get(replicas), False),
            "sharded": _memory(subject, variants[True].get(replicas), True),
        },
        compute_ms=compute_s * 1e3,
        communication_ms=communication_s * 1e3,
        step_ms=step_s * 1e3,
        speedup=speedup,
        efficiency=speedup / replicas,
    )


def _memory(subject, program, sharded: bool):
    if program is None:
        return None
    return Memory(
        params_bytes=subject.params_bytes,
        optimizer_state_bytes=subject.optimizer_state_bytes(program.replicas, sharded),
        other_state_bytes=subject.other_state_bytes,
        batch_bytes=subject.batch_bytes,
        argument_bytes=program.argument_bytes,
        temp_bytes=program.temp_bytes,
        peak_bytes=program.peak_bytes,
        source=program.source,
    )


def _assumptions(subject, timed, link, overlap, cores, local, compiled_counts, counts) -> list:
    largest = max(compiled_counts)
    text = [
        f"Weak scaling: every replica runs the per-replica batch of {subject.per_replica_batch}; "
        "speedup = N x one-device step / predicted step (examples per second over one "
        "device's); efficiency = speedup / N.",
        f"Compute: the one-device step measured here, T1 = {timed.ms:.3f} ms on "
        f"{timed.device} (median of {len(timed.windows_ms)} windows of {timed.steps_per_window} "
        "warm steps), "
        + (
            "shared as below."
            if cores is not None
            else "on every replica at every N, each on its own device: the "
            "predictions are for more devices of this kind."
        ),
        "Communication: each collective instruction of the compiled step on a ring: all-reduce "
        "base + 2(N-1) latency + 2(N-1)/N bytes / bandwidth; reduce-scatter, all-gather, "
        "all-to-all base + (N-1) latency + (N-1)/N bytes / bandwidth (NCCL's own cost model). "
        f"Link: {link.describe()}: {link.source}.",
        f"Overlap: {overlap:g} of the communication hidden behind compute (step = compute + "
        "communication - min(overlap x communication, compute)); 0 means the collectives run "
        "after the backward pass, as XLA:CPU runs them.",
        "Latency counts once per collective instruction of the optimized program (XLA "
        "combines the gradients' all-reduces into one), "
        + (
            "times its arrays: this link runs a combined collective array by array (Gloo)."
            if link.per_operand
            else "as NCCL runs it (Gloo on CPU runs a combined "
            "all-reduce array by array: LinkModel(per_operand=True))."
        ),
        "Minimum: one all-reduce of the gradients (every nnx.Param), "
        f"{subject.params_bytes:,} bytes, 2(N-1)/N of them sent per device.",
        "Memory: one device's share; params and optimizer state counted from the arrays "
        "(sharded: 1/N of each array along its first dimension N divides), temp and peak "
        "(arguments + outputs - donated + temp) from compiled.memory_analysis().",
    ]
    if cores is not None:
        text.append(
            f"Shared cores: the replicas are threads sharing {cores} CPU core(s), so compute at "
            f"N replicas = max(T1, N x T1 x {timed.cores_busy:.2f} / {cores}), with "
            f"{timed.cores_busy:.2f} the cores the one-device step kept busy."
        )
    if largest < max(counts):
        beyond = [n for n in counts if n > largest]
        text.append(
            f"Rows {', '.join(map(str, beyond))}: this process has {local} device(s), so "
            + (
                f"they carry the program compiled at {largest} replicas over (same collectives "
                "and payloads, temp as there, the sharded optimizer state recounted)."
                if largest > 1
                else "no multi-device program was compiled: one all-reduce of the gradients (with "
                "sharded state, a reduce-scatter and an all-gather) is assumed, on the one-"
                "device program's memory."
            )
        )
    return text


def _check_power_of_two(value) -> int:
    value = argument_checks.count(WHAT, "max_replicas", value)
    if value & (value - 1):
        below = 1 << (value.bit_length() - 1)
        raise errors.InvalidArgumentError(
            f"{WHAT}: max_replicas must be a power of two (the rows are 1, 2, 4, ...); received "
            f"{value}. Use {below} or {below * 2}."
        )
    return value


def _check_overlap(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.InvalidArgumentTypeError(
            f"{WHAT}: overlap must be a number in [0, 1]; received {value!r}."
        )
    if not 0.0 <= value <= 1.0:
        raise errors.InvalidArgumentError(
            f"{WHAT}: overlap is the share of communication hidden behind compute, in [0, 1]; "
            f"received {value!r}. Pass 0 (none, the default) up to 1 (all of it)."
        )
    return float(value)


def _check_devices(devices) -> list:
    if devices is None:
        return jax.local_devices()
    devices = list(devices) if isinstance(devices, (list, tuple)) else devices
    local = set(jax.local_devices())
    if not isinstance(devices, list) or not devices or not all(d in local for d in devices):
        raise errors.InvalidArgumentError(
            f"{WHAT}: devices must be a non-empty list of this process's devices "
            f"(jax.local_devices()); received {devices!r}. Pass e.g. jax.local_devices()[:4], "
            "or None for all of them."
        )
    return devices


def _check_cores(shared_cores, link, devices):
    if shared_cores == "auto":
        on_cpu = devices[0].platform == "cpu"
        if link != links.LOCAL or not on_cpu:
            return None
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        return len(affinity(0)) if affinity else os.cpu_count() or 1
    if shared_cores is None:
        return None
    return argument_checks.count(WHAT, "shared_cores", shared_cores)
