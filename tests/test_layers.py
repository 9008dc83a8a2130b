"""The layer contract of src/tridens: imports go one way, no cycle, no private name crosses a package.

A package is a directory under src/tridens (or a top-level module such as ``trial.py``). The allowed
direction is written below as data: each package lists the packages it may import. The order is the
pipeline's: engine -> executors -> xopt / warmup -> units -> evaluators / graph / space -> trial.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "tridens"

_CORE = {"errors", "trial", "text", "_lazy", "files"}
_MODELS = _CORE | {"graph", "space", "nn", "datasets"}
_TRAINING = _MODELS | {"evaluators"}
_UNITS = _TRAINING | {"units"}

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_lazy": set(),  # a package's names imported on first use
    "text": set(),  # terminal-safe text for what the interfaces print
    "trial": {"errors"},
    "files": {"errors"},  # files someone else wrote, read bounded (regular files, archive sizes)
    "graph": {"errors"},
    "datasets": {"errors"},
    "space": _CORE | {"graph"},
    "nn": _CORE | {"graph", "space"},
    "evaluators": _MODELS,
    "store": _CORE,
    "strategy": _CORE | {"space"},
    "loggers": _CORE | {"store"},
    "units": _TRAINING,
    "warmup": _UNITS | {"store"},
    "xopt": _UNITS | {"store", "warmup"},  # the super-graph inherits weights through warm start's alignment
    "oneshot": _UNITS | {"store", "strategy"},
    "executors": _UNITS | {"store", "warmup", "xopt"},  # where trials train: the objects users pass to Experiment
    "engine": _UNITS | {"store", "strategy", "loggers", "warmup", "xopt", "oneshot", "executors"},
    "_views": _CORE | {"store"},  # what the tridens command prints of trials
    "hub": _TRAINING,  # ready-made model spaces (NAS-Bench-201's lives beside its table in evaluators)
    "dashboard": _MODELS | {"store", "loggers"},
    "cli": _UNITS | {"store", "strategy", "loggers", "engine", "executors", "dashboard", "hub", "_views"},
    "compat": _UNITS | {"store", "strategy", "loggers", "warmup", "xopt", "oneshot", "engine", "executors", "hub", "__init__"},
    "__init__": set(),  # the top-level package re-exports anything; checked as "any"
}


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module relative to tridens, imported names) of every tridens import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
                if module != "tridens" and not module.startswith("tridens."):
                    continue
                parts = module.split(".")[1:]
            else:
                here = list(path.relative_to(ROOT).parent.parts)
                parts = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            if parts:
                found.append((node.lineno, ".".join(parts), [alias.name for alias in node.names]))
            else:  # ``from tridens import x`` / ``from .. import x`` at the top: x is the module imported
                found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tridens":
                    found.append((node.lineno, "__init__", []))
                elif alias.name.startswith("tridens."):
                    found.append((node.lineno, alias.name[len("tridens."):], []))
    return found


def _edges() -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """package -> imported package -> where; and the private names imported across packages."""
    edges: dict[str, dict[str, list[str]]] = {}
    private = []
    for path in sorted(ROOT.rglob("*.py")):
        package = _package(path)
        for line, target, names in _imports(path):
            parts = target.split(".")
            other = parts[0]
            if not other or other == package:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            edges.setdefault(package, {}).setdefault(other, []).append(where)
            crossing = [n for n in names if n.startswith("_")]
            if crossing and package != "__init__":
                private.append(f"{where}: {', '.join(crossing)} from {target}")
    return edges, private


def test_every_package_has_a_place_in_the_layers():
    packages = {_package(p) for p in ROOT.rglob("*.py")}
    missing = sorted(packages - set(ALLOWED))
    assert not missing, f"packages without a layer: {missing}; add them to ALLOWED in {__file__}"


def test_imports_follow_the_layers():
    edges, _ = _edges()
    wrong = [f"{where}: {package} imports {other}"
             for package, targets in edges.items() if package != "__init__"
             for other, places in targets.items() if other not in ALLOWED.get(package, set())
             for where in places[:1]]
    assert not wrong, "imports against the layer direction:\n" + "\n".join(wrong)


def test_no_cycle_between_packages():
    edges, _ = _edges()
    graph = {p: set(t) for p, t in edges.items() if p != "__init__"}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else path + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            pytest.fail("import cycle between packages: " + " -> ".join(cycle))


def _module_imports(path: Path) -> set[str]:
    """The sibling modules ``path`` imports (``from ._x import ...`` and ``from . import _x``), at
    module level or inside a function, leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
               for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in skipped:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return {name.split(".")[0] for name in found}


