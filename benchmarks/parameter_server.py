"""ParameterServerStrategy on a local Ray cluster: steps/s with 1 and 2 workers, and staleness.

Workloads (random data, Adam via `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)`,
the step of `models.strategy_run_step`): the MLP 784-256-256-10 at batch 128 and the MLP
32-64-10 at batch 8, where the host and the RPCs, not the arithmetic, are the step. One local
Ray cluster serves the run; each `--workers` x `--ps` configuration gets a fresh
`ParameterServerStrategy` (no partitioner: whole variables dealt round-robin to the servers)
and `ClusterCoordinator`, each worker with one CPU device. A scheduled function runs one
`strategy.run(train_step, ...)` on `next(iterator)` of a per-worker dataset (a fixed batch,
repeated) and returns `strategy.reduce("sum", loss)`. `--warmup` functions per worker are
scheduled and joined (compilation, the first layout), then `--steps` more: steps/s is steps
/ (wall time of scheduling them all + join). Staleness (`coordinator.update_staleness`) is
the number of pushes by other workers between a function's pull and its push, over those
steps. Then as many `lambda: None` are timed alike: it names no held object, so it pulls and
pushes nothing, and no-op fn/s is the round trip's ceiling. Also reported: the coordinator
thread's CPU time per `schedule` (`time.thread_time` over the scheduling loop) and the mean
bytes each function pulled and pushed (`coordinator.transferred_bytes`).

`train_step` is a function of this importable module, sent by reference: every scheduled
function hands the worker's `strategy.run` the same function. `--closure` gives it
`models.strategy_run_step(batch)`'s closure instead, pickled by value (as any function of a
script run as `__main__`); the worker keeps the function it unpickled for the same bytes, so
it too compiles once (before that cache, every scheduled function compiled anew: 559 ms/step
instead of 7).

Reference: the same step and batch in this process on `MirroredStrategy(["cpu:0"])`, each
step's loss read before the next (as a worker reads each result); "PS / mirrored" is the
ratio of ms/step. And Ray's floor, no mirrax code: plain actors, one holding the model's
parameters as NumPy arrays and one that pulls them and pushes as many bytes back (what a step
moves under update="gradients", without the step), and a no-op actor call, two calls in flight.

Usage:
  python -m benchmarks.parameter_server                      # ~1-2 minutes on 2 cores
  python -m benchmarks.parameter_server --steps 50 --workers 1 --ps 1 --json out.json
  python -m benchmarks.parameter_server --workloads small --closure --steps 20
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import sys
import time

from benchmarks._harness import env

MODULE = "benchmarks.parameter_server"
# option name -> (label, model builder in _harness/models.py, input features, batch)
WORKLOADS = {"mlp": ("MLP 784-256-256-10", "MLP256", 784, 128), "small": ("MLP 32-64-10", "MLP", 32, 8)}
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def train_step(model, optimizer, batch):
    """`models.strategy_run_step(global batch)`'s step, at module level (sent by reference)."""
    import mirrax
    from benchmarks._harness import models

    x, y = batch
    global_batch = x.shape[0] * mirrax.get_replica_context().num_replicas_in_sync
    return models.update(
        model,
        optimizer,
        x,
        y,
        lambda per_example: mirrax.compute_average_loss(per_example, global_batch_size=global_batch),
    )


def _train_step(args, batch: int):
    """The function given to `strategy.run`: see the module's docstring."""
    from benchmarks._harness import models

    if args.closure:
        return models.strategy_run_step(batch)
    # Run as `python -m`, this file is `__main__`, whose functions cloudpickle sends by value;
    # the same file imported under its own name is sent by reference.
    return importlib.import_module(MODULE).train_step


