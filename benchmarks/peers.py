"""Examples/s of mirrax.Model.fit against its peers: Keras 3 (JAX), TensorFlow, PyTorch DDP.

The same three workloads are defined in every framework, layer for layer (the parameter counts
are printed per framework and must agree):

- CNN: the TF tutorial CNN of `workloads.py` (Conv 32 3x3 relu, max pool 2, Conv 64 3x3 relu,
  max pool 2, Conv 64 3x3 relu, flatten, Dense 64 relu, Dense 10; padding "SAME"), 28x28x1
  float32 images; 257,162 parameters.
- MLP: 784 -> 1024 relu -> 1024 relu -> 10, float32 inputs; 1,863,690 parameters.
- transformer: token embedding (vocab 1000, d_model 256) plus a learned position embedding
  (sequence 64), 4 pre-LayerNorm encoder blocks (4-head self-attention with biases, MLP
  256 -> 1024 GELU (exact) -> 256, residuals), a final LayerNorm, the mean over the sequence and
  Dense 10; int32 token ids; 3,434,506 parameters.

Everywhere: Adam (lr 1e-3, epsilon 1e-7: Keras's defaults), sparse categorical cross-entropy on
logits, global batch 128, random data from one NumPy seed (every framework trains on the same
arrays), no metrics, no dropout. Two comparisons:

1. One process, 2 devices, `fit`:
   - mirrax: `mirrax.MirroredStrategy` over 2 fake JAX CPU devices
     (`--xla_force_host_platform_device_count=2`), `mirrax.Model.fit`.
   - JAX hand-written (the floor, `workloads.make_handwritten`): one `jax.jit(jax.shard_map)`
     call per step on a pre-placed batch, buffers not donated; no input pipeline, no logs.
   - Keras 3, JAX backend: `keras.distribution.DataParallel` over the same 2 fake devices,
     `model.fit` (XLA-compiled, as Keras does by default on JAX).
   - TensorFlow: Keras 3 on the TF backend under `tf.distribute.MirroredStrategy` over 2 logical
     CPU devices (`tf.config.set_logical_device_configuration`), `model.fit`. Keras turns XLA off
     for TF on CPU and under tf.distribute, so this runs TF's own kernels (oneDNN).
   Each `fit` call is one epoch of `steps` batches of NumPy arrays (`shuffle=False`,
   `verbose=0`); the time is `on_epoch_begin` to `on_epoch_end` of a callback that then waits
   for the weights, so `fit`'s own set-up per call is not counted. Each framework uses both
   cores as it likes (default threading).
2. Two processes on this machine, one core each (pinned with `sched_setaffinity`; one thread
   of intra-op work: `--xla_cpu_multi_thread_eigen=false`, `torch.set_num_threads(1)`),
   global batch 128 = 64 per process:
   - mirrax: `mirrax.MultiWorkerMirroredStrategy()` with a 2-worker `TF_CONFIG` (127.0.0.1),
     one replica per process, gradients all-reduced by Gloo inside the compiled step; timed as
     `Model.fit` (every worker passes the same global arrays: DATA sharding), and as a custom
     loop, `strategy.run(step, args=(model, optimizer, batch))` on a pre-placed batch.
   - PyTorch: `DistributedDataParallel` with the Gloo backend (`init_method` tcp://127.0.0.1),
     the usual loop (zero_grad, forward, loss, backward, step) over pre-made per-step tensors.

Timing: every variant is a long-lived process (or pair of processes) that builds all its
workloads and runs `--warmup` untimed epochs of each (compilation, tracing), then answers
commands from this driver: one timed epoch of `--<workload>-steps` steps. The driver runs
`--repeats` rounds; in each round, per workload, every variant runs one epoch, in an order that
rotates every round (A B C, B C A, ...), so drift hits all alike. A pair's epoch time is the
slower process's. Reported: the median examples/s (steps * 128 / epoch seconds) and the ratio
mirrax / peer, the median of the same-round ratios. Every group of processes runs from start to
end under `flock /tmp/mirrax_bench.lock`, so other benchmarks on this machine do not overlap.

A peer whose package is not installed (`benchmarks/requirements-peers.txt`, in a separate
environment, e.g. `.venv-peers`) is skipped with a message; from mirrax's own environment the
script prints what it skipped and exits 0.

Usage:
  .venv-peers/bin/python benchmarks/peers.py                     # all peers, ~8 minutes
  .venv-peers/bin/python benchmarks/peers.py --only keras,tf --json out.json
  .venv-peers/bin/python benchmarks/peers.py --only torch --repeats 7 --mlp-steps 50
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import overhead  # JAX-free: the shared --json check

GLOBAL_BATCH = 128
NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
MLP_SIZES = (784, 1024, 1024, 10)
# The transformer encoder: blocks, d_model, heads, MLP width, sequence length, vocabulary.
LAYERS, D_MODEL, HEADS, MLP_WIDTH, SEQUENCE, VOCAB = 4, 256, 4, 1024, 64, 1000
LAYER_NORM_EPSILON = 1e-5
LEARNING_RATE, ADAM_EPSILON = 1e-3, 1e-7
SEED = 0

WORKLOADS = ("cnn", "mlp", "transformer")
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
TORCH_WORKLOADS = ("mlp", "transformer")  # the issue's; --torch-workloads adds the CNN
DEVICES = 2
PROCESSES = 2
LOCK_PATH = "/tmp/mirrax_bench.lock"
REPLY = "@@peers "  # prefix of a worker's reply line on stdout (frameworks print there too)
STARTUP_TIMEOUT_S = 900
EPOCH_TIMEOUT_S = 600
MAX_RESTARTS = 3  # per single-process worker (see _run_group's `restart`)
PAUSE_S = 0.2  # between epochs: threads of the framework that just ran stop spinning


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Examples/s of mirrax.Model.fit vs Keras 3 (JAX) DataParallel, "
        "TensorFlow MirroredStrategy and PyTorch DDP on the same models and data."
    )
    parser.add_argument("--only", default=",".join(PEERS),
                        help=f"comma-separated peers to compare with (default: {','.join(PEERS)})")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated workloads (default: {','.join(WORKLOADS)})")
    parser.add_argument("--torch-workloads", default=",".join(TORCH_WORKLOADS),
                        help="workloads of the 2-process comparison (default: mlp,transformer)")
    for name in WORKLOADS:
        parser.add_argument(f"--{name}-steps", type=int, default=DEFAULT_STEPS[name],
                            help=f"{WORKLOAD_NAMES[name]} steps per timed epoch "
                            f"(default {DEFAULT_STEPS[name]})")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per variant (5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed epochs per variant and workload before timing (1)")
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the hand-written jax.jit(shard_map) step")
    parser.add_argument("--tf-one-device", action="store_true",
                        help="also time TF's fit without a strategy (one device, TF's own "
                        "speed without MirroredStrategy)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.peers = _names(parser, "--only", args.only, PEERS)
    args.workload_list = _names(parser, "--workloads", args.workloads, WORKLOADS)
    args.torch_workload_list = [
        w for w in _names(parser, "--torch-workloads", args.torch_workloads, WORKLOADS)
        if w in args.workload_list
    ]
    args.steps = {name: getattr(args, f"{name}_steps") for name in WORKLOADS}
    if min(args.steps.values()) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--*-steps and --repeats must be >= 1, --warmup >= 0")
    return args


def _names(parser, flag: str, value: str, allowed: tuple) -> list:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {','.join(allowed)}; got {value!r}")
    return [n for n in allowed if n in names]


# -- the data -----------------------------------------------------------------------------------


def make_data(workload: str, steps: int):
    """`steps` global batches, concatenated: x float32 (or int32 token ids), y int32 labels."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    n = steps * GLOBAL_BATCH
    if workload == "cnn":
        x = rng.standard_normal((n,) + IMAGE_SHAPE).astype(np.float32)
    elif workload == "mlp":
        x = rng.standard_normal((n, MLP_SIZES[0])).astype(np.float32)
    else:
        x = rng.integers(0, VOCAB, size=(n, SEQUENCE)).astype(np.int32)
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype(np.int32)
    return x, y


