"""Multi-worker weak scaling: 1 worker on 1 core against 2 workers on 1 core each.

Long-lived workers pinned one per core (`_harness/workers.py`), per-worker batch fixed (CNN 64,
MLP 784-1024-1024-10 128): "1 worker" (no TF_CONFIG), "2 independent" (two not talking: what
sharing the machine costs), "2 workers" (a 2-task TF_CONFIG cluster, Gloo); frameworks mirrax,
mirrax-packed (`mirrax.value_and_grad`), with --sharded mirrax-sharded (the same with
`shard_optimizer_state=True`) and, when it imports, TensorFlow's
MultiWorkerMirroredStrategy on the same Keras models. Windows of `--steps` `strategy.run` steps,
`--repeats` rounds in rotation, a window taking its slowest process's time. Columns: median
ms/step, ex/s, throughput ratio (2 workers / 1 worker ex/s), efficiency (1 worker / 2 workers
ms/step), steps doing only the gradient's all-reduce (`strategy.run`; a bare
`jax.jit(jax.shard_map(psum))`), the step's HLO all-reduces; the CPU ms per step (all threads,
mean of the processes); from `jax.profiler`, where mirrax's step goes.

Usage:
  python -m benchmarks.multi_worker                     # table on stdout, ~3-4 minutes
  python -m benchmarks.multi_worker --steps 5 --repeats 5 --json out.json
  python -m benchmarks.multi_worker --skip-tf --no-profile --workloads MLP
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import os
import sys
import tempfile
import threading
import time

from benchmarks._harness import env, hlo, peer_models, timing, workers

WORKLOADS = ("CNN", "MLP")
PER_WORKER_BATCH = {"CNN": 64, "MLP": 128}
CONFIGS = ("1 worker", "2 independent", "2 workers")
PROFILE_COLUMNS = ("wall_ms", "executable_ms", "all_reduce_ms", "compute_ms", "host_ms")
ROW_KEYS = {"1 worker": "one_worker", "2 independent": "two_independent", "2 workers": "two_workers"}
MAX_IN_FLIGHT = 2


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Weak scaling of MultiWorkerMirroredStrategy.")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window (10)")
    parser.add_argument("--repeats", type=int, default=7, help="timed windows per case (7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case (3)")
    parser.add_argument("--skip-tf", action="store_true", help="do not run TensorFlow")
    parser.add_argument("--no-profile", action="store_true", help="skip the jax.profiler pass")
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="also mirrax-sharded: mirrax-packed with shard_optimizer_state=True",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of CNN,MLP (default both)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", nargs=3, metavar=("FRAMEWORK", "WORKERS", "CORE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    args.workloads = [
        w.upper()
        for w in env.names_option(parser, "--workloads", args.workloads, [w.lower() for w in WORKLOADS])
    ]
    if not args.workloads:
        parser.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    return args


def all_reduce_stats(hlo_text: str) -> dict:
    """Counts the all-reduce ops of an optimized HLO module and the bytes they reduce."""
    found = hlo.all_reduces(hlo_text)
    return {
        "all_reduce_ops": len(found),
        "all_reduce_bytes": sum(hlo.nbytes(a) for arrays in found for a in arrays),
    }


def _mirrax_worker(num_workers: int, workloads: list, packed: bool = False, sharded: bool = False) -> tuple:
    import mirrax

    # The strategy first: it initializes jax.distributed, which must precede any JAX call.
    strategy = mirrax.MultiWorkerMirroredStrategy(shard_optimizer_state=sharded)

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks._harness import models

    mesh, axis = strategy.mesh, strategy.mesh.axis_names[0]
    local_devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    raw_allreduce = jax.jit(
        jax.shard_map(
            lambda g: jax.tree.map(lambda x: jax.lax.psum(x[0], axis), g),
            mesh=mesh,
            in_specs=P(axis),
            out_specs=P(),
        )
    )

    def allreduce(grads):
        return mirrax.get_replica_context().all_reduce("sum", grads)

    tasks, info = {}, {"strategy": repr(strategy), "jax": jax.__version__}
    for name in workloads:
        with strategy.scope():
            model = {"CNN": models.CNN, "MLP": models.WideMLP}[name](nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        x, y = peer_models.random_data(name.lower(), PER_WORKER_BATCH[name], seed=1 + jax.process_index())
        batch = strategy.experimental_distribute_values_from_function(lambda ctx: (x, y))
        train_step = models.strategy_run_step(num_workers * PER_WORKER_BATCH[name], packed)
        step = functools.partial(strategy.run, train_step, args=(model, optimizer, batch))

        def block(out, state=(model, optimizer)):
            jax.block_until_ready((out, nnx.state(state)))

        start = time.perf_counter()
        block(step())
        compile_s = time.perf_counter() - start
        tasks[name] = (step, block)
        shapes = [p.shape for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
        # The all-reduces of the very program strategy.run runs, on the same arguments.
        lowered = strategy.experimental_lower(train_step, args=(model, optimizer, batch))
        info[name] = {
            "parameters": int(sum(np.prod(s) for s in shapes)),
            "compile_s": compile_s,
            "hlo": all_reduce_stats(lowered.compile().as_text()),
        }
        if num_workers == 1:
            continue
        # Steps that do only the all-reduce of a gradient-shaped pytree of ones.
        grads = strategy.experimental_distribute_values_from_function(
            lambda ctx: [np.ones(s, np.float32) for s in shapes]
        )
        stacked = [
            jax.make_array_from_single_device_arrays(
                (len(mesh.devices.flat),) + s,
                NamedSharding(mesh, P(axis)),
                [jax.device_put(np.ones((1,) + s, np.float32), d) for d in local_devices],
            )
            for s in shapes
        ]
        for key, fn in (
            ("allreduce_run", lambda g=grads: strategy.run(allreduce, args=(g,))),
            ("allreduce_raw", lambda s=stacked: raw_allreduce(s)),
        ):
            jax.block_until_ready(fn())
            tasks[f"{name} {key}"] = (fn, jax.block_until_ready)
        info[name]["raw_allreduce_hlo"] = all_reduce_stats(raw_allreduce.lower(stacked).compile().as_text())
    return tasks, functools.partial(timing.run_steps, max_in_flight=MAX_IN_FLIGHT), info


def profile_steps(step, block, steps: int) -> dict:
    """ms per step under `jax.profiler`, each step waited for: `wall`, `executable` (the
    `ThunkExecutor::Execute` spans), of it `all_reduce` (the all-reduce thunks, waiting for
    the other worker included), and the 8 costliest other thunks."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own events would slow the host side down
    with tempfile.TemporaryDirectory(prefix="mirrax-mw-trace-") as trace_dir:
        jax.profiler.start_trace(trace_dir, profiler_options=options)
        start = time.perf_counter()
        for _ in range(steps):
            block(step())
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        paths = [
            os.path.join(d, f)
            for d, _, files in os.walk(trace_dir)
            for f in files
            if f.endswith(".xplane.pb")
        ]
        data = jax.profiler.ProfileData.from_file(paths[0])
    events = [
        event
        for plane in data.planes
        if plane.name.startswith("/host:CPU")
        for line in plane.lines
        for event in line.events
    ]
    totals = collections.Counter()
    for event in events:
        totals[event.name] += event.duration_ns
    executable = _union_ms([e for e in events if e.name == "ThunkExecutor::Execute"], steps)
    all_reduce = _union_ms([e for e in events if e.name.startswith("all-reduce")], steps)
    # Thunks of nested computations run inside their parent's span, so this list may count
    # time twice; the two spans are unions and do not.
    thunks = {
        k: v / 1e6 / steps
        for k, v in totals.items()
        if not k.startswith(("all-reduce", "end: ", "$", "Pjit")) and "Execute" not in k and "::" not in k
    }
    wall *= 1e3 / steps
    return {
        "wall_ms": wall,
        "executable_ms": executable,
        "all_reduce_ms": all_reduce,
        "compute_ms": executable - all_reduce,
        "host_ms": wall - executable,
        "top_thunks_ms": dict(sorted(thunks.items(), key=lambda kv: -kv[1])[:8]),
    }


