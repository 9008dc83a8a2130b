"""A user's LightningModule runs under PyTorch Lightning, one trial at a time, reporting to tridens
through a Lightning callback: td.evaluators.Lightning and NNI's Lightning(module, trainer, ...)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tridens as td
from tridens.compat.nni._common import NotSupported
from tridens.evaluators import RecordingReporter

from . import _upstream

pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning (the extra tridens[lightning]) is not installed")


class Space(td.nn.ModelSpace):
    def __init__(self) -> None:
        super().__init__()
        width = td.choice("width", [8, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Module(pl.LightningModule):
    """A plain Lightning module (no NNI): counts its training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        self.log("val_acc", (out.argmax(-1) == y).float().mean())
        self.log("val_loss", nn.functional.cross_entropy(out, y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def loaders() -> tuple[DataLoader, DataLoader]:
    train, val = td.datasets.digits()
    return DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256)


def test_trials_run_under_lightning_with_metrics_each_epoch_and_weights_stored(loaders, tmp_path: Path, caplog) -> None:
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=3)
    exp = td.Experiment(Space(), ev, strategy=td.strategy.GridSearch(), budget=2, store=str(tmp_path / "t.db"),
                        name="lit", options=td.RunOptions(verbose=False))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    trials = td.Experiment.load(str(tmp_path / "t.db"), "lit").trials()
    assert len(trials) == 2 and all(t.status is td.TrialStatus.COMPLETED for t in trials)
    for t in trials:
        assert len(t.metrics["val_acc"]) == 3 and len(t.metrics["val_loss"]) == 3
        assert t.metric == t.metrics["val_acc"][-1] and t.metric > 0.5
        assert t.checkpoint and Path(t.checkpoint).exists()
    assert sum("no fusion" in r.getMessage() for r in caplog.records) == 1  # said once
    assert not (tmp_path / "lightning_logs").exists() and not Path("lightning_logs").exists()


def test_a_stop_decision_stops_lightning_and_max_steps_caps_it(loaders) -> None:
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=5)
    model = Space().freeze({"width": 8})
    reporter = RecordingReporter(stop_after=2)
    value = ev.evaluate(model, {}, seed=0, reporter=reporter)
    assert reporter.steps == [0, 1] and value == reporter.metrics["val_acc"][-1]
    assert list(next(iter(reporter.history))[1])[0] == "val_acc"  # the objective first
    reporter = RecordingReporter()
    ev.evaluate(Space().freeze({"width": 8}), {}, seed=0, reporter=reporter, max_steps=1)
    assert reporter.steps == [0]


def test_trainer_arguments_are_lightnings(loaders) -> None:
    module = Module()
    ev = td.evaluators.Lightning(module, train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=2, limit_train_batches=3, gradient_clip_val=0.5, accelerator="cpu",
                                 devices=1)
    trainer = ev.trainer()
    assert (trainer.max_epochs, trainer.limit_train_batches, trainer.gradient_clip_val) == (2, 3, 0.5)
    model = Space().freeze({"width": 8})
    fitted = ev.fresh_module(model)
    ev.run_fit(trainer, fitted)
    assert fitted.steps == 6 and module.steps == 0  # 2 epochs x 3 batches, on a copy of the module
    fast = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1],
                                   metric="val_acc", fast_dev_run=True)
    reporter = RecordingReporter()
    fast.evaluate(Space().freeze({"width": 8}), {}, seed=0, reporter=reporter)
    assert reporter.steps == [0]
    with pytest.raises(td.evaluators.InvalidParameter, match="val_f1"):
        td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_f1",
                                max_epochs=1).evaluate(Space().freeze({"width": 8}), {}, seed=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_request_without_cuda_is_one_line(loaders) -> None:
    from tridens.compat.nni.nas.evaluator.pytorch import Classification, ClassificationModule, Lightning, Trainer

    for gpus in (1, [0]):
        with pytest.raises(NotSupported, match=r"asks for a GPU .*no CUDA device.*gpus=0"):
            Classification(train_dataloaders=loaders[0], val_dataloaders=loaders[1], gpus=gpus)

    class Custom(ClassificationModule):
        pass

    with pytest.raises(NotSupported, match="no CUDA device"):
        Lightning(Custom(), Trainer(gpus=1), train_dataloaders=loaders[0], val_dataloaders=loaders[1])
    with pytest.raises(td.evaluators.InvalidParameter, match="no CUDA device"):
        td.evaluators.Classification(loaders[0].dataset, loaders[1].dataset, device="cuda").config()
    with pytest.raises(td.evaluators.InvalidParameter, match="no CUDA device"):
        td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], accelerator="gpu").check()


