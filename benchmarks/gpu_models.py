"""ResNet-50 and a transformer at bf16 on one GPU: mirrax vs a plain jax.jit step vs PyTorch, with MFU.

ResNet-50 (`models.ResNet50`, v1.5; batch 256 of 224x224x3, SGD momentum 0.9) and the 4-layer
transformer (`models.Transformer`, d_model 256; batch 64 at sequence 512, Adam) on one placed
random batch. Variants: mirrax (`strategy.run`, the `mixed_bfloat16` policy applied in the step as
`mirrax.Model` applies it), fit (`mirrax.Model.fit`, timed between its epoch callbacks;
transformer only unless --fit-resnet), jax.jit (one donated `jax.jit` step: the floor) and torch
(its own process, compiling while JAX does: `channels_last`, `autocast(bfloat16)`,
`torch.compile`, eager if that fails). After 3 warm-up steps, rotating rounds of one window each.
Columns: median ms/step, throughput, model TFLOP/s and MFU (analytic FLOPs, 3 x 2 x forward
multiply-adds x batch, against --peak-tflops), the ratio to jax.jit, windows x steps, compile + 3
steps. No model is built after --deadline s, PyTorch must be ready by --torch-timeout s (else
its rows are skipped); without a GPU (and without --smoke) it says it skipped and exits 0.

Usage (the GPU numbers come from `bash benchmarks/gpu.sh`):
  python -m benchmarks.gpu_models                    # on a GPU: both models, all variants, ~5 min
  python -m benchmarks.gpu_models --skip-torch --skip-resnet --json out.json
  python -m benchmarks.gpu_models --torch-python python3   # PyTorch from another interpreter
  python -m benchmarks.gpu_models --smoke            # CPU check: tiny shapes; measures nothing
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import sys
import time
import traceback

from benchmarks._harness import env, peer_models, timing, workers

# JAX is imported inside `main`, after the allocator setting there: JAX reads it once.

MODULE = "benchmarks.gpu_models"
PEAK_TFLOPS = 790.0
# As models.RESNET_STAGES, which the PyTorch process cannot import (models imports JAX).
RESNET_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))  # (bottlenecks, width); expansion 4
RESNET_CLASSES = 1000
BN_EPSILON, BN_MOMENTUM = 1e-5, 0.9  # as models.ResNet50; flax's momentum is 1 - torch's
LAYERS, D_MODEL, HEADS, MLP_WIDTH, VOCABULARY, CLASSES = 4, 256, 4, 1024, 1000, 10
LN_EPSILON = 1e-6
WARMUP_STEPS = 3
MODELS = ("transformer", "resnet50")  # the cheap compile first: the deadline falls on ResNet-50
TITLES = {"resnet50": "ResNet-50", "transformer": "Transformer 4x256"}
# --option: (type, default, --smoke default, what it sets)
SIZED = {
    "resnet-batch": (int, 256, 2, "ResNet-50's global batch"),
    "image-size": (int, 224, 64, "ResNet-50's image side"),
    "transformer-batch": (int, 64, 2, "the transformer's batch"),
    "sequence": (int, 512, 32, "the transformer's sequence length"),
    "window-seconds": (float, 0.5, 0.0, "target length of a window (0: one step)"),
    "variant-seconds": (float, 20.0, float("inf"), "a variant's windows stop after this many s"),
    "deadline": (float, 200.0, float("inf"), "no model is built after this many s from the start"),
    "torch-timeout": (
        float,
        330.0,
        1800.0,
        "PyTorch must be ready this many s after the start "
        "(after JAX is ready, with --torch-after-jax), else its rows are skipped",
    ),
}
FLAGS = {  # on/off options
    "smoke": "CPU check: batch 2, 64x64 images, sequence 32, 1 step per window",
    "skip-resnet": "no ResNet-50",
    "skip-transformer": "no transformer",
    "skip-torch": "no PyTorch rows",
    "skip-fit": "no Model.fit rows",
    "skip-mirrax": "no strategy.run rows",
    "fit-resnet": "also Model.fit on ResNet-50",
    "no-torch-compile": "PyTorch eager",
    "torch-after-jax": "PyTorch compiles only once JAX has (no overlap of their autotuning)",
    "torch-worker": argparse.SUPPRESS,  # this process is the PyTorch process
}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, what in FLAGS.items():
        parser.add_argument("--" + flag, action="store_true", help=what)
    for flag, (kind, full, smoke, what) in SIZED.items():
        limit = "no limit" if smoke == float("inf") else f"{smoke:g}"
        parser.add_argument("--" + flag, type=kind, help=f"{what} (default {full:g}; smoke {limit})")
    parser.add_argument("--torch-python", default=sys.executable, help="PyTorch's interpreter")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="bf16: mixed_bfloat16 / autocast(bfloat16); fp32: neither",
    )
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (5)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=PEAK_TFLOPS,
        help="dense bf16 peak of the device, TFLOP/s (default 790, H200)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    for flag, (_, full, smoke, _) in SIZED.items():
        if getattr(args, flag.replace("-", "_")) is None:
            setattr(args, flag.replace("-", "_"), smoke if args.smoke else full)
    args.models = [m for m in MODELS if not getattr(args, "skip_" + m.replace("50", ""))]
    return args


def shapes(args) -> dict:
    """{model: {"batch", "x_shape", "classes", "unit", "per_example"}}; per_example: tokens."""
    return {
        "resnet50": {
            "batch": args.resnet_batch,
            "x_shape": (args.image_size, args.image_size, 3),
            "classes": RESNET_CLASSES,
            "unit": "img/s",
            "per_example": 1,
        },
        "transformer": {
            "batch": args.transformer_batch,
            "x_shape": (args.sequence,),
            "classes": CLASSES,
            "unit": "tok/s",
            "per_example": args.sequence,
        },
    }


def make_data(model: str, spec: dict):
    """One batch as NumPy: x (batch, *x_shape), y (batch,) int32; the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (spec["batch"],) + tuple(spec["x_shape"])
    x = (
        rng.standard_normal(shape).astype(np.float32)
        if model == "resnet50"
        else rng.integers(0, VOCABULARY, size=shape).astype(np.int32)
    )
    return x, rng.integers(0, spec["classes"], size=(spec["batch"],)).astype(np.int32)


