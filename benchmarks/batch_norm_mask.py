"""What masking batch statistics to the real rows costs a full batch: `Model.fit`'s step of a
BatchNorm model with mirrax's row-masked statistics vs the same step without them.

The model: a CNN of two 3x3 convolutions (32 and 64 channels), each followed by
`nnx.BatchNorm` and ReLU, then global average pooling and a dense layer of 10, on 16x16x3
random images, 32 per replica, sparse cross-entropy, SGD 0.1. Variants, per device count:

- `masked`: `Model.fit` as shipped: while the step is traced, `nnx.BatchNorm` computes its
  statistics over the rows the batch mask marks real (docs/design.md, "Padded batches and
  batch-wide layers"), beside its own, and selects its own on a full batch.
- `plain`: the same model and fit, its step traced with the masking switched off (the
  context manager replaced by a no-op for that model's first, compiling, step), so BatchNorm
  computes only its own statistics.

Every batch is full, so both give the same statistics; the ratio masked / plain is the cost of
the extra reductions and the `where`. Timing: one untimed epoch per variant (it compiles), then
`--repeats` rounds timing each variant's epoch of `--steps` steps once, the order rotating;
reported: median ms/step and the median of same-round ratios masked / plain.

Usage:
  python -m benchmarks.batch_norm_mask                      # 1 and 4 fake CPU devices
  python -m benchmarks.batch_norm_mask --devices 4 --repeats 3 --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from benchmarks._harness import env, timing

MODULE = "benchmarks.batch_norm_mask"
BATCH_PER_REPLICA = 32
VARIANTS = ("masked", "plain")


def _measure(args, devices: int) -> dict:
    import numpy as np
    import optax
    from flax import nnx

    import mirrax
    from mirrax._src.distribute import batch_stats

    class BatchNormCNN(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(3, 32, (3, 3), rngs=rngs)
            self.bn1 = nnx.BatchNorm(32, rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
            self.bn2 = nnx.BatchNorm(64, rngs=rngs)
            self.head = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn1(self.conv1(x)))
            x = nnx.relu(self.bn2(self.conv2(x)))
            return self.head(x.mean(axis=(1, 2)))

    local = env.local_devices(args.platform, devices, MODULE)
    gb = BATCH_PER_REPLICA * devices
    rng = np.random.default_rng(0)
    x = rng.standard_normal((gb * args.steps, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 10, gb * args.steps).astype(np.int32)
    strategy = mirrax.MirroredStrategy(local)

    def make():
        with strategy.scope():
            model = mirrax.Model(BatchNormCNN(nnx.Rngs(0)))
            model.compile(optax.sgd(0.1), mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def window_of(model):
        def window():
            stamps = []
            clock = mirrax.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: stamps.append(time.perf_counter()),
                on_epoch_end=lambda epoch, logs: (float(logs["loss"]), stamps.append(time.perf_counter())),
            )
            model.fit(x, y, batch_size=gb, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
            return stamps[1] - stamps[0]

        return window

    windows = {"masked": window_of(make()), "plain": window_of(make())}
    windows["masked"]()  # compiles with the masking
    shipped = batch_stats.masked_batch_layers
    batch_stats.masked_batch_layers = contextlib.nullcontext  # traced once, without it
    try:
        windows["plain"]()
    finally:
        batch_stats.masked_batch_layers = shipped
    seconds = timing.interleave(windows, args.repeats, order="rotate")
    samples = {key: [t / args.steps for t in seconds[key]] for key in VARIANTS}
    row = {
        "devices": devices,
        "global_batch": gb,
        "steps_per_window": args.steps,
        "repeats": args.repeats,
        "ms_per_step": timing.medians(samples, 1e3),
        "ratio": timing.paired_ratio(samples, "masked", "plain"),
        "samples_s": samples,
    }
    env.log(
        f"  [{devices} {args.platform}] "
        + ", ".join(f"{k} {ms:.3f}" for k, ms in row["ms_per_step"].items())
        + f" ms/step; masked/plain {row['ratio']:.3f}x"
    )
    return {"environment": env.environment(local), "rows": [row]}


def _markdown(results: list) -> str:
    header = ["replicas", "global batch", "masked ms/step", "plain ms/step", "masked / plain"]
    table = [
        [
            r["devices"],
            r["global_batch"],
            *(f"{r['ms_per_step'][key]:.3f}" for key in VARIANTS),
            f"{r['ratio']:.3f}",
        ]
        for result in results
        for r in result["rows"]
    ]
    first = results[0]["rows"][0]
    return "\n".join(
        env.markdown_table(header, table)
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} {first['steps_per_window']} steps "
            f"per window; median of {first['repeats']} rotated rounds; the ratio is the median of "
            "same-round ratios.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,4")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--steps", type=int, default=40, help="steps per window (default 40)")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if args.repeats < 1 or args.steps < 2:
        parser.error(f"--repeats must be >= 1 and --steps >= 2; got {args.repeats}, {args.steps}")
    child_argv = env.forward_arguments(args, ("platform", "repeats", "steps"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
