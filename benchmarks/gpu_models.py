"""ResNet-50 and a transformer at bf16 on one GPU: mirrax vs a plain jax.jit step vs PyTorch, with MFU.

Two models, each built the same way in Flax NNX and in PyTorch (parameter counts are printed
and must agree):

- ResNet-50 (v1.5, as torchvision's `resnet50`: stride 2 in the 3x3 convolution of a
  bottleneck, BatchNorm epsilon 1e-5 and momentum 0.1, no convolution biases, 1000 classes;
  25,557,032 parameters), NHWC float32 images 224x224x3 in JAX, channels-last NCHW in PyTorch.
  Global batch 256, SGD with momentum 0.9 (lr 0.1).
- Transformer: the 4-layer pre-LayerNorm encoder of `benchmarks/communication.py` (d_model 256,
  4 heads, MLP 1024 with tanh GELU, learned positions, vocabulary 1000, mean pooling, 10
  classes; LayerNorm epsilon 1e-6) at sequence length 512, batch 64. Adam (lr 1e-3).

Variants, on the same random batch (placed on the device once; no input pipeline except for
`fit`), softmax cross-entropy on the logits:

- mirrax: `mirrax.mixed_precision.set_global_policy("mixed_bfloat16")`, a
  `mirrax.MirroredStrategy` over the one GPU, model and optimizer built under
  `strategy.scope()`, the batch from `strategy.experimental_distribute_dataset`, and
  `strategy.run(train_step, args=(model, optimizer, batch))`. The policy is applied the way
  `mirrax.Model` applies it (`strategy.run` takes the step as written): the step reads
  `mirrax.mixed_precision.global_policy().compute_dtype`, casts the float32 parameters and the
  images to bfloat16 for the forward pass, and computes the loss in float32. Variables (and
  BatchNorm statistics) stay float32.
- fit: `mirrax.Model(module).compile(...)` under the same policy and strategy, `fit` on NumPy
  arrays (`steps` copies of the batch, `shuffle=False`), timed from `on_epoch_begin` to
  `on_epoch_end` (which waits for the weights): it includes fit's own input pipeline (host to
  device copies of every batch). By default on the transformer only (`--fit-resnet` adds it to
  ResNet-50: one more XLA compile of ResNet-50, and 154 MB of images copied per step).
- jax.jit: `nnx.split((model, optimizer))` once, then one `jax.jit(step, donate_argnums=0)`
  call per step on the state pytree: the same bf16 cast, float32 parameters. The floor.
- torch: PyTorch, in a separate process (its own CUDA context and allocator; JAX's and
  PyTorch's CUDA libraries never share a process): `torchvision.models.resnet50()` when
  torchvision is importable, else the same network written with `torch.nn` layers (the table's
  notes say which); `channels_last` model and images; `torch.autocast(bfloat16)`;
  `torch.compile(model)` (default mode; when compiling fails, eager, and the notes say so);
  `torch.backends.cudnn.benchmark = True`; `torch.optim.SGD` / `Adam` (default implementation);
  the usual loop: `zero_grad`, forward, loss, `backward`, `step`.

Timing: every variant compiles and takes 3 warm-up steps (the PyTorch process compiles while
JAX compiles, to fit the time budget; both compilers time candidate kernels on the GPU, so each
may see the other's work while autotuning: `--torch-after-jax` runs them one after the other),
then its steps per window are set so that a window lasts about `--window-seconds`. Then rounds: in each round every variant of a model runs one window, in an
order that rotates every round (A B C D, B C D A, ...); a window dispatches its steps and waits
for the last one's outputs and the whole state (`jax.block_until_ready`,
`torch.cuda.synchronize`). Reported: the median ms/step over the windows (>= 5 unless a time
limit cut them short: the "windows" column says how many ran), throughput, and the ratio to
jax.jit. Limits, so that one run stays bounded: no model is built (compiled) after
`--deadline` seconds from the start of the script; PyTorch must be ready by `--torch-timeout`
seconds from the start, or its rows are skipped; each variant's timed windows stop after
`--variant-seconds`.

Model FLOPs (for MFU): analytic, 3 x the forward pass's multiply-adds x 2 (convolutions and
dense layers; for the transformer also the attention products QK^T and AV), the usual "model
FLOPs" (no recomputation, no elementwise work, the same count for every variant). ResNet-50's
forward is 4.09 G multiply-adds (the "4.1 GFLOPs" usually quoted) = 8.18 GFLOP per 224x224
image, so a training step counts 24.5 GFLOP per image. As a check, XLA's own count
(`jax.jit(step).lower(...).cost_analysis()["flops"]`, the whole jax.jit train step before
optimisation, elementwise work and optimizer included; it leaves out a convolution's
multiplications by its zero padding, so for ResNet-50 it is lower: 3.99 G multiply-adds forward
at 224x224) is printed next to it. MFU = model
FLOPs per second / `--peak-tflops` (default 790e12, the H200's dense bf16 peak).

Usage (the GPU numbers come from `bash benchmarks/gpu.sh`):
  python benchmarks/gpu_models.py                    # on a GPU: both models, all variants, ~5 min
  python benchmarks/gpu_models.py --skip-torch --skip-resnet --json out.json
  python benchmarks/gpu_models.py --torch-python python3   # PyTorch from another interpreter
  python benchmarks/gpu_models.py --smoke            # CPU check: tiny shapes, a few steps

Without a GPU (and without --smoke) it prints that it skipped and exits 0, so
`python -m benchmarks run` passes over it on CPU machines. Without PyTorch the torch rows are
skipped with a message. The --smoke numbers are not measurements of anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback

import overhead  # JAX-free: the shared --json check

# JAX is imported inside `_run_jax`, after the allocator setting below: JAX reads it once.

PEAK_TFLOPS = 790.0
RESNET_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))  # (bottlenecks, width); expansion 4
RESNET_CLASSES = 1000
BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9  # flax's convention (running = m * running + (1 - m) * batch); torch's 0.1
LAYERS, D_MODEL, HEADS, MLP_WIDTH, VOCABULARY, CLASSES = 4, 256, 4, 1024, 1000, 10
LN_EPSILON = 1e-6
WARMUP_STEPS = 3
REPLY = "@@gpu_models "  # prefix of the PyTorch worker's protocol lines on its stdout
MODELS = ("transformer", "resnet50")  # the cheap compile first: the deadline falls on ResNet-50
TITLES = {"resnet50": "ResNet-50", "transformer": "Transformer 4x256"}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: batch 2, 64x64 images, sequence 32, 1 step per window")
    parser.add_argument("--resnet-batch", type=int, help="global batch (default 256; smoke 2)")
    parser.add_argument("--image-size", type=int, help="image side (default 224; smoke 64)")
    parser.add_argument("--transformer-batch", type=int, help="batch (default 64; smoke 2)")
    parser.add_argument("--sequence", type=int, help="sequence length (default 512; smoke 32)")
    parser.add_argument("--skip-resnet", action="store_true", help="no ResNet-50")
    parser.add_argument("--skip-transformer", action="store_true", help="no transformer")
    parser.add_argument("--skip-torch", action="store_true", help="no PyTorch rows")
    parser.add_argument("--skip-fit", action="store_true", help="no mirrax.Model.fit rows")
    parser.add_argument("--skip-mirrax", action="store_true", help="no strategy.run rows")
    parser.add_argument("--fit-resnet", action="store_true",
                        help="also Model.fit on ResNet-50 (one more ResNet-50 compile)")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="PyTorch eager (no torch.compile)")
    parser.add_argument("--torch-after-jax", action="store_true",
                        help="PyTorch builds and compiles only once JAX has compiled (no overlap "
                        "of the two compilers' GPU autotuning; slower)")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="interpreter of the PyTorch process (default: this one)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="bf16: mixed_bfloat16 / autocast(bfloat16) (default); fp32: neither")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (5)")
    parser.add_argument("--window-seconds", type=float, default=0.5,
                        help="target length of a window (default 0.5; smoke 0: 1 step)")
    parser.add_argument("--variant-seconds", type=float,
                        help="timed windows of a variant stop after this many seconds "
                        "(20; smoke: no limit)")
    parser.add_argument("--deadline", type=float,
                        help="no model is built after this many seconds from the start "
                        "(200; smoke: no limit)")
    parser.add_argument("--torch-timeout", type=float,
                        help="PyTorch must have built and compiled this many seconds after the "
                        "start (after JAX is ready, with --torch-after-jax), else its rows are "
                        "skipped (330; smoke: 1800)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                        help="dense bf16 peak of the device, TFLOP/s (default 790, H200)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--torch-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    small = args.smoke
    args.resnet_batch = args.resnet_batch or (2 if small else 256)
    args.image_size = args.image_size or (64 if small else 224)
    args.transformer_batch = args.transformer_batch or (2 if small else 64)
    args.sequence = args.sequence or (32 if small else 512)
    if small and "--window-seconds" not in (argv if argv is not None else sys.argv):
        args.window_seconds = 0.0
    unlimited = float("inf")
    if args.variant_seconds is None:
        args.variant_seconds = unlimited if small else 20.0
    if args.deadline is None:
        args.deadline = unlimited if small else 200.0
    if args.torch_timeout is None:
        args.torch_timeout = 1800.0 if small else 330.0
    args.models = [m for m in MODELS if not getattr(args, "skip_" + m.replace("50", ""))]
    return args


# -- shapes, data and model FLOPs (no framework) --------------------------------------------------


def shapes(args) -> dict:
    """{model: {"batch", "x_shape", "x_dtype", "unit", "per_example"}}; per_example: tokens."""
    return {
        "resnet50": {"batch": args.resnet_batch, "x_shape": (args.image_size, args.image_size, 3),
                     "x_dtype": "float32", "classes": RESNET_CLASSES, "unit": "img/s",
                     "per_example": 1},
        "transformer": {"batch": args.transformer_batch, "x_shape": (args.sequence,),
                        "x_dtype": "int32", "classes": CLASSES, "unit": "tok/s",
                        "per_example": args.sequence},
    }


def make_data(model: str, spec: dict):
    """One batch as NumPy: x (batch, *x_shape), y (batch,) int32; the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (spec["batch"],) + spec["x_shape"]
    if model == "resnet50":
        x = rng.standard_normal(shape).astype(np.float32)
    else:
        x = rng.integers(0, VOCABULARY, size=shape).astype(np.int32)
    y = rng.integers(0, spec["classes"], size=(spec["batch"],)).astype(np.int32)
    return x, y


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
            macs += side * side * channels * width               # 1x1 reduce
            macs += after * after * 9 * width * width            # 3x3 (stride here, v1.5)
            macs += after * after * width * 4 * width            # 1x1 expand
            if block == 0:
                macs += after * after * channels * 4 * width     # projection shortcut
            side, channels = after, 4 * width
    return macs + channels * RESNET_CLASSES


