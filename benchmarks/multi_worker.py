"""Multi-worker weak scaling: 1 worker on 1 core against 2 workers on 1 core each.

Every worker is its own process, pinned to one CPU core (`os.sched_setaffinity`), with one
replica (`--xla_force_host_platform_device_count=1`) and XLA's intra-op threading off
(`--xla_cpu_multi_thread_eigen=false`), so a worker really uses one core. The per-worker batch
is the same in every configuration (weak scaling: 2 workers train on twice the global batch).
Three configurations, each a set of long-lived processes:

- "1 worker": `mirrax.MultiWorkerMirroredStrategy()` without TF_CONFIG (one replica), core 0.
- "2 independent": two such 1-worker processes on cores 0 and 1, timed at the same moment but
  not talking to each other: what sharing the machine alone costs (memory, caches, the
  hypervisor), with no communication.
- "2 workers": a 2-task cluster (TF_CONFIG, 127.0.0.1), cores 0 and 1: one replica per worker,
  gradients all-reduced across the processes by Gloo inside the compiled step.

Workloads (random data, Adam 1e-3, `strategy.run` of value_and_grad + optimizer update with the
loss `compute_average_loss(per_example, global_batch_size=workers * per_worker_batch)`):

- CNN: the TF tutorial CNN of `workloads.py` (257,162 parameters), per-worker batch 64.
- MLP: 784 -> 1024 relu -> 1024 relu -> 10 (1,863,690 parameters), per-worker batch 128.

Timing: after compiling and warming up, the driver (this script without --worker) sends each
configuration in turn a window of `--steps` steps of one workload, the order of the
configurations rotating every round, for `--repeats` rounds; a window ends with
`jax.block_until_ready` on the step's output and the whole model and optimizer state, and at
most 2 steps run ahead of the last finished one (as `overhead.py`). A window's time is the
slowest of its processes'. Reported: the median ms/step, examples/s = workers * per-worker
batch / step time, weak-scaling efficiency = examples/s(2 workers) / (2 * examples/s(1 worker)).

CPU time: each window also reports the CPU time its process used (`time.process_time()`: every
thread, XLA's, Gloo's I/O thread and Python's), per step, averaged over the configuration's
processes. Wall times swing with other jobs on a shared machine; CPU times barely do, and they
show what the communication costs a core that has nothing else to give it.

All-reduce time per step (2 workers): a step that does ONLY the all-reduce of a per-replica
pytree shaped like the model's parameters (the gradient), once through
`strategy.run(lambda g: get_replica_context().all_reduce("sum", g))` and once as a bare
`jax.jit(jax.shard_map(psum))` (the raw Gloo cost, no mirrax). The all-reduce ops in the
compiled train step are counted in the optimized HLO of the very program `strategy.run` runs
(`strategy.experimental_lower` on the same arguments).

TensorFlow: when `import tensorflow` works, the same three configurations run the same models
(Keras layers, Adam, a `tf.function` around `strategy.run`, `tf.nn.compute_average_loss`) on
`tf.distribute.MultiWorkerMirroredStrategy` (ring all-reduce over gRPC), intra-op threads 1;
otherwise the TensorFlow rows say it was skipped.

Usage:
  python benchmarks/multi_worker.py                     # table on stdout, ~3-4 minutes
  python benchmarks/multi_worker.py --steps 5 --repeats 5 --json out.json
  python benchmarks/multi_worker.py --skip-tf
  python benchmarks/multi_worker.py --skip-tf --no-profile --workloads MLP
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (JAX-free: imports JAX only inside)
from overhead import _processor_name  # noqa: E402

CNN_PER_WORKER_BATCH = 64
MLP_PER_WORKER_BATCH = 128
MLP_SIZES = (784, 1024, 1024, 10)
NUM_CLASSES = 10
MAX_IN_FLIGHT = 2
REPLY = "@@mw "  # prefix of a worker's reply line on stdout (JAX and TF may print there too)
CONFIGS = ("1 worker", "2 independent", "2 workers")
WORKLOADS = ("CNN", "MLP")
STARTUP_TIMEOUT_S = 600
WINDOW_TIMEOUT_S = 300


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Weak scaling of MultiWorkerMirroredStrategy: 1 worker on 1 core vs 2 "
        "workers on 1 core each (mirrax, and TensorFlow when installed)."
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window (10)")
    parser.add_argument("--repeats", type=int, default=7, help="timed windows per case (7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case (3)")
    parser.add_argument("--skip-tf", action="store_true", help="do not run TensorFlow")
    parser.add_argument("--only-packed", action="store_true",
                        help="run only mirrax with mirrax.value_and_grad (packed all-reduce)")
    parser.add_argument("--no-profile", action="store_true", help="skip the jax.profiler pass")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of CNN,MLP (default both)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    # A worker process (started by the driver): framework, workers in its cluster (TF_CONFIG
    # names them), task index, core.
    parser.add_argument("--worker", nargs=4, metavar=("FRAMEWORK", "N", "INDEX", "CORE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    args.workloads = tuple(w for w in WORKLOADS if w in args.workloads.split(","))
    if not args.workloads:
        parser.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    return args


# -- HLO -----------------------------------------------------------------------------------------

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")


def all_reduce_stats(hlo_text: str) -> dict:
    """Counts the all-reduce ops of an optimized HLO module and the bytes they reduce."""
    ops, total = 0, 0
    for line in hlo_text.splitlines():
        match = _ALL_REDUCE.search(line)
        if not match:
            continue
        ops += 1
        for dtype, dims in _SHAPE.findall(match.group(1)):
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            total += count * _BYTES.get(dtype, 4)
    return {"all_reduce_ops": ops, "all_reduce_bytes": total}


def _worker_workloads() -> tuple:
    """The workloads the driver asked for (`--workloads`, passed to workers in the environment)."""
    return tuple(os.environ.get("MIRRAX_BENCH_WORKLOADS", ",".join(WORKLOADS)).split(","))


# -- a mirrax worker -----------------------------------------------------------------------------


def _mirrax_worker(num_workers: int, packed: bool = False) -> tuple:
    """Builds both workloads on a MultiWorkerMirroredStrategy; returns (tasks, info).

    With `packed`, the train step takes its gradients with `mirrax.value_and_grad` (one
    all-reduce of the concatenated gradients) instead of `nnx.value_and_grad`.
    """
    import mirrax

    # The strategy first: it initializes jax.distributed, which must precede any JAX call.
    strategy = mirrax.MultiWorkerMirroredStrategy()

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import workloads

    class MLP(nnx.Module):
        """784 -> 1024 relu -> 1024 relu -> 10; input (batch, 784) float32."""

        def __init__(self, rngs: nnx.Rngs):
            inputs, hidden1, hidden2, outputs = MLP_SIZES
            self.dense1 = nnx.Linear(inputs, hidden1, rngs=rngs)
            self.dense2 = nnx.Linear(hidden1, hidden2, rngs=rngs)
            self.dense3 = nnx.Linear(hidden2, outputs, rngs=rngs)

        def __call__(self, x):
            return self.dense3(nnx.relu(self.dense2(nnx.relu(self.dense1(x)))))

    def allreduce(grads):
        return mirrax.get_replica_context().all_reduce("sum", grads)

    mesh = strategy.mesh
    axis = mesh.axis_names[0]
    local_devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    raw_allreduce = jax.jit(
        jax.shard_map(
            lambda g: jax.tree.map(lambda x: jax.lax.psum(x[0], axis), g),
            mesh=mesh,
            in_specs=P(axis),
            out_specs=P(),
        )
    )

    def run_steps(step, block, steps):
        return workloads.run_steps(step, block, steps, MAX_IN_FLIGHT)

    tasks, info = {}, {"strategy": repr(strategy), "jax": jax.__version__}
    for name, module_cls, x_shape, per_worker in (
        ("CNN", workloads.CNN, (28, 28, 1), CNN_PER_WORKER_BATCH),
        ("MLP", MLP, (MLP_SIZES[0],), MLP_PER_WORKER_BATCH),
    ):
        if name not in _worker_workloads():
            continue
        with strategy.scope():
            model = module_cls(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        rng = np.random.default_rng(1 + jax.process_index())
        x = rng.standard_normal((per_worker,) + x_shape).astype(np.float32)
        y = rng.integers(0, NUM_CLASSES, size=(per_worker,)).astype(np.int32)
        batch = strategy.experimental_distribute_values_from_function(lambda ctx: (x, y))
        train_step = workloads.strategy_run_step(num_workers * per_worker, packed=packed)

        def step(model=model, optimizer=optimizer, batch=batch, train_step=train_step):
            return strategy.run(train_step, args=(model, optimizer, batch))

        def block(out, model=model, optimizer=optimizer):
            jax.block_until_ready((out, nnx.state((model, optimizer))))

        start = time.perf_counter()
        block(step())
        compile_s = time.perf_counter() - start
        tasks[name] = (step, block)
        shapes = [p.shape for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
        info[name] = {
            "parameters": int(sum(np.prod(s) for s in shapes)),
            "compile_s": compile_s,
            "hlo": _train_step_hlo(strategy, train_step, model, optimizer, batch),
        }
        if num_workers == 1:
            continue

        grads = strategy.experimental_distribute_values_from_function(
            lambda ctx: [np.ones(s, np.float32) for s in shapes]
        )

        def reduce_step(grads=grads):
            return strategy.run(allreduce, args=(grads,))

        sharding = NamedSharding(mesh, P(axis))
        stacked = [
            jax.make_array_from_single_device_arrays(
                (len(mesh.devices.flat),) + s,
                sharding,
                [jax.device_put(np.ones((1,) + s, np.float32), d) for d in local_devices],
            )
            for s in shapes
        ]

        def raw_step(stacked=stacked):
            return raw_allreduce(stacked)

        for key, fn in (("allreduce_run", reduce_step), ("allreduce_raw", raw_step)):
            jax.block_until_ready(fn())
            tasks[f"{name} {key}"] = (fn, jax.block_until_ready)
        info[name]["raw_allreduce_hlo"] = all_reduce_stats(
            raw_allreduce.lower(stacked).compile().as_text()
        )
    return tasks, run_steps, info


def profile_steps(step, block, steps: int) -> dict:
    """Runs `steps` steps (each waited for) under `jax.profiler`; where the time went.

    Returns ms per step: `wall`, `executable` (XLA running the compiled step: the
    `ThunkExecutor::Execute` events) and, inside it, `all_reduce` (the all-reduce thunks,
    including the wait for the other workers) and each of the 8 costliest other thunks.
    """
    import collections

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
        paths = [os.path.join(d, f) for d, _, files in os.walk(trace_dir) for f in files
                 if f.endswith(".xplane.pb")]
        data = jax.profiler.ProfileData.from_file(paths[0])
    totals = collections.Counter()
    spans = {"executable": [], "all_reduce": []}
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                totals[event.name] += event.duration_ns
                if event.name == "ThunkExecutor::Execute":
                    spans["executable"].append((event.start_ns, event.end_ns))
                elif event.name.startswith("all-reduce"):
                    spans["all_reduce"].append((event.start_ns, event.end_ns))
    thunks = {k: v / 1e6 / steps for k, v in totals.items()
              if not k.startswith(("all-reduce", "end: ", "$", "Pjit"))
              and "Execute" not in k and "::" not in k}
    # Thunks of nested computations (fusions, loops) run inside their parent's span: this
    # list may count such time twice; the two spans above are unions and do not.
    top = dict(sorted(thunks.items(), key=lambda kv: -kv[1])[:8])
    return {
        "wall_ms": wall * 1e3 / steps,
        "executable_ms": _union_ns(spans["executable"]) / 1e6 / steps,
        "all_reduce_ms": _union_ns(spans["all_reduce"]) / 1e6 / steps,
        "top_thunks_ms": top,
    }


def _union_ns(spans: list) -> int:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _train_step_hlo(strategy, train_step, model, optimizer, batch) -> dict:
    """All-reduce ops and bytes in the optimized HLO of the program `strategy.run` runs."""
    lowered = strategy.experimental_lower(train_step, args=(model, optimizer, batch))
    return all_reduce_stats(lowered.compile().as_text())


# -- a TensorFlow worker -------------------------------------------------------------------------


def _tf_worker(num_workers: int) -> tuple:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras = tf.keras
    layers = keras.layers

    def cnn():
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, activation="relu", padding="same"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, activation="relu", padding="same"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, activation="relu", padding="same"),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
            layers.Dense(NUM_CLASSES),
        ])

    def mlp():
        return keras.Sequential(
            [keras.Input((MLP_SIZES[0],))]
            + [layers.Dense(n, activation="relu") for n in MLP_SIZES[1:-1]]
            + [layers.Dense(MLP_SIZES[-1])]
        )

    def first_batch(make):
        dataset = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensors(make()).repeat()
        )
        return next(iter(dataset))

    def local(value):
        return strategy.experimental_local_results(value)[0]

    def run_steps(step, block, steps):
        host, out = 0.0, None
        for _ in range(steps):
            start = time.perf_counter()
            out = step()
            host += time.perf_counter() - start
        block(out)
        return host

    def block(out):
        for value in tf.nest.flatten(out):
            local(value).numpy()

    tasks, info = {}, {"strategy": type(strategy).__name__, "tensorflow": tf.__version__}
    for name, build, x_shape, per_worker in (
        ("CNN", cnn, (28, 28, 1), CNN_PER_WORKER_BATCH),
        ("MLP", mlp, (MLP_SIZES[0],), MLP_PER_WORKER_BATCH),
    ):
        if name not in _worker_workloads():
            continue
        global_batch = num_workers * per_worker
        with strategy.scope():
            model = build()
            optimizer = keras.optimizers.Adam(1e-3)
            optimizer.build(model.trainable_variables)
        rng = np.random.default_rng(1 + (strategy.cluster_resolver.task_id or 0))
        x = rng.standard_normal((per_worker,) + x_shape).astype(np.float32)
        y = rng.integers(0, NUM_CLASSES, size=(per_worker,)).astype(np.int32)
        xb, yb = first_batch(lambda: (x, y))

        def make_train(model=model, optimizer=optimizer, global_batch=global_batch):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    logits = model(x, training=True)
                    per_example = keras.losses.sparse_categorical_crossentropy(
                        y, logits, from_logits=True)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            @tf.function
            def train(x, y):
                return strategy.run(replica_step, args=(x, y))

            return train

        train = make_train()

        def step(train=train, xb=xb, yb=yb):
            return train(xb, yb)

        start = time.perf_counter()
        block(step())
        info[name] = {
            "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "compile_s": time.perf_counter() - start,
        }
        tasks[name] = (step, block)
        if num_workers == 1:
            continue
        shapes = [tuple(v.shape) for v in model.trainable_variables]
        grads = first_batch(lambda: tuple(np.ones(s, np.float32) for s in shapes))

        def replica_reduce(g):
            # Tensors straight from the iterator carry no device, and MWMS then finds no
            # destination for the reduction ("destinations can not be empty").
            g = tf.nest.map_structure(tf.identity, g)
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, g)

        @tf.function
        def reduce_all(g):
            return strategy.run(replica_reduce, args=(g,))

        def reduce_step(reduce_all=reduce_all, grads=grads):
            return reduce_all(grads)

        block(reduce_step())
        tasks[f"{name} allreduce_run"] = (reduce_step, block)
    return tasks, run_steps, info


# -- the worker's command loop -------------------------------------------------------------------


def _worker_main(args) -> None:
    framework, num_workers, _, core = args.worker
    num_workers = int(num_workers)
    # Pin before anything starts a thread: every thread inherits this core.
    os.sched_setaffinity(0, {int(core)})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    # JAX, TF and absl may print on stdout; keep the reply channel clean.
    os.dup2(2, 1)

    def reply(obj):
        reply_to.write(REPLY + json.dumps(obj) + "\n")
        reply_to.flush()

    build = {"mirrax": _mirrax_worker, "tensorflow": _tf_worker,
             "mirrax-packed": lambda n: _mirrax_worker(n, packed=True)}[framework]
    try:
        tasks, run_steps, info = build(num_workers)
    except BaseException:
        # Exit at once: TensorFlow's and JAX's cluster threads would keep the process alive.
        reply({"error": traceback.format_exc()})
        os._exit(1)
    info["affinity"] = sorted(os.sched_getaffinity(0))
    info["threads"] = threading.active_count()
    reply({"ready": True, "tasks": sorted(tasks), "info": info})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        step, block = tasks[command["task"]]
        if command["op"] == "profile":
            reply(profile_steps(step, block, command["steps"]))
            continue
        start, cpu = time.perf_counter(), time.process_time()
        host = run_steps(step, block, command["steps"])
        # CPU time of every thread of this process (XLA, Gloo's I/O, Python): unlike the wall
        # time, it barely moves when other jobs share the machine.
        reply({"seconds": time.perf_counter() - start, "host_seconds": host,
               "cpu_seconds": time.process_time() - cpu})
    reply({"bye": True})


# -- the driver ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tf_config(ports: list, index: int) -> str:
    return json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })


class _Process:
    """One worker process: commands on its stdin, replies from its stdout, log in a file."""

    def __init__(self, framework, num_workers, index, core, ports, log_dir, label, replies):
        env = dict(os.environ)
        env.update({
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
                         "--xla_cpu_multi_thread_eigen=false",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        })
        env.pop("TF_CONFIG", None)
        if num_workers > 1:
            env["TF_CONFIG"] = _tf_config(ports, index)
        self.label = label
        self.log = os.path.join(log_dir, f"{framework}-{label}-{index}.log".replace(" ", "_"))
        self._sink = open(self.log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", framework,
             str(num_workers), str(index), str(core)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._sink, text=True,
            env=env,
        )
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _read(self, replies: queue.Queue):
        for line in self.process.stdout:
            if line.startswith(REPLY):
                replies.put((self, json.loads(line[len(REPLY):])))
        replies.put((self, None))

    def send(self, obj):
        self.process.stdin.write(json.dumps(obj) + "\n")
        self.process.stdin.flush()

    def fail(self, what: str):
        with open(self.log, errors="replace") as f:
            tail = f.read()[-4000:]
        raise SystemExit(
            f"multi_worker.py: worker {self.label!r} (exit code {self.process.poll()}): {what}. "
            f"Its log ({self.log}) ends:\n{tail}"
        )

    def close(self):
        if self.process.poll() is None:
            try:
                self.send({"op": "quit"})
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._sink.close()


def _receive(processes: list, replies: queue.Queue, timeout: float) -> list:
    """The next reply of every process in `processes`; fails as soon as any worker does."""
    answers = {}
    deadline = time.monotonic() + timeout
    while len(answers) < len(processes):
        try:
            process, answer = replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            late = next(p for p in processes if p not in answers)
            late.fail(f"no answer within {timeout} s")
        if answer is None or "error" in answer:
            process.fail("exited" if answer is None else answer["error"])
        answers[process] = answer
    return [answers[p] for p in processes]


def _measure(framework: str, args, log_dir: str) -> dict:
    """Starts the three configurations of `framework`, times them in rotation; the results."""
    ports = [_free_port(), _free_port()]
    replies = queue.Queue()
    groups = {
        "1 worker": [_Process(framework, 1, 0, 0, ports, log_dir, "1 worker", replies)],
        "2 independent": [_Process(framework, 1, 0, 1, ports, log_dir, "independent", replies)],
        "2 workers": [_Process(framework, 2, i, i, ports, log_dir, "2 workers", replies)
                      for i in range(2)],
    }
    # "2 independent" is the 1-worker process on core 0 and a second one on core 1.
    groups["2 independent"].insert(0, groups["1 worker"][0])
    processes = groups["1 worker"] + groups["2 independent"][1:] + groups["2 workers"]
    try:
        start = time.perf_counter()
        ready = dict(zip(map(id, processes), _receive(processes, replies, STARTUP_TIMEOUT_S)))
        startup_s = time.perf_counter() - start
        cases = [(config, task) for config in CONFIGS
                 for task in ready[id(groups[config][-1])]["tasks"]]

        def window(config, task, steps):
            for p in groups[config]:
                p.send({"op": "window", "task": task, "steps": steps})
            answers = _receive(groups[config], replies, WINDOW_TIMEOUT_S)
            return (max(a["seconds"] for a in answers) / steps,
                    max(a["host_seconds"] for a in answers) / steps,
                    statistics.mean(a["cpu_seconds"] for a in answers) / steps)

        for config, task in cases:
            if args.warmup:
                window(config, task, args.warmup)
        times = {case: [] for case in cases}
        hosts = {case: [] for case in cases}
        cpus = {case: [] for case in cases}
        for r in range(args.repeats):
            order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
            for config in order:
                for case in [c for c in cases if c[0] == config]:
                    seconds, host, cpu = window(*case, args.steps)
                    times[case].append(seconds)
                    hosts[case].append(host)
                    cpus[case].append(cpu)
        profiles = {}
        if framework == "mirrax" and not args.no_profile:
            for config, task in cases:
                if task in WORKLOADS:
                    for p in groups[config]:
                        p.send({"op": "profile", "task": task, "steps": args.steps})
                    profiles[f"{config} | {task}"] = _receive(groups[config], replies,
                                                              WINDOW_TIMEOUT_S)
    finally:
        for p in processes:
            p.close()
    return {
        "framework": framework,
        "startup_s": startup_s,
        "info": {config: [ready[id(p)]["info"] for p in groups[config]] for config in CONFIGS},
        "ms_per_step": {f"{c} | {t}": [s * 1e3 for s in v] for (c, t), v in times.items()},
        "median_ms": {f"{c} | {t}": statistics.median(v) * 1e3 for (c, t), v in times.items()},
        "median_host_us": {f"{c} | {t}": statistics.median(v) * 1e6
                           for (c, t), v in hosts.items()},
        "median_cpu_ms": {f"{c} | {t}": statistics.median(v) * 1e3 for (c, t), v in cpus.items()},
        "profiles": profiles,
    }


def _rows(result: dict) -> list:
    median = result["median_ms"]
    info = result["info"]
    rows = []
    cpu = result["median_cpu_ms"]
    for workload, per_worker in (("CNN", CNN_PER_WORKER_BATCH), ("MLP", MLP_PER_WORKER_BATCH)):
        if f"1 worker | {workload}" not in median:
            continue
        one = median[f"1 worker | {workload}"]
        independent = median[f"2 independent | {workload}"]
        two = median[f"2 workers | {workload}"]
        two_info = info["2 workers"][0][workload]
        hlo = two_info.get("hlo", {})
        raw_hlo = two_info.get("raw_allreduce_hlo", {})
        rows.append({
            "framework": result["framework"],
            "workload": workload,
            "parameters": two_info["parameters"],
            "per_worker_batch": per_worker,
            "one_worker_ms": one,
            "two_independent_ms": independent,
            "two_workers_ms": two,
            "one_worker_examples_per_s": per_worker / one * 1e3,
            "two_workers_examples_per_s": 2 * per_worker / two * 1e3,
            "throughput_ratio": (2 * per_worker / two) / (per_worker / one),
            "efficiency": one / two,
            "efficiency_without_communication": one / independent,
            "allreduce_run_ms": median.get(f"2 workers | {workload} allreduce_run"),
            "allreduce_raw_ms": median.get(f"2 workers | {workload} allreduce_raw"),
            "one_worker_cpu_ms": cpu[f"1 worker | {workload}"],
            "two_independent_cpu_ms": cpu[f"2 independent | {workload}"],
            "two_workers_cpu_ms": cpu[f"2 workers | {workload}"],
            "allreduce_run_cpu_ms": cpu.get(f"2 workers | {workload} allreduce_run"),
            "allreduce_raw_cpu_ms": cpu.get(f"2 workers | {workload} allreduce_raw"),
            "two_workers_host_us": result["median_host_us"][f"2 workers | {workload}"],
            "hlo_all_reduce_ops": hlo.get("all_reduce_ops"),
            "hlo_all_reduce_bytes": hlo.get("all_reduce_bytes"),
            "hlo_error": hlo.get("error"),
            "raw_hlo_all_reduce_ops": raw_hlo.get("all_reduce_ops"),
            "one_worker_hlo_all_reduce_ops": info["1 worker"][0][workload].get("hlo", {}).get(
                "all_reduce_ops"),
        })
    return rows


def _fmt(value, digits=2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(rows: list) -> str:
    lines = [
        "| framework | workload | per-worker batch | 1 worker ms/step | 2 independent ms/step "
        "| 2 workers ms/step | 1 worker ex/s | 2 workers ex/s | throughput ratio | efficiency "
        "| all-reduce only ms/step (strategy.run) | raw psum ms/step | all-reduce ops / MiB in "
        "the step's HLO |",
        "| --- | --- |" + " ---: |" * 11,
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['framework']} | {r['workload']} | {r['skipped']} |"
                         + " |" * 10)
            continue
        hlo = ("n/a" if r["hlo_all_reduce_ops"] is None
               else f"{r['hlo_all_reduce_ops']} / {r['hlo_all_reduce_bytes'] / 2**20:.2f}")
        lines.append(
            f"| {r['framework']} | {r['workload']} | {r['per_worker_batch']} "
            f"| {_fmt(r['one_worker_ms'])} | {_fmt(r['two_independent_ms'])} "
            f"| {_fmt(r['two_workers_ms'])} | {r['one_worker_examples_per_s']:.0f} "
            f"| {r['two_workers_examples_per_s']:.0f} | {r['throughput_ratio']:.3f} "
            f"| {r['efficiency']:.3f} | {_fmt(r['allreduce_run_ms'])} "
            f"| {_fmt(r['allreduce_raw_ms'])} | {hlo} |"
        )
    return "\n".join(lines)


def _cpu_table(rows: list) -> str:
    """CPU time per step (all threads of a worker; mean of the workers of a configuration)."""
    lines = [
        "| framework | workload | 1 worker CPU ms/step | 2 independent CPU ms/step | 2 workers "
        "CPU ms/step | 2 workers minus 1 worker | all-reduce only CPU ms/step (strategy.run) "
        "| raw psum CPU ms/step | CPU-bound efficiency (1 worker CPU / 2 workers CPU) |",
        "| --- | --- |" + " ---: |" * 7,
    ]
    for r in rows:
        if r.get("skipped"):
            continue
        lines.append(
            f"| {r['framework']} | {r['workload']} | {r['one_worker_cpu_ms']:.2f} "
            f"| {r['two_independent_cpu_ms']:.2f} | {r['two_workers_cpu_ms']:.2f} "
            f"| {r['two_workers_cpu_ms'] - r['one_worker_cpu_ms']:.2f} "
            f"| {_fmt(r['allreduce_run_cpu_ms'])} | {_fmt(r['allreduce_raw_cpu_ms'])} "
            f"| {r['one_worker_cpu_ms'] / r['two_workers_cpu_ms']:.3f} |"
        )
    return "\n".join(lines)


def _profile_table(results: list) -> str:
    """Where a step's time goes, per mirrax configuration (one value per worker, ' / ')."""
    lines = [
        "| workload | configuration | wall ms/step (each step waited for) | XLA executable "
        "ms/step | of which all-reduce | of which compute | outside the executable (host) "
        "| costliest compute thunks (ms/step, worker 0) |",
        "| --- | --- |" + " ---: |" * 5 + " --- |",
    ]
    for result in results:
        for key, per_worker in result.get("profiles", {}).items():
            config, workload = key.split(" | ")

            def each(f):
                return " / ".join(f"{f(p):.2f}" for p in per_worker)

            top = ", ".join(f"{k} {v:.1f}" for k, v in
                            list(per_worker[0]["top_thunks_ms"].items())[:4])
            lines.append(
                f"| {workload} | {config} | {each(lambda p: p['wall_ms'])} "
                f"| {each(lambda p: p['executable_ms'])} | {each(lambda p: p['all_reduce_ms'])} "
                f"| {each(lambda p: p['executable_ms'] - p['all_reduce_ms'])} "
                f"| {each(lambda p: p['wall_ms'] - p['executable_ms'])} | {top} |"
            )
    return "\n".join(lines)


