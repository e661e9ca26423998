"""Examples/s of mirrax.Model.fit against its peers: Keras 3 (JAX), TensorFlow, PyTorch DDP.

The same models (`models`, `peer_models`: the TF tutorial CNN, the MLP 784-1024-1024-10, the
transformer 4x256; the parameter column says MISMATCH if the counts differ), NumPy data, Adam
and global batch 128 everywhere. Group 1, one process with 2 CPU devices: mirrax
`MirroredStrategy` `Model.fit`, the hand-written floor (`models.make_handwritten`), Keras 3 on
JAX with `DataParallel`, Keras 3 on TensorFlow under `MirroredStrategy`. Group 2, two processes
on one core each: `MultiWorkerMirroredStrategy` `Model.fit` and a `strategy.run` loop against
PyTorch DDP (Gloo). Long-lived processes time one epoch of `--<workload>-steps` steps per
command after `--warmup` epochs, `--repeats` rounds in rotating order (a fit epoch: from
`on_epoch_begin` to `on_epoch_end` plus a wait for the weights; a pair: its slower process).
Columns: median examples/s, mirrax / peer as the median of same-round ratios (> 1: mirrax
faster). Each group holds /tmp/mirrax_bench.lock; peers whose packages are missing
(`benchmarks/requirements-peers.txt`) are skipped.

Usage:
  .venv-peers/bin/python -m benchmarks.peers                     # all peers, ~8 minutes
  .venv-peers/bin/python -m benchmarks.peers --only keras,tf --json out.json
  .venv-peers/bin/python -m benchmarks.peers --only torch --repeats 7 --mlp-steps 50
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import statistics
import sys
import time

from benchmarks._harness import env, peer_models, timing, workers

WORKLOADS = peer_models.WORKLOADS
GLOBAL_BATCH = 128
LEARNING_RATE, ADAM_EPSILON = 1e-3, 1e-7
SEED = 0
WORKLOAD_NAMES = {"cnn": "CNN", "mlp": "MLP", "transformer": "transformer"}
DEFAULT_STEPS = {"cnn": 10, "mlp": 50, "transformer": 3}
PEERS = ("keras", "tf", "torch")
# The modules a peer needs, found with importlib (not imported) by the driver.
PEER_MODULES = {"keras": ("keras",), "tf": ("tensorflow", "keras"), "torch": ("torch",)}
PEER_TITLES = {
    "keras": "Keras 3 (JAX backend), keras.distribution.DataParallel",
    "tf": "TensorFlow, tf.distribute.MirroredStrategy",
    "torch": "PyTorch DDP (Gloo)",
}
VERSIONS = {
    "mirrax": ("mirrax", "jax", "jaxlib", "flax", "optax", "numpy"),
    "keras": ("keras", "jax", "jaxlib", "numpy"),
    "tf": ("keras", "tensorflow-cpu", "tensorflow", "numpy"),
    "torch": ("torch", "numpy"),
}
DEVICES = 2
PROCESSES = 2
STARTUP_TIMEOUT_S = 900
EPOCH_TIMEOUT_S = 600
MAX_RESTARTS = 3  # per single-process worker (see _run_group's `restart`)
PAUSE_S = 0.2  # between epochs: threads of the framework that just ran stop spinning


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Examples/s of mirrax.Model.fit vs its peers.")
    parser.add_argument("--only", default=",".join(PEERS), help="comma-separated peers (all)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads (all)")
    parser.add_argument(
        "--torch-workloads",
        default="mlp,transformer",
        help="workloads of the 2-process comparison (mlp,transformer)",
    )
    for name in WORKLOADS:
        parser.add_argument(
            f"--{name}-steps",
            type=int,
            default=DEFAULT_STEPS[name],
            help=f"steps per timed epoch ({DEFAULT_STEPS[name]})",
        )
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per variant (5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per variant and workload (1)")
    parser.add_argument(
        "--no-floor", action="store_true", help="leave out the hand-written jax.jit(shard_map) step"
    )
    parser.add_argument(
        "--tf-one-device", action="store_true", help="also time TF's fit without a strategy, on one device"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.peers = env.names_option(parser, "--only", args.only, PEERS)
    args.workload_list = env.names_option(parser, "--workloads", args.workloads, WORKLOADS)
    args.torch_workload_list = [
        w
        for w in env.names_option(parser, "--torch-workloads", args.torch_workloads, WORKLOADS)
        if w in args.workload_list
    ]
    args.steps = {name: getattr(args, f"{name}_steps") for name in WORKLOADS}
    if min(args.steps.values()) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--*-steps and --repeats must be >= 1, --warmup >= 0")
    return args


def make_data(workload: str, steps: int):
    """`steps` global batches, concatenated (`peer_models.random_data`)."""
    return peer_models.random_data(workload, steps * GLOBAL_BATCH, SEED)


def _fit_task(model, x, y, callback, wait):
    """One epoch of `model.fit` (Keras 3 or mirrax; `callback` its Callback class), timed from
    `on_epoch_begin` to `on_epoch_end` after `wait(model)` has waited for the weights."""

    class EpochClock(callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            wait(self.model)
            self.seconds = time.perf_counter() - self.begin

    def epoch():
        clock = EpochClock()
        history = model.fit(
            x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[clock]
        )
        return clock.seconds, history.history["loss"][-1]

    return epoch


def _steps_task(step, block, steps: int):
    """An epoch of `steps` calls of `step()`, at most 2 in flight; it reports no loss."""

    def epoch():
        start = time.perf_counter()
        timing.run_steps(step, block, steps, 2)
        return time.perf_counter() - start, None

    return epoch


def _worker_mirrax(spec: dict) -> tuple:
    """mirrax.Model.fit: under MirroredStrategy over the fake devices, with the hand-written
    floor; or (spec["world"]) as one worker of a MultiWorkerMirroredStrategy, with a
    strategy.run loop."""
    import mirrax

    # MultiWorkerMirroredStrategy starts jax.distributed, which must precede any other JAX call.
    strategy = mirrax.MultiWorkerMirroredStrategy() if "world" in spec else None

    import jax
    import optax
    from flax import nnx

    from benchmarks._harness import models

    devices = jax.local_devices()[: spec.get("devices", 1)]
    strategy = strategy or mirrax.MirroredStrategy(devices)
    modules = {
        "cnn": models.CNN,
        "mlp": models.WideMLP,
        "transformer": functools.partial(models.Transformer, **peer_models.TRANSFORMER),
    }
    tasks, info = {}, {"strategy": repr(strategy), "process_index": jax.process_index()}

    def wait(model):
        jax.block_until_ready(nnx.state((model.module, model.optimizer.nnx_optimizer)))

    for workload in spec["workloads"]:
        steps = spec["steps"][workload]
        x, y = make_data(workload, steps)  # every worker reads the global batches
        with strategy.scope():
            model = mirrax.Model(modules[workload](nnx.Rngs(SEED)))
            model.compile(
                optimizer="adam",  # Keras's Adam: 1e-3, epsilon 1e-7
                loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        tasks[f"{workload}/fit"] = _fit_task(model, x, y, mirrax.callbacks.Callback, wait)
        parameters = jax.tree.leaves(nnx.state(model.module, nnx.Param))
        info[workload] = {"parameters": int(sum(p.size for p in parameters))}
        if spec.get("floor"):
            step, block, _ = models.make_handwritten(
                modules[workload], x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], GLOBAL_BATCH, devices, donate=False
            )
            tasks[f"{workload}/floor"] = _steps_task(step, block, steps)
        if "world" in spec:
            with strategy.scope():
                module = modules[workload](nnx.Rngs(SEED))
                optimizer = nnx.Optimizer(module, optax.adam(LEARNING_RATE, eps=ADAM_EPSILON), wrt=nnx.Param)
            batch = next(iter(strategy.experimental_distribute_dataset((x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]))))
            step = functools.partial(
                strategy.run, models.strategy_run_step(GLOBAL_BATCH), args=(module, optimizer, batch)
            )

            def block(out, state=(module, optimizer)):
                jax.block_until_ready((out, nnx.state(state)))

            tasks[f"{workload}/run"] = _steps_task(step, block, steps)
    return tasks, info


def _worker_keras(spec: dict) -> tuple:
    """Keras 3's model.fit: on JAX with DataParallel over the fake devices ("keras"), or on
    TensorFlow ("tf") under MirroredStrategy over logical CPU devices and, with
    `tf_one_device`, outside any strategy (TF on one device, no all-reduce)."""
    os.environ["KERAS_BACKEND"] = {"tf": "tensorflow", "keras": "jax"}[spec["framework"]]
    if spec["framework"] == "tf":
        import tensorflow as tf

        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration() for _ in range(spec["devices"])],
        )
        import keras

        logical = [d.name for d in tf.config.list_logical_devices("CPU")][: spec["devices"]]
        info = {
            "strategy": f"MirroredStrategy({logical})",
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on)"),
        }
        scopes = {"fit": tf.distribute.MirroredStrategy(logical).scope}
        if spec.get("tf_one_device"):
            scopes["one_device"] = contextlib.nullcontext

        def wait(model):
            model.variables[-1].numpy()
    else:
        import jax
        import keras

        devices = keras.distribution.list_devices("cpu")[: spec["devices"]]
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        info, scopes = {"distribution": f"DataParallel({devices})"}, {"fit": contextlib.nullcontext}

        def wait(model):
            jax.block_until_ready([v.value for v in model.variables])

    info["backend"] = keras.backend.backend()
    tasks = {}
    for suffix, scope in scopes.items():
        keras.utils.set_random_seed(SEED)
        for workload in spec["workloads"]:
            x, y = make_data(workload, spec["steps"][workload])
            with scope():
                model = peer_models.keras_model(keras, workload)
                model.compile(
                    optimizer=keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            tasks[f"{workload}/{suffix}"] = _fit_task(model, x, y, keras.callbacks.Callback, wait)
            info[workload] = {"parameters": int(model.count_params())}
    return tasks, info


def _worker_torch(spec: dict) -> tuple:
    """One rank of torch DistributedDataParallel (Gloo), the usual training loop."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world
    )
    torch.manual_seed(SEED)
    local = GLOBAL_BATCH // world
    tasks, info = {}, {"backend": dist.get_backend(), "threads": torch.get_num_threads()}
    for workload in spec["workloads"]:
        steps = spec["steps"][workload]
        x, y = make_data(workload, steps)
        x = torch.from_numpy(x.transpose(0, 3, 1, 2).copy() if workload == "cnn" else x)  # NCHW
        x, y = (x.long() if workload == "transformer" else x), torch.from_numpy(y).long()
        # This rank's share of every global batch, as DistributedSampler would give it.
        starts = [i * GLOBAL_BATCH + rank * local for i in range(steps)]
        batches = [(x[s : s + local], y[s : s + local]) for s in starts]
        module = peer_models.torch_model(workload)
        info[workload] = {"parameters": int(sum(p.numel() for p in module.parameters()))}
        model = nn.parallel.DistributedDataParallel(module)
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        loss_fn = nn.CrossEntropyLoss()

        def epoch(model=model, optimizer=optimizer, batches=batches, loss_fn=loss_fn):
            model.train()
            start = time.perf_counter()
            for xb, yb in batches:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
            return time.perf_counter() - start, float(loss)

        tasks[f"{workload}/loop"] = epoch
    return tasks, info


