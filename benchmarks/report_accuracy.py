"""Scaling report accuracy: the step times `scaling_report` predicts against measured ones.

Part 1, fake CPU devices (one process, 8 fake devices, threads sharing the machine's cores): the
tutorial CNN as `mirrax train` builds it (`mirrax.Model`, Adam, the bundled digits), fit's step,
at per-replica batch 16 (the `mirrax report` default: a 2 ms step, mostly host time) and 256.
Predicted by the report with link "local" (this process's all-reduce measured at 2, 4, 8
devices) and its shared-cores compute term: with all 8 devices (every row compiled) and, for
batch 256, with only 2 (rows 4 and 8 extrapolated from the program at 2). Measured:
`Model.make_train_function()` on MirroredStrategies over 1, 2, 4, 8 devices, windows
interleaved in rotation. Two errors: the report's own (its T1 was timed before the
measurement, on a machine whose load moves), and the model's given the T1 measured in the
interleaved windows (the model's arithmetic, with the report's communication and cores busy).

Part 2, 2 worker processes on one core each (MultiWorkerMirroredStrategy, Gloo on loopback,
as `multi_worker.py`), per-worker batch 16, two steps through `strategy.run`: "packed"
(`mirrax.value_and_grad(pack=True)`: one all-reduce of one gradient vector, in one process as
across two) and "10 arrays" (the custom loop's `train_step`, `nnx.value_and_grad`: one
all-reduce instruction of the CNN's 10 gradient arrays, which XLA:CPU's Gloo path runs one
array at a time). The link is measured between the two workers first, from bare all-reduces:
one array of 4 KiB and of the gradient's size give bandwidth and latency per instruction;
ten arrays of 4 KiB in one instruction give the latency per array (for "10 arrays",
`LinkModel(per_operand=True)`). A one-core process with 2 fake devices then runs the report of
each step with its link (T1 measured there), and the 1-worker and 2-worker steps are timed in
rotation.

Relative error = predicted / measured - 1 (of the step time; of the speedup it is
1 / (1 + error) - 1).

Usage:
  python -m benchmarks.report_accuracy                  # both parts, about 3 minutes
  python -m benchmarks.report_accuracy --skip-workers --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._harness import env, timing, workers

DEVICES = (1, 2, 4, 8)
# (label, per-replica batch, also report from 2 devices with 4 and 8 extrapolated)
FAKE_DEVICE_CASES = (("fit, 16 per replica", 16, False), ("fit, 256 per replica", 256, True))
PER_WORKER_BATCH = 16
SMALL_BYTES = 4096
ARRAYS = 10  # the tutorial CNN's parameter arrays


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=5, help="timed windows per case (5)")
    parser.add_argument(
        "--window-s", type=float, default=0.3, help="seconds a timed window lasts, about (0.3)"
    )
    parser.add_argument("--skip-devices", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-workers", action="store_true", help="leave out part 2")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", nargs=2, metavar=("ROLE", "CORE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows < 1 or args.window_s <= 0:
        parser.error("--windows must be >= 1 and --window-s > 0")
    return args


def _cnn_model(x, strategy):
    """The tutorial CNN compiled as examples/keras_fit.py compiles it, under `strategy`."""
    import optax
    from flax import nnx
    from mirrax.examples.keras_fit import TutorialCNN

    import mirrax

    with strategy.scope():
        model = mirrax.Model(TutorialCNN(x.shape[1:], rngs=nnx.Rngs(0)))
        model.compile(
            optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _distributed(strategy, per_replica: tuple):
    """The distributed global batch of `per_replica` on every replica of `strategy`."""
    import numpy as np

    replicas = strategy.num_replicas_in_sync
    iterator = iter(
        strategy.experimental_distribute_dataset([tuple(np.concatenate([a] * replicas) for a in per_replica)])
    )
    try:
        return next(iterator)
    finally:
        iterator.close()


def _steps_for(step, block, seconds: float) -> int:
    """Steps that fill a window of about `seconds`, from one warm step's time."""
    start = time.perf_counter()
    block(step())
    return max(1, round(seconds / max(time.perf_counter() - start, 1e-6)))


def packed_step(model, optimizer, batch):
    """The custom loop's step with the gradients packed into one all-reduce of one vector."""
    import optax

    import mirrax

    images, labels = batch

    def loss_fn(model):
        losses = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
        return mirrax.compute_average_loss(losses)

    loss, grads = mirrax.value_and_grad(loss_fn, pack=True)(model)
    optimizer.update(model, grads)
    return loss


# -- part 1: fake CPU devices ------------------------------------------------------------------


