"""Files someone else wrote are read within bounds: only regular files inside the export (a FIFO,
a device or a link out is refused before it is opened), a bounded manifest, and a checkpoint
archive only when it does not inflate beyond its size (a zip bomb built here)."""

import os
import zipfile

import pytest
import torch

import tridens as td
from tridens.errors import TridensError

from .payloads import export_folder


def test_a_fifo_as_manifest_or_weights_is_refused_not_waited_on(tmp_path):
    for name in ("tridens.json", "weights.pt"):
        folder = export_folder(tmp_path / name)
        (folder / name).unlink()
        os.mkfifo(folder / name)
        with pytest.raises(TridensError, match="not a regular file \\(a FIFO\\)"):
            td.load(folder)


def test_a_manifest_linked_to_dev_zero_is_refused(tmp_path):
    folder = export_folder(tmp_path / "export")
    (folder / "tridens.json").unlink()
    (folder / "tridens.json").symlink_to("/dev/zero")
    with pytest.raises(TridensError, match="outside"):
        td.load(folder)


def test_weights_linked_outside_the_export_are_refused(tmp_path):
    folder = export_folder(tmp_path / "export")
    outside = tmp_path / "elsewhere.pt"
    torch.save({"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3)}, outside)
    (folder / "weights.pt").unlink()
    (folder / "weights.pt").symlink_to(outside)
    with pytest.raises(TridensError, match="weights file .* is a link to .*outside"):
        td.load(folder)


def test_a_zip_bomb_checkpoint_is_refused_before_inflating(tmp_path):
    folder = export_folder(tmp_path / "export")
    with zipfile.ZipFile(folder / "weights.pt") as archive:
        members = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(folder / "weights.pt", "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            archive.writestr(name, data)
        archive.writestr(members[0][0].split("/")[0] + "/data/99", bytes(256 << 20))  # 256 MiB of zeros
    assert (folder / "weights.pt").stat().st_size < 2 << 20
    with pytest.raises(TridensError, match="inflates to 268,4"):
        td.load(folder)
