"""Per-step overhead of `strategy.run` against the same train step written by hand in JAX.

Two variants run the SAME training step (same model, same initial weights, same `nnx.Optimizer`
with Adam 1e-3, same loss scaled by the global batch size) on the same device-resident batch:

- mirrax: `strategy = mirrax.MirroredStrategy(...)`, model and optimizer built under
  `strategy.scope()`, the batch a `PerReplica` from `strategy.experimental_distribute_dataset`,
  and `strategy.run(train_step, args=(model, optimizer, batch))` every step.
- hand-written: `nnx.split((model, optimizer))` ONCE, then
  `jax.jit(jax.shard_map(step, ...), donate_argnums=0)` called on the flat list of state arrays
  and the sharded batch: a pure function (state, x, y) -> (new state, loss), with the state
  buffers donated. This is the floor: no per-step Python beyond JAX's own dispatch.

Two workloads:

- CNN: the TF tutorial CNN (Conv 32 3x3 relu, max pool 2, Conv 64 3x3 relu, max pool 2, Conv 64
  3x3 relu, flatten, Dense 64 relu, Dense 10; padding "SAME") on 28x28x1 random inputs, global
  batch 128. Compute dominates; the ratio mirrax/hand-written should be <= 1.05.
- MLP: a tiny 2-layer MLP (32 -> 64 relu -> 10) on a global batch of 8. Compute is negligible,
  so the difference between the variants is the host (Python) cost of one `strategy.run` call.

Timing: compile and warm up both variants, then alternate them (order flipped every window, so
drift hits both alike) for several windows of `steps` steps each; a window ends with
`jax.block_until_ready` on the step's outputs and the whole model and optimizer state. Within a
window at most `--max-in-flight` steps run ahead of the last finished one (the host waits on the
output of the step that many steps back), for both variants alike: XLA:CPU's in-process
all-reduce deadlocks when about 100 multi-device steps are queued. Reported: the median ms per
step over the windows, the ratio mirrax/hand-written, their difference (overhead per step), and
the median host time spent inside one step call (Python and dispatch, not waiting for the
device). After the timing both variants take one more step; their losses are printed side by
side and must agree, since both took the same steps from the same weights.

Each device count runs in a fresh subprocess of this script, because the number of fake CPU
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`) is fixed when JAX starts.

Usage:
  python benchmarks/overhead.py                    # 1 and 4 fake CPU devices, a markdown table
  python benchmarks/overhead.py --devices 4        # one device count, in this process
  python benchmarks/overhead.py --json out.json    # also write the results as JSON
  python benchmarks/overhead.py --devices 1 --platform gpu   # on an accelerator
  python benchmarks/overhead.py --devices 4 --profile        # cProfile of the tiny mirrax step
  python benchmarks/overhead.py --no-donate        # hand-written step without buffer donation
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# JAX is imported inside `_measure`, after `_configure_jax_environment`: the device count and
# platform are read from the environment once, when JAX starts.

CNN_GLOBAL_BATCH = 128
MLP_GLOBAL_BATCH = 8
MLP_FEATURES = 32
TARGET_RATIO = 1.05


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-step overhead of mirrax's strategy.run vs a hand-written "
        "jax.jit(jax.shard_map(...)) train step."
    )
    parser.add_argument(
        "--devices",
        default="1,4",
        help="comma-separated replica counts; each runs in a fresh subprocess when more than one "
        "is given (default: 1,4)",
    )
    parser.add_argument(
        "--platform",
        default="cpu",
        choices=["cpu", "gpu", "tpu"],
        help="cpu uses N fake host devices; gpu/tpu use the first N local accelerators",
    )
    parser.add_argument("--windows", type=int, default=9, help="timed windows per variant")
    parser.add_argument("--cnn-steps", type=int, default=10, help="CNN steps per timed window")
    parser.add_argument("--mlp-steps", type=int, default=300, help="MLP steps per timed window")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=2,
        help="steps dispatched ahead of the last finished one (both variants alike; default 2)",
    )
    parser.add_argument(
        "--no-donate",
        action="store_true",
        help="compile the hand-written step without donate_argnums (mirrax does not donate)",
    )
    parser.add_argument("--skip-cnn", action="store_true", help="only the tiny MLP step")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, cProfile --mlp-steps calls of the mirrax MLP step and print the top "
        "functions",
    )
    args = parser.parse_args(argv)
    try:
        args.device_counts = [int(n) for n in args.devices.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--devices must be comma-separated integers like 1,4; got {args.devices!r}")
    if not args.device_counts or min(args.device_counts) < 1:
        parser.error(f"--devices needs at least one count >= 1; got {args.devices!r}")
    if min(args.windows, args.cnn_steps, args.mlp_steps, args.max_in_flight) < 1:
        parser.error("--windows, --cnn-steps, --mlp-steps and --max-in-flight must be >= 1")
    return args


def _configure_jax_environment(platform_name: str, devices: int) -> None:
    if platform_name == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
        ).strip()


# -- one device count, in this process ---------------------------------------------------------


def _measure(args, devices: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mirrax

    local = jax.local_devices()
    if local[0].platform != args.platform:
        raise SystemExit(
            f"overhead.py: asked for --platform {args.platform} but JAX's devices are "
            f"{local[0].platform} ({local[0].device_kind}). Install the matching jax extra "
            "(e.g. jax[cuda12]) or pass --platform cpu."
        )
    if len(local) < devices:
        raise SystemExit(
            f"overhead.py: asked for {devices} devices but this process has {len(local)} "
            f"{args.platform} device(s)."
        )

    from mirrax._src.cli.train import TutorialCNN

    def CNN(rngs: nnx.Rngs):
        """The TF tutorial CNN (the main job's); input (batch, 28, 28, 1), output (batch, 10)."""
        return TutorialCNN((28, 28, 1), rngs=rngs)

    class MLP(nnx.Module):
        """Two dense layers; input (batch, MLP_FEATURES) float32, output (batch, 10) logits."""

        def __init__(self, rngs: nnx.Rngs):
            self.dense1 = nnx.Linear(MLP_FEATURES, 64, rngs=rngs)
            self.dense2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.dense2(nnx.relu(self.dense1(x)))

    def update(model, optimizer, x, y, reduce_loss):
        """The train step both variants share; `reduce_loss` maps per-example losses to a scalar."""

        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return reduce_loss(per_example)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def make_mirrax(module_cls, x, y, global_batch):
        strategy = mirrax.MirroredStrategy(local[:devices])
        with strategy.scope():
            model = module_cls(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        iterator = iter(strategy.experimental_distribute_dataset((x, y)))
        batch = next(iterator)
        iterator.close()

        def train_step(model, optimizer, batch):
            images, labels = batch
            return update(
                model,
                optimizer,
                images,
                labels,
                lambda l: mirrax.compute_average_loss(l, global_batch_size=global_batch),
            )

        def step():
            return strategy.run(train_step, args=(model, optimizer, batch))

        def block(out):
            jax.block_until_ready((out, nnx.state((model, optimizer))))

        def loss_of(out):
            return float(strategy.reduce("sum", out))

        return step, block, loss_of

    def make_handwritten(module_cls, x, y, global_batch):
        mesh = jax.sharding.Mesh(np.array(local[:devices]), ("replica",))
        model = module_cls(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        leaves, state_def = jax.tree.flatten(state)
        replicated = NamedSharding(mesh, P())
        sharded = NamedSharding(mesh, P("replica"))
        holder = {"state": jax.device_put(leaves, replicated)}
        x_dev, y_dev = jax.device_put(x, sharded), jax.device_put(y, sharded)

        def per_replica(leaves, x, y):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))
            loss = update(model, optimizer, x, y, lambda l: l.sum() / global_batch)
            return jax.tree.leaves(nnx.state((model, optimizer))), loss[None]

        compiled = jax.jit(
            jax.shard_map(
                per_replica,
                mesh=mesh,
                in_specs=(P(), P("replica"), P("replica")),
                out_specs=(P(), P("replica")),
            ),
            donate_argnums=() if args.no_donate else 0,
        )

        def step():
            holder["state"], loss = compiled(holder["state"], x_dev, y_dev)
            return loss

        def block(out):
            jax.block_until_ready((out, holder["state"]))

        def loss_of(out):
            return float(out.sum())

        return step, block, loss_of

    def run_steps(step, block, steps):
        """Runs `steps` steps; returns the seconds spent inside the `step()` calls (host time)."""
        # At most `max_in_flight` steps are dispatched ahead of the one that finished: XLA:CPU
        # deadlocks in the all-reduce rendezvous when ~100 multi-device steps are queued.
        in_flight = collections.deque()
        host = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            out = step()
            host += time.perf_counter() - start
            in_flight.append(out)
            if len(in_flight) > args.max_in_flight:
                jax.block_until_ready(in_flight.popleft())
        block(in_flight[-1])
        return host

    def compare(name, module_cls, x_shape, global_batch, steps):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((global_batch,) + x_shape).astype(np.float32)
        y = rng.integers(0, 10, size=(global_batch,)).astype(np.int32)
        variants = {
            "mirrax": make_mirrax(module_cls, x, y, global_batch),
            "handwritten": make_handwritten(module_cls, x, y, global_batch),
        }
        first_loss, compile_s = {}, {}
        for key, (step, block, loss_of) in variants.items():
            start = time.perf_counter()
            out = step()
            block(out)
            compile_s[key] = time.perf_counter() - start
            first_loss[key] = loss_of(out)
            run_steps(step, block, max(2, steps // 4))
        per_step = {key: [] for key in variants}
        per_call = {key: [] for key in variants}
        for window in range(args.windows):
            order = list(variants) if window % 2 == 0 else list(reversed(variants))
            for key in order:
                step, block, _ = variants[key]
                start = time.perf_counter()
                host = run_steps(step, block, steps)
                per_step[key].append((time.perf_counter() - start) / steps)
                per_call[key].append(host / steps)
        # Both variants have now taken the same number of steps from the same weights: their
        # next losses must agree, or they are not the same training step.
        last_loss = {}
        for key, (step, block, loss_of) in variants.items():
            out = step()
            block(out)
            last_loss[key] = loss_of(out)
        median = {key: statistics.median(v) for key, v in per_step.items()}
        host = {key: statistics.median(v) for key, v in per_call.items()}
        row = {
            "workload": name,
            "devices": devices,
            "global_batch": global_batch,
            "steps_per_window": steps,
            "windows": args.windows,
            "max_in_flight": args.max_in_flight,
            "handwritten_donates": not args.no_donate,
            "mirrax_ms": median["mirrax"] * 1e3,
            "handwritten_ms": median["handwritten"] * 1e3,
            "ratio": median["mirrax"] / median["handwritten"],
            "overhead_us": (median["mirrax"] - median["handwritten"]) * 1e6,
            "mirrax_call_us": host["mirrax"] * 1e6,
            "handwritten_call_us": host["handwritten"] * 1e6,
            "mirrax_windows_ms": [t * 1e3 for t in per_step["mirrax"]],
            "handwritten_windows_ms": [t * 1e3 for t in per_step["handwritten"]],
            "first_compile_s": compile_s,
            "first_loss": first_loss,
            "last_loss": last_loss,
        }
        print(
            f"  [{devices} {args.platform}] {name}: mirrax {row['mirrax_ms']:.3f} ms/step, "
            f"hand-written {row['handwritten_ms']:.3f} ms/step, ratio {row['ratio']:.3f}, host "
            f"{row['mirrax_call_us']:.0f} / {row['handwritten_call_us']:.0f} us/call, "
            f"losses first {first_loss['mirrax']:.6f} / {first_loss['handwritten']:.6f}, "
            f"last {last_loss['mirrax']:.6f} / {last_loss['handwritten']:.6f}",
            file=sys.stderr,
            flush=True,
        )
        return row, variants

    rows = []
    if not args.skip_cnn:
        rows.append(compare("CNN", CNN, (28, 28, 1), CNN_GLOBAL_BATCH, args.cnn_steps)[0])
    mlp_row, mlp_variants = compare(
        "MLP", MLP, (MLP_FEATURES,), MLP_GLOBAL_BATCH, args.mlp_steps
    )
    rows.append(mlp_row)
    if args.profile:
        _profile(mlp_variants["mirrax"], run_steps, args.mlp_steps)
    return {"environment": _environment(jax, local[:devices]), "rows": rows}


def _profile(variant, run_steps, steps: int) -> None:
    import cProfile
    import io
    import pstats

    step, block, _ = variant
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(step, block, steps)
    profiler.disable()
    for sort in ("tottime", "cumulative"):
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(sort)
        stats.print_stats(30)
        print(f"\n### cProfile of {steps} mirrax MLP steps, sorted by {sort}\n", file=sys.stderr)
        print(text.getvalue(), file=sys.stderr, flush=True)


def _environment(jax, devices) -> dict:
    import flax
    import optax

    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "host_cpus": os.cpu_count(),
        "processor": _processor_name(),
    }


def _processor_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- several device counts, one subprocess each -------------------------------------------------


def _run_subprocess(args, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--devices",
            str(devices),
            "--platform",
            args.platform,
            "--windows",
            str(args.windows),
            "--cnn-steps",
            str(args.cnn_steps),
            "--mlp-steps",
            str(args.mlp_steps),
            "--max-in-flight",
            str(args.max_in_flight),
            "--json",
            path,
        ]
        if args.skip_cnn:
            command.append("--skip-cnn")
        if args.no_donate:
            command.append("--no-donate")
        if args.profile:
            command.append("--profile")
        # The child prints its own table on stdout; only its progress lines (stderr) show here.
        done = subprocess.run(command, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise SystemExit(
                f"overhead.py: the run with --devices {devices} failed (exit {done.returncode})."
            )
        with open(path) as f:
            return json.load(f)[0]


def _markdown(results: list) -> str:
    lines = [
        "| workload | replicas | global batch | mirrax ms/step | hand-written ms/step | ratio "
        "| overhead/step | mirrax host µs/call | hand-written host µs/call |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for row in result["rows"]:
            lines.append(
                f"| {row['workload']} | {row['devices']} | {row['global_batch']} "
                f"| {row['mirrax_ms']:.3f} | {row['handwritten_ms']:.3f} | {row['ratio']:.3f} "
                f"| {row['overhead_us']:.0f} µs | {row['mirrax_call_us']:.0f} "
                f"| {row['handwritten_call_us']:.0f} |"
            )
    env = results[0]["environment"]
    first = results[0]["rows"][0]
    lines.append("")
    lines.append(
        f"{env['platform']} ({env['device_kind']}), {env['host_cpus']} host CPUs "
        f"({env['processor']}); jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, "
        f"Python {env['python']}. Median of {first['windows']} interleaved windows, at most "
        f"{first['max_in_flight']} steps in flight; target ratio <= {TARGET_RATIO} (CNN). Host "
        "µs/call: time inside the step call (dispatch and Python), not waiting for the device."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    start = time.perf_counter()
    if len(args.device_counts) == 1:
        _configure_jax_environment(args.platform, args.device_counts[0])
        results = [_measure(args, args.device_counts[0])]
    else:
        results = [_run_subprocess(args, n) for n in args.device_counts]
    print(_markdown(results))
    if len(args.device_counts) > 1:
        print(f"(total {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