# -- NNI's API --------------------------------------------------------------------------------------------------
NASBENCH201_MODULE = '''
@nni.trace
class NasBench201TrainingModule(pl.LightningModule):
    def __init__(self, max_epochs=200, learning_rate=0.1, weight_decay=5e-4):
        super().__init__()
        self.save_hyperparameters('learning_rate', 'weight_decay', 'max_epochs')
        self.criterion = nn.CrossEntropyLoss()
        self.accuracy = AccuracyWithLogits()

    def forward(self, x):
        y_hat = self.model(x)
        return y_hat

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = self.criterion(y_hat, y)
        self.log('train_loss', loss, prog_bar=True)
        self.log('train_accuracy', self.accuracy(y_hat, y), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        self.log('val_loss', self.criterion(y_hat, y), prog_bar=True)
        self.log('val_accuracy', self.accuracy(y_hat, y), prog_bar=True)

    def configure_optimizers(self):
        optimizer = RMSpropTF(self.parameters(), lr=self.hparams.learning_rate,
                              weight_decay=self.hparams.weight_decay,
                              momentum=0.9, alpha=0.9, eps=1.0)
        return {
            'optimizer': optimizer,
            'lr_scheduler': CosineAnnealingLR(optimizer, self.hparams.max_epochs)
        }

    def on_validation_epoch_end(self):
        nni.report_intermediate_result(self.trainer.callback_metrics['val_accuracy'].item())

    def teardown(self, stage):
        if stage == 'fit':
            nni.report_final_result(self.trainer.callback_metrics['val_accuracy'].item())
'''


class _AccuracyWithLogits(nn.Module):
    """Stands in for the example's torchmetrics.Accuracy subclass (torchmetrics >= 0.11 needs a task)."""

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (pred.argmax(-1) == target).float().mean()


def _nasbench201_module(source: str):
    """The example's training module, its imports changed to tridens' (timm's RMSpropTF -> torch's RMSprop)."""
    import tridens.compat.nni as nni
    import tridens.compat.nni.retiarii.evaluator.pytorch.lightning as compat_pl

    namespace = {"nni": nni, "pl": compat_pl, "nn": nn, "AccuracyWithLogits": _AccuracyWithLogits,
                 "RMSpropTF": torch.optim.RMSprop, "CosineAnnealingLR": torch.optim.lr_scheduler.CosineAnnealingLR}
    exec(compile(source, "network.py", "exec"), namespace)
    return namespace["NasBench201TrainingModule"], compat_pl


