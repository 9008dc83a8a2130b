"""Choices in a plain ``torch.nn.Module`` (no ``@model_wrapper``, no compat ``Module``), as NNI 2.x's
``examples/nas/oneshot/darts`` writes its model: ``LayerChoice`` / ``InputChoice`` from
``nni.retiarii.nn.pytorch`` inside ``torch.nn.Module`` classes, the model handed to the 2.x one-shot
trainers or to ``RetiariiExperiment``. NNI's own ``model.py`` and ``ops.py`` run from the NNI
snapshot when there is one (their import line changed only); the small model below runs everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tridens
from tridens.compat.nni._common import NotSupported
from tridens.compat.nni.retiarii import fixed_arch
from tridens.compat.nni.retiarii import strategy as nni2
from tridens.compat.nni.retiarii.evaluator.pytorch.lightning import Classification, DataLoader
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment
from tridens.compat.nni.retiarii.nn.pytorch import InputChoice, LayerChoice, Repeat
from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer, EnasTrainer, SinglePathTrainer
from tridens.datasets import digits

from . import _upstream


class Node(nn.Module):  # torch.nn.Module, as NNI's darts example
    def __init__(self, node_id: str, num_prev: int, channels: int) -> None:
        super().__init__()
        self.ops = nn.ModuleList([LayerChoice([nn.Conv2d(channels, channels, 3, padding=1),
                                               nn.MaxPool2d(3, stride=1, padding=1)], label=f"{node_id}_p{i}")
                                  for i in range(num_prev)])
        self.switch = InputChoice(n_candidates=num_prev, n_chosen=1, label=f"{node_id}_switch")

    def forward(self, prev: list[torch.Tensor]) -> torch.Tensor:
        return self.switch([op(x) for op, x in zip(self.ops, prev)])


class Net(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.nodes = nn.ModuleList([Node(f"n{i}", i + 1, channels) for i in range(2)])
        self.head = nn.Linear(channels * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states = [self.stem(x)]
        for node in self.nodes:
            states.append(node(states))
        return self.head(states[-1].flatten(1))


_LABELS = {"n0_p0", "n0_switch", "n1_p0", "n1_p1", "n1_switch"}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    return tmp_path / "nni.db"


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), 1e-2)


def test_a_plain_module_runs_its_first_candidates_until_searched() -> None:
    model = Net(4)
    x = torch.randn(2, 1, 8, 8)
    assert model(x).shape == (2, 10)  # NNI 2.x: an unsearched LayerChoice runs its first candidate
    with fixed_arch({"n0_p0": 1, "n0_switch": 0, "n1_p0": 0, "n1_p1": 1, "n1_switch": 1}):
        chosen = Net(4)  # NNI's retrain.py: the chosen network, a plain module
    assert isinstance(chosen.nodes[1].ops[1], nn.MaxPool2d) and chosen(x).shape == (2, 10)


@pytest.mark.parametrize("trainer", ["darts", pytest.param("enas", marks=pytest.mark.slow),
                                     pytest.param("spos", marks=pytest.mark.slow)])
def test_the_one_shot_trainers_take_a_plain_module(store: Path, trainer: str) -> None:
    torch.manual_seed(0)  # the supernet's initial weights: the score of one argmax subnet varies with them
    train, val = digits()
    model = Net(8)
    common = dict(loss=nn.CrossEntropyLoss(), metrics=None, optimizer=_optimizer(model), num_epochs=3, batch_size=64)
    if trainer == "darts":
        t = DartsTrainer(model=model, dataset=train, **common)
    elif trainer == "enas":
        t = EnasTrainer(model=model, reward_function=None, dataset=train, **common)
    else:
        t = SinglePathTrainer(model=model, dataset_train=train, dataset_valid=val, **common)
    t.fit()
    arch = t.export()
    assert set(arch) == _LABELS
    assert t.experiment.best().metric > 0.2  # twice chance after 3 epochs
    with fixed_arch(arch):
        assert Net(8)(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_retiarii_experiment_takes_a_plain_module_with_a_multi_trial_strategy(store: Path) -> None:
    train, val = digits()
    evaluator = Classification(train_dataloaders=DataLoader(train, batch_size=64),
                               val_dataloaders=DataLoader(val, batch_size=64), max_epochs=1)
    exp = RetiariiExperiment(Net(8), evaluator, [], nni2.Random())
    config = RetiariiExeConfig("local")
    config.max_trial_number = 3
    exp.run(config)
    [arch] = exp.export_top_models(formatter="dict")
    assert set(arch) == _LABELS


def test_value_choices_in_a_plain_module_are_refused_naming_the_alternative() -> None:
    with pytest.raises(NotSupported, match="@model_wrapper"):
        Repeat(nn.Identity(), (1, 2), label="depth")


def _nni_darts_example(tmp_path: Path) -> Path:
    """NNI 2.10's examples/nas/oneshot/darts model.py, ops.py and utils.py, the import line changed."""
    for name in ("model.py", "ops.py", "utils.py"):
        text = _upstream.require(f"examples/nas/oneshot/darts/{name}", _upstream.NNI2)
        if name == "model.py":
            old = "from nni.retiarii.nn.pytorch import LayerChoice, InputChoice"
            assert old in text
            text = text.replace(old, "from tridens.compat.nni.retiarii.nn.pytorch import LayerChoice, InputChoice")
        (tmp_path / name).write_text(text)
    return tmp_path


