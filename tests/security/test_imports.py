"""A module a file names is imported only when this process already imported it or the user allows
it (``allow_modules=[...]``, ``--allow-module``, ``trust_code=True``), and the check comes before any
import: importing a module runs it (``venv.__main__`` builds a virtualenv, ``antigravity`` opens a
browser). Each test names a module of our own that writes a marker file when imported."""

import json
import os
import sqlite3
import subprocess
import sys
import uuid

import pytest
import torch
from torch import nn

import tridens as td
from tridens.dashboard import create_app
from tridens.errors import TridensError
from tridens.warmup import Zoo

from .payloads import export_folder
from .test_stores import make_store, tridens

starlette_testclient = pytest.importorskip("starlette.testclient")


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """``(name, marker)``: an importable module (on sys.path and PYTHONPATH) defining a model
    space ``Net``, which creates ``marker`` when imported."""
    name = f"tridens_marker_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from torch import nn\nfrom tridens import nn as tnn\n\n"
        "class Net(tnn.ModelSpace):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.add_module('0', nn.Linear(4, 3))\n\n"
        "    def forward(self, x):\n"
        "        return self._modules['0'](x)\n")
    monkeypatch.syspath_prepend(str(code_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code_dir), os.environ.get("PYTHONPATH", "")]))
    yield name, marker
    sys.modules.pop(name, None)


def _recipe(name, kind="model_space", qualname="Net"):
    return {"kind": kind, "path": f"{name}:{qualname}", "file": None, "args": [], "kwargs": {}}


def test_td_load_imports_a_named_module_only_when_allowed(tmp_path, marker_module):
    name, marker = marker_module
    for kind, qualname in (("module", "X"), ("model_space", "Net")):
        folder = export_folder(tmp_path / f"export-{kind}", _recipe(name, kind, qualname))
        with pytest.raises(TridensError, match=f"{name}.*has not imported.*allow_modules"):
            td.load(folder)
        assert not marker.exists() and name not in sys.modules
    with pytest.raises(TridensError, match="allow_modules"):
        td.load(folder, allow_modules="tridens_marker")  # a string is not a list of names
    model = td.load(folder, allow_modules=[name])  # the user allows it: imported, rebuilt
    assert marker.exists() and model(torch.zeros(2, 4)).shape == (2, 3)
    marker.unlink()
    assert td.load(folder) is not None and not marker.exists()  # imported now: no second import


def test_a_submodule_of_an_imported_package_is_not_imported(tmp_path):
    # json is imported; json.tool is not, and importing json.tool would run its code
    assert "json.tool" not in sys.modules or pytest.skip("json.tool already imported")
    folder = export_folder(tmp_path / "export", _recipe("json.tool", "module", "main"))
    with pytest.raises(TridensError, match="'json.tool'.*has not imported"):
        td.load(folder)
    assert "json.tool" not in sys.modules


def test_a_name_a_module_getattr_would_import_is_refused(tmp_path, monkeypatch):
    # an imported module whose __getattr__ runs code (lazy imports do): only its own names resolve
    marker = tmp_path / "imported"
    name = f"tridens_lazy_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(f"def __getattr__(attr):\n    open({str(marker)!r}, 'w').close()\n"
                                         "    raise AttributeError(attr)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    folder = export_folder(tmp_path / "export", _recipe(name, "module", "Net"))
    with pytest.raises(TridensError, match="defines no 'Net'"):
        td.load(folder)
    assert not marker.exists()
    sys.modules.pop(name)


def test_export_zoo_resume_and_dashboard_import_no_module_a_store_names(tmp_path, marker_module):
    name, marker = marker_module
    db = tmp_path / "runs.db"
    make_store(db, {"space": _recipe(name)}).close()

    res = tridens("export", "e", "--to", tmp_path / "out", "--db", db)
    assert res.returncode == 0 and "--allow-module" in res.stderr, res.stderr  # weights exported, no program
    assert (tmp_path / "out" / "rank1-trial0" / "weights.pt").exists() and not marker.exists()

    with pytest.raises(TridensError, match="has not imported"):
        Zoo(tmp_path / "zoo.db").add_experiment("e", db)
    assert not marker.exists()

    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    arch = client.get("/api/experiments/e/trials/0/architecture").json()
    assert arch["available"] is False and not marker.exists() and name not in sys.modules

    script = tmp_path / "mine.py"
    script.write_text("import tridens as td\n"
                      "def f(x):\n    return x\n"
                      "if __name__ == '__main__':\n"
                      "    td.Experiment(None, td.evaluators.FunctionalEvaluator(f, x=td.choice('x', [1, 2])), 'grid',\n"
                      "                  max_trials=2, name='mine').run()\n")
    res = subprocess.run([sys.executable, "-m", "tridens.cli", "run", str(script), "--db", str(db)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    conn = sqlite3.connect(db)
    config = json.loads(conn.execute("SELECT config FROM experiments WHERE name = 'mine'").fetchone()[0])
    conn.execute("UPDATE experiments SET config = ?, status = 'interrupted' WHERE name = 'mine'",
                 (json.dumps({**config, "space": _recipe(name)}),))
    conn.commit()
    conn.close()
    res = tridens("resume", "mine", "--db", db, "--script", script)
    assert res.returncode == 0, res.stderr
    assert not marker.exists()

    res = tridens("export", "e", "--to", tmp_path / "allowed", "--db", db, "--allow-module", name)
    assert res.returncode == 0 and marker.exists(), res.stderr  # the user allowed it


def test_build_space_refuses_before_importing(marker_module):
    from tridens.space import RecipeError, build_space

    name, marker = marker_module
    with pytest.raises(RecipeError, match="has not imported"):
        build_space({"kind": "mutators", "base": _recipe(name), "mutators": [], "example_inputs": []})
    with pytest.raises(RecipeError, match="does not name a module"):
        build_space(_recipe("..x"))
    assert not marker.exists()
    space = build_space(_recipe(name), trust_code=True)
    assert marker.exists() and isinstance(space, nn.Module)