def transformer_forward_macs(sequence: int) -> int:
    """Multiply-adds of one transformer forward pass on one sequence (matmuls, attention, head)."""
    per_token = LAYERS * (4 * D_MODEL * D_MODEL + 2 * D_MODEL * MLP_WIDTH + 2 * sequence * D_MODEL)
    return sequence * per_token + D_MODEL * CLASSES


def model_flops_per_step(model: str, spec: dict) -> float:
    """Training FLOPs per step: 3 x forward multiply-adds x 2 x batch."""
    if model == "resnet50":
        macs = resnet50_forward_macs(spec["x_shape"][0])
    else:
        macs = transformer_forward_macs(spec["x_shape"][0])
    return 3.0 * 2.0 * macs * spec["batch"]


def _steps_for(seconds_per_step: float, target: float) -> int:
    if target <= 0:
        return 1
    return int(min(500, max(2, round(target / max(seconds_per_step, 1e-6)))))


# -- the models in Flax NNX ---------------------------------------------------------------------


def nnx_model(model: str, rngs):
    """The Flax NNX module: ResNet-50 (NHWC images -> 1000 logits) or the transformer."""
    import jax.numpy as jnp
    from flax import nnx

    def bn(features, scale_init=None):
        kwargs = {"scale_init": scale_init} if scale_init else {}
        return nnx.BatchNorm(features, epsilon=BN_EPSILON, momentum=BN_MOMENTUM, rngs=rngs,
                             **kwargs)

    def conv(cin, cout, k, stride=1):
        pad = (k - 1) // 2
        return nnx.Conv(cin, cout, (k, k), strides=(stride, stride),
                        padding=((pad, pad), (pad, pad)), use_bias=False, rngs=rngs)

    class Bottleneck(nnx.Module):
        def __init__(self, cin, width, stride):
            self.conv1, self.bn1 = conv(cin, width, 1), bn(width)
            self.conv2, self.bn2 = conv(width, width, 3, stride), bn(width)
            self.conv3, self.bn3 = conv(width, 4 * width, 1), bn(4 * width)
            needed = stride != 1 or cin != 4 * width
            self.project = (nnx.Sequential(conv(cin, 4 * width, 1, stride), bn(4 * width))
                            if needed else None)

        def __call__(self, x):
            h = nnx.relu(self.bn1(self.conv1(x)))
            h = nnx.relu(self.bn2(self.conv2(h)))
            h = self.bn3(self.conv3(h))
            return nnx.relu(h + (x if self.project is None else self.project(x)))

    class ResNet50(nnx.Module):
        def __init__(self):
            self.stem, self.stem_bn = conv(3, 64, 7, 2), bn(64)
            blocks, cin = [], 64
            for index, (count, width) in enumerate(RESNET_STAGES):
                for block in range(count):
                    blocks.append(Bottleneck(cin, width, 2 if block == 0 and index > 0 else 1))
                    cin = 4 * width
            self.blocks = nnx.List(blocks)
            self.head = nnx.Linear(cin, RESNET_CLASSES, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.stem_bn(self.stem(x)))
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=(1, 2)))

    class Block(nnx.Module):
        def __init__(self):
            self.norm1 = nnx.LayerNorm(D_MODEL, epsilon=LN_EPSILON, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=HEADS, in_features=D_MODEL, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(D_MODEL, epsilon=LN_EPSILON, rngs=rngs)
            self.mlp_in = nnx.Linear(D_MODEL, MLP_WIDTH, rngs=rngs)
            self.mlp_out = nnx.Linear(MLP_WIDTH, D_MODEL, rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))

    class Encoder(nnx.Module):
        def __init__(self, sequence):
            self.tokens = nnx.Embed(VOCABULARY, D_MODEL, rngs=rngs)
            self.positions = nnx.Embed(sequence, D_MODEL, rngs=rngs)
            self.blocks = nnx.List([Block() for _ in range(LAYERS)])
            self.norm = nnx.LayerNorm(D_MODEL, epsilon=LN_EPSILON, rngs=rngs)
            self.head = nnx.Linear(D_MODEL, CLASSES, rngs=rngs)

        def __call__(self, tokens):
            x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x).mean(axis=1))

    if model == "resnet50":
        return ResNet50()
    return lambda sequence: Encoder(sequence)


