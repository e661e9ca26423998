"""Replica-invariant mode vs the default: step time of strategy.run and Model.fit, and the step's collectives.

Per workload and replica count, from the same weights and global batch of 128: a `strategy.run`
step (`mirrax.value_and_grad`, `compute_average_loss`, Adam 1e-3) and `Model.fit` on `steps`
copies of the batch (timed between the epoch callbacks), each on a default `MirroredStrategy`
and on one with `replica_invariant=True, micro_batches=8`; one untimed window per variant, then
`--repeats` rotated rounds. Columns: median ms/step, the median of same-round ratios invariant /
default (target, CNN at 4 replicas: <= 1.3) and per mode the strategy.run program's collectives.

Usage:
  python -m benchmarks.replica_invariant                      # 1 and 4 fake CPU devices
  python -m benchmarks.replica_invariant --devices 4 --workloads cnn --repeats 3
  python -m benchmarks.replica_invariant --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks._harness import env, hlo, timing

MODULE = "benchmarks.replica_invariant"
GLOBAL_BATCH = 128
MICRO_BATCHES = 8
# short name -> (models.WORKLOADS key, steps per window)
WORKLOADS = {"cnn": ("CNN", 10), "mlp": ("MLP 784-1024-1024-10", 20)}
MODES = ("default", "invariant")
VARIANTS = ("run_default", "run_invariant", "fit_default", "fit_invariant")


def _collectives(compiled_text: str) -> dict:
    """{opcode: [count, bytes per replica]} of a compiled program's collectives."""
    found = {}
    for opcode, arrays in hlo.collectives(compiled_text):
        count, nbytes = found.get(op := opcode.replace("-start", ""), (0, 0))
        found[op] = [count + 1, nbytes + sum(map(hlo.nbytes, arrays))]
    return found


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import mirrax
    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)

    def ready_at(out, *nnx_objects):  # the time once `out` and the objects' state are computed
        jax.block_until_ready((out, nnx.state(nnx_objects)))
        return time.perf_counter()

    def step(model, optimizer, batch):
        def loss_fn(model, batch):  # an argument: the invariant mode splits it into micro-batches
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1])
            return mirrax.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        loss, grads = mirrax.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    def make_variants(module_cls, x, y, steps, invariant):  # -> (run window, fit window, report)
        options = {"replica_invariant": invariant, "micro_batches": MICRO_BATCHES}
        strategy, model, optimizer, batch = models.mirrax_state(local, module_cls, x, y, **options)

        def run():
            return strategy.run(step, args=(model, optimizer, batch))

        def report():  # -> (collectives, the next step's loss)
            compiled = strategy.experimental_lower(step, args=(model, optimizer, batch)).compile()
            return _collectives(compiled.as_text()), float(strategy.reduce("sum", run()))

        with mirrax.MirroredStrategy(local, **options).scope():
            fit_model = mirrax.Model(module_cls(nnx.Rngs(0)))
            fit_model.compile(
                optimizer=optax.adam(1e-3), loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)

        def fit():
            stamps = []
            clock = mirrax.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: stamps.append(time.perf_counter()),
                on_epoch_end=lambda epoch, logs: stamps.append(
                    ready_at(None, fit_model.module, fit_model.optimizer.nnx_optimizer)
                ),
            )
            fit_model.fit(
                xs, ys, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[clock]
            )
            return stamps[1] - stamps[0]

        def run_window():  # timed from outside (it returns None), the final wait included
            timing.run_steps(run, lambda out: ready_at(out, model, optimizer), steps, 2)

        return run_window, fit, report

    rows = []
    for short in args.names:
        name, base_steps = WORKLOADS[short]
        steps = max(1, round(base_steps * args.steps_scale))
        module_cls, data = models.WORKLOADS[name]
        x, y = data(GLOBAL_BATCH)
        built = {mode: make_variants(module_cls, x, y, steps, mode == "invariant") for mode in MODES}
        windows = {
            f"{kind}_{mode}": built[mode][i] for i, kind in enumerate(("run", "fit")) for mode in MODES
        }
        for window in windows.values():  # compilation
            window()
        seconds = timing.interleave(windows, args.repeats, order="rotate")
        samples = {key: [t / steps for t in seconds[key]] for key in VARIANTS}
        reports = {mode: built[mode][2]() for mode in MODES}
        row = {
            "workload": name,
            "devices": devices,
            "global_batch": GLOBAL_BATCH,
            "micro_batches": MICRO_BATCHES,
            "steps_per_window": steps,
            "repeats": args.repeats,
            "ms_per_step": timing.medians(samples, 1e3),
            "run_ratio": timing.paired_ratio(samples, "run_invariant", "run_default"),
            "fit_ratio": timing.paired_ratio(samples, "fit_invariant", "fit_default"),
            "collectives": {mode: found for mode, (found, _) in reports.items()},
            "next_loss": {mode: loss for mode, (_, loss) in reports.items()},
            "samples_s": samples,
        }
        env.log(
            f"  [{devices} {args.platform}] {name}: "
            + ", ".join(f"{k} {ms:.2f}" for k, ms in row["ms_per_step"].items())
            + f" ms/step; run {row['run_ratio']:.3f}x, fit {row['fit_ratio']:.3f}x"
        )
        rows.append(row)
    return {"environment": env.environment(local), "rows": rows}


def _markdown(results: list) -> str:
    def describe(collectives: dict) -> str:
        return (
            ", ".join(
                f"{count} {op} ({nbytes / 1024:.0f} KiB)"
                for op, (count, nbytes) in sorted(collectives.items())
            )
            or "none"
        )

    header = [
        "workload",
        "replicas",
        "run ms/step default",
        "run ms/step invariant",
        "run invariant / default",
        "fit ms/step default",
        "fit ms/step invariant",
        "fit invariant / default",
        "collectives default",
        "collectives invariant",
    ]
    table = [
        [
            r["workload"],
            r["devices"],
            *(f"{r['ms_per_step'][key]:.2f}" for key in VARIANTS[:2]),
            f"{r['run_ratio']:.3f}",
            *(f"{r['ms_per_step'][key]:.2f}" for key in VARIANTS[2:]),
            f"{r['fit_ratio']:.3f}",
            describe(r["collectives"]["default"]),
            describe(r["collectives"]["invariant"]),
        ]
        for result in results
        for r in result["rows"]
    ]
    return "\n".join(
        env.markdown_table(header, table, ["l"] + ["r"] * 7 + ["l", "l"])
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} Global batch {GLOBAL_BATCH}, "
            f"micro_batches {MICRO_BATCHES}; median of {results[0]['rows'][0]['repeats']} rotated "
            "rounds; ratios are medians of same-round ratios. Collective bytes: operand bytes per "
            "replica of the compiled strategy.run program. Target (CNN, 4 replicas): <= 1.3.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,4")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--steps-scale", type=float, default=1.0, help="multiply every workload's steps per window by this"
    )
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if any(MICRO_BATCHES % n for n in args.device_counts):
        parser.error(
            f"--devices {args.devices}: every count must divide micro_batches="
            f"{MICRO_BATCHES}; use 1, 2, 4 or 8"
        )
    args.names = env.names_option(parser, "--workloads", args.workloads, list(WORKLOADS))
    if not args.names or args.repeats < 1 or args.steps_scale <= 0:
        parser.error(
            f"--workloads must name one of {', '.join(WORKLOADS)}, --repeats be >= 1 and "
            f"--steps-scale > 0; got {args.workloads!r}, {args.repeats}, {args.steps_scale}"
        )
    child_argv = env.forward_arguments(args, ("platform", "workloads", "repeats", "steps_scale"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
