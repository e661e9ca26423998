"""`Model.fit` / `evaluate` / `predict` on NumPy arrays against hand-written jitted loops over the
same batches: what mirrax's Keras loop costs over the loop a JAX expert writes.

Both sides get the same arrays (`steps` global batches of random data), the same model, the
same initial weights and the same optimizer (Adam 1e-3), and run one pass over the arrays:

- mirrax: `mirrax.Model(module)` compiled with `SparseCategoricalCrossentropy(from_logits=True)`
  under a `MirroredStrategy` over the devices; `fit(x, y, batch_size=B, epochs=1, verbose=0,
  shuffle=False)`, `evaluate(x, y, batch_size=B, verbose=0)`, `predict(x, batch_size=B,
  verbose=0)`: slicing the arrays, placing each batch, the loss tracker, callbacks and logs
  included.
- hand-written: `nnx.split` once; per batch, slice the NumPy arrays, `jax.device_put` the
  slices sharded over the devices, and call one `jax.jit(jax.shard_map(...))` program (the
  train step with `donate_argnums=0`; the evaluation step adding the loss to device-resident
  totals; the prediction step returning the logits). The loss is read once, at the end (as
  fit's epoch logs); predict's outputs are copied to one NumPy array at the end (as
  `Model.predict` returns). At most 4 steps in flight on multi-device CPU (XLA:CPU's
  in-process all-reduce deadlocks with ~100 queued), as fit does.

Workloads: an MLP 784-256-256-10 at global batch 128 (host-sensitive: ~1 ms of compute per
step here) and the TF tutorial CNN at global batch 128 (compute-bound). Timing: one untimed
pass of every variant (which compiles), then `--repeats` rounds; each round times every
variant once, the order flipped every round. Reported: median seconds per pass and the median
of same-round ratios mirrax / hand-written. Targets (issue 13): <= 1.10 for the MLP, <= 1.05
for the CNN. Each device count runs in a fresh subprocess (the fake CPU device count is fixed
when JAX starts).

Usage:
  python benchmarks/fit_floor.py                 # 1 and 4 fake CPU devices, ~3 min
  python benchmarks/fit_floor.py --devices 4 --workloads mlp
  python benchmarks/fit_floor.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import overhead

GLOBAL_BATCH = 128
STEPS = {"mlp": 160, "cnn": 8}
TARGETS = {"mlp": 1.10, "cnn": 1.05}
KINDS = ("fit", "evaluate", "predict")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="mirrax.Model.fit / evaluate / predict vs hand-written jitted loops.")
    parser.add_argument("--devices", default="1,4", help="comma-separated replica counts")
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    parser.add_argument("--workloads", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    overhead.check_divides(parser, args, {"": GLOBAL_BATCH})
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workload_names) - set(STEPS))
    if unknown or not args.workload_names:
        parser.error(f"--workloads: unknown {unknown or args.workloads!r}; use mlp, cnn")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mirrax
    import workloads

    local = overhead.local_devices(args.platform, devices, "fit_floor.py")
    mesh = jax.sharding.Mesh(np.array(local), ("replica",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    cap = 4 if devices > 1 and args.platform == "cpu" else None
    modules = {"mlp": (workloads.MLP256, (784,)), "cnn": (workloads.CNN, (28, 28, 1))}

    def capped(queue, value):
        if cap is not None:
            queue.append(value)
            if len(queue) > cap:
                jax.block_until_ready(queue.popleft())

    def handwritten(module_cls, x, y, steps):
        model = module_cls(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        leaves, state_def = jax.tree.flatten(state)
        holder = {"state": jax.device_put(leaves, replicated)}

        def rebuild(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))

        def losses(model, xb, yb):
            return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb)

        def train(leaves, xb, yb):
            model, optimizer = rebuild(leaves)
            loss = workloads.update(model, optimizer, xb, yb,
                                    lambda l: l.sum() / GLOBAL_BATCH)
            return jax.tree.leaves(nnx.state((model, optimizer))), jax.lax.psum(loss, "replica")

        def evaluate(leaves, totals, xb, yb):
            model, _ = rebuild(leaves)
            return totals + jax.lax.psum(losses(model, xb, yb).sum(), "replica")

        def predict(leaves, xb):
            return rebuild(leaves)[0](xb)

        specs = dict(mesh=mesh)
        train_fn = jax.jit(jax.shard_map(train, in_specs=(P(), P("replica"), P("replica")),
                                         out_specs=(P(), P()), **specs), donate_argnums=0)
        eval_fn = jax.jit(jax.shard_map(evaluate, in_specs=(P(), P(), P("replica"),
                                                            P("replica")),
                                        out_specs=P(), **specs))
        predict_fn = jax.jit(jax.shard_map(predict, in_specs=(P(), P("replica")),
                                           out_specs=P("replica"), **specs))

        def batches(arrays):
            for i in range(steps):
                part = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
                yield [jax.device_put(a[part], sharded) for a in arrays]

        def fit():
            total, queue = None, collections.deque()
            for xb, yb in batches((x, y)):
                holder["state"], loss = train_fn(holder["state"], xb, yb)
                total = loss if total is None else total + loss
                capped(queue, loss)
            return float(total) / steps

        def run_evaluate():
            totals, queue = jax.device_put(np.float32(0), replicated), collections.deque()
            for xb, yb in batches((x, y)):
                totals = eval_fn(holder["state"], totals, xb, yb)
                capped(queue, totals)
            return float(totals) / (steps * GLOBAL_BATCH)

        def run_predict():
            outs, queue = [], collections.deque()
            for (xb,) in batches((x,)):
                outs.append(predict_fn(holder["state"], xb))
                capped(queue, outs[-1])
            return np.concatenate([np.asarray(o) for o in outs])

        return {"fit": fit, "evaluate": run_evaluate, "predict": run_predict}

    def with_mirrax(module_cls, x, y):
        strategy = mirrax.MirroredStrategy(local)
        with strategy.scope():
            model = mirrax.Model(module_cls(nnx.Rngs(0)))
            model.compile(optimizer=optax.adam(1e-3),
                          loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
        common = dict(batch_size=GLOBAL_BATCH, verbose=0)
        return {
            "fit": lambda: model.fit(x, y, epochs=1, shuffle=False,
                                     **common).history["loss"][-1],
            "evaluate": lambda: model.evaluate(x, y, **common),
            "predict": lambda: model.predict(x, **common),
        }

    rows = []
    for name in args.workload_names:
        module_cls, shape = modules[name]
        steps = STEPS[name]
        x, y = workloads.random_batch(shape, GLOBAL_BATCH * steps)
        variants = {"mirrax": with_mirrax(module_cls, x, y),
                    "handwritten": handwritten(module_cls, x, y, steps)}
        first = {v: {k: fn() for k, fn in kinds.items()} for v, kinds in variants.items()}
        seconds = {(v, k): [] for v in variants for k in KINDS}
        for round_ in range(args.repeats):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for kind in KINDS:
                for variant in order:
                    start = time.perf_counter()
                    variants[variant][kind]()
                    seconds[variant, kind].append(time.perf_counter() - start)
        for kind in KINDS:
            ratios = [a / b for a, b in zip(seconds["mirrax", kind], seconds["handwritten", kind])]
            row = {
                "workload": name, "devices": devices, "global_batch": GLOBAL_BATCH,
                "steps": steps, "kind": kind, "repeats": args.repeats,
                "mirrax_s": statistics.median(seconds["mirrax", kind]),
                "handwritten_s": statistics.median(seconds["handwritten", kind]),
                "ratio": statistics.median(ratios), "target": TARGETS[name],
            }
            if kind != "predict":
                row["first_loss"] = {v: float(first[v][kind]) for v in variants}
            rows.append(row)
            print(f"  [{devices} {args.platform}] {name} {kind}: mirrax "
                  f"{row['mirrax_s'] * 1e3:.1f} ms, hand-written {row['handwritten_s'] * 1e3:.1f}"
                  f" ms, ratio {row['ratio']:.3f}"
                  + (f", first loss {row['first_loss']}" if "first_loss" in row else ""),
                  file=sys.stderr, flush=True)
    return {"environment": overhead.environment(jax, local), "rows": rows}


def _markdown(results: list) -> str:
    lines = ["| workload | replicas | pass | steps | mirrax ms | hand-written ms | ratio | target |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        for row in result["rows"]:
            lines.append(
                f"| {row['workload']} | {row['devices']} | {row['kind']} | {row['steps']} "
                f"| {row['mirrax_s'] * 1e3:.1f} | {row['handwritten_s'] * 1e3:.1f} "
                f"| {row['ratio']:.3f} | <= {row['target']} |")
    first = results[0]["rows"][0]
    lines += ["", f"{overhead.environment_note(results[0]['environment'])} Global batch "
              f"{first['global_batch']}; medians of {first['repeats']} interleaved rounds; ratio: "
              "median of same-round mirrax / hand-written."]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    child = overhead.forward_arguments(args, ("platform", "workloads", "repeats"), ())
    return overhead.run_benchmark(args, _measure, _markdown, child, __file__)


if __name__ == "__main__":
    sys.exit(main())
