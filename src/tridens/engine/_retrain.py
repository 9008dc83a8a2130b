"""Training a found architecture again with an evaluator of the user's choice (``td.retrain``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import TridensError
from ..evaluators import Evaluator, RecordingReporter
from ..files import MANIFEST_BYTES, regular_file
from ..space import BaseSpace, build_space
from ..trial import Trial
from ._export import _MANIFEST, ExportedProgram, _model_folder, load

__all__ = ["Retrained", "retrain"]


@dataclass
class Retrained:
    """What :func:`retrain` trained: the model (trained in place), the sample and seed it was
    trained under, the objective's final value and every reported metric per step (the shape of
    ``Trial.metrics``)."""

    model: nn.Module
    sample: dict[str, Any]
    seed: int
    metric: float | None
    metrics: dict[str, list[float]] = field(default_factory=dict)


def _from_export(path: Path, rank: int, weights: str, trust_code: bool,
                 allow_modules: Sequence[str]) -> tuple[nn.Module | None, BaseSpace | None, dict[str, Any], int]:
    folder = _model_folder(path, rank)
    manifest_path = regular_file(folder / _MANIFEST, inside=folder, max_bytes=MANIFEST_BYTES, what="manifest")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TridensError(f"{manifest_path} is not a readable tridens manifest ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sample"), dict):
        raise TridensError(f"{manifest_path} is not a tridens manifest (no sample)")
    recorded = manifest.get("seed")
    seed = recorded if isinstance(recorded, int) else 0
    if weights == "trained":
        model = load(folder, trust_code=trust_code, allow_modules=allow_modules)
        if isinstance(model, ExportedProgram):  # the space's code was not importable: inference only
            raise TridensError(f"{folder}: its space's code is not importable, only its inference program is; "
                               "pass allow_modules=[...] naming the module of its model space")
        return model, None, manifest["sample"], seed
    if manifest.get("space") is None:
        raise TridensError(f"{folder} records no model space to rebuild the architecture from")
    space = build_space(manifest["space"], trust_code=trust_code, untrusted_dir=folder, allow_modules=allow_modules)
    return None, space, manifest["sample"], seed


def retrain(source: str | os.PathLike[str] | Trial | nn.Module, evaluator: Evaluator, *,
            space: BaseSpace | None = None, sample: Mapping[str, Any] | None = None, seed: int | None = None,
            weights: str = "init", rank: int = 1, trust_code: bool = False,
            allow_modules: Sequence[str] = ()) -> Retrained:
    """Train a found architecture with ``evaluator`` (another dataset, more epochs, a final
    training on train + validation) and return it with its metrics.

    ``source`` is an export directory (``tridens export`` / ``Experiment.export``; its
    ``rank``-th model, or one ``rank*-trial*`` folder), a :class:`~tridens.Trial` of an
    experiment (with ``space=`` the experiment's model space), or an ``nn.Module``.
    ``weights="init"`` (the default) trains from scratch: the architecture is frozen again with
    the trial's seed, so its initial weights are those the trial started from;
    ``weights="trained"`` starts from the exported weights (fine-tuning). ``sample`` adds or
    overrides hyperparameters (the evaluator's own labels, e.g. an ``lr`` choice, take their
    value from it or from the trial's sample). ``seed`` defaults to the trial's. Exports from
    someone else run none of their code unless ``trust_code`` (as :func:`tridens.load`).

    >>> exp.export("best")                                                        # doctest: +SKIP
    >>> final = td.evaluators.Classification(train_and_val, test, epochs=30, lr=0.05)
    >>> result = td.retrain("best", final)                                         # doctest: +SKIP
    >>> result.metric, result.metrics["val_acc"][-1], result.model                 # doctest: +SKIP
    """
    if weights not in ("init", "trained"):
        raise ValueError(f"The 'weights' parameter of retrain must be one of ['init', 'trained']. Got {weights!r} instead.")
    if not isinstance(evaluator, Evaluator):
        raise ValueError(f"The 'evaluator' parameter of retrain must be a tridens evaluator. Got {evaluator!r} instead.")
    model: nn.Module | None = None
    found_seed = 0
    if isinstance(source, (str, os.PathLike)):
        model, built, found, found_seed = _from_export(Path(source), rank, weights, trust_code, allow_modules)
        space = built if space is None else space
    elif isinstance(source, Trial):
        if weights == "trained":
            raise TridensError(f"retrain(trial, weights='trained'): export trial {source.label} first "
                               "(exp.export(...)) and retrain the export, which holds its weights")
        if space is None:
            raise TridensError(f"retrain(trial {source.label}, ...) needs space=, the experiment's model space, "
                               "to rebuild the architecture from its sample")
        found, found_seed = dict(source.sample), source.seed
    elif isinstance(source, nn.Module):
        model, found = source, {}
    else:
        raise ValueError(f"The 'source' parameter of retrain must be an export directory, a Trial or an nn.Module. "
                         f"Got {type(source).__name__} instead.")
    merged = {**found, **dict(sample or {})}
    seed = found_seed if seed is None else seed
    missing = [label for label in evaluator.search_space() if label not in merged]
    if missing:
        raise TridensError(f"the evaluator's hyperparameter {missing[0]!r} has no value in the sample "
                           f"{sorted(merged)}: pass sample={{{missing[0]!r}: ...}} or fix it in the evaluator")
    if model is None:
        assert space is not None  # every source without a model names its space above
        torch.manual_seed(seed)  # the engine's initialisation of the trial's model
        model = space.freeze(space.restrict(merged), check=False)
    reporter = RecordingReporter()
    value = evaluator.evaluate(model, merged, seed, reporter)
    return Retrained(model=model, sample=merged, seed=seed, metric=value, metrics=reporter.metrics)