def _worker_main(spec_json: str) -> None:
    """A worker process; its builder returns (tasks, info): a task "<workload>/<variant>" runs
    one epoch and returns (seconds, last loss or None); info[workload]["parameters"] is the
    model's size."""
    from importlib import metadata

    spec = json.loads(spec_json)
    framework = spec["framework"]

    def start():
        began = time.perf_counter()
        build = {"mirrax": _worker_mirrax, "torch": _worker_torch}.get(framework, _worker_keras)
        tasks, info = build(spec)
        info["build_s"], info["warmup"] = time.perf_counter() - began, {}
        for name, task in tasks.items():
            began = time.perf_counter()
            losses = [task()[1] for _ in range(spec["warmup"])]
            info["warmup"][name] = {"seconds": time.perf_counter() - began, "loss": losses}
        info["versions"] = {}
        for name in VERSIONS[framework]:
            with contextlib.suppress(metadata.PackageNotFoundError):
                info["versions"][name] = metadata.version(name)
        info["affinity"] = sorted(os.sched_getaffinity(0))
        return {"tasks": sorted(tasks), "info": info}, tasks

    def handle(tasks, command):
        seconds, loss = tasks[command["task"]]()
        return {"seconds": seconds, "loss": loss}

    workers.serve(start, handle, core=spec.get("core"))