def build_nnx(model: str, spec: dict, rngs):
    made = nnx_model(model, rngs)
    return made(spec["x_shape"][0]) if model == "transformer" else made


def nnx_optimizer(model: str):
    import optax

    return optax.sgd(0.1, momentum=0.9) if model == "resnet50" else optax.adam(1e-3)


# -- the JAX variants, in this process ----------------------------------------------------------


def _forward(module, x, compute_dtype):
    """Logits in float32 from `module` run in `compute_dtype`, as mirrax.Model applies a policy."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if compute_dtype == jnp.float32:
        return module(x)

    def cast(a):
        return a.astype(compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    view = nnx.merge(graphdef, jax.tree.map(cast, params), rest)
    return view(cast(x)).astype(jnp.float32)


def _make_variants(model, spec, args, device, compute_dtype) -> dict:
    """{variant: (step, block, loss_of)}: `step()` runs one train step, `block(out)` waits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import mirrax

    x, y = make_data(model, spec)
    global_batch = spec["batch"]
    variants = {}

    if not args.skip_mirrax:
        strategy = mirrax.MirroredStrategy([device])
        with strategy.scope():
            module = build_nnx(model, spec, nnx.Rngs(0))
            optimizer = nnx.Optimizer(module, nnx_optimizer(model), wrt=nnx.Param)
        iterator = iter(strategy.experimental_distribute_dataset((x, y)))
        batch = next(iterator)
        iterator.close()
        # What mirrax.Model does with the policy, written in the step (strategy.run runs the
        # step as written): parameters and images in the compute dtype, the loss in float32.
        dtype = jnp.dtype(mirrax.mixed_precision.global_policy().compute_dtype)

        def train_step(module, optimizer, batch):
            def loss_fn(m):
                per_example = optax.softmax_cross_entropy_with_integer_labels(
                    _forward(m, batch[0], dtype), batch[1])
                return mirrax.compute_average_loss(per_example, global_batch_size=global_batch)

            loss, grads = nnx.value_and_grad(loss_fn)(module)
            optimizer.update(module, grads)
            return loss

        state = (module, optimizer)
        variants["mirrax"] = (
            lambda state=state: strategy.run(train_step, args=state + (batch,)),
            lambda out, state=state: jax.block_until_ready((out, nnx.state(state))),
            lambda out: float(strategy.reduce("sum", out)),
        )

    if not args.skip_fit and (model == "transformer" or args.fit_resnet):
        variants["fit"] = _make_fit(model, spec, device, x, y)

    module = build_nnx(model, spec, nnx.Rngs(0))
    optimizer = nnx.Optimizer(module, nnx_optimizer(model), wrt=nnx.Param)
    graphdef, state = nnx.split((module, optimizer))

    def jit_step(state, xb, yb):
        module, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits = _forward(m, xb, compute_dtype)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum() / global_batch

        loss, grads = nnx.value_and_grad(loss_fn)(module)
        optimizer.update(module, grads)
        return nnx.state((module, optimizer)), loss

    jitted = jax.jit(jit_step, donate_argnums=0)
    holder = {"state": jax.device_put(state, device)}
    x_dev, y_dev = jax.device_put(x, device), jax.device_put(y, device)
    try:
        xla = jax.jit(jit_step).lower(holder["state"], x_dev, y_dev).cost_analysis()
        xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    except Exception as error:  # noqa: BLE001 - the check is optional; MFU does not use it
        _log(f"XLA cost analysis unavailable: {type(error).__name__}: {error}")
        xla = None

    def step():
        holder["state"], loss = jitted(holder["state"], x_dev, y_dev)
        return loss

    variants["jax.jit"] = (
        step,
        lambda out: jax.block_until_ready((out, holder["state"])),
        lambda out: float(out),
    )
    parameters = int(sum(np.size(p) for p in jax.tree.leaves(nnx.state(module, nnx.Param))))
    variants["_info"] = {"xla_flops": float((xla or {}).get("flops", float("nan"))),
                         "parameters": parameters}
    return variants