def resnet50_forward_macs(image_size: int) -> int:
    """Multiply-adds of one ResNet-50 forward pass on one image (convolutions and the dense head)."""

    def out(n, k, s, p):
        return (n + 2 * p - k) // s + 1

    side = out(image_size, 7, 2, 3)
    macs = side * side * 7 * 7 * 3 * 64
    side = out(side, 3, 2, 1)  # max pool
    channels = 64
    for index, (blocks, width) in enumerate(RESNET_STAGES):
        for block in range(blocks):
            stride = 2 if block == 0 and index > 0 else 1
            after = out(side, 3, stride, 1)
            macs += side * side * channels * width  # 1x1 reduce
            macs += after * after * 9 * width * width  # 3x3 (stride here, v1.5)
            macs += after * after * width * 4 * width  # 1x1 expand
            if block == 0:
                macs += after * after * channels * 4 * width  # projection shortcut
            side, channels = after, 4 * width
    return macs + channels * RESNET_CLASSES


def model_flops_per_step(model: str, spec: dict) -> float:
    """Training FLOPs per step: 3 (forward and backward) x 2 x forward multiply-adds x batch."""
    side = spec["x_shape"][0]
    if model == "resnet50":
        macs = resnet50_forward_macs(side)
    else:  # per token: the Q, K, V, output and MLP matmuls and the attention products; the head
        per_token = LAYERS * (4 * D_MODEL * D_MODEL + 2 * D_MODEL * MLP_WIDTH + 2 * side * D_MODEL)
        macs = side * per_token + D_MODEL * CLASSES
    return 3.0 * 2.0 * macs * spec["batch"]


def _timed(step, block, loss_of):
    """`run(n)`: `n` calls of `step()`, then `block(last output)`; -> (seconds, last loss)."""

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            out = step()
        block(out)
        return time.perf_counter() - start, loss_of(out)

    return run


def _warm_up(run, start: float) -> dict:
    """{"compile_s" (since `start`), "first_loss", "step_s"} of `run` after its first step and
    WARMUP_STEPS - 1 more; step_s (WARMUP_STEPS more) sets the steps per window."""
    first_loss = run(1)[1]
    run(WARMUP_STEPS - 1)
    return {
        "compile_s": time.perf_counter() - start,
        "first_loss": first_loss,
        "step_s": run(WARMUP_STEPS)[0] / WARMUP_STEPS,
    }


