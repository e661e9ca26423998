"""The example programs of examples/: they run as a user runs them, and `mirrax train` runs them.

Each script runs in a new Python process (as `python examples/keras_fit.py --epochs 1`) with
2 fake CPU devices, so MirroredStrategy() has 2 replicas there; this process keeps its 8.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import mirrax.examples.custom_training_loop
import mirrax.examples.keras_fit
import mirrax.examples.keras_model
import mirrax.examples.multi_output
import mirrax.examples.time_series_lstm
import pytest

from tests.conftest import mirrored

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["keras_fit.py", "custom_training_loop.py"])
def test_example_runs_as_a_script_over_two_devices(script, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--epochs", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "Number of devices: 2"
    assert lines[1] == "Epoch 1/1" or lines[1].startswith("Epoch 1/1 - loss: ")
    match = re.fullmatch(r"Test accuracy: (\d\.\d{4})", lines[-1])
    assert match, result.stdout[-2000:]
    # One epoch of ceil(1293 / 32) = 41 (fit) or ceil(1437 / 32) = 45 (custom) steps at
    # global batch 2 x 16: far above chance (0.1).
    assert float(match.group(1)) >= 0.5  # measured: 0.73 (fit), 0.84 (custom)


def test_the_lstm_example_forecasts_the_sine_over_two_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "time_series_lstm.py"), "--epochs", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == "Number of devices: 2"
    match = re.fullmatch(r"Test MSE: (\d\.\d{4})", result.stdout.splitlines()[-1])
    assert match, result.stdout[-2000:]
    # Predicting 0 would score the sine's variance, 0.5; the noise alone is 0.05^2 = 0.0025.
    assert float(match.group(1)) < 0.05  # measured: 0.0051 after 1 epoch (32 steps of 2 x 16)


def test_the_multi_output_example_learns_both_heads_over_two_devices(capsys):
    example = mirrax.examples.multi_output
    x, y = example.synthetic(1200)
    part = lambda tree, s: {k: v[s] for k, v in tree.items()}  # noqa: E731
    _, history, results = example.train(
        mirrored(2),
        (part(x, slice(0, 1000)), part(y, slice(0, 1000))),
        (part(x, slice(1000, None)), part(y, slice(1000, None))),
        epochs=2,
    )
    # Keras 3's names: the total, each output's loss, then each output's metrics.
    assert list(results) == ["loss", "value_loss", "kind_loss", "value_mae", "kind_accuracy"]
    assert sorted(history) == sorted(list(results) + ["learning_rate"])
    # The total is value_loss + 0.5 * kind_loss (the loss_weights), up to float32 rounding.
    assert abs(results["loss"] - (results["value_loss"] + 0.5 * results["kind_loss"])) < 1e-5
    # Predicting 0 scores value's variance (about 1.4: 16 weights in [-1, 1] / 4 and meta[:, 0]
    # of variance 1); chance on kind is 1/3. Measured after 2 epochs: 0.11 and 0.68.
    assert results["value_loss"] < 0.5 and results["kind_accuracy"] > 0.55
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "Test " + ", ".join(f"{k}: {v:.4f}" for k, v in results.items())


@pytest.mark.parametrize(
    "module",
    [
        mirrax.examples.keras_fit,
        mirrax.examples.custom_training_loop,
        mirrax.examples.keras_model,
        mirrax.examples.time_series_lstm,
        mirrax.examples.multi_output,
    ],
)
def test_mirrax_train_runs_the_files_of_examples(module):
    # mirrax.examples is the examples/ folder, installed with the package (pyproject.toml):
    # the command cannot drift from the programs users read.
    name = module.__name__.rsplit(".", 1)[-1] + ".py"
    assert Path(module.__file__).read_text() == (ROOT / "examples" / name).read_text()


def test_pyproject_lists_every_package():
    # The package list is explicit (a package mapped from examples/ is invisible to
    # setuptools' finder), so a new folder under mirrax/ must be added there by hand.
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    on_disk = sorted(
        ".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "mirrax").rglob("__init__.py")
    )
    assert sorted(setuptools["packages"]) == sorted(on_disk + ["mirrax.examples"])
    assert setuptools["package-dir"] == {"mirrax.examples": "examples"}
