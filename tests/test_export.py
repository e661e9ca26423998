"""mirrax.export / load_exported: a serving artifact that runs without the model's code."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mirrax.examples.keras_fit import TutorialCNN

import mirrax
from tests.conftest import mirrored

pytestmark = pytest.mark.xdist_group("export")

BATCH_SIZES = (1, 7, 64)
SIGNATURE = jax.ShapeDtypeStruct((-1, 8, 8, 1), jnp.float32)

# Runs in a fresh interpreter: only mirrax and numpy, never the model's module.
_SERVE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mirrax

    export_dir, inputs_path, outputs_path = sys.argv[1:]
    model = mirrax.load_exported(export_dir)
    with np.load(inputs_path, allow_pickle=False) as inputs:
        outputs = {name: np.asarray(model(inputs[name])) for name in inputs.files}
    np.savez(outputs_path, **outputs)
    print(json.dumps({
        "examples_imported": sorted(m for m in sys.modules if "examples" in m.split(".")),
        "tutorial_cnn_defined": [name for name, m in list(sys.modules.items())
                                 if m is not None and hasattr(m, "TutorialCNN")],
        "devices": len(__import__("jax").devices()),
    }))
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TutorialCNN fit 4 steps (64 digits, global batch 16) under 2 replicas, and its export."""
    (x_train, y_train), (x_test, _) = mirrax.data.load_digits()
    strategy = mirrored(2)
    with strategy.scope():
        model = mirrax.Model(TutorialCNN((8, 8, 1), rngs=nnx.Rngs(0)))
        model.compile(
            optimizer=optax.adam(1e-2), loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    initial = model.get_weights()
    model.fit(x_train[:64], y_train[:64], batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert model.optimizer.iterations == 4  # 64 examples / global batch 16
    assert any(not np.allclose(a, b) for a, b in zip(initial, model.get_weights()))
    path = tmp_path_factory.mktemp("export") / "cnn"
    mirrax.export(model, path, SIGNATURE)
    return model, path, x_test


@pytest.mark.subprocess
def test_exported_cnn_matches_live_model_in_a_fresh_process_without_its_code(trained, tmp_path):
    model, path, x_test = trained
    inputs = {f"batch_{n}": x_test[:n] for n in BATCH_SIZES}
    live = {name: model.predict(x, batch_size=len(x), verbose=0) for name, x in inputs.items()}
    np.savez(tmp_path / "inputs.npz", **inputs)
    (tmp_path / "serve.py").write_text(_SERVE)
    result = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "serve.py"),
            str(path),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "outputs.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["examples_imported"] == []
    assert report["tutorial_cnn_defined"] == []
    with np.load(tmp_path / "outputs.npz", allow_pickle=False) as served:
        for name, expected in live.items():
            assert served[name].shape == expected.shape == (len(inputs[name]), 10)
            np.testing.assert_allclose(served[name], expected, rtol=0, atol=1e-6)


def test_artifact_files_and_metadata(trained):
    _, path, _ = trained
    assert sorted(p.name for p in path.iterdir()) == ["forward.jax_export", "metadata.json", "weights.npz"]
    metadata = json.loads((path / "metadata.json").read_text())
    assert metadata["input_signature"] == {"shape": [None, 8, 8, 1], "dtype": "float32"}
    assert metadata["output_signature"] == {"shape": [None, 10], "dtype": "float32"}
    assert "cpu" in metadata["platforms"]
    # 3 convs + 2 denses, a kernel and a bias each.
    assert metadata["num_weights"] == 10
    with np.load(path / "weights.npz", allow_pickle=False) as weights:
        assert len(weights.files) == 10


@pytest.mark.parametrize(
    "bad, what",
    [
        (np.zeros((2, 8, 8, 3), np.float32), r"shape \(2, 8, 8, 3\)"),
        (np.zeros((2, 64), np.float32), r"shape \(2, 64\)"),
        (np.zeros((2, 8, 8, 1), np.float64), "dtype float64"),
    ],
)
def test_wrong_input_names_the_expected_signature(trained, bad, what):
    _, path, _ = trained
    served = mirrax.load_exported(path)
    with pytest.raises(ValueError, match=what) as info:
        served(bad)
    assert "expected float32[None, 8, 8, 1]" in str(info.value)


def test_missing_empty_and_incomplete_directories_are_reported(trained, tmp_path):
    _, path, _ = trained
    with pytest.raises(FileNotFoundError, match="no directory at"):
        mirrax.load_exported(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty directory"):
        mirrax.load_exported(tmp_path / "empty")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "metadata.json").write_bytes((path / "metadata.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="missing forward.jax_export, weights.npz"):
        mirrax.load_exported(partial)


def test_pure_function_with_pytree_input_shares_one_batch_dimension(tmp_path):
    def fn(x):
        return {"doubled": x["u"] * 2.0, "row_sum": x["v"].sum(axis=-1)}

    signature = {
        "u": jax.ShapeDtypeStruct((-1, 3), jnp.float32),
        "v": jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 4"), jnp.int32),
    }
    mirrax.export(fn, tmp_path, signature)
    served = mirrax.load_exported(tmp_path)
    out = served({"u": np.full((5, 3), 1.5, np.float32), "v": np.ones((5, 4), np.int32)})
    np.testing.assert_array_equal(out["doubled"], np.full((5, 3), 3.0))  # 1.5 * 2
    np.testing.assert_array_equal(out["row_sum"], np.full((5,), 4))  # 1 + 1 + 1 + 1
    with pytest.raises(ValueError, match=r"batch sizes differ \(\[2, 3\]\)"):
        served({"u": np.ones((2, 3), np.float32), "v": np.ones((3, 4), np.int32)})
    with pytest.raises(ValueError, match="structure"):
        served(np.ones((2, 3), np.float32))


def test_module_is_exported_in_eval_mode(tmp_path):
    class Dropped(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.dropout(self.linear(x))

    module = Dropped()
    mirrax.export(module, tmp_path, jax.ShapeDtypeStruct((-1, 4), jnp.float32))
    x = np.ones((3, 4), np.float32)
    module.eval()
    # Dropout off: the served output is the linear layer's, identical on every call.
    np.testing.assert_allclose(mirrax.load_exported(tmp_path)(x), module(x), rtol=0, atol=1e-6)


def test_bad_signatures_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="only the leading"):
        mirrax.export(lambda x: x, tmp_path, jax.ShapeDtypeStruct((4, -1), jnp.float32))
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        mirrax.export(lambda x: x, tmp_path, np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="received int"):
        mirrax.export(3, tmp_path, jax.ShapeDtypeStruct((-1, 2), jnp.float32))


def test_none_as_the_batch_dimension_where_jax_allows_it(tmp_path):
    try:
        signature = jax.ShapeDtypeStruct((None, 2), jnp.float32)
    except ValueError:
        pytest.skip(f"jax {jax.__version__}'s ShapeDtypeStruct refuses None; use -1")
    mirrax.export(lambda x: x + 1.0, tmp_path, signature)
    np.testing.assert_array_equal(
        mirrax.load_exported(tmp_path)(np.zeros((3, 2), np.float32)), np.ones((3, 2))
    )  # 0 + 1


# -- PRNG state, damaged artifacts, overwriting (issue 11) --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
def test_a_model_with_rngs_and_batchnorm_exports_and_serves_in_eval_mode(tmp_path, legacy):
    from tests.test_checkpoint import RNG_X, used_rng_net

    net = used_rng_net(0, legacy)  # batch statistics moved off 0 / 1 by two training calls
    mirrax.export(net, tmp_path / "a", jax.ShapeDtypeStruct((-1, 2), jnp.float32))
    net.eval()  # running statistics, no dropout
    np.testing.assert_allclose(
        mirrax.load_exported(tmp_path / "a")(RNG_X), net(RNG_X), rtol=0, atol=1e-6
    )  # one compiled program vs eager ops


def _small_artifact(path):
    mirrax.export(lambda x: x * 2.0, path, jax.ShapeDtypeStruct((-1, 2), jnp.float32))
    return path


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (
            lambda p: (p / "metadata.json").write_text('{"format": "mirrax.exp'),
            "metadata.json is not valid JSON",
        ),
        (lambda p: (p / "metadata.json").write_text("[1, 2]"), "holds a list, not the artifact's metadata"),
        (
            lambda p: (p / "forward.jax_export").write_bytes((p / "forward.jax_export").read_bytes()[:20]),
            "forward.jax_export is not a readable serialized program",
        ),
        (lambda p: (p / "weights.npz").write_bytes(b"PK\x03\x04garbage"), "weights.npz does not hold"),
        (
            lambda p: (p / "metadata.json").write_text(
                json.dumps(dict(json.loads((p / "metadata.json").read_text()), num_weights="2"))
            ),
            "num_weights='2'",
        ),
    ],
)
def test_damaged_artifact_files_give_a_clear_error(tmp_path, damage, fragment):
    path = _small_artifact(tmp_path / "a")
    damage(path)
    with pytest.raises(mirrax.errors.InvalidExportError, match=re.escape(fragment)) as info:
        mirrax.load_exported(path)
    assert "Re-export the model with mirrax.export" in str(info.value)


def test_export_over_an_existing_artifact_replaces_it_whole_and_refuses_other_things(tmp_path):
    path = _small_artifact(tmp_path / "a")
    mirrax.export(lambda x: x + 1.0, path, jax.ShapeDtypeStruct((-1, 2), jnp.float32))
    np.testing.assert_array_equal(
        mirrax.load_exported(path)(np.zeros((1, 2), np.float32)), [[1.0, 1.0]]
    )  # 0 + 1: the new program, not 0 * 2
    assert sorted(os.listdir(tmp_path)) == ["a"]  # nothing left beside it
    (tmp_path / "file").write_text("keep")
    with pytest.raises(mirrax.errors.ExistingPathError, match="is a file"):
        _small_artifact(tmp_path / "file")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep")
    with pytest.raises(mirrax.errors.ExistingPathError, match="holds no mirrax export"):
        _small_artifact(tmp_path / "home")
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep"


def test_platforms_given_as_one_string_and_unknown_platforms(tmp_path):
    mirrax.export(
        lambda x: x, tmp_path / "a", jax.ShapeDtypeStruct((-1, 2), jnp.float32), platforms="cpu"
    )  # was: lowered for "c", "p", "u"
    assert mirrax.load_exported(tmp_path / "a").platforms == ("cpu",)
    with pytest.raises(mirrax.errors.InvalidArgumentError, match=r"\['gpu'\] unknown"):
        mirrax.export(
            lambda x: x, tmp_path / "b", jax.ShapeDtypeStruct((-1, 2), jnp.float32), platforms=["gpu"]
        )


# -- list signatures, wrapped and foreign inputs, signatures the model cannot take (issue 11) ----


class _Features8(nnx.Module):
    """y = x @ W + b with W = 1 everywhere (8 -> 3) and b = (0, 1, 2): each output is the sum
    of the 8 features plus 0, 1 or 2, checkable by hand."""

    def __init__(self):
        self.linear = nnx.Linear(8, 3, rngs=nnx.Rngs(0), kernel_init=nnx.initializers.ones)
        self.linear.bias[...] = jnp.arange(3.0)

    def __call__(self, x):
        return self.linear(x)


_X8 = np.arange(32, dtype=np.float32).reshape(4, 8)
# Row i holds 8i .. 8i+7, whose sum is 64i + 28: row i of the output is 64i + 28 + (0, 1, 2).
_Y8 = (64.0 * np.arange(4) + 28.0)[:, None] + np.arange(3.0)


def test_a_list_signature_is_the_positional_inputs_as_tf_function(tmp_path):
    # TF habit: input_signature=[tf.TensorSpec((None, 8))] is one positional argument x.
    model = mirrax.Model(_Features8())
    mirrax.export(model, tmp_path / "m", [jax.ShapeDtypeStruct((-1, 8), jnp.float32)])
    served = mirrax.load_exported(tmp_path / "m")
    assert served.positional
    np.testing.assert_array_equal(served(_X8), _Y8)  # was: a structure error
    # Sums of whole numbers below 2**24: exact in float32.
    with pytest.raises(
        mirrax.errors.InvalidExportInputError,
        match=r"received \['float32\[4, 8\]'\] \(a list\) at positional input 0",
    ):
        served([_X8])  # was: output of shape (1, 4, 3), the list stacked into one array
    with pytest.raises(
        mirrax.errors.InvalidExportInputError, match=r"takes 1 positional input\(s\).*received 2"
    ):
        served(_X8, _X8)
    metadata = json.loads((tmp_path / "m" / "metadata.json").read_text())
    assert metadata["positional"] is True and metadata["format_version"] == 2
    assert metadata["input_signature"] == [{"shape": [None, 8], "dtype": "float32"}]


def test_two_positional_inputs_run_the_function_with_two_arguments(tmp_path):
    signature = (jax.ShapeDtypeStruct((-1, 2), jnp.float32), jax.ShapeDtypeStruct((-1,), jnp.float32))
    mirrax.export(lambda a, b: a * b[:, None], tmp_path, signature)
    served = mirrax.load_exported(tmp_path)
    out = served(np.full((3, 2), 2.0, np.float32), np.full((3,), 5.0, np.float32))
    np.testing.assert_array_equal(out, np.full((3, 2), 10.0))  # 2 * 5
    with pytest.raises(mirrax.errors.InvalidExportInputError, match="received 1"):
        served(np.ones((3, 2), np.float32))


def test_a_bare_signature_stays_one_input_and_refuses_a_list_or_two_arguments(tmp_path):
    mirrax.export(_Features8(), tmp_path, jax.ShapeDtypeStruct((-1, 8), jnp.float32))
    served = mirrax.load_exported(tmp_path)
    assert not served.positional
    assert json.loads((tmp_path / "metadata.json").read_text())["format_version"] == 1
    np.testing.assert_array_equal(served(_X8), _Y8)
    with pytest.raises(
        mirrax.errors.InvalidExportInputError,
        match=r"received \['float32\[4, 8\]'\] \(a list\) where the signature "
        r"expects one array float32\[None, 8\]",
    ):
        served([_X8])  # was: jax's raw "must have the same pytree structure" ValueError
    with pytest.raises(mirrax.errors.InvalidExportInputError, match="received 2 arguments"):
        served(_X8, _X8)
    with pytest.raises(mirrax.errors.InvalidExportInputError, match=r"received a str \('abc'\)"):
        served("abc")


def test_torch_tensors_are_served_as_numpy(tmp_path):
    torch = pytest.importorskip("torch")
    mirrax.export(_Features8(), tmp_path, jax.ShapeDtypeStruct((-1, 8), jnp.float32))
    served = mirrax.load_exported(tmp_path)
    x = torch.tensor(_X8, requires_grad=True)  # grad-tracking: .numpy() alone would refuse it
    np.testing.assert_array_equal(served(x), _Y8)  # was: TypeError "Cannot interpret 'torch.float32'"
    with pytest.raises(mirrax.errors.InvalidExportInputError, match="dtype float64"):
        served(torch.zeros((4, 8), dtype=torch.float64))


def test_a_signature_the_model_cannot_take_is_refused_before_writing(tmp_path):
    model = mirrax.Model(_Features8())
    with pytest.raises(mirrax.errors.IncompatibleInputError) as info:
        mirrax.export(model, tmp_path / "m", jax.ShapeDtypeStruct((-1, 9), jnp.float32))
    message = str(info.value)
    # Was: jax's raw TypeError from dot_general.
    assert "input_signature float32[None, 9]" in message
    assert "dot_general requires contracting dimensions to have the same shape" in message
    assert "test_export.py:" in message  # the model's line: _Features8.__call__
    assert "Nothing was written" in message
    assert os.listdir(tmp_path) == []
    # Two positional inputs for a module that takes one: says what a list signature means.
    with pytest.raises(
        mirrax.errors.IncompatibleInputError,
        match=r"2 positional input\(s\) \(a list signature is one entry per",
    ):
        mirrax.export(model, tmp_path / "m", [jax.ShapeDtypeStruct((-1, 8), jnp.float32)] * 2)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_an_empty_batch_is_refused_by_the_exported_model(tmp_path):
    module = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    mirrax.export(module, tmp_path / "artifact", jax.ShapeDtypeStruct((-1, 2), jnp.float32))
    serve = mirrax.load_exported(tmp_path / "artifact")
    assert serve(np.ones((1, 2), np.float32)).shape == (1, 3)
    # jax.export's symbolic batch size is >= 1; 0 rows used to be a raw jax ValueError.
    with pytest.raises(mirrax.errors.InvalidExportInputError, match="a batch of 0 examples"):
        serve(np.zeros((0, 2), np.float32))