def _log_warm_up(model: str, variant: str, info: dict) -> None:
    env.log(
        f"  {TITLES[model]} / {variant}: compile + {WARMUP_STEPS} steps "
        f"{info['compile_s']:.1f} s, first loss {info['first_loss']:.6f}, "
        f"~{info['step_s'] * 1e3:.1f} ms/step"
    )


def build_nnx(model: str, spec: dict, rngs):
    """The Flax NNX module of `models`, as `torch_model` builds it in PyTorch."""
    from benchmarks._harness import models

    if model == "resnet50":
        return models.ResNet50(rngs, classes=RESNET_CLASSES)
    # exact_gelu=False: tanh GELU (nnx.gelu's default), as the PyTorch encoder's activation.
    return models.Transformer(
        rngs,
        layers=LAYERS,
        d_model=D_MODEL,
        heads=HEADS,
        mlp=MLP_WIDTH,
        sequence=spec["x_shape"][0],
        vocabulary=VOCABULARY,
        classes=CLASSES,
        epsilon=LN_EPSILON,
        exact_gelu=False,
    )


def _jax_variants(model, spec, args, device, compute_dtype) -> tuple:
    """({variant: {"run", "compile_s", "first_loss", "step_s"}}, jax.jit's info) of one model,
    each variant compiled and warmed up; `run(n)` -> (seconds, loss) of n steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import mirrax

    x, y = make_data(model, spec)

    def new_optimizer():
        return optax.sgd(0.1, momentum=0.9) if model == "resnet50" else optax.adam(1e-3)

    def new_state():
        module = build_nnx(model, spec, nnx.Rngs(0))
        return module, nnx.Optimizer(module, new_optimizer(), wrt=nnx.Param)

    def cast(a):
        return a.astype(compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    def update(module, optimizer, xb, yb, reduce):
        """One train step; the forward pass in `compute_dtype` as mirrax.Model applies a policy."""

        def loss_fn(module):
            inputs = xb
            if compute_dtype != "float32":
                graphdef, params, rest = nnx.split(module, nnx.Param, ...)
                module, inputs = nnx.merge(graphdef, jax.tree.map(cast, params), rest), cast(xb)
            logits = module(inputs).astype(jnp.float32)
            return reduce(optax.softmax_cross_entropy_with_integer_labels(logits, yb))

        loss, grads = nnx.value_and_grad(loss_fn)(module)
        optimizer.update(module, grads)
        return loss

    runs = {}
    if not args.skip_mirrax:
        strategy = mirrax.MirroredStrategy([device])
        with strategy.scope():
            module, optimizer = new_state()
        iterator = iter(strategy.experimental_distribute_dataset((x, y)))
        batch = next(iterator)
        iterator.close()

        def train_step(module, optimizer, batch):  # strategy.run runs the step as written
            return update(
                module,
                optimizer,
                *batch,
                lambda losses: mirrax.compute_average_loss(losses, global_batch_size=spec["batch"]),
            )

        runs["mirrax"] = _timed(
            lambda: strategy.run(train_step, args=(module, optimizer, batch)),
            lambda out: jax.block_until_ready((out, nnx.state((module, optimizer)))),
            lambda out: float(strategy.reduce("sum", out)),
        )
    if not args.skip_fit and (model == "transformer" or args.fit_resnet):
        with mirrax.MirroredStrategy([device]).scope():
            keras_model = mirrax.Model(build_nnx(model, spec, nnx.Rngs(0)))
            keras_model.compile(
                optimizer=new_optimizer(), loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
            )

        class EpochClock(mirrax.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.begin = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                jax.block_until_ready(nnx.state(self.model.module))
                self.seconds, self.loss = time.perf_counter() - self.begin, (logs or {}).get("loss")

        def fit(steps):  # one epoch of `steps` steps, its input pipeline included
            clock = EpochClock()
            keras_model.fit(
                np.concatenate([x] * steps),
                np.concatenate([y] * steps),
                batch_size=spec["batch"],
                epochs=1,
                verbose=0,
                shuffle=False,
                callbacks=[clock],
            )
            return clock.seconds, clock.loss

        runs["fit"] = fit

    module, optimizer = new_state()
    graphdef, state = nnx.split((module, optimizer))

    def jit_step(state, xb, yb):
        module, optimizer = nnx.merge(graphdef, state)
        loss = update(module, optimizer, xb, yb, lambda losses: losses.sum() / spec["batch"])
        return nnx.state((module, optimizer)), loss

    jitted = jax.jit(jit_step, donate_argnums=0)
    holder = {"state": jax.device_put(state, device)}
    x_dev, y_dev = jax.device_put(x, device), jax.device_put(y, device)
    try:  # a check beside the analytic FLOPs; MFU does not use it
        xla_flops = float(jax.jit(jit_step).lower(holder["state"], x_dev, y_dev).cost_analysis()["flops"])
    except Exception as error:  # noqa: BLE001
        env.log(f"  XLA cost analysis unavailable: {type(error).__name__}: {error}")
        xla_flops = float("nan")

    def step():
        holder["state"], loss = jitted(holder["state"], x_dev, y_dev)
        return loss

    runs["jax.jit"] = _timed(step, lambda out: jax.block_until_ready((out, holder["state"])), float)
    variants = {}
    for name, run in runs.items():
        variants[name] = dict(_warm_up(run, time.perf_counter()), run=run)
        _log_warm_up(model, name, variants[name])
    params = jax.tree.leaves(nnx.state(module, nnx.Param))
    return variants, {"xla_flops": xla_flops, "parameters": int(sum(np.size(p) for p in params))}


def _run_jax(args, results: dict, start: float, device, torch_worker) -> None:
    """Builds, compiles and times the JAX variants; fills `results["rows"]` per model."""
    import mirrax

    if args.precision == "bf16":
        mirrax.mixed_precision.set_global_policy("mixed_bfloat16")
    policy = mirrax.mixed_precision.global_policy()
    env.log(f"  JAX {device.platform} ({device.device_kind}); policy {policy.name}")
    specs, built = shapes(args), {}
    for model in args.models:
        if time.perf_counter() - start > args.deadline:
            results["notes"].append(f"{TITLES[model]}: not built (--deadline reached).")
            continue
        try:
            built[model] = _jax_variants(model, specs[model], args, device, policy.compute_dtype)
        except Exception as error:  # noqa: BLE001 - one model failing (out of memory, say)
            traceback.print_exc()  # must not cost the other model's rows
            results["notes"].append(
                f"{TITLES[model]}: JAX variants failed ({type(error).__name__}: {str(error)[:300]})."
            )
    torch_ready = torch_worker.wait_ready(args, start, results) if torch_worker else {}
    for model, (variants, info) in built.items():
        _measure(args, results, model, specs[model], variants, info, torch_ready.get(model), torch_worker)


def _measure(args, results, model, spec, variants, info, torch_info, torch_worker) -> None:
    """Rotating rounds of one window per variant of one model (a variant's windows stop after
    --variant-seconds, a failed torch window is left out); appends its rows and notes."""
    if torch_info and "error" not in torch_info:
        variants["torch"] = dict(torch_info, run=lambda n: torch_worker.window(model, n))
    elif torch_info:
        results["notes"].append(f"{TITLES[model]}: torch row skipped ({torch_info['error']}).")
    else:
        reason = "--skip-torch" if args.skip_torch else torch_worker.error or "not ready"
        if f"torch rows skipped ({reason})." not in results["notes"]:
            results["notes"].append(f"torch rows skipped ({reason}).")
    # Steps per window: about --window-seconds at the warm-up's pace, 2 to 500 (0 s: one step).
    steps = {
        name: 1
        if args.window_seconds <= 0
        else int(min(500, max(2, round(args.window_seconds / max(v["step_s"], 1e-6)))))
        for name, v in variants.items()
    }
    spent = dict.fromkeys(variants, 0.0)

    def window(name):  # seconds, or NaN once past --variant-seconds or when the window failed
        done = variants[name]["run"](steps[name]) if spent[name] <= args.variant_seconds else None
        spent[name] += done[0] if done else 0.0
        return done[0] if done else float("nan")

    samples = timing.interleave({name: functools.partial(window, name) for name in variants}, args.windows)
    flops = model_flops_per_step(model, spec)
    rows = []
    for name, seconds in samples.items():
        per = [s / steps[name] for s in seconds if s == s]
        median = statistics.median(per) if per else float("nan")
        rows.append(
            {
                "model": model,
                "variant": name,
                "batch": spec["batch"],
                "x_shape": list(spec["x_shape"]),
                "steps_per_window": steps[name],
                "windows": len(per),
                "window_ms": [p * 1e3 for p in per],
                "ms_per_step": median * 1e3,
                "throughput": spec["batch"] * spec["per_example"] / median,
                "unit": spec["unit"],
                "model_flops_per_step": flops,
                "tflops": flops / median / 1e12,
                "mfu": flops / median / (args.peak_tflops * 1e12),
                "compile_s": variants[name]["compile_s"],
                "first_loss": variants[name]["first_loss"],
                "xla_flops_per_step": info["xla_flops"],
                "parameters": info["parameters"],
                "torch_parameters": (torch_info or {}).get("parameters"),
            }
        )
    jit_ms = next(r["ms_per_step"] for r in rows if r["variant"] == "jax.jit")
    results["rows"] += [dict(row, vs_jit=row["ms_per_step"] / jit_ms) for row in rows]
    line = (
        f"{TITLES[model]}: model FLOPs {flops / spec['batch'] / 1e9:.2f} GFLOP per example per "
        f"step (analytic); XLA's count of the jax.jit train step "
        f"{info['xla_flops'] / spec['batch'] / 1e9:.2f} GFLOP; {info['parameters']:,} "
        "parameters (Flax)"
    )
    if torch_info and "parameters" in torch_info:
        line += f", {torch_info['parameters']:,} (PyTorch, {torch_info['impl']})"
    # Every JAX variant starts from the same weights: the same first loss means the same step.
    losses = ", ".join(
        f"{name} {v['first_loss']:.6f}" for name, v in variants.items() if v["first_loss"] is not None
    )
    caveat = " (torch: its own random initialization)" if "torch" in variants else ""
    results["notes"].append(f"{line}. First-step losses: {losses}{caveat}.")


# -- the PyTorch process --------------------------------------------------------------------------


def torch_model(model: str, spec: dict):
    """(module, "torchvision" | "torch.nn"): ResNet-50 or the transformer, as torch.nn.Module,
    the same networks as `build_nnx`'s."""
    import torch.nn.functional as F
    from torch import nn

    if model == "transformer":
        return peer_models.torch_model(
            "transformer",
            layers=LAYERS,
            d_model=D_MODEL,
            heads=HEADS,
            mlp=MLP_WIDTH,
            sequence=spec["x_shape"][0],
            vocabulary=VOCABULARY,
            classes=CLASSES,
            epsilon=LN_EPSILON,
            exact_gelu=False,
        ), "torch.nn"

    try:
        import torchvision

        return torchvision.models.resnet50(weights=None), "torchvision"
    except ImportError:
        pass

    def bn(features):
        return nn.BatchNorm2d(features, eps=BN_EPSILON, momentum=1 - BN_MOMENTUM)

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), bn(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, padding=1, bias=False)
            self.bn2 = bn(width)
            self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), bn(4 * width)
            self.project = None
            if stride != 1 or cin != 4 * width:
                self.project = nn.Sequential(nn.Conv2d(cin, 4 * width, 1, stride, bias=False), bn(4 * width))

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            h = F.relu(self.bn2(self.conv2(h)))
            h = self.bn3(self.conv3(h))
            return F.relu(h + (x if self.project is None else self.project(x)))

    layers, cin = (
        [nn.Conv2d(3, 64, 7, 2, padding=3, bias=False), bn(64), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1)],
        64,
    )
    for index, (count, width) in enumerate(RESNET_STAGES):
        for block in range(count):
            layers.append(Bottleneck(cin, width, 2 if block == 0 and index > 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, RESNET_CLASSES)]
    return nn.Sequential(*layers), "torch.nn"


