"""What a user callback sees and changes between `fit`'s batches: weights, the learning rate,
the logged loss, `stop_training` and an exception mid-epoch, on a real `mirrax.Model`.

The contract `fit` keeps whatever it does with the state between steps (issue 30 may carry it
flat and write it back lazily): a callback's hook reads the values of the last completed step
and a write it makes is what the next step starts from.

The model is y = w * x (one weight, no bias), mse, plain SGD, one example (x=1, y=0) per batch,
so each step is w <- w - lr * d(w^2)/dw = w - 2 * lr * w, and the batch's loss is w^2 before it.
The values are float32 (lr 0.1 is not exact in it), hence a relative tolerance of 1e-6.
"""

import numpy as np
import optax
import pytest
from flax import nnx

import mirrax

X = np.ones((4, 1), np.float32)
Y = np.zeros((4, 1), np.float32)


def _model():
    model = mirrax.Model(nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0)))
    model.compile(optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), loss="mse")
    model.set_weights([np.ones((1, 1), np.float32)])
    return model


def _w(model) -> float:
    return float(model.get_weights()[0][0, 0])


def test_a_callback_reads_and_writes_the_weights_and_learning_rate_between_batches():
    model = _model()
    seen = []

    def begin(batch, logs):
        seen.append(("begin", batch, _w(model)))
        if batch == 1:
            model.set_weights([np.full((1, 1), 10.0, np.float32)])
        if batch == 2:
            model.optimizer.learning_rate = 0.25

    def end(batch, logs):
        seen.append(("end", batch, _w(model), logs["loss"]))

    callback = mirrax.callbacks.LambdaCallback(on_train_batch_begin=begin, on_train_batch_end=end)
    model.fit(X, Y, batch_size=1, epochs=1, steps_per_epoch=3, shuffle=False, verbose=0, callbacks=[callback])
    expected = [
        ("begin", 0, 1.0),
        ("end", 0, 0.8, 1.0),  # 1 - 2 * 0.1 * 1; loss 1^2
        ("begin", 1, 0.8),
        ("end", 1, 8.0, 50.5),  # set to 10: 10 - 2 * 0.1 * 10; the epoch's mean (1 + 100) / 2
        ("begin", 2, 8.0),
        ("end", 2, 4.0, 55.0),  # lr 0.25: 8 - 2 * 0.25 * 8; (1 + 100 + 64) / 3
    ]
    assert [e[:2] for e in seen] == [e[:2] for e in expected]
    np.testing.assert_allclose(
        [v for e in seen for v in e[2:]], [v for e in expected for v in e[2:]], rtol=1e-6
    )
    assert _w(model) == 4.0 and model.optimizer.learning_rate == 0.25


def test_stop_training_and_an_exception_leave_the_last_completed_step_s_weights():
    model = _model()

    def stop(batch, logs):
        if batch == 1:
            model.stop_training = True

    history = model.fit(
        X, Y, batch_size=1, epochs=3, shuffle=False, verbose=0,
        callbacks=[mirrax.callbacks.LambdaCallback(on_train_batch_end=stop)],
    )  # fmt: skip
    assert len(history.history["loss"]) == 1
    assert _w(model) == pytest.approx(0.64, rel=1e-6)  # two steps: 1 * 0.8 * 0.8

    model = _model()

    def fail(batch, logs):
        if batch == 2:
            raise RuntimeError("stopped by the user")

    with pytest.raises(RuntimeError, match="stopped by the user"):
        model.fit(
            X, Y, batch_size=1, epochs=1, shuffle=False, verbose=0,
            callbacks=[mirrax.callbacks.LambdaCallback(on_train_batch_begin=fail)],
        )  # fmt: skip
    assert _w(model) == pytest.approx(0.64, rel=1e-6)  # batches 0 and 1 only


# Without a callback hook between batches the state is carried through the epoch and written
# into the model at its end (docs/design.md, "Carried state in fit, evaluate and predict"): what
# the epoch-end hooks, validation, a checkpoint and an exception see is checked below.