# -- the workloads in Flax NNX (mirrax) ---------------------------------------------------------


def nnx_modules() -> dict:
    """{workload: constructor(rngs) -> nnx.Module}, the models mirrax trains."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mirrax.examples.keras_fit import TutorialCNN

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            sizes = MLP_SIZES
            self.layers = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
            )

        def __call__(self, x):
            """Logits (batch, 10) for x (batch, 784) float32."""
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    class EncoderBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(D_MODEL, epsilon=LAYER_NORM_EPSILON, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(HEADS, D_MODEL, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(D_MODEL, epsilon=LAYER_NORM_EPSILON, rngs=rngs)
            self.up = nnx.Linear(D_MODEL, MLP_WIDTH, rngs=rngs)
            self.down = nnx.Linear(MLP_WIDTH, D_MODEL, rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x)), approximate=False))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
            self.position = nnx.Param(
                0.02 * jax.random.normal(rngs.params(), (SEQUENCE, D_MODEL), jnp.float32)
            )
            self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(LAYERS)])
            self.norm = nnx.LayerNorm(D_MODEL, epsilon=LAYER_NORM_EPSILON, rngs=rngs)
            self.head = nnx.Linear(D_MODEL, NUM_CLASSES, rngs=rngs)

        def __call__(self, tokens):
            """Logits (batch, 10) for token ids (batch, SEQUENCE) int32."""
            x = self.embed(tokens) + self.position[...]
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x).mean(axis=1))

    return {
        "cnn": lambda rngs: TutorialCNN(IMAGE_SHAPE, NUM_CLASSES, rngs=rngs),
        "mlp": MLP,
        "transformer": Transformer,
    }


def _nnx_parameters(module) -> int:
    import jax
    from flax import nnx

    return int(sum(p.size for p in jax.tree.leaves(nnx.state(module, nnx.Param))))


# -- the workloads in Keras 3 (JAX and TensorFlow backends) -------------------------------------


def keras_model(keras, workload: str):
    """The workload as a Keras 3 model (any backend); outputs logits."""
    layers = keras.layers
    if workload == "cnn":
        return keras.Sequential([
            keras.Input(IMAGE_SHAPE),
            layers.Conv2D(32, 3, activation="relu", padding="same"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, activation="relu", padding="same"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, activation="relu", padding="same"),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
            layers.Dense(NUM_CLASSES),
        ])
    if workload == "mlp":
        return keras.Sequential(
            [keras.Input((MLP_SIZES[0],))]
            + [layers.Dense(n, activation="relu") for n in MLP_SIZES[1:-1]]
            + [layers.Dense(MLP_SIZES[-1])]
        )

    class PositionEmbedding(layers.Layer):
        """Adds a learned (SEQUENCE, D_MODEL) embedding of the positions."""

        def build(self, input_shape):
            self.position = self.add_weight(
                shape=(SEQUENCE, D_MODEL),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
            )

        def call(self, x):
            return x + self.position

    def norm():
        return layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON)

    tokens = keras.Input((SEQUENCE,), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(VOCAB, D_MODEL)(tokens))
    for _ in range(LAYERS):
        h = norm()(x)
        x = layers.Add()([x, layers.MultiHeadAttention(HEADS, D_MODEL // HEADS)(h, h)])
        h = layers.Dense(MLP_WIDTH, activation="gelu")(norm()(x))  # Keras's gelu is exact
        x = layers.Add()([x, layers.Dense(D_MODEL)(h)])
    x = layers.GlobalAveragePooling1D()(norm()(x))
    return keras.Model(tokens, layers.Dense(NUM_CLASSES)(x))


# -- the workloads in PyTorch -------------------------------------------------------------------


def torch_module(workload: str):
    """The workload as a torch.nn.Module; outputs logits. The CNN takes NCHW images."""
    import torch
    from torch import nn

    if workload == "cnn":
        channels = IMAGE_SHAPE[-1]
        return nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * (IMAGE_SHAPE[0] // 4) * (IMAGE_SHAPE[1] // 4), 64), nn.ReLU(),
            nn.Linear(64, NUM_CLASSES),
        )
    if workload == "mlp":
        sizes = MLP_SIZES
        modules = []
        for a, b in zip(sizes[:-2], sizes[1:-1]):
            modules += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*modules, nn.Linear(sizes[-2], sizes[-1]))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.position = nn.Parameter(0.02 * torch.randn(SEQUENCE, D_MODEL))
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    D_MODEL, HEADS, MLP_WIDTH, dropout=0.0, activation="gelu",
                    layer_norm_eps=LAYER_NORM_EPSILON, batch_first=True, norm_first=True,
                )
                for _ in range(LAYERS)
            )
            self.norm = nn.LayerNorm(D_MODEL, eps=LAYER_NORM_EPSILON)
            self.head = nn.Linear(D_MODEL, NUM_CLASSES)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x).mean(dim=1))

    return Transformer()


# -- workers: each builds its workloads, warms up, then runs timed epochs on command -----------
#
# A worker returns (tasks, info): tasks maps "<workload>/<variant>" to a function that runs one
# epoch of that workload and returns (seconds, mean loss or None).


def _worker_mirrax(spec: dict) -> tuple:
    """mirrax.MirroredStrategy over the fake devices: Model.fit, and the hand-written floor."""
    import jax

    import mirrax
    import workloads

    devices = jax.local_devices()[:spec["devices"]]
    strategy = mirrax.MirroredStrategy(devices)
    modules = nnx_modules()
    tasks, info = {}, {"strategy": repr(strategy)}
    for workload in spec["workloads"]:
        steps = spec["steps"][workload]
        x, y = make_data(workload, steps)
        tasks[f"{workload}/fit"], parameters = _mirrax_fit(strategy, modules[workload], x, y)
        info[workload] = {"parameters": parameters}
        if spec.get("floor"):
            step, block, loss_of = workloads.make_handwritten(
                modules[workload], x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], GLOBAL_BATCH, devices,
                donate=False,
            )

            def floor_epoch(step=step, block=block, loss_of=loss_of, steps=steps):
                start = time.perf_counter()
                workloads.run_steps(step, block, steps, max_in_flight=2)
                seconds = time.perf_counter() - start
                return seconds, None

            tasks[f"{workload}/floor"] = floor_epoch
    return tasks, info


def _mirrax_fit(strategy, module_cls, x, y) -> tuple:
    """(epoch function, parameter count) of `mirrax.Model.fit` on (x, y) under `strategy`."""
    import jax
    from flax import nnx

    import mirrax

    class EpochClock(mirrax.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            model = self.model
            jax.block_until_ready(nnx.state((model.module, model.optimizer.nnx_optimizer)))
            self.seconds = time.perf_counter() - self.begin

    with strategy.scope():
        model = mirrax.Model(module_cls(nnx.Rngs(SEED)))
        model.compile(
            optimizer="adam",  # Keras's Adam: 1e-3, epsilon 1e-7
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def epoch():
        clock = EpochClock()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
                            callbacks=[clock])
        return clock.seconds, history.history["loss"][-1]

    return epoch, _nnx_parameters(model.module)


def _worker_keras(spec: dict) -> tuple:
    """Keras 3 on JAX with DataParallel over the fake devices, model.fit."""
    import jax
    import keras

    devices = keras.distribution.list_devices("cpu")[:spec["devices"]]
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    info = {"distribution": f"DataParallel({devices})", "backend": keras.backend.backend()}
    return _keras_tasks(spec, keras, lambda model: jax.block_until_ready(
        [v.value for v in model.variables])), info


def _worker_tf(spec: dict) -> tuple:
    """Keras 3 on TensorFlow under MirroredStrategy over logical CPU devices, model.fit."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(spec["devices"])]
    )
    import keras

    logical = [d.name for d in tf.config.list_logical_devices("CPU")][:spec["devices"]]
    strategy = tf.distribute.MirroredStrategy(logical)
    info = {"strategy": f"MirroredStrategy({logical})", "backend": keras.backend.backend(),
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on)")}
    wait = lambda model: model.variables[-1].numpy()  # noqa: E731
    with strategy.scope():
        tasks = _keras_tasks(spec, keras, wait)
    if spec.get("tf_one_device"):
        # The same models outside any strategy: TF on one (logical) device, no all-reduce.
        tasks.update(_keras_tasks(spec, keras, wait, suffix="one_device"))
    return tasks, info


