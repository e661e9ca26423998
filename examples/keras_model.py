"""A Keras 3 model, distributed: TensorFlow's "Distributed training with Keras" with Keras layers.

The model code of the tutorial (a `keras.Sequential` CNN: Conv2D 32, 64, 64 with max pooling,
Flatten, Dense 64, Dense 10; Adam; SparseCategoricalCrossentropy(from_logits=True);
EarlyStopping and ReduceLROnPlateau) with only its import lines changed: `keras` is Keras 3
on the JAX backend, `callbacks` are mirrax's, and the Keras model is wrapped in `mirrax.Model`
under `strategy.scope()`. Every step then runs on all replicas as one compiled program. The
data are scikit-learn's bundled handwritten digits (8x8 images, so the convolutions pad
"same").

    python examples/keras_model.py --epochs 10

Without an accelerator, fake CPU devices give several replicas:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/keras_model.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported: mirrax runs JAX

import keras  # noqa: E402
from keras import layers  # noqa: E402

import mirrax  # noqa: E402
from mirrax import callbacks  # noqa: E402

# The share of the training examples held out (from the end) to validate after every epoch.
VALIDATION_SPLIT = 0.1


def build_model(image_shape, num_classes: int = 10) -> keras.Model:
    """The tutorial's CNN in Keras layers: logits of shape (batch, num_classes) for images of
    shape (batch, *image_shape); height and width multiples of 4 (two 2x2 max-pools)."""
    return keras.Sequential(
        [
            keras.Input(shape=image_shape),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.Flatten(),
            layers.Dense(64, activation="relu"),
            layers.Dense(num_classes),
        ]
    )


def train(
    strategy, train_data, test_data, *, epochs: int = 10, batch_size_per_replica: int = 16, seed: int = 0
):
    """Trains the Keras CNN with `Model.fit` on every replica of `strategy`, then evaluates it.

    Args:
      strategy: the `mirrax.Strategy` to train with, e.g. `mirrax.MirroredStrategy()`.
      train_data, test_data: (images float32 (N, height, width, channels), labels int32 (N,)).
      epochs: the most epochs to train (EarlyStopping may stop sooner).
      batch_size_per_replica: examples per replica per step (the global batch is this times
        `strategy.num_replicas_in_sync`).
      seed: Keras's random seed (initial weights).

    Returns:
      (model, history, test_accuracy): the trained `mirrax.Model` (`model.keras_model` is the
      Keras model, holding the trained weights), its per-epoch logs, and the test accuracy.
    """
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = mirrax.Model(build_model(x_train.shape[1:]))
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(learning_rate=1e-3),
            metrics=["accuracy"],
        )
    history = model.fit(
        x_train,
        y_train,
        batch_size=global_batch_size,
        epochs=epochs,
        validation_split=VALIDATION_SPLIT,
        callbacks=[
            callbacks.EarlyStopping(patience=3, restore_best_weights=True),
            callbacks.ReduceLROnPlateau(factor=0.5, patience=2),
        ],
    )
    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=global_batch_size)
    print(f"Test accuracy: {test_accuracy:.4f}", flush=True)
    return model, history.history, test_accuracy


def main(argv=None) -> None:
    """Trains on the digits over every device; `argv` as `sys.argv[1:]` (None reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="default 10")
    args = parser.parse_args(argv)
    strategy = mirrax.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    train(strategy, *mirrax.data.load_digits(), epochs=args.epochs)


if __name__ == "__main__":
    main()
