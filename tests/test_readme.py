"""README.md as a user runs it: every code block and every command line it shows.

Python blocks run as programs in new processes (as tests/test_examples.py runs the examples),
over 2 fake CPU devices. Every command line (each line of an `sh` block, and each inline span
that starts like a command) must have an entry in CHECKS, which says how it is checked:
"run" executes it (`.venv/bin/mirrax`, `mirrax` and `python` are this interpreter, the README
assuming its venv; `python` AFTER `mirrax launch --` is left to the launcher, as a user's
shell leaves it), "parse" parses it with the `mirrax` command's own parser (it trains or
reports for minutes; the test named there runs that command), "make" dry-runs the Makefile
target (it installs and runs the job or the whole suite), "help" runs its `--help` (it runs
every benchmark, or names a placeholder), "example" is an examples/ program that
tests/test_examples.py runs as this very command line (with an XLA_FLAGS prefix). A new block
or command line without a check fails here, so the README cannot show one nobody has run.
Paths the README names must be tracked files, so a fresh clone has them.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mirrax._src.cli.main import build_parser

pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("readme")]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# Inline spans that are command lines (the rest are API names and code fragments).
_COMMAND = re.compile(r"^(\.venv/bin/|mirrax |make |python |pip |XLA_FLAGS=|--)")
_TIMEOUT_S = 300
_XLA_COUNT = "--xla_force_host_platform_device_count"

# command line -> (kind, detail): what a "run" prints (a regex its stdout must match), the
# target's command a "make" dry run must show, the test that runs a "parse"d command.
CHECKS = {
    "make demo": ("make", "mirrax train"),
    "make test": ("make", "-m pytest"),
    ".venv/bin/mirrax train --cpu-devices N": ("parse", "tests/test_main_job.py"),
    ".venv/bin/mirrax train --loop custom": ("parse", "tests/test_main_job.py"),
    "mirrax train": ("parse", "tests/test_main_job.py"),
    "mirrax report": ("parse", "tests/test_scaling_report.py"),
    "mirrax launch": ("help", None),
    ".venv/bin/mirrax devices": (
        "run",
        r"(PhysicalDevice\(name='/physical_device:CPU:[01]', device_type='CPU'\)\n){2}",
    ),
    "mirrax launch --nproc 2 --cpu-devices 2 -- python train.py": ("run", None),
    ".venv/bin/python train.py": ("run", None),  # the three changes, saved as train.py
    ".venv/bin/pip install notebook && .venv/bin/jupyter notebook examples/tutorial.ipynb": (
        "help",
        None,
    ),  # pip is there; the notebook runs in tests/test_notebook.py
    ".venv/bin/python examples/keras_fit.py --epochs 1": ("example", None),
    "XLA_FLAGS=--xla_force_host_platform_device_count=4": ("example", None),
    "python -m benchmarks list": ("run", r"overhead +\S"),
    "python -m benchmarks run [NAME...]": ("help", None),
    "python -m benchmarks.<name> --help": ("help", None),
    # Options named in the text: each must be an option of a `mirrax` command.
    "--help": ("option", None),
    "--loop fit": ("option", None),
    "--loop custom": ("option", None),
    "--json": ("option", None),
    "--plot": ("option", None),
}


def _blocks() -> list:
    return [(language, code) for language, code in _FENCE.findall(README)]


def _command_lines() -> list:
    """Every command line: the lines of `sh` blocks (without comments), then inline spans."""
    lines = [
        line.split("#")[0].strip()
        for language, code in _blocks()
        if language == "sh"
        for line in code.splitlines()
    ]
    prose = _FENCE.sub("", README)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [line for line in lines if line] + [s for s in spans if _COMMAND.match(s)]


def _env(devices: int = 2) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{_XLA_COUNT}={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _mirrax(*argv) -> list:
    return [sys.executable, "-m", "mirrax._src.cli.main", *argv]


def _python_blocks() -> list:
    return [code for language, code in _blocks() if language == "python"]


def _three_changes() -> str:
    """The block of "The three changes" (the one that marks change 1)."""
    (code,) = [code for code in _python_blocks() if "# 1. create a strategy" in code]
    return code


def test_every_block_is_python_sh_or_text_and_every_command_line_has_a_check():
    # A block of another kind, or a command line not in CHECKS, would go unchecked.
    assert {language for language, _ in _blocks()} <= {"python", "sh", "text"}
    found = _command_lines()
    assert [line for line in found if line not in CHECKS] == [], "add it to CHECKS"
    assert sorted(set(CHECKS) - set(found)) == [], "CHECKS names lines the README lost"


def test_the_paths_the_readme_names_are_tracked_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = set(listed.stdout.splitlines())
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)]+)\)", README) if "://" not in target]
    named = [
        word
        for line in _command_lines()
        for word in line.split()
        if re.fullmatch(r"[\w.]+/[\w./]+\.\w+", word) and not word.startswith(".venv/")
    ]
    assert links and named
    missing = [
        path
        for path in links + named
        if path not in tracked and not any(t.startswith(path.rstrip("/") + "/") for t in tracked)
    ]
    assert missing == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts every "run" check at once (they wait on imports and compiles, not only on the
    CPU) and returns {name: CompletedProcess-like (returncode, stdout, stderr)}."""
    folder = tmp_path_factory.mktemp("readme")
    # The README: "make the strategy mirrax.MultiWorkerMirroredStrategy() ... and start the
    # program once per worker", with its three-changes program as train.py.
    block = _three_changes()
    assert block.count("mirrax.MirroredStrategy()") == 1
    (folder / "train.py").write_text(
        block.replace("mirrax.MirroredStrategy()", "mirrax.MultiWorkerMirroredStrategy()")
    )
    # PATH's first `python` is not this interpreter (as with .venv/bin/mirrax and no venv
    # activated): the launcher must still run the workers with it.
    fake = folder / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "PATH\'s python, without jax" >&2\nexit 3\n')
    fake.chmod(0o755)
    launch_env = _env()
    launch_env["PATH"] = f"{fake.parent}{os.pathsep}{launch_env['PATH']}"
    # Each block saved as train.py, in a folder of its own, run as `.venv/bin/python train.py`.
    commands, folders = {}, {}
    for i, code in enumerate(_python_blocks()):
        folders[f"python block {i}"] = folder / f"block{i}"
        folders[f"python block {i}"].mkdir()
        (folders[f"python block {i}"] / "train.py").write_text(code)
        commands[f"python block {i}"] = ([sys.executable, "train.py"], _env())
    commands.update(
        {
            "devices": (_mirrax("devices"), _env(4)),
            "launch": (
                _mirrax(*shlex.split("launch --nproc 2 --cpu-devices 2 -- python train.py")),
                launch_env,
            ),
            "benchmarks list": ([sys.executable, "-m", "benchmarks", "list"], _env()),
            "benchmarks run --help": ([sys.executable, "-m", "benchmarks", "run", "--help"], _env()),
            "benchmark --help": ([sys.executable, "-m", "benchmarks.overhead", "--help"], _env()),
            "pip": ([sys.executable, "-m", "pip", "--version"], _env()),
        }
    )
    started = {
        name: subprocess.Popen(
            argv,
            env=env,
            cwd=folders.get(name, ROOT if name.startswith(("benchmark", "pip")) else folder),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (argv, env) in commands.items()
    }
    results = {}
    for name, process in started.items():
        try:
            out, err = process.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            err += f"\n(killed after {_TIMEOUT_S} s)"
        results[name] = (process.returncode, out, err)
    return results


def _ok(runs, name) -> str:
    code, out, err = runs[name]
    assert code == 0, f"{name}: exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return out


def _losses(lines) -> list:
    return [
        float(m.group(1)) for m in (re.fullmatch(r"epoch \d+: loss (\d+\.\d+)", line) for line in lines) if m
    ]


def test_every_python_block_runs(runs):
    for i in range(len(_python_blocks())):
        _ok(runs, f"python block {i}")


def test_the_three_changes_block_trains_its_loss_falls(runs):
    index = _python_blocks().index(_three_changes())
    losses = _losses(_ok(runs, f"python block {index}").splitlines())
    # 5 epochs of ceil(1437 / 128) = 12 Adam steps on the digits over 2 replicas: from about
    # ln(10) = 2.30 (chance) the epoch's mean loss falls (measured: 1.63 to 0.16).
    assert len(losses) == 5 and losses[-1] < losses[0] < 2.31, losses


def test_mirrax_launch_runs_the_block_as_two_workers_with_this_interpreter(runs):
    out = _ok(runs, "launch").splitlines()
    # Each worker prints the all-reduced loss: the same 5 numbers on both (4 replicas in all).
    per_worker = [
        _losses(line.removeprefix(f"[worker {i}] ") for line in out if line.startswith(f"[worker {i}] "))
        for i in range(2)
    ]
    assert per_worker[0] == per_worker[1] and len(per_worker[0]) == 5, out
    assert per_worker[0][-1] < per_worker[0][0], per_worker


def test_the_command_lines_that_run(runs):
    assert re.search(CHECKS[".venv/bin/mirrax devices"][1], _ok(runs, "devices"))
    assert re.search(CHECKS["python -m benchmarks list"][1], _ok(runs, "benchmarks list"))
    assert "NAME" in _ok(runs, "benchmarks run --help")
    assert _ok(runs, "benchmark --help").startswith("usage:")
    assert _ok(runs, "pip").startswith("pip ")


@pytest.mark.parametrize("line", [line for line, (kind, _) in CHECKS.items() if kind == "parse"])
def test_the_mirrax_command_lines_parse(line):
    words = line.replace(".venv/bin/", "").split()
    assert words[0] == "mirrax"
    args = build_parser().parse_args([w if w != "N" else "2" for w in words[1:]])
    assert args.command == words[1]
    assert (ROOT / CHECKS[line][1]).is_file()  # the test that runs it


def test_the_options_the_text_names_are_options_of_the_mirrax_command(capsys):
    helps = []
    for command in ("train", "report", "launch", "devices"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        helps.append(capsys.readouterr().out)
    assert "launch [options] -- PROGRAM" in helps[2]  # `mirrax launch`
    for line, (kind, _) in CHECKS.items():
        if kind == "option":
            option, *value = line.split()
            assert any(re.search(rf"{re.escape(option)}\b", h) for h in helps), option
            assert all(v in " ".join(helps) for v in value), line


def test_the_example_command_line_is_the_one_tests_test_examples_runs():
    # That test runs `python examples/<script> --epochs 1` with XLA_FLAGS=<count>=2 in front
    # and checks "Number of devices: 2" and the test accuracy; running it twice costs 15-30 s.
    source = (ROOT / "tests" / "test_examples.py").read_text()
    for line, (kind, _) in CHECKS.items():
        if kind == "example" and not line.startswith("XLA_FLAGS="):
            _, script, *args = line.split()
            assert (ROOT / script).is_file()
            assert f'"{Path(script).name}"' in source and repr(args)[1:-1].replace("'", '"') in source, line
        elif kind == "example":
            assert f'XLA_FLAGS="{line.split("=", 1)[1].rsplit("=", 1)[0]}=2"' in source


def test_the_make_targets_exist_and_run_what_the_readme_says():
    if shutil.which("make") is None:
        pytest.skip("make is not installed (the README's set-up needs it)")
    for line, (kind, command) in CHECKS.items():
        if kind == "make":
            # A dry run: prints the recipe (venv creation included when .venv is missing).
            result = subprocess.run(
                ["make", "-n", "-C", str(ROOT), line.split()[1]], capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, result.stderr
            assert command in result.stdout, (line, result.stdout)
