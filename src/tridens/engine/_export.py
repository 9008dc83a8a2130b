"""Exporting trained models and loading them back (``td.load``) without the user's script."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import TridensError
from ..files import MANIFEST_BYTES, check_archive, model_bytes_limit, regular_file
from ..store import Store
from ..trial import Trial
from ..space import RecipeError, check_frozen, checked_space
from ._program_check import check_program

__all__ = ["ExportedProgram", "export_trials", "load"]

_MANIFEST = "tridens.json"


# What an export writes: one folder per model, ``rank{r}-trial{n}/`` (r: 1 = best; n: the trial's
# number in its experiment), holding these files.
_EXPORT_FILES = (_MANIFEST, "weights.pt", "sample.json", "model.pt2")


def _clear_for_export(directory: Path, force: bool) -> None:
    """Refuse a non-empty ``directory`` (two exports in one folder mix their models); with
    ``force``, remove the tridens exports in it (other files stay). A symbolic link in it is
    removed as a link, never followed: what it points to is not touched."""
    if directory.exists() and not directory.is_dir():
        raise TridensError(f"cannot export to {directory}: it is a file, not a directory")
    entries = sorted(directory.iterdir()) if directory.is_dir() else []
    if entries and not force:
        shown = ", ".join(e.name for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise TridensError(f"cannot export to {directory}: it is not empty ({shown}); choose a new directory, or "
                           "pass --force (export(..., force=True)) to replace the tridens exports in it")
    for entry in entries:
        if entry.is_symlink():
            if entry.name in _EXPORT_FILES or entry.name.startswith("rank"):
                entry.unlink()
        elif entry.is_dir() and (entry / _MANIFEST).exists():
            shutil.rmtree(entry)
        elif entry.is_file() and entry.name in _EXPORT_FILES:
            entry.unlink()


def _new_file(path: Path) -> Path:
    """``path``, with whatever is there removed first (a link is removed, not followed), so that
    writing it never writes through a link planted in the export directory."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    return path


def export_trials(db: Store, config: dict[str, Any], trials: Sequence[Trial], directory: Path, *,
                  force: bool = False, trust_code: bool = False, allow_modules: Sequence[str] = ()) -> list[Path]:
    """Write ``trials`` (best first) to ``directory/rank{r}-trial{n}/``, whatever their number.
    The space is rebuilt (for the exported program) from already imported modules only, or those
    in ``allow_modules``, unless ``trust_code`` (see :func:`tridens.space.build_space`)."""
    if not trials:
        raise TridensError("no finished trial to export")
    for trial in trials:  # checked before anything is written
        if trial.checkpoint is None and config.get("space") is None and trial.fingerprint is None:
            raise TridensError(f"experiment {trial.experiment!r} searched hyperparameters only (space=None): its "
                               "function built and kept its own models, so there is no model to export; use "
                               "exp.best().sample to train the best one")
        if trial.checkpoint is None:
            raise TridensError(f"trial {trial.label} of {trial.experiment!r} has no checkpoint to export")
    _clear_for_export(directory, force)
    out = []
    for rank, trial in enumerate(trials, 1):
        target = directory / f"rank{rank}-trial{trial.label}"
        if target.is_symlink():
            raise TridensError(f"cannot export to {target}: it is a symbolic link (to {os.readlink(target)}); "
                               "remove it, or choose a new directory")
        target.mkdir(parents=True, exist_ok=True)
        assert trial.checkpoint is not None  # checked above
        weights = db.load_checkpoint(trial.checkpoint)
        torch.save(weights, _new_file(target / "weights.pt"))
        manifest = {
            "format": 1, "experiment": trial.experiment, "trial": trial.label, "sample": trial.sample,
            "seed": trial.seed, "fingerprint": trial.fingerprint, "metric": trial.metric, "metrics": trial.metrics,
            "objective": config.get("objective"), "space": config.get("space"), "program": None,
            "role": trial.role, "inherited_weights": trial.role == "supernet-scored",
        }
        if trial.role == "supernet-scored":
            manifest["note"] = ("weights inherited from the one-shot supernet, not trained on their own: metric is "
                                "the supernet's proxy score; train the architecture from scratch before use (retrain=True)")
        if config.get("space") is not None:
            try:
                # The store may come from someone else: its recipe is measured before it is built.
                what = f"the space recipe of experiment {trial.experiment!r}"
                nbytes = sum(t.numel() * t.element_size() for t in weights.values() if isinstance(t, torch.Tensor))
                space = checked_space(config["space"], max_bytes=model_bytes_limit(nbytes), what=what,
                                      trust_code=trust_code, allow_modules=allow_modules)
                check_frozen(space, trial.sample, what=what, weights=weights,
                             weights_file=f"the checkpoint of trial {trial.label}")
                model = space.freeze(space.restrict(trial.sample), check=False)
                model.load_state_dict(weights)
                inputs = space.example_inputs
                if inputs is not None:
                    model.eval()
                    # A batch of 2 or more and an automatic batch dimension: the program accepts any batch size.
                    batch = tuple(torch.cat([x, x]) if x.shape[0] == 1 else x for x in inputs)
                    dims = tuple({0: torch.export.Dim.AUTO} for _ in batch)
                    program = torch.export.export(model, batch, dynamic_shapes=dims)
                    torch.export.save(program, str(_new_file(target / "model.pt2")))
                    manifest["program"] = "model.pt2"
            except Exception as err:  # the weights and recipe are exported even when the program is not
                warnings.warn(f"trial {trial.label}: no self-contained program exported ({type(err).__name__}: {err})")
        _new_file(target / "sample.json").write_text(json.dumps(trial.sample, indent=2))
        _new_file(target / _MANIFEST).write_text(json.dumps(manifest, indent=2))
        out.append(target)
    return out


