"""Per-device memory of strategy.run's compiled train step (XLA memory analysis) at 1 to 8 replicas.

Data parallelism keeps a full copy of the model on every replica and gives each replica a fixed
per-replica batch, so the memory of one device must not grow with the number of replicas. This
benchmark compiles (never times) the train step `strategy.run(train_step, args=(model,
optimizer, batch))` builds for the three workloads of `communication.py` (the tutorial CNN, the
MLP 784-1024-1024-10 and the 4-layer transformer encoder, Adam, per-replica batch 32) and reads
`compiled.memory_analysis()`, which describes ONE device's share of the SPMD program:

- arguments: the inputs (model and optimizer state, this replica's batch);
- outputs: the new state and the per-replica loss (plus XLA's small tuple index tables);
- aliased: output bytes that reuse argument buffers (donation; mirrax's step donates nothing);
- temp: XLA's scratch buffers (activations kept for the backward pass, gradients, fusion
  workspace), after buffer reuse: a temporary may live in an output buffer before the output
  is written, so temp can be smaller than the gradients;
- peak: arguments + outputs - aliased + temp, what the device holds while the step runs.
  jax 0.10.2 also has `peak_memory_in_bytes`; on XLA:CPU it equals arguments + outputs (to a
  few bytes) and leaves temp out, so it is shown beside the peak but not used.

Alongside, by hand from the parameter count P (float32): params + Adam state (mu, nu) = 12 P
bytes (plus two int32 step counters), gradients 4 P. Without donation the old state (an
argument) and the new state (an output) are both live, so the floor of the peak is about
2 x 12 P + the batch + what of the gradients and activations does not fit in output buffers.
The program is reached as in `communication.py`: one real `strategy.run` step, then
`strategy.experimental_lower` on the same arguments, compiled.

Each replica count runs in a fresh subprocess (the fake CPU device count is read when JAX
starts), as in `overhead.py`.

Usage:
  python benchmarks/memory.py                   # 1, 2, 4 and 8 fake CPU devices
  python benchmarks/memory.py --devices 4       # one count, in this process
  python benchmarks/memory.py --json out.json   # also write the results as JSON
"""

from __future__ import annotations

import argparse
import sys
import time

import communication
import overhead

FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


def _measure(args, devices: int) -> dict:
    import jax

    import mirrax

    local = overhead.local_devices(args.platform, devices, "memory.py")
    rows = []
    for name in communication.WORKLOADS:
        start = time.perf_counter()
        strategy = mirrax.MirroredStrategy(local)
        step = communication.compile_train_step(strategy, name, args.per_replica_batch)
        analysis = step["compiled"].memory_analysis()
        stats = {f: getattr(analysis, f) for f in FIELDS if hasattr(analysis, f)}
        formula = (
            stats["argument_size_in_bytes"]
            + stats["output_size_in_bytes"]
            - stats["alias_size_in_bytes"]
            + stats["temp_size_in_bytes"]
        )
        parameters = step["parameters"]
        row = {
            "workload": name,
            "devices": devices,
            "per_replica_batch": args.per_replica_batch,
            "parameters": parameters,
            "state_bytes_by_hand": 12 * parameters,
            "gradient_bytes_by_hand": 4 * parameters,
            "state_bytes": step["state_bytes"],
            "batch_bytes_per_replica": step["batch_bytes"],
            "memory_analysis": stats,
            "peak_bytes": formula,
            "seconds": time.perf_counter() - start,
        }
        print(
            f"  [{devices} {args.platform}] {name}: peak {row['peak_bytes'] / 2**20:.2f} MiB, "
            f"temp {stats['temp_size_in_bytes'] / 2**20:.2f} MiB, {row['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    env = overhead.environment(jax, local)
    env["date"] = time.strftime("%Y-%m-%d")
    env["memory_analysis_fields"] = sorted(
        f for f in dir(analysis) if f.endswith("_bytes") and not f.startswith("_")
    )
    return {"environment": env, "rows": rows}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _markdown(results: list) -> str:
    lines = [
        "| workload | replicas | parameters | params + Adam (12 P) MiB | gradients (4 P) MiB "
        "| batch/replica MiB | arguments MiB | outputs MiB | aliased MiB | temp MiB "
        "| peak MiB | peak / fewest replicas' | jax peak_memory MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = [row for result in results for row in result["rows"]]
    order = list(communication.WORKLOADS)
    rows.sort(key=lambda r: (order.index(r["workload"]), r["devices"]))
    first_peak = {}
    for row in rows:
        stats = row["memory_analysis"]
        base = first_peak.setdefault(row["workload"], row["peak_bytes"])
        lines.append(
            f"| {row['workload']} | {row['devices']} | {row['parameters']:,} "
            f"| {_mib(row['state_bytes_by_hand'])} | {_mib(row['gradient_bytes_by_hand'])} "
            f"| {_mib(row['batch_bytes_per_replica'])} "
            f"| {_mib(stats['argument_size_in_bytes'])} | {_mib(stats['output_size_in_bytes'])} "
            f"| {_mib(stats['alias_size_in_bytes'])} | {_mib(stats['temp_size_in_bytes'])} "
            f"| {_mib(row['peak_bytes'])} | {row['peak_bytes'] / base:.3f} "
            f"| {_mib(stats['peak_memory_in_bytes']) if 'peak_memory_in_bytes' in stats else '-'} |"
        )
    env = results[0]["environment"]
    other = sorted({
        f"{field}={value}"
        for row in rows
        for field, value in row["memory_analysis"].items()
        if field.startswith(("host_", "generated")) and value
    })
    lines.append("")
    lines.append(
        f"{env['date']}; {overhead.environment_note(env)} Static analysis (compile only): "
        f"per-replica batch {rows[0]['per_replica_batch']}, Adam; per-device numbers from "
        f"`compiled.memory_analysis()`; peak = arguments + outputs - aliased + temp; fields on this jax: "
        f"{', '.join(f.removesuffix('_in_bytes') for f in env['memory_analysis_fields'])}; "
        f"non-zero host/generated-code fields: {', '.join(other) or 'none'}."
    )
    return "\n".join(lines)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        default="1,2,4,8",
        help="comma-separated replica counts; each runs in a fresh subprocess when more than one "
        "is given (default: 1,2,4,8)",
    )
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"],
                        help="cpu uses N fake host devices; gpu/tpu the first N local accelerators")
    parser.add_argument("--per-replica-batch", type=int,
                        default=communication.PER_REPLICA_BATCH,
                        help=f"examples per replica (default {communication.PER_REPLICA_BATCH})")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    child_argv = overhead.forward_arguments(args, ("platform", "per_replica_batch"), ())
    return overhead.run_benchmark(args, _measure, _markdown, child_argv, __file__)


if __name__ == "__main__":
    sys.exit(main())
