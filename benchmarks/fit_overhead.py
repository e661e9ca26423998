"""Steps per second of `mirrax.Model.fit` against the same train step written by hand in JAX.

The hand-written side is `overhead.py`'s floor (from `workloads.py`): `nnx.split` once, then
`jax.jit(jax.shard_map(step, ...))` on the flat state and one device-resident global batch. The
fit side is what a Keras user writes::

    with strategy.scope():
        model = mirrax.Model(module)
        model.compile(optimizer=optax.adam(1e-3),
                      loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=1)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)

on NumPy arrays of `steps` copies of that same global batch, so both sides compute the same
gradients from the same initial weights (checked: the mean loss of the first `steps` steps is
printed for both). Same models (the tutorial CNN at global batch 128, the tiny MLP at 8), same
devices, same optimizer; fit also pays for its input pipeline (slicing the arrays and placing
each batch on the devices), its loss tracker, its callbacks and its logs, which is the point.

Measured, per workload and replica count, over `--repeats` rounds (the variants alternate and
the order flips every round, so drift hits all alike), after one epoch that compiles:

- fit ms/step: the wall time of one epoch (`on_epoch_begin` to `on_epoch_end`, which waits for
  the model and optimizer state) over its steps. The timing callback has no batch hooks, so
  this is fit exactly as a user without batch callbacks runs it.
- hand-written ms/step: `steps` steps, at most `--max-in-flight` dispatched ahead.
- hand-written + float(loss): the same, but the loss is read on the host after every step,
  as fit's batch logs are (a device-to-host sync per step): what that sync costs the floor.
- fit, no batch logs: fit with the timing callback declaring `needs_batch_logs` False, so no
  per-step conversion of the loss to a Python float. Since fit reads batch logs only for a
  callback that needs them, this now equals "fit" (the timing callback has no batch hooks).
- per-epoch breakdown: a callback that also timestamps `on_train_batch_begin/end` splits an
  epoch into time inside the steps, time between them (input pipeline, loop, hooks) and time
  at its start and end; the same with `validation_data` (`steps // 5` batches, at least 1), whose
  validation runs after the last step. `fit() call`: wall time of the whole call minus its
  epoch (input set-up, callback list, label check). These epochs have batch hooks, so they
  pay for batch logs even where fit skips them for callbacks without batch hooks.
- with --profile, also fit taken apart: on pre-placed batches, `overhead.py`'s step through
  `strategy.run` and fit's own train step (which adds a loss tracker and the sample weights),
  then the batch logs, then the input pipeline (inline or in its prefetch thread), and the
  pipeline alone (this mirrors fit's loop with its private names); and a cProfile of one MLP
  epoch, the input prefetch thread included.

Each device count runs in a fresh subprocess, as in `overhead.py`.

Usage:
  python benchmarks/fit_overhead.py                 # 1 and 4 fake CPU devices, markdown tables
  python benchmarks/fit_overhead.py --profile       # also fit taken apart, and a cProfile
  python benchmarks/fit_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import operator
import statistics
import sys
import time

import overhead
from overhead import CNN_GLOBAL_BATCH, MLP_GLOBAL_BATCH, TARGET_RATIO


def _validation_steps(steps: int) -> int:
    """Batches of validation_data: a fifth of an epoch's, at least one."""
    return max(1, steps // 5)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Steps/s of mirrax.Model.fit vs a hand-written jax.jit(jax.shard_map(...)) "
        "train step, and fit's per-epoch overhead."
    )
    overhead.add_common_arguments(parser, steps_per="epoch")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per variant")
    parser.add_argument(
        "--donate",
        action="store_true",
        help="donate the hand-written step's state buffers (overhead.py's default; slower on "
        "XLA:CPU; fit donates since issue 13)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, time fit's pieces alone, and cProfile one MLP fit epoch",
    )
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    overhead.check_divides(parser, args, {"CNN": CNN_GLOBAL_BATCH, "MLP": MLP_GLOBAL_BATCH})
    if min(args.repeats, args.max_in_flight) < 1 or min(args.cnn_steps, args.mlp_steps) < 2:
        parser.error("--repeats and --max-in-flight must be >= 1, --*-steps >= 2")
    return args


