"""The code's layout: no import cycle among mirrax's modules (through any import, at the top of
a module or inside a function), imports at the top of each module except the documented lazy
ones, rooms of bounded size and lines of bounded length (docs/design.md, "Layout")."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mirrax"
# The Python trees whose lines are bounded: the package, the tests, benchmarks and examples.
SOURCE_DIRS = ("mirrax", "tests", "benchmarks", "examples")

# Function-level imports allowed, each (importing module, imported module) with its reason:
# the CLI imports its commands only after setting the CPU device count (cli/main.py); optional
# heavy packages load on use. An entry that matches no import any more fails the test.
_LAZY_OK = {
    ("mirrax._src.cli.main", "mirrax._src.cli.devices"): "a command's module, after XLA_FLAGS is set",
    ("mirrax._src.cli.main", "mirrax._src.cli.report"): "a command's module, after XLA_FLAGS is set",
    ("mirrax._src.cli.main", "mirrax._src.cli.train"): "a command's module, after XLA_FLAGS is set",
    ("mirrax._src.cli.main", "mirrax._src.cli.launch"): "`mirrax launch`'s module, for that command only",
    ("mirrax._src.cli.main", "jax"): "the running CPU device count, only once JAX's backends run",
    ("mirrax._src.data.digits", "sklearn"): "scikit-learn (optional)",
    ("mirrax._src.data.files", "grain"): "grain (optional)",
    ("mirrax._src.training.callbacks.tensorboard", "tensorboardX"): "tensorboardX (optional)",
    ("mirrax._src.parameter_server.ray_calls", "ray"): "ray (optional), when a strategy starts",
    ("mirrax._src.parameter_server.cluster", "ray.util.scheduling_strategies"): (
        "ray (optional), when an actor is placed on a given host"
    ),
    ("mirrax._src.parameter_server.serialization", "ray"): "ray's cloudpickle (optional)",
    ("mirrax._src.parameter_server.actors", "mirrax._src.parameter_server.worker_side"): (
        "a worker's JAX side, in the worker process only"
    ),
    ("mirrax._src.training.keras_models", "keras"): "keras (optional), when a Keras model is given",
    ("mirrax._src.training.keras_saving", "keras"): "keras (optional), when a .keras file is loaded",
    ("mirrax._src.report.plot", "matplotlib.backends.backend_agg"): "matplotlib (optional), on a plot",
    ("mirrax._src.report.plot", "matplotlib.figure"): "matplotlib (optional), when a plot is drawn",
}


def _line_length() -> int:
    """ruff's line-length (pyproject.toml, [tool.ruff]): the one number for both checks. Read
    from the text: tomllib is Python 3.11's, and mirrax supports 3.10."""
    table = re.search(r"^\[tool\.ruff\]\n(.*?)(?=^\[|\Z)", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert table is not None, "pyproject.toml has no [tool.ruff] table"
    value = re.search(r"^line-length\s*=\s*(\d+)\s*$", table.group(1), re.M)
    assert value is not None, "pyproject.toml's [tool.ruff] sets no line-length"
    return int(value.group(1))


def _modules(root: pathlib.Path, package: pathlib.Path) -> dict:
    """{dotted module name: path} of every .py file under `package` (a package's name for its
    __init__.py)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(node, module: str, is_package: bool, modules: dict) -> list:
    """The modules an import statement names: `import a.b` names a.b; `from a import b` names
    the module a.b when b is one of `modules` (a submodule), else a. Relative imports are
    resolved from `module` (itself for a package's __init__)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        if node.level > 1:
            package = package.rsplit(".", node.level - 1)[0]
        base = f"{package}.{base}" if base else package
    return sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names})


