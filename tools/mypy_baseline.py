"""mypy against a baseline that may only shrink: `python -m tools.mypy_baseline MYPY [--update]`.

Runs MYPY (the mypy executable; its config is [tool.mypy] in pyproject.toml) and compares its
errors with .ci/mypy-baseline.txt, one error a line without its line number (so an edit above an
error does not move it). Fails when an error is not in the baseline (a new one), and when a
baseline entry no longer occurs (a fixed one: `--update` then rewrites the baseline, which it
only ever shrinks). Zero errors and an empty baseline is the goal.

`--rewrite` writes the current errors whatever they are: for code moved between files (its
errors then carry a new path), never to let a new error in; its diff shows which it is.
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys

BASELINE = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "mypy-baseline.txt"
# path:line: error: message  [code]  (a line number is dropped; a column, if shown, too)
_ERROR = re.compile(r"^(?P<path>[^:\s]+):\d+(?::\d+)?: error: (?P<rest>.*)$")


def errors(output: str) -> collections.Counter:
    """mypy's errors, each as 'path: error: message  [code]', counted."""
    found: collections.Counter = collections.Counter()
    for line in output.splitlines():
        match = _ERROR.match(line)
        if match:
            found[f"{match['path']}: error: {match['rest']}"] += 1
    return found


def read_baseline() -> collections.Counter:
    lines = BASELINE.read_text().splitlines() if BASELINE.exists() else []
    return collections.Counter(line for line in lines if line.strip())


def write_baseline(found: collections.Counter) -> None:
    BASELINE.parent.mkdir(exist_ok=True)
    BASELINE.write_text("".join(f"{line}\n" for line in sorted(found.elements())))


def main(argv: list[str]) -> int:
    update, rewrite = "--update" in argv, "--rewrite" in argv
    command = [a for a in argv if a not in ("--update", "--rewrite")] or ["mypy"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode not in (0, 1):  # 2: mypy itself failed (a config or syntax error)
        sys.stdout.write(result.stdout + result.stderr)
        return result.returncode
    found, baseline = errors(result.stdout), read_baseline()
    if rewrite:
        write_baseline(found)
        print(f"mypy: {BASELINE.name} rewritten: {sum(found.values())} error(s).")
        return 0
    new, fixed = found - baseline, baseline - found
    if new:
        print(f"mypy: {sum(new.values())} error(s) not in {BASELINE.name} (fix them):")
        for line in result.stdout.splitlines():
            match = _ERROR.match(line)
            if match and f"{match['path']}: error: {match['rest']}" in new:
                print(line)
        return 1
    if fixed and update:
        write_baseline(found)
        print(f"mypy: {BASELINE.name} shrunk by {sum(fixed.values())} to {sum(found.values())} error(s).")
        return 0
    if fixed:
        print(f"mypy: {sum(fixed.values())} baseline error(s) fixed; shrink the baseline with --update:")
        print("".join(f"  {line}\n" for line in sorted(fixed.elements())), end="")
        return 1
    print(f"mypy: no new error ({sum(found.values())} in {BASELINE.name}).")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