def _torch_build(args):
    """`workers.serve`'s build: (ready reply, {model: run(n) -> (seconds, loss)}), every model
    warmed up; "fatal" when PyTorch cannot run, a model's "error" when that model failed."""
    try:
        import torch
    except ImportError as error:
        return {"fatal": f"PyTorch is not installed for {sys.executable} ({error})"}, None
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        return {"fatal": f"torch {torch.__version__} sees no CUDA device"}, None
    if args.torch_after_jax:
        line = sys.stdin.readline()  # the driver's go-ahead, once JAX has compiled
        if not line or json.loads(line).get("op") == "quit":
            os._exit(0)
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cudnn.benchmark = True
    ready = {
        "versions": {"torch": torch.__version__},
        "device": torch.cuda.get_device_name(0) if cuda else env.processor_name(),
    }

    def timed(forward, optimizer, x, y):
        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = torch.nn.functional.cross_entropy(forward(x), y)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return _timed(step, lambda out: torch.cuda.synchronize() if cuda else None, float)

    runs, specs = {}, shapes(args)
    for model in args.models:
        try:
            x, y = make_data(model, specs[model])
            module, impl = torch_model(model, specs[model])
            module = module.to(device)
            x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
            if model == "resnet50":
                module = module.to(memory_format=torch.channels_last)
                x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
                optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            else:
                optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
            start, note = time.perf_counter(), ""
            run = timed(module if args.no_torch_compile else torch.compile(module), optimizer, x, y)
            try:
                warm = _warm_up(run, start)
            except Exception as error:  # noqa: BLE001 - any compile failure: fall back to eager
                if args.no_torch_compile:
                    raise
                traceback.print_exc()
                message = str(error).splitlines()[0][:200] if str(error) else ""
                note = f"torch.compile failed ({type(error).__name__}: {message}); eager"
                run = timed(module, optimizer, x, y)
                warm = _warm_up(run, start)
            runs[model] = run
            ready[model] = dict(
                warm,
                impl=impl,
                note=note,
                parameters=sum(p.numel() for p in module.parameters()),
                compiled=not note and not args.no_torch_compile,
            )
        except Exception as error:  # noqa: BLE001 - report it, keep the other model
            traceback.print_exc()
            ready[model] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return ready, runs


