"""Several outputs in compile / fit / evaluate, as Keras 3: a loss per output (list or dict),
per-output loss_weights and metrics, the "<output>_loss" and "<output>_<metric>" logs, per-output
sample weights, and the refusals (docs/training.md, "Several outputs")."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from flax import nnx  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from mirrax import errors  # noqa: E402
from tests.conftest import mirrored  # noqa: E402

pytestmark = [pytest.mark.xdist_group("multi_output"), pytest.mark.slow]

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 4)).astype(np.float32)
Y_REG = RNG.normal(size=(32, 1)).astype(np.float32)
Y_CLS = RNG.integers(0, 3, size=(32,)).astype(np.int32)
Y = {"reg": Y_REG, "cls": Y_CLS}
KEYS = ["loss", "reg_loss", "cls_loss", "cls_accuracy"]


def _two_headed():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, [layers.Dense(1, name="reg")(hidden), layers.Dense(3, name="cls")(hidden)])


_INITIAL = _two_headed()


def _copy():
    model = keras.models.clone_model(_INITIAL)
    model.set_weights(_INITIAL.get_weights())
    return model


def _compile_args(**overrides):
    args = dict(
        loss={"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        loss_weights={"reg": 0.5, "cls": 1.0},
        metrics={"cls": ["accuracy"]},
    )
    return {**args, **overrides}


def _mirrax_fit(strategy, **fit_args):
    with strategy.scope():
        model = mirrax.Model(_copy())
        # Plain SGD: Keras's SGD(0.1) is w -= 0.1 * g too (optax.sgd logs no learning_rate).
        model.compile(optimizer=optax.sgd(0.1), **_compile_args())
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, **fit_args)
    return model, history.history


@pytest.fixture(scope="module")
def keras_run():
    reference = _copy()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), **_compile_args())
    with jax.numpy_rank_promotion("allow"):  # Keras's own Dense broadcasts its bias by rank
        history = reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return reference.get_weights(), history


@pytest.fixture(scope="module")
def one_replica():
    return _mirrax_fit(mirrored(1))


def test_two_outputs_fit_as_keras_fits_them(keras_run, one_replica):
    keras_weights, keras_history = keras_run
    model, history = one_replica
    # Float32 sums in another order (per-example weighted sum vs Keras's per-output means).
    for mine, theirs in zip(model.get_weights(), keras_weights):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert sorted(history) == sorted(keras_history) == sorted(KEYS)
    assert model.metrics_names == KEYS  # Keras's log order: total, per-output losses, metrics
    for key in KEYS:
        np.testing.assert_allclose(history[key], keras_history[key], atol=1e-5)


@pytest.mark.parametrize("replicas", [2, 4])
def test_two_outputs_fit_the_same_on_2_and_4_replicas(one_replica, replicas):
    model, history = _mirrax_fit(mirrored(replicas))
    # Gradients summed over replicas in another order: float32 round-off only.
    for mine, single in zip(model.get_weights(), one_replica[0].get_weights()):
        np.testing.assert_allclose(mine, single, atol=1e-6)
    for key in KEYS:
        np.testing.assert_allclose(history[key], one_replica[1][key], atol=1e-6)


def test_evaluate_lists_the_total_then_each_output_loss_then_the_metrics(one_replica, capsys):
    model, _ = one_replica
    logs = model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)
    assert list(logs) == KEYS
    model.evaluate(X, Y, batch_size=8, verbose=2)  # the progress bar's line shows every key
    line = capsys.readouterr().out.splitlines()[-1]
    assert [part.split(":")[0] for part in line.split(" - ")[2:]] == KEYS
    assert model.evaluate(X, Y, batch_size=8, verbose=0) == pytest.approx(list(logs.values()))
    # The total is the weighted sum of the (unweighted) per-output losses.
    assert logs["loss"] == pytest.approx(0.5 * logs["reg_loss"] + logs["cls_loss"], rel=1e-6)
    assert list(model.get_metrics_result()) == KEYS
    predictions = model.predict(X, batch_size=8, verbose=0)
    assert [p.shape for p in predictions] == [(32, 1), (32, 3)]


class Pair(nnx.Module):
    """y_1 = x w (w = 1), y_2 = logits x v over 2 classes (v = 0)."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((1, 1)))
        self.v = nnx.Param(jnp.zeros((1, 2)))

    def __call__(self, x):
        return x @ self.w[...], x @ self.v[...]


