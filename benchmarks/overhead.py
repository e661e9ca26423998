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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# JAX is imported inside `_measure`, after `configure_jax_environment`: the device count and
# platform are read from the environment once, when JAX starts.

CNN_GLOBAL_BATCH = 128
MLP_GLOBAL_BATCH = 8
TARGET_RATIO = 1.05


def add_common_arguments(parser: argparse.ArgumentParser, steps_per: str) -> None:
    """The options every benchmark here takes: --devices, --platform, --cnn-steps and
    --mlp-steps (steps per `steps_per`), --max-in-flight, --skip-cnn, --json."""
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
    parser.add_argument("--cnn-steps", type=int, default=10, help=f"CNN steps per {steps_per}")
    parser.add_argument("--mlp-steps", type=int, default=300, help=f"MLP steps per {steps_per}")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=2,
        help="steps dispatched ahead of the last finished one (both variants alike; default 2)",
    )
    parser.add_argument("--skip-cnn", action="store_true", help="only the tiny MLP")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")


def parse_device_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets `args.device_counts` from --devices, or exits with the usage error."""
    try:
        args.device_counts = [int(n) for n in args.devices.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--devices must be comma-separated integers like 1,4; got {args.devices!r}")
    if not args.device_counts or min(args.device_counts) < 1:
        parser.error(f"--devices needs at least one count >= 1; got {args.devices!r}")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-step overhead of mirrax's strategy.run vs a hand-written "
        "jax.jit(jax.shard_map(...)) train step."
    )
    add_common_arguments(parser, steps_per="timed window")
    parser.add_argument("--windows", type=int, default=9, help="timed windows per variant")
    parser.add_argument(
        "--no-donate",
        action="store_true",
        help="compile the hand-written step without donate_argnums (mirrax donates)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, cProfile --mlp-steps calls of the mirrax MLP step and print the top "
        "functions",
    )
    args = parser.parse_args(argv)
    parse_device_counts(parser, args)
    check_divides(parser, args, {"CNN": CNN_GLOBAL_BATCH, "MLP": MLP_GLOBAL_BATCH})
    if min(args.windows, args.cnn_steps, args.mlp_steps, args.max_in_flight) < 1:
        parser.error("--windows, --cnn-steps, --mlp-steps and --max-in-flight must be >= 1")
    return args


def configure_jax_environment(platform_name: str, devices: int) -> None:
    """Asks JAX for `devices` fake CPU devices (cpu only); call it before JAX is imported."""
    if platform_name == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
        ).strip()


def local_devices(platform_name: str, devices: int, script: str) -> list:
    """The first `devices` local JAX devices, or exit naming what is missing and the fix."""
    import jax

    local = jax.local_devices()
    if local[0].platform != platform_name:
        raise SystemExit(
            f"{script}: asked for --platform {platform_name} but JAX's devices are "
            f"{local[0].platform} ({local[0].device_kind}). Install the matching jax extra "
            "(e.g. jax[cuda12]) or pass --platform cpu."
        )
    if len(local) < devices:
        raise SystemExit(
            f"{script}: asked for {devices} devices but this process has {len(local)} "
            f"{platform_name} device(s)."
        )
    return local[:devices]


# -- one device count, in this process ---------------------------------------------------------


def _measure(args, devices: int) -> dict:
    import jax
    from flax import nnx

    import workloads

    local = local_devices(args.platform, devices, "overhead.py")

    def make_mirrax(module_cls, x, y, global_batch):
        strategy, model, optimizer, batch = workloads.mirrax_state(local, module_cls, x, y)

        train_step = workloads.strategy_run_step(global_batch)

        def step():
            return strategy.run(train_step, args=(model, optimizer, batch))

        def block(out):
            jax.block_until_ready((out, nnx.state((model, optimizer))))

        def loss_of(out):
            return float(strategy.reduce("sum", out))

        return step, block, loss_of

    def run_steps(step, block, steps):
        return workloads.run_steps(step, block, steps, args.max_in_flight)

    def compare(name, module_cls, x_shape, global_batch, steps):
        x, y = workloads.random_batch(x_shape, global_batch)
        variants = {
            "mirrax": make_mirrax(module_cls, x, y, global_batch),
            "handwritten": workloads.make_handwritten(
                module_cls, x, y, global_batch, local, donate=not args.no_donate
            ),
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
        rows.append(
            compare("CNN", workloads.CNN, (28, 28, 1), CNN_GLOBAL_BATCH, args.cnn_steps)[0]
        )
    mlp_row, mlp_variants = compare(
        "MLP", workloads.MLP, (workloads.MLP_FEATURES,), MLP_GLOBAL_BATCH, args.mlp_steps
    )
    rows.append(mlp_row)
    if args.profile:
        _profile(mlp_variants["mirrax"], run_steps, args.mlp_steps)
    return {"environment": environment(jax, local), "rows": rows}


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


def environment(jax, devices) -> dict:
    """Versions, platform and host CPU of this run, for the note under a results table."""
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


def forward_arguments(args, options, flags) -> list:
    """The command line that passes `options` (valued) and `flags` (on/off) of `args` on."""
    argv = []
    for name in options:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv + ["--" + name.replace("_", "-") for name in flags if getattr(args, name)]


def _child_argv(args) -> list:
    return forward_arguments(
        args,
        ("platform", "windows", "cnn_steps", "mlp_steps", "max_in_flight"),
        ("skip_cnn", "no_donate", "profile"),
    )


def _run_subprocess(script: str, child_argv: list, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            os.path.abspath(script),
            "--devices",
            str(devices),
            *child_argv,
            "--json",
            path,
        ]
        # The child prints its own table on stdout; only its progress lines (stderr) show here.
        done = subprocess.run(command, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            raise SystemExit(
                f"{os.path.basename(script)}: the run with --devices {devices} failed "
                f"(exit {done.returncode})."
            )
        with open(path) as f:
            return json.load(f)[0]


def run_benchmark(args, measure, markdown, child_argv: list, script: str) -> int:
    """Measures every count in `args.device_counts`, prints the table, writes --json.

    One count runs here (`measure(args, devices)` after `configure_jax_environment`); several
    run one fresh subprocess each (`script --devices N *child_argv --json tmp`), because the
    fake CPU device count is fixed when JAX starts. `markdown(results)` makes the table.
    """
    check_json_path(args.json)
    start = time.perf_counter()
    if len(args.device_counts) == 1:
        configure_jax_environment(args.platform, args.device_counts[0])
        results = [measure(args, args.device_counts[0])]
    else:
        results = [_run_subprocess(script, child_argv, n) for n in args.device_counts]
    print(markdown(results))
    if len(args.device_counts) > 1:
        print(f"(total {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def check_json_path(path) -> None:
    """Exits before any measuring when --json names a file in a folder that does not exist."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder and not os.path.isdir(folder):
        raise SystemExit(
            f"--json {path}: the folder {folder} does not exist; create it or give another path."
        )


