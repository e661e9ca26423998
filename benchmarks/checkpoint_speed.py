"""Save and restore speed of `mirrax.CheckpointManager`, synchronous vs asynchronous.

For the tutorial CNN (input 28x28x1) and a large MLP (`--mlp-layers` dense layers of
`--mlp-width` x `--mlp-width` float32, ~100M parameters by default), each with its Adam state
after one train step (so the moments are not all zeros, which would compress unrealistically),
tracked as `mirrax.Checkpoint(model=..., optimizer=...)` and created in `strategy.scope()` of a
`MirroredStrategy` over `--devices` fake CPU devices. Measured, median of `--repeats` after one
untimed warm-up, each save into a fresh directory:

- sync save: `CheckpointManager(async_save=False).save()` wall time; bytes on disk is the sum
  of the file sizes of the checkpoint directory it wrote.
- async save, blocked: how long `CheckpointManager(async_save=True).save()` holds the caller
  (the training loop); until finished: from that call until `wait_until_finished()` returns.
- restore: `Checkpoint.restore(path)` until every restored array is ready. The files were just
  written, so they are read from the page cache (no cold-disk reads).

Run: .venv/bin/python benchmarks/checkpoint_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402
from overhead import configure_jax_environment  # noqa: E402


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="fake CPU devices (replicas)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--mlp-width", type=int, default=4096, help="MLP layer width")
    parser.add_argument("--mlp-layers", type=int, default=6, help="MLP dense layers")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    if min(args.devices, args.repeats, args.mlp_width, args.mlp_layers) < 1:
        parser.error("--devices, --repeats, --mlp-width and --mlp-layers must be >= 1")
    return args


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
    )


def _workloads(args):
    """(name, build) pairs; `build()` returns (model, optimizer) after one Adam step."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from workloads import CNN

    class BigMLP(nnx.Module):
        """`layers` dense layers width x width; input (batch, width) float32."""

        def __init__(self, width: int, layers: int, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return x

    def one_step(model, x):
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x):
            grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
            optimizer.update(model, grads)

        step(model, optimizer, x)
        return model, optimizer

    rng = np.random.default_rng(0)
    cnn_x = rng.standard_normal((8, 28, 28, 1)).astype(np.float32)
    mlp_x = rng.standard_normal((8, args.mlp_width)).astype(np.float32)
    return [
        ("CNN", lambda: one_step(CNN(nnx.Rngs(0)), cnn_x)),
        (f"MLP {args.mlp_layers}x{args.mlp_width}²",
         lambda: one_step(BigMLP(args.mlp_width, args.mlp_layers, nnx.Rngs(0)), mlp_x)),
    ]


def _measure(model, optimizer, base: str, repeats: int) -> dict:
    import jax
    from flax import nnx

    import mirrax

    ckpt = mirrax.Checkpoint(model=model, optimizer=optimizer)
    rows = {"sync": [], "blocked": [], "total": [], "restore": [], "bytes": []}
    for rep in range(repeats + 1):  # repeat 0 warms up (thread pools, TensorStore, imports)
        sync_dir = tempfile.mkdtemp(dir=base)
        async_dir = tempfile.mkdtemp(dir=base)
        sync_mgr = mirrax.CheckpointManager(ckpt, sync_dir, max_to_keep=1)
        t0 = time.perf_counter()
        path = sync_mgr.save()
        sync_s = time.perf_counter() - t0
        size = _dir_bytes(path)

        async_mgr = mirrax.CheckpointManager(ckpt, async_dir, max_to_keep=1, async_save=True)
        t0 = time.perf_counter()
        async_mgr.save()
        blocked_s = time.perf_counter() - t0
        async_mgr.wait_until_finished()
        total_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        ckpt.restore(path).assert_consumed()
        jax.block_until_ready(nnx.state((model, optimizer)))
        restore_s = time.perf_counter() - t0

        shutil.rmtree(sync_dir)
        shutil.rmtree(async_dir)
        if rep:
            for key, value in zip(rows, (sync_s, blocked_s, total_s, restore_s, size)):
                rows[key].append(value)
    return {key: statistics.median(values) for key, values in rows.items()}


def main(argv=None) -> None:
    args = _parse_args(argv)
    overhead.check_json_path(args.json)
    configure_jax_environment("cpu", args.devices)
    import jax
    import numpy as np
    from flax import nnx

    import mirrax

    strategy = mirrax.MirroredStrategy(jax.local_devices()[: args.devices])
    base = tempfile.mkdtemp(prefix="mirrax_ckpt_bench_", dir=args.dir)
    header = (
        "| workload | replicas | parameters | state MiB (params + Adam) | sync save s | bytes on disk (MiB) "
        "| sync save MiB/s | async save blocks s | async save until finished s | restore s |"
    )
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    results: dict = {}
    try:
        for name, build in _workloads(args):
            with strategy.scope():
                model, optimizer = build()
            params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
            state_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state((model, optimizer))))
            m = _measure(model, optimizer, base, args.repeats)
            results[name] = {"parameters": params, "state_bytes": state_bytes, **m}
            mib = 2**20
            lines.append(
                f"| {name} | {args.devices} | {params:,} | {state_bytes / mib:.1f} | {m['sync']:.3f} "
                f"| {m['bytes'] / mib:.1f} | {m['bytes'] / mib / m['sync']:.0f} | {m['blocked']:.3f} "
                f"| {m['total']:.3f} | {m['restore']:.3f} |"
            )
            print(lines[-1], flush=True)
            del model, optimizer
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\njax {jax.__version__}, {os.cpu_count()} CPU cores, median of {args.repeats}\n")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replicas": args.devices, "repeats": args.repeats, "jax": jax.__version__,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
