"""Input pipeline: batches/s experimental_distribute_dataset delivers vs what the tutorial CNN's step consumes.

The claim checked (docs/design.md, "Input"): with the background prefetcher on (`InputOptions(
experimental_fetch_to_device=True)`, the default), the step never waits on input. For each
data set, on the same strategy, four things are timed:

- **pipeline alone**: iterate `strategy.experimental_distribute_dataset(source, options)` and
  `jax.block_until_ready` every `PerReplica` batch, with no step consuming them; batches/s (and
  examples/s), from `iter()` (thread start included) to the last batch on the devices. Once with
  the default options (prefetch thread) and once with `experimental_fetch_to_device=False`
  (split, pad and place inside `next()`).
- **step alone**: `strategy.run(train_step, args=(model, optimizer, batch))` on one pre-placed
  batch, the train step of `workloads.strategy_run_step` (Adam, sparse softmax cross-entropy
  scaled by the global batch) on the tutorial CNN (`mirrax.examples.keras_fit.TutorialCNN`)
  built for the data's image shape.
- **together**: the training loop `for batch in iterator: strategy.run(train_step, ...)`,
  timed per step, with the time spent inside `next(iterator)` (blocked waiting for input)
  summed separately; with and without the prefetch thread. The iterator's first batch and its
  step run before the clock starts (thread start and the first fill are start-up, not steady
  state; the first batch's latency is in the JSON). With prefetch, the loop also counts the
  `next()` calls that found a placed batch waiting in the prefetch queue (read from the
  iterator's private queue, never changed): 100% means input was always ready, and any time
  still spent in `next()` is the hand-over between the threads, not a wait for data.

As in the other benchmarks, at most 2 steps run ahead of the last finished one (XLA:CPU's
in-process all-reduce deadlocks when about 100 multi-device steps are queued), and every window
ends with a wait for the outputs and the whole model and optimizer state. `--max-in-flight 0`
makes the loop (and the step alone) synchronous, as a loop that reads the loss every step: the
devices then idle while the host asks for the next batch, so input time is no longer hidden
behind queued steps. The variants are
interleaved: each window runs all of them, in an order that flips every window; medians over
the windows, after a short untimed run of every variant (compilation, first placement).
Results: capacity/consumption = pipeline batches/s (prefetch) x step-alone seconds/step (how
many times faster the input comes than the step takes it; > 1: the pipeline keeps up) and
together/alone (the median of same-window ratios; 1.0: the loop runs at the step's speed).

Data (global batch 128 everywhere):

- **digits**: `mirrax.data.load_digits()`'s training set (1,437 images 8x8x1 float32, what
  `examples/keras_fit.py` and `mirrax train` use), cut into its 11 full global batches (the
  last 29 examples dropped, so every step is full), a generator cycling over them.
- **digits, grain**: the same images from a Grain pipeline, per example:
  `grain.MapDataset.range(N).map(lambda i: (x[i], y[i])).repeat().batch(128)` read through
  `to_iter_dataset` (one read thread), so the source itself stacks every batch.
- **CIFAR-shaped**: 8 distinct random global batches of 32x32x3 float32 images (normal) and
  int32 labels, cycled; the model is `TutorialCNN((32, 32, 3))`.
- **CIFAR-shaped uint8**: the same as uint8 images (a quarter of the bytes; pipeline only, the
  CNN takes floats).

Each device count runs in a fresh subprocess (the fake CPU device count is fixed when JAX
starts), as in `overhead.py`.

Usage:
  python benchmarks/input_pipeline.py                  # 1 and 4 fake CPU devices
  python benchmarks/input_pipeline.py --devices 4      # one count, in this process
  python benchmarks/input_pipeline.py --json out.json  # also write the results as JSON
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import sys
import time

import overhead

GLOBAL_BATCH = 128
CIFAR_SHAPE = (32, 32, 3)
CIFAR_BATCHES = 8
WARM_BATCHES = 5
# (name, steps per window for the step and the loop); pipeline windows take --pipeline-batches.
WORKLOADS = (
    ("digits", "digits"),
    ("digits, grain", "digits"),
    ("CIFAR-shaped", "cifar"),
    ("CIFAR-shaped uint8", None),
)


def _sources(args):
    """{name: (make_source(n) -> iterable of n global batches, image_shape)}."""
    import numpy as np

    import mirrax

    (x, y), _ = mirrax.data.load_digits()
    full = len(x) // GLOBAL_BATCH
    digits = [(x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH])
              for i in range(full)]
    rng = np.random.default_rng(0)
    cifar = [
        (rng.standard_normal((GLOBAL_BATCH,) + CIFAR_SHAPE).astype(np.float32),
         rng.integers(0, 10, size=GLOBAL_BATCH).astype(np.int32))
        for _ in range(CIFAR_BATCHES)
    ]
    cifar_uint8 = [(rng.integers(0, 256, size=(GLOBAL_BATCH,) + CIFAR_SHAPE, dtype=np.uint8), b[1])
                   for b in cifar]

    def cycling(batches):
        def make(n):
            return (batches[i % len(batches)] for i in range(n))
        return make

    def grain_digits(n):
        import grain

        ds = (grain.MapDataset.range(len(x)).map(lambda i: (x[i], y[i])).repeat()
              .batch(GLOBAL_BATCH, drop_remainder=True))
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        return itertools.islice(ds.to_iter_dataset(read), n)

    return {
        "digits": (cycling(digits), x.shape[1:]),
        "digits, grain": (grain_digits, x.shape[1:]),
        "CIFAR-shaped": (cycling(cifar), CIFAR_SHAPE),
        "CIFAR-shaped uint8": (cycling(cifar_uint8), CIFAR_SHAPE),
    }


def _measure(args, devices: int) -> dict:
    import jax
    import optax
    from flax import nnx

    import mirrax
    import workloads
    from mirrax.examples.keras_fit import TutorialCNN

    local = overhead.local_devices(args.platform, devices, "input_pipeline.py")
    strategy = mirrax.MirroredStrategy(local)
    sources = _sources(args)
    options = {
        "prefetch": mirrax.InputOptions(),
        "direct": mirrax.InputOptions(experimental_fetch_to_device=False),
    }
    train_step = workloads.strategy_run_step(GLOBAL_BATCH)
    models = {}  # image shape -> (model, optimizer): one CNN per shape, shared by its sources

    def model_for(shape):
        if shape not in models:
            with strategy.scope():
                model = TutorialCNN(shape, rngs=nnx.Rngs(0))
                models[shape] = (model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
        return models[shape]

    def pipeline(make_source, option, n):
        """Seconds to deliver n batches onto the devices, from iter() on."""
        start = time.perf_counter()
        iterator = iter(strategy.experimental_distribute_dataset(make_source(n), option))
        for batch in iterator:
            jax.block_until_ready(batch)
        return time.perf_counter() - start

    def train_loop(state, next_batch, steps):
        """Seconds for `steps` steps of `strategy.run(train_step, args=state + (next_batch(),))`,
        at most --max-in-flight of them ahead of the last finished one, until the state is
        ready. The step alone and the loop over the iterator run this same code."""
        in_flight = collections.deque()
        start = time.perf_counter()
        for _ in range(steps):
            in_flight.append(strategy.run(train_step, args=state + (next_batch(),)))
            while len(in_flight) > args.max_in_flight:
                jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready((list(in_flight), nnx.state(state)))
        return time.perf_counter() - start

    def step_alone(state, batch, steps):
        return train_loop(state, lambda: batch, steps)

    def together(state, make_source, option, steps):
        """(seconds for `steps` steps of the loop, seconds inside next(), first-batch latency,
        share of next() calls that found a batch already placed; None without prefetch)."""
        start = time.perf_counter()
        iterator = iter(strategy.experimental_distribute_dataset(make_source(steps + 1), option))
        first = next(iterator)
        first_latency = time.perf_counter() - start
        jax.block_until_ready((strategy.run(train_step, args=state + (first,)), nnx.state(state)))
        prefetching = option.experimental_fetch_to_device
        seen = {"waited": 0.0, "ready": 0}

        def next_batch():
            if prefetching:
                # Read only: the prefetch queue holds the batches already on the devices.
                seen["ready"] += iterator._queue.qsize() > 0
            asked = time.perf_counter()
            batch = next(iterator)
            seen["waited"] += time.perf_counter() - asked
            return batch

        elapsed = train_loop(state, next_batch, steps)
        iterator.close()
        return (elapsed, seen["waited"], first_latency,
                seen["ready"] / steps if prefetching else None)

    rows = []
    for name, kind in WORKLOADS:
        make_source, shape = sources[name]
        steps = {"digits": args.digits_steps, "cifar": args.cifar_steps}.get(kind)
        n = args.pipeline_batches
        # Each variant takes `warm`: a short untimed run (compilation, first placement).
        variants = {
            "pipeline_prefetch": lambda warm: pipeline(
                make_source, options["prefetch"], WARM_BATCHES if warm else n),
            "pipeline_direct": lambda warm: pipeline(
                make_source, options["direct"], WARM_BATCHES if warm else n),
        }
        if kind is not None:
            state = model_for(tuple(shape))
            one = next(iter(strategy.experimental_distribute_dataset(next(iter(make_source(1))))))
            variants["alone"] = lambda warm: step_alone(state, one, 2 if warm else steps)
            for key in ("prefetch", "direct"):
                variants[f"together_{key}"] = (lambda warm, key=key: together(
                    state, make_source, options[key], 2 if warm else steps))
        for key in variants:
            variants[key](True)
        results = {key: [] for key in variants}
        for window in range(args.windows):
            order = list(variants) if window % 2 == 0 else list(reversed(variants))
            for key in order:
                results[key].append(variants[key](False))
        row = {"data": name, "devices": devices, "global_batch": GLOBAL_BATCH,
               "windows": args.windows, "pipeline_batches": n, "steps_per_window": steps,
               "max_in_flight": args.max_in_flight}
        for key in ("prefetch", "direct"):
            seconds = statistics.median(results[f"pipeline_{key}"])
            row[f"pipeline_{key}_batches_per_s"] = n / seconds
            row[f"pipeline_{key}_windows_s"] = results[f"pipeline_{key}"]
        row["pipeline_prefetch_examples_per_s"] = row["pipeline_prefetch_batches_per_s"] * GLOBAL_BATCH
        if kind is not None:
            alone = [t / steps for t in results["alone"]]
            row["alone_ms"] = statistics.median(alone) * 1e3
            row["alone_windows_ms"] = [t * 1e3 for t in alone]
            for key in ("prefetch", "direct"):
                runs = results[f"together_{key}"]
                per_step = [t / steps for t, *_ in runs]
                row[f"together_{key}_ms"] = statistics.median(per_step) * 1e3
                row[f"together_{key}_windows_ms"] = [t * 1e3 for t in per_step]
                row[f"wait_{key}_us"] = statistics.median(w / steps for _, w, *_ in runs) * 1e6
                row[f"wait_{key}_share"] = statistics.median(w / t for t, w, *_ in runs)
                row[f"first_batch_{key}_ms"] = statistics.median(r[2] for r in runs) * 1e3
                if key == "prefetch":
                    row["ready_at_next_share"] = statistics.median(r[3] for r in runs)
                # Same-window ratio, then the median: drift between windows cancels.
                row[f"together_{key}_over_alone"] = statistics.median(
                    p / a for p, a in zip(per_step, alone))
            row["capacity_over_consumption"] = (
                row["pipeline_prefetch_batches_per_s"] * row["alone_ms"] / 1e3)
        rows.append(row)
        print(f"  [{devices} {args.platform}] {_progress(row)}", file=sys.stderr, flush=True)
    return {"environment": overhead.environment(jax, local), "rows": rows}


def _progress(row) -> str:
    text = (f"{row['data']}: pipeline {row['pipeline_prefetch_batches_per_s']:.0f} / "
            f"{row['pipeline_direct_batches_per_s']:.0f} batches/s (prefetch / direct)")
    if "alone_ms" in row:
        text += (f", step alone {row['alone_ms']:.2f} ms, together "
                 f"{row['together_prefetch_ms']:.2f} / {row['together_direct_ms']:.2f} ms, wait "
                 f"{row['wait_prefetch_us']:.0f} / {row['wait_direct_us']:.0f} us/step")
    return text


def _markdown(results: list) -> str:
    lines = [
        "| data | replicas | pipeline batches/s, prefetch | pipeline batches/s, no prefetch "
        "| pipeline examples/s, prefetch | step alone ms | together ms, prefetch "
        "| wait in next() µs/step, prefetch | wait share, prefetch | batch ready at next(), "
        "prefetch | together / alone, prefetch "
        "| together ms, no prefetch | wait in next() µs/step, no prefetch "
        "| capacity / consumption |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for result in results:
        for r in result["rows"]:
            cells = [r["data"], str(r["devices"]), f"{r['pipeline_prefetch_batches_per_s']:,.0f}",
                     f"{r['pipeline_direct_batches_per_s']:,.0f}",
                     f"{r['pipeline_prefetch_examples_per_s']:,.0f}"]
            if "alone_ms" in r:
                cells += [f"{r['alone_ms']:.2f}", f"{r['together_prefetch_ms']:.2f}",
                          f"{r['wait_prefetch_us']:.0f}", f"{r['wait_prefetch_share']:.1%}",
                          f"{r['ready_at_next_share']:.0%}",
                          f"{r['together_prefetch_over_alone']:.2f}",
                          f"{r['together_direct_ms']:.2f}", f"{r['wait_direct_us']:.0f}",
                          f"{r['capacity_over_consumption']:.0f}"]
            else:
                cells += ["—"] * 9
            lines.append("| " + " | ".join(cells) + " |")
    first = results[0]["rows"][0]
    lines.append("")
    lines.append(
        f"{overhead.environment_note(results[0]['environment'])} Global batch {GLOBAL_BATCH}; "
        f"medians of {first['windows']} interleaved windows after a warm-up; pipeline "
        f"windows of {first['pipeline_batches']} batches; at most {first['max_in_flight']} steps in flight "
        "(0: every step waited for before the next batch is asked for)."
    )
    return "\n".join(lines)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,4",
                        help="comma-separated replica counts; each runs in a fresh subprocess when "
                        "more than one is given (default: 1,4)")
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"],
                        help="cpu uses N fake host devices; gpu/tpu the first N local accelerators")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--pipeline-batches", type=int, default=100,
                        help="batches per pipeline-alone window (default 100)")
    parser.add_argument("--digits-steps", type=int, default=20,
                        help="steps per window on the digits (default 20)")
    parser.add_argument("--cifar-steps", type=int, default=4,
                        help="steps per window on the CIFAR-shaped data (default 4)")
    parser.add_argument("--max-in-flight", type=int, default=2,
                        help="steps dispatched ahead of the last finished one (default 2; 0: a "
                        "synchronous loop, as one that reads the loss every step)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    if min(args.windows, args.pipeline_batches, args.digits_steps, args.cifar_steps) < 1:
        parser.error("--windows, --pipeline-batches, --digits-steps and --cifar-steps must be >= 1")
    if args.max_in_flight < 0:
        parser.error(f"--max-in-flight must be >= 0; got {args.max_in_flight}")
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    child_argv = overhead.forward_arguments(
        args, ("platform", "windows", "pipeline_batches", "digits_steps", "cifar_steps",
               "max_in_flight"), ())
    return overhead.run_benchmark(args, _measure, _markdown, child_argv, __file__)


if __name__ == "__main__":
    sys.exit(main())
