"""mirrax.Model's inputs and arguments: list batches (torch DataLoader), empty inputs, Keras's
steps_per_epoch, class and sample weights, weighted metrics, the strategy of compile, and the
checks made before the first step (issue 11, defects 3-5 and the Keras-parity audit)."""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mirrax
from mirrax import errors
from tests.conftest import mirrored
from tests.test_run import MLP, mlp_data
from tests.test_training_model import identity_model


def constant_batches(values, size=2):
    """Batches of `size` examples whose x is the constant v (the identity model's loss is x)."""
    return [(np.full((size, 1), v, np.float32), np.zeros(size, np.int32)) for v in values]


def mlp_model(strategy, optimizer=None, **compile_kwargs):
    w1, w2, _, _ = mlp_data()
    with strategy.scope():
        model = mirrax.Model(MLP(w1, w2))
        model.compile(
            optimizer or optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


# -- defect 3: a batch given as a list is a batch ------------------------------------------------


def test_fit_evaluate_predict_take_batches_given_as_lists():
    # The identity model's loss is x itself: batches of 1s and 3s log (1 + 3) / 2 = 2.0.
    as_lists = [list(batch) for batch in constant_batches([1.0, 3.0])]
    model = identity_model(mirrored(2))
    assert model.fit(as_lists, verbose=0).history["loss"] == [2.0]
    assert model.evaluate(as_lists, verbose=0) == 2.0
    # predict takes the first element of each [x, y] as the input: x back, 4 examples.
    np.testing.assert_array_equal(model.predict(as_lists, verbose=0)[:, 0], [1.0, 1.0, 3.0, 3.0])
    with_weights = [[x, y, np.array([1.0, 3.0], np.float32)] for x, y in constant_batches([1.0])]
    # (1 * 1 + 3 * 1) / 2 examples = 2.0
    assert model.evaluate(with_weights, verbose=0) == 2.0


def test_fit_takes_a_torch_dataloader_as_keras_does():
    torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
    from torch.utils.data import DataLoader, TensorDataset

    _, _, x, y = mlp_data()
    loader = DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))), batch_size=4, shuffle=False
    )
    assert isinstance(next(iter(loader)), list)  # the default collate gives [x, y]
    from_arrays = mlp_model(mirrored(2))
    expected = from_arrays.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    from_torch = mlp_model(mirrored(2))
    history = from_torch.fit(loader, epochs=2, verbose=0).history
    # The same batches in the same order through the same compiled step: the same numbers
    # (a tolerance only for the int64 -> int32 label cast path, which changes no value).
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6)
    np.testing.assert_allclose(
        from_torch.evaluate(loader, verbose=0), from_arrays.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-6
    )
    np.testing.assert_allclose(
        from_torch.predict(loader, verbose=0), from_arrays.predict(x, batch_size=4, verbose=0), rtol=1e-6
    )
    # Tensors that track gradients (what a torch model's outputs are) are detached, not refused.
    tracked = DataLoader(
        TensorDataset(torch.from_numpy(x).requires_grad_(), torch.from_numpy(y.astype(np.int64))),
        batch_size=4,
    )
    np.testing.assert_allclose(
        from_torch.evaluate(tracked, verbose=0),
        from_arrays.evaluate(x, y, batch_size=4, verbose=0),
        rtol=1e-6,
    )
    # Tensors as x and y mean what arrays mean (Keras takes torch tensors as arrays).
    np.testing.assert_allclose(
        from_torch.evaluate(torch.from_numpy(x), torch.from_numpy(y), batch_size=4, verbose=0),
        from_arrays.evaluate(x, y, batch_size=4, verbose=0),
        rtol=1e-6,
    )


# -- defect 4: empty inputs ----------------------------------------------------------------------


def test_empty_inputs_raise_before_training():
    model = identity_model(mirrored(2))

    def nothing():
        return
        yield

    for call in (model.fit, model.evaluate, model.predict):
        for empty in ([], nothing()):
            with pytest.raises(errors.EmptyDatasetError, match="no batch|empty list"):
                call(empty, verbose=0)
    assert model.optimizer.iterations == 0