def _union_ms(events: list, steps: int) -> float:
    """ms per step covered by the union of the events' (start, end) spans."""
    total, reach = 0, float("-inf")
    for start, end in sorted((e.start_ns, e.end_ns) for e in events):
        total, reach = total + max(0, end - max(start, reach)), max(reach, end)
    return total / 1e6 / steps


def _tf_worker(num_workers: int, workloads: list) -> tuple:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras = tf.keras

    def first_batch(make):
        return next(
            iter(
                strategy.distribute_datasets_from_function(
                    lambda ctx: tf.data.Dataset.from_tensors(make()).repeat()
                )
            )
        )

    def block(out):
        for value in tf.nest.flatten(out):
            strategy.experimental_local_results(value)[0].numpy()

    def run_steps(step, block, steps):
        for _ in range(steps):
            out = step()
        block(out)

    def replica_reduce(g):
        # Tensors straight from the iterator carry no device, and MWMS then finds no
        # destination for the reduction ("destinations can not be empty").
        g = tf.nest.map_structure(tf.identity, g)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, g)

    tasks, info = {}, {"strategy": type(strategy).__name__, "tensorflow": tf.__version__}
    for name in workloads:
        global_batch = num_workers * PER_WORKER_BATCH[name]
        with strategy.scope():
            model = peer_models.keras_model(keras, name.lower())
            optimizer = keras.optimizers.Adam(1e-3)
            optimizer.build(model.trainable_variables)
        x, y = peer_models.random_data(
            name.lower(), PER_WORKER_BATCH[name], seed=1 + (strategy.cluster_resolver.task_id or 0)
        )
        xb, yb = first_batch(lambda: (x, y))

        def replica_step(x, y, model=model, optimizer=optimizer, global_batch=global_batch):
            with tf.GradientTape() as tape:
                per_example = keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True
                )
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        train = tf.function(functools.partial(strategy.run, replica_step))
        start = time.perf_counter()
        block(train(args=(xb, yb)))
        info[name] = {
            "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "compile_s": time.perf_counter() - start,
        }
        tasks[name] = (functools.partial(train, args=(xb, yb)), block)
        if num_workers == 1:
            continue
        grads = first_batch(lambda: tuple(np.ones(v.shape, np.float32) for v in model.trainable_variables))
        reduce_all = tf.function(lambda g: strategy.run(replica_reduce, args=(g,)))
        block(reduce_all(grads))
        tasks[f"{name} allreduce_run"] = (functools.partial(reduce_all, grads), block)
    return tasks, run_steps, info


