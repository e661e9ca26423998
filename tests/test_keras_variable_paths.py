"""A Keras model's variables in `mirrax.Model` are named by Keras's variable paths: the NNX
state keys, get_weights() order, summary(), TensorBoard's histogram tags and checkpoint keys;
a checkpoint written when they were keyed by position still restores (or is refused, saying
why)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from flax import nnx  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from mirrax._src.training.keras_names import checkpoint_aliases, state_keys  # noqa: E402
from tests.test_training_callbacks import read_scalars  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)

X = np.arange(32, dtype=np.float32).reshape(8, 4) / 32.0
Y = np.arange(32, dtype=np.float32).reshape(8, 4) / 32.0


def _keras_net(extra: bool = False, name: str = "seq"):
    """Dense(4) -> BatchNormalization -> Dropout -> Dense(4) [-> Dense(2)]: two (4, 4) kernels
    and six (4,) vectors, so a mix-up by position would not show in the shapes."""
    stack = [
        keras.Input((4,)),
        layers.Dense(4, name="dense"),
        layers.BatchNormalization(name="batch_normalization"),
        layers.Dropout(0.5),
        layers.Dense(4, name="dense_1"),
    ]
    if extra:
        stack.append(layers.Dense(2, name="dense_2"))
    keras.utils.set_random_seed(0)
    return keras.Sequential(stack, name=name)


def _compiled(keras_model):
    model = mirrax.Model(keras_model)
    model.compile(optimizer="adam", loss="mse")
    return model


WEIGHT_PATHS = [
    "seq/dense/kernel",
    "seq/dense/bias",
    "seq/batch_normalization/gamma",
    "seq/batch_normalization/beta",
    "seq/batch_normalization/moving_mean",
    "seq/batch_normalization/moving_variance",
    "seq/dense_1/kernel",
    "seq/dense_1/bias",
]


def test_the_state_is_keyed_by_keras_paths_and_get_weights_keeps_keras_order():
    keras_model = _keras_net()
    model = mirrax.Model(keras_model)
    paths = [path for path, _ in nnx.to_flat_state(nnx.state(model.module))]
    assert [p for p in paths if p[0] == "variables" and p[-1] != "seed_generator_state"] == sorted(
        ("variables",) + tuple(p.split("/")) for p in WEIGHT_PATHS
    )
    assert model.module.variables["seq"]["dense"]["kernel"].get_value().shape == (4, 4)
    seed = [v.path for v in keras_model.variables if v.name == "seed_generator_state"]
    assert ("seed_counts",) + tuple(seed[0].split("/")) in paths
    assert [w.path for w in keras_model.weights] == WEIGHT_PATHS
    for ours, theirs in zip(model.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_duplicate_and_prefix_clashing_paths_get_deterministic_suffixes():
    assert state_keys(
        ["m/same/kernel", "m/same/bias", "m/same/kernel", "m/same/bias", "a/b", "a/b/c", "x/y/z", "x/y"]
    ) == (
        ("m", "same", "kernel"),
        ("m", "same", "bias"),
        ("m", "same", "kernel_1"),
        ("m", "same", "bias_1"),
        ("a", "b"),
        ("a", "b_1", "c"),
        ("x", "y", "z"),
        ("x", "y_1"),
    )

    class TwoSame(keras.Model):  # Keras gives both layers' kernels the path "two/same/kernel"
        def __init__(self):
            super().__init__(name="two")
            self.first, self.second = layers.Dense(2, name="same"), layers.Dense(2, name="same")

        def call(self, x):
            return self.second(self.first(x))

    keras_model = TwoSame()
    with jax.numpy_rank_promotion("allow"):  # Keras adds the bias by broadcasting
        keras_model(X[:1, :2])
    assert [v.path for v in keras_model.variables] == ["two/same/kernel", "two/same/bias"] * 2
    model = mirrax.Model(keras_model)
    assert model.module.names == ("two/same/kernel", "two/same/bias", "two/same/kernel_1", "two/same/bias_1")
    np.testing.assert_array_equal(
        model.module.variables["two"]["same"]["kernel_1"].get_value(), keras_model.second.kernel.value
    )


def test_a_nested_sequential_and_a_shared_layer():
    inner = keras.Sequential([layers.Dense(3, name="d1"), layers.Dense(3, name="d2")], name="inner")
    shared = layers.Dense(3, name="shared")
    x = keras.Input((4,))
    keras_model = keras.Model(x, layers.Dense(4, name="out")(shared(shared(inner(x)))), name="outer")
    model = _compiled(keras_model)
    # The shared layer's two variables appear once; the inner model's under its name.
    assert model.module.names == (
        "inner/d1/kernel",
        "inner/d1/bias",
        "inner/d2/kernel",
        "inner/d2/bias",
        "shared/kernel",
        "shared/bias",
        "out/kernel",
        "out/bias",
    )
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    model.module.write_to_keras()
    for ours, theirs in zip(model.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    optimizer_paths = [p for p, _ in nnx.to_flat_state(nnx.state(model.optimizer.nnx_optimizer))]
    assert any(p[-4:] == ("variables", "inner", "d2", "kernel") for p in optimizer_paths)


def test_summary_is_keras_summary_and_a_bare_layer_lists_its_paths():
    lines = []
    _compiled(_keras_net()).summary(print_fn=lines.append, show_trainable=True)
    text = "\n".join(lines)
    assert "dense (Dense)" in text and "batch_normalization" in text and "dense_1 (Dense)" in text
    # 4*4 + 4 (dense) + 4*4 (batch norm: gamma, beta, mean, variance) + 4*4 + 4 (dense_1) = 56
    assert "Total params: 56" in text and "variables." not in text
    dense = layers.Dense(2, name="lone")
    dense.build((None, 3))
    lines = []
    mirrax.Model(dense).summary(print_fn=lines.append)
    assert [line.split()[0] for line in lines[2:4]] == ["lone/kernel", "lone/bias"]
    assert lines[-1] == "Total: 8 values"  # 3*2 + 2


@pytest.mark.slow
def test_tensorboard_histograms_are_tagged_as_keras_tags_them(tmp_path):
    keras_model = _keras_net()
    model = _compiled(keras_model)
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[mirrax.callbacks.TensorBoard(tmp_path, histogram_freq=1)],
    )
    histograms = {tag for tag, points in read_scalars(tmp_path / "train").items() if points == [(0, None)]}
    # Keras's callback: f"{weight.path}/histogram" for each weight of each layer.
    assert histograms == {f"{w.path}/histogram" for layer in keras_model.layers for w in layer.weights}
    assert "seq/dense/kernel/histogram" in histograms


@pytest.mark.slow
def test_a_checkpoint_round_trip_is_keyed_by_name_not_position(tmp_path):
    model = _compiled(_keras_net())
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    mirrax.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    model.save_weights(str(tmp_path / "weights"))
    again = _compiled(_keras_net())
    mirrax.Checkpoint(model=again).read(str(tmp_path / "ckpt"))
    for ours, theirs in zip(again.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    other = mirrax.Model(_keras_net())
    other.load_weights(str(tmp_path / "weights"))
    np.testing.assert_array_equal(other.get_weights()[6], model.get_weights()[6])
    # The same shapes under other layer names: refused, never loaded by position.
    renamed = mirrax.Model(_keras_net(name="other"))
    with pytest.raises(
        mirrax.errors.IncompatibleCheckpointError,
        match=r"\['variables'\]\['other'\]\['dense'\]\['kernel'\] is missing",
    ):
        renamed.load_weights(str(tmp_path / "weights"))


class _Positional(nnx.Module):
    """The layout mirrax wrote before Keras paths: variables.<i> in `keras_model.variables`
    order, seed_counts.<j> (one seed here), as the same classes of NNX variables."""

    def __init__(self, module):
        self.variables = nnx.List([type(v)(v.get_value()) for v in module.variable_list])
        self.seed_counts = nnx.List([nnx.RngCount(jnp.asarray(5, jnp.uint32))])

    def number(self):
        """Variable i (0-based) holds i + 1 in every element."""
        for i, v in enumerate(self.variables):
            v.set_value(jnp.full(v.get_value().shape, i + 1, v.get_value().dtype))


class _OldModel:
    def __init__(self, module, optimizer):
        self.children = {"module": module, "optimizer": optimizer}

    def checkpoint_children(self):
        return self.children


def _old_checkpoint(path, model):
    """A full checkpoint and a save_weights directory in the positional layout, written through
    mirrax.Checkpoint (the same Orbax writer), with an optimizer that took one step."""
    old = _Positional(model.module)
    optimizer = nnx.Optimizer(old, model.optimizer.nnx_optimizer.tx, wrt=nnx.Param)
    optimizer.update(old, nnx.state(old, nnx.Param))  # moments that differ per variable
    old.number()
    mirrax.Checkpoint(model=_OldModel(old, optimizer)).write(str(path / "full"))
    mirrax.Checkpoint(weights=old).write(str(path / "weights"))
    return old, optimizer


def test_a_checkpoint_keyed_by_position_restores_each_variable_to_its_own_place(tmp_path):
    model = _compiled(_keras_net())
    old, optimizer = _old_checkpoint(tmp_path, model)
    status = mirrax.Checkpoint(model=model).read(str(tmp_path / "full"))
    status.assert_consumed()
    keras_variables = model.keras_model.variables
    assert keras_variables[6].name == "seed_generator_state"  # Dropout's
    for i, variable in enumerate(model.module.variable_list):
        if i != 6:  # variable i (0-based) of keras_model.variables was stored as i + 1
            assert np.all(np.asarray(variable.get_value()) == i + 1), keras_variables[i].path
    # The seed's count came back: Keras's state is its key advanced by 5 in its second word.
    model.module.write_to_keras()
    np.testing.assert_array_equal(np.asarray(keras_variables[6].value), [7, 7 + 5])
    moments = {p: v for p, v in nnx.to_flat_state(nnx.state(model.optimizer.nnx_optimizer))}
    old_moments = {p: v for p, v in nnx.to_flat_state(nnx.state(optimizer))}
    for old_path, value in old_moments.items():
        new_path = old_path
        if "variables" in old_path:
            i = old_path[-1]
            new_path = old_path[:-1] + tuple(keras_variables[i].path.split("/"))
        np.testing.assert_array_equal(
            np.asarray(moments[new_path].get_value()), np.asarray(value.get_value())
        )
    fresh = mirrax.Model(_keras_net())
    fresh.load_weights(str(tmp_path / "weights"))
    assert [float(np.asarray(w).flat[0]) for w in fresh.get_weights()] == [1, 2, 3, 4, 5, 6, 8, 9]


def test_a_positional_checkpoint_of_another_model_is_refused_with_the_fix(tmp_path):
    bigger = _compiled(_keras_net(extra=True))
    _old_checkpoint(tmp_path, bigger)
    model = _compiled(_keras_net())
    before = model.get_weights()
    with pytest.raises(
        mirrax.errors.IncompatibleCheckpointError,
        match=r"keyed by position, variables/0, \.\.\., as mirrax wrote them "
        r"before, restores only into the model that wrote it",
    ):
        mirrax.Checkpoint(model=model).read(str(tmp_path / "full"))
    for ours, theirs in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(ours, theirs)  # nothing was changed


def test_the_same_model_built_again_in_the_process_restores_despite_keras_renumbering(tmp_path):
    def build():  # auto-named: Keras numbers each build's layers further on
        keras.utils.set_random_seed(len(str(tmp_path)))
        return keras.Sequential([keras.Input((4,)), layers.Dense(4), layers.Dropout(0.5), layers.Dense(4)])

    model = _compiled(build())
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    mirrax.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    again = _compiled(build())
    assert again.module.names != model.module.names
    mirrax.Checkpoint(model=again).read(str(tmp_path / "ckpt")).assert_consumed()
    for ours, theirs in zip(again.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert int(again.optimizer.iterations) == 1  # 8 examples, batch 8: one step


def test_renumbered_names_match_by_rank_not_by_text():
    keys = (("sequential_9", "dense_9", "kernel"), ("sequential_9", "dense_10", "kernel"))
    stored = [
        ("variables", "sequential_12", "dense_19", "kernel"),
        ("variables", "sequential_12", "dense_20", "kernel"),
    ]
    alias = checkpoint_aliases(keys, (False, False), stored)
    # dense_9 < dense_10 by number (not as text, where "dense_10" < "dense_9"): ranks 0 and 1,
    # as dense_19 and dense_20.
    assert alias(("variables", "sequential_9", "dense_10", "kernel")) == stored[1]
    assert alias(("opt", "mu", "variables", "sequential_9", "dense_9", "kernel")) == ("opt", "mu") + stored[0]
    assert alias(("step",)) is None
    assert checkpoint_aliases(keys, (False, False), stored[:1]) is None  # one variable short
    assert checkpoint_aliases(keys, (False, False), [("variables", "0"), ("variables", "1")])(
        keys and ("variables",) + keys[1]
    ) == ("variables", "1")


def test_layer_names_of_digits_or_dots_save_and_load(tmp_path):
    keras_model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(4, name="0"), layers.Dense(4, name="a.b")], name="s"
    )
    model = mirrax.Model(keras_model)
    assert model.module.names == ("s/0/kernel", "s/0/bias", "s/a.b/kernel", "s/a.b/bias")
    model.save_weights(str(tmp_path / "weights"))
    again = mirrax.Model(keras.models.clone_model(keras_model))
    again.load_weights(str(tmp_path / "weights"))
    for ours, theirs in zip(again.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_an_nnx_module_with_a_sequence_still_restores_its_integer_keys(tmp_path):
    # The restore maps Orbax's string keys back to the state's own: ints for nnx.List.
    module = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 1, rngs=nnx.Rngs(1)))
    mirrax.Checkpoint(net=module).write(str(tmp_path / "ckpt"))
    other = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(2)), nnx.Linear(2, 1, rngs=nnx.Rngs(3)))
    mirrax.Checkpoint(net=other).read(str(tmp_path / "ckpt")).assert_consumed()
    np.testing.assert_array_equal(other.layers[1].kernel.get_value(), module.layers[1].kernel.get_value())


def test_backup_and_restore_resumes_from_a_backup_keyed_by_position(tmp_path):
    model = _compiled(_keras_net())
    old, optimizer = _old_checkpoint(tmp_path, model)
    backup = mirrax.Checkpoint(model=_OldModel(old, optimizer), epoch=1, step=0)
    mirrax.CheckpointManager(backup, str(tmp_path / "backup"), max_to_keep=2).save()
    seen = {}
    record = mirrax.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: seen.setdefault(epoch, model.get_weights())
    )
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[mirrax.callbacks.BackupAndRestore(str(tmp_path / "backup")), record],
    )
    assert list(seen) == [1]  # the backup's epoch 1 resumes; epoch 0 is not run again
    # get_weights() leaves out the seed state (variable 6): variables 0-5, 7, 8 hold i + 1.
    assert [float(np.asarray(w).flat[0]) for w in seen[1]] == [1, 2, 3, 4, 5, 6, 8, 9]


@pytest.mark.slow
def test_trainable_variables_follow_the_gradients_leaves_and_the_optimizer_maps_them_back():
    # Layers named "dense_2" and "dense_10": the state sorts the paths as text ("dense_10" <
    # "dense_2", "bias" < "kernel"), so the gradients' leaves are in that order, and so are
    # model.trainable_variables; KerasOptimizer puts each pair back in Keras's order.
    keras_model = keras.Sequential(
        [keras.Input((3,)), layers.Dense(2, name="dense_2"), layers.Dense(4, name="dense_10")], name="s"
    )
    model = mirrax.Model(keras_model)
    optimizer = mirrax.KerasOptimizer(model, keras.optimizers.SGD(0.5))
    before = [np.asarray(w) for w in model.get_weights()]  # Keras order: d2 k, b; d10 k, b

    def loss_fn(module):
        return sum(
            jnp.sum(jnp.arange(v.size, dtype=jnp.float32).reshape(v.shape) * v[...])
            for v in module.keras_trainable_variables
        )

    gradients = mirrax.value_and_grad(loss_fn)(model.module)[1]
    assert [v.shape for v in model.trainable_variables] == [(4,), (2, 4), (2,), (3, 2)]
    pairs = list(zip(jax.tree.leaves(gradients), model.trainable_variables))
    assert all(g.shape == v.shape for g, v in pairs)
    optimizer.apply_gradients(pairs)
    # d(loss)/dw = arange(size) in w's shape, so SGD(0.5) moves each weight by -0.5 * its index.
    for old, new in zip(before, model.get_weights(), strict=True):
        step = 0.5 * np.arange(old.size, dtype=np.float32).reshape(old.shape)
        np.testing.assert_allclose(new, old - step, rtol=1e-6)
