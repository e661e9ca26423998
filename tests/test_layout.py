"""The code's layout: no import cycle among mirrax's modules (through any import, at the top of
a module or inside a function), imports at the top of each module except the documented lazy
ones, rooms of bounded size, lines of bounded length, and private names used only by the module
that owns them (docs/design.md, "Layout")."""

import ast
import pathlib
import re

import pytest

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
    ("mirrax._src.parameter_server.wire", "ray"): "ray's cloudpickle (optional)",
    ("mirrax._src.parameter_server.actors", "mirrax._src.parameter_server.gradient_rule"): (
        "JAX in a parameter server only under update='gradients'"
    ),
    ("mirrax._src.parameter_server.actors", "mirrax._src.parameter_server.worker_side"): (
        "a worker's JAX side, in the worker process only"
    ),
    ("mirrax._src.training.keras_checks", "keras"): "keras (optional), when a Keras model is given",
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


@pytest.mark.slow
def test_imports_sit_at_the_top_except_the_documented_lazy_ones():
    unexpected, stale = lazy_imports_not_allowed(_imports(_modules(ROOT, PACKAGE)), _LAZY_OK)
    assert unexpected == [], "function-level imports without an entry in _LAZY_OK"
    assert stale == [], "entries of _LAZY_OK that match no function-level import any more"


def room_limit(relative: str) -> int:
    """distribute/ (the runtime): 450 lines per file; training/: 400; the rest of mirrax/_src: 500."""
    if "/distribute/" in relative:
        return 450
    if relative.startswith("mirrax/_src/training/"):
        return 400
    return 500