def _worker_main(args) -> None:
    """A worker process; its framework's builder returns ({task: (step, block)}, run_steps,
    info), a task being a workload's train step or an all-reduce-only step."""
    framework, num_workers, core = args.worker
    build = {
        "mirrax": _mirrax_worker,
        "tensorflow": _tf_worker,
        "mirrax-packed": lambda n, w: _mirrax_worker(n, w, packed=True),
        "mirrax-sharded": lambda n, w: _mirrax_worker(n, w, packed=True, sharded=True),
    }[framework]

    def start():
        tasks, run_steps, info = build(int(num_workers), args.workloads)
        info.update(affinity=sorted(os.sched_getaffinity(0)), threads=threading.active_count())
        return {"tasks": sorted(tasks), "info": info}, (tasks, run_steps)

    def handle(state, command):
        tasks, run_steps = state
        step, block = tasks[command["task"]]
        if command["op"] == "profile":
            return profile_steps(step, block, command["steps"])
        return workers.timed(lambda: run_steps(step, block, command["steps"]))

    workers.serve(start, handle, core=int(core))


def _measure(framework: str, args) -> dict:
    """Starts the three configurations of `framework`, times them in rotation; the results."""
    ports = [workers.free_port() for _ in range(2)]
    with workers.Pool(f"multi-worker-{framework}") as pool:

        def start(num_workers, core, label):  # the 2-worker cluster's task index is its core
            command = env.module_command(
                __spec__.name,
                "--worker",
                framework,
                num_workers,
                core,
                "--workloads",
                ",".join(args.workloads),
            )
            tf_config = workers.tf_config(ports, core) if num_workers > 1 else None
            return pool.start(command, label, workers.environment(TF_CONFIG=tf_config))

        one = start(1, 0, "1 worker")
        groups = {
            "1 worker": [one],
            "2 independent": [one, start(1, 1, "independent")],
            "2 workers": [start(2, i, "2 workers") for i in range(2)],
        }
        began = time.perf_counter()
        ready = pool.ready()
        startup_s = time.perf_counter() - began
        cases = [(config, task) for config in CONFIGS for task in ready[groups[config][-1]]["tasks"]]
        samples = pool.windows(groups, cases, args.steps, args.repeats, args.warmup)
        profiles = (
            {}
            if framework != "mirrax" or args.no_profile
            else {
                f"{config} | {task}": pool.ask(
                    groups[config], {"op": "profile", "task": task, "steps": args.steps}
                )
                for config, task in cases
                if task in WORKLOADS
            }
        )
    return {
        "framework": framework,
        "startup_s": startup_s,
        "profiles": profiles,
        "info": {config: [ready[p]["info"] for p in groups[config]] for config in CONFIGS},
        "ms_per_step": samples["ms"],
        **{f"median_{key}": timing.medians(values) for key, values in samples.items()},
    }