def _run_group(
    key: str, title: str, recipes: dict, variants: list, workloads: list, args, result: dict
) -> dict:
    """Starts the processes `recipes` {name: (spec, environment)}, times `variants`
    [(label, [process names], task suffix)] in rotation under the benchmark lock; the group's
    results, also in result["groups"][key]."""
    live, restarts, ready = {}, [], {}
    pool = workers.Pool("peers")

    def start(name):
        live[name] = pool.start(
            env.module_command(__spec__.name, "--worker", json.dumps(recipes[name][0])),
            name,
            recipes[name][1],
        )

    def restart(name: str, error: workers.WorkerFailedError, when: str) -> str:
        """A fresh process `name` in place of the dead one, or `error` again. XLA:CPU's
        in-process all-reduce can deadlock when a framework queues many multi-device steps
        (Keras's fit does), and its rendezvous then aborts the process: a single process is
        restarted (at most MAX_RESTARTS times); a pair cannot be."""
        done = [r["process"] for r in restarts].count(name)
        if "world" in recipes[name][0] or done >= MAX_RESTARTS:
            raise error
        last = [
            line for line in str(error).splitlines() if line.strip() and not line.lstrip().startswith("@")
        ][-6:]
        env.log(f"  {name} died ({when}); restarting it:\n    " + "\n    ".join(last))
        restarts.append({"process": name, "when": when, "log_tail": last})
        live[name].close()
        start(name)
        return name

    def wait_ready(names):
        """Waits for the `ready` reply of the processes `names`, restarting failures."""
        answers = {}
        while any(live[name] not in answers for name in names):
            try:
                workers.receive([live[n] for n in names], pool.replies, STARTUP_TIMEOUT_S, answers)
            except workers.WorkerFailedError as error:
                restart(error.worker.label, error, "warm-up")
        ready.update((name, answers[live[name]]) for name in names)

    def epoch(label, names, suffix, workload):
        while True:
            try:
                answers = pool.ask(
                    [live[name] for name in names],
                    {"op": "epoch", "task": f"{workload}/{suffix}"},
                    EPOCH_TIMEOUT_S,
                )
                break
            except workers.WorkerFailedError as error:
                wait_ready([restart(error.worker.label, error, f"{label}, {workload}")])
        time.sleep(PAUSE_S)
        return max(a["seconds"] for a in answers), answers[0]["loss"]

    with env.bench_lock(), pool:
        began = time.perf_counter()
        for name in recipes:
            start(name)
        wait_ready(recipes)
        startup_s = time.perf_counter() - began
        env.log(f"  {title}: started and warmed up in {startup_s:.0f} s")
        seconds = {f"{label} | {w}": [] for label, _, _ in variants for w in workloads}
        losses = {key: [] for key in seconds}
        for r in range(args.repeats):
            for workload in workloads:
                turn = r % len(variants)
                for label, names, suffix in variants[turn:] + variants[:turn]:
                    s, loss = epoch(label, names, suffix, workload)
                    seconds[f"{label} | {workload}"].append(s)
                    losses[f"{label} | {workload}"].append(loss)
            env.log(f"  {title}: round {r + 1}/{args.repeats} done")
    result["groups"][key] = group = {
        "title": title,
        "startup_s": startup_s,
        "restarts": restarts,
        "variants": [label for label, _, _ in variants],
        "processes": {label: names for label, names, _ in variants},
        "info": {name: answer["info"] for name, answer in ready.items()},
        "seconds": seconds,
        "losses": losses,
    }
    return group