def test_steps_per_epoch_beyond_a_sized_input_is_refused():
    model = identity_model(mirrored(2))
    with pytest.raises(
        errors.InvalidArgumentError, match=r"steps_per_epoch=5 but the input holds 2 batch\(es\)"
    ):
        model.fit(constant_batches([1.0, 2.0]), steps_per_epoch=5, verbose=0)
    assert model.optimizer.iterations == 0


def test_steps_per_epoch_continues_the_pass_across_epochs_as_keras():
    # 4 batches, 2 per epoch: epoch 0 sees 1s and 2s (1.5), epoch 1 the 3s and 4s (3.5), so no
    # batch is skipped (each epoch used to restart at the first batch: 1.5, 1.5).
    model = identity_model(mirrored(2))
    history = model.fit(constant_batches([1.0, 2.0, 3.0, 4.0]), steps_per_epoch=2, epochs=3, verbose=0)
    assert history.history["loss"] == [1.5, 3.5, 1.5]
    # Arrays too: 8 examples in batches of 2 (values 0..7), 2 batches per epoch, no shuffle.
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    history = identity_model(mirrored(2)).fit(
        x, np.zeros(8, np.float32), batch_size=2, steps_per_epoch=2, epochs=2, shuffle=False, verbose=0
    )
    assert history.history["loss"] == [1.5, 5.5]  # mean(0..3), mean(4..7)


def test_a_distributed_endless_generator_is_read_across_epochs_with_steps_per_epoch():
    strategy = mirrored(2)

    def endless():
        value = 0.0
        while True:
            value += 1.0
            yield np.full((2, 1), value, np.float32), np.zeros(2, np.float32)

    model = identity_model(strategy)
    history = model.fit(
        strategy.experimental_distribute_dataset(endless()), steps_per_epoch=2, epochs=2, verbose=0
    )
    # Epoch 0 sees the 1s and 2s (mean 1.5), epoch 1 continues with the 3s and 4s (3.5); each
    # epoch used to start a new pass, which a one-shot source cannot give.
    assert history.history["loss"] == [1.5, 3.5]


def test_a_pass_that_ends_inside_an_epoch_ends_it_with_keras_warning():
    model = identity_model(mirrored(2))
    with pytest.warns(UserWarning, match="Your input ran out of data"):
        history = model.fit(constant_batches([1.0, 2.0, 3.0]), steps_per_epoch=2, epochs=3, verbose=0)
    # Epoch 1 gets only the 3s, then epoch 2 starts a new pass.
    assert history.history["loss"] == [1.5, 3.0, 1.5]


# -- defect 5: callbacks that change the learning rate need a rate to change ---------------------


@pytest.mark.parametrize(
    "callback",
    [
        mirrax.callbacks.ReduceLROnPlateau(monitor="loss"),
        mirrax.callbacks.LearningRateScheduler(lambda epoch, lr: lr),
    ],
    ids=["ReduceLROnPlateau", "LearningRateScheduler"],
)
def test_learning_rate_callbacks_refuse_a_fixed_rate_before_any_step(callback):
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2), optimizer=optax.adam(1e-3))
    before = model.get_weights()
    name = type(callback).__name__
    with pytest.raises(
        errors.FixedLearningRateError,
        match=rf"{name} changes the learning rate.*'adam'.*"
        r"optax.inject_hyperparams\(optax.adam\)\(learning_rate=1e-3\)",
    ):
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], verbose=0)
    assert model.optimizer.iterations == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- checks before the first step ----------------------------------------------------------------


def test_a_misspelt_monitor_is_refused_before_any_step_listing_the_logs():
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2))
    stop = mirrax.callbacks.EarlyStopping(monitor="val_los")
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"monitor='val_los' is not among the logs of this fit, which hold: "
        r"loss, accuracy, val_loss, val_accuracy, learning_rate",
    ):
        model.fit(x, y, validation_split=0.25, callbacks=[stop], verbose=0)
    assert model.optimizer.iterations == 0