def _rows(result: dict) -> list:
    """One row per workload: the JSON's rows and the tables' cells."""
    rows = []
    for workload in WORKLOADS:
        if f"1 worker | {workload}" not in result["median_ms"]:
            continue
        per_worker = PER_WORKER_BATCH[workload]
        one_info, two_info = (result["info"][c][0][workload] for c in ("1 worker", "2 workers"))
        hlo_stats = two_info.get("hlo", {})
        row = {
            "framework": result["framework"],
            "workload": workload,
            "parameters": two_info["parameters"],
            "per_worker_batch": per_worker,
        }
        for unit in ("ms", "cpu_ms"):
            medians = result[f"median_{unit}"]
            for config, key in ROW_KEYS.items():
                row[f"{key}_{unit}"] = medians[f"{config} | {workload}"]
            for task in ("run", "raw"):
                row[f"allreduce_{task}_{unit}"] = medians.get(f"2 workers | {workload} allreduce_{task}")
        one, independent, two = (row[f"{key}_ms"] for key in ROW_KEYS.values())
        row.update(
            {
                "one_worker_examples_per_s": per_worker / one * 1e3,
                "two_workers_examples_per_s": 2 * per_worker / two * 1e3,
                "throughput_ratio": 2 * one / two,
                "efficiency": one / two,
                "efficiency_without_communication": one / independent,
                "hlo_all_reduce_ops": hlo_stats.get("all_reduce_ops"),
                "hlo_all_reduce_bytes": hlo_stats.get("all_reduce_bytes"),
                "raw_hlo_all_reduce_ops": two_info.get("raw_allreduce_hlo", {}).get("all_reduce_ops"),
                "one_worker_hlo_all_reduce_ops": one_info.get("hlo", {}).get("all_reduce_ops"),
            }
        )
        rows.append(row)
    return rows