def _report(group: dict, workloads: list, steps: dict, heading: str, extra=()) -> list:
    """Sets group["rows"] (per workload: median examples/s of every variant, the same-round
    ratios of the first variant to every other one, `extra` (key, header, slower, faster)
    ratios, parameter counts per process); returns the heading, the markdown table, the
    versions and the restarts."""
    variants, rows, cells = group["variants"], [], []
    reference, peers = variants[0], variants[1:]
    seconds = group["seconds"]  # examples/s of a / b = seconds of b / a
    for w in workloads:
        row = {
            "workload": w,
            "steps_per_epoch": steps[w],
            "examples_per_s": {
                v: statistics.median(steps[w] * GLOBAL_BATCH / s for s in seconds[f"{v} | {w}"])
                for v in variants
            },
            "ratio_vs": {v: timing.paired_ratio(seconds, f"{v} | {w}", f"{reference} | {w}") for v in peers},
            "parameters": {
                process: info[w]["parameters"] for process, info in group["info"].items() if w in info
            },
        }
        for key, _, slower, faster in extra:
            row[key] = timing.paired_ratio(seconds, f"{slower} | {w}", f"{faster} | {w}")
        rows.append(row)
        counts = sorted(set(row["parameters"].values()))
        params = (
            f"{counts[0]:,}"
            if len(counts) == 1
            else "MISMATCH " + ", ".join(f"{k} {v:,}" for k, v in row["parameters"].items())
        )
        cells.append(
            [WORKLOAD_NAMES[w], steps[w]]
            + [f"{row['examples_per_s'][v]:,.0f}" for v in variants]
            + [f"{row['ratio_vs'][v]:.2f}" for v in peers]
            + [f"{row[key]:.2f}" for key, *_ in extra]
            + [params]
        )
    group["rows"] = rows
    header = (
        ["workload", "steps/epoch"]
        + [f"{v} ex/s" for v in variants]
        + [f"{reference} / {v}" for v in peers]
        + [h for _, h, _, _ in extra]
        + ["parameters (every framework)"]
    )
    versions = {}
    for info in group["info"].values():
        versions.update(info.get("versions", {}))
    lines = [
        heading,
        "",
        *env.markdown_table(header, cells),
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}.",
        "",
    ]
    for r in group["restarts"]:
        reason = next(
            (line for line in r["log_tail"] if "rendezvous" in line.lower()),
            r["log_tail"][-1] if r["log_tail"] else "no log",
        )
        lines.append(f"Restarted: worker {r['process']} died ({r['when']}): {reason[:300]}")
    return lines + ([""] if group["restarts"] else [])


