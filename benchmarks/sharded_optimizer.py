"""Sharded optimizer state (ZeRO-1): step time with and without it, and a model that fits only with it.

Part 1, step time: the train step of `models.strategy_run_step(packed=True)` (gradients from
`mirrax.value_and_grad`, so the sharded step reduce-scatters them; Adam) through
`strategy.run` on `MirroredStrategy(devices)` and on `MirroredStrategy(devices,
shard_optimizer_state=True)`, the three `models.WORKLOADS` at per-replica batch 32, interleaved
windows (order flipped every window), at most 2 steps in flight. Columns: median ms/step and
the median of same-window ratios sharded / unsharded.

Part 2 (`--big`), a model that does not fit without sharding: an MLP of `--big-layers` square
layers of width `--big-width` on the fake CPU devices of one process, which all share the
host's memory. XLA's per-device peak (arguments + outputs - aliased + temp) of the sharded
step is read, and of the unsharded one's one-layer twin times the layers (placing the whole
unsharded state would not fit); times the devices for the process. The sharded step then runs
`--big-steps` steps when its estimate fits in 80% of the machine's memory, and the process's
peak resident memory (`ru_maxrss`) is reported.

Usage:
  python -m benchmarks.sharded_optimizer                      # part 1, 4 fake CPU devices
  python -m benchmarks.sharded_optimizer --devices 2,4 --json out.json
  python -m benchmarks.sharded_optimizer --big --devices 8    # part 2 as well (minutes)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from benchmarks._harness import env, hlo, timing

MODULE = "benchmarks.sharded_optimizer"
STEPS = {"CNN": 10, "MLP 784-1024-1024-10": 20, "Transformer 4x256": 3}


def _measure(args, devices: int) -> dict:
    import jax
    from flax import nnx

    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    rows = []
    for name, (builder, make_batch) in models.WORKLOADS.items():
        global_batch = hlo.PER_REPLICA_BATCH * devices
        x, y = make_batch(global_batch)
        step = models.strategy_run_step(global_batch, packed=True)
        windows, losses = {}, {}
        for sharded in (False, True):
            strategy, model, optimizer, batch = models.mirrax_state(
                local, builder, x, y, shard_optimizer_state=sharded
            )

            def run(strategy=strategy, model=model, optimizer=optimizer, batch=batch):
                return strategy.run(step, args=(model, optimizer, batch))

            def block(out, state=(model, optimizer)):
                jax.block_until_ready((out, nnx.state(state)))

            def window(run=run, block=block):
                timing.run_steps(run, block, STEPS[name], 2)

            window()  # compiles
            windows["sharded" if sharded else "unsharded"] = window
            losses[sharded] = float(strategy.reduce("sum", run()))
        samples = timing.interleave(windows, args.windows, order="flip")
        row = {
            "workload": name,
            "devices": devices,
            "steps": STEPS[name],
            "windows": args.windows,
            "ms": timing.medians(samples, 1e3 / STEPS[name]),
            "ratio": timing.paired_ratio(samples, "sharded", "unsharded"),
            "next_loss": losses,
        }
        env.log(
            f"  [{devices}] {name}: {row['ms']['unsharded']:.2f} / "
            f"{row['ms']['sharded']:.2f} ms/step, ratio {row['ratio']:.3f}, next losses "
            f"{losses[False]:.6f} / {losses[True]:.6f}"
        )
        rows.append(row)
    result = {"environment": env.environment(local), "rows": rows}
    if args.big:
        result["big"] = _big(args, local)
    return result


def _big(args, local) -> dict:
    """Compiles the big MLP's step both ways; runs the sharded one if it fits."""
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks._harness import models

    width, layers, devices = args.big_width, args.big_layers, len(local)
    x, y = models.random_batch((width,), 8 * devices, classes=width)
    step = models.strategy_run_step(8 * devices, packed=True)
    report = {
        "width": width,
        "layers": layers,
        "devices": devices,
        "parameters": layers * (width * width + width),
    }
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    report["machine_bytes"] = memory
    for sharded in (True, False):
        # Unsharded, the full model's state would not fit on 8 fake devices of this machine:
        # compile its one-layer twin (every per-device term, state, gradients and activations,
        # grows by one layer's worth per layer) and scale by the layer count.
        count = layers if sharded else 1
        strategy, model, optimizer, batch = models.mirrax_state(
            local,
            lambda rngs: models.DenseStack((width,) * (count + 1), rngs),
            x,
            y,
            shard_optimizer_state=sharded,
        )
        analysis = (
            strategy.experimental_lower(step, args=(model, optimizer, batch)).compile().memory_analysis()
        )
        peak = (
            (
                analysis.argument_size_in_bytes
                + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes
                + analysis.temp_size_in_bytes
            )
            * layers
            // count
        )
        key = "sharded" if sharded else "unsharded"
        report[f"{key}_device_peak_bytes"] = peak
        report[f"{key}_process_estimate_bytes"] = peak * devices
        env.log(
            f"  big MLP {layers}x{width} ({report['parameters']:,} parameters), {key}: "
            f"{peak / 2**30:.2f} GiB per device, {peak * devices / 2**30:.1f} GiB for the "
            f"process; the machine has {memory / 2**30:.1f} GiB"
        )
        if sharded and peak * devices < 0.8 * memory:
            start = time.perf_counter()
            losses = [
                float(strategy.reduce("sum", strategy.run(step, args=(model, optimizer, batch))))
                for _ in range(args.big_steps)
            ]
            report["sharded_losses"] = losses
            report["sharded_seconds_per_step"] = (time.perf_counter() - start) / args.big_steps
            mu = jax.tree.leaves(nnx.state(optimizer.opt_state))[1]
            report["moment_shard_rows"] = [s.data.shape[0] for s in mu.addressable_shards]
        del strategy, model, optimizer, batch
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["losses_finite"] = bool(np.all(np.isfinite(report.get("sharded_losses", [np.nan]))))
    return report