def _tables(rows: list, results: list) -> str:
    """The scaling table, the CPU-time table and the profile table (mirrax's steps)."""
    scaling = env.markdown_table(
        [
            "framework",
            "workload",
            "per-worker batch",
            "1 worker ms/step",
            "2 independent ms/step",
            "2 workers ms/step",
            "1 worker ex/s",
            "2 workers ex/s",
            "throughput ratio",
            "efficiency",
            "all-reduce only ms/step (strategy.run)",
            "raw psum ms/step",
            "all-reduce ops / MiB in the step's HLO",
        ],
        [
            [r["framework"], r["workload"], r["skipped"]] + [""] * 10
            if r.get("skipped")
            else [
                r["framework"],
                r["workload"],
                r["per_worker_batch"],
                workers.fmt(r["one_worker_ms"]),
                workers.fmt(r["two_independent_ms"]),
                workers.fmt(r["two_workers_ms"]),
                workers.fmt(r["one_worker_examples_per_s"], 0),
                workers.fmt(r["two_workers_examples_per_s"], 0),
                workers.fmt(r["throughput_ratio"], 3),
                workers.fmt(r["efficiency"], 3),
                workers.fmt(r["allreduce_run_ms"]),
                workers.fmt(r["allreduce_raw_ms"]),
                "n/a"
                if r["hlo_all_reduce_ops"] is None
                else f"{r['hlo_all_reduce_ops']} / {r['hlo_all_reduce_bytes'] / 2**20:.2f}",
            ]
            for r in rows
        ],
        ["l", "l"] + ["r"] * 11,
    )
    cpu = env.markdown_table(
        [
            "framework",
            "workload",
            "1 worker CPU ms/step",
            "2 independent CPU ms/step",
            "2 workers CPU ms/step",
            "2 workers minus 1 worker",
            "all-reduce only CPU ms/step (strategy.run)",
            "raw psum CPU ms/step",
            "CPU-bound efficiency (1 worker CPU / 2 workers CPU)",
        ],
        [
            [
                r["framework"],
                r["workload"],
                workers.fmt(r["one_worker_cpu_ms"]),
                workers.fmt(r["two_independent_cpu_ms"]),
                workers.fmt(r["two_workers_cpu_ms"]),
                workers.fmt(r["two_workers_cpu_ms"] - r["one_worker_cpu_ms"]),
                workers.fmt(r["allreduce_run_cpu_ms"]),
                workers.fmt(r["allreduce_raw_cpu_ms"]),
                workers.fmt(r["one_worker_cpu_ms"] / r["two_workers_cpu_ms"], 3),
            ]
            for r in rows
            if not r.get("skipped")
        ],
        ["l", "l"] + ["r"] * 7,
    )
    profile_rows = [
        key.split(" | ")[::-1]  # workload, configuration
        + [" / ".join(f"{p[column]:.2f}" for p in per_worker) for column in PROFILE_COLUMNS]
        + [", ".join(f"{k} {v:.1f}" for k, v in list(per_worker[0]["top_thunks_ms"].items())[:4])]
        for result in results
        for key, per_worker in result["profiles"].items()
    ]
    profile = env.markdown_table(
        [
            "workload",
            "configuration",
            "wall ms/step (each step waited for)",
            "XLA executable ms/step",
            "of which all-reduce",
            "of which compute",
            "outside the executable (host)",
            "costliest compute thunks (ms/step, worker 0)",
        ],
        profile_rows,
        ["l", "l"] + ["r"] * 5 + ["l"],
    )
    return "\n\n".join("\n".join(table) for table in (scaling, cpu, profile))


def main(argv=None) -> None:
    args = _parse_args(argv)
    env.check_json_path(args.json)
    if args.worker:
        return _worker_main(args)
    began = workers.begin("multi_worker")
    frameworks, tf_status = ["mirrax", "mirrax-packed"], "skipped (--skip-tf)"
    frameworks += ["mirrax-sharded"] if args.sharded else []
    if not args.skip_tf and importlib.util.find_spec("tensorflow"):  # found, not imported
        frameworks, tf_status = frameworks + ["tensorflow"], "run"
    elif not args.skip_tf:
        tf_status = "TensorFlow not installed: skipped"
        env.log(tf_status)
    results, rows = [], []
    for framework in frameworks:
        env.log(f"[{framework}] starting 4 worker processes ...")
        results.append(_measure(framework, args))
        rows.extend(_rows(results[-1]))
    if tf_status != "run":
        rows.extend({"framework": "tensorflow", "workload": w, "skipped": tf_status} for w in args.workloads)
    print(_tables(rows, results))
    workers.finish(
        began,
        f"{args.repeats} windows of {args.steps} steps per case",
        args.json,
        {
            "steps_per_window": args.steps,
            "repeats": args.repeats,
            "tensorflow": tf_status,
            "rows": rows,
            "results": results,
        },
    )


if __name__ == "__main__":
    try:
        main()
    except workers.WorkerFailedError as error:
        sys.exit(f"multi_worker: {error}")
