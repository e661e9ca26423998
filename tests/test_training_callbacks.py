"""Callbacks, driven by a fake model through the hooks exactly as `Model.fit` calls them.

The fake model has the interface callbacks rely on (`stop_training`, `optimizer.learning_rate`,
`get_weights` / `set_weights`, `history`, `metrics`). After epoch e its weights are
`[full(2, e + 1)]`, so restored weights tell which epoch they came from. Expected numbers follow
Keras 3's rules; the arithmetic is written next to each assertion.
"""

import contextlib
import io
import math
import os
import struct
import warnings

import numpy as np
import pytest

import mirrax
from mirrax import callbacks
from mirrax._src.training import progbar as progbar_lib


class FakeOptimizer:
    def __init__(self, learning_rate):
        self._learning_rate = float(learning_rate)

    @property
    def learning_rate(self) -> float:
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._learning_rate = float(value)


class FakeModel:
    def __init__(self, learning_rate=1.0, metrics=()):
        self.stop_training = False
        self.optimizer = FakeOptimizer(learning_rate)
        self.metrics = list(metrics)
        self.weights = [np.zeros(2)]
        self.rates_used = []  # the learning rate each epoch's steps ran with

    def get_weights(self):
        return [w.copy() for w in self.weights]

    def set_weights(self, weights):
        self.weights = [np.array(w) for w in weights]