def _pair(**compile_args):
    model = mirrax.Model(Pair())
    args = dict(
        optimizer=optax.sgd(0.1),
        loss=["mse", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)],
        loss_weights=[0.5, 1.0],
    )
    model.compile(**{**args, **compile_args})
    return model


PAIR_X = np.array([[1.0], [2.0]], np.float32)
PAIR_Y = (np.zeros((2, 1), np.float32), np.array([0, 1]))


def test_one_step_of_a_tuple_output_module_by_hand():
    model = _pair()
    logs = model.train_on_batch(PAIR_X, {"output_1": PAIR_Y[0], "output_2": PAIR_Y[1]}, return_dict=True)
    # output_1: predictions 1, 2 against 0: mse = (1 + 4) / 2 = 2.5.
    # output_2: zero logits over 2 classes: ce = ln 2 for each example.
    # loss = 0.5 * 2.5 + 1.0 * ln 2 = 1.25 + 0.693147 = 1.943147 (per-output losses unweighted).
    assert list(logs) == ["loss", "output_1_loss", "output_2_loss"]
    assert logs["output_1_loss"] == pytest.approx(2.5)
    assert logs["output_2_loss"] == pytest.approx(math.log(2))
    assert logs["loss"] == pytest.approx(1.25 + math.log(2))
    v, w = model.get_weights()  # by path: "v" before "w"
    # d/dw 0.5 * mean((x w)^2) = 0.5 * mean(2 x^2 w) = 0.5 * (2 + 8) / 2 = 2.5: w = 1 - 0.25.
    np.testing.assert_allclose(w, [[0.75]], rtol=1e-6)
    # d ce / d logits = softmax - onehot: [-0.5, 0.5] (label 0), [0.5, -0.5] (label 1);
    # dv = mean(x * that) = (1 * [-0.5, 0.5] + 2 * [0.5, -0.5]) / 2 = [0.25, -0.25].
    np.testing.assert_allclose(v, [[-0.025, 0.025]], rtol=1e-6)


def test_per_output_sample_weights_weight_each_outputs_gradient_on_2_replicas():
    strategy = mirrored(2)
    with strategy.scope():
        model = _pair()
    train = model.make_train_function()
    weights = {"output_1": np.array([1.0, 0.0], np.float32), "output_2": np.ones(2, np.float32)}
    for batch in strategy.experimental_distribute_dataset([(PAIR_X, PAIR_Y, weights)]):
        train(batch)  # one row per replica
    logs = model.get_metrics_result()
    # output_1: (1 * 1 + 0 * 4) / 2 = 0.5; loss = 0.5 * 0.5 + ln 2.
    assert logs["output_1_loss"] == pytest.approx(0.5)
    assert logs["loss"] == pytest.approx(0.25 + math.log(2))
    v, w = model.get_weights()
    # d/dw 0.5 * (1 * (1 w)^2 + 0) / 2 = 0.5 * 2 w / 2 = 0.5: w = 1 - 0.1 * 0.5 = 0.95; v as
    # in the unweighted step (output_2's weights are 1).
    np.testing.assert_allclose(w, [[0.95]], rtol=1e-6)
    np.testing.assert_allclose(v, [[-0.025, 0.025]], rtol=1e-6)