def _make_fit(model, spec, device, x, y):
    """The fit variant: (step, block, loss_of) where `step(steps)` is one fit epoch of `steps`."""
    import jax
    import numpy as np
    from flax import nnx

    import mirrax

    strategy = mirrax.MirroredStrategy([device])
    with strategy.scope():
        keras_model = mirrax.Model(build_nnx(model, spec, nnx.Rngs(0)))
        keras_model.compile(optimizer=nnx_optimizer(model),
                            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))

    class EpochClock(mirrax.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            jax.block_until_ready(nnx.state(self.model.module))
            self.seconds = time.perf_counter() - self.begin
            self.loss = logs.get("loss") if logs else None

    tiled = {}

    def fit_epoch(steps):
        if steps not in tiled:
            tiled.clear()
            tiled[steps] = (np.concatenate([x] * steps), np.concatenate([y] * steps))
        clock = EpochClock()
        keras_model.fit(*tiled[steps], batch_size=spec["batch"], epochs=1, verbose=0,
                        shuffle=False, callbacks=[clock])
        return clock

    return ("fit", fit_epoch)


def _run_jax(args, results: dict, start: float, torch_worker) -> None:
    """Builds, compiles and times the JAX variants; fills `results["rows"]` per model."""
    import jax
    import jax.numpy as jnp
    import flax
    import optax

    import mirrax

    backend = jax.default_backend()
    device = jax.local_devices()[0]
    results["device"] = f"{device.platform}: {device.device_kind}"
    results["versions"].update(jax=jax.__version__, flax=flax.__version__,
                               optax=optax.__version__)
    if args.precision == "bf16":
        mirrax.mixed_precision.set_global_policy("mixed_bfloat16")
    compute_dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    _log(f"JAX {backend} ({device.device_kind}); policy "
         f"{mirrax.mixed_precision.global_policy().name}")

    specs = shapes(args)
    built = {}
    for model in args.models:
        if time.perf_counter() - start > args.deadline:
            results["notes"].append(f"{TITLES[model]}: not built (--deadline reached).")
            continue
        try:
            built[model] = _build(model, specs[model], args, device, compute_dtype)
        except Exception as error:  # noqa: BLE001 - one model failing (out of memory, say)
            traceback.print_exc()   # must not cost the other model's rows
            results["notes"].append(f"{TITLES[model]}: JAX variants failed "
                                    f"({type(error).__name__}: {str(error)[:300]}).")
    torch_ready = torch_worker.wait_ready(args, start) if torch_worker else None
    _measure(args, results, built, torch_ready, torch_worker)


def _build(model, spec, args, device, compute_dtype) -> tuple:
    """One model's JAX variants, each compiled and warmed up.

    Returns (variants, info, compile_s, first_loss, per_step): per_step is the rough seconds per
    step from the warm-up, which sets the steps per window.
    """
    t0 = time.perf_counter()
    variants = _make_variants(model, spec, args, device, compute_dtype)
    info = variants.pop("_info")
    info["build_s"] = time.perf_counter() - t0
    compile_s, first_loss, per_step = {}, {}, {}
    for name, variant in variants.items():
        t0 = time.perf_counter()
        if variant[0] == "fit":
            clock = variant[1](WARMUP_STEPS)
            first_loss[name] = clock.loss
            compile_s[name] = time.perf_counter() - t0
            clock = variant[1](WARMUP_STEPS)
            per_step[name] = clock.seconds / WARMUP_STEPS
        else:
            step, block, loss_of = variant
            out = step()
            block(out)
            first_loss[name] = loss_of(out)
            for _ in range(WARMUP_STEPS - 1):
                out = step()
            block(out)
            compile_s[name] = time.perf_counter() - t0
            t1 = time.perf_counter()
            for _ in range(WARMUP_STEPS):
                out = step()
            block(out)
            per_step[name] = (time.perf_counter() - t1) / WARMUP_STEPS
        _log(f"{TITLES[model]} / {name}: compile + {WARMUP_STEPS} steps "
             f"{compile_s[name]:.1f} s, first loss {first_loss[name]}, "
             f"~{per_step[name] * 1e3:.1f} ms/step")
    return variants, info, compile_s, first_loss, per_step


def _measure(args, results: dict, built: dict, torch_ready, torch_worker) -> None:
    """Interleaved windows of every built model's variants; appends rows and notes."""
    specs = shapes(args)
    for model, (variants, info, compile_s, first_loss, per_step) in built.items():
        spec = specs[model]
        runners = {}
        for name, variant in variants.items():
            steps = _steps_for(per_step[name], args.window_seconds)
            if variant[0] == "fit":
                fit_epoch = variant[1]
                runners[name] = (steps, lambda n, f=fit_epoch: f(n).seconds)
            else:
                step, block, _ = variant

                def run(n, step=step, block=block):
                    t0 = time.perf_counter()
                    out = None
                    for _ in range(n):
                        out = step()
                    block(out)
                    return time.perf_counter() - t0

                runners[name] = (steps, run)
        torch_info = (torch_ready or {}).get(model)
        if torch_info and "error" not in torch_info:
            steps = _steps_for(torch_info["step_s"], args.window_seconds)
            runners["torch"] = (steps, lambda n, m=model: torch_worker.window(m, n))
            compile_s["torch"] = torch_info["compile_s"]
            first_loss["torch"] = torch_info["first_loss"]
        elif torch_info:
            results["notes"].append(f"{TITLES[model]}: torch row skipped ({torch_info['error']}).")
        else:
            reason = "--skip-torch" if args.skip_torch else torch_worker.error or "not ready"
            note = f"torch rows skipped ({reason})."
            if note not in results["notes"]:
                results["notes"].append(note)
        windows = _interleave(runners, args)
        flops = model_flops_per_step(model, spec)
        for name, seconds in windows.items():
            steps = runners[name][0]
            per = [s / steps for s in seconds]
            median = statistics.median(per) if per else float("nan")
            results["rows"].append({
                "model": model, "variant": name, "batch": spec["batch"],
                "x_shape": list(spec["x_shape"]), "steps_per_window": steps,
                "windows": len(per), "window_ms": [p * 1e3 for p in per],
                "ms_per_step": median * 1e3,
                "throughput": spec["batch"] * spec["per_example"] / median,
                "unit": spec["unit"], "model_flops_per_step": flops,
                "tflops": flops / median / 1e12,
                "mfu": flops / median / (args.peak_tflops * 1e12),
                "compile_s": compile_s.get(name), "first_loss": first_loss.get(name),
                "xla_flops_per_step": info["xla_flops"], "parameters": info["parameters"],
                "torch_parameters": (torch_info or {}).get("parameters"),
            })
        jit_rows = [r for r in results["rows"] if r["model"] == model and r["variant"] == "jax.jit"]
        for row in results["rows"]:
            if row["model"] == model and jit_rows:
                row["vs_jit"] = row["ms_per_step"] / jit_rows[0]["ms_per_step"]
        info_line = (f"{TITLES[model]}: model FLOPs {flops / spec['batch'] / 1e9:.2f} GFLOP per "
                     f"example per step (analytic); XLA's count of the jax.jit train step "
                     f"{info['xla_flops'] / spec['batch'] / 1e9:.2f} GFLOP; "
                     f"{info['parameters']:,} parameters (Flax)")
        if torch_info and "parameters" in torch_info:
            info_line += f", {torch_info['parameters']:,} (PyTorch, {torch_info['impl']})"
        # mirrax and jax.jit start from the same weights: the same first loss means the same step.
        losses = ", ".join(f"{name} {loss:.6f}" for name, loss in first_loss.items()
                           if loss is not None)
        caveats = [text for name, text in (
            ("fit", f"fit: mean of its first {WARMUP_STEPS}-step epoch"),
            ("torch", "torch: its own random initialization")) if name in first_loss]
        results["notes"].append(f"{info_line}. First-step losses: {losses}"
                                + (f" ({'; '.join(caveats)})." if caveats else "."))


def _interleave(runners: dict, args) -> dict:
    """Rotating rounds of one window per variant; returns {variant: [window seconds]}."""
    names = list(runners)
    seconds = {name: [] for name in names}
    spent = {name: 0.0 for name in names}
    for round_index in range(args.windows):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            if spent[name] > args.variant_seconds:
                continue
            steps, run = runners[name]
            elapsed = run(steps)
            if elapsed is None:
                continue
            seconds[name].append(elapsed)
            spent[name] += elapsed
    return seconds


# -- the PyTorch process --------------------------------------------------------------------------


def torch_model(model: str, spec: dict):
    """(module, "torchvision" | "torch.nn"): ResNet-50 or the transformer, as torch.nn.Module."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if model == "transformer":
        class Encoder(nn.Module):
            def __init__(self, sequence):
                super().__init__()
                self.tokens = nn.Embedding(VOCABULARY, D_MODEL)
                self.positions = nn.Embedding(sequence, D_MODEL)
                self.blocks = nn.ModuleList(
                    nn.TransformerEncoderLayer(
                        D_MODEL, HEADS, MLP_WIDTH, dropout=0.0,
                        activation=lambda h: F.gelu(h, approximate="tanh"),
                        layer_norm_eps=LN_EPSILON, batch_first=True, norm_first=True)
                    for _ in range(LAYERS))
                self.norm = nn.LayerNorm(D_MODEL, eps=LN_EPSILON)
                self.head = nn.Linear(D_MODEL, CLASSES)

            def forward(self, tokens):
                positions = torch.arange(tokens.shape[1], device=tokens.device)
                x = self.tokens(tokens) + self.positions(positions)
                for block in self.blocks:
                    x = block(x)
                return self.head(self.norm(x).mean(dim=1))

        return Encoder(spec["x_shape"][0]), "torch.nn"

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
                self.project = nn.Sequential(
                    nn.Conv2d(cin, 4 * width, 1, stride, bias=False), bn(4 * width))

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            h = F.relu(self.bn2(self.conv2(h)))
            h = self.bn3(self.conv3(h))
            return F.relu(h + (x if self.project is None else self.project(x)))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, padding=3, bias=False), bn(64), nn.ReLU(),
                   nn.MaxPool2d(3, 2, padding=1)], 64
    for index, (count, width) in enumerate(RESNET_STAGES):
        for block in range(count):
            layers.append(Bottleneck(cin, width, 2 if block == 0 and index > 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, RESNET_CLASSES)]
    return nn.Sequential(*layers), "torch.nn"


def _torch_worker(spec_json: str) -> None:
    """The PyTorch process: builds and compiles, says ready, then times windows on command."""
    def reply(message):
        sys.stdout.write(REPLY + json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as error:
        reply({"fatal": f"PyTorch is not installed for {sys.executable} ({error})"})
        return
    spec = json.loads(spec_json)
    cuda = torch.cuda.is_available()
    if not cuda and not spec["smoke"]:
        reply({"fatal": f"torch {torch.__version__} sees no CUDA device"})
        return
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cudnn.benchmark = True
    bf16 = spec["precision"] == "bf16"
    ready = {"versions": {"torch": torch.__version__},
             "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"}
    steps_of = {}
    if spec["after_jax"]:
        sys.stdin.readline()
    for model in spec["models"]:
        try:
            shape = spec["shapes"][model]
            shape["x_shape"] = tuple(shape["x_shape"])
            x, y = make_data(model, shape)
            module, impl = torch_model(model, shape)
            module = module.to(device)
            x = torch.from_numpy(x).to(device)
            y = torch.from_numpy(y).long().to(device)
            if model == "resnet50":
                module = module.to(memory_format=torch.channels_last)
                x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
                optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            else:
                optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
            parameters = sum(p.numel() for p in module.parameters())

            def make_step(forward, optimizer=optimizer, x=x, y=y):
                def step():
                    optimizer.zero_grad(set_to_none=True)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        loss = F.cross_entropy(forward(x), y)
                    loss.backward()
                    optimizer.step()
                    return loss.detach()
                return step

            def sync():
                if cuda:
                    torch.cuda.synchronize()

            t0 = time.perf_counter()
            note, step = "", None
            if not spec["no_compile"]:
                try:
                    step = make_step(torch.compile(module))
                    first = float(step())
                    sync()
                except Exception as error:  # noqa: BLE001 - any compile failure: fall back
                    note = f"torch.compile failed ({type(error).__name__}: " \
                           f"{str(error).splitlines()[0][:200] if str(error) else ''}); eager"
                    print(traceback.format_exc(), file=sys.stderr, flush=True)
                    step = None
            if step is None:
                step = make_step(module)
                first = float(step())
            for _ in range(WARMUP_STEPS - 1):
                step()
            sync()
            compile_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            for _ in range(WARMUP_STEPS):
                step()
            sync()
            steps_of[model] = (step, sync)
            ready[model] = {
                "compile_s": compile_s, "first_loss": first, "parameters": parameters,
                "step_s": (time.perf_counter() - t1) / WARMUP_STEPS, "impl": impl,
                "compiled": not note and not spec["no_compile"], "note": note,
            }
        except Exception as error:  # noqa: BLE001 - report it, keep the other model
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            ready[model] = {"error": f"{type(error).__name__}: {error}"[:300]}
    reply({"ready": ready})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        step, sync = steps_of[command["model"]]
        t0 = time.perf_counter()
        for _ in range(command["steps"]):
            loss = step()
        sync()
        reply({"seconds": time.perf_counter() - t0, "loss": float(loss)})


class TorchWorker:
    """The driver's handle on the PyTorch process (started at once, so it compiles while JAX does)."""

    def __init__(self, args, specs: dict):
        spec = {"smoke": args.smoke, "precision": args.precision, "models": args.models,
                "no_compile": args.no_torch_compile, "after_jax": args.torch_after_jax,
                "shapes": {m: dict(specs[m], x_shape=list(specs[m]["x_shape"]))
                           for m in args.models}}
        self.error = None
        self.ready = None
        self.replies = queue.Queue()
        env = dict(os.environ)
        env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        try:
            self.process = subprocess.Popen(
                [args.torch_python, os.path.abspath(__file__), "--torch-worker", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        except OSError as error:
            self.process, self.error = None, f"cannot start {args.torch_python}: {error}"
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            if line.startswith(REPLY):
                self.replies.put(json.loads(line[len(REPLY):]))
            else:
                sys.stderr.write("[torch] " + line)
        self.replies.put({"fatal": f"the PyTorch process exited ({self.process.wait()})"})

    def _get(self, timeout: float) -> dict:
        try:
            message = self.replies.get(timeout=timeout)
        except queue.Empty:
            message = {"fatal": f"no answer from the PyTorch process within {timeout:.0f} s"}
        if "fatal" in message:
            self.error = message["fatal"]
            self.close()
        return message

    def wait_ready(self, args, start: float) -> dict | None:
        if self.process is None or self.error:
            return None
        if self.ready is None:
            timeout = args.torch_timeout - (time.perf_counter() - start)
            if args.torch_after_jax:
                self.process.stdin.write(json.dumps({"start": True}) + "\n")
                self.process.stdin.flush()
                timeout = args.torch_timeout
            message = self._get(max(1.0, timeout))
            self.ready = message.get("ready")
            if self.ready:
                for model in args.models:
                    info = self.ready.get(model, {})
                    if "error" not in info:
                        _log(f"{TITLES[model]} / torch ({info['impl']}, "
                             f"{'compiled' if info['compiled'] else 'eager'}): compile + "
                             f"{WARMUP_STEPS} steps {info['compile_s']:.1f} s, first loss "
                             f"{info['first_loss']:.4f}, ~{info['step_s'] * 1e3:.1f} ms/step")
        return self.ready

    def window(self, model: str, steps: int):
        if self.process is None or self.error:
            return None
        self.process.stdin.write(json.dumps({"model": model, "steps": steps}) + "\n")
        self.process.stdin.flush()
        message = self._get(120.0 + 10 * steps)
        return message.get("seconds")

    def close(self):
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"quit": True}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


# -- the table ------------------------------------------------------------------------------------


def _fmt_throughput(value: float, unit: str) -> str:
    if value != value:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M {unit}"
    return f"{value:,.0f} {unit}"


def markdown(results: dict, args) -> str:
    lines = [
        "| model | variant | batch | ms/step | throughput | model TFLOP/s | MFU | vs jax.jit "
        "| windows | compile + 3 steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        shape = "x".join(str(d) for d in row["x_shape"])
        title = (f"{TITLES[row['model']]} {shape}" if row["model"] == "resnet50"
                 else f"{TITLES[row['model']]}, seq {shape}")
        if not row["windows"]:
            lines.append(f"| {title} | {row['variant']} | {row['batch']} | - | - | - | - | - | 0 "
                         "| - |")
            continue
        lines.append(
            f"| {title} | {row['variant']} | {row['batch']} | {row['ms_per_step']:.2f} | "
            f"{_fmt_throughput(row['throughput'], row['unit'])} | {row['tflops']:.1f} | "
            f"{row['mfu'] * 100:.1f}% | {row.get('vs_jit', float('nan')):.3f} | "
            f"{row['windows']} x {row['steps_per_window']} | "
            f"{row['compile_s']:.0f} s |"
        )
    lines.append("")
    lines.append(f"Device: {results.get('device', '?')}; precision {args.precision}; MFU against "
                 f"{args.peak_tflops:.0f} TFLOP/s. Versions: "
                 + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".")
    lines += [f"- {note}" for note in results["notes"]]
    if args.smoke:
        lines.append("- --smoke: tiny shapes on whatever device there is; these numbers measure "
                     "nothing.")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(f"  [gpu_models] {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = _parse_args(argv)
    overhead.check_json_path(args.json)
    if args.torch_worker:
        _torch_worker(args.torch_worker)
        return 0
    start = time.perf_counter()
    # Both frameworks share the GPU: JAX allocates as it goes instead of taking 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke,
               "versions": {"python": platform.python_version()}, "rows": [], "notes": []}
    import jax

    if jax.default_backend() != "gpu" and not args.smoke:
        message = (f"gpu_models: skipped: JAX's backend is {jax.default_backend()!r}, not 'gpu'. "
                   "Run `bash benchmarks/gpu.sh` on a GPU machine, or pass --smoke for a quick "
                   "CPU check of the script.")
        print(message)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(results, skipped=message), f, indent=1)
        return 0
    specs = shapes(args)
    torch_worker = None if args.skip_torch else TorchWorker(args, specs)
    try:
        _run_jax(args, results, start, torch_worker)
    except Exception as error:  # noqa: BLE001 - print the rows measured so far
        traceback.print_exc()
        results["notes"].append(f"stopped early: {type(error).__name__}: {str(error)[:300]}")
    finally:
        if torch_worker is not None:
            if torch_worker.ready:
                results["versions"].update(torch_worker.ready.get("versions", {}))
                results["torch_device"] = torch_worker.ready.get("device")
                for model in args.models:
                    info = torch_worker.ready.get(model, {})
                    if "impl" in info:
                        how = info["note"] or ("torch.compile" if info["compiled"] else "eager")
                        results["notes"].append(
                            f"{TITLES[model]}: torch ran the {info['impl']} model, {how}, on "
                            f"{results['torch_device']}.")
            if torch_worker.error and not any(torch_worker.error in n for n in results["notes"]):
                results["notes"].append(f"torch: {torch_worker.error}.")
            torch_worker.close()
    results["seconds"] = time.perf_counter() - start
    table = markdown(results, args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results, table=table), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