def test_the_epoch_end_sees_the_epoch_s_last_weights_when_no_hook_runs_between_batches():
    model = _model()
    seen = []
    record = mirrax.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((_w(model), logs)))
    model.fit(X, Y, batch_size=1, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    w = [0.8**n for n in range(9)]  # the weight before step n: each step multiplies it by 0.8
    assert [s[0] for s in seen] == pytest.approx([w[4], w[8]], rel=1e-6)
    # The epoch's loss: the mean of w^2 over its 4 steps, taken before each step.
    assert [s[1]["loss"] for s in seen] == pytest.approx(
        [np.mean(np.square(w[0:4])), np.mean(np.square(w[4:8]))], rel=1e-6
    )
    assert _w(model) == pytest.approx(w[8], rel=1e-6)


def test_validation_and_the_next_epoch_start_from_the_epoch_s_last_weights():
    model = _model()
    history = model.fit(
        X, Y, batch_size=1, epochs=2, shuffle=False, verbose=0, validation_data=(X[:1], Y[:1])
    )
    # val_loss is (w x)^2 after the epoch's 4 steps: (0.8^4)^2, then (0.8^8)^2.
    assert history.history["val_loss"] == pytest.approx([0.8**8, 0.8**16], rel=1e-6)
    assert _w(model) == pytest.approx(0.8**8, rel=1e-6)


def test_an_error_from_the_input_mid_epoch_leaves_the_last_completed_step_s_weights():
    model = _model()

    def batches():
        yield X[:1], Y[:1]
        yield X[:1], Y[:1]
        raise RuntimeError("the input failed")

    with pytest.raises(RuntimeError, match="the input failed"):
        model.fit(batches(), epochs=1, steps_per_epoch=4, verbose=0)
    assert _w(model) == pytest.approx(0.64, rel=1e-6)  # two steps: 1 * 0.8 * 0.8
    model.fit(X[:1], Y[:1], batch_size=1, epochs=1, verbose=0)  # and training goes on from there
    assert _w(model) == pytest.approx(0.512, rel=1e-6)


def test_early_stopping_restores_the_best_epoch_s_carried_weights():
    model = _model()
    model.optimizer.learning_rate = 1.1  # each step: w - 2 * 1.1 * w = -1.2 w, so the loss grows
    stop = mirrax.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    history = model.fit(
        X, Y, batch_size=1, epochs=5, steps_per_epoch=1, shuffle=False, verbose=0, callbacks=[stop]
    )
    # Epoch 0: loss 1, w -> -1.2 (the best); epoch 1: loss 1.44, worse: stop, restore -1.2.
    assert history.history["loss"] == pytest.approx([1.0, 1.44], rel=1e-6)
    assert _w(model) == pytest.approx(-1.2, rel=1e-6)


def test_a_checkpoint_every_two_batches_holds_the_weights_after_those_batches(tmp_path):
    model = _model()
    checkpoint = mirrax.callbacks.ModelCheckpoint(
        str(tmp_path / "w-{batch}.weights.h5"), save_freq=2, save_weights_only=True
    )
    model.fit(X, Y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    for batch, steps in (("2", 2), ("4", 4)):  # 1-based batch numbers: after 2 and 4 steps
        restored = _model()
        restored.load_weights(str(tmp_path / f"w-{batch}.weights.h5"))
        assert _w(restored) == pytest.approx(0.8**steps, rel=1e-6)


def test_evaluate_and_predict_carry_the_state_and_leave_the_model_usable():
    model = _model()
    model.set_weights([np.full((1, 1), 3.0, np.float32)])
    assert model.evaluate(X, Y, batch_size=1, verbose=0) == pytest.approx(9.0, rel=1e-6)  # (3 x)^2
    np.testing.assert_array_equal(model.predict(X, batch_size=1, verbose=0), np.full((4, 1), 3.0, np.float32))
    model.fit(X[:1], Y[:1], batch_size=1, epochs=1, verbose=0)
    assert _w(model) == pytest.approx(2.4, rel=1e-6)  # 3 - 2 * 0.1 * 3


def test_a_progress_bar_subclass_with_its_own_batch_hook_sees_each_step():
    model = _model()
    seen = []

    class WeightBar(mirrax.callbacks.ProgbarLogger):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(_w(self.model))

    model.fit(
        X, Y, batch_size=1, epochs=1, steps_per_epoch=3, shuffle=False, verbose=0, callbacks=[WeightBar()]
    )
    assert seen == pytest.approx([0.8, 0.64, 0.512], rel=1e-6)  # 1 * 0.8 per step


def test_a_batch_hook_set_in_on_train_begin_reads_and_writes_each_step():
    model = _model()
    seen = []

    class Late(mirrax.callbacks.Callback):
        def on_train_begin(self, logs=None):
            def begin(batch, logs=None):
                seen.append(_w(self.model))
                if batch == 1:
                    self.model.set_weights([np.full((1, 1), 10.0, np.float32)])

            self.on_train_batch_begin = begin

    model.fit(X, Y, batch_size=1, epochs=1, steps_per_epoch=3, shuffle=False, verbose=0, callbacks=[Late()])
    assert seen == pytest.approx([1.0, 0.8, 8.0], rel=1e-6)  # 1, 0.8, then 10 * 0.8
    assert _w(model) == pytest.approx(6.4, rel=1e-6)


def test_epoch_level_saving_callbacks_leave_the_state_carried_and_batch_level_ones_do_not(tmp_path):
    callbacks = mirrax.callbacks
    epoch_level = [
        callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True),
        callbacks.BackupAndRestore(str(tmp_path / "backup")),
        callbacks.TensorBoard(str(tmp_path / "logs")),
        callbacks.ProgbarLogger(),
    ]
    batch_level = [
        callbacks.ModelCheckpoint(str(tmp_path / "b.weights.h5"), save_weights_only=True, save_freq=5),
        callbacks.BackupAndRestore(str(tmp_path / "backup2"), save_freq=5),
    ]
    assert [c.needs_model_between_batches("train") for c in epoch_level] == [False] * 4
    assert [c.needs_model_between_batches("train") for c in batch_level] == [True] * 2

    class Reading(callbacks.TensorBoard):
        def on_train_batch_end(self, batch, logs=None):
            self.model.get_weights()

    assert Reading(str(tmp_path / "logs2")).needs_model_between_batches("train")