def _torch_window(runs: dict, command: dict) -> dict:
    seconds, loss = runs[command["model"]](command["steps"])
    return {"seconds": seconds, "loss": loss}


class TorchWorker:
    """The driver's handle on the PyTorch process, started at once so that it compiles while
    JAX does; when it cannot run or fails, `error` says why and its rows are skipped."""

    def __init__(self, args, argv: list):
        self.worker, self.error, self.replies = None, None, queue.Queue()
        try:  # the same command line: the same shapes and options
            self.worker = workers.Worker(
                env.module_command(MODULE, *argv, "--torch-worker", python=args.torch_python),
                env=env.child_environment({"XLA_PYTHON_CLIENT_PREALLOCATE": None}),
                log=None,
                label="torch",
                replies=self.replies,
            )
        except OSError as error:
            self.error = f"cannot start {args.torch_python}: {error}"

    def _ask(self, command: dict | None, timeout: float) -> dict | None:
        """The reply to `command` (None: none sent); None, `error` set, once the process failed."""
        if self.error:
            return None
        try:
            if command is not None:
                self.worker.send(command)
            (reply,) = workers.receive([self.worker], self.replies, timeout)
            self.error = reply.get("fatal")
        except (OSError, workers.WorkerFailedError) as error:
            env.log(f"  the PyTorch process failed: {error}")
            lines = [line for line in str(error).splitlines() if line.strip(" .")]
            self.error = lines[-1].rstrip(".")[:300]
        if self.error:
            self.worker.close()
            return None
        return reply

    def wait_ready(self, args, start: float, results: dict) -> dict:
        """The ready reply ({} when PyTorch failed); notes its version, device and models."""
        timeout = args.torch_timeout - (0 if args.torch_after_jax else time.perf_counter() - start)
        ready = self._ask({"op": "start"} if args.torch_after_jax else None, max(1.0, timeout)) or {}
        if ready:
            results["versions"].update(ready["versions"])
            results["torch_device"] = ready["device"]
        for model in args.models:
            info = ready.get(model, {})
            if "impl" in info:
                how = "torch.compile" if info["compiled"] else "eager"
                _log_warm_up(model, f"torch ({info['impl']}, {how})", info)
                results["notes"].append(
                    f"{TITLES[model]}: torch ran the {info['impl']} model, "
                    f"{info['note'] or how}, on {ready['device']}."
                )
        return ready

    def window(self, model: str, steps: int):
        """(seconds, loss) of `steps` steps of `model`, or None when the process failed."""
        reply = self._ask({"op": "window", "model": model, "steps": steps}, 120.0 + 10 * steps)
        return (reply["seconds"], reply["loss"]) if reply else None

    def close(self, results: dict):
        if self.worker is not None:
            self.worker.close()
        if self.error and not any(self.error in note for note in results["notes"]):
            results["notes"].append(f"torch: {self.error}.")