def test_rooms_are_bounded():
    over = []
    for path in sorted((PACKAGE / "_src").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > room_limit(relative):
            over.append(f"{relative}: {lines} > {room_limit(relative)}")
    assert over == []


def test_lines_are_no_longer_than_ruffs_line_length():
    paths = sorted(path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py"))
    assert len(paths) > 100  # the four trees were found (mirrax alone has more files)
    assert long_lines(paths, _line_length()) == []


# -- each check catches what it should -----------------------------------------------------------


def test_room_limits_are_the_ones_the_layout_sets():
    assert room_limit("mirrax/_src/distribute/run/runner.py") == 450
    assert room_limit("mirrax/_src/training/new_room.py") == 400
    assert room_limit("mirrax/_src/training/callbacks/new_callback.py") == 400
    assert room_limit("mirrax/_src/training/model.py") == 400
    assert room_limit("mirrax/_src/checkpointing/checkpoint.py") == 500


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


# -- private names stay in the module that owns them --------------------------------------------

_COMPAT = "mirrax/_src/distribute/_compat.py"
# Underscore names their library documents as public: os._exit, and namedtuple's API.
_DOCUMENTED_PUBLIC = {"_exit", "_fields", "_field_defaults", "_asdict", "_make", "_replace"}
_ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owned(tree: ast.Module) -> set:
    """The private attribute names a module defines: set on `self` / `cls`, defined in a class
    body (methods, class attributes, fields) or listed in a `__slots__`."""
    owned = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                owned.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    owned.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else []
                if isinstance(item, ast.AnnAssign):
                    targets = [item.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        owned.add(target.id)
                        if target.id == "__slots__":
                            owned |= {
                                c.value
                                for c in ast.walk(item.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            }
    return owned


def _project_module(dotted: str) -> pathlib.Path | None:
    """The file (or package) of a module of this repository named `dotted`, if there is one."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def private_reads(source: str, module: str) -> list:
    """Where the code of `module` (dotted name, e.g. "mirrax._src.training.model") uses a
    private name it does not own, as "line: what" strings; see the test below for the rule."""
    tree = ast.parse(source)
    owned = _owned(tree)
    found = []

    def own_object(node, classes) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ("self", "cls") or node.id in classes
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"

    def visit(node, classes):
        if isinstance(node, ast.ClassDef):
            classes = classes | {node.name}
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not own_object(node.value, classes) and node.attr not in owned | _DOCUMENTED_PUBLIC:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in _ATTRIBUTE_FUNCTIONS and len(node.args) >= 2:
                target, attribute = node.args[0], node.args[1]
                if (
                    isinstance(attribute, ast.Constant)
                    and isinstance(attribute.value, str)
                    and _is_private(attribute.value)
                    and not own_object(target, classes)
                    and attribute.value not in owned | _DOCUMENTED_PUBLIC
                ):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
            for keyword in node.keywords:
                if keyword.arg and _is_private(keyword.arg):
                    found.append(f"{node.lineno}: {ast.unparse(node.func)}({keyword.arg}=...)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                paths = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = module.rsplit(".", node.level)[0]
                    base = f"{package}.{base}" if base else package
                paths = [f"{base}.{alias.name}" for alias in node.names]
            for path in paths:
                first, *rest = path.split(".")
                if first in SOURCE_DIRS:
                    # A private module of this repository is the package's own; a private
                    # name inside a module belongs to that module.
                    if _is_private(rest[-1] if rest else first) and _project_module(path) is None:
                        found.append(f"{node.lineno}: import of {path}")
                elif any(_is_private(part) for part in path.split(".")):
                    found.append(f"{node.lineno}: import of {path}")
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(tree, frozenset())
    return found


def _scanned_files():
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_private_name_is_read_outside_the_module_that_owns_it():
    """No module reads or writes another module's private names, in mirrax/, tests/,
    benchmarks/ and examples/; the one exception is mirrax/_src/distribute/_compat.py, home of
    every private third-party (JAX, flax, Keras, NumPy, CPython) use, each named in its docstring.

    The rule: a private name starts with one underscore or two, and is not a dunder. A module
    *owns* the private names it sets on `self` / `cls`, defines in a class body, or lists in a
    `__slots__`. A module may not
    - read or write `obj._name` (nor `getattr` / `hasattr` / `setattr` / `delattr`, including
      `monkeypatch.setattr`, with the literal "_name") for a `_name` it does not own, unless
      `obj` is `self`, `cls`, `super()` or an enclosing class's name;
    - import a private name from another module (`from mirrax._src.x import _helper`); a
      package's private modules (`_compat`, `callbacks._monitor`, `benchmarks._harness`) are
      shared inside the repository and may be imported;
    - import a third-party module with a private part (`jax._src...`) or pass a private keyword
      argument (`_unsafe_bypass_check=`).
    The stdlib's documented underscore names (`os._exit`, namedtuple's `_fields`, `_replace`,
    `_asdict`, `_make`, `_field_defaults`) are public. Owning is by name, per module: `other._x`
    in the module that defines `_x` (an `__eq__`, a factory) is that module's own business.
    """
    found, roots = [], set()
    for path, module in _scanned_files():
        relative = str(path.relative_to(ROOT))
        roots.add(module.split(".")[0])
        if relative != _COMPAT:
            found += [f"{relative}:{where}" for where in private_reads(path.read_text(), module)]
    assert roots == set(SOURCE_DIRS) and found == []


def test_every_private_use_in_compat_is_named_in_its_docstring():
    path = ROOT / _COMPAT
    tree = ast.parse(path.read_text())
    docstring = ast.get_docstring(tree)
    names = set()
    for where in private_reads(path.read_text(), "mirrax._src.distribute._compat"):
        names |= {part for part in where.replace("(", ".").replace("=", ".").split(".") if _is_private(part)}
    names |= {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value)
    }
    assert names and sorted(n for n in names if n not in docstring) == []


def test_the_private_read_check_catches_each_kind_of_use():
    source = """
import jax._src.xla_bridge
from mirrax._src.distribute import _compat
from mirrax._src.distribute.strategy import _context_stack
from mirrax._src.distribute.replica_context import ReplicaContext

class Owner:
    def __init__(self, other):
        self._mine = 1
        self._mine = other._mine + Owner._also_mine
        self._peek = other._theirs
        ReplicaContext._hidden
        super()._parent_private()
        getattr(other, "_theirs_too", None)
        monkeypatch.setattr(_compat, "_flag", True)
        fn(x, _bypass=True)
        return os._exit, row._replace(a=1)
"""
    assert private_reads(source, "tests.synthetic") == [
        "2: import of jax._src.xla_bridge",
        "4: import of mirrax._src.distribute.strategy._context_stack",
        "11: other._theirs",
        "12: ReplicaContext._hidden",
        "14: getattr(other, '_theirs_too', None)",
        "15: monkeypatch.setattr(_compat, '_flag', True)",
        "16: fn(_bypass=...)",
    ]
