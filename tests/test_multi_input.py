"""Several inputs, and labels / sample weights per output: a list or tuple x of equal-length
arrays given with y or batch_size (or matching a Keras model's inputs) is the model's inputs,
fits as Keras 3 fits it; y and sample_weight as lists / dicts of arrays keep their structure
through batching, padding, shuffling, validation and datasets; the bad ones are named."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

keras = pytest.importorskip("keras", reason="Keras 3 is not installed (the test extra has it)")
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from mirrax import errors  # noqa: E402
from mirrax._src.training import data_adapter  # noqa: E402
from tests.conftest import mirrored  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than JAX", allow_module_level=True)

RNG = np.random.default_rng(0)
XA = RNG.normal(size=(12, 3)).astype(np.float32)
XB = RNG.normal(size=(12, 2)).astype(np.float32)
Y = RNG.normal(size=(12, 1)).astype(np.float32)


def _keras_two_inputs():
    """A functional model of inputs "a" (3 features) and "b" (2), one output."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    joined = layers.Concatenate()([layers.Dense(4, activation="tanh")(a), layers.Dense(4)(b)])
    return keras.Model([a, b], layers.Dense(1, name="out")(joined))


_REFERENCE = {}


def _keras_reference():
    """Keras's own fit (one device, shuffle=False, 2 epochs of 3 batches of 4), its initial
    weights, trained weights, history, evaluate and predict."""
    if not _REFERENCE:
        model = _keras_two_inputs()
        initial = model.get_weights()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with jax.numpy_rank_promotion("allow"):  # Keras broadcasts a bias by rank
            history = model.fit([XA, XB], Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
            _REFERENCE.update(
                initial=initial,
                weights=model.get_weights(),
                loss=history.history["loss"],
                evaluate=model.evaluate([XA, XB], Y, batch_size=4, verbose=0),
                predict=model.predict([XA, XB], batch_size=4, verbose=0),
            )
    return _REFERENCE


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_a_two_input_keras_model_fits_as_keras_fits_it(replicas, as_dict):
    reference = _keras_reference()
    # Keras's fit moved the weights (so equal weights below mean mirrax trained alike).
    assert max(np.abs(w - v).max() for w, v in zip(reference["weights"], reference["initial"])) > 1e-2
    keras_model = _keras_two_inputs()
    keras_model.set_weights(reference["initial"])
    x = {"a": XA, "b": XB} if as_dict else [XA, XB]
    with mirrored(replicas).scope():
        model = mirrax.Model(keras_model)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, Y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    # The same float32 arithmetic as Keras's, summed over 2 replicas in another order: 1e-5.
    for got, want in zip(keras_model.get_weights(), reference["weights"]):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(history["loss"], reference["loss"], atol=1e-5)
    np.testing.assert_allclose(
        model.evaluate(x, Y, batch_size=4, verbose=0), reference["evaluate"], atol=1e-5
    )
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), reference["predict"], atol=1e-5)
    # Without batch_size a list of as many arrays as the Keras model has inputs is its inputs
    # (a list of 2 batches would not fit it), as in Keras.
    np.testing.assert_allclose(model.predict([XA, XB], verbose=0), reference["predict"], atol=1e-5)
    np.testing.assert_allclose(model.predict_on_batch(x), reference["predict"], atol=1e-5)


class Pair(nnx.Module):
    """Two inputs, two outputs: (s * x[0], t * x[1]) with s = t = 1 (fixed by hand)."""

    def __init__(self):
        self.s, self.t = nnx.Param(jnp.ones(())), nnx.Param(jnp.ones(()))

    def __call__(self, x):
        assert isinstance(x, (list, tuple)), type(x)  # the list given, not one array
        return self.s[...] * x[0], self.t[...] * x[1]


# Five examples: x1 = 1..5, x2 = 0, labels y1 = 0, y2 = 1. Per example the loss below is
# (x1 - 0)^2 + (0 - 1)^2 = x1^2 + 1: 2, 5, 10, 17, 26; their mean is 60 / 5 = 12.
X1 = np.arange(1, 6, dtype=np.float32)[:, None]
X2 = np.zeros((5, 1), np.float32)
Y1, Y2 = np.zeros((5, 1), np.float32), np.ones((5, 1), np.float32)


def _pair_model(replicas, learning_rate=0.0, loss=None):
    with mirrored(replicas).scope():
        model = mirrax.Model(Pair())
        model.compile(
            optax.sgd(learning_rate),
            loss or (lambda y, p: jnp.mean((y[0] - p[0]) ** 2, -1) + jnp.mean((y[1] - p[1]) ** 2, -1)),
        )
    return model


def _by_key(y, p):
    return jnp.mean((y["one"] - p[0]) ** 2, -1) + jnp.mean((y["two"] - p[1]) ** 2, -1)