class ExportedProgram(nn.Module):
    """A model loaded from its ``torch.export`` program (its code was not importable): it
    computes what the trained model computed in eval mode. ``eval()`` works; ``train()`` is
    refused, since the program holds no training behaviour (dropout, BatchNorm updates)."""

    def __init__(self, program: nn.Module, path: Path):
        super().__init__()
        self.program = program
        self.path = path
        self.training = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.program(*args, **kwargs)

    def train(self, mode: bool = True) -> "ExportedProgram":
        if mode:
            raise TridensError(f"the model loaded from {self.path} is its exported program, which computes inference "
                               "only; rebuild it from its space's code (importable again) to train it")
        return self

    def __repr__(self) -> str:
        return f"ExportedProgram({str(self.path)!r})"


def _model_folder(path: Path, rank: int) -> Path:
    """The folder of one exported model: ``path`` itself, or its ``rank{rank}-*`` folder."""
    if (path / _MANIFEST).exists():
        return path
    folders = sorted(p for p in path.glob(f"rank{rank}-trial*") if (p / _MANIFEST).exists()) if path.is_dir() else []
    if not folders:
        raise TridensError(f"{path} is not a tridens export (no {_MANIFEST}, no rank{rank}-trial* folder)")
    return folders[0]


def load(directory: str | os.PathLike[str], *, prefer: str = "module", rank: int = 1,
         trust_code: bool = False, allow_modules: Sequence[str] = ()) -> nn.Module:
    """Rebuild an exported model: the ``rank``-th best of an export directory, or the model of
    one ``rank*-trial*`` folder.

    With ``prefer="module"`` the space is rebuilt from its recorded import path and the sample
    frozen (a trainable ``nn.Module``); when that code is not importable, the self-contained
    ``torch.export`` program is loaded instead as an :class:`ExportedProgram` (``prefer="program"``
    always takes it).

    An export may come from someone else, so loading it runs none of its code unless
    ``trust_code=True``: the recipe resolves only to model-space / ``nn.Module`` classes in
    modules this process has already imported, or in ``allow_modules`` (never a script, nor a
    module inside the export folder; checked before any import), and the program is loaded only
    if it holds no pickled data and no guard code (:func:`check_program`).

    >>> model = td.load("best-model")             # doctest: +SKIP
    >>> model = td.load("best-model", allow_modules=["my_models"])   # doctest: +SKIP
    >>> second = td.load("best-model", rank=2)    # doctest: +SKIP
    """
    path = _model_folder(Path(directory), rank)
    # Files from someone else: regular files inside the folder only (a FIFO blocks, /dev/zero
    # never ends), a bounded manifest, and no archive that inflates beyond its size (a zip bomb).
    manifest_path = regular_file(path / _MANIFEST, inside=path, max_bytes=MANIFEST_BYTES, what="manifest")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TridensError(f"{manifest_path} is not a readable tridens manifest ({err})") from err
    if not isinstance(manifest, dict):
        raise TridensError(f"{manifest_path} is not a tridens manifest (a JSON {type(manifest).__name__})")
    weights_path = regular_file(path / "weights.pt", inside=path, what="weights file")
    check_archive(weights_path, what="weights file")
    try:
        weights = torch.load(weights_path, weights_only=True)
    except Exception as err:  # a damaged or crafted file: one line naming it
        raise TridensError(f"cannot load the weights {weights_path}: {type(err).__name__}: "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}") from err
    if prefer == "module" and manifest.get("space") is not None:
        try:
            # Shapes and sizes the manifest declares are checked before anything is allocated.
            space = checked_space(manifest["space"], max_bytes=model_bytes_limit(weights_path.stat().st_size),
                                  what=f"the manifest {manifest_path}", trust_code=trust_code, untrusted_dir=path,
                                  allow_modules=allow_modules)
            check_frozen(space, manifest["sample"], what=f"the manifest {manifest_path}", weights=weights,
                         weights_file=weights_path)
            model = space.freeze(space.restrict(manifest["sample"]), check=False)
            model.load_state_dict(weights)
            return model
        except RecipeError as err:
            if not manifest.get("program"):
                raise
            warnings.warn(f"rebuilding from code failed ({err}); loading the exported program instead")
    if manifest.get("program"):
        program = path / str(manifest["program"])
        if program.parent.resolve() != path.resolve():
            raise TridensError(f"{manifest_path} names the program {manifest['program']!r}, outside its folder")
        regular_file(program, inside=path, what="program")
        if not trust_code:
            check_program(program)
        return ExportedProgram(torch.export.load(str(program)).module(), path)
    raise TridensError(f"{path} holds no rebuildable model: the space was not importable and no program was exported")
