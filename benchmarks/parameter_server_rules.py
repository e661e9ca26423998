"""ParameterServerStrategy's two update rules compared on the digits CNN with Adam: test
accuracy after the same number of steps, and the staleness the asynchrony causes.

Workload: `mirrax.examples.keras_fit.TutorialCNN` on the embedded digits (the first 1,408 =
44 x 32 of the 1,437 training images, and the 360 test images, 8x8), compiled with
`optimizer="adam"`, `SparseCategoricalCrossentropy(from_logits=True)` and accuracy; global
batches of 32, 44 steps per epoch (one pass).
Reference: the same model on `MirroredStrategy(["cpu:0"])` (one worker, synchronous), whose
first epoch with a test accuracy >= 0.96 sets the step budget compared. Each rule x worker
count gets a fresh `ParameterServerStrategy(..., update=rule)` with one parameter server and
`fit(..., validation_data=test)` for `--epochs` epochs of 44 steps (steps count every worker's:
the servers apply the same number of updates as the reference); its test accuracy per epoch
comes from the validation, its staleness from `coordinator.update_staleness` (pushes by other
workers between a function's pull and its push). Asynchronous runs differ from run to run:
`--repeats` runs of each, interleaved.

Usage:
  python -m benchmarks.parameter_server_rules                  # ~4 minutes on 2 cores
  python -m benchmarks.parameter_server_rules --workers 2 --repeats 1 --epochs 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._harness import env

STEPS_PER_EPOCH = 44  # 1,437 training images // 32
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
RULES = ["differences", "gradients"]


def _model(strategy):
    from flax import nnx
    from mirrax.examples.keras_fit import TutorialCNN

    import mirrax

    with strategy.scope():
        model = mirrax.Model(TutorialCNN((8, 8, 1), rngs=nnx.Rngs(0)))
        model.compile(
            optimizer="adam",
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _fit(strategy, epochs: int) -> tuple[list, float]:
    import mirrax

    (x, y), (x_test, y_test) = mirrax.data.load_digits()
    # 44 full batches of 32: every epoch is one pass (1,437 would leave a short 45th batch,
    # which with steps_per_epoch=44 Keras carries into the next epoch as a 1-step epoch).
    x, y = x[: STEPS_PER_EPOCH * 32], y[: STEPS_PER_EPOCH * 32]
    model = _model(strategy)
    start = time.perf_counter()
    history = model.fit(
        x, y, batch_size=32, epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH,
        validation_data=(x_test, y_test), verbose=0,
    )  # fmt: skip
    return history.history["val_accuracy"], time.perf_counter() - start


def _reference(epochs: int) -> dict:
    import mirrax

    accuracy, seconds = _fit(mirrax.MirroredStrategy(["cpu:0"]), epochs)
    env.log(f"  MirroredStrategy(['cpu:0']): {[round(a, 3) for a in accuracy]} ({seconds:.1f} s)")
    return {"accuracy": accuracy, "seconds": seconds}


def _parameter_server(rule: str, workers: int, epochs: int) -> dict:
    import mirrax

    strategy = mirrax.ParameterServerStrategy(
        mirrax.RayClusterResolver(workers, 1, worker_env=ONE_DEVICE), update=rule
    )
    try:
        accuracy, seconds = _fit(strategy, epochs)
        staleness = list(strategy.extended.coordinator.update_staleness)
    finally:
        strategy.shutdown()
    env.log(
        f"  {rule}, {workers} workers: {[round(a, 3) for a in accuracy]} ({seconds:.1f} s, "
        f"staleness mean {statistics.fmean(staleness):.2f})"
    )
    return {"accuracy": accuracy, "seconds": seconds, "staleness_mean": statistics.fmean(staleness)}


def _first_epoch(accuracy: list, threshold: float) -> int | None:
    return next((epoch for epoch, a in enumerate(accuracy, start=1) if a >= threshold), None)


def _measure(args) -> dict:
    import jax

    import mirrax

    cluster = mirrax.RayClusterResolver(max(args.worker_counts), 1)
    cluster.connect()
    runs: dict = {}
    try:
        reference = _reference(args.epochs)
        for _ in range(args.repeats):
            for workers in args.worker_counts:
                for rule in RULES:  # interleaved: a loaded moment touches both rules alike
                    runs.setdefault((rule, workers), []).append(_parameter_server(rule, workers, args.epochs))
    finally:
        cluster.shutdown()
    return {
        "environment": env.environment(jax.local_devices()[:1]),
        "epochs": args.epochs,
        "reference": reference,
        "runs": [{"rule": r, "workers": w, "runs": v} for (r, w), v in runs.items()],
    }


def _markdown(result: dict) -> str:
    reference = result["reference"]["accuracy"]
    budget = _first_epoch(reference, 0.96)
    at = (budget or result["epochs"]) - 1
    rows = [
        [
            "MirroredStrategy(['cpu:0'])",
            "1",
            f"{reference[at]:.3f}",
            _epochs(reference, 0.95),
            f"{reference[-1]:.3f}",
            "",
        ]
    ]
    for entry in result["runs"]:
        accuracies = [run["accuracy"] for run in entry["runs"]]
        rows.append(
            [
                f"update={entry['rule']!r}",
                str(entry["workers"]),
                " / ".join(f"{a[at]:.3f}" for a in accuracies),
                " / ".join(_epochs(a, 0.95) for a in accuracies),
                " / ".join(f"{a[-1]:.3f}" for a in accuracies),
                " / ".join(f"{run['staleness_mean']:.2f}" for run in entry["runs"]),
            ]
        )
    steps = "not reached" if budget is None else f"{budget * STEPS_PER_EPOCH} steps (epoch {budget})"
    lines = env.markdown_table(
        [
            "strategy",
            "workers",
            f"test accuracy at {(at + 1) * STEPS_PER_EPOCH} steps",
            "steps to >= 0.95",
            f"after {result['epochs'] * STEPS_PER_EPOCH} steps",
            "staleness mean",
        ],
        rows,
        ["l", "r", "r", "r", "r", "r"],
    )
    lines += [
        "",
        f"{env.environment_note(result['environment'])} MirroredStrategy on one worker first "
        f"reaches 0.96 test accuracy at {steps}; every cell lists each repeat's value "
        "(asynchronous runs differ). One parameter server; workers with one CPU device each "
        "share the host's cores with it and the coordinator.",
    ]
    return "\n".join(lines)


def _epochs(accuracy: list, threshold: float) -> str:
    epoch = _first_epoch(accuracy, threshold)
    return "not reached" if epoch is None else str(epoch * STEPS_PER_EPOCH)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4", help="worker counts (default 2,4)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of 44 steps (default 12)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each rule x workers (default 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    try:
        args.worker_counts = sorted({int(n) for n in args.workers.split(",") if n.strip()})
    except ValueError:
        args.worker_counts = []
    if not args.worker_counts or args.worker_counts[0] < 1 or args.epochs < 1 or args.repeats < 1:
        parser.error("--workers needs counts >= 1 like 2,4; --epochs and --repeats must be >= 1")
    env.check_json_path(args.json)
    env.configure_jax_environment("cpu", 1)
    return env.run_in_process(args, _measure, _markdown)


if __name__ == "__main__":
    sys.exit(main())
