"""The `mirrax` command's arguments: the parser of every subcommand (`devices`, `train`,
`report`, `launch`) and the checked types of its options (positive counts, fractions, powers of
two, finite numbers), which refuse a bad value with argparse's exit status 2."""

from __future__ import annotations

import argparse
import math
import sys

from mirrax._src.distribute import cpu_devices
from mirrax._src.report.links import LINK_NAMES

_COUNT_FLAG = cpu_devices.COUNT_FLAG


DEFAULT_CPU_DEVICES = 4


MIXED_PRECISION_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `mirrax` command (subcommands `devices`, `train`, `report`,
    `launch`)."""
    parser = argparse.ArgumentParser(
        prog="mirrax",
        description="The tf.distribute programming model on JAX: list devices, run the demo job, "
        "report what scaling a step will cost, launch local workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_cpu_devices(sub, default=str(DEFAULT_CPU_DEVICES)):
        sub.add_argument(
            "--cpu-devices",
            type=_positive_int,
            default=None,
            metavar="N",
            help=(
                "number of (fake) CPU devices JAX creates, through XLA_FLAGS="
                f"{_COUNT_FLAG}=N (default {default}, or the count already in "
                "XLA_FLAGS). Accelerators, when present, are used whatever N is."
            ),
        )

    devices = commands.add_parser(
        "devices",
        help="list the devices, as tf.config.list_physical_devices() prints them",
        description="List the devices, one per line, as tf.config.list_physical_devices().",
    )
    add_cpu_devices(devices)

    train = commands.add_parser(
        "train",
        help="train the TF tutorial CNN over every device: Keras-style fit, or a custom loop",
        description=(
            "TensorFlow's distributed-training tutorials on mirrax: the tutorial CNN trained "
            "with a MirroredStrategy over every device (or the first --replicas). --loop fit "
            "(default) runs examples/keras_fit.py (mirrax.Model compile/fit/evaluate, "
            "EarlyStopping, ReduceLROnPlateau); --loop custom runs "
            "examples/custom_training_loop.py (strategy.run, compute_average_loss, "
            "strategy.reduce)."
        ),
    )
    train.add_argument(
        "--loop",
        choices=("fit", "custom"),
        default="fit",
        help="fit: Model.fit with 10%% of the training images held out for "
        "validation (default); custom: a custom training loop, tested every "
        "epoch",
    )
    train.add_argument(
        "--data",
        choices=("digits", "cifar10"),
        default="digits",
        help="digits: scikit-learn's bundled 8x8 digits (default); cifar10: CIFAR-10 read from --data-dir",
    )
    train.add_argument(
        "--data-dir",
        default="~/.mirrax/datasets",
        metavar="DIR",
        help="where the CIFAR-10 'python version' files are: the "
        "cifar-10-python.tar.gz archive, the extracted cifar-10-batches-py "
        "folder, or a folder holding either (default ~/.mirrax/datasets)",
    )
    train.add_argument(
        "--epochs",
        type=_positive_int,
        default=10,
        help="epochs (default 10; with --loop fit, EarlyStopping may stop sooner)",
    )
    # 16 x 4 fake CPU devices = global batch 64: 21 Adam steps per epoch on the 1293 digits
    # fit trains on (23 on the custom loop's 1437), enough for >= 0.95 test accuracy in 10
    # epochs; 64 per replica (6 steps per epoch) reaches only 0.91-0.92 (docs/design.md).
    train.add_argument(
        "--batch-size-per-replica",
        "--batch-per-replica",
        type=_positive_int,
        default=16,
        metavar="N",
        dest="batch_size_per_replica",
        help="examples per replica per step; the global batch is N times the number of replicas (default 16)",
    )
    add_cpu_devices(train)
    train.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        metavar="N",
        help="use only the first N devices (default: all of them)",
    )
    train.add_argument(
        "--seed",
        type=_non_negative_int,
        default=0,
        help="seed of the initial weights (and, with --loop custom, of the shuffling) (default 0)",
    )
    train.add_argument(
        "--lr", type=_positive_float, default=1e-3, help="Adam's (initial) learning rate (default 1e-3)"
    )
    train.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISION_POLICIES,
        default="float32",
        metavar="POLICY",
        help="Keras dtype policy of --loop fit: "
        + ", ".join(MIXED_PRECISION_POLICIES)
        + " (default float32)",
    )
    train.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="with --loop fit, write TensorBoard event files to DIR",
    )

    report = commands.add_parser(
        "report",
        help="what training an example's step on 1, 2, 4 ... N replicas will cost",
        description=(
            "The scaling report (mirrax.experimental.scaling_report, docs/report.md) of the "
            "tutorial CNN's training step on one per-replica batch of the data: for 1, 2, "
            "4 ... --max-replicas replicas, the collectives and their bytes read from the "
            "compiled step, per-device memory with and without a sharded optimizer state, and "
            "the step time and speedup predicted for a link from the measured one-device "
            "step. --loop fit (default) reports examples/keras_fit.py's Model.fit step, --loop "
            "custom examples/custom_training_loop.py's train_step."
        ),
    )
    report.add_argument(
        "--loop",
        choices=("fit", "custom"),
        default="fit",
        help="fit: the step of Model.fit (default); custom: the custom training loop's train_step",
    )
    report.add_argument(
        "--data",
        choices=("digits", "cifar10"),
        default="digits",
        help="digits: the bundled 8x8 digits (default); cifar10: CIFAR-10 read from --data-dir",
    )
    report.add_argument(
        "--data-dir",
        default="~/.mirrax/datasets",
        metavar="DIR",
        help="where the CIFAR-10 files are (as for mirrax train)",
    )
    report.add_argument(
        "--batch-size-per-replica",
        "--batch-per-replica",
        type=_positive_int,
        default=16,
        metavar="N",
        dest="batch_size_per_replica",
        help="examples per replica per step, the same at every replica count (weak scaling) (default 16)",
    )
    report.add_argument(
        "--max-replicas",
        type=_power_of_two,
        default=8,
        metavar="N",
        help="the largest replica count, a power of two (default 8)",
    )
    report.add_argument(
        "--link",
        choices=LINK_NAMES,
        default=None,
        help="the link between replicas: nvlink (450 GB/s), pcie (31.5 GB/s), "
        "ethernet-100g (12.5 GB/s), or local (this machine's devices, "
        "measured); default nvlink, or the link of --bandwidth/--latency",
    )
    report.add_argument(
        "--bandwidth",
        type=_positive_float,
        default=None,
        metavar="GB/S",
        help="your link's bandwidth each way per device, in GB/s (replaces the --link preset's)",
    )
    report.add_argument(
        "--latency",
        type=_non_negative_float,
        default=None,
        metavar="US",
        help="your link's latency per ring step, in microseconds (default 0 "
        "with --bandwidth; replaces the --link preset's)",
    )
    report.add_argument(
        "--overlap",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="share of the communication hidden behind compute, 0 to 1 (default 0: none, as on XLA:CPU)",
    )
    report.add_argument(
        "--shard-optimizer-state",
        action="store_true",
        help="predict the step with MirroredStrategy(shard_optimizer_state="
        "True) (memory is shown for both either way)",
    )
    report.add_argument(
        "--timing-windows",
        type=_positive_int,
        default=5,
        metavar="N",
        help="timed windows of the one-device step (default 5)",
    )
    report.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seed of the initial weights (default 0)"
    )
    report.add_argument(
        "--lr", type=_positive_float, default=1e-3, help="Adam's learning rate (default 1e-3)"
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    report.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the predicted speedup against replicas (and the ideal) "
        "into FILE, in the format its suffix names: .png, .svg or .pdf (needs "
        "matplotlib)",
    )
    add_cpu_devices(report, default="--max-replicas, at most 8")

    launch = commands.add_parser(
        "launch",
        help="run a program as N local worker processes of a multi-worker job (TF_CONFIG)",
        description=(
            "Run PROGRAM as --nproc worker processes on this node, each with a TF_CONFIG "
            "(worker 0 is the chief; its address is the coordinator of jax.distributed), its "
            "output lines prefixed '[worker i] '. Signals are forwarded; when a worker fails, "
            "the others are stopped and the launcher exits with the worker's code, or, with "
            "--max-restarts, starts the group again. A bare "
            "'python' or 'python3' as PROGRAM is the interpreter running mirrax (sys.executable, "
            "as torchrun does), not the first one on PATH, so the workers see the same packages; "
            "give a path (e.g. /usr/bin/python3) to run another. For several "
            "nodes, run the same command on each with --nnodes, --node-rank and --coordinator. "
            "See docs/launch.md."
        ),
        usage="%(prog)s [options] -- PROGRAM [ARGS ...]",
    )
    launch.add_argument(
        "--nproc",
        type=_worker_count,
        default=1,
        metavar="N",
        help="worker processes on this node, or MIN:MAX: start MAX and, when a worker is killed "
        "by a signal in two attempts in a row (--max-restarts), go on with one fewer, down to MIN "
        "(default 1)",
    )
    launch.add_argument(
        "--cpu-devices",
        type=_positive_int,
        default=None,
        metavar="K",
        help=f"(fake) CPU devices per worker, through the workers' XLA_FLAGS="
        f"{_COUNT_FLAG}=K (default: XLA_FLAGS as inherited)",
    )
    launch.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="P",
        help="single node: the coordinator's port on 127.0.0.1 (worker i's "
        "address is 127.0.0.1:P+i, only worker 0's is used) (default: a free "
        "port)",
    )
    launch.add_argument(
        "--nnodes",
        type=_positive_int,
        default=1,
        metavar="M",
        help="nodes running this same command (default 1)",
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index in [0, M); its workers are R*N .. R*N+N-1 of M*N (default 0)",
    )
    launch.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of worker 0 on node 0, reachable from every node; required with --nnodes > 1",
    )
    launch.add_argument(
        "--grace-period",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between SIGTERM (or a forwarded signal) and SIGKILL (default 10)",
    )
    launch.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="start the whole group again, up to N times, when a worker fails (not when the "
        "launcher is signalled); the program resumes from its backup (BackupAndRestore) "
        "(default 0: never)",
    )
    launch.add_argument(
        "--restart-delay",
        type=_non_negative_float,
        default=None,
        metavar="SECONDS",
        help="seconds between a failed attempt's end and the restart (default 1)",
    )
    launch.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="-- PROGRAM [ARGS ...]",
        help="the program and its arguments, run as given (no shell); "
        "python or python3 means this interpreter (" + sys.executable.replace("%", "%%") + ")",
    )
    return parser


def _number(text: str, kind, minimum, expected: str, exclusive: bool = False):
    """`text` as `kind` (int or float), finite and >= `minimum` (> with `exclusive`)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, received {text!r}") from None
    too_small = value <= minimum if exclusive else value < minimum
    if too_small or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, received {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return _number(text, int, 0, "an integer >= 0")


def _positive_int(text: str) -> int:
    return _number(text, int, 1, "a positive integer")


def _worker_count(text: str):
    """N, or (MIN, MAX) for "MIN:MAX" (an elastic width; its order is checked by the launcher)."""
    if ":" not in text:
        return _positive_int(text)
    low, _, high = text.partition(":")
    try:
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or MIN:MAX (e.g. 2:4), received {text!r}"
        ) from None


def _power_of_two(text: str) -> int:
    value = _number(text, int, 1, "a power of two >= 1 (1, 2, 4, 8, ...)")
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two >= 1 (1, 2, 4, 8, ...), received {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    return _number(text, float, 0.0, "a finite number >= 0 (e.g. 5)")


def _fraction(text: str) -> float:
    value = _number(text, float, 0.0, "a number from 0 to 1 (e.g. 0.5)")
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1 (e.g. 0.5), received {text!r}")
    return value


def _positive_float(text: str) -> float:
    # A zero or negative learning rate trains nothing (or climbs the loss) without a word.
    return _number(text, float, 0.0, "a finite number > 0 (e.g. 1e-3)", exclusive=True)