def test_per_output_sample_weights_and_a_shared_one():
    strategy = mirrored(2)
    with strategy.scope():
        model = _pair()
    test = model.make_test_function()
    x = np.array([[1.0], [2.0], [1.0], [2.0]], np.float32)
    y = (np.zeros((4, 1), np.float32), np.array([0, 1, 0, 1]))
    for weights, reg_loss, cls_weight in [
        # output_1's weights [1, 0, 1, 0]: (1 + 0 + 1 + 0) / 4 = 0.5; output_2's all 1.
        ((np.array([1, 0, 1, 0], np.float32), np.ones(4, np.float32)), 0.5, 1.0),
        (
            {"output_1": np.ones(4, np.float32), "output_2": np.full(4, 2.0, np.float32)},
            2.5,
            2.0,
        ),  # (1 + 4 + 1 + 4) / 4 = 2.5; ce doubled
        (np.full(4, 3.0, np.float32), 7.5, 3.0),
    ]:  # one array for both outputs
        model.reset_metrics()
        for batch in strategy.experimental_distribute_dataset([(x, y, weights)]):
            test(batch)
        logs = model.get_metrics_result()
        assert logs["output_1_loss"] == pytest.approx(reg_loss)
        assert logs["output_2_loss"] == pytest.approx(cls_weight * math.log(2))
        assert logs["loss"] == pytest.approx(0.5 * reg_loss + cls_weight * math.log(2))


def test_y_as_a_list_of_batches_and_a_dict_for_a_tuple_output():
    model = _pair()
    as_tuple = model.evaluate([(PAIR_X, PAIR_Y)], verbose=0)
    as_dict = model.evaluate([(PAIR_X, {"output_2": PAIR_Y[1], "output_1": PAIR_Y[0]})], verbose=0)
    assert as_tuple == pytest.approx([1.25 + math.log(2), 2.5, math.log(2)])
    assert as_dict == pytest.approx(as_tuple)


def test_a_skipped_output_and_one_loss_for_every_output():
    model = _pair(loss=["mse", None], loss_weights=None)
    # One loss left: no per-output logs (as Keras), loss = mse = 2.5.
    assert model.evaluate([(PAIR_X, PAIR_Y)], verbose=0, return_dict=True) == {"loss": 2.5}
    with mirrored(1).scope():
        model = mirrax.Model(_copy())
        model.compile(optimizer="sgd", loss="mse", metrics=["mae", None])
    assert model.metrics_names == ["loss", "reg_loss", "cls_loss", "reg_mae"]
    logs = model.evaluate(
        X, {"reg": Y_REG, "cls": np.zeros((32, 3))}, batch_size=8, verbose=0, return_dict=True
    )
    assert logs["loss"] == pytest.approx(logs["reg_loss"] + logs["cls_loss"], rel=1e-6)


def test_accuracy_resolves_by_each_outputs_loss_and_names_follow_keras():
    model = _pair(
        loss=["binary_crossentropy", "sparse_categorical_crossentropy"],
        metrics=[["accuracy"], ["accuracy", "accuracy"]],
        weighted_metrics={"output_2": ["accuracy"]},
    )
    assert [type(m).__name__ for m in model.metrics] == [
        "BinaryAccuracy",
        "SparseCategoricalAccuracy",
        "SparseCategoricalAccuracy",
        "SparseCategoricalAccuracy",
    ]
    # Keras 3's CompileMetrics.result: "<output>_<name>", a taken one "_1"; a taken weighted
    # name "<output>_weighted_<name>".
    assert model.metrics_names == [
        "loss",
        "output_1_loss",
        "output_2_loss",
        "output_1_accuracy",
        "output_2_accuracy",
        "output_2_accuracy_1",
        "output_2_weighted_accuracy",
    ]


