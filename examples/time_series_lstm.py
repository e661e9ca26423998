"""A recurrent Keras 3 model, distributed: an LSTM forecasting the next value of a sine wave.

A `keras.Sequential` of LSTM 16 and Dense 1, trained with `Model.fit` over every device and
evaluated on held-out windows. The layer code is plain Keras on the JAX backend; wrapped in
`mirrax.Model` under `strategy.scope()`, every step runs on all replicas as one compiled
program (the LSTM's scan included: mirrax marks its per-replica state for it). The data are
windows of a noisy synthetic sine series: each example is `WINDOW` values, its label the next.

    python examples/time_series_lstm.py --epochs 5

Without an accelerator, fake CPU devices give several replicas:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/time_series_lstm.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported: mirrax runs JAX

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402

WINDOW = 24  # values a model sees to predict the next one


def sine_windows(n: int, seed: int = 0):
    """`n` (window, next value) pairs of a sine of period 50 steps plus noise (sd 0.05):
    x float32 (n, WINDOW, 1), y float32 (n, 1)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n + WINDOW, dtype=np.float32)
    series = np.sin(2 * np.pi * t / 50) + rng.normal(0, 0.05, t.shape).astype(np.float32)
    x = np.stack([series[i : i + WINDOW] for i in range(n)])[..., None]
    return x.astype(np.float32), series[WINDOW : WINDOW + n, None].astype(np.float32)


def train(
    strategy, train_data, test_data, *, epochs: int = 5, batch_size_per_replica: int = 16, seed: int = 0
):
    """Trains the LSTM with `Model.fit` on every replica of `strategy`, then evaluates it.

    Returns (model, history, test_mse): the trained `mirrax.Model`, its per-epoch logs, and the
    mean squared error on `test_data`.
    """
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = mirrax.Model(
            keras.Sequential([keras.Input(shape=x_train.shape[1:]), layers.LSTM(16), layers.Dense(1)])
        )
        model.compile(loss="mse", optimizer=keras.optimizers.Adam(learning_rate=1e-2))
    history = model.fit(x_train, y_train, batch_size=global_batch_size, epochs=epochs)
    test_mse = model.evaluate(x_test, y_test, batch_size=global_batch_size)
    print(f"Test MSE: {test_mse:.4f}", flush=True)
    return model, history.history, test_mse


def main(argv=None) -> None:
    """Trains on the sine series over every device; `argv` as `sys.argv[1:]` (None reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="default 5")
    args = parser.parse_args(argv)
    strategy = mirrax.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    x, y = sine_windows(1200)
    train(strategy, (x[:1000], y[:1000]), (x[1000:], y[1000:]), epochs=args.epochs)


if __name__ == "__main__":
    main()