def markdown(results: dict, args) -> str:
    rows = []
    for row in results["rows"]:
        shape = "x".join(str(d) for d in row["x_shape"])
        title = (
            f"{TITLES[row['model']]} {shape}"
            if row["model"] == "resnet50"
            else f"{TITLES[row['model']]}, seq {shape}"
        )
        if not row["windows"]:
            rows.append([title, row["variant"], row["batch"]] + ["-"] * 5 + [0, "-"])
            continue
        value, unit = row["throughput"], row["unit"]
        rows.append(
            [
                title,
                row["variant"],
                row["batch"],
                f"{row['ms_per_step']:.2f}",
                f"{value / 1e6:.2f}M {unit}" if value >= 1e6 else f"{value:,.0f} {unit}",
                f"{row['tflops']:.1f}",
                f"{row['mfu'] * 100:.1f}%",
                f"{row['vs_jit']:.3f}",
                f"{row['windows']} x {row['steps_per_window']}",
                f"{row['compile_s']:.0f} s",
            ]
        )
    header = [
        "model",
        "variant",
        "batch",
        "ms/step",
        "throughput",
        "model TFLOP/s",
        "MFU",
        "vs jax.jit",
        "windows",
        "compile + 3 steps",
    ]
    torch_version = results["versions"].get("torch")
    lines = env.markdown_table(header, rows, ["l", "l"] + ["r"] * 8) + [
        "",
        f"{env.environment_note(results['environment'])} Precision {args.precision}; "
        f"MFU against {args.peak_tflops:.0f} TFLOP/s"
        + (f"; torch {torch_version}." if torch_version else "."),
    ]
    lines += [f"- {note}" for note in results["notes"]]
    if args.smoke:
        lines.append("- --smoke: tiny shapes on whatever device there is; these numbers measure nothing.")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    env.check_json_path(args.json)
    if args.torch_worker:  # the PyTorch process: serve exits it
        workers.serve(lambda: _torch_build(args), _torch_window)
    start = time.perf_counter()
    # Both frameworks share the GPU: JAX allocates as it goes instead of taking 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    device = jax.local_devices()[0]
    machine = env.environment([device])
    results = {
        "command": " ".join(["python -m", MODULE, *argv]),
        "date": machine["date"],
        "smoke": args.smoke,
        "environment": machine,
        "device": f"{device.platform}: {device.device_kind}",
        "versions": {name: machine[name] for name in ("python", "jax", "flax", "optax")},
        "rows": [],
        "notes": [],
    }
    if jax.default_backend() != "gpu" and not args.smoke:
        message = (
            f"gpu_models: skipped: JAX's backend is {jax.default_backend()!r}, not 'gpu'. "
            "Run `bash benchmarks/gpu.sh` on a GPU machine, or pass --smoke for a quick "
            "CPU check of the script."
        )
        print(message)
        env.write_json(args.json, dict(results, skipped=message))
        return 0
    torch_worker = None if args.skip_torch else TorchWorker(args, argv)
    try:
        _run_jax(args, results, start, device, torch_worker)
    except Exception as error:  # noqa: BLE001 - print the rows measured so far
        traceback.print_exc()
        results["notes"].append(f"stopped early: {type(error).__name__}: {str(error)[:300]}")
    finally:
        if torch_worker is not None:
            torch_worker.close(results)
    results["seconds"] = time.perf_counter() - start
    table = markdown(results, args)
    print(table)
    env.write_json(args.json, dict(results, table=table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
