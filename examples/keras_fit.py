"""Keras-style distributed training: TensorFlow's "Distributed training with Keras" on mirrax.

The tutorial's program with `tf.distribute` and `tf.keras` swapped for mirrax: create a
`MirroredStrategy`, build and compile the model under `strategy.scope()`, and call `fit` with
the GLOBAL batch size (the batch per replica times the number of replicas). Every step runs on
all replicas as one compiled program, with the gradients summed over them. The model is the CNN
of TensorFlow's CNN tutorial written in Flax NNX; the data are scikit-learn's bundled
handwritten digits (1,797 8x8 images, no download).

    python examples/keras_fit.py --epochs 10

Without an accelerator, fake CPU devices give several replicas:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/keras_fit.py

`mirrax train` runs this program's `train` with more options (CIFAR-10, the replica count,
TensorBoard logs).
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import optax
from flax import nnx

import mirrax

# The share of the training examples held out (from the end) to validate after every epoch.
VALIDATION_SPLIT = 0.1


class TutorialCNN(nnx.Module):
    """The CNN of TensorFlow's CNN tutorial, with "SAME" padding so it fits 8x8 and 32x32 images.

    Conv 32 3x3 relu -> max pool 2 -> Conv 64 3x3 relu -> max pool 2 -> Conv 64 3x3 relu ->
    flatten -> Dense 64 relu -> Dense `num_classes` (logits).

    The last layer computes in float32 whatever the mixed precision policy (with
    `dtype=jnp.float32` it casts its bfloat16/float16 input and kernel up), as Keras's mixed
    precision guide advises for the output layer: the logits keep float32's range and precision.

    Args:
      image_shape: (height, width, channels) of the input images, e.g. (8, 8, 1) or (32, 32, 3);
        height and width must be multiples of 4 (two 2x2 max-pools).
      num_classes: number of outputs.
      rngs: `nnx.Rngs` for the initial weights.
    """

    def __init__(self, image_shape, num_classes: int = 10, *, rngs: nnx.Rngs):
        height, width, channels = image_shape
        self.conv1 = nnx.Conv(channels, 32, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding="SAME", rngs=rngs)
        self.conv3 = nnx.Conv(64, 64, (3, 3), padding="SAME", rngs=rngs)
        self.dense1 = nnx.Linear((height // 4) * (width // 4) * 64, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, num_classes, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        """Logits, float32 of shape (batch, num_classes), for images (batch, h, w, channels)."""
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        x = nnx.relu(self.conv3(x))
        x = x.reshape((x.shape[0], -1))
        return self.dense2(nnx.relu(self.dense1(x)))


def train(
    strategy,
    train_data,
    test_data,
    *,
    epochs: int = 10,
    batch_size_per_replica: int = 16,
    learning_rate: float = 1e-3,
    seed: int = 0,
    tensorboard_dir=None,
):
    """Trains the CNN with `Model.fit` on every replica of `strategy`, then evaluates it.

    The last `VALIDATION_SPLIT` (10%) of the training examples are held out for validation, as
    Keras's `validation_split` does (so shuffle the data beforehand; both `mirrax.data` sets
    come shuffled). EarlyStopping and ReduceLROnPlateau watch the validation loss; the test set
    is used once, at the end. The mixed precision policy is the one set before this call
    (`mirrax.mixed_precision.set_global_policy`). Progress goes to stdout, Keras-style, then
    `Test accuracy: 0.9xxx`.

    Args:
      strategy: the `mirrax.Strategy` to train with, e.g. `mirrax.MirroredStrategy()`.
      train_data: (images float32 (N, height, width, channels), labels int32 (N,) in 0..9).
      test_data: the test set, in the same form.
      epochs: the most epochs to train (EarlyStopping may stop sooner).
      batch_size_per_replica: examples per replica per step; the global batch is this times
        `strategy.num_replicas_in_sync`.
      learning_rate: Adam's initial learning rate (ReduceLROnPlateau halves it on plateaus).
      seed: seed of the initial weights.
      tensorboard_dir: a folder for TensorBoard event files, or None for none.

    Returns:
      (model, history, test_accuracy): the trained `mirrax.Model`, its per-epoch logs (a dict
      of lists: "loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"), and the
      share of test images classified correctly (a float in [0, 1]).
    """
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    with strategy.scope():
        model = mirrax.Model(TutorialCNN(x_train.shape[1:], rngs=nnx.Rngs(seed)))
        model.compile(
            optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate),
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = [
        mirrax.callbacks.EarlyStopping(patience=3, restore_best_weights=True, verbose=1),
        mirrax.callbacks.ReduceLROnPlateau(factor=0.5, patience=2, verbose=1),
    ]
    if tensorboard_dir is not None:
        callbacks.append(mirrax.callbacks.TensorBoard(tensorboard_dir))
    history = model.fit(
        x_train,
        y_train,
        batch_size=global_batch_size,
        epochs=epochs,
        validation_split=VALIDATION_SPLIT,
        callbacks=callbacks,
    )
    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=global_batch_size)
    print(f"Test accuracy: {test_accuracy:.4f}", flush=True)
    return model, history.history, test_accuracy


def main(argv=None) -> None:
    """Trains on the digits over every device; `argv` as `sys.argv[1:]` (None reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="default 10")
    parser.add_argument(
        "--mixed-precision", default="float32", choices=("float32", "mixed_bfloat16", "mixed_float16")
    )
    args = parser.parse_args(argv)

    mirrax.mixed_precision.set_global_policy(args.mixed_precision)
    strategy = mirrax.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    train(strategy, *mirrax.data.load_digits(), epochs=args.epochs)


if __name__ == "__main__":
    main()
