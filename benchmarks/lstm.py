"""The LSTM example's `Model.fit` step time under MirroredStrategy vs a hand-written jax.jit step.

The model, data and batch are examples/time_series_lstm.py's: `keras.Sequential` of LSTM 16 and
Dense 1 on windows of `WINDOW` (24) values of the noisy sine, mean squared error, Adam 1e-2,
16 examples per replica (global batch 16 at 1 device, 64 at 4). Variants, per device count:

- `fit`: `mirrax.Model.fit` (as the example builds and compiles it) for one epoch of `--steps`
  batches, timed from its epoch-begin hook to its epoch-end hook (which reads the loss, so the
  last step has finished).
- `hand`: the same Keras model's `stateless_call` + `jax.value_and_grad` + `optax.adam(1e-2)`
  in one `jax.jit` with the state donated; every step `device_put`s its NumPy slice of the same
  arrays (at 4 devices sharded over a 4-device mesh with `NamedSharding`, state replicated).
- `hand_placed`: the same jitted step on batches placed on the devices before the window.

Timing: one untimed window per variant (it compiles), then `--repeats` rounds timing every
variant once, the order rotating; at most 2 hand-written steps run ahead. Reported: median
ms/step and medians of same-round ratios fit / hand (target <= 1.10) and fit / hand_placed.
One subprocess per device count.

Usage:
  python -m benchmarks.lstm                      # 1 and 4 fake CPU devices
  python -m benchmarks.lstm --devices 4 --repeats 3 --steps 40
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks._harness import env, timing

MODULE = "benchmarks.lstm"
BATCH_PER_REPLICA = 16  # the example's default batch_size_per_replica
VARIANTS = ("fit", "hand", "hand_placed")
TARGET = 1.10


def _measure(args, devices: int) -> dict:
    os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported: mirrax runs JAX
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from keras import layers
    from mirrax.examples.time_series_lstm import WINDOW, sine_windows

    import mirrax

    local = env.local_devices(args.platform, devices, MODULE)
    gb = BATCH_PER_REPLICA * devices
    x, y = sine_windows(gb * args.steps)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input(shape=(WINDOW, 1)), layers.LSTM(16), layers.Dense(1)])

    # -- mirrax: the example's model, compile and fit
    strategy = mirrax.MirroredStrategy(local)
    with strategy.scope():
        model = mirrax.Model(build())
        model.compile(loss="mse", optimizer=keras.optimizers.Adam(learning_rate=1e-2))

    def fit_window():
        stamps = []
        clock = mirrax.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: stamps.append(time.perf_counter()),
            on_epoch_end=lambda epoch, logs: (float(logs["loss"]), stamps.append(time.perf_counter())),
        )
        model.fit(x, y, batch_size=gb, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
        return stamps[1] - stamps[0]

    # -- hand-written: one jitted step over the same model's stateless_call
    mesh = jax.sharding.Mesh(np.array(local), ("batch",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    net = build()
    optimizer = optax.adam(1e-2)
    trainable = [jax.device_put(v.value, replicated) for v in net.trainable_variables]
    frozen = [jax.device_put(v.value, replicated) for v in net.non_trainable_variables]
    state = [trainable, frozen, jax.device_put(optimizer.init(trainable), replicated)]

    def loss_fn(trainable, frozen, xb, yb):
        pred, frozen = net.stateless_call(trainable, frozen, xb, training=True)
        return jnp.mean(jnp.square(pred - yb)), frozen

    def step(trainable, frozen, opt_state, xb, yb):
        (loss, frozen), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), frozen, opt_state, loss

    step_fn = jax.jit(step, donate_argnums=(0, 1, 2))
    slices = [(x[i * gb : (i + 1) * gb], y[i * gb : (i + 1) * gb]) for i in range(args.steps)]
    placed = [tuple(jax.device_put(a, sharded) for a in pair) for pair in slices]

    def hand_window(batches, put):
        def window():
            it = iter(batches)

            def one():
                xb, yb = next(it)
                if put:
                    xb, yb = jax.device_put(xb, sharded), jax.device_put(yb, sharded)
                state[0], state[1], state[2], loss = step_fn(*state, xb, yb)
                return loss

            start = time.perf_counter()
            timing.run_steps(one, jax.block_until_ready, args.steps, 2)
            jax.block_until_ready(state)
            return time.perf_counter() - start

        return window

    windows = {
        "fit": fit_window,
        "hand": hand_window(slices, True),
        "hand_placed": hand_window(placed, False),
    }
    for window in windows.values():  # compilation
        window()
    seconds = timing.interleave(windows, args.repeats, order="rotate")
    samples = {key: [t / args.steps for t in seconds[key]] for key in VARIANTS}
    row = {
        "devices": devices,
        "global_batch": gb,
        "steps_per_window": args.steps,
        "repeats": args.repeats,
        "ms_per_step": timing.medians(samples, 1e3),
        "ratio_hand": timing.paired_ratio(samples, "fit", "hand"),
        "ratio_placed": timing.paired_ratio(samples, "fit", "hand_placed"),
        "samples_s": samples,
    }
    env.log(
        f"  [{devices} {args.platform}] "
        + ", ".join(f"{k} {ms:.3f}" for k, ms in row["ms_per_step"].items())
        + f" ms/step; fit/hand {row['ratio_hand']:.3f}x, fit/placed {row['ratio_placed']:.3f}x"
    )
    return {"environment": env.environment(local), "rows": [row]}


def _markdown(results: list) -> str:
    header = [
        "replicas",
        "global batch",
        "fit ms/step",
        "hand ms/step",
        "hand_placed ms/step",
        "fit / hand",
        "fit / hand_placed",
    ]
    table = [
        [
            r["devices"],
            r["global_batch"],
            *(f"{r['ms_per_step'][key]:.3f}" for key in VARIANTS),
            f"{r['ratio_hand']:.3f}",
            f"{r['ratio_placed']:.3f}",
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
            f"per window; median of {first['repeats']} rotated rounds; ratios are medians of "
            f"same-round ratios. Target: fit / hand <= {TARGET}.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,4")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--steps", type=int, default=100, help="steps per window (default 100)")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if args.repeats < 1 or args.steps < 2:
        parser.error(f"--repeats must be >= 1 and --steps >= 2; got {args.repeats}, {args.steps}")
    child_argv = env.forward_arguments(args, ("platform", "repeats", "steps"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