@pytest.mark.parametrize("replicas", [1, 2])
def test_labels_as_a_list_or_dict_reach_the_loss_as_that_structure(replicas):
    model = _pair_model(replicas)
    # Batches of 2: [1, 2], [3, 4], [5] (padded on 2 replicas, the padding row masked).
    assert model.evaluate([X1, X2], [Y1, Y2], batch_size=2, verbose=0) == pytest.approx(12.0)
    assert model.evaluate((X1, X2), (Y1, Y2), batch_size=2, verbose=0) == pytest.approx(12.0)
    by_key = _pair_model(replicas, loss=_by_key)
    assert by_key.evaluate([X1, X2], {"one": Y1, "two": Y2}, batch_size=2, verbose=0) == pytest.approx(12.0)
    # Outputs come back as the module's tuple, one row per example.
    p1, p2 = model.predict([X1, X2], batch_size=2, verbose=0)
    np.testing.assert_array_equal(p1, X1)
    np.testing.assert_array_equal(p2, X2)


@pytest.mark.slow
def test_lists_under_replica_invariant_mode_and_several_steps_per_execution():
    # Micro-batches of 2 rows over 2 replicas (batch 4: [1..4], [5] padded); and 2 steps per
    # call: the same 12 by hand, as the padding rows are masked in both.
    strategy = mirrax.MirroredStrategy(["cpu:0", "cpu:1"], replica_invariant=True, micro_batches=2)
    loss = lambda y, p: jnp.mean((y[0] - p[0]) ** 2, -1) + jnp.mean((y[1] - p[1]) ** 2, -1)  # noqa: E731
    with strategy.scope():
        invariant = mirrax.Model(Pair())
        invariant.compile(optax.sgd(0.0), loss)
    assert invariant.evaluate([X1, X2], [Y1, Y2], batch_size=4, verbose=0) == pytest.approx(12.0)
    np.testing.assert_array_equal(invariant.predict([X1, X2], batch_size=4, verbose=0)[0], X1)
    with mirrored(2).scope():
        grouped = mirrax.Model(Pair())
        grouped.compile(optax.sgd(0.0), loss, steps_per_execution=2)
    assert grouped.evaluate([X1, X2], [Y1, Y2], batch_size=2, verbose=0) == pytest.approx(12.0)
    history = grouped.fit([X1, X2], (Y1, Y2), batch_size=2, epochs=2, verbose=0).history
    assert history["loss"] == [pytest.approx(12.0)] * 2


def test_torch_tensors_in_the_lists_count_as_arrays():
    torch = pytest.importorskip("torch")
    model = _pair_model(2)
    as_torch = [torch.from_numpy(a) for a in (X1, X2, Y1, Y2)]
    assert model.evaluate(as_torch[:2], as_torch[2:], batch_size=2, verbose=0) == pytest.approx(12.0)
    # One step on the whole batch at learning rate 0: the loss of the 5 examples, 12.
    assert model.train_on_batch(tuple(as_torch[:2]), as_torch[2:]) == pytest.approx(12.0)


def test_validation_split_and_validation_data_carry_lists():
    model = _pair_model(2)  # learning rate 0: the loss is the data's, by hand
    # validation_split=0.4 of 5 keeps int(5 * 0.6) = 3 for training: x1 = 1, 2, 3 give
    # (1 + 4 + 9) / 3 + 1 = 5.6667; validation x1 = 4, 5: (16 + 25) / 2 + 1 = 21.5.
    history = model.fit([X1, X2], [Y1, Y2], batch_size=2, validation_split=0.4, verbose=0).history
    assert history["loss"] == [pytest.approx(14 / 3 + 1)]
    assert history["val_loss"] == [pytest.approx(21.5)]
    history = model.fit(
        [X1, X2], [Y1, Y2], batch_size=2, verbose=0, validation_data=((X1, X2), [Y1, Y2])
    ).history
    assert history["val_loss"] == [pytest.approx(12.0)]


def test_datasets_of_list_and_dict_batches_fit_and_evaluate():
    model = _pair_model(2)
    batches = [([X1[:2], X2[:2]], (Y1[:2], Y2[:2])), ((X1[2:], X2[2:]), [Y1[2:], Y2[2:]])]
    assert model.evaluate(batches, verbose=0) == pytest.approx(12.0)
    assert model.evaluate(iter(batches), verbose=0) == pytest.approx(12.0)
    history = model.fit(batches, epochs=2, verbose=0).history
    assert history["loss"] == [pytest.approx(12.0)] * 2