def test_a_monitor_logged_by_a_users_callback_is_accepted_as_in_keras():
    # A callback of the user's own may write a key into the epoch logs (Keras allows it), so
    # with one in the list the key is looked for at each epoch end instead of refused up front.
    class LogsTwiceTheLoss(mirrax.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["twice_loss"] = 2 * logs["loss"]

    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2))
    stop = mirrax.callbacks.EarlyStopping(monitor="twice_loss", mode="min", patience=0)
    model.fit(x, y, epochs=2, callbacks=[LogsTwiceTheLoss(), stop], verbose=0)
    assert stop.best == pytest.approx(2 * min(model.history.history["loss"]))
    # One callback, not in a list, is taken as a list of one (as before the monitor check).
    model.fit(x, y, epochs=1, callbacks=mirrax.callbacks.EarlyStopping(monitor="loss"), verbose=0)


def test_inputs_that_do_not_fit_the_model_are_named_before_any_step():
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2))
    wide = np.zeros((16, 5), np.float32)
    with pytest.raises(
        errors.IncompatibleInputError,
        match=r"cannot take x of shape \(16, 5\).*Linear \(l1\) takes inputs whose "
        r"last axis is 4",
    ):
        model.fit(wide, y, verbose=0)
    with pytest.raises(errors.IncompatibleInputError, match=r"x of shape \(8, 5\)"):
        model.fit(iter([(wide[:8], y[:8])]), verbose=0)
    with pytest.raises(errors.IncompatibleInputError, match=r"y_true of shape \(1, 3\)"):
        model.evaluate(x, np.zeros((16, 3), np.int32), verbose=0)
    assert model.optimizer.iterations == 0


# -- Keras parity: class_weight, weighted_metrics, validation_batch_size --------------------------


def test_class_weight_weights_each_example_by_its_label():
    # x = 1, 2, 3, 4 with labels 0, 1, 0, 1 and class weights {0: 1, 1: 3}: the identity
    # model's loss is x, so the logged loss is (1*1 + 3*2 + 1*3 + 3*4) / 4 = 22 / 4 = 5.5.
    x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    labels = np.array([0, 1, 0, 1], np.int32)
    model = identity_model(mirrored(2))
    history = model.fit(x, labels, batch_size=4, class_weight={0: 1.0, 1: 3.0}, verbose=0)
    assert history.history["loss"] == [5.5]
    history = identity_model(mirrored(2)).fit([(x, labels)], class_weight={0: 1.0, 1: 3.0}, verbose=0)
    assert history.history["loss"] == [5.5]
    with pytest.raises(errors.InvalidArgumentError, match="class_weight and sample_weight"):
        model.fit(x, labels, class_weight={0: 1.0}, sample_weight=np.ones(4), verbose=0)


def test_metrics_ignore_sample_weights_and_weighted_metrics_use_them():
    # x = 1, 2, 3, 4 with weights 1, 3, 1, 3: the plain mean of x is 2.5, the weighted mean
    # (1 + 6 + 3 + 12) / (1 + 3 + 1 + 3) = 22 / 8 = 2.75 (as Keras: only weighted_metrics see
    # the weights); the same name in both lists is logged as "weighted_<name>".
    def mean_x():
        return mirrax.metrics.MeanMetricWrapper(lambda y, y_pred: y_pred[:, 0], name="mean_x")

    model = identity_model(mirrored(2), metrics=[mean_x()], weighted_metrics=[mean_x()])
    x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    logs = model.evaluate(
        x,
        np.zeros(4, np.float32),
        sample_weight=np.array([1.0, 3.0, 1.0, 3.0]),
        batch_size=4,
        verbose=0,
        return_dict=True,
    )
    assert logs == {"loss": 5.5, "mean_x": 2.5, "weighted_mean_x": 2.75}


