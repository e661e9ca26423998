"""What mirrax costs over the same training written by hand: strategy.run, fit, evaluate, predict.

Each is measured against a hand-written `jax.jit(jax.shard_map(...))` floor.

Every comparison runs the SAME training (same model, initial weights and data; Adam 1e-3;
sparse softmax cross-entropy scaled by the global batch). The floor (`models.make_handwritten`)
is `nnx.split` once, then one jitted `shard_map` step on the flat state and a device-resident
batch, buffers donated. `--variants` picks the comparisons (default all; each one's method is
in BENCHMARKS.md next to its table):

- `run`: `strategy.run` on one `PerReplica` batch, and the same step inside a `mirrax.function`
  (the model and optimizer captured), vs the floor: the tutorial CNN (batch 128, targets
  <= 1.05 and <= 1.10) and a tiny MLP 32-64-10 (batch 8: the host cost of a call, also reported).
- `models`: CNN, MLP 784-1024-1024-10, transformer at batch 128: the floor donated and not,
  `strategy.run`, one `Model.fit` epoch; ratios to the donated and to the faster floor.
- `fit`: `Model.fit` vs the floor (CNN, tiny MLP); the floor reading `float(loss)` every step;
  batch logs' cost; an epoch split into inside / between / around its steps; with validation.
  --profile: fit's loop taken apart piece by piece, and a cProfile of one MLP epoch.
- `loops`: `fit` / `evaluate` / `predict` on NumPy arrays vs hand-written loops that slice,
  `device_put` and run one jitted program per batch: MLP 784-256-256-10 (160 batches, target
  <= 1.10) and the CNN (8 batches, <= 1.05), batch 128. --profile: evaluate taken apart (on
  batches placed before, and the hand-written loop likewise).

Timing: one untimed window per variant (it compiles), then `--repeats` rounds timing every
variant of a workload once, the order rotating every round; at most `--max-in-flight` steps
run ahead in the step loops (XLA:CPU's in-process all-reduce deadlocks with ~100 queued).
Reported: medians and medians of same-round ratios; every variant's next loss is printed and
agrees (all train the same model the same way). One subprocess per device count.

Usage:
  python -m benchmarks.overhead                          # all four, 1 and 4 fake CPU devices
  python -m benchmarks.overhead --variants run           # strategy.run vs hand-written (~2 min)
  python -m benchmarks.overhead --variants run --workloads mlp --devices 1 --profile
  python -m benchmarks.overhead --variants models --json out.json
  python -m benchmarks.overhead --variants run --platform gpu --devices 1 --cnn-steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._harness import env, timing

GROUPS = ("run", "models", "fit", "loops")
FAMILIES = ("cnn", "mlp", "transformer")
REPEATS = {"run": 9, "models": 5, "fit": 5, "loops": 5}
MODEL_STEPS = {"cnn": 10, "mlp": 30, "transformer": 3}  # `models`, times --steps-scale
LOOP_STEPS = {"mlp": 160, "cnn": 8}  # `loops`, times --steps-scale
TARGETS = {"run": {"cnn": 1.05}, "models": {}, "fit": {"cnn": 1.05}, "loops": {"mlp": 1.10, "cnn": 1.05}}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser)
    add = parser.add_argument
    add("--variants", default=",".join(GROUPS), help=f"comparisons: {', '.join(GROUPS)}")
    add("--workloads", default=",".join(FAMILIES), help="cnn, mlp, transformer (default all)")
    add("--repeats", "--windows", type=int, dest="repeats", help="rounds (run 9, others 5)")
    add("--cnn-steps", type=int, default=10, help="CNN steps per window (run, fit)")
    add("--mlp-steps", type=int, default=300, help="tiny-MLP steps per window (run, fit)")
    add("--steps-scale", type=float, default=1.0, help="scales models' and loops' steps")
    add("--max-in-flight", type=int, default=2, help="steps dispatched ahead (default 2)")
    add("--no-donate", action="store_true", help="the floor without donation (run, fit)")
    add(
        "--steps-per-execution",
        type=int,
        default=1,
        help="mirrax's compile(steps_per_execution=...) in the loops (default 1)",
    )
    add(
        "--profile",
        action="store_true",
        help="cProfile (run); fit taken apart (fit); evaluate taken apart (loops)",
    )
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    args.groups = env.names_option(parser, "--variants", args.variants, GROUPS)
    args.families = env.names_option(parser, "--workloads", args.workloads, FAMILIES)
    if not args.groups or not args.families:
        parser.error("--variants and --workloads need at least one name each")
    batches = {"": 128} if set(args.groups) - {"run", "fit"} or "cnn" in args.families else {}
    if {"run", "fit"} & set(args.groups) and "mlp" in args.families:
        batches["tiny MLP"] = 8
    env.check_divides(parser, args, batches)
    if (
        min(args.cnn_steps, args.mlp_steps) < 2
        or min(args.max_in_flight, args.repeats or 1) < 1
        or args.steps_scale <= 0
        or args.steps_per_execution < 1
    ):
        parser.error(
            "--*-steps must be >= 2, --repeats, --max-in-flight, --steps-per-execution "
            ">= 1, --steps-scale > 0"
        )
    return args


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mirrax
    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, "overhead")
    mesh = jax.sharding.Mesh(np.array(local), ("replica",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))

    def wait_for(*objects):
        jax.block_until_ready(nnx.state(objects))

    def step_loop(step, block):
        def window(steps):
            start = time.perf_counter()
            host = timing.run_steps(step, block, steps, args.max_in_flight)
            return {"wall": time.perf_counter() - start, "host": host}

        return window

    def hand(module_cls, x, y, gb, donate=True, sync=False):
        step, block, loss_of = models.make_handwritten(module_cls, x, y, gb, local, donate)

        def synced():
            out = step()
            loss_of(out)  # a device-to-host copy of the loss, as per-step logs need
            return out

        return step_loop(synced if sync else step, block), lambda: loss_of(step())

    def run(module_cls, x, y, gb):
        strategy, model, optimizer, batch = models.mirrax_state(local, module_cls, x, y)
        train_step = models.strategy_run_step(gb)
        step = lambda: strategy.run(train_step, args=(model, optimizer, batch))  # noqa: E731
        window = step_loop(step, lambda out: (jax.block_until_ready(out), wait_for(model, optimizer)))
        return window, lambda: float(strategy.reduce("sum", step()))

    def function(module_cls, x, y, gb):
        strategy, model, optimizer, batch = models.mirrax_state(local, module_cls, x, y)
        train_step = models.strategy_run_step(gb)

        @mirrax.function
        def distributed_step(batch):  # the model and optimizer captured, as TF's tutorials do
            return strategy.run(train_step, args=(model, optimizer, batch))

        step = lambda: distributed_step(batch)  # noqa: E731
        window = step_loop(step, lambda out: (jax.block_until_ready(out), wait_for(model, optimizer)))
        return window, lambda: float(strategy.reduce("sum", step()))

    class Clock(mirrax.callbacks.Callback):
        """Times the epoch (its end waits for the state) and, with `per_step`, every step."""

        def __init__(self, per_step=False, batch_logs=True):
            super().__init__()
            self.per_step, self.batch_logs, self.steps = per_step, batch_logs, []

        def needs_batch_logs(self, hook):
            return self.batch_logs and self.per_step

        def on_epoch_begin(self, epoch, logs=None):
            self.steps, self.begin = [], time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            if self.per_step:
                self.steps.append([time.perf_counter()])

        def on_train_batch_end(self, batch, logs=None):
            if self.per_step:
                self.steps[-1].append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            wait_for(self.model.module, self.model.optimizer.nnx_optimizer)
            self.end = time.perf_counter()

        def parts(self) -> dict:
            times = {"wall": self.end - self.begin}
            if self.steps:
                s = self.steps
                times.update(
                    inside=sum(b - a for a, b in s),
                    start=s[0][0] - self.begin,
                    between=sum(s[i + 1][0] - s[i][1] for i in range(len(s) - 1)),
                    end=self.end - s[-1][1],
                )
            return times

    def compiled_model(module_cls, steps_per_execution=1):
        strategy = mirrax.MirroredStrategy(local)
        with strategy.scope():
            model = mirrax.Model(module_cls(nnx.Rngs(0)))
            model.compile(
                optimizer=optax.adam(1e-3),
                loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
            )
        return model

    def fit(model, xs, ys, gb, validation=None, **clock):
        def window(steps=None):
            timer = Clock(**clock)
            start = time.perf_counter()
            model.fit(
                xs,
                ys,
                batch_size=gb,
                epochs=1,
                verbose=0,
                shuffle=False,
                callbacks=[timer],
                validation_data=validation,
            )
            return dict(timer.parts(), call=time.perf_counter() - start)

        def next_loss():
            return model.fit(xs[:gb], ys[:gb], batch_size=gb, epochs=1, verbose=0, shuffle=False).history[
                "loss"
            ][0]

        return window, next_loss

    def outside(fn):
        def window(steps=None):
            start = time.perf_counter()
            fn()
            return {"wall": time.perf_counter() - start}

        return window

    def hand_loops(module_cls, x, y, gb, steps):
        """fit / evaluate / predict as a JAX expert writes them over the same NumPy arrays."""
        cap = 4 if devices > 1 and args.platform == "cpu" else None
        model = module_cls(nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
        leaves, state_def = jax.tree.flatten(state)
        holder = {"state": jax.device_put(leaves, replicated)}
        rebuild = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))  # noqa: E731

        def train(leaves, xb, yb):
            model, optimizer = rebuild(leaves)
            loss = models.update(model, optimizer, xb, yb, lambda losses: losses.sum() / gb)
            return jax.tree.leaves(nnx.state((model, optimizer))), jax.lax.psum(loss, "replica")

        def evaluate(leaves, totals, xb, yb):
            losses = optax.softmax_cross_entropy_with_integer_labels(rebuild(leaves)[0](xb), yb)
            return totals + jax.lax.psum(losses.sum(), "replica")

        def program(fn, in_specs, out_specs, **jit):
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs), **jit)

        R = P("replica")
        train_fn = program(train, (P(), R, R), (P(), P()), donate_argnums=0)
        eval_fn = program(evaluate, (P(), P(), R, R), P())
        predict_fn = program(lambda leaves, xb: rebuild(leaves)[0](xb), (P(), R), R)

        def loop(arrays, call):
            outs, queue = [], []
            for i in range(steps):
                part = slice(i * gb, (i + 1) * gb)
                outs.append(call(*[jax.device_put(a[part], sharded) for a in arrays]))
                if cap is not None:
                    queue.append(outs[-1])
                    if len(queue) > cap:
                        jax.block_until_ready(queue.pop(0))
            return outs

        def run_fit():
            def call(xb, yb):
                holder["state"], loss = train_fn(holder["state"], xb, yb)
                return loss

            return float(sum(loop((x, y), call))) / steps

        def run_evaluate():
            totals = [jax.device_put(np.float32(0), replicated)]

            def call(xb, yb):
                totals[0] = eval_fn(holder["state"], totals[0], xb, yb)
                return totals[0]

            loop((x, y), call)
            return float(totals[0]) / (steps * gb)

        def run_predict():
            outs = loop((x,), lambda xb: predict_fn(holder["state"], xb))
            return np.concatenate([np.asarray(o) for o in outs])

        placed = [
            (
                jax.device_put(x[i * gb : (i + 1) * gb], sharded),
                jax.device_put(y[i * gb : (i + 1) * gb], sharded),
            )
            for i in range(steps)
        ]

        def run_evaluate_placed():  # no input pipeline: the batches were placed before
            totals, queue = jax.device_put(np.float32(0), replicated), []
            for xb, yb in placed:
                totals = eval_fn(holder["state"], totals, xb, yb)
                if cap is not None:  # as `loop`: XLA:CPU's all-reduce rendezvous needs it
                    queue.append(totals)
                    if len(queue) > cap:
                        jax.block_until_ready(queue.pop(0))
            return float(totals) / (steps * gb)

        return {
            "fit": run_fit,
            "evaluate": run_evaluate,
            "predict": run_predict,
            "evaluate_placed": run_evaluate_placed,
        }

    def workloads(group):
        """(family, title, module_cls, x, y, global batch, steps) of a comparison."""
        images = lambda gb: models.random_batch((28, 28, 1), gb)  # noqa: E731
        tiny = lambda gb: models.random_batch((models.MLP_FEATURES,), gb)  # noqa: E731
        if group in ("run", "fit"):
            table = [
                ("cnn", "CNN", models.CNN, images, 128, args.cnn_steps),
                ("mlp", "MLP", models.MLP, tiny, 8, args.mlp_steps),
            ]
        elif group == "models":
            table = [
                (f, name, builder, data, 128, max(1, round(MODEL_STEPS[f] * args.steps_scale)))
                for f, (name, (builder, data)) in zip(FAMILIES, models.WORKLOADS.items())
            ]
        else:
            table = [
                (
                    "mlp",
                    "MLP 784-256-256-10",
                    models.MLP256,
                    lambda gb: models.random_batch((784,), gb),
                    128,
                    LOOP_STEPS["mlp"],
                ),
                ("cnn", "CNN", models.CNN, images, 128, LOOP_STEPS["cnn"]),
            ]
            table = [t[:5] + (max(1, round(t[5] * args.steps_scale)),) for t in table]
        for family, title, module_cls, data, gb, steps in table:
            if family in args.families:
                yield (family, title, module_cls) + data(gb) + (gb, steps)

    def variants(group, module_cls, x, y, gb, steps):
        """{name: (window(steps) -> {"wall": seconds, ...}, next loss)} of a comparison."""
        tile = lambda a, n: np.concatenate([a] * n)  # noqa: E731
        xs, ys = tile(x, steps), tile(y, steps)
        donate = not args.no_donate
        if group == "run":
            return {
                "mirrax": run(module_cls, x, y, gb),
                "function": function(module_cls, x, y, gb),
                "handwritten": hand(module_cls, x, y, gb, donate),
            }
        if group == "models":
            return {
                "handwritten_donated": hand(module_cls, x, y, gb, True),
                "handwritten": hand(module_cls, x, y, gb, False),
                "run": run(module_cls, x, y, gb),
                "fit": fit(compiled_model(module_cls), xs, ys, gb),
            }
        if group == "fit":
            # One model per fit variant: each then takes as many steps as a floor variant,
            # so all next losses must agree.
            fit_model, n = compiled_model(module_cls), max(1, steps // 5)
            return {
                "fit_model": fit_model,
                "fit": fit(fit_model, xs, ys, gb),
                "handwritten": hand(module_cls, x, y, gb, donate),
                "fit_no_batch_logs": fit(
                    compiled_model(module_cls), xs, ys, gb, per_step=True, batch_logs=False
                ),
                "handwritten_sync": hand(module_cls, x, y, gb, donate, sync=True),
                "fit_steps": fit(compiled_model(module_cls), xs, ys, gb, per_step=True),
                "fit_validation": fit(
                    compiled_model(module_cls), xs, ys, gb, (tile(x, n), tile(y, n)), per_step=True
                ),
            }
        model = compiled_model(module_cls, args.steps_per_execution)
        loops = hand_loops(module_cls, xs, ys, gb, steps)
        common = dict(batch_size=gb, verbose=0)
        mirrax_passes = {
            "fit": lambda: model.fit(xs, ys, epochs=1, shuffle=False, **common).history["loss"][-1],
            "evaluate": lambda: model.evaluate(xs, ys, **common),
            "predict": lambda: model.predict(xs, **common),
        }
        built = {
            f"{side}_{kind}": (outside(fn), fn)
            for kind in ("fit", "evaluate", "predict")
            for side, fn in (("mirrax", mirrax_passes[kind]), ("handwritten", loops[kind]))
        }
        return dict(built, evaluate_inputs=(model, loops, xs, ys, gb, steps))

    def take_fit_apart(model, x, y, gb, steps, repeats) -> dict:
        """ms per step of fit's pieces, each timed alone on one epoch of the same batches:
        on pre-placed batches the `run` step and fit's train function, then the batch logs,
        then the input pipeline (inline or in its prefetch thread), and the pipeline alone."""
        strategy = model.distribute_strategy
        batches = [(x, y, np.ones(gb, np.float32))] * steps  # fit adds all-ones weights
        placed = list(strategy.experimental_distribute_dataset(batches))
        inline = mirrax.InputOptions(experimental_fetch_to_device=False)
        plain_step, train_function = models.strategy_run_step(gb), model.make_train_function()
        state = (model.module, model.optimizer.nnx_optimizer)

        def train(source, logs=True, plain=False):
            for batch in source:
                if plain:
                    strategy.run(plain_step, args=state + (batch,))
                    continue
                train_function(batch)
                if logs:
                    model.get_metrics_result()
            wait_for(*state)

        def pipeline(options):
            for _ in strategy.experimental_distribute_dataset(batches, options):
                pass

        parts = {
            "the run step": lambda: train(placed, plain=True),
            "fit's train step": lambda: train(placed, logs=False),
            "+ batch logs": lambda: train(placed),
            "+ input pipeline, inline": lambda: train(
                strategy.experimental_distribute_dataset(batches, inline)
            ),
            "+ input pipeline, prefetch thread": lambda: train(
                strategy.experimental_distribute_dataset(batches)
            ),
            "input pipeline alone, inline": lambda: pipeline(inline),
            "input pipeline alone, prefetch thread": lambda: pipeline(None),
        }
        for part in parts.values():
            part()
        return timing.medians(timing.interleave(parts, repeats), 1e3 / steps)

    def take_evaluate_apart(inputs, repeats) -> dict:
        """ms per step of evaluate's pieces, each timed alone on the same batches: evaluate on
        the arrays, its test function on batches distributed before (no input pipeline), and
        the hand-written evaluate on pre-placed batches and with a device_put per batch."""
        model, loops, xs, ys, gb, steps = inputs
        strategy = model.distribute_strategy
        placed = list(
            strategy.experimental_distribute_dataset(
                [(xs[i * gb : (i + 1) * gb], ys[i * gb : (i + 1) * gb]) for i in range(steps)]
            )
        )
        test_function = model.make_test_function()

        def on_placed():
            model.reset_metrics()
            for batch in placed:
                test_function(batch)
            model.get_metrics_result()  # waits for the last step

        parts = {
            "evaluate (arrays)": lambda: model.evaluate(xs, ys, batch_size=gb, verbose=0),
            "test function, batches placed before": on_placed,
            "hand-written, batches placed before": loops["evaluate_placed"],
            "hand-written, device_put per batch": loops["evaluate"],
        }
        for part in parts.values():
            part()
        # Each window returns None, so the interleave times it from outside.
        timed = {name: (lambda part=part: (part(), None)[1]) for name, part in parts.items()}
        return timing.medians(timing.interleave(timed, repeats), 1e3 / steps)

    rows = []
    for group in args.groups:
        repeats = args.repeats or REPEATS[group]
        for family, name, module_cls, x, y, gb, steps in workloads(group):
            built = variants(group, module_cls, x, y, gb, steps)
            fit_model = built.pop("fit_model", None)
            evaluate_inputs = built.pop("evaluate_inputs", None)
            first = {}
            for key, (window, _) in built.items():
                start = time.perf_counter()
                window(steps)
                first[key] = time.perf_counter() - start
            samples = timing.interleave({k: (lambda w=w: w(steps)) for k, (w, _) in built.items()}, repeats)
            losses = {k: next_loss() for k, (_, next_loss) in built.items() if not k.endswith("predict")}
            row = {
                "group": group,
                "workload": name,
                "family": family,
                "devices": devices,
                "global_batch": gb,
                "steps": steps,
                "repeats": repeats,
                "max_in_flight": args.max_in_flight,
                "donated": not args.no_donate,
                "steps_per_execution": args.steps_per_execution if group == "loops" else 1,
                "target": TARGETS[group].get(family),
                "first_window_s": first,
                "next_loss": {k: float(np.asarray(v)) for k, v in losses.items()},
                "samples": samples,
                "median": {
                    k: {p: statistics.median(s[p] for s in v) for p in v[0]} for k, v in samples.items()
                },
            }
            wall = {k: [s["wall"] for s in v] for k, v in samples.items()}
            row["ratio"] = {k: timing.paired_ratio(wall, k, ref) for k, ref in _PAIRS[group]}
            if group == "models":
                floor = lambda i: min(wall["handwritten_donated"][i], wall["handwritten"][i])  # noqa: E731
                row["ratio"].update(
                    {f"{k}_floor": timing.paired_ratio(wall, k, floor) for k in ("run", "fit")}
                )
            if group == "fit":
                per_step = lambda a, b: statistics.median(  # noqa: E731
                    (p - q) / steps * 1e6 for p, q in zip(wall[a], wall[b])
                )
                row["batch_logs_us"] = per_step("fit_steps", "fit_no_batch_logs")
                row["sync_us"] = per_step("handwritten_sync", "handwritten")
            rows.append(row)
            env.log(
                f"  [{devices} {args.platform}] {group} {name}: "
                + ", ".join(f"{k} {row['median'][k]['wall'] / steps * 1e3:.3f}" for k in built)
                + " ms/step; ratios "
                + ", ".join(f"{k} {v:.3f}" for k, v in row["ratio"].items())
                + "; next loss "
                + " / ".join(f"{v:.6f}" for v in row["next_loss"].values())
            )
            if args.profile and family == "mlp" and group == "run":
                timing.profile(lambda: built["mirrax"][0](steps), f"{steps} mirrax MLP steps")
            if args.profile and family == "mlp" and group == "fit":
                row["decomposition_ms"] = take_fit_apart(fit_model, x, y, gb, steps, repeats)
                timing.profile(lambda: built["fit"][0](steps), "one MLP fit epoch", threads=True)
            if args.profile and group == "loops":
                row["evaluate_apart_ms"] = take_evaluate_apart(evaluate_inputs, repeats)
    return {"environment": env.environment(local), "rows": rows}


# (variant, reference) pairs whose same-round ratios each comparison reports.
_PAIRS = {
    "run": [("mirrax", "handwritten"), ("function", "handwritten")],
    "models": [("run", "handwritten_donated"), ("fit", "handwritten_donated")],
    "fit": [("fit", "handwritten"), ("fit_no_batch_logs", "handwritten")],
    "loops": [(f"mirrax_{k}", f"handwritten_{k}") for k in ("fit", "evaluate", "predict")],
}


def _ms(row, key, part="wall") -> str:
    return f"{row['median'][key][part] / row['steps'] * 1e3:.3f}"


def _s(row, key, part="wall") -> str:
    return f"{row['median'][key][part]:.4f}"


def _overhead_us(row) -> float:
    """mirrax's wall time per step minus the hand-written loop's, in microseconds."""
    return (row["median"]["mirrax"]["wall"] - row["median"]["handwritten"]["wall"]) / row["steps"] * 1e6


def _table_run(rows) -> list:
    lines = env.markdown_table(
        [
            "workload",
            "replicas",
            "global batch",
            "mirrax ms/step",
            "mirrax.function ms/step",
            "hand-written ms/step",
            "ratio",
            "function ratio",
            "overhead/step",
            "mirrax host µs/call",
            "function host µs/call",
            "hand-written host µs/call",
        ],
        [
            [
                r["workload"],
                r["devices"],
                r["global_batch"],
                _ms(r, "mirrax"),
                _ms(r, "function"),
                _ms(r, "handwritten"),
                f"{r['ratio']['mirrax']:.3f}",
                f"{r['ratio']['function']:.3f}",
                f"{_overhead_us(r):.0f} µs",
                f"{r['median']['mirrax']['host'] / r['steps'] * 1e6:.0f}",
                f"{r['median']['function']['host'] / r['steps'] * 1e6:.0f}",
                f"{r['median']['handwritten']['host'] / r['steps'] * 1e6:.0f}",
            ]
            for r in rows
        ],
    )
    return lines + [
        "",
        "Host µs/call: time inside the step call (dispatch and Python), not "
        "waiting for the device. Target ratio <= 1.05 (CNN); mirrax.function (strategy.run "
        "inside it, the model captured) <= 1.10.",
    ]


def _table_models(rows) -> list:
    keys = ("handwritten_donated", "handwritten", "run", "fit")
    lines = env.markdown_table(
        [
            "workload",
            "replicas",
            "steps/window",
            "hand-written, donated ms/step",
            "hand-written ms/step",
            "strategy.run ms/step",
            "fit ms/step",
            "strategy.run / donated",
            "fit / donated",
            "strategy.run / floor",
            "fit / floor",
        ],
        [
            [
                r["workload"],
                r["devices"],
                r["steps"],
                *[_ms(r, k) for k in keys],
                *[f"{r['ratio'][k]:.3f}" for k in ("run", "fit", "run_floor", "fit_floor")],
            ]
            for r in rows
        ],
    )
    return lines + ["", "Global batch 128; floor = the faster hand-written variant of the round."]


def _table_fit(rows) -> list:
    def outside(r):
        m = r["median"]["fit_steps"]
        return m["between"] + m["start"] + m["end"]

    lines = ["Steps per second:", ""] + env.markdown_table(
        [
            "workload",
            "replicas",
            "global batch",
            "steps/epoch",
            "fit ms/step",
            "hand-written ms/step",
            "fit / hand-written",
            "fit steps/s",
            "hand-written steps/s",
        ],
        [
            [
                r["workload"],
                r["devices"],
                r["global_batch"],
                r["steps"],
                _ms(r, "fit"),
                _ms(r, "handwritten"),
                f"{r['ratio']['fit']:.3f}",
                *[f"{r['steps'] / r['median'][k]['wall']:.0f}" for k in ("fit", "handwritten")],
            ]
            for r in rows
        ],
    )
    lines += ["", "The per-step logs (the loss read as a Python float after every step):", ""]
    lines += env.markdown_table(
        [
            "workload",
            "replicas",
            "fit ms/step",
            "fit without batch logs ms/step",
            "batch logs cost",
            "fit without batch logs / hand-written",
            "hand-written + float(loss) ms/step",
            "float(loss) costs the hand-written",
        ],
        [
            [
                r["workload"],
                r["devices"],
                _ms(r, "fit"),
                _ms(r, "fit_no_batch_logs"),
                f"{r['batch_logs_us']:.0f} µs/step",
                f"{r['ratio']['fit_no_batch_logs']:.3f}",
                _ms(r, "handwritten_sync"),
                f"{r['sync_us']:.0f} µs/step",
            ]
            for r in rows
        ],
    )
    lines += ["", "One fit epoch, in seconds (the epoch timed with batch hooks):", ""]
    lines += env.markdown_table(
        [
            "workload",
            "replicas",
            "epoch",
            "inside steps",
            "between steps",
            "epoch start + end",
            "outside steps",
            "outside, per step",
            "fit() call beyond its epoch",
            "epoch with validation",
            "of which validation",
        ],
        [
            [
                r["workload"],
                r["devices"],
                _s(r, "fit_steps"),
                _s(r, "fit_steps", "inside"),
                _s(r, "fit_steps", "between"),
                f"{r['median']['fit_steps']['start'] + r['median']['fit_steps']['end']:.4f}",
                f"{outside(r):.4f}",
                f"{outside(r) / r['steps'] * 1e6:.0f} µs",
                f"{r['median']['fit']['call'] - r['median']['fit']['wall']:.4f}",
                _s(r, "fit_validation"),
                f"{r['median']['fit_validation']['end']:.4f} ({max(1, r['steps'] // 5)} steps)",
            ]
            for r in rows
        ],
    )
    apart = [r for r in rows if "decomposition_ms" in r]
    if apart:
        parts = list(apart[0]["decomposition_ms"])
        lines += [
            "",
            "fit taken apart (--profile), ms per step; each part timed alone on an "
            "epoch of the same batches:",
            "",
        ]
        lines += env.markdown_table(
            ["workload", "replicas", "hand-written", *parts, "fit"],
            [
                [
                    r["workload"],
                    r["devices"],
                    _ms(r, "handwritten"),
                    *[f"{r['decomposition_ms'][p]:.3f}" for p in parts],
                    _ms(r, "fit"),
                ]
                for r in apart
            ],
        )
    return lines + ["", "Costs are medians of same-round pairs. Target fit / hand-written <= 1.05 (CNN)."]


def _table_loops(rows) -> list:
    apart = [r for r in rows if "evaluate_apart_ms" in r]
    lines = []
    if apart:
        parts = list(apart[0]["evaluate_apart_ms"])
        lines = [
            "",
            "evaluate taken apart (--profile), ms per step; each part timed alone on the same batches:",
            "",
        ] + env.markdown_table(
            ["workload", "replicas", *parts],
            [
                [r["workload"], r["devices"], *[f"{r['evaluate_apart_ms'][p]:.3f}" for p in parts]]
                for r in apart
            ],
        )
    return (
        env.markdown_table(
            ["workload", "replicas", "pass", "steps", "mirrax ms", "hand-written ms", "ratio", "target"],
            [
                [
                    r["workload"],
                    r["devices"],
                    kind
                    if r.get("steps_per_execution", 1) == 1
                    else f"{kind}, steps_per_execution={r['steps_per_execution']}",
                    r["steps"],
                    f"{r['median'][f'mirrax_{kind}']['wall'] * 1e3:.1f}",
                    f"{r['median'][f'handwritten_{kind}']['wall'] * 1e3:.1f}",
                    f"{r['ratio'][f'mirrax_{kind}']:.3f}",
                    f"<= {r['target']}",
                ]
                for r in rows
                for kind in ("fit", "evaluate", "predict")
            ],
        )
        + lines
    )


_TABLES = {
    "run": ("strategy.run vs the hand-written step", _table_run),
    "models": ("Three models at global batch 128: strategy.run and Model.fit vs hand-written", _table_models),
    "fit": ("Model.fit vs the hand-written step", _table_fit),
    "loops": ("fit / evaluate / predict on arrays vs hand-written loops", _table_loops),
}


def _markdown(results: list) -> str:
    rows = [row for result in results for row in result["rows"]]
    first = rows[0]
    lines = []
    for group, (title, table) in _TABLES.items():
        chosen = [r for r in rows if r["group"] == group]
        if chosen:
            lines += ["", f"### {title} (`--variants {group}`)", ""] + table(chosen)
    rounds = ", ".join(f"{g} {n}" for g, n in dict((r["group"], r["repeats"]) for r in rows).items())
    lines += [
        "",
        f"{env.environment_note(results[0]['environment'])} Medians of interleaved "
        f"rounds ({rounds}); ratios are medians of same-round ratios; at most "
        f"{first['max_in_flight']} steps in flight; the floor's buffers "
        f"{'donated' if first['donated'] else 'not donated'} (run, fit).",
    ]
    return "\n".join(lines[1:])


def main(argv=None) -> int:
    args = _parse_args(argv)
    child = env.forward_arguments(
        args,
        ("platform", "variants", "workloads", "cnn_steps", "mlp_steps", "steps_scale", "max_in_flight"),
        ("no_donate", "profile"),
    )
    if args.repeats is not None:
        child += ["--repeats", str(args.repeats)]
    return env.run_benchmark(args, _measure, _markdown, child, "benchmarks.overhead")


if __name__ == "__main__":
    sys.exit(main())
