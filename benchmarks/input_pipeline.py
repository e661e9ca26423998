"""Input pipeline: batches/s experimental_distribute_dataset delivers vs what the tutorial
CNN's step consumes.

Checks docs/design.md ("Input"): with the prefetch thread (the default `InputOptions()`) the
step never waits on input. Per data set, interleaved windows (order flipped every window, medians
after an untimed run): the pipeline alone (batches placed on the devices, with prefetch and with
`experimental_fetch_to_device=False`), the step alone (`strategy.run` of
`models.strategy_run_step` with `TutorialCNN(image shape)` on one placed batch) and together
(`for batch in iterator: strategy.run(...)`, the time inside `next()` summed). Capacity /
consumption = pipeline batches/s x step-alone s/step (> 1: the pipeline keeps up). Data (global
batch 128): digits, digits through Grain, CIFAR-shaped float32 and uint8 (pipeline only).

Usage:
  python -m benchmarks.input_pipeline                  # 1 and 4 fake CPU devices
  python -m benchmarks.input_pipeline --devices 4      # one count, in this process
  python -m benchmarks.input_pipeline --max-in-flight 0 --json out.json   # a synchronous loop
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time

from benchmarks._harness import env, timing

MODULE = "benchmarks.input_pipeline"
GLOBAL_BATCH = 128
CIFAR_SHAPE = (32, 32, 3)
CIFAR_BATCHES = 8
WARM_BATCHES = 5
COLUMNS = [  # (header, row key, format) after data and replicas; "—" where a row has no key
    ("pipeline batches/s, prefetch", "pipeline_prefetch_batches_per_s", "{:,.0f}"),
    ("pipeline batches/s, no prefetch", "pipeline_direct_batches_per_s", "{:,.0f}"),
    ("pipeline examples/s, prefetch", "pipeline_prefetch_examples_per_s", "{:,.0f}"),
    ("step alone ms", "alone_ms", "{:.2f}"),
    ("together ms, prefetch", "together_prefetch_ms", "{:.2f}"),
    ("wait in next() µs/step, prefetch", "wait_prefetch_us", "{:.0f}"),
    ("wait share, prefetch", "wait_prefetch_share", "{:.1%}"),
    ("batch ready at next(), prefetch", "ready_at_next_share", "{:.0%}"),
    ("together / alone, prefetch", "together_prefetch_over_alone", "{:.2f}"),
    ("together ms, no prefetch", "together_direct_ms", "{:.2f}"),
    ("wait in next() µs/step, no prefetch", "wait_direct_us", "{:.0f}"),
    ("capacity / consumption", "capacity_over_consumption", "{:.0f}"),
]


def _sources(args):
    """{name: (make_source(n) -> n global batches, image shape, steps per window or None)}."""
    import grain
    import numpy as np

    import mirrax
    from benchmarks._harness import models

    (x, y), _ = mirrax.data.load_digits()
    digits = [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH])
        for i in range(0, len(x) - GLOBAL_BATCH + 1, GLOBAL_BATCH)
    ]
    cifar = [models.random_batch(CIFAR_SHAPE, GLOBAL_BATCH, seed) for seed in range(CIFAR_BATCHES)]
    cifar_uint8 = [((b[0] * 64 + 128).clip(0, 255).astype(np.uint8), b[1]) for b in cifar]

    def cycling(batches):
        return lambda n: (batches[i % len(batches)] for i in range(n))

    def grain_digits(n):  # a per-example pipeline: the source stacks every batch in Python
        ds = (
            grain.MapDataset.range(len(x))
            .map(lambda i: (x[i], y[i]))
            .repeat()
            .batch(GLOBAL_BATCH, drop_remainder=True)
        )
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        return itertools.islice(ds.to_iter_dataset(read), n)

    return {
        "digits": (cycling(digits), x.shape[1:], args.digits_steps),
        "digits, grain": (grain_digits, x.shape[1:], args.digits_steps),
        "CIFAR-shaped": (cycling(cifar), CIFAR_SHAPE, args.cifar_steps),
        "CIFAR-shaped uint8": (cycling(cifar_uint8), CIFAR_SHAPE, None),  # the CNN takes floats
    }


def _measure(args, devices: int) -> dict:
    import jax
    import optax
    from flax import nnx
    from mirrax.examples.keras_fit import TutorialCNN

    import mirrax
    from benchmarks._harness import models
    from mirrax._src.distribute import iterator as iterator_lib

    local = env.local_devices(args.platform, devices, MODULE)
    strategy = mirrax.MirroredStrategy(local)
    options = {
        "prefetch": mirrax.InputOptions(),
        "direct": mirrax.InputOptions(experimental_fetch_to_device=False),
    }
    train_step = models.strategy_run_step(GLOBAL_BATCH)

    @functools.cache  # one (model, optimizer) per image shape, shared by its sources
    def state_for(shape):
        with strategy.scope():
            model = TutorialCNN(shape, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def pipeline(make_source, option, n):  # places n batches, from iter() on; timed from outside
        for batch in strategy.experimental_distribute_dataset(make_source(n), option):
            jax.block_until_ready(batch)

    def train_loop(state, next_batch, steps):  # seconds until the state is ready
        start = time.perf_counter()
        timing.run_steps(
            lambda: strategy.run(train_step, args=state + (next_batch(),)),
            lambda out: jax.block_until_ready((out, nnx.state(state))),
            steps,
            args.max_in_flight,
        )
        return time.perf_counter() - start

    def together(state, make_source, key, steps):
        """The row's together, wait, first-batch (and ready) values of one window of the loop."""
        start = time.perf_counter()
        iterator = iter(strategy.experimental_distribute_dataset(make_source(steps + 1), options[key]))
        first = next(iterator)
        first_latency = time.perf_counter() - start
        jax.block_until_ready((strategy.run(train_step, args=state + (first,)), nnx.state(state)))
        waited, ready = [], []

        def next_batch():
            ready.append(key == "prefetch" and iterator_lib.prefetched_count(iterator) > 0)  # placed batches
            asked = time.perf_counter()
            batch = next(iterator)
            waited.append(time.perf_counter() - asked)
            return batch

        elapsed = train_loop(state, next_batch, steps)
        iterator.close()
        wait = sum(waited)
        values = {
            f"together_{key}_ms": elapsed / steps * 1e3,
            f"wait_{key}_us": wait / steps * 1e6,
            f"wait_{key}_share": wait / elapsed,
            f"first_batch_{key}_ms": first_latency * 1e3,
        }
        return dict(values, ready_at_next_share=sum(ready) / steps) if key == "prefetch" else values

    rows, n, median = [], args.pipeline_batches, statistics.median
    for name, (make_source, shape, steps) in _sources(args).items():
        # Each variant takes `warm`: a short untimed run (compilation, first placement).
        variants = {
            f"pipeline_{key}": lambda warm, key=key: pipeline(
                make_source, options[key], WARM_BATCHES if warm else n
            )
            for key in options
        }
        if steps:
            state = state_for(tuple(shape))
            one = next(iter(strategy.experimental_distribute_dataset(next(iter(make_source(1))))))
            variants["alone"] = lambda warm: train_loop(state, lambda: one, 2 if warm else steps)
            for key in options:
                variants[f"together_{key}"] = lambda warm, key=key: together(
                    state, make_source, key, 2 if warm else steps
                )
        for variant in variants.values():
            variant(True)
        results = timing.interleave(
            {key: lambda v=v: v(False) for key, v in variants.items()}, args.windows, order="flip"
        )
        row = {
            "data": name,
            "devices": devices,
            "global_batch": GLOBAL_BATCH,
            "windows": args.windows,
            "pipeline_batches": n,
            "steps_per_window": steps,
            "max_in_flight": args.max_in_flight,
        }
        for key in options:
            row[f"pipeline_{key}_batches_per_s"] = n / median(results[f"pipeline_{key}"])
            row[f"pipeline_{key}_windows_s"] = results[f"pipeline_{key}"]
        row["pipeline_prefetch_examples_per_s"] = row["pipeline_prefetch_batches_per_s"] * GLOBAL_BATCH
        if steps:
            alone = [t / steps * 1e3 for t in results["alone"]]
            row.update(alone_ms=median(alone), alone_windows_ms=alone)
            for key in options:
                runs = results[f"together_{key}"]
                row.update({stat: median(r[stat] for r in runs) for stat in runs[0]})
                per_step = row[f"together_{key}_windows_ms"] = [r[f"together_{key}_ms"] for r in runs]
                # Same-window ratio, then the median: drift between windows cancels.
                row[f"together_{key}_over_alone"] = median(p / a for p, a in zip(per_step, alone))
            row["capacity_over_consumption"] = row["pipeline_prefetch_batches_per_s"] * row["alone_ms"] / 1e3
        rows.append(row)
        env.log(
            f"  [{devices} {args.platform}] {name}: "
            + "; ".join(f"{header} {fmt.format(row[key])}" for header, key, fmt in COLUMNS if key in row)
        )
    return {"environment": env.environment(local), "rows": rows}