def test_nni_darts_example_model_under_darts_trainer(tmp_path: Path) -> None:
    """search.py's DartsTrainer branch (``--v1`` off) on NNI's CNN, then retrain.py's fixed_arch."""
    folder = _nni_darts_example(tmp_path)
    (folder / "search_digits.py").write_text(textwrap.dedent("""
        import json
        import torch
        import torch.nn as nn
        from model import CNN
        from utils import accuracy
        from tridens.compat.nni.retiarii import fixed_arch
        from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer
        from tridens.datasets import digits

        dataset_train, dataset_valid = digits()
        model = CNN(8, 1, 4, 10, 3)
        criterion = nn.CrossEntropyLoss()
        optim = torch.optim.SGD(model.parameters(), 0.025, momentum=0.9, weight_decay=3.0E-4)
        trainer = DartsTrainer(model=model, loss=criterion,
                               metrics=lambda output, target: accuracy(output, target, topk=(1,)),
                               optimizer=optim, num_epochs=1, dataset=dataset_train, batch_size=64,
                               log_frequency=10, unrolled=False)
        trainer.fit()
        json.dump(trainer.export(), open('checkpoint.json', 'w'))
        with fixed_arch('checkpoint.json'):
            final = CNN(8, 1, 4, 10, 3)
        print('retrain model outputs', tuple(final(torch.randn(2, 1, 8, 8)).shape))
        """))
    source = str(Path(tridens.__file__).resolve().parents[1])  # this tridens, whatever the folder
    env = {**os.environ, "TRIDENS_DB": str(tmp_path / "nni.db"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "search_digits.py"], cwd=folder, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "retrain model outputs (2, 10)" in done.stdout
    arch = __import__("json").loads((folder / "checkpoint.json").read_text())
    # NNI's labels: {normal,reduce}_n{2..5}_p{i} ops and _switch input choices of two
    assert len(arch) == 2 * (2 + 3 + 4 + 5 + 4) and all(len(arch[k]) == 2 for k in arch if k.endswith("switch"))


def test_nni1_callbacks_import_and_refuse_naming_the_2x_way() -> None:
    """NNI 2.10's oneshot/darts/search.py imports these at top level, for its --v1 branch only."""
    from tridens.compat.nni.nas.pytorch.callbacks import ArchitectureCheckpoint, LRSchedulerCallback

    with pytest.raises(NotSupported, match=r"NNI 1\.x.*trainer\.export\(\)"):
        ArchitectureCheckpoint("./checkpoints")
    optimizer = _optimizer(Net(4))
    with pytest.raises(NotSupported, match=r"NNI 1\.x.*configure_optimizers"):
        LRSchedulerCallback(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10))
