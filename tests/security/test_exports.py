"""Loading an export someone else wrote runs none of their code unless the user passes
``trust_code=True``: recipes resolve only to already importable model classes, nothing inside the
export folder is imported, and the ``torch.export`` program is refused when it holds pickled data
or guard code."""

import json
import subprocess
import sys

import pytest
import torch

import tridens as td
from tridens.errors import TridensError

from .payloads import edit_archive, export_folder, pickle_payload, save_program, touch_command


def test_a_recipe_naming_os_system_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    recipe = {"kind": "module", "path": "os:system", "file": None, "args": [touch_command(marker)], "kwargs": {}}
    folder = export_folder(tmp_path / "export", recipe)
    with pytest.raises(TridensError, match="os:system.*not a subclass"):
        td.load(folder)
    recipe["kind"] = "model_space"
    (folder / "tridens.json").write_text(json.dumps({**json.loads((folder / "tridens.json").read_text()), "space": recipe}))
    with pytest.raises(TridensError, match="not a subclass of ModelSpace"):
        td.load(folder)
    assert not marker.exists()


def test_a_script_recipe_inside_the_export_runs_only_with_trust_code(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "export"
    folder.mkdir()
    script = folder / "space.py"
    script.write_text(f"import os\nos.system({touch_command(marker)!r})\n")
    export_folder(folder, {"kind": "model_space", "path": "__main__:Net", "file": str(script), "args": [], "kwargs": {}})
    with pytest.raises(TridensError, match="trust_code=True"):
        td.load(folder)
    assert not marker.exists()
    with pytest.raises(TridensError):  # the user opted in: the script runs (and defines no Net)
        td.load(folder, trust_code=True)
    assert marker.exists()


def test_a_module_shipped_in_the_export_folder_is_not_imported(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "shipped_models.py").write_text(f"import os\nos.system({touch_command(marker)!r})\n")
    export_folder(folder, {"kind": "model_space", "path": "shipped_models:Net", "file": None, "args": [], "kwargs": {}})
    # run from inside the export folder, where Python would find shipped_models.py first
    code = "import tridens as td\ntry:\n    td.load('.')\nexcept td.TridensError as err:\n    print('refused:', err)\n"
    res = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=120)
    assert "refused:" in res.stdout and "inside the folder being loaded" in res.stdout, res.stdout + res.stderr
    assert not marker.exists()


def _program_export(tmp_path):
    folder = export_folder(tmp_path / "export", None, program="model.pt2")
    save_program(folder / "model.pt2")
    return folder


def test_a_clean_exported_program_loads_and_runs(tmp_path):
    model = td.load(_program_export(tmp_path), prefer="program")
    assert model(torch.zeros(5, 4)).shape == (5, 3)


def test_a_pickled_weight_in_the_program_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    folder = _program_export(tmp_path)

    def pickle_first_weight(name, data):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            return json.dumps(config).encode()
        if name.endswith("data/weights/weight_0"):
            return pickle_payload(marker)
        return data

    edit_archive(folder / "model.pt2", pickle_first_weight)
    with pytest.raises(TridensError, match="pickled"):
        td.load(folder, prefer="program")
    assert not marker.exists()


def test_pickled_sample_inputs_and_guard_code_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    folder = _program_export(tmp_path)
    edit_archive(folder / "model.pt2",
                 lambda name, data: pickle_payload(marker) if "sample_inputs/" in name else data)
    with pytest.raises(TridensError, match="sample inputs"):
        td.load(folder, prefer="program")

    folder = _program_export(tmp_path / "second")
    guard = f"1#\nimport os; os.system({touch_command(marker)!r})\ndef _(*a):\n  (0"

    def add_guard(name, data):
        if name.endswith("models/model.json"):
            program = json.loads(data)
            program["guards_code"] = [guard]
            return json.dumps(program).encode()
        return data

    edit_archive(folder / "model.pt2", add_guard)
    with pytest.raises(TridensError, match="guard"):
        td.load(folder, prefer="program")
    assert not marker.exists()


def test_a_manifest_that_is_not_json_is_one_error(tmp_path):
    folder = export_folder(tmp_path / "export")
    (folder / "tridens.json").write_text("{not json")
    with pytest.raises(TridensError, match="tridens.json is not a readable tridens manifest"):
        td.load(folder)
