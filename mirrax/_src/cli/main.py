"""The `mirrax` command: the checks across its arguments, the CPU device count, and dispatch to
the commands (the parser and its option types: arguments.py).

JAX reads `XLA_FLAGS` once, when it starts its backends (at the first device query), so
nothing may ask for devices before `main` has parsed the arguments and set
`--xla_force_host_platform_device_count`. Importing JAX does not start it (the `mirrax` package
imports JAX, and this module lives in that package); the commands' modules are still imported
only once the flag is set, so none of them can start JAX early by accident.
"""

from __future__ import annotations

import argparse
import os
import sys

from mirrax import errors
from mirrax._src.cli.arguments import DEFAULT_CPU_DEVICES, build_parser
from mirrax._src.distribute import cpu_devices
from mirrax._src.report import plot as plot_lib
from mirrax._src.report.links import LOCAL

_COUNT_FLAG = cpu_devices.COUNT_FLAG


def main(argv=None) -> int:
    """Runs the `mirrax` command line.

    Args:
      argv: the arguments without the program name (a list of str), or None for `sys.argv[1:]`.

    Returns:
      The exit status: 0 on success, 1 when the command failed with a mirrax error (e.g. a
      missing data set; the message goes to stderr). Bad arguments exit with status 2, as
      argparse does. `launch` returns its workers' status (see `mirrax._src.cli.launch.launch`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "launch":
        # Before configure_cpu_devices and the JAX-importing modules: the launcher passes
        # --cpu-devices to its workers and never touches devices itself.
        return _launch(parser, args)
    if args.command == "train" and args.loop == "custom":
        for option, value, default in (
            ("--mixed-precision", args.mixed_precision, "float32"),
            ("--tensorboard", args.tensorboard, None),
        ):
            if value != default:
                parser.error(
                    f"{option} {value} applies to --loop fit (mirrax.Model) only; the custom "
                    "training loop computes in float32 and writes no TensorBoard logs. Drop "
                    f"{option} or use --loop fit."
                )
    if (
        args.command == "train"
        and args.tensorboard is not None
        and os.path.exists(os.path.expanduser(args.tensorboard))
        and not os.path.isdir(os.path.expanduser(args.tensorboard))
    ):
        parser.error(
            f"--tensorboard {args.tensorboard} is a file, not a folder; TensorBoard writes its "
            "event files into a folder. Give a folder path (it is created if missing)."
        )
    if args.command == "report":
        # Before any work: the report takes tens of seconds to compile and time its step.
        problem = _report_link_problem(args)
        if problem is not None:
            parser.error(problem)
        if args.plot is not None:
            try:
                plot_lib.check_path(args.plot)
            except errors.MirraxError as e:
                print(f"mirrax report: error: {e}", file=sys.stderr, flush=True)
                return 1
    # The report compiles its step at every replica count there are devices for, up to 8
    # (more fake devices than that cost compile time and say little more).
    configure_cpu_devices(
        args.cpu_devices,
        default=min(args.max_replicas, 8) if args.command == "report" else DEFAULT_CPU_DEVICES,
    )
    # The commands' modules are imported only now, inside `try`: they must see XLA_FLAGS first.
    try:
        if args.command == "devices":
            from mirrax._src.cli.devices import physical_device_lines

            print("\n".join(physical_device_lines()), flush=True)
        elif args.command == "report":
            from mirrax._src.cli.report import report

            report(args)
        else:
            from mirrax._src.cli.train import train

            train(args)
    except errors.MirraxError as e:
        print(f"mirrax {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _report_link_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with `mirrax report`'s link options, or None (the checks of
    `mirrax._src.report.links.resolve`, worded for the command line)."""
    if args.link == LOCAL and (args.bandwidth is not None or args.latency is not None):
        given = " ".join(
            f"{option} {value:g}"
            for option, value in (("--bandwidth", args.bandwidth), ("--latency", args.latency))
            if value is not None
        )
        return (
            f"--link local is measured on this machine, so it takes no numbers; received "
            f"{given}. Drop {given}, or pick another --link."
        )
    if args.link is None and args.bandwidth is None and args.latency is not None:
        return (
            f"--latency {args.latency:g} was given without --bandwidth; a link needs both. "
            "Add --bandwidth GB/S (your link's bandwidth each way), or pick a preset with "
            "--link (--latency then replaces its latency)."
        )
    return None


def _launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from mirrax._src.cli import launch

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    grace_period = launch.GRACE_PERIOD_S if args.grace_period is None else args.grace_period
    restart_delay = launch.RESTART_DELAY_S if args.restart_delay is None else args.restart_delay
    min_nproc, nproc = args.nproc if isinstance(args.nproc, tuple) else (None, args.nproc)
    arguments = (
        program,
        nproc,
        args.cpu_devices,
        args.port,
        args.nnodes,
        args.node_rank,
        args.coordinator,
        grace_period,
        args.max_restarts,
        restart_delay,
        min_nproc,
    )
    try:
        launch.check_arguments(*arguments)
    except ValueError as e:
        parser.error(str(e))
    return launch.launch(*arguments)


def configure_cpu_devices(count: int | None, default: int = DEFAULT_CPU_DEVICES) -> None:
    """Asks JAX for `count` CPU devices, through XLA_FLAGS, unless JAX has already started.

    The flag only affects JAX's CPU backend, so it is harmless on machines with accelerators
    (MirroredStrategy() then uses the accelerators). With `count=None` a device count already
    in XLA_FLAGS is kept, else `default` is set. When JAX's backends already run in this
    process (e.g. `main` called from a test), the device count cannot change; an explicit
    `count` that differs from the running one is reported on stderr.

    Args:
      count: the number of CPU devices (an int >= 1), or None for the default.
      default: the count set when `count` is None and XLA_FLAGS names none.
    """
    if _jax_backends_started():
        if count is not None:
            import jax

            running = len(jax.devices("cpu"))
            if running != count:
                print(
                    f"mirrax: --cpu-devices {count} has no effect: JAX already started in this "
                    f"process with {running} CPU devices. Set XLA_FLAGS={_COUNT_FLAG}={count} "
                    "before JAX starts (or run the mirrax command in a new process).",
                    file=sys.stderr,
                    flush=True,
                )
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if count is None:
        if _COUNT_FLAG + "=" in flags:
            return
        count = default
    os.environ["XLA_FLAGS"] = cpu_devices.with_cpu_device_count(flags, count)


def _jax_backends_started() -> bool:
    """Whether JAX has created its backends in this process (checked without starting them)."""
    return cpu_devices.backends_started()


if __name__ == "__main__":
    sys.exit(main())