def _devices_part(args) -> dict:
    env.configure_jax_environment("cpu", max(DEVICES))
    import jax
    from flax import nnx

    import mirrax

    (x, y), _ = mirrax.data.load_digits()
    devices = env.local_devices("cpu", max(DEVICES), "report_accuracy")
    results = {}
    for label, per_replica, extrapolate in FAKE_DEVICE_CASES:
        batch = (x[:per_replica], y[:per_replica])
        predicted = {}
        for used in [devices] + ([devices[:2]] if extrapolate else []):
            start = time.perf_counter()
            report = mirrax.experimental.scaling_report(
                _cnn_model(x, mirrax.MirroredStrategy(devices[:1])),
                batch,
                max_replicas=max(DEVICES),
                link="local",
                devices=used,
            )
            env.log(
                f"  [{label}] report on {len(used)} devices: "
                f"{time.perf_counter() - start:.0f} s, T1 {report.one_device_ms:.2f} ms, "
                f"{report.cores_busy:.2f} cores busy"
            )
            predicted[f"{len(used)} devices"] = report.to_dict()
        cases = {}
        for n in DEVICES:
            strategy = mirrax.MirroredStrategy(devices[:n])
            model = _cnn_model(x, strategy)
            train, dist_batch = model.make_train_function(), _distributed(strategy, batch)

            def block(_, model=model):
                jax.block_until_ready(nnx.state((model.module, model.optimizer.nnx_optimizer)))

            def step(train=train, b=dist_batch):
                return train(b)

            block(step())  # compiles
            cases[n] = (step, block, _steps_for(step, block, args.window_s))
        busy = {n: [] for n in DEVICES}

        def window(n):  # timed from outside by `interleave`: the whole window's wall time
            cpu, start = time.process_time(), time.perf_counter()
            timing.run_steps(*cases[n], 2)
            busy[n].append((time.process_time() - cpu) / (time.perf_counter() - start))

        windows = timing.interleave({n: (lambda n=n: window(n)) for n in DEVICES}, args.windows)
        results[label] = {
            "per_replica_batch": per_replica,
            "predicted": predicted,
            "measured_ms": {n: [t / cases[n][2] * 1e3 for t in windows[n]] for n in DEVICES},
            "cores_busy": busy,
            "steps_per_window": {n: cases[n][2] for n in DEVICES},
        }
    return {"cases": results, "environment": env.environment(devices)}


# -- part 2: two one-core workers --------------------------------------------------------------