def _keras_tasks(spec: dict, keras, wait, suffix: str = "fit") -> dict:
    """{"<workload>/<suffix>": epoch function} for Keras 3's model.fit, any backend."""

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            wait(self.model)
            self.seconds = time.perf_counter() - self.begin

    keras.utils.set_random_seed(SEED)
    tasks = {}
    for workload in spec["workloads"]:
        x, y = make_data(workload, spec["steps"][workload])
        model = keras_model(keras, workload)
        model.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE, epsilon=ADAM_EPSILON),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

        def epoch(model=model, x=x, y=y):
            clock = EpochClock()
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                                shuffle=False, callbacks=[clock])
            return clock.seconds, history.history["loss"][-1]

        epoch.parameters = int(model.count_params())
        tasks[f"{workload}/{suffix}"] = epoch
    return tasks


def _worker_mirrax_multi(spec: dict) -> tuple:
    """One worker of a 2-worker MultiWorkerMirroredStrategy: Model.fit and strategy.run."""
    import mirrax

    # The strategy first: it starts jax.distributed, which must precede any other JAX call.
    strategy = mirrax.MultiWorkerMirroredStrategy()

    import jax
    from flax import nnx

    import workloads

    modules = nnx_modules()
    tasks, info = {}, {"strategy": repr(strategy), "process_index": jax.process_index()}
    for workload in spec["workloads"]:
        steps = spec["steps"][workload]
        x, y = make_data(workload, steps)  # every worker reads the global batches (DATA)
        tasks[f"{workload}/fit"], parameters = _mirrax_fit(strategy, modules[workload], x, y)
        info[workload] = {"parameters": parameters}

        with strategy.scope():
            model = modules[workload](nnx.Rngs(SEED))
            optimizer = nnx.Optimizer(model, _optax_adam(), wrt=nnx.Param)
        iterator = iter(strategy.experimental_distribute_dataset(
            (x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
        ))
        batch = next(iterator)
        train_step = workloads.strategy_run_step(GLOBAL_BATCH)

        def run_epoch(model=model, optimizer=optimizer, batch=batch, train_step=train_step,
                      steps=steps):
            def step():
                return strategy.run(train_step, args=(model, optimizer, batch))

            def block(out):
                jax.block_until_ready((out, nnx.state((model, optimizer))))

            start = time.perf_counter()
            workloads.run_steps(step, block, steps, max_in_flight=2)
            return time.perf_counter() - start, None

        tasks[f"{workload}/run"] = run_epoch
    return tasks, info


def _optax_adam():
    import optax

    return optax.adam(LEARNING_RATE, eps=ADAM_EPSILON)


def _worker_torch(spec: dict) -> tuple:
    """One rank of torch DistributedDataParallel (Gloo), the usual training loop."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(spec.get("threads", 1))
    rank, world = spec["rank"], spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=rank, world_size=world)
    torch.manual_seed(SEED)
    local = GLOBAL_BATCH // world
    tasks, info = {}, {"backend": dist.get_backend(), "threads": torch.get_num_threads()}
    for workload in spec["workloads"]:
        steps = spec["steps"][workload]
        x, y = make_data(workload, steps)
        if workload == "cnn":
            x = x.transpose(0, 3, 1, 2)  # NHWC -> NCHW
        x = torch.from_numpy(x.copy())
        if workload == "transformer":
            x = x.long()
        y = torch.from_numpy(y).long()
        # This rank's share of every global batch, as DistributedSampler would give it.
        batches = [
            (x[i * GLOBAL_BATCH + rank * local:i * GLOBAL_BATCH + (rank + 1) * local],
             y[i * GLOBAL_BATCH + rank * local:i * GLOBAL_BATCH + (rank + 1) * local])
            for i in range(steps)
        ]
        module = torch_module(workload)
        info[workload] = {"parameters": int(sum(p.numel() for p in module.parameters()))}
        model = nn.parallel.DistributedDataParallel(module)
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        loss_fn = nn.CrossEntropyLoss()

        def epoch(model=model, optimizer=optimizer, batches=batches):
            model.train()
            start = time.perf_counter()
            for xb, yb in batches:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
            seconds = time.perf_counter() - start
            return seconds, float(loss)

        tasks[f"{workload}/loop"] = epoch
    return tasks, info


WORKERS = {
    "mirrax": _worker_mirrax,
    "keras": _worker_keras,
    "tf": _worker_tf,
    "mirrax_multi": _worker_mirrax_multi,
    "torch": _worker_torch,
}


def _versions(framework: str) -> dict:
    from importlib import metadata

    names = {
        "mirrax": ("mirrax", "jax", "jaxlib", "flax", "optax", "numpy"),
        "mirrax_multi": ("mirrax", "jax", "jaxlib", "flax", "optax", "numpy"),
        "keras": ("keras", "jax", "jaxlib", "numpy"),
        "tf": ("keras", "tensorflow-cpu", "tensorflow", "numpy"),
        "torch": ("torch", "numpy"),
    }[framework]
    found = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if "core" in spec:
        # Pin before anything starts a thread: every thread inherits this core.
        os.sched_setaffinity(0, {spec["core"]})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the frameworks may print on stdout; keep the reply channel clean

    def reply(obj):
        reply_to.write(REPLY + json.dumps(obj) + "\n")
        reply_to.flush()

    try:
        start = time.perf_counter()
        tasks, info = WORKERS[spec["framework"]](spec)
        info["build_s"] = time.perf_counter() - start
        warmup = {}
        for name, task in tasks.items():
            start = time.perf_counter()
            losses = [task()[1] for _ in range(spec["warmup"])]
            warmup[name] = {"seconds": time.perf_counter() - start, "loss": losses}
            if hasattr(task, "parameters"):
                info.setdefault(name.split("/")[0], {})["parameters"] = task.parameters
        info["warmup"] = warmup
        info["versions"] = _versions(spec["framework"])
        info["affinity"] = sorted(os.sched_getaffinity(0))
    except BaseException:
        # Exit at once: the frameworks' cluster threads would keep the process alive.
        reply({"error": traceback.format_exc()})
        os._exit(1)
    reply({"ready": True, "tasks": sorted(tasks), "info": info})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        seconds, loss = tasks[command["task"]]()
        reply({"seconds": seconds, "loss": loss})
    reply({"bye": True})
    sys.stdout.flush()
    os._exit(0)  # jax.distributed's and torch.distributed's shutdown would wait for peers


# -- the driver ----------------------------------------------------------------------------------


class WorkerFailedError(RuntimeError):
    """A worker process exited or sent an error; the message ends with its log's tail."""


class _Process:
    """One worker process: commands on its stdin, replies from its stdout, its log in a file."""

    def __init__(self, spec: dict, env: dict, log_dir: str, label: str, replies: queue.Queue):
        self.label = label
        self.log = os.path.join(log_dir, label.replace(" ", "_") + ".log")
        self._sink = open(self.log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
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
        raise WorkerFailedError(
            f"peers.py: worker {self.label!r} (exit code {self.process.poll()}): {what}. "
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
    """The next reply of every process in `processes`; fails as soon as any of them does."""
    answers = {}
    deadline = time.monotonic() + timeout
    while len(answers) < len(processes):
        try:
            process, answer = replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            late = next(p for p in processes if p not in answers)
            late.fail(f"no answer within {timeout} s")
        if process not in processes:
            continue  # a restarted process's last words
        if answer is None or "error" in answer:
            process.fail("exited" if answer is None else answer["error"])
        answers[process] = answer
    return [answers[p] for p in processes]


@contextlib.contextmanager
def _bench_lock():
    """Holds /tmp/mirrax_bench.lock (flock), so no other timed benchmark runs meanwhile."""
    with open(LOCK_PATH, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"  waiting for {LOCK_PATH} (another benchmark is running)...",
                  file=sys.stderr, flush=True)
            start = time.perf_counter()
            fcntl.flock(f, fcntl.LOCK_EX)
            print(f"  got the lock after {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(devices: int, multi_worker: bool = False, framework: str = "") -> dict:
    env = dict(os.environ)
    for name in ("TF_CONFIG", "XLA_FLAGS", "KERAS_BACKEND", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    flags = [f"--xla_force_host_platform_device_count={devices}"]
    if multi_worker:
        flags.append("--xla_cpu_multi_thread_eigen=false")
        env["OMP_NUM_THREADS"] = "1"
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags),
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
    })
    if framework in ("keras", "tf"):
        env["KERAS_BACKEND"] = "jax" if framework == "keras" else "tensorflow"
    return env


def _run_group(title: str, variants: list, workloads: list, args, log_dir: str) -> dict:
    """Starts every variant's processes, times them in rotation; the group's results.

    `variants` is a list of (label, [(spec, env, process label)], task suffix); a variant whose
    processes are those of an earlier one (same process labels) reuses them.
    """
    replies = queue.Queue()
    processes, members, recipes = {}, {}, {}
    for label, specs, _ in variants:
        members[label] = []
        for spec, env, name in specs:
            if name not in processes:
                recipes[name] = (spec, env)
                processes[name] = _Process(spec, env, log_dir, name, replies)
            members[label].append(processes[name])
    restarts, ready = [], {}

    def restart(dead, error: WorkerFailedError, when: str):
        """A fresh process in place of `dead`, in every variant it served; or `error` again.

        XLA:CPU's in-process all-reduce can deadlock when a framework queues many
        multi-device steps (Keras's fit does), and its rendezvous then aborts the process.
        A single process is restarted (at most MAX_RESTARTS times); a pair cannot be.
        """
        label = dead.label
        if "world" in recipes[label][0] or sum(r["process"] == label for r in restarts) \
                >= MAX_RESTARTS:
            raise error
        last = [line for line in str(error).splitlines()
                if line.strip() and not line.lstrip().startswith("@")][-6:]
        print(f"  {label} died ({when}); restarting it:\n    " + "\n    ".join(last),
              file=sys.stderr, flush=True)
        restarts.append({"process": label, "when": when, "log_tail": last})
        dead.close()
        fresh = _Process(*recipes[label], log_dir, f"{label} restart {len(restarts)}", replies)
        fresh.label = label
        for group in members.values():
            group[:] = [fresh if p is dead else p for p in group]
        processes[label] = fresh
        return fresh

    def wait_ready(labels: set):
        """Waits for the `ready` reply of the processes named `labels`, restarting failures."""
        pending = set(labels)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            try:
                process, answer = replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                processes[min(pending)].fail(f"not ready within {STARTUP_TIMEOUT_S} s")
            if process.label not in pending or processes[process.label] is not process:
                continue  # a restarted process's last words
            try:
                if answer is None or "error" in answer:
                    process.fail("exited" if answer is None else answer["error"])
            except WorkerFailedError as error:
                restart(process, error, "warm-up")
                continue
            ready[process.label] = answer
            pending.discard(process.label)

    try:
        start = time.perf_counter()
        wait_ready(set(processes))
        startup_s = time.perf_counter() - start
        print(f"  {title}: started and warmed up in {startup_s:.0f} s", file=sys.stderr,
              flush=True)

        def epoch(label, suffix, workload):
            while True:
                group = members[label]
                try:
                    for p in group:
                        p.send({"op": "epoch", "task": f"{workload}/{suffix}"})
                    answers = _receive(group, replies, EPOCH_TIMEOUT_S)
                    break
                except (WorkerFailedError, OSError) as error:
                    dead = next((p for p in group if p.process.poll() is not None), group[0])
                    if not isinstance(error, WorkerFailedError):
                        error = WorkerFailedError(f"peers.py: worker {dead.label!r}: {error}")
                    fresh = restart(dead, error, f"{label}, {workload}")
                    wait_ready({fresh.label})
            time.sleep(PAUSE_S)
            return max(a["seconds"] for a in answers), answers[0]["loss"]

        seconds = {(label, w): [] for label, _, _ in variants for w in workloads}
        losses = {(label, w): [] for label, _, _ in variants for w in workloads}
        for r in range(args.repeats):
            for workload in workloads:
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                for label, _, suffix in order:
                    s, loss = epoch(label, suffix, workload)
                    seconds[(label, workload)].append(s)
                    losses[(label, workload)].append(loss)
            print(f"  {title}: round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for p in processes.values():
            p.close()
    info = {name: answer["info"] for name, answer in ready.items()}
    return {
        "title": title,
        "startup_s": startup_s,
        "restarts": restarts,
        "variants": [label for label, _, _ in variants],
        "processes": {label: [p.label for p in group] for label, group in members.items()},
        "info": info,
        "seconds": {f"{label} | {w}": v for (label, w), v in seconds.items()},
        "losses": {f"{label} | {w}": v for (label, w), v in losses.items()},
    }


def _examples_per_s(seconds: float, steps: int) -> float:
    return steps * GLOBAL_BATCH / seconds


def _rows(group: dict, workloads: list, steps: dict, reference: str) -> list:
    """Per workload: median examples/s of every variant, ratios reference / variant."""
    rows = []
    for w in workloads:
        row = {"workload": w, "steps_per_epoch": steps[w], "examples_per_s": {},
               "ratio_vs": {}, "parameters": {}}
        for label in group["variants"]:
            samples = group["seconds"][f"{label} | {w}"]
            row["examples_per_s"][label] = statistics.median(
                _examples_per_s(s, steps[w]) for s in samples
            )
            if label != reference:
                ref = group["seconds"][f"{reference} | {w}"]
                # examples/s ratio reference / label, per round; the median over rounds.
                row["ratio_vs"][label] = statistics.median(b / a for a, b in zip(ref, samples))
        for process, info in group["info"].items():
            if w in info and "parameters" in info[w]:
                row["parameters"][process] = info[w]["parameters"]
        rows.append(row)
    return rows


def _processor_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _markdown_group(group: dict, rows: list, reference: str, extra=()) -> list:
    """A markdown table: examples/s of every variant, `reference` / each other, `extra`
    columns (header, row -> cell), and the parameter count (all frameworks', if they differ)."""
    variants = group["variants"]
    peers = [v for v in variants if v != reference]
    header = (["workload", "steps/epoch"] + [f"{v} ex/s" for v in variants]
              + [f"{reference} / {v}" for v in peers] + [h for h, _ in extra]
              + ["parameters (every framework)"])
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for row in rows:
        counts = sorted(set(row["parameters"].values()))
        params = (f"{counts[0]:,}" if len(counts) == 1
                  else "MISMATCH " + ", ".join(f"{k} {v:,}" for k, v in row["parameters"].items()))
        cells = ([WORKLOAD_NAMES[row["workload"]], str(row["steps_per_epoch"])]
                 + [f"{row['examples_per_s'][v]:,.0f}" for v in variants]
                 + [f"{row['ratio_vs'][v]:.2f}" for v in peers]
                 + [cell(row) for _, cell in extra] + [params])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _restart_notes(group: dict) -> list:
    """One line per worker that died and was restarted (the epoch was then run again)."""
    notes = []
    for r in group["restarts"]:
        reason = next((line for line in r["log_tail"] if "rendezvous" in line.lower()),
                      r["log_tail"][-1] if r["log_tail"] else "no log")
        notes.append(f"Restarted: worker {r['process']} died ({r['when']}): {reason[:300]}")
    return notes + ([""] if notes else [])


def _versions_note(group: dict) -> str:
    versions = {}
    for info in group["info"].values():
        versions.update(info.get("versions", {}))
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))


def main(argv=None) -> int:
    args = _parse_args(argv)
    overhead.check_json_path(args.json)
    if args.worker:
        _worker_main(args.worker)
        return 0
    started = time.perf_counter()
    missing = {peer: [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
               for peer in args.peers}
    skipped = {peer: f"not installed: {', '.join(m)} (pip install -r "
               "benchmarks/requirements-peers.txt)" for peer, m in missing.items() if m}
    for peer, why in skipped.items():
        print(f"peers.py: skipped {PEER_TITLES[peer]}: {why}", file=sys.stderr, flush=True)
    peers = [p for p in args.peers if p not in skipped]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "processor": _processor_name(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "global_batch": GLOBAL_BATCH,
        "skipped": skipped,
        "groups": {},
    }
    lines = []
    with tempfile.TemporaryDirectory(prefix="mirrax-peers-") as log_dir:
        single = [p for p in peers if p in ("keras", "tf")]
        if single:
            base = {"workloads": args.workload_list, "steps": args.steps, "warmup": args.warmup,
                    "devices": DEVICES}
            mirrax_proc = (dict(base, framework="mirrax", floor=not args.no_floor),
                           _environment(DEVICES), "mirrax")
            variants = [("mirrax fit", [mirrax_proc], "fit")]
            if not args.no_floor:
                variants.append(("JAX hand-written", [mirrax_proc], "floor"))
            titles = {"keras": "Keras (JAX) fit", "tf": "TF fit"}
            for peer in single:
                spec = dict(base, framework=peer, tf_one_device=args.tf_one_device)
                process = (spec, _environment(DEVICES, framework=peer), peer)
                variants.append((titles[peer], [process], "fit"))
                if peer == "tf" and args.tf_one_device:
                    variants.append(("TF fit, 1 device, no strategy", [process], "one_device"))
            title = f"one process, {DEVICES} CPU devices"
            with _bench_lock():
                group = _run_group(title, variants, args.workload_list, args, log_dir)
            rows = _rows(group, args.workload_list, args.steps, "mirrax fit")
            group["rows"] = rows
            result["groups"]["single_process"] = group
            lines += [f"One process, {DEVICES} devices, global batch {GLOBAL_BATCH} "
                      f"(examples/s, median of {args.repeats} epochs; ratios > 1: mirrax "
                      "faster):", ""]
            lines += _markdown_group(group, rows, "mirrax fit")
            lines += ["", f"Versions: {_versions_note(group)}.", ""]
            lines += _restart_notes(group)
        if "torch" in peers and args.torch_workload_list:
            mirrax_ports = [_free_port() for _ in range(PROCESSES)]
            torch_port = _free_port()
            base = {"workloads": args.torch_workload_list, "steps": args.steps,
                    "warmup": args.warmup, "world": PROCESSES}
            mirrax_procs, torch_procs = [], []
            for i in range(PROCESSES):
                env = _environment(1, multi_worker=True)
                env["TF_CONFIG"] = json.dumps({
                    "cluster": {"worker": [f"127.0.0.1:{port}" for port in mirrax_ports]},
                    "task": {"type": "worker", "index": i},
                })
                mirrax_procs.append((dict(base, framework="mirrax_multi", rank=i, core=i), env,
                                     f"mirrax worker {i}"))
                torch_procs.append((dict(base, framework="torch", rank=i, core=i,
                                         port=torch_port, threads=1),
                                    _environment(1, multi_worker=True), f"torch rank {i}"))
            variants = [
                ("mirrax MWMS fit", mirrax_procs, "fit"),
                ("mirrax MWMS strategy.run", mirrax_procs, "run"),
                ("torch DDP", torch_procs, "loop"),
            ]
            title = f"{PROCESSES} processes, 1 core each"
            with _bench_lock():
                group = _run_group(title, variants, args.torch_workload_list, args, log_dir)
            rows = _rows(group, args.torch_workload_list, args.steps, "mirrax MWMS fit")
            for row in rows:
                # The custom loop against DDP's loop, per round, as the fit ratios.
                run = group["seconds"][f"mirrax MWMS strategy.run | {row['workload']}"]
                ddp = group["seconds"][f"torch DDP | {row['workload']}"]
                row["run_vs_ddp"] = statistics.median(b / a for a, b in zip(run, ddp))
            group["rows"] = rows
            result["groups"]["two_processes"] = group
            lines += [f"{PROCESSES} processes x 1 core, global batch {GLOBAL_BATCH} "
                      f"({GLOBAL_BATCH // PROCESSES} per process; examples/s, median of "
                      f"{args.repeats} epochs; ratios > 1: mirrax faster):", ""]
            lines += _markdown_group(group, rows, "mirrax MWMS fit", extra=[(
                "mirrax MWMS strategy.run / torch DDP", lambda row: f"{row['run_vs_ddp']:.2f}")])
            lines += ["", f"Versions: {_versions_note(group)}.", ""]
    total = time.perf_counter() - started
    result["total_s"] = total
    for peer, why in skipped.items():
        lines.append(f"{PEER_TITLES[peer]}: skipped ({why}).")
    lines.append(f"{result['processor']}, {result['host_cpus']} CPUs, Python "
                 f"{result['python']}; total {total:.0f} s.")
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except WorkerFailedError as e:
        sys.exit(str(e))