def _markdown(results: list) -> str:
    rows = [r for result in results for r in result["rows"]]
    lines = env.markdown_table(
        [
            "workload",
            "replicas",
            "steps/window",
            "unsharded ms/step",
            "sharded ms/step",
            "sharded / unsharded",
        ],
        [
            [
                r["workload"],
                r["devices"],
                r["steps"],
                f"{r['ms']['unsharded']:.2f}",
                f"{r['ms']['sharded']:.2f}",
                f"{r['ratio']:.3f}",
            ]
            for r in rows
        ],
    )
    lines += [
        "",
        f"{env.environment_note(results[0]['environment'])} Per-replica batch "
        f"{hlo.PER_REPLICA_BATCH}, Adam, gradients from mirrax.value_and_grad; medians "
        f"of {rows[0]['windows']} interleaved windows per variant.",
    ]
    big = [result["big"] for result in results if "big" in result]
    for b in big:
        gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
        ran = "sharded_losses" in b
        lines += [
            "",
            f"A model that fits only sharded: MLP {b['layers']} x {b['width']}^2 "
            f"({b['parameters']:,} parameters, float32, Adam) on {b['devices']} fake CPU "
            f"devices sharing {gib(b['machine_bytes'])} GiB:",
            "",
        ]
        lines += env.markdown_table(
            ["", "per-device peak GiB (XLA)", "process estimate GiB", "ran"],
            [
                [
                    "unsharded",
                    gib(b["unsharded_device_peak_bytes"]),
                    gib(b["unsharded_process_estimate_bytes"]),
                    "no (compiled only)",
                ],
                [
                    "sharded",
                    gib(b["sharded_device_peak_bytes"]),
                    gib(b["sharded_process_estimate_bytes"]),
                    f"{len(b['sharded_losses'])} steps, {b['sharded_seconds_per_step']:.1f} s/step, "
                    f"losses {', '.join(f'{v:.4f}' for v in b['sharded_losses'])}; process peak "
                    f"RSS {gib(b['peak_rss_bytes'])} GiB"
                    if ran
                    else "no: estimate above 80%",
                ],
            ],
            ["l", "r", "r", "l"],
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="4")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--big", action="store_true", help="part 2: the big MLP")
    parser.add_argument("--big-width", type=int, default=7168, help="its width (7168)")
    parser.add_argument("--big-layers", type=int, default=4, help="its layers (4)")
    parser.add_argument("--big-steps", type=int, default=3, help="sharded steps it runs (3)")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    child_argv = env.forward_arguments(
        args, ("platform", "windows", "big_width", "big_layers", "big_steps"), ("big",)
    )
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
