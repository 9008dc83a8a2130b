"""One-shot strategies with a user's Lightning module driving the supernet's weights
(td.evaluators.Lightning): a real Lightning Trainer in manual optimization, the module's
training_step / configure_optimizers / lr scheduler / hooks, the strategy's architecture steps
between, tridens' reporting and checkpoints per epoch, subnets scored by the module's validation_step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import tridens as td
from tridens.store import Store
from tridens.trial import TrialStatus

from .spaces import role

pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning (the extra tridens[lightning]) is not installed")

CLIP = 0.05


class Space(td.nn.ModelSpace):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 32)
        self.op = td.nn.LayerChoice([nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                                     nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Identity()], label="op")
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.op(torch.relu(self.inp(x.flatten(1)))))


class Module(pl.LightningModule):
    """SGD with momentum and a cosine schedule (stepped per epoch); logs its lr at each epoch start
    and the gradient norm it sees before each optimizer step."""

    # Kept on the class: the evaluator trains a copy of the module given to it.
    calls = {"training_step": 0, "optimizer_step": 0}
    norms: list[float] = []

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        self.log("val_acc", (out.argmax(-1) == y).float().mean())
        self.log("val_loss", nn.functional.cross_entropy(out, y))

    def on_train_epoch_start(self):
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, optimizer):
        self.calls["optimizer_step"] += 1
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 4, eta_min=1e-3)}


@pytest.fixture(scope="module")
def loaders(digits_data) -> tuple[DataLoader, DataLoader]:
    train, val = digits_data
    return DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=256)


def _trials(path, name: str = "lit") -> list[td.Trial]:
    with Store(path, readonly=True) as db:
        return db.trials(name)


def _run(tmp_path, evaluator, strategy, name: str = "lit") -> str:
    exp = td.Experiment(Space(), evaluator, strategy=strategy, store=tmp_path / "t.db", name=name,
                        options=td.RunOptions(verbose=False))
    return exp.run() and exp._name()


def test_darts_steps_the_architecture_between_the_modules_own_weight_steps(loaders, tmp_path) -> None:
    Module.calls.update(training_step=0, optimizer_step=0)
    Module.norms.clear()
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=2, limit_train_batches=6, gradient_clip_val=CLIP)
    strategy = td.oneshot.DARTS(warmup=0.0, samples=3, arch_lr=0.05, retrain=True)
    exp = td.Experiment(Space(), ev, strategy=strategy, store=tmp_path / "t.db", name="lit",
                        options=td.RunOptions(verbose=False))
    exp.run()
    trials = _trials(tmp_path / "t.db")
    [supernet] = [t for t in trials if role(t) == "supernet"]
    # metrics per epoch: the module's logged lr follows its own cosine schedule, stepped per epoch
    assert [round(v, 4) for v in supernet.metrics["lr"]] == [0.1, round(1e-3 + (0.1 - 1e-3) * (1 + math.cos(math.pi / 4)) / 2, 4)]
    assert len(supernet.metrics["train_loss"]) == 2 and supernet.status is TrialStatus.COMPLETED
    info = supernet.info["oneshot"]
    assert info["epochs"] == 2 and info["steps"] == 12 and info["lightning"] == "Module"
    probs = info["probabilities"]["op"]
    assert max(probs) - min(probs) > 0.01  # alpha learned by DARTS' own Adam on the validation batches
    ckpt = torch.load(supernet.checkpoint, weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["lightning"]["optimizer_states"]
    # the weights are stored once: the module holds nothing but the model, so Lightning's state_dict is left empty
    assert not ckpt["lightning"]["state_dict"] and set(ckpt["lightning_model_keys"].values()) <= set(ckpt["model"])
    subnets = [t for t in trials if role(t) == "subnet"]
    assert len(subnets) == 3 and all(t.status is TrialStatus.COMPLETED and 0 <= t.metric <= 1 for t in subnets)
    assert exp.top(1)[0].id in {t.id for t in trials if role(t) in ("subnet", "retrain")}
    assert {"val_acc", "val_loss"} <= set(subnets[0].metrics)
    assert subnets[0].sample == info["argmax"]  # DARTS' argmax is scored first
    # The module's training_step gave the loss of every architecture step and every weight step; its
    # optimizer stepped the weights, their gradient clipped to the Trainer's gradient_clip_val first
    # (Lightning refuses that argument in manual optimization: the one-shot wrapper applies it).
    # Then the retrain: 12 more steps, under Lightning's automatic optimization (which clips after this hook).
    assert Module.calls == {"training_step": 24 + 12, "optimizer_step": 12 + 12}
    assert max(Module.norms[:12]) <= CLIP * (1 + 1e-4)
    [retrain] = [t for t in trials if role(t) == "retrain"]
    best = max(subnets, key=lambda t: (t.metric, -t.metrics["val_loss"][-1]))
    assert retrain.status is TrialStatus.COMPLETED and retrain.info["oneshot"]["of"] == best.label
    assert len(retrain.metrics["val_acc"]) == 2 and retrain.metric == retrain.metrics["val_acc"][-1]


def test_a_module_is_refused_in_one_line_where_the_strategy_needs_its_own_steps(loaders, tmp_path) -> None:
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=1)
    for strategy, why in ((td.oneshot.ENAS(), "ENAS rewards its controller"),
                          (td.oneshot.DARTS(second_order=True), "second_order=True"),
                          (td.oneshot.RandomOneShot(fair=True), "fair=True")):
        with pytest.raises(ValueError, match=why):
            _run(tmp_path, ev, strategy)
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], metric="val_acc", max_epochs=1)
    with pytest.raises(ValueError, match="'val_dataloaders' parameter of Lightning is required by the one-shot"):
        _run(tmp_path, ev, td.oneshot.DARTS())
    assert not (tmp_path / "t.db").exists()  # refused before any write


def test_random_one_shot_validates_each_epoch_and_resumes_from_lightnings_checkpoint(loaders, tmp_path) -> None:
    """SPOS under the module: a random path per training step, the module's validation_step each
    epoch (reported with the epoch); a run asked for one more epoch continues from the stored
    checkpoint (optimizer, scheduler, epoch, the strategy's random state) as an uninterrupted run trains."""
    def evaluator() -> td.evaluators.Lightning:
        return td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1],
                                       metric="val_acc", max_epochs=4, limit_train_batches=4)

    def run(folder, epochs: int) -> td.Trial:
        folder.mkdir(exist_ok=True)
        _run(folder, evaluator(), td.oneshot.RandomOneShot(epochs=epochs, samples=2, search="random"))
        [supernet] = [t for t in _trials(folder / "t.db") if role(t) == "supernet"]
        return supernet

    whole = run(tmp_path / "whole", 2)
    assert set(whole.metrics) >= {"train_loss", "val_acc", "val_loss", "lr"} and len(whole.metrics["val_acc"]) == 2
    assert whole.metric is None  # validated each epoch, the supernet still never ranks
    first = run(tmp_path / "parts", 1)
    assert len(first.metrics["train_loss"]) == 1
    resumed = run(tmp_path / "parts", 2)
    assert resumed.id == first.id and resumed.info["oneshot"]["steps"] == 8
    for name in ("train_loss", "val_acc", "lr"):
        assert resumed.metrics[name] == pytest.approx(whole.metrics[name], rel=1e-5), name


