"""A Keras 3 functional model with two inputs and two outputs, distributed.

As Keras's functional API guide builds one: a `signal` input (16 values) and a `meta` input (4
values) feed a shared trunk, which ends in two heads, `value` (a regression, mean squared
error) and `kind` (3 classes, sparse categorical cross-entropy from logits). `compile` takes a
loss and a metric per output, keyed by output name, and `loss_weights` that scale each loss in
the total; `fit` logs `loss`, `value_loss`, `kind_loss`, `value_mae` and `kind_accuracy`, as
Keras does. x is a dict keyed by input name, y a dict keyed by output name (lists in input
and output order work too). The data are synthetic: `value` is a fixed linear function of the
inputs plus noise, `kind` the bucket of another.

    python examples/multi_output.py --epochs 5

Without an accelerator, fake CPU devices give several replicas:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/multi_output.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported: mirrax runs JAX

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402


def synthetic(n: int, seed: int = 0):
    """`n` examples: x {"signal": float32 (n, 16), "meta": float32 (n, 4)}, y {"value": float32
    (n, 1), "kind": int32 (n,) in 0..2}."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=(n, 16)).astype(np.float32)
    meta = rng.normal(size=(n, 4)).astype(np.float32)
    direction = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    value = signal @ direction / 4 + meta[:, 0] + rng.normal(0, 0.1, n).astype(np.float32)
    score = signal[:, :8].sum(axis=1) / np.sqrt(8) + meta[:, 1]
    kind = np.digitize(score, [-0.6, 0.6]).astype(np.int32)  # three classes of about 1/3 each
    return {"signal": signal, "meta": meta}, {"value": value[:, None], "kind": kind}


def build_model() -> keras.Model:
    """The two-input, two-output functional model (its outputs named `value` and `kind`)."""
    signal = keras.Input(shape=(16,), name="signal")
    meta = keras.Input(shape=(4,), name="meta")
    trunk = layers.Dense(32, activation="relu")(layers.Concatenate()([signal, meta]))
    return keras.Model(
        inputs=[signal, meta],
        outputs=[layers.Dense(1, name="value")(trunk), layers.Dense(3, name="kind")(trunk)],
    )


def train(
    strategy, train_data, test_data, *, epochs: int = 5, batch_size_per_replica: int = 32, seed: int = 0
):
    """Trains the model with `Model.fit` on every replica of `strategy`, then evaluates it.

    Returns (model, history, results): the trained `mirrax.Model`, its per-epoch logs, and
    `evaluate`'s dict on `test_data` (loss, value_loss, kind_loss, value_mae, kind_accuracy).
    """
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = mirrax.Model(build_model())
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=1e-2),
            loss={"value": "mse", "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
            loss_weights={"value": 1.0, "kind": 0.5},
            metrics={"value": ["mae"], "kind": ["accuracy"]},
        )
    history = model.fit(x_train, y_train, batch_size=global_batch_size, epochs=epochs)
    results = model.evaluate(x_test, y_test, batch_size=global_batch_size, return_dict=True)
    print("Test " + ", ".join(f"{name}: {value:.4f}" for name, value in results.items()), flush=True)
    return model, history.history, results


def main(argv=None) -> None:
    """Trains on the synthetic data over every device; `argv` as `sys.argv[1:]` (None reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="default 5")
    args = parser.parse_args(argv)
    strategy = mirrax.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    x, y = synthetic(2400)
    head = lambda tree, s: {k: v[s] for k, v in tree.items()}  # noqa: E731
    train(
        strategy,
        (head(x, slice(0, 2000)), head(y, slice(0, 2000))),
        (head(x, slice(2000, None)), head(y, slice(2000, None))),
        epochs=args.epochs,
    )


if __name__ == "__main__":
    main()