def _single_process(args, peers: list, result: dict) -> list:
    spec = {
        "workloads": args.workload_list,
        "steps": args.steps,
        "warmup": args.warmup,
        "devices": DEVICES,
        "floor": not args.no_floor,
        "tf_one_device": args.tf_one_device,
    }
    environment = workers.environment(DEVICES, one_core=False, TF_CONFIG=None)
    variants = [("mirrax fit", ["mirrax"], "fit")]
    variants += [] if args.no_floor else [("JAX hand-written", ["mirrax"], "floor")]
    variants += [({"keras": "Keras (JAX) fit", "tf": "TF fit"}[p], [p], "fit") for p in peers]
    if "tf" in peers and args.tf_one_device:
        variants.append(("TF fit, 1 device, no strategy", ["tf"], "one_device"))
    group = _run_group(
        "single_process",
        f"one process, {DEVICES} CPU devices",
        {name: (dict(spec, framework=name), environment) for name in ["mirrax", *peers]},
        variants,
        args.workload_list,
        args,
        result,
    )
    return _report(
        group,
        args.workload_list,
        args.steps,
        (
            f"One process, {DEVICES} devices, global batch {GLOBAL_BATCH} (examples/s, median of "
            f"{args.repeats} epochs; ratios > 1: mirrax faster):"
        ),
    )


