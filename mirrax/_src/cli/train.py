"""`mirrax train`: the two tutorial programs of examples/, with the command's options.

`--loop fit` (the default) runs `keras_fit.train`: TensorFlow's "Distributed training with
Keras" (`mirrax.Model` compile / fit / evaluate). `--loop custom` runs
`custom_training_loop.train`: TensorFlow's "Custom training with tf.distribute.Strategy"
(`strategy.run`, `compute_average_loss`, `strategy.reduce`). Both are the files of the
repository's examples/ folder, installed as the package `mirrax.examples` (see pyproject.toml),
so the command runs exactly the programs a user reads and copies. This module adds only what a
user program leaves out, shared by both loops: the data set (digits or CIFAR-10 files), the
number of replicas, the mixed precision policy and TensorBoard logs.
"""

from __future__ import annotations

import os

import jax

import mirrax
from mirrax import errors
from mirrax.examples import custom_training_loop, keras_fit


def train(args):
    """Runs the tutorial program `args.loop` names on the chosen data and replicas.

    Prints a line naming the strategy, the global batch size (`batch_size_per_replica` times
    the number of replicas) and the data, then the program's own output: Keras-style progress
    and `Test accuracy: 0.9xxx`. The mixed precision policy (fit only) is set for the run and
    restored afterwards.

    Args:
      args: an `argparse.Namespace` from `mirrax train`'s parser (`build_parser` in
        mirrax._src.cli.main), or any object with the attributes loop ("fit" or "custom"),
        data, data_dir, epochs, batch_size_per_replica, replicas (None for every device),
        seed, lr, mixed_precision (a policy name) and tensorboard (a folder or None).

    Returns:
      (model, history, test_accuracy) as the program returns them: a `mirrax.Model` (fit) or
      the `TutorialCNN` (custom), a dict of per-epoch lists, and the test accuracy (a float).

    With `TF_CONFIG` in the environment (and no `replicas`), the strategy is a
    `MultiWorkerMirroredStrategy` over every worker's devices: `mirrax launch --nproc 2 --
    mirrax train` trains one model on two processes.

    Raises:
      InvalidDeviceError: `args.replicas` exceeds the number of devices.
      MissingDatasetError: `args.data == "cifar10"` and the files are not in `args.data_dir`.
    """
    train_data, test_data = load_data(args.data, args.data_dir)
    strategy = _make_strategy(args.replicas)
    global_batch_size = args.batch_size_per_replica * strategy.num_replicas_in_sync
    held_out = (
        f" ({keras_fit.VALIDATION_SPLIT:.0%} of them held out for validation)" if args.loop == "fit" else ""
    )
    print(
        f"{strategy!r}: global batch {global_batch_size} ({args.batch_size_per_replica} per "
        f"replica); {args.data}: {len(train_data[1])} training images{held_out}, "
        f"{len(test_data[1])} test images",
        flush=True,
    )
    options = dict(
        epochs=args.epochs,
        batch_size_per_replica=args.batch_size_per_replica,
        learning_rate=args.lr,
        seed=args.seed,
    )
    if args.loop == "custom":
        return custom_training_loop.train(strategy, train_data, test_data, **options)
    previous_policy = mirrax.mixed_precision.global_policy()
    mirrax.mixed_precision.set_global_policy(args.mixed_precision)
    try:
        return keras_fit.train(strategy, train_data, test_data, tensorboard_dir=args.tensorboard, **options)
    finally:
        mirrax.mixed_precision.set_global_policy(previous_policy)


def load_data(data: str, data_dir):
    """(train, test) of `--data` ("digits", bundled; "cifar10", read from `data_dir`), each
    (images float32 (N, h, w, c), labels int32 (N,)).

    Raises:
      MissingDatasetError: "cifar10" and the files are not in `data_dir`.
    """
    if data == "digits":
        return mirrax.data.load_digits()
    if data == "cifar10":
        return mirrax.data.load_cifar10(data_dir)
    raise errors.InvalidArgumentError(f"--data must be 'digits' or 'cifar10'; received {data!r}.")


def _make_strategy(replicas):
    if replicas is None and os.environ.get("TF_CONFIG"):
        # One worker of a multi-worker job (e.g. under `mirrax launch`): the cluster is in
        # TF_CONFIG, as for TF's MultiWorkerMirroredStrategy.
        return mirrax.MultiWorkerMirroredStrategy()
    if replicas is None:
        return mirrax.MirroredStrategy()
    devices = jax.local_devices()
    if replicas > len(devices):
        names = ", ".join(f"{d.platform}:{i}" for i, d in enumerate(devices))
        raise errors.InvalidDeviceError(
            f"--replicas {replicas} asks for more replicas than this process has devices "
            f"({len(devices)}: {names}). Use --replicas {len(devices)} or fewer, or more CPU "
            f"devices with --cpu-devices {replicas}."
        )
    return mirrax.MirroredStrategy(devices[:replicas])
