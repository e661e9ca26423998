"""Save and restore speed of `mirrax.CheckpointManager`, synchronous vs asynchronous.

The tutorial CNN (28x28x1) and an MLP of `--mlp-layers` dense layers of `--mlp-width`² float32
(~100M parameters by default), each with its Adam state after one step (nonzero moments: zeros
would compress unrealistically), saved as `mirrax.Checkpoint(model=..., optimizer=...)` built in
a `MirroredStrategy` scope over the devices. Median of `--repeats` after one untimed warm-up,
each save into a fresh folder: sync save (`save()` with `async_save=False`; bytes on disk: the
files it wrote), async save blocks (how long `save()` with `async_save=True` holds the caller)
and until finished (until `wait_until_finished()` returns), restore (`Checkpoint.restore(path)`
until every array is ready; the files are read from the page cache).

Usage:
  python -m benchmarks.checkpoint_speed                  # 1 fake CPU device
  python -m benchmarks.checkpoint_speed --devices 1,4    # one subprocess per count
  python -m benchmarks.checkpoint_speed --json out.json  # also write the results as JSON
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from benchmarks._harness import env

MODULE = "benchmarks.checkpoint_speed"


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
    )


def _measure(args, devices: int) -> dict:
    import jax
    import optax
    from flax import nnx

    import mirrax
    from benchmarks._harness import models

    local = env.local_devices(args.platform, devices, MODULE)
    strategy = mirrax.MirroredStrategy(local)

    @nnx.jit
    def adam_step(model, optimizer, x):
        optimizer.update(model, nnx.grad(lambda m: (m(x) ** 2).mean())(model))

    def timed_checkpoints(model, optimizer) -> dict:
        ckpt = mirrax.Checkpoint(model=model, optimizer=optimizer)
        samples = []
        for _ in range(args.repeats + 1):  # the first warms up (thread pools, TensorStore)
            with tempfile.TemporaryDirectory(prefix="mirrax_ckpt_bench_", dir=args.dir) as folder:
                start = time.perf_counter()
                path = mirrax.CheckpointManager(ckpt, f"{folder}/sync", max_to_keep=1).save()
                sync_s = time.perf_counter() - start
                manager = mirrax.CheckpointManager(ckpt, f"{folder}/async", max_to_keep=1, async_save=True)
                start = time.perf_counter()
                manager.save()
                blocked_s = time.perf_counter() - start
                manager.wait_until_finished()
                total_s = time.perf_counter() - start
                start = time.perf_counter()
                ckpt.restore(path).assert_consumed()
                jax.block_until_ready(nnx.state((model, optimizer)))
                samples.append(
                    {
                        "sync": sync_s,
                        "blocked": blocked_s,
                        "total": total_s,
                        "restore": time.perf_counter() - start,
                        "bytes": _dir_bytes(path),
                    }
                )
        return {key: statistics.median(s[key] for s in samples[1:]) for key in samples[0]}

    width, layers = args.mlp_width, args.mlp_layers
    workloads = {  # name -> (model builder, input shape)
        "CNN": (models.CNN, (28, 28, 1)),
        f"MLP {layers}x{width}²": (lambda rngs: models.DenseStack([width] * (layers + 1), rngs), (width,)),
    }
    rows = []
    for name, (builder, x_shape) in workloads.items():
        with strategy.scope():
            model = builder(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            adam_step(model, optimizer, models.random_batch(x_shape, 8)[0])
        row = {
            "workload": name,
            "replicas": devices,
            "repeats": args.repeats,
            "parameters": int(sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))),
            "state_bytes": int(sum(a.nbytes for a in jax.tree.leaves(nnx.state((model, optimizer))))),
            **timed_checkpoints(model, optimizer),
        }
        env.log(
            f"  [{devices} {args.platform}] {name}: sync save {row['sync']:.3f} s, async "
            f"blocks {row['blocked']:.3f} s, restore {row['restore']:.3f} s"
        )
        rows.append(row)
        del model, optimizer  # the MLP's state is ~1.1 GiB: free it before the next build
    return {"environment": env.environment(local), "rows": rows}


def _markdown(results: list) -> str:
    mib = 2**20
    header = [
        "workload",
        "replicas",
        "parameters",
        "state MiB (params + Adam)",
        "sync save s",
        "bytes on disk (MiB)",
        "sync save MiB/s",
        "async save blocks s",
        "async save until finished s",
        "restore s",
    ]
    table = [
        [
            r["workload"],
            r["replicas"],
            f"{r['parameters']:,}",
            f"{r['state_bytes'] / mib:.1f}",
            f"{r['sync']:.3f}",
            f"{r['bytes'] / mib:.1f}",
            f"{r['bytes'] / mib / r['sync']:.0f}",
            f"{r['blocked']:.3f}",
            f"{r['total']:.3f}",
            f"{r['restore']:.3f}",
        ]
        for result in results
        for r in result["rows"]
    ]
    return "\n".join(
        env.markdown_table(header, table)
        + [
            "",
            f"{env.environment_note(results[0]['environment'])} Median of "
            f"{results[0]['rows'][0]['repeats']} after one warm-up; restore reads from the page cache.",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env.add_device_arguments(parser, default="1")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--mlp-width", type=int, default=4096, help="MLP layer width")
    parser.add_argument("--mlp-layers", type=int, default=6, help="MLP dense layers")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    args = parser.parse_args(argv)
    env.parse_device_counts(parser, args)
    if min(args.repeats, args.mlp_width, args.mlp_layers) < 1:
        parser.error("--repeats, --mlp-width and --mlp-layers must be >= 1")
    child_argv = env.forward_arguments(args, ("platform", "repeats", "mlp_width", "mlp_layers", "dir"))
    return env.run_benchmark(args, _measure, _markdown, child_argv, MODULE)


if __name__ == "__main__":
    sys.exit(main())