def _markdown(results: list) -> str:
    table = [
        [r["data"], r["devices"], *(fmt.format(r[key]) if key in r else "—" for _, key, fmt in COLUMNS)]
        for result in results
        for r in result["rows"]
    ]
    first = results[0]["rows"][0]
    return "\n".join(
        env.markdown_table(["data", "replicas"] + [c[0] for c in COLUMNS], table)
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} Global batch {GLOBAL_BATCH}; "
            f"medians of {first['windows']} interleaved windows after a warm-up; pipeline windows "
            f"of {first['pipeline_batches']} batches; at most {first['max_in_flight']} steps in "
            "flight (0: every step waited for before the next batch is asked for).",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1,4")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--pipeline-batches", type=int, default=100, help="per pipeline window")
    parser.add_argument("--digits-steps", type=int, default=20, help="per window, digits")
    parser.add_argument("--cifar-steps", type=int, default=4, help="per window, CIFAR-shaped")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=2,
        help="steps dispatched ahead of the last finished one (0: synchronous)",
    )
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if min(args.windows, args.pipeline_batches, args.digits_steps, args.cifar_steps) < 1:
        parser.error("--windows, --pipeline-batches, --digits-steps and --cifar-steps must be >= 1")
    if args.max_in_flight < 0:
        parser.error(f"--max-in-flight must be >= 0; got {args.max_in_flight}")
    child_argv = env.forward_arguments(
        args, ("platform", "windows", "pipeline_batches", "digits_steps", "cifar_steps", "max_in_flight")
    )
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
