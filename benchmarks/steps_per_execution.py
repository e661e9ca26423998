"""What `compile(steps_per_execution=k)` costs and saves in `Model.fit`: compile time, and wall
and host time per step, for k = 1, 8, 32 and 100.

The workload is the host-bound one `steps_per_execution` exists for: a tiny MLP 32-64-10
(Adam 1e-3, sparse cross-entropy) at a global batch of 8, `--steps` steps per epoch from NumPy
arrays, no shuffling, `verbose=0`. Each k has its own model (same initial weights and data).

- compile: the seconds JAX spends tracing, lowering and compiling during the model's first
  epoch (the sum of jax.monitoring's `jaxpr_trace`, `jaxpr_to_mlir_module` and
  `backend_compile` durations), once per k. With k > 1, mirrax runs the k steps of a call as
  one `jax.lax.scan` (training/multi_step.py, `make_multi_step`), so it should stay near k = 1's;
  the unrolled form of earlier releases grew with k.
- wall / host per step: an epoch's wall time, and the main thread's CPU time
  (`time.thread_time`: what the host spends dispatching), each over `--steps`.

Timing: one untimed epoch per k (it compiles), then `--repeats` rounds timing each k's epoch
once, the order rotating; reported: medians, and the ratios to k = 1 of the medians.

Usage:
  python -m benchmarks.steps_per_execution                 # 1 and 4 fake CPU devices
  python -m benchmarks.steps_per_execution --devices 1 --repeats 3 --steps 400
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks._harness import env, timing

MODULE = "benchmarks.steps_per_execution"
KS = (1, 8, 32, 100)
GLOBAL_BATCH = 8
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import mirrax

    class TinyMLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(32, 64, rngs=rngs)
            self.out = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    compiling = {"seconds": 0.0}

    def listen(event, seconds, **kwargs):
        if event in _COMPILE_EVENTS:
            compiling["seconds"] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    local = env.local_devices(args.platform, devices, MODULE)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * args.steps, 32)).astype(np.float32)
    y = rng.integers(0, 10, GLOBAL_BATCH * args.steps).astype(np.int32)
    strategy = mirrax.MirroredStrategy(local)

    def make(k):
        with strategy.scope():
            model = mirrax.Model(TinyMLP(nnx.Rngs(0)))
            model.compile(
                optax.adam(1e-3),
                mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=k,
            )
        return model

    host: dict = {k: [] for k in KS}

    def window_of(k, model):
        def window():
            stamps: list = []

            def begin(epoch, logs):
                stamps.extend([time.perf_counter(), time.thread_time()])

            def end(epoch, logs):
                float(logs["loss"])  # waits for the epoch's last step
                stamps.extend([time.perf_counter(), time.thread_time()])

            clock = mirrax.callbacks.LambdaCallback(on_epoch_begin=begin, on_epoch_end=end)
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
            host[k].append((stamps[3] - stamps[1]) / args.steps)
            return stamps[2] - stamps[0]

        return window

    compile_s, windows = {}, {}
    for k in KS:
        model = make(k)
        windows[k] = window_of(k, model)
        compiling["seconds"] = 0.0
        windows[k]()
        compile_s[k] = compiling["seconds"]
        host[k].clear()
    seconds = timing.interleave(windows, args.repeats, order="rotate")
    wall = {k: [t / args.steps for t in seconds[k]] for k in KS}
    row = {
        "devices": devices,
        "steps_per_window": args.steps,
        "repeats": args.repeats,
        "compile_s": compile_s,
        "wall_us_per_step": timing.medians(wall, 1e6),
        "host_us_per_step": timing.medians(host, 1e6),
        "samples_s": wall,
    }
    env.log(
        f"  [{devices} {args.platform}] "
        + "; ".join(
            f"k={k}: compile {compile_s[k]:.2f} s, {row['wall_us_per_step'][k]:.0f} us/step wall, "
            f"{row['host_us_per_step'][k]:.0f} host"
            for k in KS
        )
    )
    return {"environment": env.environment(local), "rows": [row]}


def _markdown(results: list) -> str:
    header = [
        "replicas",
        "k",
        "compile s",
        "compile / k=1",
        "wall us/step",
        "host us/step",
        "host / k=1",
    ]
    table = []
    for result in results:
        for r in result["rows"]:
            compile_s, wall, host = r["compile_s"], r["wall_us_per_step"], r["host_us_per_step"]
            one = str(KS[0]) if str(KS[0]) in compile_s else KS[0]  # JSON keys are strings
            for k in compile_s:
                table.append(
                    [
                        r["devices"],
                        k,
                        f"{compile_s[k]:.2f}",
                        f"{compile_s[k] / compile_s[one]:.2f}",
                        f"{wall[k]:.0f}",
                        f"{host[k]:.0f}",
                        f"{host[k] / host[one]:.3f}",
                    ]
                )
    first = results[0]["rows"][0]
    return "\n".join(
        env.markdown_table(header, table)
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} Tiny MLP 32-64-10, global batch "
            f"{GLOBAL_BATCH}, {first['steps_per_window']} steps per epoch; median of "
            f"{first['repeats']} rotated rounds.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,4")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps", type=int, default=800, help="steps per epoch (default 800)")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if args.repeats < 1 or args.steps < max(KS):
        parser.error(f"--repeats must be >= 1 and --steps >= {max(KS)}; got {args.repeats}, {args.steps}")
    child_argv = env.forward_arguments(args, ("platform", "repeats", "steps"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
