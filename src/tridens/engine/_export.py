"""Exporting trained models and loading them back (``td.load``) without the user's script."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import TridensError
from ..store import Store
from ..trial import Trial
from ..space import RecipeError, build_space

__all__ = ["export_trials", "load"]

_MANIFEST = "tridens.json"


def export_trials(db: Store, config: dict[str, Any], trials: Sequence[Trial], directory: Path) -> list[Path]:
    if not trials:
        raise TridensError("no finished trial to export")
    out = []
    for rank, trial in enumerate(trials, 1):
        target = directory if len(trials) == 1 else directory / f"rank{rank}-trial{trial.id}"
        target.mkdir(parents=True, exist_ok=True)
        if trial.checkpoint is None:
            raise TridensError(f"trial {trial.id} has no checkpoint to export")
        weights = db.load_checkpoint(trial.checkpoint)
        torch.save(weights, target / "weights.pt")
        manifest = {
            "format": 1, "experiment": trial.experiment, "trial": trial.id, "sample": trial.sample,
            "seed": trial.seed, "fingerprint": trial.fingerprint, "metric": trial.metric, "metrics": trial.metrics,
            "objective": config.get("objective"), "space": config.get("space"), "program": None,
        }
        if config.get("space") is not None:
            try:
                space = build_space(config["space"])
                model = space.freeze(space.restrict(trial.sample), check=False)
                model.load_state_dict(weights)
                inputs = space.example_inputs
                if inputs is not None:
                    model.eval()
                    # A batch of 2 or more and an automatic batch dimension: the program accepts any batch size.
                    batch = tuple(torch.cat([x, x]) if x.shape[0] == 1 else x for x in inputs)
                    dims = tuple({0: torch.export.Dim.AUTO} for _ in batch)
                    program = torch.export.export(model, batch, dynamic_shapes=dims)
                    torch.export.save(program, str(target / "model.pt2"))
                    manifest["program"] = "model.pt2"
            except Exception as err:  # the weights and recipe are exported even when the program is not
                warnings.warn(f"trial {trial.id}: no self-contained program exported ({type(err).__name__}: {err})")
        (target / "sample.json").write_text(json.dumps(trial.sample, indent=2))
        (target / _MANIFEST).write_text(json.dumps(manifest, indent=2))
        out.append(target)
    return out


def load(directory: str | os.PathLike[str], *, prefer: str = "module") -> nn.Module:
    """Rebuild an exported model.

    With ``prefer="module"`` the space is rebuilt from its recorded import path and the sample
    frozen (a trainable ``nn.Module``); when that code is not importable, the self-contained
    ``torch.export`` program is loaded instead (``prefer="program"`` always takes it).

    >>> model = td.load("best-model")        # doctest: +SKIP
    """
    path = Path(directory)
    manifest_path = path / _MANIFEST
    if not manifest_path.exists():
        raise TridensError(f"{path} is not a tridens export (no {_MANIFEST})")
    manifest = json.loads(manifest_path.read_text())
    weights = torch.load(path / "weights.pt", weights_only=True)
    if prefer == "module" and manifest.get("space") is not None:
        try:
            space = build_space(manifest["space"])
            model = space.freeze(space.restrict(manifest["sample"]), check=False)
            model.load_state_dict(weights)
            return model
        except RecipeError as err:
            if not manifest.get("program"):
                raise
            warnings.warn(f"rebuilding from code failed ({err}); loading the exported program instead")
    if manifest.get("program"):
        return torch.export.load(str(path / manifest["program"])).module()
    raise TridensError(f"{path} holds no rebuildable model: the space was not importable and no program was exported")