def _tensorflow_available() -> bool:
    # Asked in a child: importing TensorFlow here would start its threads in the driver.
    done = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    return done.returncode == 0


def main(argv=None) -> None:
    args = _parse_args(argv)
    overhead.check_json_path(args.json)
    if args.worker:
        _worker_main(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("multi_worker.py needs 2 CPU cores (cores 0 and 1); this process may "
                         f"use {sorted(os.sched_getaffinity(0))}.")
    began = time.perf_counter()
    # Other work on the machine distorts every number here: the 1-minute load average before
    # and after the run goes into the output.
    load_before = os.getloadavg()[0]
    results, rows = [], []
    os.environ["MIRRAX_BENCH_WORKLOADS"] = ",".join(args.workloads)  # the workers read it
    with tempfile.TemporaryDirectory(prefix="mirrax-multi-worker-") as log_dir:
        frameworks = ["mirrax", "mirrax-packed"] if not args.only_packed else ["mirrax-packed"]
        tf_status = "skipped (--skip-tf)"
        if not args.skip_tf:
            if _tensorflow_available():
                frameworks.append("tensorflow")
                tf_status = "run"
            else:
                tf_status = "TensorFlow not installed: skipped"
                print(tf_status, file=sys.stderr)
        for framework in frameworks:
            print(f"[{framework}] starting 4 worker processes ...", file=sys.stderr, flush=True)
            result = _measure(framework, args, log_dir)
            results.append(result)
            rows.extend(_rows(result))
            for key, value in result["median_ms"].items():
                print(f"  [{framework}] {key}: {value:.3f} ms/step", file=sys.stderr, flush=True)
    if tf_status != "run":
        rows.extend({"framework": "tensorflow", "workload": w, "skipped": tf_status}
                    for w in args.workloads)
    print(_table(rows))
    print()
    print(_cpu_table(rows))
    print()
    print(_profile_table(results))
    total = time.perf_counter() - began
    load_after = os.getloadavg()[0]
    print(f"\n{args.repeats} windows of {args.steps} steps per case; total {total:.0f} s; "
          f"load average {load_before:.2f} before, {load_after:.2f} after", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "steps_per_window": args.steps,
                "repeats": args.repeats,
                "processor": _processor_name(),
                "host_cpus": os.cpu_count(),
                "python": platform.python_version(),
                "tensorflow": tf_status,
                "total_s": total,
                "load_average_before_after": [load_before, load_after],
                "rows": rows,
                "results": results,
            }, f, indent=1)


if __name__ == "__main__":
    main()