@pytest.mark.slow
def test_metrics_of_the_same_name_get_keras_keys_everywhere(tmp_path):
    # Issue 27, item 3: [AUC(), AUC(curve="PR")] logged one "auc". Keras 3 keys them "auc",
    # "auc_1" (compile_utils.CompileMetrics.result); a name= is kept; a weighted metric whose
    # name is taken is "weighted_<name>".
    auc = mirrax.metrics.AUC
    model = identity_model(
        mirrored(2),
        metrics=[
            auc(num_thresholds=3),
            auc(num_thresholds=3, curve="PR"),
            "accuracy",
            "accuracy",
            auc(num_thresholds=3, name="roc"),
        ],
        weighted_metrics=[auc(num_thresholds=3, curve="PR")],
    )
    names = ["loss", "auc", "auc_1", "accuracy", "accuracy_1", "roc", "weighted_auc"]
    assert model.metrics_names == names
    # The identity model predicts x itself: scores [0, 0.5, 0.3, 0.9] for labels [0, 0, 1, 1]
    # (Keras's AUC docstring), weights [1, 2, 3, 4] for the weighted metric and the loss.
    x = np.array([[0.0], [0.5], [0.3], [0.9]], np.float32)
    y, w = np.array([0, 0, 1, 1], np.float32), np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    expected = {
        "loss": (0 * 1 + 0.5 * 2 + 0.3 * 3 + 0.9 * 4) / 4,  # the weighted sum over 4 examples
        "auc": 0.75,  # ROC: recall [1, .5, 0], fpr [1, 0, 0]: (1 + .5) / 2
        # PR, tp [2, 1, 0], fp [2, 0, 0], fn [0, 1, 2]: slopes [1/3, 1], intercepts [2/3, 0],
        # (1/3)(1 + (2/3) ln 4) / 2 + 1 * 1 / 2.
        "auc_1": (1 + 2 / 3 * np.log(4.0)) / 6 + 0.5,
        "accuracy": 0.75,
        "accuracy_1": 0.75,  # predictions > 0.5: [0, 0, 0, 1]
        "roc": 0.75,
        "weighted_auc": (0.5 * (3 + 2 * np.log(2.5)) + 4) / 7,  # test_auc_matches_keras
    }
    logs = model.evaluate(x, y, sample_weight=w, batch_size=4, verbose=0, return_dict=True)
    assert list(logs) == names
    assert logs == pytest.approx(expected, rel=1e-5)
    # The list form: one value per name (it had 6 for 7).
    values = model.evaluate(x, y, sample_weight=w, batch_size=4, verbose=0)
    assert values == pytest.approx([expected[n] for n in names], rel=1e-5)
    path = tmp_path / "log.csv"
    history = model.fit(
        x, y, sample_weight=w, batch_size=4, verbose=0, callbacks=[mirrax.callbacks.CSVLogger(path)]
    )
    assert list(history.history) == names + ["learning_rate"]
    # CSVLogger's columns: "epoch", the keys sorted, then (no validation) their val_ twins.
    keys = sorted(history.history)
    assert path.read_text().splitlines()[0].split(",") == ["epoch"] + keys + [f"val_{k}" for k in keys]


