"""`import mirrax` makes Keras default to the JAX backend (mirrax/_src/keras_backend.py): in a
new process as a user runs it, and the rule's cases (unset, set by the user, Keras already
imported on another backend) on a stand-in `sys.modules` and environment."""

import os
import subprocess
import sys
import types
import warnings

import pytest

from mirrax._src import keras_backend

pytestmark = pytest.mark.subprocess


def test_import_mirrax_then_keras_without_keras_backend_gives_keras_on_jax(tmp_path):
    pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
    # Keras's own default, written as a fresh `import keras` writes it: "tensorflow" (installed
    # by the test extra on x86_64 Python 3.11 only). Before, without TensorFlow:
    # ModuleNotFoundError: No module named 'tensorflow'; with it, Keras on TensorFlow.
    (tmp_path / "keras.json").write_text('{"backend": "tensorflow"}')
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(KERAS_HOME=str(tmp_path), JAX_PLATFORMS="cpu")
    code = (
        "import mirrax; import keras; print(keras.backend.backend()); "
        "model = mirrax.Model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])); "
        "print(type(model).__name__, model.module.keras_trainable_variables[0].shape)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["jax", "Model (3, 2)"]  # a Dense(2) kernel of 3 inputs


def test_the_default_is_set_only_when_unset_and_keras_is_not_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    keras_backend.default_to_jax()
    assert os.environ["KERAS_BACKEND"] == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # the user's choice is kept
    keras_backend.default_to_jax()
    assert os.environ["KERAS_BACKEND"] == "torch"


def _keras_on(backend):
    return types.SimpleNamespace(backend=types.SimpleNamespace(backend=lambda: backend))


def test_keras_imported_first_on_another_backend_warns_with_the_fix(monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "keras", _keras_on("tensorflow"))
    with pytest.warns(
        UserWarning,
        match=r"Keras was imported before mirrax, on its "
        r"'tensorflow' backend.*Import mirrax before Keras.*KERAS_BACKEND=jax",
    ):
        keras_backend.default_to_jax()
    # Too late to change Keras: the environment is left as it was.
    assert "KERAS_BACKEND" not in os.environ
    monkeypatch.setitem(sys.modules, "keras", _keras_on("jax"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_backend.default_to_jax()  # Keras already on JAX: nothing to say