def test_five_examples_at_batch_2_over_2_replicas_keep_every_structure_aligned():
    strategy = mirrored(2)
    model = _pair_model(2, loss=_by_key)
    rows = np.arange(5, dtype=np.float32)
    # Every leaf holds its example's index (scaled), so where each row lands is read back.
    x = [rows[:, None], 10 * rows[:, None]]
    y = {"one": 100 * rows[:, None], "two": 1000 * rows[:, None]}
    weights = (rows + 0.5, rows + 0.25)
    data = data_adapter.ModelInput(model, strategy, x, y, weights, 2, False, "fit")
    batches = list(data.batches(prefetch=False))
    assert len(batches) == 3  # ceil(5 / 2)
    for step, (bx, by, bw) in enumerate(batches):
        assert isinstance(bx, list) and isinstance(by, dict) and isinstance(bw, tuple)
        # TF's split of a batch of 2 over 2 replicas: one row each; the last batch of 1 gives
        # replica 0 example 4 and replica 1 a padding copy of it, masked out.
        first = 2 * step
        want = [first, first + 1] if step < 2 else [4, 4]
        np.testing.assert_array_equal(bx[0].stacked[:, 0, 0], want)
        np.testing.assert_array_equal(bx[1].stacked[:, 0, 0], [10 * r for r in want])
        np.testing.assert_array_equal(by["two"].stacked[:, 0, 0], [1000 * r for r in want])
        np.testing.assert_array_equal(bw[0].stacked[:, 0], [r + 0.5 for r in want])
        np.testing.assert_array_equal(bw[1].stacked[:, 0], [r + 0.25 for r in want])
        np.testing.assert_array_equal(np.asarray(bw[1].mask)[:, 0], [True, step < 2])
    # A dataset's (x, y, sample_weight) batches of a list, a dict and a tuple: the same.
    dataset = [
        ([a[:2] for a in x], {k: v[:2] for k, v in y.items()}, tuple(w[:2] for w in weights)),
        ([a[2:] for a in x], {k: v[2:] for k, v in y.items()}, tuple(w[2:] for w in weights)),
    ]
    data = data_adapter.ModelInput(model, strategy, dataset, None, None, None, False, "fit")
    (bx, by, bw), (cx, cy, cw) = data.batches(prefetch=False)
    assert isinstance(bx, list) and isinstance(by, dict) and isinstance(bw, tuple)
    # The second batch, examples 2, 3, 4: ceil(3 / 2) = 2 rows to replica 0, 1 to replica 1,
    # padded with a copy of the batch's first example (2), masked out.
    np.testing.assert_array_equal(cw[1].stacked, [[2.25, 3.25], [4.25, 2.25]])
    np.testing.assert_array_equal(np.asarray(cw[1].mask), [[True, True], [True, False]])
    np.testing.assert_array_equal(cy["one"].stacked[:, :, 0], [[200, 300], [400, 200]])
    np.testing.assert_array_equal(cx[1].stacked[:, :, 0], [[20, 30], [40, 20]])
    # Shuffled, every leaf of an example moves together.
    data = data_adapter.ModelInput(
        model, strategy, x, y, weights, 2, True, "fit", rng=np.random.default_rng(3)
    )
    for bx, by, bw in data.batches(prefetch=False):
        index = bx[0].stacked[:, 0, 0]
        np.testing.assert_array_equal(by["one"].stacked[:, 0, 0], 100 * index)
        np.testing.assert_array_equal(bw[0].stacked[:, 0], index + 0.5)


def test_per_output_sample_weights_reach_a_step_as_a_tuple():
    # Weights (1, 0, 1, 0, 1) on output 1 and (0, 1, 0, 1, 0) on output 2 of the per-example
    # losses above, x1^2 = 1, 4, 9, 16, 25 and 1 each: (1 + 9 + 25) + (1 + 1) = 37 over 5
    # examples = 7.4, whatever the replicas (padding rows are not counted).
    w1 = np.array([1, 0, 1, 0, 1], np.float32)
    for replicas in (1, 2):
        strategy = mirrored(replicas)
        dist = strategy.experimental_distribute_dataset(
            [
                ([X1[:2], X2[:2]], [Y1[:2], Y2[:2]], (w1[:2], 1 - w1[:2])),
                ([X1[2:], X2[2:]], [Y1[2:], Y2[2:]], (w1[2:], 1 - w1[2:])),
            ]
        )

        def step(x, y, w):
            first = mirrax.compute_average_loss(jnp.mean((y[0] - x[0]) ** 2, -1), w[0])
            return first + mirrax.compute_average_loss(jnp.mean((y[1] - x[1]) ** 2, -1), w[1])

        total = sum(
            float(strategy.reduce("sum", strategy.run(step, args=batch), axis=None)) for batch in dist
        )
        # Each batch's share is divided by its own examples: (1 + 1) / 2 + (9 + 25 + 1) / 3.
        assert total == pytest.approx(2 / 2 + 35 / 3)