def test_validation_batch_size_sets_the_validation_batches():
    class CountTestBatches(mirrax.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.count = 0

        def on_test_batch_end(self, batch, logs=None):
            self.count += 1

    _, _, x, y = mlp_data()
    counter = CountTestBatches()
    mlp_model(mirrored(2)).fit(
        x[:8],
        y[:8],
        batch_size=8,
        validation_data=(x[8:], y[8:]),
        validation_batch_size=2,
        callbacks=[counter],
        verbose=0,
    )
    assert counter.count == 4  # 8 validation examples in batches of 2


# -- a model belongs to the strategy it was made under --------------------------------------------


def test_a_model_made_under_a_scope_keeps_its_strategy_outside_it():
    strategy = mirrored(2)
    _, _, x, y = mlp_data()
    w1, w2, _, _ = mlp_data()
    with strategy.scope():
        model = mirrax.Model(MLP(w1, w2))
    # Compiled and trained outside the scope, as Keras allows: still the scope's strategy.
    model.compile(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert model.distribute_strategy is strategy
    reference = mlp_model(strategy)
    np.testing.assert_allclose(
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"],
        reference.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"],
        rtol=1e-6,
    )
    with mirrored(4).scope():
        other = mirrax.Model(MLP(w1, w2))
    with strategy.scope():
        with pytest.raises(errors.MixedStrategyError, match="made under the scope of"):
            other.compile("sgd", "sparse_categorical_crossentropy")


def test_auto_scale_loss_false_turns_off_float16_loss_scaling():
    import jax.numpy as jnp
    from flax import nnx

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))

        def __call__(self, x):
            return x * self.w[...]

    # loss = mean(10 * w), so d loss / d w = 10. Scaled by Keras's initial 2**15 the float16
    # gradient 327680 overflows (float16's max is 65504): the step is skipped and w stays 1.
    # Without loss scaling the SGD step (rate 0.01) gives w = 1 - 0.01 * 10 = 0.9.
    x, y = np.full((2, 1), 10.0, np.float32), np.zeros(2, np.float32)
    results = {}
    mirrax.mixed_precision.set_global_policy("mixed_float16")
    try:
        for auto_scale_loss in (True, False):
            with mirrored(2).scope():
                model = mirrax.Model(Scale())
                model.compile(
                    optax.inject_hyperparams(optax.sgd)(learning_rate=0.01),
                    loss=lambda y, y_pred: y_pred[:, 0],
                    auto_scale_loss=auto_scale_loss,
                )
            model.fit(x, y, batch_size=2, verbose=0)
            results[auto_scale_loss] = float(model.module.w[...])
    finally:
        mirrax.mixed_precision.set_global_policy("float32")
    assert results[True] == 1.0
    assert results[False] == pytest.approx(0.9, abs=1e-6)


def test_evaluate_and_predict_warn_when_the_input_runs_out_before_steps():
    model = identity_model(mirrored(2))
    with pytest.warns(UserWarning, match=r"Your input ran out of data.*after 2 batch\(es\) of steps=5"):
        # batches of 1s and 3s: the loss is their mean, (1 + 3) / 2 = 2.0
        assert model.evaluate(constant_batches([1.0, 3.0]), steps=5, verbose=0) == 2.0
    with pytest.warns(UserWarning, match="Your input ran out of data"):
        assert model.predict(constant_batches([1.0, 3.0]), steps=3, verbose=0).shape == (4, 1)


def test_summary_shows_trainable_and_fills_line_length():
    lines = []
    mlp_model(mirrored(2)).summary(line_length=80, show_trainable=True, print_fn=lines.append)
    assert lines[0] == 'Model: "MLP"'
    assert all(len(line) == 80 for line in lines[1:-1]), [len(line) for line in lines]
    assert lines[-1] == "Total: 23 values"  # 4*3 + 3 + 3*2 + 2 parameters
    assert sum(line.endswith("yes") for line in lines) == 4  # two kernels, two biases


@pytest.mark.slow
def test_train_and_test_on_batch_are_one_step_of_fit_and_evaluate():
    _, _, x, y = mlp_data()
    by_fit, by_batch = mlp_model(mirrored(2)), mlp_model(mirrored(2))
    history = by_fit.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    loss, accuracy = by_batch.train_on_batch(x, y)
    # One step on the same 16 examples: the same logs and weights (same program, same data).
    assert [loss, accuracy] == pytest.approx([history["loss"][0], history["accuracy"][0]], rel=1e-6)
    for a, b in zip(by_fit.get_weights(), by_batch.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert by_batch.test_on_batch(x, y, return_dict=True) == pytest.approx(
        by_fit.evaluate(x, y, batch_size=16, verbose=0, return_dict=True), rel=1e-6
    )
    np.testing.assert_allclose(by_batch.predict_on_batch(x), by_fit.predict(x, verbose=0), rtol=1e-6)
    # Metrics are reset at each call (Keras 3): the identity model's loss is x's mean.
    model = identity_model(mirrored(2))
    assert model.test_on_batch(np.ones((2, 1), np.float32), np.zeros(2)) == 1.0
    assert model.test_on_batch(np.full((2, 1), 3.0, np.float32), np.zeros(2)) == 3.0


def test_labels_given_as_a_python_list_are_arrays_as_in_keras():
    # The identity model's loss is x: (1 + 2 + 3 + 4) / 4 = 2.5 whatever the labels' type.
    x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    assert identity_model(mirrored(2)).evaluate(x, [0, 1, 0, 1], verbose=0) == 2.5


def test_examples_as_python_lists_are_told_to_become_arrays():
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"x holds Python numbers \(e.g. from X.tolist\(\)\): pass the "
        r"examples as arrays, np.asarray\(x\)",
    ):
        model.fit(x.tolist(), y.tolist(), verbose=0)