class Named(nnx.Module):
    def __init__(self):
        self.a, self.b = nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.Linear(2, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return {"out_b": self.b(x), "out_a": self.a(x)}


def test_early_stopping_monitors_one_outputs_validation_loss(tmp_path):
    model = mirrax.Model(Named())
    model.compile(optimizer=optax.sgd(0.01), loss={"out_a": "mse", "out_b": "mse"})
    x, y = np.ones((8, 2), np.float32), {"out_a": np.zeros((8, 1)), "out_b": np.ones((8, 1))}
    # min_delta=100: no epoch improves on the first, so patience=1 stops after epoch 2; a
    # monitor missing from the logs would only warn and train all 10 epochs.
    stop = mirrax.callbacks.EarlyStopping(monitor="val_out_b_loss", min_delta=100, patience=1)
    csv = mirrax.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(
            x, y, batch_size=4, epochs=10, validation_data=(x, y), verbose=0, callbacks=[stop, csv]
        ).history
    keys = ["loss", "out_a_loss", "out_b_loss", "val_loss", "val_out_a_loss", "val_out_b_loss"]
    assert sorted(history) == keys
    assert len(history["loss"]) == 2
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0] == ",".join(["epoch"] + keys) and len(lines) == 3  # the header, 2 epochs


def test_replica_invariant_mode_gives_the_same_bits_on_1_and_4_replicas():
    x = RNG.normal(size=(8, 1)).astype(np.float32)
    y = (RNG.normal(size=(8, 1)).astype(np.float32), RNG.integers(0, 2, size=(8,)))
    runs = []
    for replicas in (1, 4):
        strategy = mirrax.MirroredStrategy(jax.devices()[:replicas], replica_invariant=True, micro_batches=4)
        with strategy.scope():
            model = _pair()
        history = model.fit(
            x, {"output_1": y[0], "output_2": y[1]}, batch_size=8, epochs=1, shuffle=False, verbose=0
        ).history
        runs.append((history, model.get_weights()))
    assert list(runs[0][0]) == ["loss", "output_1_loss", "output_2_loss"]
    assert runs[0][0] == runs[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_two_steps_per_execution_fit_as_one(one_replica):
    with mirrored(2).scope():
        model = mirrax.Model(_copy())
        model.compile(optimizer=optax.sgd(0.1), steps_per_execution=2, **_compile_args())
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    # 2 replicas vs 1: gradients summed in another order, float32 round-off only.
    for a, b in zip(model.get_weights(), one_replica[0].get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for key in KEYS:
        np.testing.assert_allclose(history[key], one_replica[1][key], atol=1e-6)


def _keras_compile(**overrides):
    model = mirrax.Model(_copy())
    model.compile(optimizer="sgd", **_compile_args(**overrides))
    return model


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"loss": {"reg": "mse", "clss": "mse"}},
            "compile: loss is a dict with the keys ['reg', 'clss'], but the model's outputs are ['reg', "
            "'cls'] (['clss'] name no output) (['cls'] have none). Key loss by these output names "
            "(None skips an output).",
        ),
        (
            {"loss": ["mse"], "loss_weights": None},
            "compile: loss is a list of 1, but the model has 2 output(s) ['reg', 'cls']. Give one entry "
            "per output, in this order (None skips an output), or a dict keyed by these names.",
        ),
        (
            {"loss_weights": [0.5, 1.0, 2.0]},
            "compile: loss_weights is a list of 3, but the model has 2 output(s) ['reg', 'cls'].",
        ),
        (
            {"loss_weights": {"reg": 0.5}},
            "compile: loss_weights is a dict with the keys ['reg'], but the model's outputs are ['reg', "
            "'cls'] (['cls'] have none). Key loss_weights by these output names (1.0 for an output "
            "whose loss is not scaled).",
        ),
        (
            {"loss_weights": 0.5},
            "compile: loss_weights=0.5 is one float, but the model has 2 outputs ['reg', 'cls'].",
        ),
        (
            {"metrics": [["accuracy"]]},
            "compile: metrics=[['accuracy']] does not match the model's 2 outputs ['reg', 'cls']: for "
            "several outputs pass a list with one entry per output",
        ),
        (
            {"weighted_metrics": {"class": ["accuracy"]}},
            "compile: weighted_metrics={'class': ['accuracy']} does not match the model's 2 outputs",
        ),
    ],
)
def test_compile_refuses_what_does_not_match_the_outputs(overrides, message):
    with pytest.raises(errors.InvalidArgumentError) as caught:
        _keras_compile(**overrides)
    assert str(caught.value).startswith(message)


