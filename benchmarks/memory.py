"""Per-device memory of strategy.run's compiled train step (XLA memory analysis) at 1 to 8 replicas.

Data parallelism keeps a full model on every replica at a fixed per-replica batch, so one
device's memory must not grow with the replicas. For each workload of `models.WORKLOADS` (Adam,
per-replica batch 32) this compiles, never times, the program strategy.run runs
(`hlo.compile_train_step`) and reads `compiled.memory_analysis()`, ONE device's share: arguments
(state and this replica's batch), outputs (new state, loss), aliased (outputs reusing donated
argument buffers), temp (XLA's scratch after buffer reuse: activations, gradients, fusion
workspace; it can be smaller than the gradients) and peak = arguments + outputs - aliased +
temp (jax's `peak_memory_in_bytes` leaves temp out on XLA:CPU: shown, not used). By hand from
the parameter count P (float32): params + Adam (mu, nu) = 12 P bytes, gradients 4 P. Target:
peak / fewest replicas' = 1. A second table compiles the same steps with
`shard_optimizer_state=True`: the state one device holds (by hand 4 P + 8 P / R bytes for
Adam) and the peak.

Usage:
  python -m benchmarks.memory                   # 1, 2, 4 and 8 fake CPU devices
  python -m benchmarks.memory --devices 4       # one count, in this process
  python -m benchmarks.memory --json out.json   # also write the results as JSON
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks._harness import env, hlo

MODULE = "benchmarks.memory"
FIELDS = tuple(
    f"{where}{kind}_size_in_bytes"
    for where in ("", "host_")
    for kind in ("argument", "output", "alias", "temp", "generated_code")
)
FIELDS += ("peak_memory_in_bytes",)


def _measure(args, devices: int) -> dict:
    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    rows = []
    for name in models.WORKLOADS:
        start = time.perf_counter()
        step = hlo.compile_train_step(local, name, args.per_replica_batch)
        analysis = step["compiled"].memory_analysis()
        stats = {f: getattr(analysis, f) for f in FIELDS if hasattr(analysis, f)}
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
            "peak_bytes": _peak(analysis),
            "seconds": time.perf_counter() - start,
        }
        env.log(
            f"  [{devices} {args.platform}] {name}: peak {row['peak_bytes'] / 2**20:.2f} MiB, "
            f"temp {stats['temp_size_in_bytes'] / 2**20:.2f} MiB, {row['seconds']:.1f} s"
        )
        row["device_state_bytes"] = step["device_state_bytes"]
        if devices > 1 and not args.skip_sharded:
            sharded = hlo.compile_train_step(
                local, name, args.per_replica_batch, packed=True, shard_optimizer_state=True
            )
            row["sharded_device_state_bytes"] = sharded["device_state_bytes"]
            row["sharded_peak_bytes"] = _peak(sharded["compiled"].memory_analysis())
        rows.append(row)
    machine = env.environment(local)
    machine["memory_analysis_fields"] = sorted(
        f for f in dir(analysis) if f.endswith("_bytes") and not f.startswith("_")
    )
    return {"environment": machine, "rows": rows}


def _peak(analysis) -> int:
    """arguments + outputs - aliased + temp, one device's bytes."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _markdown(results: list) -> str:
    order = [row["workload"] for row in results[0]["rows"]]
    rows = sorted(
        (row for result in results for row in result["rows"]),
        key=lambda r: (order.index(r["workload"]), r["devices"]),
    )
    header = [
        "workload",
        "replicas",
        "parameters",
        "params + Adam (12 P) MiB",
        "gradients (4 P) MiB",
        "batch/replica MiB",
        "arguments MiB",
        "outputs MiB",
        "aliased MiB",
        "temp MiB",
        "peak MiB",
        "peak / fewest replicas'",
        "jax peak_memory MiB",
    ]
    table, first_peak = [], {}
    for r in rows:
        stats = r["memory_analysis"]
        base = first_peak.setdefault(r["workload"], r["peak_bytes"])
        jax_peak = stats.get("peak_memory_in_bytes")
        table.append(
            [
                r["workload"],
                r["devices"],
                f"{r['parameters']:,}",
                _mib(r["state_bytes_by_hand"]),
                _mib(r["gradient_bytes_by_hand"]),
                _mib(r["batch_bytes_per_replica"]),
                *(_mib(stats[f"{kind}_size_in_bytes"]) for kind in ("argument", "output", "alias", "temp")),
                _mib(r["peak_bytes"]),
                f"{r['peak_bytes'] / base:.3f}",
                "-" if jax_peak is None else _mib(jax_peak),
            ]
        )
    machine = results[0]["environment"]
    other = sorted(
        {
            f"{field}={value}"
            for r in rows
            for field, value in r["memory_analysis"].items()
            if field.startswith(("host_", "generated")) and value
        }
    )
    fields = ", ".join(f.removesuffix("_in_bytes") for f in machine["memory_analysis_fields"])
    lines = env.markdown_table(header, table) + [
        "",
        f"{machine['date'][:10]}; {env.environment_note(machine)} Static analysis (compile "
        f"only): per-replica batch {rows[0]['per_replica_batch']}, Adam; per-device numbers "
        "from `compiled.memory_analysis()`; peak = arguments + outputs - aliased + temp; fields "
        f"on this jax: {fields}; non-zero host/generated-code fields: {', '.join(other) or 'none'}.",
    ]
    sharded = [r for r in rows if "sharded_peak_bytes" in r]
    if sharded:
        lines += [
            "",
            "With `shard_optimizer_state=True` (ZeRO-1): parameters + Adam state held "
            "on one device (its arrays' shards there; by hand 12 P unsharded, 4 P + 8 P / "
            "R sharded) and the step's peak (gradients from `mirrax.value_and_grad`, as `fit`):",
            "",
        ]
        lines += env.markdown_table(
            [
                "workload",
                "replicas",
                "state on one device MiB",
                "sharded MiB",
                "ratio",
                "peak MiB",
                "sharded peak MiB",
                "ratio",
            ],
            [
                [
                    r["workload"],
                    r["devices"],
                    _mib(r["device_state_bytes"]),
                    _mib(r["sharded_device_state_bytes"]),
                    f"{r['sharded_device_state_bytes'] / r['device_state_bytes']:.3f}",
                    _mib(r["peak_bytes"]),
                    _mib(r["sharded_peak_bytes"]),
                    f"{r['sharded_peak_bytes'] / r['peak_bytes']:.3f}",
                ]
                for r in sharded
            ],
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,2,4,8")
    parser.add_argument(
        "--per-replica-batch",
        type=int,
        default=hlo.PER_REPLICA_BATCH,
        help=f"examples per replica (default {hlo.PER_REPLICA_BATCH})",
    )
    parser.add_argument(
        "--skip-sharded", action="store_true", help="leave out the shard_optimizer_state=True programs"
    )
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    child_argv = env.forward_arguments(args, ("platform", "per_replica_batch"), ("skip_sharded",))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
