"""README.md as a user reads it: its Python blocks compile, the names it mentions exist, its imports
resolve, and (slow) its short example and one-shot block run in a fresh directory with the
``tridens`` command working on the result."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tridens as td

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 3)
    return text[start:end if end > 0 else None]


def test_python_blocks_compile() -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 6
    for block in blocks:
        ast.parse(block)


def test_every_td_name_in_the_readme_exists() -> None:
    """``td.a.b`` names in the text and code (tridens.x packages are imported as a user would)."""
    names = set(re.findall(r"\btd\.([A-Za-z_][\w.]*[A-Za-z_0-9])", README.read_text()))
    assert len(names) > 20
    missing = []
    for name in sorted(names):
        obj = td
        for part in name.split("."):
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
                    continue
                except (ImportError, AttributeError):
                    missing.append(name)
                    break
            obj = getattr(obj, part)
    assert missing == []


def test_every_import_in_the_readme_resolves() -> None:
    for block in _blocks("python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"from {node.module} import {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
    for module in re.findall(r"`(tridens(?:\.[a-z_]\w*)+)`", README.read_text()):
        if module != "tridens.db":  # the default store file, not a module
            importlib.import_module(module)


def test_the_migration_section_lists_files_that_exist() -> None:
    root = README.parent
    for path in re.findall(r"`(tests/\S+?\.py)`", _section("Migrating from NNI")):
        assert (root / path).is_file(), path


def _run(args: list[str], cwd: Path, timeout: int = 900) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{args} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


@pytest.mark.slow
def test_short_example_and_the_commands_after_it(tmp_path: Path) -> None:
    script = tmp_path / "search.py"
    script.write_text(_blocks("python")[0])
    out = _run([sys.executable, str(script)], tmp_path)
    rows = re.findall(r"^(0\.\d+) \{'width': (16|32|64), 'op': ([01]), 'lr': 0\.0", out, re.M)
    assert len(rows) == 5 and [float(r[0]) for r in rows] == sorted((float(r[0]) for r in rows), reverse=True)
    tridens = [sys.executable, "-m", "tridens.cli"]
    assert "my-search" in _run([*tridens, "ls"], tmp_path)
    assert "top 10 of my-search" in _run([*tridens, "top", "my-search", "-k", "10"], tmp_path)
    export = _run([*tridens, "export", "my-search", "--top", "1", "--to", "best/", "--trust-code"], tmp_path)
    assert "resuming" not in export  # the script's guarded main code did not run again
    loaded = _run([sys.executable, "-c", "import tridens as td, torch; m = td.load('best'); "
                   "print(tuple(m(torch.zeros(3, 1, 8, 8)).shape))"], tmp_path)
    assert "(3, 10)" in loaded


@pytest.mark.slow
def test_one_shot_block(tmp_path: Path) -> None:
    """The one-shot block, run on the short example's space as the README puts them together."""
    short, oneshot = _blocks("python")[0], next(b for b in _blocks("python") if "td.oneshot.DARTS" in b)
    defs = short[:short.index('if __name__ == "__main__":')]
    script = tmp_path / "oneshot.py"
    script.write_text(defs + "space = Net()\ntrain, val = td.datasets.digits()\n" + oneshot
                      + "for t in exp.top(5):\n    print(t.info['oneshot']['role'], t.metric, t.sample)\n")
    out = _run([sys.executable, str(script)], tmp_path)
    roles = re.findall(r"^(subnet|retrain) (0\.\d+) ", out, re.M)
    assert len(roles) == 5 and "retrain" in [r for r, _ in roles]
