"""Weak scaling of strategy.run in one process, 1 to 8 fake CPU devices, and the gradient
all-reduce's overlap.

Scaling: `models.strategy_run_step` (Adam 1e-3) through `strategy.run` on a placed batch at a
fixed per-replica batch (CNN 32, MLP 784-1024-1024-10 32, transformer 4x256 8), interleaved with
the floor `models.make_handwritten(..., donate=False)`; speedup = ex/s(N) / ex/s(1) (ideal N),
per-core efficiency = speedup / min(N, cores) (the fake devices are threads sharing the cores),
cores busy = CPU time / wall time. Overlap (at `--overlap-devices`): strategy.run's program per
XLA option set of `OPTION_SETS`: in each scheduled HLO, the all-reduces and the compute ops that
may run beside each (independent of it); each distinct program timed on zeros of its inputs.

Usage:
  python -m benchmarks.scaling                    # 1, 2, 4 and 8 fake CPU devices
  python -m benchmarks.scaling --devices 4 --json out.json   # one count, in this process
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks._harness import env, hlo, timing

MODULE = "benchmarks.scaling"
# workload (a key of models.WORKLOADS) -> (per-replica batch, steps per timed window)
WORKLOADS = {"CNN": (32, 4), "MLP 784-1024-1024-10": (32, 20), "Transformer 4x256": (8, 2)}
# name -> compiler_options: jax 0.10.2's XLA:CPU options that could change how the all-reduce
# meets the backward pass (no asynchronous collectives, no combiner threshold on CPU).
OPTION_SETS = {
    "default": {},
    "no all-reduce combiner": {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"},
    "memory-optimized scheduler": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    # The older switch between the same schedulers; jax 0.10.2 seems to ignore it (same program).
    "concurrency scheduler off": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
}
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def overlap_report(hlo_text: str) -> dict:
    """The all-reduces of an optimized, scheduled HLO module and what could run beside them."""
    instructions = hlo.entry_instructions(hlo_text)
    position = {name: i for i, (name, _, _) in enumerate(instructions)}
    opcodes = {name: opcode for name, opcode, _ in instructions}
    operands = {name: ops for name, _, ops in instructions}
    users = {name: [] for name in operands}
    for name, ops in operands.items():
        for op in ops:
            users[op].append(name)
    compute = [name for name, opcode, _ in instructions if opcode not in _NOT_COMPUTE]

    def closure(start, edges):  # every instruction reachable from `start` along `edges`
        seen, stack = set(), [start]
        while stack:
            new = [n for n in edges[stack.pop()] if n not in seen]
            seen.update(new)
            stack += new
        return seen

    syncs = [n for n in operands if opcodes[n] == "all-reduce"]
    dones = {
        n: next(u for u in users[n] if opcodes[u] == "all-reduce-done")
        for n in operands
        if opcodes[n] == "all-reduce-start"
    }
    linked = {op: closure(op, operands) | closure(op, users) | {op} for op in syncs + list(dones)}
    independent = [sum(c not in linked[op] for c in compute) for op in linked]
    before = [sum(position[c] < position[op] for c in compute) for op in linked]
    return {
        "allreduce_ops": len(linked),
        "async_pairs": len(dones),
        "compute_between_start_done": [
            sum(position[s] < position[c] < position[d] for c in compute) for s, d in dones.items()
        ],
        "compute_ops": len(compute),
        "independent_compute_per_allreduce": independent,
        "max_independent_compute": max(independent, default=0),
        "compute_before_first_allreduce": min(before, default=None),
    }  # its schedule place


def _time_interleaved(variants: dict, steps: int, args) -> dict:
    """{name: {"ms", "cores_busy" (medians), "windows_ms"}} of {name: (step, block)}, flipped."""
    busy = {key: [] for key in variants}

    def window(key):
        cpu, start = time.process_time(), time.perf_counter()
        timing.run_steps(*variants[key], steps, args.max_in_flight)
        wall = time.perf_counter() - start
        busy[key].append((time.process_time() - cpu) / wall)
        return wall / steps

    for step, block in variants.values():
        timing.run_steps(step, block, max(1, steps // 2), args.max_in_flight)
    per_step = timing.interleave(
        {key: lambda key=key: window(key) for key in variants}, args.windows, order="flip"
    )
    ms, cores_busy = timing.medians(per_step, 1e3), timing.medians(busy)
    return {
        key: {"ms": ms[key], "cores_busy": cores_busy[key], "windows_ms": [t * 1e3 for t in per_step[key]]}
        for key in variants
    }


def _measure(args, devices: int) -> dict:
    import jax
    from flax import nnx

    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    load_before = os.getloadavg()
    rows, overlap = [], []
    for name, (per_replica, steps) in WORKLOADS.items():
        builder, make_batch = models.WORKLOADS[name]
        global_batch = per_replica * devices
        x, y = make_batch(global_batch)
        strategy, model, optimizer, batch = models.mirrax_state(local, builder, x, y)
        train_step = models.strategy_run_step(global_batch)
        timed = _time_interleaved(
            {
                "mirrax": (
                    lambda: strategy.run(train_step, args=(model, optimizer, batch)),
                    lambda out: jax.block_until_ready((out, nnx.state((model, optimizer)))),
                ),
                "handwritten": models.make_handwritten(builder, x, y, global_batch, local, donate=False)[:2],
            },
            steps * args.steps_scale,
            args,
        )
        row = {
            "workload": name,
            "devices": devices,
            "per_replica_batch": per_replica,
            "global_batch": global_batch,
            "steps_per_window": steps * args.steps_scale,
            "windows": args.windows,
            "max_in_flight": args.max_in_flight,
            **{f"{key}_{stat}": value for key, stats in timed.items() for stat, value in stats.items()},
        }
        env.log(
            f"  [{devices} {args.platform}] {name}: mirrax {row['mirrax_ms']:.2f} ms/step, "
            f"hand-written {row['handwritten_ms']:.2f} ms/step"
        )
        rows.append(row)
        if devices == args.overlap_devices and not args.skip_overlap:
            lowered = strategy.experimental_lower(train_step, args=(model, optimizer, batch))
            overlap += _overlap(args, lowered, name, devices)
    machine = dict(
        env.environment(local), load_average_before=load_before, load_average_after=os.getloadavg()
    )
    return {"environment": machine, "rows": rows, "overlap": overlap}


def _overlap(args, lowered, name: str, devices: int) -> list:
    """The overlap rows of strategy.run's program `lowered`, one per OPTION_SETS entry."""
    import jax
    import numpy as np

    compiled = {
        label: lowered.compile(compiler_options=options or None) for label, options in OPTION_SETS.items()
    }
    texts = {label: program.as_text() for label, program in compiled.items()}

    def looped(program):  # on zeros (the work does not depend on the values); state donated
        arguments = list(
            jax.tree.map(
                lambda info, sharding: jax.device_put(np.zeros(info.shape, info.dtype), sharding),
                lowered.args_info[0],
                compiled["default"].input_shardings[0],
            )
        )

        def step():
            arguments[0], outputs = program(*arguments)
            return outputs

        return step, jax.block_until_ready

    rows = [
        dict(
            overlap_report(texts[label]),
            workload=name,
            devices=devices,
            options=label,
            xla=options,
            schedule_same_as_default=(None if label == "default" else texts[label] == texts["default"]),
        )
        for label, options in OPTION_SETS.items()
    ]
    # A program the same as the default's is not timed again: that would only measure noise.
    timed = _time_interleaved(
        {r["options"]: looped(compiled[r["options"]]) for r in rows if not r["schedule_same_as_default"]},
        WORKLOADS[name][1] * args.steps_scale,
        args,
    )
    base = timed["default"]["ms"]
    for report in rows:
        stats = timed.get(report["options"], {"ms": None, "windows_ms": []})
        report.update(stats, vs_default=None if stats["ms"] is None else stats["ms"] / base)
    env.log(
        f"  [{devices}] {name}: "
        + ", ".join(f"{label} {stats['ms']:.2f}" for label, stats in timed.items())
        + " ms/step"
    )
    return rows


