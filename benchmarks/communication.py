"""All-reduce bytes of strategy.run's compiled train step (HLO) against one pass over the gradients.

Data parallelism must move each gradient across replicas once per step: for float32 that is
4 bytes x parameters, the minimum. For each workload of `models.WORKLOADS` (the tutorial CNN,
the MLP 784-1024-1024-10, the 4x256 transformer; Adam, per-replica batch 32) this compiles,
never times, the program `strategy.run(train_step, ...)` runs (`hlo.compile_train_step`) and
counts the collectives in its HLO text: before optimization (`lowered.as_text(dialect="hlo")`,
one all-reduce per gradient leaf) and after (`compiled.as_text()`, after XLA's all-reduce
combiner). A collective's bytes are those of its result shape; each all-reduced array is
matched against the parameter shapes (a gradient), rank-0 arrays are scalars (a loss or metric
psum), anything else is "other" and listed. Columns: parameters, the minimum (4 x parameters),
the all-reduce bytes and their ratio to the minimum (target 1.00), the all-reduce ops before
and after the combiner, the arrays they carry, the non-gradient all-reduced arrays and any
other collectives. A second table compiles the same step with `shard_optimizer_state=True`
and compares the bytes each device sends (ring model; target <= 1.05x the unsharded step's).

Usage:
  python -m benchmarks.communication                  # 2, 4 and 8 fake CPU devices
  python -m benchmarks.communication --devices 4      # one count, in this process
  python -m benchmarks.communication --json out.json  # also write the results as JSON
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time

from benchmarks._harness import env, hlo

MODULE = "benchmarks.communication"


def classify(ops: list, param_shapes: list) -> dict:
    """Splits the all-reduced arrays into gradients, scalars and other, with their bytes."""
    unmatched = collections.Counter(math.prod(s) for s in param_shapes)
    result = {"gradient_bytes": 0, "scalars": [], "other": [], "other_bytes": 0}
    for opcode, arrays in ops:
        if not opcode.startswith("all-reduce"):
            continue
        for array in arrays:
            size = math.prod(array[1])
            if array[1] == ():
                result["scalars"].append(hlo.describe(array))
            elif unmatched[size] > 0 and array[0] == "f32":
                unmatched[size] -= 1
                result["gradient_bytes"] += hlo.nbytes(array)
            else:
                result["other"].append(hlo.describe(array))
                result["other_bytes"] += hlo.nbytes(array)
    result["gradients_missing"] = sum(unmatched.values())
    return result


def _measure(args, devices: int) -> dict:
    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    rows = []
    for name in models.WORKLOADS:
        start = time.perf_counter()
        step = hlo.compile_train_step(local, name, args.per_replica_batch)
        before = hlo.collectives(step["lowered"].as_text(dialect="hlo"))
        after = hlo.collectives(step["compiled"].as_text())
        reduced = [arrays for op, arrays in after if op.startswith("all-reduce")]
        others = [(op, arrays) for op, arrays in after if not op.startswith("all-reduce")]
        minimum = 4 * step["parameters"]
        allreduce_bytes = sum(hlo.nbytes(a) for arrays in reduced for a in arrays)
        row = {
            "workload": name,
            "devices": devices,
            "per_replica_batch": args.per_replica_batch,
            "parameters": step["parameters"],
            "parameter_arrays": len(step["param_shapes"]),
            "minimum_bytes": minimum,
            "allreduce_bytes": allreduce_bytes,
            "ratio": allreduce_bytes / minimum,
            "allreduce_ops_before": sum(op.startswith("all-reduce") for op, _ in before),
            "allreduce_ops_after": len(reduced),
            "allreduce_arrays_after": sum(map(len, reduced)),
            "other_collectives_after": sorted(collections.Counter(op for op, _ in others).items()),
            "other_collective_bytes": sum(hlo.nbytes(a) for _, arrays in others for a in arrays),
            "largest_allreduce_bytes": max((sum(map(hlo.nbytes, arrays)) for arrays in reduced), default=0),
            **classify(after, step["param_shapes"]),
            "seconds": time.perf_counter() - start,
        }
        env.log(
            f"  [{devices} {args.platform}] {name}: {row['allreduce_ops_before']} all-reduces "
            f"before, {row['allreduce_ops_after']} after, {allreduce_bytes:,} B "
            f"(x{row['ratio']:.4f} the minimum), {row['seconds']:.1f} s"
        )
        if devices > 1 and not args.skip_sharded:
            row["ring_bytes"] = hlo.ring_bytes(after, devices)
            unsharded = sum(row["ring_bytes"].values())
            for packed, key in ((True, "sharded"), (False, "sharded_nnx")):
                ops = hlo.collectives(
                    hlo.compile_train_step(
                        local, name, args.per_replica_batch, packed, shard_optimizer_state=True
                    )["compiled"].as_text()
                )
                row[f"{key}_ring_bytes"] = hlo.ring_bytes(ops, devices)
                row[f"{key}_ops"] = sorted(collections.Counter(op for op, _ in ops).items())
                row[f"{key}_ring_ratio"] = sum(row[f"{key}_ring_bytes"].values()) / unsharded
            env.log(
                f"  [{devices} {args.platform}] {name}, shard_optimizer_state=True: "
                f"{dict(row['sharded_ops'])}, ring bytes x{row['sharded_ring_ratio']:.4f} "
                f"the unsharded step's (x{row['sharded_nnx_ring_ratio']:.4f} with "
                "nnx.value_and_grad)"
            )
        rows.append(row)
    return {"environment": env.environment(local), "rows": rows}


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
        "minimum (4 x params) MiB",
        "all-reduce MiB",
        "ratio",
        "all-reduce ops before combiner",
        "after",
        "arrays after",
        "non-gradient all-reduced",
        "other collectives",
    ]
    table = [
        [
            r["workload"],
            r["devices"],
            f"{r['parameters']:,}",
            _mib(r["minimum_bytes"]),
            _mib(r["allreduce_bytes"]),
            f"{r['ratio']:.4f}",
            r["allreduce_ops_before"],
            r["allreduce_ops_after"],
            r["allreduce_arrays_after"],
            ", ".join(r["scalars"] + r["other"]) or "none",
            ", ".join(f"{n} {op}" for op, n in r["other_collectives_after"]) or "none",
        ]
        for r in rows
    ]
    machine = results[0]["environment"]
    lines = env.markdown_table(header, table, ["l"] + ["r"] * 8 + ["l", "l"]) + [
        "",
        f"{machine['date'][:10]}; {env.environment_note(machine)} Static analysis (compile "
        f"only): per-replica batch {rows[0]['per_replica_batch']}, Adam; bytes are the result "
        "shapes of the collectives in the optimized HLO (`compiled.as_text()`); ops before: "
        "`lowered.as_text(dialect='hlo')`.",
    ]
    sharded = [r for r in rows if "sharded_ring_bytes" in r]
    if sharded:
        mib = lambda r, k: _mib(r["sharded_ring_bytes"][k])  # noqa: E731
        lines += [
            "",
            "With `shard_optimizer_state=True` (ZeRO-1): MiB each device sends per "
            "step in a ring implementation (an all-reduce of S: 2(R-1)/R S; a "
            "reduce-scatter of S in, an all-gather of S out: (R-1)/R S each):",
            "",
        ]
        lines += env.markdown_table(
            [
                "workload",
                "replicas",
                "unsharded: all-reduce",
                "sharded: reduce-scatter",
                "all-gather",
                "all-reduce",
                "sharded / unsharded",
                "collectives",
                "with nnx.value_and_grad: sharded / unsharded",
            ],
            [
                [
                    r["workload"],
                    r["devices"],
                    _mib(sum(r["ring_bytes"].values())),
                    mib(r, "reduce-scatter"),
                    mib(r, "all-gather"),
                    mib(r, "all-reduce"),
                    f"{r['sharded_ring_ratio']:.4f}",
                    ", ".join(f"{n} {op}" for op, n in r["sharded_ops"]),
                    f"{r['sharded_nnx_ring_ratio']:.4f}",
                ]
                for r in sharded
            ],
            ["l"] + ["r"] * 6 + ["l", "r"],
        )
        lines += [
            "",
            "Sharded gradients come from `mirrax.value_and_grad` (reduce-scattered); "
            "`nnx.value_and_grad`'s arrive all-reduced by JAX, so its sharded step adds "
            "the parameters' all-gather to a full all-reduce.",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="2,4,8")
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
