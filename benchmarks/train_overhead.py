"""strategy.run and Model.fit against the hand-written step, on the CNN, MLP and transformer at global batch 128.

Issue 6's overhead measurement: what mirrax costs over the same training step written by hand,
on three real models, at global batch 128, on 1 and 4 fake CPU devices. Four variants per
workload and device count, all from the same initial weights, on the same data:

- **hand-written, donated**: `workloads.make_handwritten(..., donate=True)`: `nnx.split` once,
  then `jax.jit(jax.shard_map(step), donate_argnums=0)` on the flat state and one
  device-resident global batch: the floor a JAX expert writes.
- **hand-written**: the same without `donate_argnums` (on XLA:CPU donation can cost time; the
  faster of the two is reported as "floor").
- **strategy.run**: `MirroredStrategy` over the devices, model and `nnx.Optimizer(adam 1e-3)`
  built under `strategy.scope()`, `strategy.run(workloads.strategy_run_step(128), args=(model,
  optimizer, batch))` on one `PerReplica` batch reused every step (input not measured).
- **fit**: `mirrax.Model(module)` compiled with adam 1e-3 and
  `SparseCategoricalCrossentropy(from_logits=True)`, `model.fit(x, y, batch_size=128,
  epochs=1, verbose=0, shuffle=False)` on `steps` copies of that same batch (its input
  pipeline, loss tracker, callbacks and logs included: what a Keras user runs). Timed from
  `on_epoch_begin` to `on_epoch_end` plus a wait for the whole model and optimizer state.

Workloads (`communication.WORKLOADS`): the TF tutorial CNN (28x28x1), the MLP 784-1024-1024-10,
and a 4-layer pre-LayerNorm transformer encoder (d_model 256, 4 heads, MLP 1024, sequence 64).

Method: every variant compiles and runs one untimed window; then `--repeats` rounds, each
running every variant for one window of `steps` steps (CNN 10, MLP 30, transformer 3 by
default), the order of the variants rotating every round. A window ends when the last step's
output and the whole state are ready; at most 2 steps run ahead of the last finished one in the
hand-written and strategy.run windows (XLA:CPU's in-process all-reduce deadlocks with ~100
queued steps; fit caps itself). Reported: median ms/step per variant, and the medians of
same-round ratios against the donated hand-written step and against the floor (the faster
hand-written variant of that round). Target: <= 1.03. After timing, each variant's loss on its
next step is printed (they agree: all four train the same model the same way).

Usage:
  python benchmarks/train_overhead.py                      # 1 and 4 fake CPU devices, ~6 min
  python benchmarks/train_overhead.py --devices 4 --workloads mlp
  python benchmarks/train_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import overhead

GLOBAL_BATCH = 128
TARGET_RATIO = 1.03
WORKLOADS = {  # short name -> (communication.WORKLOADS key, steps per window)
    "cnn": ("CNN", 10),
    "mlp": ("MLP 784-1024-1024-10", 30),
    "transformer": ("Transformer 4x256", 3),
}
VARIANTS = ("handwritten_donated", "handwritten", "run", "fit")
LABELS = {
    "handwritten_donated": "hand-written, donated",
    "handwritten": "hand-written",
    "run": "strategy.run",
    "fit": "fit",
}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,4",
                        help="comma-separated replica counts, one fresh subprocess each (default 1,4)")
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"],
                        help="cpu uses N fake host devices; gpu/tpu the first N accelerators")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply every workload's steps per window by this")
    parser.add_argument("--max-in-flight", type=int, default=2,
                        help="steps dispatched ahead of the last finished one (default 2; 0: one at a time)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    overhead.check_divides(parser, args, {"": GLOBAL_BATCH})
    args.names = [w.strip().lower() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.names if w not in WORKLOADS]
    if unknown or not args.names:
        parser.error(f"--workloads {args.workloads!r}: unknown {unknown or 'empty list'}; "
                     f"choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; received {args.repeats}")
    if args.max_in_flight < 0:
        parser.error(f"--max-in-flight must be >= 0 (0: one step at a time); received "
                     f"{args.max_in_flight}")
    if args.steps_scale <= 0:
        parser.error(f"--steps-scale must be > 0; received {args.steps_scale}")
    return args


def _child_argv(args) -> list:
    return overhead.forward_arguments(
        args, ("platform", "workloads", "repeats", "steps_scale", "max_in_flight"), ())


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import communication
    import mirrax
    import workloads

    local = overhead.local_devices(args.platform, devices, "train_overhead.py")

    def wait_for(model, optimizer, out=None):
        jax.block_until_ready((out, nnx.state((model, optimizer))))

    def make_run(module_cls, x, y):
        strategy, model, optimizer, batch = workloads.mirrax_state(local, module_cls, x, y)
        train_step = workloads.strategy_run_step(GLOBAL_BATCH)

        def window(steps):
            in_flight = collections.deque()
            for _ in range(steps):
                in_flight.append(strategy.run(train_step, args=(model, optimizer, batch)))
                while len(in_flight) > args.max_in_flight:
                    last = in_flight.popleft()
                    jax.block_until_ready(last)
            wait_for(model, optimizer, in_flight[-1] if in_flight else last)

        def next_loss():
            return float(strategy.reduce(
                "sum", strategy.run(train_step, args=(model, optimizer, batch))))

        return window, next_loss

    def make_fit(module_cls, x, y, steps):
        strategy = mirrax.MirroredStrategy(local)
        with strategy.scope():
            model = mirrax.Model(module_cls(nnx.Rngs(0)))
            model.compile(optimizer=optax.adam(1e-3),
                          loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
        xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)

        class EpochClock(mirrax.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.begin = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                wait_for(model.module, model.optimizer.nnx_optimizer)
                self.seconds = time.perf_counter() - self.begin

        def window(steps_):
            clock = EpochClock()
            model.fit(xs, ys, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=[clock])
            return clock.seconds

        def next_loss():
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
            return history.history["loss"][0]

        return window, next_loss

    def make_handwritten(module_cls, x, y, donate):
        step, block, loss_of = workloads.make_handwritten(
            module_cls, x, y, GLOBAL_BATCH, local, donate=donate)

        def window(steps):
            workloads.run_steps(step, block, steps, args.max_in_flight)

        def next_loss():
            out = step()
            block(out)
            return loss_of(out)

        return window, next_loss

    rows = []
    for short in args.names:
        name, base_steps = WORKLOADS[short]
        steps = max(1, round(base_steps * args.steps_scale))
        module_cls, data = communication.WORKLOADS[name]
        x, y = data(GLOBAL_BATCH)
        variants = {
            "handwritten_donated": make_handwritten(module_cls, x, y, True),
            "handwritten": make_handwritten(module_cls, x, y, False),
            "run": make_run(module_cls, x, y),
            "fit": make_fit(module_cls, x, y, steps),
        }

        def timed(key):
            start = time.perf_counter()
            inner = variants[key][0](steps)
            # fit's own clock excludes the fit() call's set-up around its one epoch.
            return (inner if inner is not None else time.perf_counter() - start) / steps

        compile_s = {}
        for key in VARIANTS:
            start = time.perf_counter()
            variants[key][0](steps)
            compile_s[key] = time.perf_counter() - start
        samples = {key: [] for key in VARIANTS}
        for round_ in range(args.repeats):
            shift = round_ % len(VARIANTS)
            for key in VARIANTS[shift:] + VARIANTS[:shift]:
                samples[key].append(timed(key))
        losses = {key: variants[key][1]() for key in VARIANTS}

        def paired(key, reference):
            return statistics.median(
                a / reference(i) for i, a in enumerate(samples[key]))

        donated = lambda i: samples["handwritten_donated"][i]  # noqa: E731
        floor = lambda i: min(samples["handwritten_donated"][i], samples["handwritten"][i])  # noqa: E731
        row = {
            "workload": name,
            "devices": devices,
            "global_batch": GLOBAL_BATCH,
            "steps_per_window": steps,
            "repeats": args.repeats,
            "ms_per_step": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
            "run_vs_donated": paired("run", donated),
            "fit_vs_donated": paired("fit", donated),
            "run_vs_floor": paired("run", floor),
            "fit_vs_floor": paired("fit", floor),
            "samples_s": samples,
            "first_window_s": compile_s,
            "next_loss": losses,
        }
        ms = row["ms_per_step"]
        print(
            f"  [{devices} {args.platform}] {name}: "
            + ", ".join(f"{LABELS[k]} {ms[k]:.2f}" for k in VARIANTS)
            + f" ms/step; run/floor {row['run_vs_floor']:.3f}, fit/floor {row['fit_vs_floor']:.3f};"
            + " next loss " + " / ".join(f"{losses[k]:.6f}" for k in VARIANTS),
            file=sys.stderr, flush=True,
        )
        rows.append(row)
    return {"environment": overhead.environment(jax, local), "rows": rows}


def _markdown(results: list) -> str:
    lines = [
        "| workload | replicas | steps/window | hand-written, donated ms/step | hand-written ms/step "
        "| strategy.run ms/step | fit ms/step | strategy.run / donated | fit / donated "
        "| strategy.run / floor | fit / floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for row in result["rows"]:
            ms = row["ms_per_step"]
            lines.append(
                f"| {row['workload']} | {row['devices']} | {row['steps_per_window']} "
                + "".join(f"| {ms[k]:.2f} " for k in VARIANTS)
                + f"| {row['run_vs_donated']:.3f} | {row['fit_vs_donated']:.3f} "
                f"| {row['run_vs_floor']:.3f} | {row['fit_vs_floor']:.3f} |"
            )
    first = results[0]["rows"][0]
    lines += [
        "",
        f"{overhead.environment_note(results[0]['environment'])} Global batch {GLOBAL_BATCH}; "
        f"median of {first['repeats']} rotated rounds; ratios are medians of same-round ratios; "
        f"floor = the faster hand-written variant of the round. Target <= {TARGET_RATIO}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    return overhead.run_benchmark(args, _measure, _markdown, _child_argv(args), __file__)


if __name__ == "__main__":
    sys.exit(main())
