"""One-off cost of making mirrored state equal on 2 loopback workers: worker 0's state broadcast.

The state of an NNX model plus its Adam state (what `Model.fit` places at its first step) is
broadcast from worker 0 to every worker, timed three ways, each over ALL leaves in one call:
mirrax's (one packed uint32 all-reduce over the strategy's mesh, results placed on the
replicas: what `strategy.run` does at a first use), jax.experimental.multihost_utils.
broadcast_one_to_all (returns host NumPy arrays, one psum per leaf; placing them on the
replicas is timed apart), and the first `strategy.run` of a step that only reads the state
(broadcast, exchange and compiling the read included) against a second run over the placed
state. Models: the digits CNN of examples/keras_fit.py (8x8x1 images) and an MLP
784-2048-2048-10. Each worker has 2 fake CPU devices; the median of --repeats calls after one
untimed call (compilation), the slower worker's time.

Usage:
  python -m benchmarks.broadcast                  # both models, ~1 minute
  python -m benchmarks.broadcast --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _state(model_name: str):
    import jax
    import optax
    from flax import nnx

    if model_name == "CNN":
        from examples.keras_fit import TutorialCNN as CNN

        module = CNN((8, 8, 1), rngs=nnx.Rngs(jax.process_index()))
    else:

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.l1 = nnx.Linear(784, 2048, rngs=rngs)
                self.l2 = nnx.Linear(2048, 2048, rngs=rngs)
                self.l3 = nnx.Linear(2048, 10, rngs=rngs)

            def __call__(self, x):
                return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

        module = MLP(nnx.Rngs(jax.process_index()))
    optimizer = nnx.Optimizer(module, optax.adam(1e-3), wrt=nnx.Param)
    return module, optimizer


def _timed(fn, repeats):
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _worker(repeats: int) -> dict:
    import mirrax

    strategy = mirrax.MultiWorkerMirroredStrategy()
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from mirrax._src.distribute import broadcast

    replica_devices = strategy.extended.replica_devices
    results = {}
    for name in ("CNN", "MLP"):
        module, optimizer = _state(name)
        leaves = jax.tree.leaves(nnx.state((module, optimizer)))
        replicated = [replica_devices.replicated] * len(leaves)
        row = {"arrays": len(leaves), "MB": sum(x.nbytes for x in leaves) / 1e6}
        row["mirrax_ms"] = _timed(
            lambda: broadcast.from_worker_zero(strategy, leaves, replicated)[0], repeats
        )
        plain = [x for x in leaves if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
        row["one_to_all_ms"] = _timed(lambda: multihost_utils.broadcast_one_to_all(plain), repeats)
        host = multihost_utils.broadcast_one_to_all(plain)

        def place(values):
            return [
                jax.make_array_from_single_device_arrays(
                    v.shape,
                    replica_devices.replicated,
                    [jax.device_put(np.asarray(v), d) for d in replica_devices.local_devices],
                )
                for v in values
            ]

        row["one_to_all_place_ms"] = _timed(lambda: place(host), repeats)

        def read(module, optimizer):
            return sum(jax.numpy.sum(p[...]) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))

        module, optimizer = _state(name)
        start = time.perf_counter()
        jax.block_until_ready(strategy.run(read, args=(module, optimizer)))
        row["first_run_ms"] = 1000 * (time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(strategy.run(read, args=(module, optimizer)))
        row["second_run_ms"] = 1000 * (time.perf_counter() - start)
        results[name] = row
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print("@@result " + json.dumps(_worker(args.repeats)), flush=True)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]}
    procs = []
    for index in range(2):
        worker_env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.broadcast",
                    "--worker",
                    str(index),
                    "--repeats",
                    str(args.repeats),
                ],
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=sys.stderr if index == 0 else subprocess.DEVNULL,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    rows = [
        json.loads(next(line for line in out.splitlines() if line.startswith("@@result")).split(" ", 1)[1])
        for out in outs
    ]
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        "| model | arrays | MB | mirrax (one packed all-reduce, placed) ms | "
        "broadcast_one_to_all ms | + placing its result ms | first strategy.run ms | "
        "second ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in rows[0]:
        worst = {k: max(r[name][k] for r in rows) for k in rows[0][name]}
        print(
            f"| {name} | {worst['arrays']} | {worst['MB']:.2f} | {worst['mirrax_ms']:.1f} | "
            f"{worst['one_to_all_ms']:.1f} | {worst['one_to_all_place_ms']:.1f} | "
            f"{worst['first_run_ms']:.0f} | {worst['second_run_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
