"""Checking an exported ``torch.export`` archive (``model.pt2``) before it is loaded.

``torch.export.load`` runs code an archive can carry: it unpickles weights and constants stored
with ``use_pickle`` (and custom or opaque objects), retries sample inputs with an unrestricted
unpickler when the safe one refuses them, and compiles the archive's guard expressions with
``exec``. :func:`check_program` refuses, in one line, an archive holding any of these, so that
``td.load`` of someone else's export runs none of their code; tridens' own exports hold none.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import TridensError

__all__ = ["ProgramRefused", "check_program"]


class ProgramRefused(TridensError):
    """An exported program holds something that would run code when loaded."""


# Every file of a current-format archive, relative to its root folder.
_ALLOWED = re.compile(
    r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/\w+\.json|data/sample_inputs/\w+\.pt"
    r"|data/weights/\w+_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/\w+_constants_config\.json|data/constants/tensor_\d+")
# Operators a graph node may call: registered torch operators, and Python's own arithmetic.
_TARGETS = ("torch.ops.", "_operator.", "math.", "torch.sym_")
# A guard as torch.export writes it: input sizes and strides compared with numbers.
_GUARD = re.compile(r"(?:L\['\w+'\]|\.size\(\)|\.stride\(\)|\[\d+\]|\d+|[\s()<>=!+\-*/%]|\band\b|\bor\b|\bnot\b)+")


def check_program(file: Path) -> None:
    """Raise :class:`ProgramRefused` unless ``file`` is a ``torch.export`` archive that loads
    without pickle or ``exec``: plain tensor payloads, sample inputs a ``weights_only`` load
    accepts, graph nodes that call torch operators, guards that only compare input sizes."""
    name = file.name
    try:
        archive = zipfile.ZipFile(file)
    except (OSError, zipfile.BadZipFile) as err:
        raise ProgramRefused(f"{file} is not a torch.export archive ({err})") from err
    with archive:
        names = archive.namelist()
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1:
            raise ProgramRefused(f"{name} is not a torch.export archive: it has {len(roots)} top-level folders")
        root = roots.pop() + "/"

        def read(rel: str) -> bytes:
            return archive.read(root + rel)

        for n in names:
            rel = n[len(root):]
            if rel and not n.endswith("/") and not _ALLOWED.fullmatch(rel):
                raise ProgramRefused(f"{name} holds {rel!r}, which torch.export.load would unpickle or "
                                     "is not part of the archive format; refusing to load it")
        rels = [n[len(root):] for n in names]
        if "archive_format" not in rels or read("archive_format").decode(errors="replace").strip() != "pt2":
            raise ProgramRefused(f"{name} is not a current torch.export archive (no archive_format 'pt2')")
        for rel in rels:
            if rel.endswith("_config.json"):
                _check_payloads(name, rel, _json(name, rel, read(rel)))
            elif rel.startswith("models/"):
                _check_graph(name, rel, _json(name, rel, read(rel)))
            elif rel.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(read(rel)), weights_only=True)
                except Exception as err:
                    raise ProgramRefused(f"{name}: its sample inputs {rel!r} need an unrestricted unpickler "
                                         f"({type(err).__name__}); refusing to load it") from err


def _json(name: str, rel: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as err:
        raise ProgramRefused(f"{name}: {rel!r} is not JSON ({err})") from err


def _check_payloads(name: str, rel: str, config: Any) -> None:
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ProgramRefused(f"{name}: {rel!r} is not a payload config")
    for key, meta in entries.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise ProgramRefused(f"{name}: the payload {key!r} in {rel!r} is pickled (use_pickle), and unpickling "
                                 "it can run code; refusing to load it")


def _check_graph(name: str, rel: str, program: Any) -> None:
    if not isinstance(program, dict):
        raise ProgramRefused(f"{name}: {rel!r} is not a serialized program")
    for guard in program.get("guards_code") or []:
        if not isinstance(guard, str) or not _GUARD.fullmatch(guard):
            raise ProgramRefused(f"{name}: the guard {str(guard)[:60]!r} in {rel!r} is code that loading would "
                                 "exec, not a comparison of input sizes; refusing to load it")
    for target in _node_targets(program.get("graph_module")):
        if not isinstance(target, str) or not target.startswith(_TARGETS):
            raise ProgramRefused(f"{name}: a node of {rel!r} calls {str(target)[:60]!r}, not a torch operator; "
                                 "refusing to load it")


def _node_targets(obj: Any) -> Iterator[Any]:
    """The ``target`` of every graph node, nested graphs included."""
    if isinstance(obj, dict):
        if "target" in obj and "inputs" in obj and "outputs" in obj:
            yield obj["target"]
        for value in obj.values():
            yield from _node_targets(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _node_targets(value)