@pytest.mark.parametrize("package", ["engine", "executors"])
def test_no_import_cycle_between_the_modules_of(package):
    """Inside a package too, modules import one way (a type-only import aside): the experiment
    above the executors, each executor above the lockstep loop, the channels and the messages."""
    graph = {path.stem: _module_imports(path) for path in (ROOT / package).glob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt in graph and nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            pytest.fail(f"import cycle inside {package}: " + " -> ".join(cycle))


def test_no_private_name_crosses_a_package():
    _, private = _edges()
    assert not private, "private names imported across packages:\n" + "\n".join(private)


def _exported(package: str) -> set[str]:
    """The names in ``package``'s ``__all__`` (read from its ``__init__.py``, nothing imported)."""
    init = ROOT / package / "__init__.py"
    if not init.exists():
        return set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_a_private_module_of_another_package_gives_only_its_public_names():
    """``from ..pkg._module import name`` from another package: ``name`` must be in ``pkg.__all__``
    (the name is public; where it is defined is not), and a private module is never imported whole."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        package = _package(path)
        for line, target, names in _imports(path):
            parts = target.split(".")
            if parts[0] in (package, "__init__") or not any(p.startswith("_") for p in parts[1:]):
                continue
            hidden = [n for n in names if n not in _exported(parts[0])] if names else [target]
            if hidden:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {', '.join(hidden)} from {target}")
    assert not wrong, "names imported through another package's private module but not in its __all__:\n" + \
        "\n".join(wrong)


# -- the import graph drawn in docs/architecture.md ------------------------------------------------------
DOC = ROOT.parents[1] / "docs" / "architecture.md"
START, END = "<!-- import graph: generated by `python tests/test_layers.py` -->", "<!-- end of import graph -->"


def import_graph() -> str:
    """The real import graph between packages, drawn in layers: each package on the line of its
    level (0: imports no other package), with the packages it imports."""
    edges, _ = _edges()
    graph = {p: set(t) for p, t in edges.items() if p != "__init__"}
    packages = {_package(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    level: dict[str, int] = {}

    def depth(p: str) -> int:
        if p not in level:
            level[p] = 0 if not graph.get(p) else 1 + max(depth(q) for q in graph[p])
        return level[p]

    width = max(len(p) for p in packages)
    lines = []
    for n in range(max(depth(p) for p in packages), -1, -1):
        for p in sorted(q for q in packages if level[q] == n):
            imports = ", ".join(sorted("tridens" if q == "__init__" else q for q in graph.get(p, ()))) or "-"
            lines.append(f"{n:>2}  {p:<{width}}  -> {imports}")
    return "\n".join(["```", "level package     imports", *lines, "```"])


def _documented() -> str | None:
    text = DOC.read_text()
    if START not in text or END not in text:
        return None
    return text[text.index(START) + len(START):text.index(END)].strip()


def test_the_documented_import_graph_is_the_real_one():
    assert _documented() == import_graph(), (
        "docs/architecture.md's import graph differs from the code's; run `python tests/test_layers.py` to redraw it")


if __name__ == "__main__":   # redraw the graph in docs/architecture.md
    text = DOC.read_text()
    if START in text and END in text:
        text = text[:text.index(START)] + START + "\n" + import_graph() + "\n" + text[text.index(END):]
    DOC.write_text(text)
    print(import_graph())
