"""NNI's one-shot test space ``CellNet`` (NNI 3.0's ``test/ut/nas/nn/models.py``: a ``Repeat`` of
loose-end ``Cell``s whose next layers are sized for all three nodes) under NNI's four one-shot
strategies, as NNI's ``test/algo/nas/oneshot/test_strategy.py`` runs it: the search runs and
exports an architecture. The upstream class is read from the NNI snapshot when there is one; the
copy below (NNI's text, imports changed) runs everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tridens as td
from tridens.compat.nni.nas import strategy as nni3
from tridens.compat.nni.nas.evaluator.pytorch import Classification, DataLoader
from tridens.compat.nni.nas.experiment import NasExperiment
from tridens.compat.nni.nas.nn.pytorch import Cell, ModelSpace, Repeat

from . import _upstream


class CellNet(ModelSpace):  # NNI 3.0, test/ut/nas/nn/models.py
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 5, 7, stride=4)
        self.cells = Repeat(
            lambda index: Cell({
                'conv1': lambda _, __, inp: nn.Conv2d(
                    (5 if index == 0 else 3 * 4) if inp is not None and inp < 1 else 4, 4, 1
                ),
                'conv2': lambda _, __, inp: nn.Conv2d(
                    (5 if index == 0 else 3 * 4) if inp is not None and inp < 1 else 4, 4, 3, padding=1
                ),
            }, 3, merge_op='loose_end', label=f'cell{index}'),
            (1, 3), label='rep'
        )
        self.fc = nn.Linear(3 * 4, 10)

    def forward(self, x):
        x = self.stem(x)
        x = self.cells(x)
        x = torch.mean(x, (2, 3))
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def _upstream_cellnet() -> type:
    source = _upstream.require("test/ut/nas/nn/models.py")
    namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "Cell": Cell, "ModelSpace": ModelSpace,
                                 "Repeat": Repeat}
    exec(compile(_upstream.definitions(source, "CellNet"), "models.py", "exec"), namespace)
    return namespace["CellNet"]


def _search(space: Any, strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    train, val = td.datasets.digits()
    evaluator = Classification(train_dataloaders=DataLoader(train, batch_size=64),
                               val_dataloaders=DataLoader(val, batch_size=64), max_epochs=1)
    exp = NasExperiment(space, evaluator, getattr(nni3, strategy)())
    with pytest.warns(UserWarning, match="loose-end cell"):  # its subnets cannot be retrained: NNI's space is sized for all nodes
        exp.run()
    [arch] = exp.export_top_models(formatter="dict")
    assert isinstance(arch, dict) and arch["rep"] in (1, 2, 3)
    assert {f"cell0/op_{n}_0" for n in (1, 2, 3)} <= set(arch)
    return arch


_STRATEGIES = ["DARTS", pytest.param("GumbelDARTS", marks=pytest.mark.slow), pytest.param("ENAS", marks=pytest.mark.slow),
               pytest.param("RandomOneShot", marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_nni_cellnet_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    _search(CellNet(), strategy, tmp_path, monkeypatch)


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_nni_cellnet_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    _search(_upstream_cellnet()(), strategy, tmp_path, monkeypatch)