def test_a_later_dataset_batch_that_does_not_fit_is_named_before_its_step():
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(2))
    # Batch 2's labels are 0 + 5 = 5 for a model with 2 classes: refused on the host before
    # batch 2 trains (it used to give loss nan and NaN weights).
    with pytest.raises(errors.InvalidLabelError, match=r"batch 2 of the dataset: .*\[0, 2\)"):
        model.fit([(x[:8], y[:8]), (x[:8], y[:8] * 0 + 5)], verbose=0)
    assert model.optimizer.iterations == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Batch 2 has 5 features for a first layer of 4: named before its step (it used to be a
    # jax dot_general TypeError from inside the compiled step).
    wide = np.zeros((8, 5), np.float32)
    with pytest.raises(
        errors.IncompatibleInputError, match=r"fit \(batch 2\): the model cannot take x of shape \(8, 5\)"
    ):
        model.fit([(x[:8], y[:8]), (wide, y[:8])], verbose=0)
    assert model.optimizer.iterations == 2
    with pytest.raises(errors.InvalidLabelError, match=r"batch 2 of the dataset"):
        model.evaluate([(x[:8], y[:8]), (x[:8], y[:8] * 0 + 5)], verbose=0)


def test_fit_under_another_strategys_scope_is_refused_as_tf():
    _, _, x, y = mlp_data()
    model = mlp_model(mirrored(4))
    with mirrored(2).scope():
        for call in (
            lambda: model.fit(x, y, verbose=0),
            lambda: model.evaluate(x, y, verbose=0),
            lambda: model.predict(x, verbose=0),
        ):
            with pytest.raises(
                errors.MixedStrategyError,
                match=r"this Model belongs to MirroredStrategy\(num_replicas_in_sync"
                r"=4.*scope of MirroredStrategy\(num_replicas_in_sync=2",
            ):
                call()
    assert model.optimizer.iterations == 0
    with mirrored(4).scope():  # its own scope, and outside every scope: its own strategy
        model.fit(x, y, verbose=0)
    model.fit(x, y, verbose=0)


# -- issue 27, item 6: torch bfloat16, text, and Keras's list of input arrays --------------------


def test_torch_bfloat16_and_float8_batches_arrive_as_jax_dtypes_bit_for_bit():
    torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
    from torch.utils.data import DataLoader, TensorDataset

    # 1.5, -2.25 and 3.140625 are exact in bfloat16 (8 significant bits).
    tensor = torch.tensor([[1.5, -2.25, 3.140625, 0.0]], dtype=torch.bfloat16)
    batch = next(iter(mirrored(2).experimental_distribute_dataset([(tensor.repeat(4, 1),)])))
    shard = np.asarray(mirrored(2).experimental_local_results(batch[0])[0])
    assert shard.dtype == jnp.bfloat16 and shard.shape == (2, 4)
    np.testing.assert_array_equal(shard.astype(np.float32), [[1.5, -2.25, 3.140625, 0.0]] * 2)
    # float8 too (no NumPy dtype either): 0.5 and -3.0 are exact in e4m3.
    eight = torch.tensor([[0.5, -3.0]]).to(torch.float8_e4m3fn).repeat(2, 1)
    batch = next(iter(mirrored(2).experimental_distribute_dataset([(eight,)])))
    shard = np.asarray(mirrored(2).experimental_local_results(batch[0])[0])
    assert shard.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(shard.astype(np.float32), [[0.5, -3.0]])

    _, _, x, y = mlp_data()
    x16 = torch.from_numpy(x).to(torch.bfloat16)
    as_float32 = x16.float().numpy()  # the same values, in a dtype NumPy has
    loader = DataLoader(TensorDataset(x16, torch.from_numpy(y.astype(np.int64))), batch_size=4)
    model = mlp_model(mirrored(2))
    # The same values through the same layers (bfloat16 -> float32 is exact): equal up to
    # XLA's fusion of the cast, hence a tolerance.
    np.testing.assert_allclose(
        model.evaluate(loader, verbose=0), model.evaluate(as_float32, y, batch_size=4, verbose=0), rtol=1e-6
    )
    np.testing.assert_allclose(
        model.predict(x16, batch_size=4, verbose=0),
        model.predict(as_float32, batch_size=4, verbose=0),
        rtol=1e-6,
    )
    model.fit(loader, verbose=0)
    assert model.optimizer.iterations == 4  # 16 examples in batches of 4


@pytest.mark.parametrize(
    "x",
    [
        ["a cat", "a dog"] * 8,
        np.array(["a cat", "a dog"] * 8),
        np.array([b"a cat", b"a dog"] * 8, dtype=object),
    ],
    ids=["list", "unicode array", "bytes objects (tf.string)"],
)
def test_text_as_x_is_refused_as_text_first(x):
    model = mlp_model(mirrored(2))
    # Before: "Remove batch_size" (a list is a dataset), then a shape fix for the array.
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"fit: x holds strings \(e.g. b?'a cat'\); strings are not numeric "
        r"inputs.*TextVectorization",
    ):
        model.fit(x, np.zeros(16, np.int32), batch_size=8, verbose=0)
    with pytest.raises(errors.InvalidArgumentTypeError, match=r"predict: x holds strings"):
        model.predict(x, verbose=0)


