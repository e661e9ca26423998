"""The code's layout: no import cycle among mirrax's modules, imports at the top of each module,
and rooms of bounded size (docs/design.md, "Layout")."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mirrax"

# Function-level imports allowed, each for its documented reason: the CLI imports its commands
# only after setting the CPU device count (cli/main.py); optional heavy packages load on use.
_LAZY_OK = {
    "mirrax._src.cli.main": "the commands' modules, after XLA_FLAGS is set",
    "mirrax._src.data.digits": "scikit-learn (optional)",
    "mirrax._src.data.files": "grain (optional)",
    "mirrax._src.training.callbacks.tensorboard": "tensorboardX (optional)",
    "mirrax._src.parameter_server.cluster": "ray (optional), when a strategy starts",
    "mirrax._src.parameter_server.ray_calls": "ray (optional), when a strategy starts",
    "mirrax._src.parameter_server.serialization": "ray's cloudpickle (optional)",
    "mirrax._src.parameter_server.actors": "a worker's JAX side, in the worker process only",
    "mirrax._src.training.keras_models": "keras (optional), when a Keras model is given",
    "mirrax._src.training.keras_objects": "keras (optional), when a Keras object is given",
    "mirrax._src.training.keras_saving": "keras (optional), when a .keras file is loaded",
    "mirrax._src.report.plot": "matplotlib (optional), when a plot is drawn",
}


def _modules() -> dict:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _targets(node, module: str, modules: dict) -> list:
    """The mirrax modules an import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.rsplit(".", node.level)[0]
            base = f"{package}.{base}" if base else package
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
        ]
    return [n for n in names if n in modules]


def _graph():
    modules = _modules()
    edges, lazy = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        # Module level: the body, and the body of a top-level try (a version shim).
        top = {id(node) for node in tree.body}
        for node in tree.body:
            if isinstance(node, ast.Try):
                top |= {id(n) for part in (node.body, *[h.body for h in node.handlers]) for n in part}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                    lazy.append((name, node.lineno))
        edges[name] = {
            t
            for node in ast.walk(tree)
            if id(node) in top and isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _targets(node, name, modules)
        }
    return edges, lazy


def test_no_import_cycle():
    edges, _ = _graph()
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
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_imports_sit_at_the_top_except_the_documented_lazy_ones():
    _, lazy = _graph()
    unexpected = [f"{m}:{line}" for m, line in lazy if m not in _LAZY_OK]
    assert unexpected == []


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
