"""The floor of issue 31's design for replica-invariant mode on one device: one program per
micro-batch run `micro_batches` times, then one program that adds their gradients in the
pairwise tree and applies Adam, each compiled with XLA's passes on, against the default step.

Per workload (the harness's CNN and MLP 784-1024-1024-10, global batch 128, Adam 1e-3, sparse
cross-entropy over the global batch), from the same weights and batch:

- `default`: one jitted step, `jax.grad` over the 128 rows and the update.
- `multi`: `micro_batches` dispatches of one jitted gradient over 128 / micro_batches rows,
  then one jitted program summing the gradients pairwise ((g0 + g1) + (g2 + g3)) ...) and
  applying the update: what a device runs at one replica, the programs the same at every
  replica count (no mirrax code: the arithmetic and dispatches alone).

No bitwise check here (one device); it measures what the design costs before mirrax's own
code. Timing: one untimed window per variant, then `--repeats` rotated rounds of `--steps`
steps; median ms/step and the median of same-round ratios multi / default.

Usage:
  python -m benchmarks.micro_batch_floor
  python -m benchmarks.micro_batch_floor --workloads mlp --repeats 3
"""

from __future__ import annotations

import argparse
import sys

from benchmarks._harness import env, timing

MODULE = "benchmarks.micro_batch_floor"
GLOBAL_BATCH = 128
WORKLOADS = {"cnn": ("CNN", (28, 28, 1)), "mlp": ("WideMLP", (784,))}
VARIANTS = ("default", "multi")


def _measure(args, devices: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    rows = []
    for name in args.workloads.split(","):
        builder, shape = WORKLOADS[name]
        graphdef, params = nnx.split(getattr(models, builder)(nnx.Rngs(0)))
        adam = optax.adam(1e-3)
        x, y = (jax.device_put(a, local[0]) for a in models.random_batch(shape, GLOBAL_BATCH))
        size = GLOBAL_BATCH // args.micro_batches

        def loss(p, xb, yb):
            logits = nnx.merge(graphdef, p)(xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum() / GLOBAL_BATCH

        @jax.jit
        def default_step(p, s):
            updates, s = adam.update(jax.grad(loss)(p, x, y), s, p)
            return optax.apply_updates(p, updates), s

        micro = jax.jit(jax.grad(loss))

        @jax.jit
        def combine(p, s, grads):
            parts = list(grads)
            while len(parts) > 1:  # the balanced pairwise tree over the micro-batch index
                parts = [jax.tree.map(jnp.add, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
            updates, s = adam.update(parts[0], s, p)
            return optax.apply_updates(p, updates), s

        cut = [
            (x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(args.micro_batches)
        ]

        def multi_step(p, s):
            return combine(p, s, [micro(p, xb, yb) for xb, yb in cut])

        def window_of(step):
            def window():
                state = (params, adam.init(params))
                for _ in range(args.steps):
                    state = step(*state)
                jax.block_until_ready(state)

            return window

        windows = {"default": window_of(default_step), "multi": window_of(multi_step)}
        for window in windows.values():
            window()  # compiles
        timed = {key: (lambda w=w: (w(), None)[1]) for key, w in windows.items()}
        seconds = timing.interleave(timed, args.repeats, order="rotate")
        samples = {key: [t / args.steps for t in seconds[key]] for key in VARIANTS}
        row = {
            "workload": name,
            "micro_batches": args.micro_batches,
            "ms_per_step": timing.medians(samples, 1e3),
            "ratio": timing.paired_ratio(samples, "multi", "default"),
            "repeats": args.repeats,
            "steps": args.steps,
        }
        env.log(f"  {name}: {row['ms_per_step']} ms/step; multi/default {row['ratio']:.2f}x")
        rows.append(row)
    return {"environment": env.environment(local), "rows": rows}


def _markdown(results: list) -> str:
    header = ["workload", "micro-batches", "default ms/step", "multi ms/step", "multi / default"]
    table = [
        [
            r["workload"],
            r["micro_batches"],
            *(f"{r['ms_per_step'][k]:.2f}" for k in VARIANTS),
            f"{r['ratio']:.2f}",
        ]
        for result in results
        for r in result["rows"]
    ]
    first = results[0]["rows"][0]
    return "\n".join(
        env.markdown_table(header, table)
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} {first['steps']} steps per window; "
            f"median of {first['repeats']} rotated rounds; the ratio is the median of same-round ratios.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1")
    parser.add_argument("--workloads", default="cnn,mlp", help="cnn, mlp (default both)")
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="a power of two dividing 128 (default 8)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps", type=int, default=5, help="steps per window (default 5)")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    args.workloads = ",".join(env.names_option(parser, "--workloads", args.workloads, tuple(WORKLOADS)))
    mb = args.micro_batches
    if mb < 1 or mb & (mb - 1) or GLOBAL_BATCH % mb or args.repeats < 1 or args.steps < 1:
        parser.error(
            f"--micro-batches must be a power of two dividing {GLOBAL_BATCH}, --repeats and --steps "
            f">= 1; got {mb}, {args.repeats}, {args.steps}"
        )
    child_argv = env.forward_arguments(args, ("platform", "workloads", "micro_batches", "repeats", "steps"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