def _two_processes(args, result: dict) -> list:
    ports, torch_port = [workers.free_port() for _ in range(PROCESSES)], workers.free_port()
    spec = {
        "workloads": args.torch_workload_list,
        "steps": args.steps,
        "warmup": args.warmup,
        "world": PROCESSES,
        "port": torch_port,
    }
    mirrax = [f"mirrax worker {i}" for i in range(PROCESSES)]
    torch = [f"torch rank {i}" for i in range(PROCESSES)]
    recipes = {
        name: (
            dict(spec, framework="mirrax", rank=i, core=i),
            workers.environment(TF_CONFIG=workers.tf_config(ports, i)),
        )
        for i, name in enumerate(mirrax)
    }
    recipes.update(
        {
            name: (dict(spec, framework="torch", rank=i, core=i), workers.environment(TF_CONFIG=None))
            for i, name in enumerate(torch)
        }
    )
    variants = [
        ("mirrax MWMS fit", mirrax, "fit"),
        ("mirrax MWMS strategy.run", mirrax, "run"),
        ("torch DDP", torch, "loop"),
    ]
    group = _run_group(
        "two_processes",
        f"{PROCESSES} processes, 1 core each",
        recipes,
        variants,
        args.torch_workload_list,
        args,
        result,
    )
    return _report(
        group,
        args.torch_workload_list,
        args.steps,
        (
            f"{PROCESSES} processes x 1 core, global batch {GLOBAL_BATCH} ({GLOBAL_BATCH // PROCESSES}"
            f" per process; examples/s, median of {args.repeats} epochs; ratios > 1: mirrax "
            "faster):"
        ),
        extra=[
            ("run_vs_ddp", "mirrax MWMS strategy.run / torch DDP", "torch DDP", "mirrax MWMS strategy.run")
        ],
    )


def main(argv=None) -> int:
    args = _parse_args(argv)
    env.check_json_path(args.json)
    if args.worker:
        return _worker_main(args.worker)
    started = time.perf_counter()
    skipped = {}
    for peer in args.peers:
        missing = [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
        if missing:
            skipped[peer] = (
                f"not installed: {', '.join(missing)} (pip install -r benchmarks/requirements-peers.txt)"
            )
            env.log(f"peers: skipped {PEER_TITLES[peer]}: {skipped[peer]}")
    peers = [p for p in args.peers if p not in skipped]
    result = {
        **env.environment(),
        "argv": sys.argv[1:],
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "global_batch": GLOBAL_BATCH,
        "skipped": skipped,
        "groups": {},
    }
    lines, single = [], [p for p in peers if p in ("keras", "tf")]
    if single:
        lines += _single_process(args, single, result)
    if "torch" in peers and args.torch_workload_list:
        lines += _two_processes(args, result)
    result["total_s"] = total = time.perf_counter() - started
    lines += [f"{PEER_TITLES[peer]}: skipped ({why})." for peer, why in skipped.items()]
    lines.append(
        f"{result['processor']}, {result['host_cpus']} CPUs, Python {result['python']}; total {total:.0f} s."
    )
    print("\n".join(lines), flush=True)
    env.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except workers.WorkerFailedError as e:
        sys.exit(f"peers: {e}")
