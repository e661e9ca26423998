"""Weak scaling of strategy.run in one process, 1 to 8 fake CPU devices, and the gradient all-reduce's overlap.

Part 1, scaling. The same train step (`workloads.strategy_run_step`: Adam 1e-3,
`compute_average_loss` with the global batch size given) runs through
`strategy.run(train_step, args=(model, optimizer, batch))` on a pre-placed `PerReplica` batch
(reused every step, so input is not measured) at a FIXED per-replica batch on 1, 2, 4 and 8
fake CPU devices (`--xla_force_host_platform_device_count=N`, one fresh subprocess per count):
weak scaling, the global batch grows with the devices. Interleaved with it (A B A B, the order
flipped every window) runs the floor: `workloads.make_handwritten(..., donate=False)`, one
`jax.jit(jax.shard_map(step))` call per step on the flat state arrays, so the table separates
what mirrax adds from what XLA:CPU itself does at N devices. Workloads, from
`communication.WORKLOADS`: the tutorial CNN (per-replica batch 32), the MLP 784-1024-1024-10
(32) and the 4-layer d=256 transformer encoder (sequence 64; 8).

Reported per workload and device count: the median ms/step of each variant over the windows
(each window ends with `jax.block_until_ready` on the outputs and the whole state; at most
`--max-in-flight` steps run ahead), mirrax/hand-written, examples/s (global batch / step time),
speedup = ex/s(N) / ex/s(1), ideal = N (weak scaling), per-core efficiency =
ex/s(N) / (min(N, cores) x ex/s(1)), and cores busy = this process's CPU time (all threads) /
wall time over a window. The fake devices are threads of one process sharing the machine's
cores (2 here): a step can never keep more than `cores` busy, so once the 1-device step keeps
all of them busy no speedup beyond the core count is possible whatever N; where the 1-device
step leaves a core idle (cores busy < `cores`), more devices can fill it and the speedup can
pass the core count (per-core efficiency > 1): that measures the 1-device step's idle core,
not scaling.

Part 2, overlap (at `--overlap-devices`, default 4). The program `strategy.run` runs is
reached as in `communication.py`: `strategy.experimental_lower` of the timed step, compiled
once per XLA option set in `OPTION_SETS` (`lowered.compile(compiler_options=...)`, the
per-program form of `XLA_FLAGS`). From each optimized HLO (`compiled.as_text()`, `is_scheduled=true`, the
entry computation printed in schedule order) it reports: the all-reduce ops, whether they are
asynchronous (`all-reduce-start`/`-done` pairs) and how many compute instructions (anything but
parameter, constant, get-tuple-element, tuple, bitcast) are scheduled between a start and its
done; for synchronous all-reduces, how many compute instructions are INDEPENDENT of each
all-reduce (neither feed it nor use its result, directly or transitively): XLA:CPU's thunk
executor may run those concurrently with it, nothing else can overlap it. The compiled variants
are then timed against each other, interleaved, by calling each `Compiled` directly on arrays
of the program's input shapes and shardings (zeros), feeding the new state back in (the work
per step does not depend on the values).

Usage:
  python benchmarks/scaling.py                    # 1, 2, 4 and 8 fake CPU devices
  python benchmarks/scaling.py --devices 4        # one count, in this process
  python benchmarks/scaling.py --json out.json    # also write the results as JSON
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import communication
import overhead

# workload (a key of communication.WORKLOADS) -> (per-replica batch, steps per timed window)
WORKLOADS = {
    "CNN": (32, 4),
    "MLP 784-1024-1024-10": (32, 20),
    "Transformer 4x256": (8, 2),
}
# name -> compiler_options for lowered.compile; the XLA:CPU options of jax 0.10.2 that could
# change how the gradient all-reduce meets the backward pass. XLA:CPU has no asynchronous
# collectives and no combiner threshold option (the combiner's limits are constants in
# cpu_compiler.cc: any size, 256 ops); its combiner pass can only be disabled.
OPTION_SETS = {
    "default": {},
    "no all-reduce combiner": {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"},
    "memory-optimized scheduler": {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    # The older switch between the same two schedulers; jax 0.10.2 appears to ignore it (the
    # program comes out identical, and is then not timed).
    "concurrency scheduler off": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
}
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
# `  [ROOT] %name = SHAPE opcode(operands), attributes`
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")


# -- reading the schedule -----------------------------------------------------------------------


def entry_instructions(hlo_text: str) -> list:
    """[(name, opcode, [operand names])] of the ENTRY computation, in the printed (schedule) order."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        if inside:
            match = _LINE.match(line)
            if match:
                lines.append((match.group(1), match.group(3), match.group(4)))
    names = {name for name, _, _ in lines}
    # Operand and attribute text both hold `%name`s; computations (calls=, to_apply=) are not
    # entry instructions, so keeping only entry names leaves the data operands.
    return [
        (name, opcode, [n for n in _NAME.findall(rest) if n in names and n != name])
        for name, opcode, rest in lines
    ]