def _child_argv(args) -> list:
    return overhead.forward_arguments(
        args,
        ("platform", "repeats", "cnn_steps", "mlp_steps", "max_in_flight"),
        ("donate", "skip_cnn", "profile"),
    )


# -- one device count, in this process ---------------------------------------------------------


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import mirrax
    import workloads

    local = overhead.local_devices(args.platform, devices, "fit_overhead.py")

    class EpochClock(mirrax.callbacks.Callback):
        """(begin, end) perf_counter of every epoch; the end waits for the whole state."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            model = self.model
            jax.block_until_ready(nnx.state((model.module, model.optimizer.nnx_optimizer)))
            self.epochs.append((self.begin, time.perf_counter()))

    class StepClock(EpochClock):
        """EpochClock plus (begin, end) of every training step of the last epoch."""

        def on_epoch_begin(self, epoch, logs=None):
            self.steps = []
            super().on_epoch_begin(epoch, logs)

        def on_train_batch_begin(self, batch, logs=None):
            self.steps.append([time.perf_counter()])

        def on_train_batch_end(self, batch, logs=None):
            self.steps[-1].append(time.perf_counter())

    def make_fit(module_cls, x, y, global_batch, steps):
        strategy = mirrax.MirroredStrategy(local)
        with strategy.scope():
            model = mirrax.Model(module_cls(nnx.Rngs(0)))
            model.compile(
                optimizer=optax.adam(1e-3),
                loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=1,
            )
        # `steps` copies of the one batch, in order: every step sees the hand-written's batch.
        tile = lambda a, n: np.concatenate([a] * n)  # noqa: E731
        train = (tile(x, steps), tile(y, steps))
        validation = (tile(x, _validation_steps(steps)), tile(y, _validation_steps(steps)))

        def fit(clock, validation_data=None):
            start = time.perf_counter()
            history = model.fit(
                *train, batch_size=global_batch, epochs=1, verbose=0, shuffle=False,
                callbacks=[clock], validation_data=validation_data,
            )
            return time.perf_counter() - start, history

        return model, fit, validation

    def epoch_breakdown(clock) -> dict:
        """Seconds of the last epoch: inside steps, between steps, at its start and end."""
        (begin, end), steps = clock.epochs[-1], clock.steps
        inside = sum(b - a for a, b in steps)
        between = sum(steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1))
        return {
            "epoch": end - begin,
            "inside": inside,
            "between": between,
            "start": steps[0][0] - begin,
            "end": end - steps[-1][1],
        }

    def compare(name, module_cls, x_shape, global_batch, steps):
        x, y = workloads.random_batch(x_shape, global_batch)
        model, fit, validation = make_fit(module_cls, x, y, global_batch, steps)
        hw_step, hw_block, hw_loss_of = workloads.make_handwritten(
            module_cls, x, y, global_batch, local, donate=args.donate
        )

        # Warm-up, which compiles: one epoch of each fit kind, and `steps` hand-written steps
        # with their losses read, whose mean must equal fit's first-epoch loss.
        compile_s = {}
        compile_s["fit"], history = fit(StepClock())
        compile_s["fit_validation"], _ = fit(StepClock(), validation)
        start = time.perf_counter()
        hw_losses = [hw_loss_of(hw_step()) for _ in range(steps)]
        compile_s["handwritten"] = time.perf_counter() - start
        first_epoch_loss = {
            "fit": history.history["loss"][0],
            "handwritten": statistics.fmean(hw_losses),
        }

        def synced_step():
            out = hw_step()
            hw_loss_of(out)
            return out

        def timed_hw(step):
            start = time.perf_counter()
            workloads.run_steps(step, hw_block, steps, args.max_in_flight)
            return {"epoch": time.perf_counter() - start}

        def timed_fit(clock_cls, validation_data=None, batch_logs=True):
            clock = clock_cls()
            if not batch_logs:
                # The clock's batch hooks then get logs={}: fit reads no loss per step.
                clock.needs_batch_logs = lambda hook: False
            call, _ = fit(clock, validation_data)
            begin, end = clock.epochs[-1]
            times = {"epoch": end - begin, "call": call}
            if clock_cls is StepClock:
                times.update(epoch_breakdown(clock))
            return times

        # Neighbours in this order are compared as pairs (the order flips every round).
        variants = {
            "fit": lambda: timed_fit(EpochClock),
            "handwritten": lambda: timed_hw(hw_step),
            "fit_no_batch_logs": lambda: timed_fit(EpochClock, batch_logs=False),
            "handwritten_sync": lambda: timed_hw(synced_step),
            "fit_steps": lambda: timed_fit(StepClock),
            "fit_validation": lambda: timed_fit(StepClock, validation),
        }
        samples = {key: [] for key in variants}
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for key in order:
                samples[key].append(variants[key]())
        median = {
            key: {part: statistics.median(s[part] for s in runs) for part in runs[0]}
            for key, runs in samples.items()
        }
        ms = {key: m["epoch"] / steps * 1e3 for key, m in median.items()}

        def paired(combine, a, b):
            """Median over the rounds of combine(a's epoch, b's epoch) from the same round."""
            return statistics.median(
                combine(x["epoch"], y["epoch"]) for x, y in zip(samples[a], samples[b])
            )

        per_step_us = lambda a, b: (a - b) / steps * 1e6  # noqa: E731
        row = {
            "workload": name,
            "devices": devices,
            "global_batch": global_batch,
            "steps_per_epoch": steps,
            "validation_steps": _validation_steps(steps),
            "repeats": args.repeats,
            "max_in_flight": args.max_in_flight,
            "handwritten_donates": args.donate,
            "ms_per_step": ms,
            "ratio": paired(operator.truediv, "fit", "handwritten"),
            "ratio_no_batch_logs": paired(operator.truediv, "fit_no_batch_logs", "handwritten"),
            "batch_logs_us": paired(per_step_us, "fit", "fit_no_batch_logs"),
            "sync_us": paired(per_step_us, "handwritten_sync", "handwritten"),
            "median_s": median,
            "samples_s": samples,
            "compile_s": compile_s,
            "first_epoch_loss": first_epoch_loss,
        }
        print(
            f"  [{devices} {args.platform}] {name}: fit {ms['fit']:.3f} ms/step, hand-written "
            f"{ms['handwritten']:.3f} (+ float(loss) {ms['handwritten_sync']:.3f}), fit / "
            f"hand-written {row['ratio']:.3f}; fit without batch logs "
            f"{ms['fit_no_batch_logs']:.3f}; "
            f"first-epoch loss fit {first_epoch_loss['fit']:.6f} / hand-written "
            f"{first_epoch_loss['handwritten']:.6f}",
            file=sys.stderr,
            flush=True,
        )
        return row, model, fit

    def decompose(model, fit, x, y, global_batch, steps) -> dict:
        """ms per step of fit's pieces, each timed alone on one epoch's batches (medians).

        Mirrors `Model.fit`'s loop with its private names (`_train_fn`, `_logs`, ...): keep it
        in step with model.py. fit's arrays carry all-ones sample weights when none are given.
        """
        strategy = model.distribute_strategy
        batches = [(x, y, np.ones(global_batch, np.float32))] * steps
        placed = list(strategy.experimental_distribute_dataset(batches))
        inline = mirrax.InputOptions(experimental_fetch_to_device=False)
        plain_step = workloads.strategy_run_step(global_batch)

        train_function = model.make_train_function()

        def train(source, logs, plain=False):
            start = time.perf_counter()
            for batch in source:
                if plain:
                    state = (model.module, model.optimizer.nnx_optimizer)
                    strategy.run(plain_step, args=state + (batch,))
                    continue
                train_function(batch)
                if logs:
                    model.get_metrics_result()
            jax.block_until_ready(nnx.state(model.module))
            return time.perf_counter() - start

        def pipeline(options):
            start = time.perf_counter()
            for _ in strategy.experimental_distribute_dataset(batches, options):
                pass
            return time.perf_counter() - start

        def fit_epoch():
            clock = EpochClock()
            fit(clock)
            begin, end = clock.epochs[-1]
            return end - begin

        parts = {
            "overhead.py's strategy.run step": lambda: train(placed, False, plain=True),
            "fit's train step": lambda: train(placed, False),
            "+ batch logs": lambda: train(placed, True),
            "+ input pipeline, inline": lambda: train(
                strategy.experimental_distribute_dataset(batches, inline), True
            ),
            "+ input pipeline, prefetch thread": lambda: train(
                strategy.experimental_distribute_dataset(batches), True
            ),
            "fit": fit_epoch,
            "input pipeline alone, inline": lambda: pipeline(inline),
            "input pipeline alone, prefetch thread": lambda: pipeline(None),
        }
        seconds = {key: [] for key in parts}
        for repeat in range(args.repeats + 1):
            order = list(parts) if repeat % 2 == 0 else list(reversed(parts))
            for key in order:
                took = parts[key]()
                if repeat:  # the first round warms up
                    seconds[key].append(took)
        return {key: statistics.median(v) / steps * 1e3 for key, v in seconds.items()}

    rows = []
    for name, module_cls, x_shape, global_batch, steps in (
        ("CNN", workloads.CNN, (28, 28, 1), CNN_GLOBAL_BATCH, args.cnn_steps),
        ("MLP", workloads.MLP, (workloads.MLP_FEATURES,), MLP_GLOBAL_BATCH, args.mlp_steps),
    ):
        if name == "CNN" and args.skip_cnn:
            continue
        row, model, fit = compare(name, module_cls, x_shape, global_batch, steps)
        rows.append(row)
        if args.profile:
            x, y = workloads.random_batch(x_shape, global_batch)
            row["decomposition_ms"] = decompose(model, fit, x, y, global_batch, steps)
            print(
                f"  [{devices} {args.platform}] {name} fit taken apart, ms/step: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row["decomposition_ms"].items()),
                file=sys.stderr,
                flush=True,
            )
    if args.profile:
        _profile(lambda: fit(EpochClock()), args.mlp_steps)  # the MLP's, the last workload
    return {"environment": overhead.environment(jax, local), "rows": rows}


def _profile(fit_one_epoch, steps: int) -> None:
    """cProfile of one fit epoch: the calling thread, and the input pipeline's prefetch thread."""
    import cProfile
    import io
    import pstats
    import threading

    thread_profilers = []

    def profile_new_thread(*_):
        # Called once in each thread started from here on: hand the thread to its own profiler.
        sys.setprofile(None)
        thread_profilers.append(cProfile.Profile())
        thread_profilers[-1].enable()

    profiler = cProfile.Profile()
    threading.setprofile(profile_new_thread)
    profiler.enable()
    try:
        fit_one_epoch()
    finally:
        profiler.disable()
        threading.setprofile(None)
    time.sleep(0.5)  # the prefetch thread sees its stop flag within 0.1 s and returns
    title = f"cProfile of one MLP fit epoch ({steps} steps)"
    reports = [
        (profiler, "tottime", (), ""),
        (profiler, "cumulative", ("mirrax/_src",), " (mirrax's functions)"),
    ] + [(p, "cumulative", (), " (input prefetch thread)") for p in thread_profilers]
    for source, sort, restriction, where in reports:
        text = io.StringIO()
        stats = pstats.Stats(source, stream=text).sort_stats(sort)
        stats.print_stats(*restriction, 30)
        print(f"\n### {title}, sorted by {sort}{where}\n", file=sys.stderr)
        print(text.getvalue(), file=sys.stderr, flush=True)


