"""The shape of the house, checked from the source text (``ast``, nothing imported):

- no import cycle inside the runtime or the operator (module-level imports; imports under
  ``if TYPE_CHECKING:`` and inside functions are deliberate late bindings and do not count);
- the request path HTTP -> scheduler -> TpModelWorker -> ModelRunner -> model never imports back
  up: ``models``/``layers`` import no ``model_executor.model_runner``, ``managers`` or
  ``entrypoints``; ``model_executor`` imports no ``managers`` or ``entrypoints``; ``managers``
  imports no ``entrypoints``;
- model files never import ``torch.distributed``;
- every product file stays under 400 lines, but for the few listed below with their reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "shardline_runtime": ROOT / "runtime" / "shardline_runtime",
    "shardline_operator": ROOT / "operator" / "shardline_operator",
}
MAX_LINES = 400
# file (relative to the repository root) -> why it may be longer for now
LONG_FILE_EXCEPTIONS: dict[str, str] = {
    "runtime/shardline_runtime/managers/tokenizer_manager.py": "R4 splits it into streams, gate, control client, state",
    "runtime/shardline_runtime/models/llama.py": "the base every dense and MoE model composes; its PP stage I/O is one concern",
}


def module_files(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package``."""
    root = PACKAGES[package]
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Absolute names a module imports when it is first imported (``from a import b`` yields
    ``a`` and ``a.b``; the caller keeps the ones that are modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names.add(prefix)
                names.update(f"{prefix}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return names


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports at import time."""
    files = module_files(package)
    graph = {}
    for module, path in files.items():
        raw = top_level_imports(path, module, path.name == "__init__.py")
        graph[module] = {name for name in raw if name in files and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return found


def _package_init_edges_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ re-exporting its children, and a child importing a sibling through the
    # package, is Python's normal layout, not a design cycle.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package):
    found = cycles(_package_init_edges_removed(import_graph(package)))
    assert found == [], f"import cycles in {package}: {found}"


# (importer prefix, forbidden prefix): the request path never imports back up
UPWARD_IMPORTS = [
    ("shardline_runtime.models", "shardline_runtime.managers"),
    ("shardline_runtime.models", "shardline_runtime.entrypoints"),
    ("shardline_runtime.models", "shardline_runtime.model_executor.model_runner"),
    ("shardline_runtime.layers", "shardline_runtime.managers"),
    ("shardline_runtime.layers", "shardline_runtime.entrypoints"),
    ("shardline_runtime.layers", "shardline_runtime.model_executor.model_runner"),
    ("shardline_runtime.model_executor", "shardline_runtime.managers"),
    ("shardline_runtime.model_executor", "shardline_runtime.entrypoints"),
    ("shardline_runtime.managers", "shardline_runtime.entrypoints"),
]


def all_imports(package: str) -> dict[str, set[str]]:
    """Module -> every absolute name it imports anywhere in the file (functions included)."""
    out = {}
    for module, path in module_files(package).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                prefix = node.module or ""
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                names.add(prefix)
                names.update(f"{prefix}.{alias.name}" for alias in node.names)
        out[module] = names
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize(("importer", "forbidden"), UPWARD_IMPORTS)
def test_the_request_path_never_imports_back_up(importer, forbidden):
    offenders = sorted(
        f"{module} imports {name}"
        for module, names in all_imports("shardline_runtime").items()
        if _under(module, importer)
        for name in names
        if _under(name, forbidden)
    )
    assert offenders == [], "\n".join(offenders)


def test_models_never_import_torch_distributed():
    offenders = sorted(
        f"{module} imports {name}"
        for module, names in all_imports("shardline_runtime").items()
        if _under(module, "shardline_runtime.models")
        for name in names
        if _under(name, "torch.distributed")
    )
    assert offenders == [], "\n".join(offenders)


def test_the_operator_never_imports_torch_or_the_runtime():
    offenders = sorted(
        f"{module} imports {name}"
        for module, names in all_imports("shardline_operator").items()
        for name in names
        if _under(name, "torch") or _under(name, "shardline_runtime")
    )
    assert offenders == [], "\n".join(offenders)


def test_product_files_stay_under_the_size_guide():
    too_long = {}
    for package in PACKAGES:
        for path in module_files(package).values():
            rel = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES and rel not in LONG_FILE_EXCEPTIONS:
                too_long[rel] = lines
    assert too_long == {}, f"files over {MAX_LINES} lines (split them by responsibility): {too_long}"


def test_size_exceptions_are_still_needed():
    stale = [
        rel
        for rel in LONG_FILE_EXCEPTIONS
        if not (ROOT / rel).exists() or len((ROOT / rel).read_text().splitlines()) <= MAX_LINES
    ]
    assert stale == [], f"drop these from LONG_FILE_EXCEPTIONS, they fit now: {stale}"


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
