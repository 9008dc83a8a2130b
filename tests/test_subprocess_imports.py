"""A subprocess started in another folder (a test's tmp_path) imports the tridens under test, not
another checkout's or an installed one."""

import subprocess
import sys
from pathlib import Path

import tridens


def test_a_subprocess_in_another_folder_imports_this_tridens(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import tridens; print(tridens.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve() == Path(tridens.__file__).resolve()
