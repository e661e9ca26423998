"""Notebook habits: the CPU device count set after JAX started, `mirrax.clear_session()`, and
examples/tutorial.ipynb (TF's Keras tutorial on mirrax) executed end to end."""

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import mirrax
from tests.conftest import named_strategy

pytestmark = pytest.mark.notebook

_FLAG = "--xla_force_host_platform_device_count"
_NOTEBOOK = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tutorial.ipynb"
)


# -- the CPU device count -----------------------------------------------------------------------


def test_set_cpu_device_count_before_jax_starts_gives_that_many_devices():
    code = (
        "import mirrax; mirrax.set_cpu_device_count(3); import jax; "
        "print(len(jax.devices('cpu')), mirrax.MirroredStrategy().num_replicas_in_sync)"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_dump_hlo_as_text {_FLAG}=5"  # an older count is replaced
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3", "3"]


def test_set_cpu_device_count_after_jax_started_says_to_restart_the_kernel():
    jax.devices()  # started, with the suite's 8 CPU devices (tests/conftest.py)
    mirrax.set_cpu_device_count(8)  # the count JAX has: nothing to change
    with pytest.raises(
        mirrax.errors.StartedBackendError,
        match=r"set_cpu_device_count\(2\): JAX already started in this process "
        r"with 8 CPU device\(s\).*Restart the kernel",
    ):
        mirrax.set_cpu_device_count(2)


@pytest.mark.parametrize(
    "count, error, fragment",
    [
        (0, mirrax.errors.InvalidArgumentError, "count must be >= 1; received 0"),
        (-4, mirrax.errors.InvalidArgumentError, "received -4"),
        ("8", mirrax.errors.InvalidArgumentTypeError, "received '8' of type str"),
        (2.0, mirrax.errors.InvalidArgumentTypeError, "received 2.0 of type float"),
        (True, mirrax.errors.InvalidArgumentTypeError, "received True of type bool"),
    ],
)
def test_set_cpu_device_count_refuses_what_is_not_a_count(count, error, fragment):
    with pytest.raises(error, match=fragment):
        mirrax.set_cpu_device_count(count)


def test_a_strategy_warns_when_xla_flags_asks_for_another_count_than_jax_has(monkeypatch):
    # The notebook habit: XLA_FLAGS edited after JAX started. Before: 8 replicas, no word.
    # (The warning comes once per pair of counts; no other test asks for 16 in this process.)
    monkeypatch.setenv("XLA_FLAGS", f"{_FLAG}=16")
    with pytest.warns(
        RuntimeWarning,
        match=r"XLA_FLAGS asks for 16 CPU devices .* but JAX started with 8, so "
        r"this strategy has 8 replica\(s\).*mirrax.set_cpu_device_count\(16\)",
    ):
        mirrax.MirroredStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mirrax.MirroredStrategy()  # once per count: a loop making strategies is not flooded
        mirrax.MirroredStrategy(["cpu:0", "cpu:1"])  # devices chosen by the user: no check
        monkeypatch.setenv("XLA_FLAGS", f"{_FLAG}=8")
        mirrax.MirroredStrategy()  # the count JAX has


# -- clear_session ------------------------------------------------------------------------------


def test_clear_session_drops_the_compiled_programs_and_objects_keep_working():
    strategy = named_strategy("Mirrored2CPU")
    default = mirrax.get_strategy()
    traces = []

    def step(model, x):
        traces.append(1)  # runs only while the function is traced (compiled)
        return model(x)

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    x = np.ones((2, 2), np.float32)
    first = np.asarray(strategy.run(step, args=(model, x)).values[0])
    on_default = np.asarray(default.run(step, args=(model, x)).values[0])
    compiled = len(traces)  # 2 per strategy: the abstract trace and the program's
    assert compiled == 4
    strategy.run(step, args=(model, x))
    default.run(step, args=(model, x))
    assert len(traces) == compiled  # cached: no new trace
    mirrax.clear_session()
    again = np.asarray(strategy.run(step, args=(model, x)).values[0])
    default.run(step, args=(model, x))
    assert len(traces) == 2 * compiled  # both programs dropped, compiled anew
    np.testing.assert_array_equal(again, first)  # the same program, the same bits
    assert mirrax.get_strategy() is default  # the default strategy object is kept
    np.testing.assert_array_equal(np.asarray(default.run(step, args=(model, x)).values[0]), on_default)


def test_clear_session_inside_run_is_a_replica_context_error():
    def step(x):
        mirrax.clear_session()
        return x

    with pytest.raises(mirrax.errors.ReplicaContextError, match="inside strategy.run"):
        named_strategy("Mirrored2CPU").run(step, args=(np.ones((2, 1), np.float32),))


def test_a_model_trains_on_after_clear_session():
    x, y = np.ones((4, 2), np.float32), np.full((4, 1), 3.0, np.float32)
    with named_strategy("Mirrored2CPU").scope():
        model = mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
        model.compile(optimizer="sgd", loss="mse")
    before = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
    mirrax.clear_session()
    after = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]
    # SGD on a convex MSE with a small step: the loss keeps falling across the cleared session.
    assert after[0] < before[-1] < before[0]


# -- examples/tutorial.ipynb --------------------------------------------------------------------


def test_the_tutorial_notebook_is_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (the test extra has it)")
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert "mirrax.set_cpu_device_count(4)" in code[0].source  # the first code cell


def test_the_tutorial_notebook_runs_end_to_end(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (the test extra has it)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (the test extra has it)")
    # Looked up, not imported: ipykernel imported into this process would make the progress
    # bar of later tests think it runs in a notebook.
    if importlib.util.find_spec("ipykernel") is None:
        pytest.skip("ipykernel is not installed (the test extra has it)")
    pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    # The kernel is a new process: it starts JAX itself, with the notebook's 4 CPU devices.
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "Number of devices: 4" in text
    # decay(epoch): 1e-3 for epochs 0-2, 1e-4 for 3-4, 1e-5 after; PrintLR prints each.
    assert "Learning rate for epoch 1 is 0.001000" in text
    assert "Learning rate for epoch 4 is 0.000100" in text
    assert "Learning rate for epoch 6 is 0.000010" in text
    assert sorted(os.listdir(tmp_path / "training_checkpoints")) == [f"ckpt_{e}" for e in range(1, 7)]
    assert (tmp_path / "logs" / "train").is_dir() and (tmp_path / "saved_model").is_dir()
    values = {
        name: float(v)
        for name, v in re.findall(
            r"(Eval accuracy|exported model|Mixed precision eval "
            r"accuracy|after clear_session): (\d\.\d{4})",
            text,
        )
    }
    # Measured 0.953 (6 epochs of 45 steps at global batch 4 x 8 on 1,437 digits): far above
    # the 0.1 of chance; 0.9 leaves room for another CPU's rounding.
    assert values["Eval accuracy"] >= 0.9
    # The exported program computes what evaluate did, on one device instead of four: the
    # same argmax except perhaps at a near-tie, hence at most one of the 360 test images.
    assert abs(values["exported model"] - values["Eval accuracy"]) <= 1 / 360 + 1e-4
    assert values["after clear_session"] == values["Eval accuracy"]
    assert values["Mixed precision eval accuracy"] >= 0.85  # 3 epochs in bfloat16: measured 0.925
