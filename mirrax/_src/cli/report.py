"""`mirrax report`: the scaling report of one of the bundled examples' training steps.

`--loop fit` (the default) reports the step `Model.fit` runs for examples/keras_fit.py's
compiled model; `--loop custom` reports examples/custom_training_loop.py's `train_step` with
its model and optimizer. Both train the tutorial CNN, on one per-replica batch of the chosen
data (the first `--batch-size-per-replica` training images). The report itself is
`mirrax.experimental.scaling_report` (docs/report.md).
"""

from __future__ import annotations

import sys

import optax
from flax import nnx

import mirrax
from mirrax._src.cli.train import load_data
from mirrax._src.report import plot as plot_lib
from mirrax.examples import custom_training_loop, keras_fit


def report(args):
    """Prints the scaling report of `args.loop`'s step: the table, or with `args.json` the
    report as JSON; with `args.plot` also writes the speedup plot there.

    Args:
      args: an `argparse.Namespace` from `mirrax report`'s parser (mirrax._src.cli.main), or
        any object with loop ("fit" or "custom"), data, data_dir, batch_size_per_replica,
        max_replicas, link (a preset name or None), bandwidth (GB/s or None), latency (µs or
        None), overlap, shard_optimizer_state, timing_windows, seed, lr, json (bool) and plot
        (a path or None).

    Returns:
      The `ScalingReport`.

    Raises:
      MissingDatasetError: `args.data == "cifar10"` and the files are not in `args.data_dir`.
      MissingDependencyError: `args.plot` without matplotlib installed.
      The errors of `mirrax.experimental.scaling_report` (e.g. a batch larger than the data).
    """
    if args.plot is not None:
        plot_lib.check_path(args.plot)  # before the minutes of work the report may take
    (x, y), _ = load_data(args.data, args.data_dir)
    if args.batch_size_per_replica > len(y):
        raise mirrax.errors.InvalidArgumentError(
            f"--batch-size-per-replica {args.batch_size_per_replica} is more than the "
            f"{len(y)} training images of {args.data}. Use at most {len(y)}."
        )
    batch = (x[: args.batch_size_per_replica], y[: args.batch_size_per_replica])
    step_args: tuple  # () for a Model; the custom loop's step takes (model, optimizer)
    if args.loop == "fit":
        model = mirrax.Model(keras_fit.TutorialCNN(x.shape[1:], rngs=nnx.Rngs(args.seed)))
        # Compiled as examples/keras_fit.py's `train` compiles it.
        model.compile(
            optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=args.lr),
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        step, step_args = model, ()
    else:
        model = keras_fit.TutorialCNN(x.shape[1:], rngs=nnx.Rngs(args.seed))
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
        step, step_args = custom_training_loop.train_step, (model, optimizer)
    result = mirrax.experimental.scaling_report(
        step,
        batch,
        step_args,
        max_replicas=args.max_replicas,
        link=args.link,
        bandwidth_gbps=args.bandwidth,
        latency_us=args.latency,
        overlap=args.overlap,
        shard_optimizer_state=args.shard_optimizer_state,
        timing_windows=args.timing_windows,
    )
    print(result.to_json() if args.json else str(result), flush=True)
    if args.plot is not None:
        result.plot(args.plot)
        print(f"mirrax report: wrote the speedup plot to {args.plot}", file=sys.stderr, flush=True)
    return result