def test_class_weight_is_refused_with_several_outputs():
    model = _keras_compile()
    with pytest.raises(
        errors.UnsupportedArgumentError,
        match=r"class_weight is not supported "
        r"for a model of several outputs \['reg', 'cls'\] \(Keras 3 refuses it",
    ):
        model.fit(X, Y, class_weight={0: 1.0, 1: 2.0}, verbose=0)


def test_the_preflight_names_the_output():
    model = _keras_compile()
    with pytest.raises(
        errors.IncompatibleInputError,
        match=r"fit \(output 'reg'\): mean_squared_"
        r"error: y_true of shape \(1, 2\) does not match y_pred of shape \(1, 1\)",
    ):
        model.fit(X, {"reg": np.zeros((32, 2)), "cls": Y_CLS}, verbose=0)
    with pytest.raises(
        errors.InvalidLabelError,
        match=r"output 'cls': sparse_categorical_"
        r"crossentropy: 1 of 32 labels are not class ids in the valid range \[0, 3\)",
    ):
        model.fit(X, {"reg": Y_REG, "cls": np.where(np.arange(32) == 5, 3, Y_CLS)}, verbose=0)
    with pytest.raises(
        errors.IncompatibleInputError,
        match=r"fit: y is a dict with the keys "
        r"\['reg'\], but the model's outputs are \['reg', 'cls'\] \(no y for \['cls'\]\)",
    ):
        model.fit(X, {"reg": Y_REG}, verbose=0)
    three = _pair(loss=["mse", "mse", "mse"], loss_weights=None)
    with pytest.raises(
        errors.IncompatibleInputError,
        match=r"the model's output is a tuple of 2, "
        r"but the model has 3 outputs \['output_1', 'output_2', 'output_3'\]",
    ):
        three.evaluate([(PAIR_X, PAIR_Y + (PAIR_Y[0],))], verbose=0)


def test_a_saved_two_output_model_loads_compiled_with_its_losses(tmp_path):
    model = mirrax.Model(_copy())
    model.compile(optimizer=keras.optimizers.SGD(0.1), **_compile_args())
    path = str(tmp_path / "two.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "compile arguments are not saved"
        model.save(path)
    restored = mirrax.models.load_model(path)
    assert restored.metrics_names == KEYS
    assert restored.evaluate(X, Y, batch_size=8, verbose=0) == pytest.approx(
        model.evaluate(X, Y, batch_size=8, verbose=0), rel=1e-6
    )


def test_a_dict_output_is_named_and_logged_in_keras_order():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    made = keras.Model(
        inputs, {"z": layers.Dense(1, name="first")(inputs), "b": layers.Dense(1, name="second")(inputs)}
    )
    args = dict(loss={"z": "mse", "b": "mae"}, metrics={"z": ["mae"]})
    y = {"z": Y_REG, "b": -Y_REG}
    model = mirrax.Model(made)
    model.compile(optimizer="sgd", **args)
    made.compile(optimizer="sgd", **args)
    with jax.numpy_rank_promotion("allow"):  # Keras's own Dense broadcasts its bias by rank
        expected = made.evaluate(X, y, batch_size=8, verbose=0, return_dict=True)
    logs = model.evaluate(X, y, batch_size=8, verbose=0, return_dict=True)
    assert list(logs) == model.metrics_names == ["loss", "b_loss", "z_loss", "z_mae"]
    assert sorted(logs) == sorted(expected)
    for key in logs:
        assert logs[key] == pytest.approx(expected[key], rel=1e-5)
