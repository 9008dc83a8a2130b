"""Crafted files someone else could hand a tridens user: each payload, if it ever ran, would
create its marker file. The tests assert the marker does not exist afterwards."""

import io
import json
import os
import zipfile
from pathlib import Path

import torch
from torch import nn


def touch_command(marker: Path) -> str:
    return f"touch {marker}"


class _RunsOnUnpickle:
    """Unpickling this runs ``os.system`` (what a crafted pickle does)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def pickle_payload(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(_RunsOnUnpickle(touch_command(marker)), buffer)
    return buffer.getvalue()


def export_folder(folder: Path, space_recipe=None, program: str | None = None) -> Path:
    """An export folder as tridens writes one: manifest, weights, sample."""
    folder.mkdir(parents=True, exist_ok=True)
    model = nn.Sequential(nn.Linear(4, 3))
    torch.save(model.state_dict(), folder / "weights.pt")
    (folder / "sample.json").write_text("{}")
    manifest = {"format": 1, "experiment": "e", "trial": 0, "sample": {}, "seed": 0, "fingerprint": None,
                "metric": 0.5, "metrics": {}, "objective": None, "space": space_recipe, "program": program}
    (folder / "tridens.json").write_text(json.dumps(manifest))
    return folder


def save_program(file: Path) -> None:
    """A real ``torch.export`` program of a small model (what an export holds as model.pt2)."""
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    program = torch.export.export(model, (torch.zeros(2, 4),), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    torch.export.save(program, str(file))


def edit_archive(file: Path, edit) -> None:
    """Rewrite a zip archive, ``edit(name, data) -> data`` for every member."""
    with zipfile.ZipFile(file) as archive:
        members = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(file, "w") as archive:
        for name, data in members:
            archive.writestr(name, edit(name, data))


class WideSpace:
    """Placeholder replaced below (a ModelSpace needs tridens.nn, imported lazily by tests)."""


def _wide_space():
    import tridens as td
    from tridens import nn as tnn

    class WideSpace(tnn.ModelSpace):
        """A space whose second width candidate is far larger than any weights shipped with it."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, td.choice("width", [3, 1 << 30]))

        def forward(self, x):
            return self.fc(x)

    WideSpace.__module__, WideSpace.__qualname__ = __name__, "WideSpace"
    return WideSpace


WideSpace = _wide_space()  # noqa: F811
