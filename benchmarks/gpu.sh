#!/usr/bin/env bash
# The GPU benchmarks, one command, about 7 minutes on one H200:
#   1. python -m benchmarks.gpu_models: ResNet-50 (batch 256, 224x224) and the 4-layer
#      transformer (batch 64, sequence 512) at bf16: mirrax strategy.run and Model.fit
#      (mixed_bfloat16) vs a plain jax.jit step vs PyTorch (channels_last, autocast bf16,
#      torch.compile); ms/step, images/s or tokens/s, MFU against 790 TFLOP/s. About 5 minutes
#      (compiles dominate).
#   2. python -m benchmarks.overhead --variants run: strategy.run vs the hand-written
#      jax.jit(jax.shard_map(...)) step, for the TF tutorial CNN and the tiny MLP. About 2 minutes.
#
#   bash benchmarks/gpu.sh            # results in a temporary folder (its path is printed)
#   OUT=/some/dir bash benchmarks/gpu.sh
#   SKIP_MODELS=1 / SKIP_OVERHEAD=1   # leave out part 1 / part 2
#   GPU_MODELS_ARGS="--skip-torch"    # more flags for benchmarks.gpu_models (see its --help)
#
# Python, in this order: $VENV (default .venv-gpu) if it exists; else a python3 that already has
# a GPU JAX with flax and optax (machine images without network access), running mirrax and
# benchmarks/ from a scratch copy of this checkout; else a new $VENV with
# `pip install -e . "jax[$JAX_EXTRA]"` (default cuda12, which needs an NVIDIA driver >= 525;
# JAX_EXTRA=cuda13 needs >= 580). PyTorch runs in its own process, from that Python if it
# imports torch, else from python3 if that one does; without torch the torch rows are skipped
# with a message (nothing is installed for it).
# Writes to $OUT (or the temporary folder): devices.txt, gpu-models.md (the table),
# gpu-models.json (every window), gpu-models.log (progress lines), overhead-gpu.md,
# overhead-gpu.json, overhead-gpu.log (progress lines and a cProfile of the mirrax MLP step).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-gpu}"
JAX_EXTRA="${JAX_EXTRA:-cuda12}"
out_dir="${OUT:-$(mktemp -d)}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"  # absolute: the python commands may run from a scratch folder
export PYTHONUNBUFFERED=1

has_gpu_jax() {
    "$1" - <<'EOF' 2>/dev/null
import sys
import flax, jax, optax  # noqa: F401
sys.exit(0 if jax.default_backend() == "gpu" else 1)
EOF
}

if [ -x "$VENV/bin/python" ]; then
    py="$VENV/bin/python"
elif command -v python3 >/dev/null && has_gpu_jax python3; then
    py=python3
    # mirrax.examples is mapped from examples/ at install time (pyproject.toml); lay out the
    # same package in a scratch folder (no install, no network) instead of using the tree, with
    # benchmarks/ beside it, and run from there: `python -m` and `-c` put the current folder
    # first on sys.path, where the checkout's mirrax (without mirrax.examples) would win.
    site="${TMPDIR:-/tmp}/mirrax-site"
    rm -rf "$site" && mkdir -p "$site"
    cp -r mirrax benchmarks "$site/" && cp -r examples "$site/mirrax/examples"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    cd "$site"
else
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet -e . "jax[$JAX_EXTRA]"
    py="$VENV/bin/python"
fi
if ! has_gpu_jax "$py"; then
    echo "gpu.sh: $py has no GPU backend for JAX (jax.default_backend() is not 'gpu')." >&2
    echo "gpu.sh: check nvidia-smi, or reinstall with JAX_EXTRA=cuda12 / cuda13." >&2
    exit 1
fi

{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    fi
    "$py" -c 'import flax, jax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
    # `mirrax devices`, called the way the console script calls it (works without an install).
    "$py" -c 'import sys; from mirrax._src.cli.main import main; sys.argv = ["mirrax", "devices"]; sys.exit(main())'
} 2>&1 | tee "$out_dir/devices.txt"

torch_py="$py"
if ! "$py" -c 'import torch' 2>/dev/null; then
    if command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null; then
        torch_py=python3
    fi
fi
"$torch_py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
    2>&1 | tee -a "$out_dir/devices.txt" || true

status=0
if [ -z "${SKIP_MODELS:-}" ]; then
    # No model is compiled after 200 s and PyTorch must be ready by 300 s (else its rows are
    # skipped), so this part ends by about 5.5 minutes; `timeout` is only the backstop.
    # shellcheck disable=SC2086
    timeout 420 "$py" -m benchmarks.gpu_models --torch-python "$torch_py" --deadline 200 \
        --torch-timeout 300 ${GPU_MODELS_ARGS:-} --json "$out_dir/gpu-models.json" \
        2> >(tee "$out_dir/gpu-models.log" >&2) | tee "$out_dir/gpu-models.md" \
        || { status=$?; echo "gpu.sh: benchmarks.gpu_models failed (exit status $status)" >&2; }
fi

if [ -z "${SKIP_OVERHEAD:-}" ]; then
    # GPU steps take about a millisecond: many more steps per window than on CPU.
    timeout 240 "$py" -m benchmarks.overhead --variants run --platform gpu --devices 1 \
        --windows 9 --cnn-steps 200 --mlp-steps 1000 --profile --json "$out_dir/overhead-gpu.json" \
        2> >(tee "$out_dir/overhead-gpu.log" >&2) | tee "$out_dir/overhead-gpu.md" \
        || { status=$?; echo "gpu.sh: benchmarks.overhead failed (exit status $status)" >&2; }
fi

echo "gpu.sh: results in $out_dir"
exit "$status"
