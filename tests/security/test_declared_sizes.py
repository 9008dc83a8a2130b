"""Sizes a foreign file declares are checked before anything is allocated: an export's manifest
or a store's recipe naming a 40 GB layer, or a sample whose model does not match the weights
shipped with it, is refused in one line naming the file and the tensor (built first on the meta
device); the zoo's files and NNI's ``fixed_arch`` file are read only when regular (a FIFO would
block). The allocating cases run in a subprocess whose address space is capped, so the code
before these checks fails there with an allocation error instead of exhausting the machine."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from tridens.dashboard import create_app

from .payloads import export_folder
from .test_stores import make_store

starlette_testclient = pytest.importorskip("starlette.testclient")

HUGE_LINEAR = {"kind": "module", "path": "torch.nn:Linear", "file": None, "args": [100000, 100000], "kwargs": {}}
WIDE_SPACE = {"kind": "model_space", "path": "tests.security.payloads:WideSpace", "file": None, "args": [], "kwargs": {}}


def _capped(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose address space is capped at 12 GiB."""
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=os.getcwd())


def test_a_manifest_declaring_a_40_gb_layer_is_refused_before_allocation(tmp_path):
    folder = export_folder(tmp_path / "export", space_recipe=HUGE_LINEAR)
    assert (folder / "tridens.json").stat().st_size < 400
    res = _capped(f"""
        import tridens as td
        from tridens.errors import TridensError
        try:
            td.load({str(folder)!r})
        except TridensError as err:
            print("REFUSED", err)
        """)
    assert res.returncode == 0, res.stderr[-2000:]
    line = res.stdout.strip()
    assert line.startswith("REFUSED") and "\n" not in line, line
    assert str(folder / "tridens.json") in line and "'weight'" in line and "(100000, 100000)" in line
    assert "40,000,400,000 bytes" in line


def test_a_sample_whose_model_does_not_match_its_weights_is_refused_naming_the_tensor(tmp_path):
    folder = export_folder(tmp_path / "export", space_recipe=WIDE_SPACE)
    torch.save({"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}, folder / "weights.pt")
    manifest = json.loads((folder / "tridens.json").read_text())
    manifest["sample"] = {"width": 1 << 30}  # a 16 GiB layer for 60 bytes of weights
    (folder / "tridens.json").write_text(json.dumps(manifest))
    res = _capped(f"""
        import tests.security.payloads
        import tridens as td
        from tridens.errors import TridensError
        try:
            td.load({str(folder)!r})
        except TridensError as err:
            print("REFUSED", err)
        manifest = {str(folder / "tridens.json")!r}
        import json
        data = json.load(open(manifest))
        data["sample"] = {{"width": 3}}
        json.dump(data, open(manifest, "w"))
        print("LOADED", td.load({str(folder)!r}).fc.out_features)
        """)
    assert res.returncode == 0, res.stderr[-2000:]
    refused, loaded = res.stdout.strip().splitlines()
    assert refused.startswith("REFUSED") and "'fc.weight'" in refused and "(1073741824, 4)" in refused
    assert "holds shape (3, 4)" in refused and str(folder / "weights.pt") in refused
    assert loaded == "LOADED 3"  # the same space with the sample its weights fit loads


def test_export_and_the_dashboard_measure_a_store_recipe_before_building_it(tmp_path):
    db = tmp_path / "runs.db"
    make_store(db, {"space": HUGE_LINEAR}).close()
    res = _capped(f"""
        import sys, warnings
        from tridens.cli import main
        sys.exit(main(["export", "e", "--to", {str(tmp_path / "out")!r}, "--db", {str(db)!r}]))
        """)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "40,000,400,000 bytes" in res.stderr and "experiment 'e'" in res.stderr
    assert (tmp_path / "out" / "rank1-trial0" / "weights.pt").exists()  # the weights are exported all the same
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    response = client.get("/api/experiments/e/trials/0/architecture")
    assert response.status_code == 200 and response.json()["available"] is False
    assert "40,000,400,000 bytes" in response.json()["reason"]


def test_zoo_files_and_a_fixed_arch_file_that_are_fifos_are_refused_not_waited_on(tmp_path):
    from tridens.warmup import Zoo

    db = tmp_path / "zoo.db"
    zoo = Zoo(db)
    entry = zoo.add(nn.Sequential(nn.Linear(4, 3)), torch.zeros(1, 4), accuracy=0.9)
    assert entry is not None
    os.mkfifo(zoo.dir / "7.json")
    (zoo.dir / f"{entry.id}.pt").unlink()
    os.mkfifo(zoo.dir / f"{entry.id}.pt")
    os.mkfifo(tmp_path / "arch.json")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from tridens.warmup import Zoo, ZooError
        from tridens.errors import TridensError
        from tridens.compat.nni._fixed import fixed_arch
        zoo = Zoo({str(db)!r})
        print("BROKEN", zoo.broken[7])
        try:
            zoo.weights({entry.id})
        except ZooError as err:
            print("WEIGHTS", err)
        try:
            with fixed_arch({str(tmp_path / "arch.json")!r}):
                pass
        except TridensError as err:
            print("ARCH", err)
        """)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    broken, weights, arch = res.stdout.strip().splitlines()
    assert "not a regular file (a FIFO)" in broken
    assert "not a regular file (a FIFO)" in weights and f"{entry.id}.pt" in weights
    assert "not a regular file (a FIFO)" in arch and "arch.json" in arch