def _markdown(results: list) -> str:
    machine = results[0]["environment"]
    cores = machine["host_cpus"]
    rows = sorted(
        (row for result in results for row in result["rows"]),
        key=lambda r: (list(WORKLOADS).index(r["workload"]), r["devices"]),
    )
    single = {r["workload"]: r for r in rows if r["devices"] == 1}
    header = [
        "workload",
        "devices",
        "global batch",
        "mirrax ms/step",
        "hand-written ms/step",
        "mirrax / hand-written",
        "mirrax ex/s",
        "speedup vs 1 device",
        "ideal (weak)",
        f"per-core efficiency ({cores} cores)",
        "mirrax cores busy",
        "hand-written ex/s",
        "hand-written speedup",
        "hand-written per-core efficiency",
        "hand-written cores busy",
    ]

    def scaled(r, key):  # [ex/s, speedup vs 1 device, per-core efficiency, cores busy]
        cells = [
            f"{r['global_batch'] / r[f'{key}_ms'] * 1e3:,.0f}",
            "n/a",
            "n/a",
            f"{r[f'{key}_cores_busy']:.2f}",
        ]
        if r["workload"] in single:  # ex/s(N) / ex/s(1) at the same per-replica batch
            speedup = r["devices"] * single[r["workload"]][f"{key}_ms"] / r[f"{key}_ms"]
            cells[1:3] = [f"{speedup:.2f}", f"{speedup / min(r['devices'], cores):.2f}"]
        return cells

    table = [
        [
            r["workload"],
            r["devices"],
            r["global_batch"],
            f"{r['mirrax_ms']:.2f}",
            f"{r['handwritten_ms']:.2f}",
            f"{r['mirrax_ms'] / r['handwritten_ms']:.3f}",
            *scaled(r, "mirrax")[:2],
            r["devices"],
            *scaled(r, "mirrax")[2:],
            *scaled(r, "handwritten"),
        ]
        for r in rows
    ]
    loads = ", ".join(
        f"{r['rows'][0]['devices']}: {r['environment']['load_average_before'][0]:.2f}"
        f" / {r['environment']['load_average_after'][0]:.2f}"
        for r in results
    )
    lines = env.markdown_table(header, table) + [
        "",
        f"{machine['date']}; {env.environment_note(machine)} Median of {rows[0]['windows']} "
        f"interleaved windows per variant, at most {rows[0]['max_in_flight']} steps in flight; "
        "per-replica batch fixed (CNN 32, MLP 32, transformer 8). Speedup = ex/s(N) / ex/s(1); "
        f"per-core efficiency = speedup / min(N, {cores}) ({cores} cores shared); cores busy = CPU"
        f" time (all threads) / wall time. 1-minute load average before / after each run: {loads}.",
    ]
    overlap = [r for result in results for r in result.get("overlap", [])]
    if overlap:
        header = [
            "workload",
            "devices",
            "XLA options",
            "all-reduce ops",
            "async (start/done) pairs",
            "compute ops between start and done",
            "compute ops scheduled before the first all-reduce",
            "compute ops independent of the all-reduce (max over ops)",
            "compute ops in the step",
            "schedule = default",
            "ms/step",
            "vs default",
            "cores busy",
        ]
        table = [
            [
                r["workload"],
                r["devices"],
                ", ".join(f"`{k}={v}`" for k, v in r["xla"].items()) or "(none)",
                r["allreduce_ops"],
                r["async_pairs"],
                ", ".join(map(str, r["compute_between_start_done"])) or "n/a (synchronous)",
                r["compute_before_first_allreduce"],
                r["max_independent_compute"],
                r["compute_ops"],
                {None: "-", True: "yes", False: "no"}[r["schedule_same_as_default"]],
                *(
                    ["not timed (same program)", "n/a", "n/a"]
                    if r["ms"] is None
                    else [f"{r['ms']:.2f}", f"{r['vs_default']:.3f}", f"{r['cores_busy']:.2f}"]
                ),
            ]
            for r in overlap
        ]
        lines += [
            "",
            *env.markdown_table(header, table, list("lrlrrlrrrlrrr")),
            "",
            "Overlap: `lowered.compile(compiler_options=...)`, read from `compiled.as_text()` "
            "(schedule order), timed on zero-filled arguments. Independent: compute ops "
            "that neither feed the all-reduce nor use its result.",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,2,4,8")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (5)")
    parser.add_argument("--steps-scale", type=int, default=1, help="multiplies the steps per window")
    parser.add_argument("--max-in-flight", type=int, default=2, help="steps dispatched ahead (2)")
    parser.add_argument(
        "--overlap-devices",
        type=int,
        default=4,
        help="device count at which the all-reduce overlap is analysed (4)",
    )
    parser.add_argument("--skip-overlap", action="store_true", help="only the scaling table")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if min(args.windows, args.steps_scale, args.max_in_flight) < 1:
        parser.error("--windows, --steps-scale and --max-in-flight must be >= 1")
    child_argv = env.forward_arguments(
        args, ("platform", "windows", "steps_scale", "max_in_flight", "overlap_devices"), ("skip_overlap",)
    )
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