class FakeClock:
    """Stands in for the progress bar's clock; the fit driver advances it per step."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def fit(
    model,
    cbs,
    epoch_logs,
    steps=2,
    batch_logs=None,
    verbose=0,
    step_counts=None,
    clock=None,
    step_seconds=0.25,
    params_steps="same",
):
    """Drives the hooks as `Model.fit` does (Keras 3's order).

    epoch_logs: one dict per epoch (the number of epochs); `learning_rate` is added as fit does.
    batch_logs(epoch, step) -> the running logs after that step (default: the epoch's loss).
    step_counts: steps actually run in each epoch (default `steps` every epoch).
    params_steps: what `params["steps"]` says ("same": `steps`; None: unknown).
    """
    epochs = len(epoch_logs)
    callback_list = callbacks.CallbackList(
        cbs,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps if params_steps == "same" else params_steps,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    for epoch in range(epochs):
        callback_list.on_epoch_begin(epoch)
        model.rates_used.append(model.optimizer.learning_rate)
        count = step_counts[epoch] if step_counts else steps
        for step in range(count):
            callback_list.on_train_batch_begin(step)
            if clock is not None:
                clock.now += step_seconds
            model.weights = [np.full(2, float(epoch + 1))]
            if batch_logs is not None:
                running = batch_logs(epoch, step)
            else:
                running = {k: v for k, v in epoch_logs[epoch].items() if not k.startswith("val_")}
            callback_list.on_train_batch_end(step, running)
            if model.stop_training:
                break
        logs = dict(epoch_logs[epoch])
        logs["learning_rate"] = model.optimizer.learning_rate
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history


def losses(key, values):
    return [{key: v} for v in values]


# -- Callback, CallbackList, History ----------------------------------------------------------


def test_callback_list_dispatches_every_hook_in_order_with_model_and_params():
    calls = []

    class Recorder(callbacks.Callback):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def on_epoch_end(self, epoch, logs=None):
            calls.append((self.name, epoch, dict(logs)))
            logs[self.name] = 1.0  # epoch logs are one dict: the next callback sees this key

    model = FakeModel()
    first, second = Recorder("a"), Recorder("b")
    cbl = callbacks.CallbackList(
        [first, [second]], add_history=True, model=model, epochs=3, steps=5, verbose=0
    )
    assert [type(c).__name__ for c in cbl.callbacks] == ["Recorder", "Recorder", "History"]
    assert first.model is model and second.params == {"epochs": 3, "steps": 5, "verbose": 0}
    assert model.history is cbl.callbacks[2]
    cbl.on_epoch_end(0, {"loss": 1.5})
    assert calls == [("a", 0, {"loss": 1.5}), ("b", 0, {"loss": 1.5, "a": 1.0})]


def test_callback_list_adds_history_and_progbar_only_once():
    own_history, own_progbar = callbacks.History(), callbacks.ProgbarLogger()
    cbl = callbacks.CallbackList([own_progbar, own_history], add_history=True, add_progbar=True)
    assert cbl.callbacks == [own_progbar, own_history]
    cbl = callbacks.CallbackList(None, add_history=True, add_progbar=True)
    assert [type(c).__name__ for c in cbl.callbacks] == ["History", "ProgbarLogger"]


def test_callback_list_refuses_what_is_not_a_callback():
    with pytest.raises(TypeError, match=r"received a function .*LambdaCallback"):
        callbacks.CallbackList([lambda epoch, logs: None])


def test_batch_logs_become_python_floats_and_keep_their_order():
    seen = []
    cb = callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs))
    cbl = callbacks.CallbackList([cb])
    cbl.on_train_batch_end(0, {"loss": np.float32(0.5), "accuracy": np.array(0.25)})
    assert seen == [{"loss": 0.5, "accuracy": 0.25}]
    assert list(seen[0]) == ["loss", "accuracy"]
    assert all(type(v) is float for v in seen[0].values())


def test_history_records_every_epoch_and_is_set_on_the_model():
    model = FakeModel(learning_rate=0.5)
    logs = [{"loss": 1.0, "accuracy": 0.5, "val_loss": 1.1}, {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.9}]
    history = fit(model, [], logs)
    assert isinstance(history, callbacks.History) and model.history is history
    assert history.epoch == [0, 1]
    assert history.history == {
        "loss": [1.0, 0.5],
        "accuracy": [0.5, 0.75],
        "val_loss": [1.1, 0.9],
        "learning_rate": [0.5, 0.5],
    }


def test_lambda_callback_calls_the_functions_and_refuses_unknown_hooks():
    events = []
    cb = callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: events.append(("begin", epoch)),
        on_train_batch_end=lambda batch, logs: events.append(("batch", batch, logs["loss"])),
        on_train_end=lambda logs: events.append(("end",)),
        on_test_end=lambda logs: events.append(("test", logs["loss"])),
    )
    fit(FakeModel(), [cb], losses("loss", [3.0]), steps=2)
    cb.on_test_end({"loss": 2.0})
    assert events == [("begin", 0), ("batch", 0, 3.0), ("batch", 1, 3.0), ("end",), ("test", 2.0)]
    with pytest.raises(TypeError, match=r"'on_epoch_ends', which is not a hook"):
        callbacks.LambdaCallback(on_epoch_ends=print)


# -- EarlyStopping -----------------------------------------------------------------------------


def test_early_stopping_patience():
    # best 0.8 at epoch 1; epochs 2 and 3 do not improve: wait 1, 2 -> 2 >= patience at epoch 3.
    model = FakeModel()
    es = callbacks.EarlyStopping(patience=2)
    history = fit(model, [es], losses("val_loss", [1.0, 0.8, 0.9, 0.85, 0.7, 0.6]))
    assert history.epoch == [0, 1, 2, 3]
    assert es.stopped_epoch == 3 and es.best == 0.8 and es.best_epoch == 1


def test_early_stopping_patience_zero_stops_at_the_first_epoch_without_improvement():
    es = callbacks.EarlyStopping(monitor="loss")
    history = fit(FakeModel(), [es], losses("loss", [1.0, 0.9, 0.95, 0.5]))
    assert history.epoch == [0, 1, 2] and es.stopped_epoch == 2


def test_early_stopping_min_delta():
    # min_delta 0.05: 0.97 is not below 1.0 - 0.05 (wait 1); 0.90 < 0.95 improves (wait 0);
    # 0.88 and 0.87 are not below 0.90 - 0.05 = 0.85: wait 1, 2 -> stop at epoch 4.
    values = [1.0, 0.97, 0.90, 0.88, 0.87, 0.86, 0.85]
    es = callbacks.EarlyStopping(min_delta=0.05, patience=2)
    assert fit(FakeModel(), [es], losses("val_loss", values)).epoch == [0, 1, 2, 3, 4]
    # Without min_delta every epoch improves and training runs all 7 epochs.
    es = callbacks.EarlyStopping(patience=2)
    assert len(fit(FakeModel(), [es], losses("val_loss", values)).epoch) == 7


def test_early_stopping_restores_the_best_weights_when_it_stops(capsys):
    # best at epoch 1 (0.5); epochs 2, 3 do not improve -> stop at epoch 3 (printed as 4);
    # the weights after epoch 1 are full(2, 1 + 1).
    model = FakeModel()
    es = callbacks.EarlyStopping(patience=2, restore_best_weights=True, verbose=1)
    fit(model, [es], losses("val_loss", [1.0, 0.5, 0.6, 0.7, 0.4]))
    np.testing.assert_array_equal(model.weights[0], [2.0, 2.0])
    assert capsys.readouterr().out == (
        "Epoch 4: early stopping\nRestoring model weights from the end of the best epoch: 2.\n"
    )


def test_early_stopping_restores_the_best_weights_also_when_training_ran_to_the_end():
    # Keras 3's rule: restore whenever best weights were recorded, even without a stop.
    model = FakeModel()
    es = callbacks.EarlyStopping(patience=5, restore_best_weights=True)
    history = fit(model, [es], losses("val_loss", [1.0, 0.5, 0.6]))
    assert history.epoch == [0, 1, 2] and es.stopped_epoch == 0
    np.testing.assert_array_equal(model.weights[0], [2.0, 2.0])  # epoch 1's weights


def test_early_stopping_without_restore_keeps_the_last_weights():
    model = FakeModel()
    fit(model, [callbacks.EarlyStopping(patience=1)], losses("val_loss", [1.0, 0.5, 0.6, 0.7]))
    np.testing.assert_array_equal(model.weights[0], [3.0, 3.0])  # stopped after epoch 2


def test_early_stopping_baseline():
    # baseline 0.5 never beaten: epoch 0 improves (first value) but does not reset wait (1);
    # epoch 1 does not improve: wait 2 >= 2 -> stop at epoch 1, one epoch earlier than
    # without a baseline (wait 1 at epoch 1, 2 at epoch 2).
    values = [0.9, 0.95, 0.92, 0.3]
    model = FakeModel()
    es = callbacks.EarlyStopping(patience=2, baseline=0.5, restore_best_weights=True)
    assert fit(model, [es], losses("val_loss", values)).epoch == [0, 1]
    np.testing.assert_array_equal(model.weights[0], [1.0, 1.0])  # best epoch 0, restored anyway
    es = callbacks.EarlyStopping(patience=2)
    assert fit(FakeModel(), [es], losses("val_loss", values)).epoch == [0, 1, 2]
    # A baseline beaten at epoch 0 resets wait as usual: wait 1, 2 -> stop at epoch 2.
    es = callbacks.EarlyStopping(patience=2, baseline=0.5)
    assert fit(FakeModel(), [es], losses("val_loss", [0.4, 0.45, 0.46, 0.47])).epoch == [0, 1, 2]


def test_early_stopping_start_from_epoch():
    # Epochs 0 and 1 are not monitored; epoch 2 (3.0) is the first best, epoch 3 (2.5)
    # improves, epoch 4 (2.6) does not: wait 1 >= patience 0 -> stop at epoch 4.
    values = [1.0, 2.0, 3.0, 2.5, 2.6, 2.0]
    es = callbacks.EarlyStopping(monitor="loss", start_from_epoch=2)
    assert fit(FakeModel(), [es], losses("loss", values)).epoch == [0, 1, 2, 3, 4]
    assert es.stopped_epoch == 4 and es.best == 2.5
    # From epoch 0 it would stop at epoch 1 (2.0 does not improve on 1.0).
    es = callbacks.EarlyStopping(monitor="loss")
    assert fit(FakeModel(), [es], losses("loss", values)).epoch == [0, 1]


def test_early_stopping_can_be_reused():
    es = callbacks.EarlyStopping(monitor="loss", patience=1)
    fit(FakeModel(), [es], losses("loss", [1.0, 2.0, 3.0]))
    assert es.stopped_epoch == 1
    assert fit(FakeModel(), [es], losses("loss", [5.0, 4.0, 3.0])).epoch == [0, 1, 2]
    assert es.stopped_epoch == 0 and es.best == 3.0


@pytest.mark.parametrize(
    "monitor, mode",
    [
        ("val_loss", "min"),
        ("loss", "min"),
        ("val_output_1_loss", "min"),
        ("accuracy", "max"),
        ("val_sparse_categorical_accuracy", "max"),
        ("val_auc", "max"),
        ("precision", "max"),
        ("val_recall", "max"),
        ("val_mean_squared_error", "min"),
        ("mae", "min"),
        ("val_categorical_crossentropy", "min"),
    ],
)
def test_early_stopping_infers_the_mode_from_the_name(monitor, mode):
    es = callbacks.EarlyStopping(monitor=monitor)
    es.set_model(FakeModel())
    es.on_train_begin()
    assert es.monitor_op == mode


def test_early_stopping_maximizes_accuracy():
    # "max": 0.5, 0.6 improve; 0.55 does not -> stop at epoch 2 with patience 0.
    es = callbacks.EarlyStopping(monitor="val_accuracy")
    history = fit(FakeModel(), [es], losses("val_accuracy", [0.5, 0.6, 0.55, 0.7]))
    assert history.epoch == [0, 1, 2] and es.best == 0.6


def test_early_stopping_unknown_direction_raises_with_the_fix():
    es = callbacks.EarlyStopping(monitor="val_f2")
    with pytest.raises(ValueError, match=r"monitor='val_f2'.*Pass mode='max'.*mode='min'"):
        fit(FakeModel(), [es], losses("val_f2", [0.5]))


def test_early_stopping_reads_a_direction_declared_by_a_model_metric():
    class F2:
        name = "f2"
        _direction = "up"

    es = callbacks.EarlyStopping(monitor="val_f2")
    fit(FakeModel(metrics=[F2()]), [es], losses("val_f2", [0.5]))
    assert es.monitor_op == "max"


def test_early_stopping_warns_when_the_monitor_is_missing():
    es = callbacks.EarlyStopping(patience=0)
    with pytest.warns(
        UserWarning,
        match=r"`val_loss` which is not available.*"
        r"Available metrics are: loss,learning_rate",
    ):
        history = fit(FakeModel(), [es], losses("loss", [1.0, 2.0]))
    assert history.epoch == [0, 1]  # never stopped


def test_early_stopping_unknown_mode_warns_and_uses_auto():
    with pytest.warns(UserWarning, match=r"mode='smallest' is unknown"):
        es = callbacks.EarlyStopping(mode="smallest")
    assert es.mode == "auto"


# -- ReduceLROnPlateau ------------------------------------------------------------------------


def test_reduce_lr_on_plateau_patience():
    # The loss never improves after epoch 0: wait 1, 2 -> cut at the end of epochs 2, 4, 6
    # (halved each time, wait reset), so epochs 3-4 run at 0.5, 5-6 at 0.25, 7 at 0.125.
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2)
    fit(model, [rlr], losses("loss", [1.0] * 8))
    assert model.rates_used == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]


def test_reduce_lr_on_plateau_improvement_resets_the_wait():
    # epoch 2 improves (wait 0); epochs 3, 4 do not: cut at the end of epoch 4.
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2)
    fit(model, [rlr], losses("loss", [1.0, 1.0, 0.5, 0.5, 0.5, 0.5]))
    assert model.rates_used == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5]


def test_reduce_lr_on_plateau_cooldown():
    # cut at epoch 2 sets cooldown 2; epoch 3: cooldown 1 (wait 0, no count); epoch 4:
    # cooldown 0 then wait 1; epoch 5: wait 2 -> cut. Cuts at epochs 2, 5, 8 instead of
    # 2, 4, 6, 8.
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2, cooldown=2)
    fit(model, [rlr], losses("loss", [1.0] * 10))
    assert model.rates_used == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]


def test_reduce_lr_on_plateau_min_lr():
    # 1.0 -> 0.1 -> max(0.01, 0.05) = 0.05, then 0.05 is not above float32(0.05): no more cuts.
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="loss", factor=0.1, patience=1, min_lr=0.05)
    fit(model, [rlr], losses("loss", [1.0] * 6))
    assert model.rates_used == pytest.approx([1.0, 1.0, 0.1, 0.05, 0.05, 0.05])


def test_reduce_lr_on_plateau_min_delta_and_max_mode():
    # val_accuracy is maximized: 0.5 -> 0.55 is not above 0.5 + min_delta 0.1 (wait 1 -> cut).
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="val_accuracy", factor=0.5, patience=1, min_delta=0.1)
    fit(model, [rlr], losses("val_accuracy", [0.5, 0.55, 0.7, 0.75]))
    # epoch 1: cut; epoch 2: 0.7 > 0.6 improves; epoch 3: 0.75 < 0.8, cut.
    assert model.rates_used == [1.0, 1.0, 0.5, 0.5]
    assert rlr.monitor_op == "max"


def test_reduce_lr_on_plateau_message_and_logs(capsys):
    model = FakeModel(learning_rate=1.0)
    rlr = callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, verbose=1)
    history = fit(model, [rlr], losses("loss", [1.0, 1.0]))
    assert capsys.readouterr().out == ("\nEpoch 2: ReduceLROnPlateau reducing learning rate to 0.5.\n")
    assert history.history["learning_rate"] == [1.0, 1.0]  # the rate the epoch ran with


def test_reduce_lr_on_plateau_refuses_a_factor_of_one_or_more():
    with pytest.raises(ValueError, match=r"factor >= 1.0.*received factor=1.5"):
        callbacks.ReduceLROnPlateau(factor=1.5)


def test_reduce_lr_on_plateau_needs_a_learning_rate():
    model = FakeModel()
    model.optimizer = object()
    rlr = callbacks.ReduceLROnPlateau(monitor="loss")
    rlr.set_model(model)
    # Refused at train begin (before any step), naming the fixes; the epoch end says the same.
    with pytest.raises(
        mirrax.errors.FixedLearningRateError,
        match=r"ReduceLROnPlateau changes the learning rate.*'adam'.*inject_hyper",
    ):
        rlr.on_train_begin()
    with pytest.raises(mirrax.errors.FixedLearningRateError, match=r"inject_hyperparams"):
        rlr.on_epoch_end(0, {"loss": 1.0})


# -- LearningRateScheduler --------------------------------------------------------------------


def test_learning_rate_scheduler_sets_the_rate_at_each_epoch_begin():
    # keeps the rate for epochs 0 and 1, then halves it at the start of each later epoch.
    model = FakeModel(learning_rate=1.0)
    scheduler = callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch < 2 else lr * 0.5)
    history = fit(model, [scheduler], losses("loss", [1.0] * 5))
    assert model.rates_used == [1.0, 1.0, 0.5, 0.25, 0.125]
    assert history.history["learning_rate"] == [1.0, 1.0, 0.5, 0.25, 0.125]


def test_learning_rate_scheduler_accepts_a_schedule_of_the_epoch_only(capsys):
    model = FakeModel(learning_rate=1.0)
    scheduler = callbacks.LearningRateScheduler(lambda epoch: 0.1 * 2**-epoch, verbose=1)
    fit(model, [scheduler], losses("loss", [1.0] * 3))
    assert model.rates_used == [0.1, 0.05, 0.025]
    assert capsys.readouterr().out.splitlines()[1] == (
        "Epoch 1: LearningRateScheduler setting learning rate to 0.1."
    )


def test_learning_rate_scheduler_accepts_numpy_scalars_and_refuses_other_results():
    model = FakeModel(learning_rate=1.0)
    fit(model, [callbacks.LearningRateScheduler(lambda e, lr: np.float32(0.5))], [{"loss": 1.0}])
    assert model.rates_used == [0.5]
    with pytest.raises(
        ValueError,
        match=r"must return a float learning rate; it returned "
        r"NoneType None",
    ):
        fit(FakeModel(), [callbacks.LearningRateScheduler(lambda e, lr: None)], [{"loss": 1.0}])
    with pytest.raises(TypeError, match=r"needs a function schedule\(epoch, lr\)"):
        callbacks.LearningRateScheduler(0.1)


# -- TerminateOnNaN ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_terminate_on_nan_stops_at_the_bad_batch(capsys, bad):
    model = FakeModel()
    batches = []
    recorder = callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    step_losses = [1.0, bad, 2.0]
    history = fit(
        model,
        [callbacks.TerminateOnNaN(), recorder],
        losses("loss", [1.0, 1.0]),
        steps=3,
        batch_logs=lambda epoch, step: {"loss": step_losses[step]},
    )
    assert capsys.readouterr().out == "Batch 1: Invalid loss, terminating training\n"
    assert model.stop_training is True
    assert batches == [0, 1] and history.epoch == [0]  # no batch 2, no second epoch


def test_terminate_on_nan_can_raise():
    with pytest.raises(RuntimeError, match=r"NaN or Inf loss encountered at batch 0"):
        fit(FakeModel(), [callbacks.TerminateOnNaN(raise_error=True)], [{"loss": math.nan}])


# -- CSVLogger --------------------------------------------------------------------------------


def test_csv_logger_writes_sorted_columns_with_epoch_first(tmp_path):
    path = tmp_path / "log.csv"
    logs = [
        {"loss": 0.5, "accuracy": 0.25, "val_loss": 0.75},
        {"loss": 0.25, "accuracy": 0.5, "val_loss": 0.625},
    ]
    fit(FakeModel(learning_rate=0.1), [callbacks.CSVLogger(path)], logs)
    assert path.read_bytes().decode() == (
        "epoch,accuracy,learning_rate,loss,val_loss\r\n0,0.25,0.1,0.5,0.75\r\n1,0.5,0.1,0.25,0.625\r\n"
    )


def test_csv_logger_adds_val_columns_and_appends_without_a_second_header(tmp_path):
    path = tmp_path / "log.csv"
    fit(FakeModel(learning_rate=0.5), [callbacks.CSVLogger(path, separator=";")], [{"loss": 2.0}])
    fit(
        FakeModel(learning_rate=0.5),
        [callbacks.CSVLogger(path, separator=";", append=True)],
        [{"loss": 1.0, "val_loss": 3.0}],
    )
    assert path.read_bytes().decode() == (
        "epoch;learning_rate;loss;val_learning_rate;val_loss\r\n"
        "0;0.5;2.0;NA;NA\r\n"
        "0;0.5;1.0;3.0\r\n"  # the appending run has its own columns (as Keras)
    )
    fit(FakeModel(), [callbacks.CSVLogger(path)], [{"loss": 4.0}])  # append=False overwrites
    assert path.read_text().splitlines()[1] == "0,1.0,4.0,NA,NA"


def test_csv_logger_names_a_missing_folder(tmp_path):
    logger = callbacks.CSVLogger(tmp_path / "missing" / "log.csv")
    with pytest.raises(FileNotFoundError, match=r"folder .*missing' does not exist"):
        logger.on_train_begin()


# -- TensorBoard ------------------------------------------------------------------------------


def read_scalars(folder):
    """{tag: [(step, value), ...]} from the TFRecord event files in `folder`."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in sorted(os.listdir(folder)):
        if not name.startswith("events.out.tfevents"):
            continue
        data = open(os.path.join(folder, name), "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]  # after length and its CRC
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
                elif value.HasField("histo"):
                    scalars.setdefault(value.tag, []).append((event.step, None))
    return scalars


def _open_files_under(directory) -> list:
    """The files under `directory` this process holds open (Linux's /proc/self/fd)."""
    root = os.path.realpath(directory)
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return [t for t in targets if t.startswith(root + os.sep)]


def test_tensorboard_writes_keras_tags_under_train_and_validation(tmp_path):
    tb = callbacks.TensorBoard(tmp_path, update_freq=2, write_steps_per_second=True, histogram_freq=2)
    logs = [
        {"loss": 1.0, "accuracy": 0.5, "val_loss": 1.5, "val_accuracy": 0.25},
        {"loss": 0.5, "accuracy": 0.75, "val_loss": 1.25, "val_accuracy": 0.5},
    ]
    step_losses = iter([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    fit(
        FakeModel(learning_rate=0.25),
        [tb],
        logs,
        steps=3,
        batch_logs=lambda epoch, step: {"loss": next(step_losses)},
    )
    assert _open_files_under(tmp_path) == []  # the writers closed at the end of training
    train = read_scalars(tmp_path / "train")
    validation = read_scalars(tmp_path / "validation")
    assert train["epoch_loss"] == [(0, 1.0), (1, 0.5)]
    assert train["epoch_accuracy"] == [(0, 0.5), (1, 0.75)]
    assert train["epoch_learning_rate"] == [(0, 0.25), (1, 0.25)]
    assert [step for step, _ in train["epoch_steps_per_second"]] == [0, 1]
    # 2 epochs x 3 steps = global steps 1..6; every 2nd step: 2, 4, 6.
    assert train["batch_loss"] == [(2, pytest.approx(0.8)), (4, pytest.approx(0.6)), (6, pytest.approx(0.4))]
    assert [step for step, _ in train["batch_steps_per_second"]] == [2, 4, 6]
    assert [step for step, _ in train["weight_0/histogram"]] == [0]  # epochs 0, 2, ...
    assert validation == {"epoch_loss": [(0, 1.5), (1, 1.25)], "epoch_accuracy": [(0, 0.25), (1, 0.5)]}


def test_tensorboard_epoch_only_writes_no_batch_scalars_and_logs_evaluations(tmp_path):
    tb = callbacks.TensorBoard(str(tmp_path))
    fit(FakeModel(), [tb], [{"loss": 1.0}], steps=4)
    tb.on_test_begin()
    tb.on_test_end({"loss": 0.5})
    assert _open_files_under(tmp_path) == []  # an evaluate outside fit closes its writer too
    train = read_scalars(tmp_path / "train")
    assert sorted(train) == ["epoch_learning_rate", "epoch_loss"]
    # 4 training steps were done when the evaluation ran.
    assert read_scalars(tmp_path / "validation") == {"evaluation_loss_vs_iterations": [(4, 0.5)]}


def test_tensorboard_validates_its_arguments():
    with pytest.raises(ValueError, match=r"update_freq must be 'epoch', 'batch' or a positive"):
        callbacks.TensorBoard(update_freq="step")
    with pytest.raises(ValueError, match=r"profile_batch must be .*profile_batch=\(5, 2\)"):
        callbacks.TensorBoard(profile_batch=(5, 2))
    with pytest.raises(ValueError, match=r"write_images=True is not supported"):
        callbacks.TensorBoard(write_images=True)


# -- Progbar and ProgbarLogger ----------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progbar_lib, "clock", fake)
    return fake


def run_with_output(stream, model, cbs, epoch_logs, **kwargs):
    with contextlib.redirect_stdout(stream):
        fit(model, cbs, epoch_logs, **kwargs)
    return stream.getvalue()


EPOCHS = [
    {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.25, "val_accuracy": 0.875},
    {"loss": 0.25, "accuracy": 0.875, "val_loss": math.nan, "val_accuracy": 0.9375},
]


def running(epoch, step):
    return {"loss": [1.0, 0.75, 0.5, 0.25, 0.125][step], "accuracy": 0.5}


def test_progbar_verbose_1_without_a_terminal_writes_one_line_per_epoch(clock):
    # 3 steps of 0.25 s: elapsed 0.75 s ("1s"); per step, leaving out the first:
    # (0.75 - 0.25) / 2 = 250ms. learning_rate 0.001 is not above 1e-3: "%.4e".
    out = run_with_output(
        io.StringIO(),
        FakeModel(learning_rate=1e-3),
        [],
        EPOCHS,
        steps=3,
        batch_logs=running,
        verbose=1,
        clock=clock,
    )
    assert "\r" not in out
    assert out == (
        "Epoch 1/2\n"
        "3/3 [==============================] - 1s 250ms/step - loss: 0.5000 - accuracy: "
        "0.7500 - val_loss: 0.2500 - val_accuracy: 0.8750 - learning_rate: 1.0000e-03\n"
        "Epoch 2/2\n"
        "3/3 [==============================] - 1s 250ms/step - loss: 0.2500 - accuracy: "
        "0.8750 - val_loss: nan - val_accuracy: 0.9375 - learning_rate: 1.0000e-03\n"
    )


def test_progbar_verbose_2_writes_one_line_per_epoch_without_the_bar(clock):
    out = run_with_output(
        FakeTTY(),
        FakeModel(learning_rate=0.5),
        [],
        EPOCHS[:1],
        steps=3,
        batch_logs=running,
        verbose=2,
        clock=clock,
    )
    assert out == (
        "Epoch 1/1\n"
        "3/3 - 1s 250ms/step - loss: 0.5000 - accuracy: 0.7500 - val_loss: 0.2500 - "
        "val_accuracy: 0.8750 - learning_rate: 0.5000\n"
    )


def test_progbar_verbose_0_writes_nothing(clock):
    cbs = [callbacks.ProgbarLogger()]  # even when given explicitly
    assert run_with_output(FakeTTY(), FakeModel(), cbs, EPOCHS, steps=3, verbose=0, clock=clock) == ""


def test_progbar_on_a_terminal_redraws_the_bar_in_place(clock):
    out = run_with_output(
        FakeTTY(),
        FakeModel(learning_rate=0.5),
        [],
        EPOCHS[:1],
        steps=3,
        batch_logs=running,
        verbose=1,
        clock=clock,
    )
    # step 1: int(30 * 1/3) = 10 -> 9 "=" + ">" + 20 "."; ETA 0.25 s x 2 steps left = "0s".
    # step 2: 20 -> 19 "=" + ">" + 10 "."; step 3 (epoch end): the final line, longer, "\n".
    step1 = "1/3 [=========>....................] - ETA: 0s - loss: 1.0000 - accuracy: 0.5000"
    step2 = "2/3 [===================>..........] - ETA: 0s - loss: 0.7500 - accuracy: 0.5000"
    step3 = "3/3 [==============================] - ETA: 0s - loss: 0.5000 - accuracy: 0.5000"
    final = (
        "3/3 [==============================] - 1s 250ms/step - loss: 0.5000 - accuracy: "
        "0.7500 - val_loss: 0.2500 - val_accuracy: 0.8750 - learning_rate: 0.5000"
    )
    assert out == "Epoch 1/1\n\r" + step1 + "\r" + step2 + "\r" + step3 + "\r" + final + "\n"


def test_progbar_on_a_terminal_pads_over_a_longer_previous_line_and_throttles(clock):
    stream = FakeTTY()
    bar = progbar_lib.Progbar(target=10, stream=stream, stateless_metrics=())
    bar.update(1, {"loss": 1.0, "accuracy": 0.5})
    clock.now += 0.01
    bar.update(2, {"loss": 0.5})  # 0.01 s after the last redraw (< interval 0.05 s): skipped
    assert stream.getvalue().count("\r") == 1
    clock.now += 0.1
    bar.update(3, {"loss": 0.25})
    first, second = stream.getvalue().split("\r")[1:]
    assert second.startswith(" 3/10 [========>.....................] - ETA: 0s - loss: 0.2500")
    assert len(second) == len(first)  # padded with spaces over the longer first line


def test_progbar_with_unknown_steps_counts_and_never_shows_more_than_the_target(clock):
    # Epoch 0 has 3 steps, with params["steps"] None: "N/Unknown" while running, "3/3" at the
    # end. Epoch 1 uses 3 as its target until step 4 goes past it: "4/Unknown", then "5/5".
    stream = FakeTTY()
    out = run_with_output(
        stream,
        FakeModel(learning_rate=0.5),
        [],
        [{"loss": 1.0}] * 2,
        steps=3,
        step_counts=[3, 5],
        params_steps=None,
        batch_logs=lambda e, s: {"loss": 1.0},
        verbose=1,
        clock=clock,
    )
    lines = [part.rstrip() for part in out.replace("\n", "\r").split("\r") if part]
    counts = [line.split(" ")[0] if not line.startswith(" ") else line.split()[0] for line in lines]
    assert counts == [
        "Epoch",
        "1/Unknown",
        "2/Unknown",
        "3/Unknown",
        "3/3",
        "Epoch",
        "1/3",
        "2/3",
        "3/3",
        "4/Unknown",
        "5/Unknown",
        "5/5",
    ]
    assert "      1/Unknown - 0s 250ms/step - loss: 1.0000" in lines[1]
    # Without a terminal: only the epochs' final lines.
    out = run_with_output(
        io.StringIO(),
        FakeModel(learning_rate=0.5),
        [],
        [{"loss": 1.0}] * 2,
        steps=3,
        step_counts=[3, 5],
        params_steps=None,
        verbose=1,
        clock=clock,
    )
    assert [line.split(" ")[0] for line in out.splitlines()] == ["Epoch", "3/3", "Epoch", "5/5"]


def test_progbar_shows_the_steps_done_when_training_stops_mid_epoch(clock):
    out = run_with_output(
        io.StringIO(),
        FakeModel(),
        [callbacks.TerminateOnNaN()],
        [{"loss": math.nan}],
        steps=5,
        batch_logs=lambda e, s: {"loss": [1.0, math.nan][s]},
        verbose=1,
        clock=clock,
    )
    # Stopped after step 2 of 5: int(30 * 2/5) = 12 -> 11 "=" + ">" + 18 ".".
    assert out.splitlines()[2].startswith("2/5 [===========>..................] - ")
    assert "loss: nan" in out.splitlines()[2]


def test_progbar_logger_is_silent_in_fit_validation_and_shows_evaluate(clock):
    stream = io.StringIO()
    logger = callbacks.ProgbarLogger()
    cbl = callbacks.CallbackList([logger], model=FakeModel(), verbose=1, epochs=1, steps=2)
    with contextlib.redirect_stdout(stream):
        cbl.on_train_begin()
        cbl.on_test_begin()  # validation inside fit
        cbl.on_test_batch_end(0, {"loss": 1.0})
        cbl.on_test_end({"loss": 1.0})
        assert stream.getvalue() == ""
        cbl.on_train_end()
        cbl.on_test_begin()  # evaluate
        clock.now += 0.5
        cbl.on_test_batch_end(0, {"loss": 1.0})
        clock.now += 0.5
        cbl.on_test_batch_end(1, {"loss": 0.5})
        cbl.on_test_end({"loss": 0.5})
    assert stream.getvalue() == ("2/2 [==============================] - 1s 500ms/step - loss: 0.5000\n")


@pytest.mark.parametrize(
    "value, shown",
    [
        (1.23456, "1.2346"),
        (0.0005, "5.0000e-04"),
        (0.0, "0.0000e+00"),
        (-2.5, "-2.5000"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (np.float32(0.5), "0.5000"),
        ("text", "text"),
    ],
)
def test_values_are_formatted_as_keras(value, shown):
    assert progbar_lib.format_value(value) == shown


def test_progbar_averages_stateless_values_as_keras(clock):
    stream = io.StringIO()
    bar = progbar_lib.Progbar(target=2, stream=stream, verbose=2)
    bar.update(1, [("loss", 1.0)])
    bar.update(2, [("loss", 3.0)], finalize=False)
    bar.update(2, finalize=True)
    assert stream.getvalue().endswith("- loss: 2.0000\n")  # (1 x 1 + 3 x 1) / 2


def test_progbar_refuses_inconsistent_arguments():
    with pytest.raises(ValueError, match=r"not both"):
        progbar_lib.Progbar(3, stateful_metrics=["a"], stateless_metrics=["b"])
    with pytest.raises(ValueError, match=r"received verbose=3"):
        progbar_lib.Progbar(3, verbose=3)


def test_callbacks_do_not_warn_in_a_clean_run(tmp_path, clock):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            FakeModel(),
            [
                callbacks.EarlyStopping(patience=1),
                callbacks.ReduceLROnPlateau(patience=1),
                callbacks.CSVLogger(tmp_path / "log.csv"),
                callbacks.TerminateOnNaN(),
                callbacks.TensorBoard(tmp_path / "tb"),
            ],
            [{"loss": 1.0, "val_loss": 1.0}] * 2,
            verbose=0,
        )
    assert [str(w.message) for w in caught] == []


def test_tensorboard_profiles_the_requested_steps(tmp_path):
    import jax
    import jax.numpy as jnp

    tb = callbacks.TensorBoard(tmp_path, profile_batch=2)
    work = callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: jnp.ones(4).sum().block_until_ready()
    )
    fit(FakeModel(), [tb, work], [{"loss": 1.0}], steps=3)
    traces = list((tmp_path / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    # The callback stopped its trace: a new one can start (JAX allows one at a time).
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


def test_the_progress_bar_redraws_in_a_jupyter_kernel_only(monkeypatch):
    import sys
    import types

    from mirrax._src.training import progbar

    class Shell:  # IPython's shell in a terminal: no kernel
        pass

    ipython = types.SimpleNamespace(get_ipython=Shell)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    stdout = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    # ipykernel imported (e.g. by a test runner) is not a notebook...
    assert not progbar.is_interactive(stdout)
    # ...a kernel's shell is; and only its stdout redraws, not another stream.
    Shell.kernel = object()
    assert progbar.is_interactive(stdout)
    assert not progbar.is_interactive(io.StringIO())