def _imports(modules: dict) -> list:
    """(importing module, imported module, line, at the top?) for every import statement of
    `modules`. At the top: in the module's body, or the body of a top-level try (a version
    shim); anything else (a function, a method, a branch) is a function-level import."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in tree.body:
            if isinstance(node, ast.Try):
                top |= {id(n) for part in (node.body, *[h.body for h in node.handlers]) for n in part}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            is_package = path.name == "__init__.py"
            for target in _imported(node, name, is_package, modules):
                found.append((name, target, node.lineno, id(node) in top))
    return found


def _graph(modules: dict) -> dict:
    """{module: the modules of `modules` it imports}, through every import: one inside a
    function closes a circle as surely as one at the top, once that function runs."""
    edges: dict = {name: set() for name in modules}
    for importer, target, _, _ in _imports(modules):
        if target in modules and target != importer:
            edges[importer].add(target)
    return edges


def find_cycles(edges: dict) -> list:
    """The import cycles of the graph `edges`, each as [m, ..., m] (depth-first, sorted order)."""
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return cycles


def lazy_imports_not_allowed(imports: list, allowed: dict) -> tuple:
    """(function-level imports that no entry of `allowed` names, as "module:line -> imported";
    entries of `allowed` that name no function-level import)."""
    lazy = [(importer, target, line) for importer, target, line, top in imports if not top]
    unexpected = [f"{m}:{line} -> {t}" for m, t, line in lazy if (m, t) not in allowed]
    used = {(m, t) for m, t, _ in lazy}
    stale = sorted(f"{m} -> {t}" for m, t in allowed if (m, t) not in used)
    return unexpected, stale


def long_lines(paths, limit: int) -> list:
    """ "path:line: length" for every line longer than `limit` characters in `paths`."""
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {len(line)}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if len(line) > limit
    ]


def _write_package(tmp_path: pathlib.Path, files: dict) -> tuple:
    """A package `pkg` under `tmp_path` from {relative path: source}; (root, package dir)."""
    for relative, source in files.items():
        path = tmp_path / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path, tmp_path / "pkg"


# -- the checks on mirrax ------------------------------------------------------------------------


def test_no_import_cycle_through_any_import():
    modules = _modules(ROOT, PACKAGE)
    cycles = find_cycles(_graph(modules))
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_imports_sit_at_the_top_except_the_documented_lazy_ones():
    unexpected, stale = lazy_imports_not_allowed(_imports(_modules(ROOT, PACKAGE)), _LAZY_OK)
    assert unexpected == [], "function-level imports without an entry in _LAZY_OK"
    assert stale == [], "entries of _LAZY_OK that match no function-level import any more"


def test_rooms_are_bounded():
    """distribute/ (the runtime): <= 450 lines per file; the rest of mirrax/_src: <= 500."""
    over = []
    for path in sorted((PACKAGE / "_src").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        limit = 450 if "/distribute/" in relative else 500
        lines = len(path.read_text().splitlines())
        if lines > limit:
            over.append(f"{relative}: {lines} > {limit}")
    assert over == []


def test_lines_are_no_longer_than_ruffs_line_length():
    paths = sorted(path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py"))
    assert len(paths) > 100  # the four trees were found (mirrax alone has more files)
    assert long_lines(paths, _line_length()) == []


# -- each check catches what it should -----------------------------------------------------------


def test_a_cycle_closed_by_a_function_level_import_is_found(tmp_path):
    # a imports b at the top; b imports a inside a function: a -> b -> a.
    root, package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg import a\n    return a\n",
            "c.py": "import pkg.a\n",
        },
    )
    assert find_cycles(_graph(_modules(root, package))) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_from_a_package_import_a_submodule_names_the_submodule(tmp_path):
    # `from pkg.sub import mod` imports pkg.sub.mod (a module), `from pkg.sub import name` pkg.sub;
    # `from . import mod` in pkg/sub/__init__.py is pkg.sub.mod, in pkg/sub/other.py too.
    root, package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "user.py": "from pkg.sub import mod\nfrom pkg.sub import name\n",
            "sub/__init__.py": "from . import mod\nname = 1\n",
            "sub/mod.py": "",
            "sub/other.py": "from . import mod\nfrom .. import user\n",
        },
    )
    edges = _graph(_modules(root, package))
    assert edges["pkg.user"] == {"pkg.sub.mod", "pkg.sub"}
    assert edges["pkg.sub"] == {"pkg.sub.mod"}
    assert edges["pkg.sub.other"] == {"pkg.sub.mod", "pkg.user"}


def test_lazy_imports_are_allowed_per_import_and_stale_entries_are_reported(tmp_path):
    root, package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    import json\n    from pkg import b\n",
            "b.py": "import os\n",
        },
    )
    imports = _imports(_modules(root, package))
    allowed = {("pkg.a", "json"): "allowed", ("pkg.b", "os"): "stale: os is imported at the top"}
    # pkg.a's second import (line 3) names another module than its entry: not allowed by it.
    assert lazy_imports_not_allowed(imports, allowed) == (["pkg.a:3 -> pkg.b"], ["pkg.b -> os"])


def test_long_lines_are_reported_with_their_length(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("x = 1\n" + "y = '" + "z" * 10 + "'\n")  # line 2: 5 + 10 + 1 = 16 characters
    assert long_lines([path], 16) == []
    assert long_lines([path], 15) == [f"{path}:2: 16"]
