"""`python -m benchmarks`: the one entry point of the benchmark suite.

    python -m benchmarks list                 # the benchmarks there are, one line each
    python -m benchmarks run                  # every benchmark, one after the other
    python -m benchmarks run overhead memory  # some of them
    python -m benchmarks run --out DIR        # where the JSON files go (default benchmarks/results)

Every benchmark is a module `benchmarks/<name>.py` (what they share: `benchmarks/_harness/`)
that prints its tables and takes `--json PATH`; run one as `python -m benchmarks.<name>` to
pass options. The runner uses the defaults, runs each in its own process, prints its output and
writes `<out>/<name>.json`; one whose packages are missing (the peers') says so and is skipped.
Exit status: 0 when every benchmark ran, 1 otherwise.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

from benchmarks._harness import env

HERE = pathlib.Path(__file__).resolve().parent


def available() -> dict:
    """{name: path} of the benchmark scripts, by name."""
    return {p.stem: p for p in sorted(HERE.glob("*.py")) if not p.stem.startswith("_")}


def _summary(path: pathlib.Path) -> str:
    for line in path.read_text().splitlines():
        line = line.strip().strip('"').strip()
        if line:
            return line
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the benchmarks")
    run = commands.add_parser("run", help="run benchmarks (all by default)")
    run.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    run.add_argument(
        "--out",
        default=str(HERE / "results"),
        metavar="DIR",
        help="directory for the JSON results (default benchmarks/results)",
    )
    args = parser.parse_args(argv)
    scripts = available()
    if args.command == "list":
        for name, path in scripts.items():
            print(f"{name:<20} {_summary(path)}")
        return 0
    unknown = [n for n in args.names if n not in scripts]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(scripts)}")
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot create the folder for the JSON results ({e}).")
    failed = []
    for name in args.names or list(scripts):
        print(f"\n=== {name} ({time.strftime('%Y-%m-%d %H:%M:%S')}) ===", flush=True)
        code = subprocess.call(
            env.module_command(f"benchmarks.{name}", "--json", out / f"{name}.json"),
            env=env.child_environment(),
        )
        if code:
            print(f"=== {name}: exit status {code}", flush=True)
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