def test_a_list_read_as_batches_names_the_other_reading():
    model = _pair_model(2)
    message = (
        "predict: x is a list of 2 arrays, read as 2 batches; to pass them as the model's "
        "2 inputs, pass batch_size=... (or y, or x as a dict of arrays keyed by input). "
        "A list x is a sequence of batches when neither y nor batch_size is given (and "
        "the model is not a Keras model of as many inputs). The first batch does not "
        "fit: the model cannot take x of shape (5, 1) (float32): "
    )
    with pytest.raises(errors.IncompatibleInputError, match=re.escape(message)):
        model.predict([X1, X2], verbose=0)
    p1, _ = model.predict([X1, X2], batch_size=5, verbose=0)  # the other reading
    np.testing.assert_array_equal(p1, X1)


def test_bad_structured_inputs_are_named():
    model = _pair_model(1)
    cases = [
        (
            lambda: model.fit([X1, X2[:4]], [Y1, Y2], verbose=0),
            "fit: x is a list of 2 arrays of different lengths (x[0]: 5, x[1]: 4) given with y; as "
            "the model's 2 inputs every array must hold the same examples along axis 0. Give each "
            "input one row per example.",
        ),
        (
            lambda: model.fit([X1, X2], [Y1, Y2[:4]], verbose=0),
            "fit: x has 5 examples but y[1] has 4; they must have the same length along axis 0.",
        ),
        (
            lambda: model.fit([X1, X2], [Y1, Y2], sample_weight=[np.ones(5)] * 3, verbose=0),
            "fit: sample_weight is a list of 3 arrays but the model has 2 outputs; give one (n,) "
            "array per output, in output order (or one array shared by all).",
        ),
        (
            lambda: model.fit([X1, X2], [Y1, Y2], sample_weight=[np.ones(5), np.ones(4)], verbose=0),
            "fit: x has 5 examples but sample_weight[1] has 4; they must have the same length along axis 0.",
        ),
        (
            lambda: model.fit([X1, X2], [Y1, Y2], sample_weight=[np.ones(5), np.ones((5, 2))], verbose=0),
            "fit: sample_weight[1] must hold one weight per example, shape (5,); received shape "
            "(5, 2). Pass a 1-D array of length 5 for each output.",
        ),
        (
            lambda: model.fit(
                [X1, X2],
                {"one": Y1, "two": Y2},
                verbose=0,
                sample_weight={"one": np.ones(5), "three": np.ones(5)},
            ),
            "fit: sample_weight has the key 'three', which is not an output of the model; its "
            "outputs are ['one', 'two']. Key the weights by output name.",
        ),
        (
            lambda: model.fit([X1, X2], [Y1, Y2], class_weight={0: 1.0}, verbose=0),
            "fit: class_weight is only supported for a model with one output; y is a list of 2 "
            "label arrays. Pass per-output sample_weight instead (e.g. the class weights looked "
            "up for each output's labels).",
        ),
    ]
    for call, message in cases:
        with pytest.raises(errors.InvalidArgumentError, match=re.escape(message) + "$"):
            call()
    with mirrored(1).scope():
        keras_model = mirrax.Model(_keras_two_inputs())
        keras_model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(
        errors.InvalidArgumentError,
        match=re.escape(
            "fit: sample_weight has the key 'b', which is not an output of the model; its "
            "outputs are ['out']. Key the weights by output name."
        ),
    ):
        keras_model.fit([XA, XB], Y, sample_weight={"b": np.ones(12)}, verbose=0)


def test_a_two_input_keras_model_exports_with_a_list_or_dict_signature(tmp_path):
    with mirrored(1).scope():
        model = mirrax.Model(_keras_two_inputs())
    want = model.predict([XA, XB], verbose=0)
    a = jax.ShapeDtypeStruct((None, 3), jnp.float32)
    b = jax.ShapeDtypeStruct((None, 2), jnp.float32)
    mirrax.export(model, tmp_path / "list", [[a, b]])  # one positional input, the list
    np.testing.assert_allclose(mirrax.load_exported(tmp_path / "list")([XA, XB]), want, atol=1e-6)
    mirrax.export(model, tmp_path / "dict", {"a": a, "b": b})
    np.testing.assert_allclose(mirrax.load_exported(tmp_path / "dict")({"a": XA, "b": XB}), want, atol=1e-6)
    with pytest.raises(
        errors.IncompatibleInputError,
        match=re.escape(
            "; a Keras model with 2 inputs takes them as ONE list: write "
            "input_signature=[[spec_1, ..., spec_2]] (or a dict keyed by input name)"
        ),
    ):
        mirrax.export(model, tmp_path / "spread", [a, b])