def check_divides(parser, args, global_batches: dict) -> None:
    """Usage error unless every --devices count divides each workload's global batch."""
    for name, batch in global_batches.items():
        bad = [n for n in args.device_counts if batch % n]
        if bad:
            fits = [n for n in range(1, 9) if batch % n == 0]
            parser.error(
                f"--devices {args.devices}: the {name + ' ' if name else ''}global batch of {batch} does not split "
                f"evenly over {bad} replicas; use counts that divide it, e.g. {fits}"
            )


def environment_note(env: dict) -> str:
    """The machine and versions of `environment(...)`, as the first words under a table."""
    return (
        f"{env['platform']} ({env['device_kind']}), {env['host_cpus']} host CPUs "
        f"({env['processor']}); jax {env['jax']}, flax {env['flax']}, optax {env['optax']}, "
        f"Python {env['python']}."
    )


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
        f"{environment_note(env)} Median of {first['windows']} interleaved windows, at most "
        f"{first['max_in_flight']} steps in flight; target ratio <= {TARGET_RATIO} (CNN). Host "
        "µs/call: time inside the step call (dispatch and Python), not waiting for the device."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    return run_benchmark(args, _measure, _markdown, _child_argv(args), __file__)


if __name__ == "__main__":
    sys.exit(main())