def test_text_labels_and_text_in_batches_are_refused_as_text():
    _, _, x, _ = mlp_data()
    model = mlp_model(mirrored(2))
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"fit: y holds strings \(e.g. 'cat'\).*np.unique\(y, "
        r"return_inverse=True\)",
    ):
        model.fit(x, ["cat", "dog"] * 8, verbose=0)
    # A DataLoader's default collate gives a list of str for a text field.
    with pytest.raises(
        errors.InvalidArgumentTypeError, match=r"fit: the first batch holds strings \(e.g. 'a cat'\)"
    ):
        model.fit(iter([(["a cat", "a dog"], np.zeros(2, np.int32))]), verbose=0)
    assert model.optimizer.iterations == 0


def test_a_list_of_input_arrays_given_with_y_or_batch_size_is_the_models_inputs():
    # tests/test_multi_input.py has models of two inputs; this one-input MLP is given the list
    # of its two "inputs" as its x, and says which shapes it received (a list, not a batch).
    xa, xb = np.zeros((8, 4), np.float32), np.zeros((8, 3), np.float32)
    model = mlp_model(mirrored(2))
    for kwargs in ({"batch_size": 4}, {}):
        with pytest.raises(
            errors.IncompatibleInputError,
            match=re.escape("fit: the model cannot take x of shape [(8, 4), (8, 3)]: "),
        ):
            model.fit([xa, xb], np.zeros(8, np.int32), verbose=0, **kwargs)
    with pytest.raises(
        errors.IncompatibleInputError,
        match=re.escape("predict: the model cannot take x of shape ((8, 4), (8, 3))"),
    ):
        model.predict((xa, xb), batch_size=4, verbose=0)


def test_a_pandas_data_frame_and_series_are_arrays_as_in_keras():
    # Keras 3 takes a DataFrame / Series as its values (array_data_adapter); mirrax too, so
    # the run is the one of the NumPy arrays, bit for bit (once read "already batched").
    pandas = pytest.importorskip("pandas")
    x, y = mlp_data()[2:]
    frame, series = pandas.DataFrame(x), pandas.Series(y)
    runs = [
        mlp_model(mirrored(2)).fit(a, b, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        for a, b in ((x, y), (frame, series))
    ]
    assert runs[0] == runs[1]