def _worker(role: str) -> tuple:
    """A worker's state: "1 worker" (MirroredStrategy on the first of its 2 fake devices; it
    also runs the reports) or "2 workers" (one task of the 2-worker cluster): both steps
    ready to run, and for the cluster the bare all-reduces that measure the link."""
    import mirrax

    # The strategy first: it initializes jax.distributed, which must precede any JAX call.
    strategy = (
        mirrax.MultiWorkerMirroredStrategy() if role == "2 workers" else mirrax.MirroredStrategy(["cpu:0"])
    )
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from mirrax.examples.custom_training_loop import train_step
    from mirrax.examples.keras_fit import TutorialCNN

    (x, y), _ = mirrax.data.load_digits()
    per_replica = (x[:PER_WORKER_BATCH], y[:PER_WORKER_BATCH])
    batch = _distributed(strategy, per_replica)
    tasks, objects = {}, {}
    for name, fn in (("packed", packed_step), ("10 arrays", train_step)):
        with strategy.scope():
            model = TutorialCNN(x.shape[1:], rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        def step(fn=fn, state=(model, optimizer)):
            return strategy.run(fn, args=state + (batch,))

        def block(out, state=(model, optimizer)):
            jax.block_until_ready((out, nnx.state(state)))

        block(step())
        tasks[name], objects[name] = (step, block), (fn, (model, optimizer))
    gradient_bytes = sum(p.nbytes for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if role == "2 workers":
        mesh = strategy.mesh
        psum = jax.jit(
            jax.shard_map(
                lambda vs: [jax.lax.psum(v[0], "replica") for v in vs],
                mesh=mesh,
                in_specs=P("replica"),
                out_specs=P(),
            )
        )

        def arrays(size, count):  # `count` arrays of `size` bytes, one row per worker
            return [
                jax.make_array_from_single_device_arrays(
                    (2, size // 4),
                    NamedSharding(mesh, P("replica")),
                    [jax.device_put(np.ones((1, size // 4), np.float32), jax.local_devices()[0])],
                )
                for _ in range(count)
            ]

        for key, size, count in (
            ("1 x 4 KiB", SMALL_BYTES, 1),
            ("1 x gradient", gradient_bytes, 1),
            (f"{ARRAYS} x 4 KiB", SMALL_BYTES, ARRAYS),
        ):
            vs = arrays(size, count)
            jax.block_until_ready(psum(vs))
            tasks[f"all-reduce {key}"] = (lambda vs=vs: psum(vs), jax.block_until_ready)
    state = {"tasks": tasks, "objects": objects, "per_replica": per_replica}
    return {"gradient_bytes": int(gradient_bytes), "tasks": sorted(tasks)}, state


def _handle(state, command):
    if command["op"] == "report":
        import mirrax

        fn, objects = state["objects"][command["task"]]
        report = mirrax.experimental.scaling_report(
            fn,
            state["per_replica"],
            objects,
            max_replicas=2,
            link=mirrax.experimental.LinkModel(**command["link"]),
        )
        return {"report": report.to_dict(), "table": str(report)}
    step, block = state["tasks"][command["task"]]
    return workers.timed(lambda: timing.run_steps(step, block, command["steps"], 2))


def _links(ms: dict, gradient_bytes: int) -> dict:
    """The two links of the bare all-reduces' medians (ms): at 2 replicas a ring all-reduce of
    one array of S bytes takes base + 2 latency + S / bandwidth (base 0 here); ten arrays in
    one instruction, run one at a time, 10 (2 latency + S / bandwidth)."""
    small, large, many = (
        statistics.median(ms[f"2 workers | all-reduce {key}"]) / 1e3
        for key in ("1 x 4 KiB", "1 x gradient", f"{ARRAYS} x 4 KiB")
    )
    bandwidth = (gradient_bytes - SMALL_BYTES) / max(large - small, 1e-9)
    latency = max(0.0, small - SMALL_BYTES / bandwidth) / 2
    per_array = max(0.0, many / ARRAYS - SMALL_BYTES / bandwidth) / 2
    source = "bare all-reduces between the two workers (loopback Gloo, one core each)"
    return {
        "packed": dict(
            name="loopback (measured)",
            bandwidth_gbps=bandwidth / 1e9,
            latency_us=latency * 1e6,
            source=source,
        ),
        "10 arrays": dict(
            name="loopback, per array (measured)",
            bandwidth_gbps=bandwidth / 1e9,
            latency_us=per_array * 1e6,
            source=source,
            per_operand=True,
        ),
    }


def _workers_part(args) -> dict:
    ports = [workers.free_port() for _ in range(2)]
    with workers.Pool("report-accuracy") as pool:

        def start(role, core, environment):
            return pool.start(
                env.module_command(__spec__.name, "--worker", role, core), f"{role} {core}", environment
            )

        one = start("1 worker", 0, workers.environment(devices=2))
        groups = {
            "1 worker": [one],
            "2 workers": [
                start("2 workers", i, workers.environment(TF_CONFIG=workers.tf_config(ports, i)))
                for i in range(2)
            ],
        }
        ready = pool.ready()
        gradient_bytes = ready[one]["gradient_bytes"]
        calibration = [
            ("2 workers", t) for t in ready[groups["2 workers"][0]]["tasks"] if t.startswith("all-reduce")
        ]
        link_ms = pool.windows(groups, calibration, 10, args.windows, 3)["ms"]
        link = _links(link_ms, gradient_bytes)
        for name, numbers in link.items():
            env.log(
                f"  link for {name}: {numbers['bandwidth_gbps']:.3f} GB/s, "
                f"{numbers['latency_us']:.0f} µs per step"
            )
        reports = {
            name: pool.ask([one], {"op": "report", "task": name, "link": link[name]}, timeout=600)[0]
            for name in link
        }
        steps = max(2, round(args.window_s * 1e3 / (8 * reports["packed"]["report"]["one_device_ms"])))
        samples = pool.windows(groups, [(g, t) for t in link for g in groups], steps, args.windows, 3)
    return {
        "link": link,
        "all_reduce_ms": link_ms,
        "reports": {name: r["report"] for name, r in reports.items()},
        "tables": {name: r["table"] for name, r in reports.items()},
        "measured_ms": samples["ms"],
        "cpu_ms": samples["cpu_ms"],
        "steps_per_window": steps,
    }


# -- tables ---------------------------------------------------------------------------------


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.1%}"


def _device_rows(case: dict) -> list:
    measured = {int(n): statistics.median(v) for n, v in case["measured_ms"].items()}
    busy = {int(n): statistics.median(v) for n, v in case["cores_busy"].items()}
    rows = []
    for label, report in case["predicted"].items():
        cores, u1 = report["shared_cores"], report["cores_busy"]
        for row in report["rows"]:
            n, m = row["replicas"], measured[row["replicas"]]
            # The model with the interleaved windows' T1: compute shared as the report's.
            compute = max(measured[1], n * measured[1] * u1 / cores) if cores else measured[1]
            model = compute + row["communication_ms"]
            rows.append(
                [
                    label,
                    n,
                    row["source"],
                    f"{row['compute_ms']:.2f}",
                    f"{row['communication_ms']:.2f}",
                    f"{row['step_ms']:.2f}",
                    f"{m:.2f}",
                    _error(row["step_ms"], m),
                    f"{model:.2f}",
                    _error(model, m),
                    f"{row['speedup']:.2f}",
                    f"{n * measured[1] / m:.2f}",
                    f"{busy[n]:.2f}",
                ]
            )
    return rows


def _tables(result: dict) -> str:
    lines = []
    devices = result.get("devices")
    for label, case in (devices or {}).get("cases", {}).items():
        first = next(iter(case["predicted"].values()))
        lines += [
            f"Part 1: fake CPU devices, the tutorial CNN's fit step, {label}, link 'local', shared cores",
            "",
        ]
        lines += env.markdown_table(
            [
                "report run on",
                "replicas",
                "program",
                "predicted compute ms",
                "predicted comm ms",
                "predicted step ms",
                "measured step ms",
                "error",
                "model with measured T1, ms",
                "its error",
                "predicted speedup",
                "measured speedup",
                "measured cores busy",
            ],
            _device_rows(case),
            ["l", "r", "l"] + ["r"] * 10,
        )
        fits = ", ".join(f"{n}: {b:.2f} GB/s, {lat:.0f} µs" for n, b, lat in first["link"]["calibrated"])
        lines += [
            "",
            f"Link 'local' measured ({fits} per ring step); the report's T1 "
            f"{first['one_device_ms']:.2f} ms with {first['cores_busy']:.2f} cores busy, "
            f"{first['shared_cores']} cores shared.",
            "",
        ]
    two = result.get("workers")
    if two:
        rows = []
        for name, report in two["reports"].items():
            one_ms = statistics.median(two["measured_ms"][f"1 worker | {name}"])
            two_ms = statistics.median(two["measured_ms"][f"2 workers | {name}"])
            row = report["rows"][1]
            ops = ", ".join(f"{op['instructions']} {kind}" for kind, op in row["collectives"].items())
            rows += [
                [
                    name,
                    "1 worker (the report's T1)",
                    f"{report['one_device_ms']:.2f}",
                    f"{one_ms:.2f}",
                    _error(report["one_device_ms"], one_ms),
                    "",
                ],
                [
                    name,
                    "2 workers",
                    f"{row['step_ms']:.2f}",
                    f"{two_ms:.2f}",
                    _error(row["step_ms"], two_ms),
                    f"{ops}, {row['communication_ms']:.2f} ms",
                ],
                [
                    name,
                    "2 workers: speedup",
                    f"{row['speedup']:.2f}",
                    f"{2 * one_ms / two_ms:.2f}",
                    _error(row["speedup"], 2 * one_ms / two_ms),
                    "",
                ],
            ]
        lines += [
            f"Part 2: 2 workers, one core each, Gloo on loopback, per-worker batch {PER_WORKER_BATCH}",
            "",
        ]
        lines += env.markdown_table(
            ["step", "case", "predicted", "measured", "error", "predicted communication"],
            rows,
            ["l", "l", "r", "r", "r", "l"],
        )
        bare = ", ".join(
            f"{key.split('| all-reduce ')[1]} {statistics.median(v):.2f}"
            for key, v in two["all_reduce_ms"].items()
        )
        fitted = "; ".join(
            f"{name} {link['bandwidth_gbps']:.3f} GB/s, {link['latency_us']:.0f} µs per step"
            for name, link in two["link"].items()
        )
        lines += ["", f"Links measured between the workers (bare all-reduces, median ms: {bare}): {fitted}."]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parse_args(argv)
    env.check_json_path(args.json)
    if args.worker:
        role, core = args.worker
        return workers.serve(lambda: _worker(role), _handle, core=int(core))
    began = workers.begin("report_accuracy", pinned=not args.skip_workers)
    result = {}
    if not args.skip_workers:  # first: this process must not run JAX while they start
        env.log("part 2: 3 worker processes (1 worker; a 2-worker cluster) ...")
        result["workers"] = _workers_part(args)
    if not args.skip_devices:
        env.log("part 1: 8 fake CPU devices in this process ...")
        result["devices"] = _devices_part(args)
    print(_tables(result))
    workers.finish(began, f"{args.windows} windows of about {args.window_s} s per case", args.json, result)


if __name__ == "__main__":
    try:
        main()
    except workers.WorkerFailedError as error:
        sys.exit(f"report_accuracy: {error}")
