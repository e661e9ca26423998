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