# -- tables -------------------------------------------------------------------------------------


def _table(title: str, rows: list, columns: list) -> list:
    """The lines of a markdown table after `title`: one column per (header, row -> cell)."""
    return [
        "",
        title,
        "",
        "| " + " | ".join(header for header, _ in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns[1:]) + " |",
    ] + ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]


def _ms(key: str):
    return lambda row: f"{row['ms_per_step'][key]:.3f}"


def _seconds(value: float) -> str:
    return f"{value:.4f}"


def _epoch(key: str, part: str):
    return lambda row: _seconds(row["median_s"][key][part])


def _outside(row) -> float:
    """Seconds of the timed fit epoch spent outside its training steps."""
    plain = row["median_s"]["fit_steps"]
    return plain["between"] + plain["start"] + plain["end"]


def _markdown(results: list) -> str:
    rows = [row for result in results for row in result["rows"]]
    workload = [("workload", lambda r: r["workload"]), ("replicas", lambda r: str(r["devices"]))]
    lines = _table("Steps per second:", rows, workload + [
        ("global batch", lambda r: str(r["global_batch"])),
        ("steps/epoch", lambda r: str(r["steps_per_epoch"])),
        ("fit ms/step", _ms("fit")),
        ("hand-written ms/step", _ms("handwritten")),
        ("fit / hand-written", lambda r: f"{r['ratio']:.3f}"),
        ("fit steps/s", lambda r: f"{1e3 / r['ms_per_step']['fit']:.0f}"),
        ("hand-written steps/s", lambda r: f"{1e3 / r['ms_per_step']['handwritten']:.0f}"),
    ])
    lines += _table("The per-step logs (the loss read as a Python float after every step):",
                    rows, workload + [
        ("fit ms/step", _ms("fit")),
        ("fit without batch logs ms/step", _ms("fit_no_batch_logs")),
        ("batch logs cost", lambda r: f"{r['batch_logs_us']:.0f} µs/step"),
        ("fit without batch logs / hand-written", lambda r: f"{r['ratio_no_batch_logs']:.3f}"),
        ("hand-written + float(loss) ms/step", _ms("handwritten_sync")),
        ("float(loss) costs the hand-written", lambda r: f"{r['sync_us']:.0f} µs/step"),
    ])
    lines += _table("One fit epoch, in seconds (the epoch timed with batch hooks):",
                    rows, workload + [
        ("epoch", _epoch("fit_steps", "epoch")),
        ("inside steps", _epoch("fit_steps", "inside")),
        ("between steps", _epoch("fit_steps", "between")),
        ("epoch start + end", lambda r: _seconds(
            r["median_s"]["fit_steps"]["start"] + r["median_s"]["fit_steps"]["end"])),
        ("outside steps", lambda r: _seconds(_outside(r))),
        ("outside, per step", lambda r: f"{_outside(r) / r['steps_per_epoch'] * 1e6:.0f} µs"),
        ("fit() call beyond its epoch", lambda r: _seconds(
            r["median_s"]["fit"]["call"] - r["median_s"]["fit"]["epoch"])),
        ("epoch with validation", _epoch("fit_validation", "epoch")),
        ("of which validation", lambda r: f"{r['median_s']['fit_validation']['end']:.4f} "
                                          f"({r['validation_steps']} steps)"),
    ])
    decomposed = [row for row in rows if "decomposition_ms" in row]
    if decomposed:
        lines += _table(
            "fit taken apart (--profile), ms per step; each part timed alone on an epoch of the "
            "same batches:",
            decomposed,
            workload + [("hand-written", _ms("handwritten"))]
            + [(part, lambda r, part=part: f"{r['decomposition_ms'][part]:.3f}")
               for part in decomposed[0]["decomposition_ms"]],
        )
    env = results[0]["environment"]
    first = results[0]["rows"][0]
    lines.append("")
    lines.append(
        f"{overhead.environment_note(env)} Medians of {first['repeats']} interleaved epochs "
        "per variant; ratios and costs are medians of same-round pairs. Hand-written: at most "
        f"{first['max_in_flight']} steps in flight, buffers "
        f"{'donated' if first['handwritten_donates'] else 'not donated'}. Target fit / "
        f"hand-written <= {TARGET_RATIO} (CNN)."
    )
    return "\n".join(lines[1:])


def main(argv=None) -> int:
    args = _parse_args(argv)
    return overhead.run_benchmark(args, _measure, _markdown, _child_argv(args), __file__)


if __name__ == "__main__":
    sys.exit(main())
