"""NNI's own files, read from a local snapshot of its repository when one is present.

The snapshot is a bare git directory (``$TRIDENS_NNI_SNAPSHOT``, by default the one the
developers' machines keep); CI has none and no network, so every test that reads it skips
cleanly, and a condensed copy committed beside the tests covers the same item.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

SNAPSHOT = Path(os.environ.get("TRIDENS_NNI_SNAPSHOT", "/work/.mirror/microsoft+nni/repo"))
NNI3 = "HEAD"                 # NNI 3.0's last snapshot
NNI2 = "refs/tags/v2.10.1"    # NNI 2.10.1


def read(path: str, ref: str = NNI3) -> str | None:
    """The text of ``path`` at ``ref`` in the snapshot, or None when there is no snapshot (or no such file)."""
    if not (SNAPSHOT / "HEAD").exists():
        return None
    done = subprocess.run(["git", f"--git-dir={SNAPSHOT}", "show", f"{ref}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def require(path: str, ref: str = NNI3) -> str:
    """:func:`read`, skipping the test when the file is not there."""
    text = read(path, ref)
    if text is None:
        pytest.skip(f"NNI's {path} ({ref}) is not on this machine (no snapshot of microsoft/nni)")
    return text


def definitions(source: str, *names: str) -> str:
    """The source of the top-level classes / functions ``names`` of ``source``, in file order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            out.append("\n".join(lines[start:node.end_lineno]))
    missing = set(names) - {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert not missing, f"not in the upstream file: {sorted(missing)}"
    return "\n\n".join(out) + "\n"


def class_lists(source: str, cls: str) -> dict[str, list[str]]:
    """The list-valued class attributes of ``cls`` in ``source`` (e.g. NNI's ``DARTS_OPS``)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {t.id: ast.literal_eval(stmt.value) for stmt in node.body if isinstance(stmt, ast.Assign)
                    for t in stmt.targets if isinstance(t, ast.Name) and isinstance(stmt.value, ast.List)}
    raise AssertionError(f"no class {cls} in the upstream file")


_STANDIN_IMPORT = re.compile(r"^(\s*)(import|from) (torchvision|graphviz)\b", re.M)
_IMPORT_AS = re.compile(r"^(\s*)import nni((?:\.\w+)*) as (\w+)", re.M)
_IMPORT_BARE = re.compile(r"^(\s*)import nni\s*$", re.M)
_FROM = re.compile(r"^(\s*)from nni((?:\.\w+)*) import ", re.M)


def rewrite_imports(source: str) -> str:
    """``source`` with its ``nni`` imports pointed at ``tridens.compat.nni`` and nothing else changed:
    ``import nni`` -> ``import tridens.compat.nni as nni``, ``import nni.X as Y`` ->
    ``import tridens.compat.nni.X as Y``, ``from nni.X import ...`` -> ``from tridens.compat.nni.X import ...``."""
    source = _IMPORT_AS.sub(r"\1import tridens.compat.nni\2 as \3", source)
    source = _IMPORT_BARE.sub(r"\1import tridens.compat.nni as nni", source)
    return _FROM.sub(r"\1from tridens.compat.nni\2 import ", source)


def use_standins(source: str) -> str:
    """``source`` with its ``torchvision`` and ``graphviz`` import lines pointed at the offline stand-ins
    (``standins/``: real images tridens installs, no downloads; a drawing that needs no ``dot``):
    ``from torchvision.datasets import CIFAR10`` -> ``from standin_torchvision.datasets import CIFAR10``,
    ``import graphviz`` -> ``import standin_graphviz as graphviz``. A script's data lines change no further."""
    def swap(match: re.Match[str]) -> str:
        indent, keyword, name = match.groups()
        return f"{indent}{keyword} standin_{name}"

    source = re.sub(r"^(\s*)import (torchvision|graphviz)\s*$", r"\1import standin_\2 as \2", source, flags=re.M)
    source = re.sub(r"^(\s*)import (torchvision)\.(\w+) as (\w+)", r"\1import standin_\2.\3 as \4", source, flags=re.M)
    return _STANDIN_IMPORT.sub(swap, source)


STANDINS = Path(__file__).resolve().parent / "standins"


def script_env(store: Path, **extra: str) -> dict[str, str]:
    """The environment of a subprocess running an NNI script: this tridens and the offline
    stand-ins (``standin_torchvision``, ``standin_graphviz``) on ``PYTHONPATH``, its store at ``store``, one thread."""
    import tridens

    source = str(Path(tridens.__file__).resolve().parents[1])
    return {**os.environ, "TRIDENS_DB": str(store), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([source, str(STANDINS), os.environ.get("PYTHONPATH", "")]), **extra}


def example(folder: Path, base: str, names: list[str], ref: str = NNI2) -> Path:
    """NNI's files ``base/name`` copied into ``folder`` with only their imports rewritten: ``nni`` to
    tridens, ``torchvision`` / ``graphviz`` to the offline stand-ins (skips the test when there is no
    snapshot)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text(use_standins(rewrite_imports(require(f"{base}/{name}", ref))))
    return folder