def _run_nasbench201(source: str, loaders, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment
    from tridens.compat.nni.retiarii.strategy import Random

    module_cls, compat_pl = _nasbench201_module(source)
    trainer = compat_pl.Trainer(max_epochs=2, gpus=0)  # changed: no GPU
    lightning = compat_pl.Lightning(lightning_module=module_cls(max_epochs=2, learning_rate=0.01), trainer=trainer,
                                    train_dataloader=compat_pl.DataLoader(loaders[0].dataset, batch_size=64, shuffle=True),
                                    val_dataloaders=compat_pl.DataLoader(loaders[1].dataset, batch_size=256))
    exp = RetiariiExperiment(Space(), lightning, [], Random())
    config = RetiariiExeConfig("local")
    config.max_trial_number = 2
    exp.run(config)
    trials = exp.experiment.trials()
    assert len(trials) == 2 and all(t.status is td.TrialStatus.COMPLETED for t in trials)
    for t in trials:  # the intermediate results of on_validation_epoch_end, the final one of teardown
        assert len(t.metrics["value"]) == 2 and t.metrics["val_accuracy"] == t.metrics["value"]
        assert t.metric == t.metrics["value"][-1] and 0 < t.metric <= 1


def test_nni2_nasbench201_training_module_condensed(loaders, tmp_path: Path, monkeypatch) -> None:
    _run_nasbench201(NASBENCH201_MODULE, loaders, tmp_path, monkeypatch)


def test_nni2_nasbench201_training_module_upstream(loaders, tmp_path: Path, monkeypatch) -> None:
    source = _upstream.require("examples/nas/multi-trial/nasbench201/network.py", _upstream.NNI2)
    _run_nasbench201(_upstream.definitions(source, "NasBench201TrainingModule"), loaders, tmp_path, monkeypatch)


class _Padded(Dataset):
    """digits as 3x32x32 images (the 8x8 digit in the middle), the input NNI's DARTS space expects."""

    def __init__(self, base: Dataset, n: int) -> None:
        self.base, self.n = base, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return nn.functional.pad(x, (12, 12, 12, 12)).repeat(3, 1, 1), y


def test_darts_tutorial_module_retrains_with_aux_loss_drop_path_and_clipping(loaders) -> None:
    """The DARTS tutorial's DartsClassificationModule (NNI's file when the snapshot is here, else the
    condensed copy's), on a small DARTS-V2 model with the auxiliary head and drop path."""
    from tridens.compat.nni.nas.evaluator.pytorch import ClassificationModule, DataLoader, Lightning, Trainer
    from tridens.compat.nni.nas.hub.pytorch import DARTS as DartsSpace

    source = _upstream.read("examples/tutorials/darts.py")
    if source is None:
        source = (Path(__file__).parent / "darts_tutorial_nni3.py").read_text()
    namespace = {"ClassificationModule": ClassificationModule, "torch": torch}
    exec(compile(_upstream.definitions(source, "DartsClassificationModule"), "darts.py", "exec"), namespace)
    module = namespace["DartsClassificationModule"](0.025, 3e-4, 0.4, 4)
    train = DataLoader(_Padded(loaders[0].dataset, 96), batch_size=32)
    val = DataLoader(_Padded(loaders[1].dataset, 64), batch_size=64)
    evaluator = Lightning(module, trainer=Trainer(gpus=0, gradient_clip_val=5., max_epochs=2), train_dataloaders=train,
                          val_dataloaders=val)
    assert evaluator.trainer().gradient_clip_val == 5.0
    model = DartsSpace(width=4, num_cells=3, dataset="cifar", auxiliary_loss=True, drop_path_prob=0.2).freeze(
        td.hub.DARTS_V2)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = evaluator.fit(model)
    assert {"train_loss_main", "train_loss_aux", "train_loss", "val_acc", "val_loss", "lr"} <= set(metrics)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trained in place
    drops = [m for m in model.modules() if isinstance(m, td.hub.DropPath)]
    assert drops and drops[0].drop_prob == pytest.approx(0.2 * 1 / 4)  # set by on_train_epoch_start at epoch 1


def test_darts_tutorial_module_drives_a_one_shot_darts_search(loaders, tmp_path: Path, monkeypatch) -> None:
    """The tutorial's last search: Lightning(DartsClassificationModule(...), Trainer(...)) with
    DartsStrategy(gradient_clip_val=5.) in a NasExperiment (NNI's file when the snapshot is here, else the
    condensed copy's module), on a small DARTS space: the module's SGD, cosine schedule and epoch-start
    hook under Lightning, DARTS' architecture steps on the validation loader, NNI's exported cell keys."""
    from tridens.compat.nni.nas.evaluator.pytorch import ClassificationModule, DataLoader, Lightning, Trainer
    from tridens.compat.nni.nas.experiment import NasExperiment
    from tridens.compat.nni.nas.hub.pytorch import DARTS as DartsSpace
    from tridens.compat.nni.nas.strategy import DARTS as DartsStrategy

    source = _upstream.read("examples/tutorials/darts.py")
    if source is None:
        source = (Path(__file__).parent / "darts_tutorial_nni3.py").read_text()
    namespace = {"ClassificationModule": ClassificationModule, "torch": torch}
    exec(compile(_upstream.definitions(source, "DartsClassificationModule"), "darts.py", "exec"), namespace)
    evaluator = Lightning(namespace["DartsClassificationModule"](0.025, 3e-4, 0., 2),
                          Trainer(gpus=0, max_epochs=2, limit_train_batches=2),
                          train_dataloaders=DataLoader(_Padded(loaders[0].dataset, 64), batch_size=32),
                          val_dataloaders=DataLoader(_Padded(loaders[1].dataset, 64), batch_size=32))
    experiment = NasExperiment(DartsSpace(width=4, num_cells=3, dataset="cifar"), evaluator,
                               DartsStrategy(gradient_clip_val=5., samples=2), id="lit")
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    experiment.run()
    arch = experiment.export_top_models(formatter="dict")[0]
    assert set(arch) == {f"{c}/{kind}_{i}_{j}" for c in ("normal", "reduce") for kind in ("op", "input")
                         for i in range(2, 6) for j in range(2)}
    [supernet] = [t for t in experiment.experiment.trials() if t.info["oneshot"]["role"] == "supernet"]
    assert supernet.info["oneshot"]["lightning"] == "DartsClassificationModule" and supernet.info["oneshot"]["steps"] == 4
    lrs = supernet.metrics["lr"]  # logged by its on_train_epoch_start: its CosineAnnealingLR(T_max=2), per epoch
    assert lrs[0] == pytest.approx(0.025) and lrs[1] == pytest.approx(1e-3 + (0.025 - 1e-3) / 2)
    assert {"train_loss", "train_acc"} <= set(supernet.metrics) and supernet.metric is None


def test_a_plain_classification_module_stays_declarative_and_custom_ones_need_lightning(loaders, tmp_path) -> None:
    from tridens.compat.nni.nas.evaluator.pytorch import Classification, ClassificationModule, Lightning, Trainer

    ev = Lightning(ClassificationModule(learning_rate=0.01), Trainer(max_epochs=1), train_dataloaders=loaders[0],
                   val_dataloaders=loaders[1])
    assert isinstance(ev, Classification)
    script = tmp_path / "no_lightning.py"
    script.write_text(textwrap.dedent('''
        import sys
        sys.modules["lightning"] = sys.modules["lightning.pytorch"] = sys.modules["pytorch_lightning"] = None
        from tridens.compat.nni.nas.evaluator.pytorch import ClassificationModule, LightningModule, Lightning, Trainer
        ClassificationModule(learning_rate=0.01)      # the declarative one needs no Lightning
        class Custom(ClassificationModule):
            pass
        try:
            Custom()
        except Exception as err:
            print(type(err).__name__, err)
    '''))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    [line] = out.stdout.strip().splitlines()
    assert line.startswith("NotSupported Custom is a custom LightningModule") and "tridens[lightning]" in line
