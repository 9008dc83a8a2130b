"""The dashboard reads a store on a read-only filesystem, as the CLI does: SQLite cannot create
the WAL's -shm file there, so the store is read as an immutable file. The read-only filesystem
is real: a read-only bind mount in a user and mount namespace (``unshare -rm``)."""

import shutil
import subprocess
import sys
import textwrap

import pytest

from .test_stores import make_store


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm (user and mount namespaces) for a read-only mount")
def test_the_dashboard_reads_a_store_on_a_read_only_filesystem(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    make_store(folder / "runs.db", {}).close()
    code = textwrap.dedent(f"""
        from starlette.testclient import TestClient
        from tridens.dashboard import create_app
        client = TestClient(create_app({str(folder / "runs.db")!r}), base_url="http://localhost")
        for path in ("/api/experiments", "/api/experiments/e/trials", "/api/experiments/e/trials/0"):
            response = client.get(path)
            print(response.status_code, len(response.json().get("experiments", response.json().get("rows", [0]))))
        """)
    script = tmp_path / "read.py"
    script.write_text(code)
    res = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -o bind,ro {folder} {folder} && "
                          f"touch {folder}/probe 2>/dev/null; test ! -e {folder}/probe && {sys.executable} {script}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[:3] == ["200 1", "200 1", "200 1"], res.stdout