def test_fast_dev_run_scores_only_the_strategys_export(loaders, tmp_path) -> None:
    """Lightning's fast_dev_run checks that the code runs: one batch trains the supernet, and the
    search scores the strategy's export only (DARTS' argmax; RandomOneShot one path), whatever
    ``samples`` asks, as NNI's one-shot strategies export one architecture without a search."""
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=3, fast_dev_run=True)
    assert ev.fast_dev_run and not td.evaluators.Lightning(Module(), max_epochs=3).fast_dev_run
    for name, strategy in (("darts", td.oneshot.DARTS(samples=3)), ("spos", td.oneshot.RandomOneShot(samples=3))):
        _run(tmp_path, ev, strategy, name=name)
        trials = _trials(tmp_path / "t.db", name)
        [supernet] = [t for t in trials if role(t) == "supernet"]
        assert supernet.info["oneshot"]["steps"] == 1 and len(supernet.metrics["train_loss"]) == 1
        [subnet] = [t for t in trials if role(t) == "subnet"]
        assert subnet.status is TrialStatus.COMPLETED and 0 <= subnet.metric <= 1
        if name == "darts":
            assert subnet.sample == supernet.info["oneshot"]["argmax"]


def test_darts_trains_without_a_validation_loop_lightning_would_warn_about(loaders, tmp_path, recwarn) -> None:
    """DARTS feeds the validation batches to its architecture steps: the supernet's training has no
    validation loop, so its wrapper has no validation_step and Lightning has nothing to warn about."""
    ev = td.evaluators.Lightning(Module(), train_dataloaders=loaders[0], val_dataloaders=loaders[1], metric="val_acc",
                                 max_epochs=1, fast_dev_run=True)
    _run(tmp_path, ev, td.oneshot.DARTS())
    assert not [w for w in recwarn if "val_dataloader" in str(w.message)]
    [subnet] = [t for t in _trials(tmp_path / "t.db") if role(t) == "subnet"]
    assert subnet.status is TrialStatus.COMPLETED  # scored by the module's validation_step