def overlap_report(hlo_text: str) -> dict:
    """The all-reduces of an optimized, scheduled HLO module and what could run beside them."""
    instructions = entry_instructions(hlo_text)
    position = {name: i for i, (name, _, _) in enumerate(instructions)}
    operands = {name: ops for name, _, ops in instructions}
    users = {name: [] for name in operands}
    for name, ops in operands.items():
        for op in ops:
            users[op].append(name)
    compute = [name for name, opcode, _ in instructions if opcode not in _NOT_COMPUTE]

    def closure(start, edges):
        seen, stack = set(), [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    opcodes = {name: opcode for name, opcode, _ in instructions}
    syncs = [n for n in operands if opcodes[n] == "all-reduce"]
    starts = [n for n in operands if opcodes[n] == "all-reduce-start"]
    between = []
    for start in starts:
        done = next(u for u in users[start] if opcodes[u] == "all-reduce-done")
        between.append(sum(position[start] < position[c] < position[done] for c in compute))
    independent = []
    for op in syncs + starts:
        linked = closure(op, operands) | closure(op, users) | {op}
        independent.append(sum(c not in linked for c in compute))
    first = min((position[n] for n in syncs + starts), default=None)
    return {
        "allreduce_ops": len(syncs) + len(starts),
        "async_pairs": len(starts),
        "compute_between_start_done": between,
        "compute_ops": len(compute),
        "independent_compute_per_allreduce": independent,
        "max_independent_compute": max(independent, default=0),
        # How far the first all-reduce sits in the schedule: the compute instructions before it.
        "compute_before_first_allreduce": (
            sum(position[c] < first for c in compute) if first is not None else None
        ),
    }


# -- one device count, in this process ----------------------------------------------------------


def _time_interleaved(variants: dict, steps: int, windows: int, max_in_flight: int):
    """Alternates the variants (order flipped every window) for `windows` windows of `steps`.

    Returns ({name: [seconds per step, one per window]}, {name: [cores busy, one per window]}),
    cores busy = this process's CPU time (all threads) / wall time over the window.
    """
    import workloads

    for step, block in variants.values():
        workloads.run_steps(step, block, max(1, steps // 2), max_in_flight)
    per_step = {key: [] for key in variants}
    busy = {key: [] for key in variants}
    for window in range(windows):
        order = list(variants) if window % 2 == 0 else list(reversed(variants))
        for key in order:
            step, block = variants[key]
            cpu, start = time.process_time(), time.perf_counter()
            workloads.run_steps(step, block, steps, max_in_flight)
            wall = time.perf_counter() - start
            per_step[key].append(wall / steps)
            busy[key].append((time.process_time() - cpu) / wall)
    return per_step, busy


def _measure(args, devices: int) -> dict:
    import jax
    from flax import nnx

    import workloads

    local = overhead.local_devices(args.platform, devices, "scaling.py")
    load_before = os.getloadavg()
    rows, overlap = [], []
    for name, (per_replica, steps) in WORKLOADS.items():
        started = time.perf_counter()
        builder, make_batch = communication.WORKLOADS[name]
        global_batch = per_replica * devices
        x, y = make_batch(global_batch)

        strategy, model, optimizer, batch = workloads.mirrax_state(local, builder, x, y)
        train_step = workloads.strategy_run_step(global_batch)

        def mirrax_step():
            return strategy.run(train_step, args=(model, optimizer, batch))

        def mirrax_block(out):
            jax.block_until_ready((out, nnx.state((model, optimizer))))

        hand_step, hand_block, _ = workloads.make_handwritten(
            builder, x, y, global_batch, local, donate=False
        )
        times, busy = _time_interleaved(
            {"mirrax": (mirrax_step, mirrax_block), "handwritten": (hand_step, hand_block)},
            steps * args.steps_scale, args.windows, args.max_in_flight,
        )
        row = {
            "workload": name,
            "devices": devices,
            "per_replica_batch": per_replica,
            "global_batch": global_batch,
            "steps_per_window": steps * args.steps_scale,
            "windows": args.windows,
            "max_in_flight": args.max_in_flight,
            "mirrax_ms": statistics.median(times["mirrax"]) * 1e3,
            "handwritten_ms": statistics.median(times["handwritten"]) * 1e3,
            "mirrax_cores_busy": statistics.median(busy["mirrax"]),
            "handwritten_cores_busy": statistics.median(busy["handwritten"]),
            "mirrax_windows_ms": [t * 1e3 for t in times["mirrax"]],
            "handwritten_windows_ms": [t * 1e3 for t in times["handwritten"]],
        }
        print(
            f"  [{devices} {args.platform}] {name}: mirrax {row['mirrax_ms']:.2f} ms/step, "
            f"hand-written {row['handwritten_ms']:.2f} ms/step "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr, flush=True,
        )
        rows.append(row)
        if devices == args.overlap_devices and not args.skip_overlap:
            overlap += _overlap(args, strategy, lambda: strategy.experimental_lower(
                train_step, args=(model, optimizer, batch)), name, devices)
    env = overhead.environment(jax, local)
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    env["load_average_before"] = load_before
    env["load_average_after"] = os.getloadavg()
    return {"environment": env, "rows": rows, "overlap": overlap}


def _overlap(args, strategy, lower, name: str, devices: int) -> list:
    """Compiles strategy.run's program once per OPTION_SETS entry; reads and times each.

    `lower()` is `strategy.experimental_lower` of the timed step. Each variant runs on arrays
    of the program's input shapes and shardings (zeros; the timing does not depend on the
    values), feeding its new state back in as a training loop does (the state is donated).
    """
    import jax
    import numpy as np

    lowered = lower()
    shardings = lowered.compile().input_shardings[0]

    def fresh_arguments() -> list:  # each variant its own: the state is donated
        return list(jax.tree.map(
            lambda info, sharding: jax.device_put(np.zeros(info.shape, info.dtype), sharding),
            lowered.args_info[0], shardings))
    variants, rows = {}, []
    for label, options in OPTION_SETS.items():
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        text = compiled.as_text()
        report = overlap_report(text)
        report.update(workload=name, devices=devices, options=label, xla=options,
                      schedule_same_as_default=None)
        if label == "default":
            default_text = text
        else:
            report["schedule_same_as_default"] = text == default_text

        rows.append(report)
        if report["schedule_same_as_default"]:
            continue  # the same program: timing it again would only measure noise

        def step(compiled=compiled, holder=[fresh_arguments()]):
            new_state, outputs = compiled(*holder[0])
            holder[0][0] = new_state
            return outputs

        variants[label] = (step, jax.block_until_ready)
    steps = WORKLOADS[name][1] * args.steps_scale
    times, busy = _time_interleaved(variants, steps, args.windows, args.max_in_flight)
    base = statistics.median(times["default"])
    for report in rows:
        if report["options"] not in times:
            report.update(ms=None, vs_default=None, windows_ms=[])
            continue
        ms = statistics.median(times[report["options"]])
        report["ms"] = ms * 1e3
        report["vs_default"] = ms / base
        report["windows_ms"] = [t * 1e3 for t in times[report["options"]]]
        report["cores_busy"] = statistics.median(busy[report["options"]])
        print(
            f"  [{devices}] {name} / {report['options']}: {report['allreduce_ops']} all-reduce(s), "
            f"{report['async_pairs']} async, max independent compute "
            f"{report['max_independent_compute']} of {report['compute_ops']}, {report['ms']:.2f} "
            f"ms/step (x{report['vs_default']:.3f})",
            file=sys.stderr, flush=True,
        )
    return rows


# -- the tables ---------------------------------------------------------------------------------


def _ms(value) -> str:
    return "not timed (same program)" if value is None else f"{value:.2f}"


def _markdown(results: list) -> str:
    env = results[0]["environment"]
    cores = env["host_cpus"]
    rows = [row for result in results for row in result["rows"]]
    rows.sort(key=lambda r: (list(WORKLOADS).index(r["workload"]), r["devices"]))
    single = {r["workload"]: r for r in rows if r["devices"] == 1}
    lines = [
        "| workload | devices | global batch | mirrax ms/step | hand-written ms/step "
        "| mirrax / hand-written | mirrax ex/s | speedup vs 1 device | ideal (weak) "
        f"| per-core efficiency ({cores} cores) | mirrax cores busy | hand-written ex/s "
        "| hand-written speedup | hand-written per-core efficiency | hand-written cores busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for row in rows:
        mirrax_rate = row["global_batch"] / row["mirrax_ms"] * 1e3
        hand_rate = row["global_batch"] / row["handwritten_ms"] * 1e3
        base = single.get(row["workload"])
        usable = min(row["devices"], cores)
        if base:
            base_mirrax = base["global_batch"] / base["mirrax_ms"] * 1e3
            base_hand = base["global_batch"] / base["handwritten_ms"] * 1e3
            speed = f"{mirrax_rate / base_mirrax:.2f}"
            eff = f"{mirrax_rate / (usable * base_mirrax):.2f}"
            hand_speed = f"{hand_rate / base_hand:.2f}"
            hand_eff = f"{hand_rate / (usable * base_hand):.2f}"
        else:
            speed = eff = hand_speed = hand_eff = "n/a"
        lines.append(
            f"| {row['workload']} | {row['devices']} | {row['global_batch']} "
            f"| {row['mirrax_ms']:.2f} | {row['handwritten_ms']:.2f} "
            f"| {row['mirrax_ms'] / row['handwritten_ms']:.3f} | {mirrax_rate:,.0f} | {speed} "
            f"| {row['devices']} | {eff} | {row['mirrax_cores_busy']:.2f} | {hand_rate:,.0f} "
            f"| {hand_speed} | {hand_eff} | {row['handwritten_cores_busy']:.2f} |"
        )
    first = rows[0]
    lines.append("")
    lines.append(
        f"{env['date']}; {overhead.environment_note(env)} Median of {first['windows']} "
        f"interleaved windows per variant, at most {first['max_in_flight']} steps in flight; "
        "per-replica batch fixed (CNN 32, MLP 32, transformer 8). Speedup = ex/s(N) / ex/s(1); "
        f"per-core efficiency = ex/s(N) / (min(N, {cores}) x ex/s(1)): the fake devices share "
        f"{cores} cores. Cores busy: this process's CPU time (all threads) / wall time over a "
        "window, median. 1-minute load average before / after each device count's run: "
        + ", ".join(
            f"{r['rows'][0]['devices']}: {r['environment']['load_average_before'][0]:.2f} / "
            f"{r['environment']['load_average_after'][0]:.2f}"
            for r in results
        )
        + "."
    )
    overlap = [r for result in results for r in result.get("overlap", [])]
    if overlap:
        lines += [
            "",
            "| workload | devices | XLA options | all-reduce ops | async (start/done) pairs "
            "| compute ops between start and done | compute ops scheduled before the first "
            "all-reduce | compute ops independent of the all-reduce (max over ops) "
            "| compute ops in the step | schedule = default | ms/step | vs default | cores busy |",
            "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for r in overlap:
            same = "-" if r["schedule_same_as_default"] is None else (
                "yes" if r["schedule_same_as_default"] else "no")
            options = ", ".join(f"`{k}={v}`" for k, v in r["xla"].items()) or "(none)"
            between = ", ".join(map(str, r["compute_between_start_done"])) or "n/a (synchronous)"
            lines.append(
                f"| {r['workload']} | {r['devices']} | {options} | {r['allreduce_ops']} "
                f"| {r['async_pairs']} | {between} | {r['compute_before_first_allreduce']} "
                f"| {r['max_independent_compute']} "
                f"| {r['compute_ops']} | {same} | {_ms(r['ms'])} "
                f"| {'n/a' if r['vs_default'] is None else format(r['vs_default'], '.3f')} "
                f"| {'n/a' if r['ms'] is None else format(r['cores_busy'], '.2f')} |"
            )
        lines.append("")
        lines.append(
            "Overlap: strategy.run's program compiled with each option set "
            "(`lowered.compile(compiler_options=...)`), read from `compiled.as_text()` (schedule "
            "order) and timed against the default compile, interleaved, by calling each "
            "`Compiled` on zero-filled arguments of the program's shapes (its new state fed "
            "back in). Independent = compute instructions that neither "
            "feed the all-reduce nor use its result: the only ones that can run beside it."
        )
    return "\n".join(lines)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,2,4,8",
                        help="comma-separated device counts; each runs in a fresh subprocess when "
                        "more than one is given (default: 1,2,4,8)")
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"],
                        help="cpu uses N fake host devices; gpu/tpu the first N local accelerators")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (default 5)")
    parser.add_argument("--steps-scale", type=int, default=1,
                        help="multiplies the steps per window (CNN 4, MLP 20, transformer 2)")
    parser.add_argument("--max-in-flight", type=int, default=2,
                        help="steps dispatched ahead of the last finished one (default 2)")
    parser.add_argument("--overlap-devices", type=int, default=4,
                        help="device count at which the all-reduce overlap is analysed (default 4)")
    parser.add_argument("--skip-overlap", action="store_true", help="only the scaling table")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    if min(args.windows, args.steps_scale, args.max_in_flight) < 1:
        parser.error("--windows, --steps-scale and --max-in-flight must be >= 1")
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    child_argv = overhead.forward_arguments(
        args,
        ("platform", "windows", "steps_scale", "max_in_flight", "overlap_devices"),
        ("skip_overlap",),
    )
    return overhead.run_benchmark(args, _measure, _markdown, child_argv, __file__)


if __name__ == "__main__":
    sys.exit(main())
