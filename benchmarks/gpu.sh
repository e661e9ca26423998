#!/usr/bin/env bash
# The overhead benchmark (benchmarks/overhead.py) on one GPU: strategy.run vs the hand-written
# jax.jit(jax.shard_map(...)) step, for the TF tutorial CNN and the tiny MLP.
#
#   bash benchmarks/gpu.sh            # results in a temporary folder (its path is printed)
#   OUT=/some/dir bash benchmarks/gpu.sh
#
# Python, in this order: $VENV (default .venv-gpu) if it exists; else a python3 that already has
# a GPU JAX with flax and optax (machine images without network access), running mirrax from
# this checkout; else a new $VENV with `pip install -e . "jax[$JAX_EXTRA]"` (default cuda12,
# which needs an NVIDIA driver >= 525; JAX_EXTRA=cuda13 needs >= 580).
# Writes to $OUT (or the temporary folder): devices.txt, overhead-gpu.md (the table),
# overhead-gpu.json (every window), overhead-gpu.log (progress lines and a cProfile of the
# mirrax MLP step). Takes about 2 minutes once JAX is installed.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-gpu}"
JAX_EXTRA="${JAX_EXTRA:-cuda12}"
out_dir="${OUT:-$(mktemp -d)}"
mkdir -p "$out_dir"
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
    # same package in a scratch folder (no install, no network) instead of using the tree.
    site="${TMPDIR:-/tmp}/mirrax-site"
    rm -rf "$site" && mkdir -p "$site"
    cp -r mirrax "$site/" && cp -r examples "$site/mirrax/examples"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
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

# GPU steps take about a millisecond: many more steps per window than on CPU.
"$py" benchmarks/overhead.py --platform gpu --devices 1 --windows 9 \
    --cnn-steps 200 --mlp-steps 1000 --profile --json "$out_dir/overhead-gpu.json" \
    2> >(tee "$out_dir/overhead-gpu.log" >&2) | tee "$out_dir/overhead-gpu.md"

echo "gpu.sh: results in $out_dir"