def _counts(parser, flag: str, value: str) -> list:
    try:
        counts = sorted({int(n) for n in value.split(",") if n.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        parser.error(f"{flag} must be comma-separated integers >= 1 like 1,2; got {value!r}")
    return counts


def _staleness(values: list) -> dict:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "max": max(values),
        "zero_fraction": sum(v == 0 for v in values) / len(values),
        "count": len(values),
    }


def _timed(coordinator, fn, args, steps: int) -> tuple:
    """(seconds of scheduling `steps` calls + join, the last RemoteValue, their staleness,
    the coordinator thread's CPU ms per `schedule`, the mean (bytes pulled, bytes pushed) per
    function)."""
    before = len(coordinator.update_staleness)
    moved = len(coordinator.transferred_bytes)
    start = time.perf_counter()
    cpu = time.thread_time()
    values = [coordinator.schedule(fn, args=args) for _ in range(steps)]
    schedule_ms = 1e3 * (time.thread_time() - cpu) / steps
    coordinator.join()
    seconds = time.perf_counter() - start
    transfers = coordinator.transferred_bytes[moved:]
    mean_moved = tuple(statistics.fmean(t[k] for t in transfers) for k in (0, 1))
    return seconds, values[-1], coordinator.update_staleness[before:], schedule_ms, mean_moved


def _model(builder: str):
    """The workload's model and its `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)`."""
    import optax
    from flax import nnx

    from benchmarks._harness import models

    model = getattr(models, builder)(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _parameter_server(key: str, workers: int, ps: int, args, update: str) -> dict:
    import mirrax
    from benchmarks._harness import models

    label, builder, features, batch = WORKLOADS[key]
    started = time.perf_counter()
    strategy = mirrax.ParameterServerStrategy(
        mirrax.RayClusterResolver(workers, ps, worker_env=ONE_DEVICE), update=update
    )
    start_s = time.perf_counter() - started
    try:
        coordinator = mirrax.ClusterCoordinator(strategy)
        model, optimizer = _model(builder)
        step_fn = _train_step(args, batch)

        iterator = iter(
            coordinator.create_per_worker_dataset(
                lambda ctx: itertools.repeat(
                    models.random_batch((features,), batch, seed=ctx.input_pipeline_id)
                )
            )
        )

        def step(iterator):
            loss = strategy.run(step_fn, args=(model, optimizer, next(iterator)))
            return strategy.reduce("sum", loss)

        warmup_s = _timed(coordinator, step, (iterator,), args.warmup * workers)[0]
        seconds, last, staleness, schedule_ms, moved = _timed(coordinator, step, (iterator,), args.steps)
        noop_s, _, _, noop_schedule_ms, noop_moved = _timed(coordinator, lambda: None, (), args.steps)
        row = {
            "workload": label,
            "batch": batch,
            "strategy": "parameter server",
            "workers": workers,
            "ps": ps,
            "update": update,
            "steps": args.steps,
            "steps_per_s": args.steps / seconds,
            "ms_per_step": 1e3 * seconds / args.steps,
            "noop_per_s": args.steps / noop_s,
            "schedule_ms": schedule_ms,
            "noop_schedule_ms": noop_schedule_ms,
            "moved_kib": [b / 1024 for b in moved],
            "noop_moved_kib": [b / 1024 for b in noop_moved],
            "staleness": _staleness(staleness),
            "start_s": start_s,
            "warmup_s": warmup_s,
            "last_loss": float(last.fetch()),
        }
    finally:
        strategy.shutdown()
    s = row["staleness"]
    env.log(
        f"  {label}, {workers} worker(s), {ps} ps, {update}: {row['steps_per_s']:.1f} steps/s, "
        f"no-op {row['noop_per_s']:.1f}/s, staleness mean {s['mean']:.2f} max {s['max']} "
        f"(start {start_s:.1f} s, warm-up {warmup_s:.1f} s)"
    )
    return row


def _mirrored(key: str, args) -> dict:
    import jax
    from flax import nnx

    import mirrax
    from benchmarks._harness import models

    label, builder, features, batch = WORKLOADS[key]
    strategy = mirrax.MirroredStrategy(["cpu:0"])
    with strategy.scope():
        model, optimizer = _model(builder)
    x, y = models.random_batch((features,), batch, seed=0)
    iterator = iter(strategy.experimental_distribute_dataset(itertools.repeat((x, y))))
    step_fn = _train_step(args, batch)

    def step():
        loss = strategy.run(step_fn, args=(model, optimizer, next(iterator)))
        return float(strategy.reduce("sum", loss))

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    loss = [step() for _ in range(args.steps)][-1]
    seconds = time.perf_counter() - start
    iterator.close()
    env.log(f"  {label}, mirrored cpu:0: {args.steps / seconds:.1f} steps/s")
    return {
        "workload": label,
        "batch": batch,
        "strategy": "mirrored",
        "workers": None,
        "ps": None,
        "steps": args.steps,
        "steps_per_s": args.steps / seconds,
        "ms_per_step": 1e3 * seconds / args.steps,
        "last_loss": loss,
        "held_bytes": sum(a.nbytes for a in jax.tree.leaves(nnx.state((model, optimizer)))),
    }


def _ray_floor(key: str, args) -> dict:
    """Ray's floor for the workload, no mirrax code: plain actors, one holding the model's
    parameters as NumPy arrays, one that pulls them, copies them and pushes as many bytes
    back (a step under update="gradients" without the step), and a no-op call; two calls in
    flight, as the coordinator keeps per worker."""
    import collections

    import jax
    import numpy as np
    import ray
    from flax import nnx

    label, builder, _, batch = WORKLOADS[key]
    model, _ = _model(builder)
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]

    class Server:
        def __init__(self, shapes):
            self.values = {i: np.zeros(shape, np.float32) for i, shape in enumerate(shapes)}

        def pull(self):
            return self.values

        def push(self, adds):
            for i, delta in adds.items():
                self.values[i] += delta
            return 0

    class Caller:
        def __init__(self, server):
            self.server = server

        def step(self):
            values = ray.get(self.server.pull.remote())
            return ray.get(self.server.push.remote({i: np.array(v) for i, v in values.items()}))

        def noop(self):
            return None

    free = ray.available_resources().get("CPU", 0.0)
    server = ray.remote(num_cpus=1)(Server).remote(shapes)
    caller = ray.remote(num_cpus=1)(Caller).remote(server)

    def timed(method, count: int) -> float:
        flight: collections.deque = collections.deque()
        start = time.perf_counter()
        for _ in range(count):
            flight.append(method.remote())
            if len(flight) == 2:
                ray.get(flight.popleft())
        ray.get(list(flight))
        return time.perf_counter() - start

    try:
        timed(caller.step, args.warmup)
        seconds = timed(caller.step, args.steps)
        noop_s = timed(caller.noop, args.steps)
    finally:
        ray.kill(caller)
        ray.kill(server)
        deadline = time.monotonic() + 30  # Ray frees the CPUs once the processes have ended
        while ray.available_resources().get("CPU", 0.0) < free and time.monotonic() < deadline:
            time.sleep(0.05)
    kib = sum(int(np.prod(shape)) * 4 for shape in shapes) / 1024
    env.log(
        f"  {label}, Ray's floor: {args.steps / seconds:.1f} pull+push/s, no-op {args.steps / noop_s:.1f}/s"
    )
    return {
        "workload": label,
        "batch": batch,
        "strategy": "ray floor",
        "steps": args.steps,
        "steps_per_s": args.steps / seconds,
        "ms_per_step": 1e3 * seconds / args.steps,
        "noop_per_s": args.steps / noop_s,
        "moved_kib": [kib, kib],
    }


def _measure(args) -> dict:
    import jax

    import mirrax

    # One local Ray cluster for the run, sized for the largest configuration.
    cluster = mirrax.RayClusterResolver(max(args.worker_counts), max(args.ps_counts))
    started = time.perf_counter()
    cluster.connect()
    env.log(f"Ray started in {time.perf_counter() - started:.1f} s")
    rows = []
    try:
        for key in args.workloads:
            reference = _mirrored(key, args)
            rows.append(reference)
            rows.append(_ray_floor(key, args))
            for workers in args.worker_counts:
                for ps in args.ps_counts:
                    for update in args.rules:  # interleaved: the rules' rows minutes apart at most
                        row = _parameter_server(key, workers, ps, args, update)
                        row["ratio_to_mirrored"] = row["ms_per_step"] / reference["ms_per_step"]
                        rows.append(row)
    finally:
        cluster.shutdown()
    return {
        "environment": env.environment(jax.local_devices()[:1]),
        "rows": rows,
        "steps": args.steps,
        "warmup_per_worker": args.warmup,
        "closure": args.closure,
    }


def _markdown(result: dict) -> str:
    def cells(r):
        if r["strategy"] == "ray floor":
            floor = "Ray's floor: plain actors, pull + push"
            return [r["workload"], r["batch"], floor, f"{r['steps_per_s']:.1f}", f"{r['ms_per_step']:.2f}",
                    "", f"{r['noop_per_s']:.1f}", "", "{:.0f} / {:.0f}".format(*r["moved_kib"]),
                    "", "", "", ""]  # fmt: skip
        if r["strategy"] == "mirrored":
            return [
                r["workload"],
                r["batch"],
                "MirroredStrategy(['cpu:0'])",
                f"{r['steps_per_s']:.1f}",
                f"{r['ms_per_step']:.2f}",
                "1.00",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
            ]
        s = r["staleness"]
        return [
            r["workload"],
            r["batch"],
            f"PS {r['workers']} worker(s), {r['ps']} ps, {r.get('update', 'differences')}",
            f"{r['steps_per_s']:.1f}",
            f"{r['ms_per_step']:.2f}",
            f"{r['ratio_to_mirrored']:.2f}",
            f"{r['noop_per_s']:.1f}",
            f"{r['schedule_ms']:.3f} / {r['noop_schedule_ms']:.3f}",
            "{:.0f} / {:.0f} ({:.0f} / {:.0f})".format(*r["moved_kib"], *r["noop_moved_kib"]),
            f"{s['mean']:.2f}",
            f"{s['median']:g}",
            s["max"],
            f"{s['zero_fraction']:.2f}",
        ]

    lines = env.markdown_table(
        [
            "workload",
            "batch",
            "strategy",
            "steps/s",
            "ms/step",
            "PS / mirrored",
            "no-op fn/s",
            "schedule ms (step / no-op)",
            "KiB pulled / pushed per step (no-op)",
            "staleness mean",
            "median",
            "max",
            "fraction 0",
        ],
        [cells(r) for r in result["rows"]],
        ["l", "r", "l"] + ["r"] * 10,
    )
    held = ", ".join(
        f"{r['workload']} {r['held_bytes'] / 2**20:.2f} MiB"
        for r in result["rows"]
        if r["strategy"] == "mirrored"
    )
    how = "a closure (--closure)" if result["closure"] else "a module-level function"
    lines += [
        "",
        f"{env.environment_note(result['environment'])} {result['steps']} timed "
        f"steps per row after {result['warmup_per_worker']} warm-up steps per worker; "
        "workers (one CPU device each), parameter servers and the coordinator share the "
        f"host's cores. strategy.run is given {how}. Held state (model and Adam): {held}; "
        "under 'differences' a step pulls it and pushes its differences, under 'gradients' it pulls "
        "the parameters and the optimizer's scalars and pushes the gradients; a no-op names no held "
        "object and moves "
        "nothing. schedule ms: the coordinator thread's CPU time per `schedule` call. Staleness: pushes by "
        "other workers between a function's pull and its push.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    parser.add_argument("--ps", default="1,2", help="parameter-server counts (default 1,2)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per row (200)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per worker (5)")
    parser.add_argument(
        "--workloads",
        default="mlp,small",
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default both)",
    )
    parser.add_argument(
        "--closure", action="store_true", help="give strategy.run a closure (pickled by value) instead"
    )
    parser.add_argument(
        "--update",
        default="differences,gradients",
        help="comma-separated update rules of ParameterServerStrategy (default both)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    args.worker_counts = _counts(parser, "--workers", args.workers)
    args.ps_counts = _counts(parser, "--ps", args.ps)
    args.workloads = env.names_option(parser, "--workloads", args.workloads, list(WORKLOADS))
    args.rules = env.names_option(parser, "--update", args.update, ["differences", "gradients"])
    if not args.workloads or args.steps < 1 or args.warmup < 1:
        parser.error("--workloads needs a name; --steps and --warmup must be >= 1")
    env.check_json_path(args.json)
    env.configure_jax_environment("cpu", 1)  # the coordinator: one CPU device, as each worker
    return env.run_in_process(args, _measure, _markdown)


if __name__ == "__main__":
    sys.exit(main())
