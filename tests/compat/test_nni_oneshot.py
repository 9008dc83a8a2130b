"""NNI one-shot NAS on tridens: NNI 3.x and 2.x scripts run as real subprocesses on digits, and
every NNI argument either maps onto tridens or is refused with the argument and the alternative
named."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

import tridens as td
from tridens.compat.nni._common import NotSupported
from tridens.compat.nni.nas import strategy as nni3
from tridens.compat.nni.nas.evaluator import FunctionalEvaluator
from tridens.compat.nni.nas.evaluator.pytorch import Classification, DataLoader, Regression
from tridens.compat.nni.nas.experiment import NasExperiment
from tridens.compat.nni.nas.space import model_context
from tridens.compat.nni.retiarii import fixed_arch, model_wrapper
from tridens.compat.nni.retiarii import strategy as nni2
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment
from tridens.compat.nni.retiarii.nn import pytorch as rnn
from tridens.compat.nni.retiarii.oneshot.pytorch import ProxylessTrainer
from tridens.store import Store
from tridens.trial import TrialStatus

HERE = Path(__file__).parent


def _script(script: str, arg: str, tmp_path: Path) -> tuple[str, Path]:
    """Run ``script arg`` in ``tmp_path`` with its own store; its stdout + stderr and the store."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = tmp_path / "nni.db"
    env = {**os.environ, "TRIDENS_DB": str(db), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(HERE / script), arg], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout + res.stderr, db


_DEFAULT_RUNS = {"nni3-darts": ("oneshot_nni3.py", "darts"), "nni2-strategy": ("retiarii_nni2.py", "strategy"),
                 "nni2-darts-trainer": ("retiarii_nni2.py", "darts-trainer"),
                 "nni2-plain-darts": ("plain_module_nni2.py", "darts")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[tuple[str, Path]]]]:
    """The default-suite script runs, two at a time (the machine has two cores), started once."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {key: pool.submit(_script, script, arg, tmp_path_factory.mktemp(key))
               for key, (script, arg) in _DEFAULT_RUNS.items()}


def _trials(db: Path) -> list[td.Trial]:
    with Store(db, readonly=True) as store:
        [record] = store.experiments()
        return store.trials(record.name)


def _all_trials(db: Path) -> list[td.Trial]:
    with Store(db, readonly=True) as store:
        return [t for record in store.experiments() for t in store.trials(record.name)]


def _role(trial: td.Trial) -> str:
    return trial.info["oneshot"]["role"]


# -- NNI 3.x scripts ---------------------------------------------------------------------------------
def _check_nni3(stdout: str, db: Path) -> list[td.Trial]:
    trials = _all_trials(db)  # two searches: the Classification one, the tutorial's module's
    supernets = [t for t in trials if _role(t) == "supernet"]
    subnets = [t for t in trials if _role(t) == "subnet" and t.status is TrialStatus.COMPLETED]
    assert len(supernets) == 1 and len(supernets[0].metrics["train_loss"]) == 2  # max_epochs=2
    assert subnets and all(t.info["oneshot"]["inherited"] for t in subnets)
    best = max(subnets, key=lambda t: (t.metric, -t.id))
    arch = json.loads(re.search(r"^exported architecture: (.*)$", stdout, re.M).group(1).replace("'", '"'))
    assert arch == {k: best.sample[k] for k in arch} and set(arch) == {"width", "op", "hidden"}
    # export_top_models(formatter='instance') carries the weights the subnet was scored with
    exported = float(re.search(r"^exported model accuracy: ([\d.]+)$", stdout, re.M).group(1))
    assert exported == pytest.approx(best.metric, abs=1e-6)
    assert best.metric > 0.3  # learned something in 2 epochs (10 classes)
    rebuilt, original = map(int, re.search(r"rebuilt for retraining: (\d+) parameters, (\d+) exported", stdout).groups())
    assert rebuilt == original  # model_context(arch) builds the same architecture
    return supernets


def test_nni3_darts_script(runs) -> None:
    stdout, db = runs["nni3-darts"].result()
    [supernet] = _check_nni3(stdout, db)
    probs = supernet.info["oneshot"]["probabilities"]
    assert set(probs) == {"width", "op", "hidden"} and len(probs["op"]) == 3
    with Store(db, readonly=True) as store:
        [record] = store.experiments()
    assert record.config["oneshot"]["strategy"] == "DARTS"
    assert record.config["oneshot"]["params"]["arch_lr"] == 3e-3  # arc_learning_rate
    # `tridens export` works on the NNI script's result; td.load rebuilds the model from the script
    target = db.parent / "best"
    subprocess.run([sys.executable, "-m", "tridens.cli", "export", record.name, "--top", "1", "--to", str(target),
                    "--db", str(db), "--trust-code"], check=True, capture_output=True, timeout=300)
    best = max((t for t in _trials(db) if _role(t) == "subnet"), key=lambda t: (t.metric, -t.id))
    model = td.load(target, trust_code=True).eval()  # the NNI script is ours
    _, val = td.datasets.digits()
    with torch.no_grad():
        x, y = val.tensors
        assert float((model(x).argmax(1) == y).float().mean()) == pytest.approx(best.metric, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name, strategy", [("gdas", "GumbelDARTS"), ("enas", "ENAS"), ("spos", "RandomOneShot")])
def test_nni3_other_strategies(tmp_path: Path, name: str, strategy: str) -> None:
    stdout, db = _script("oneshot_nni3.py", name, tmp_path)
    _check_nni3(stdout, db)
    with Store(db, readonly=True) as store:
        [record] = store.experiments()
    assert record.config["oneshot"]["strategy"] == strategy


# -- NNI 2.x scripts ---------------------------------------------------------------------------------
def _check_nni2(stdout: str, db: Path) -> dict:
    arch = json.loads(re.search(r"^final architecture: (.*)$", stdout, re.M).group(1).replace("'", '"'))
    assert set(arch) == {"width", "conv2"} and arch["width"] in (16, 32) and arch["conv2"] in (0, 1)
    params, kernel = map(int, re.search(r"final model: (\d+) parameters, conv2 kernel (\d)", stdout).groups())
    width, k = arch["width"], (3, 5)[arch["conv2"]]
    assert kernel == k and params == (9 * width + width) + (k * k * width * width + width) + (width * 10 + 10)
    assert any(_role(t) == "supernet" and t.status is TrialStatus.COMPLETED for t in _trials(db))
    return arch


def test_nni2_strategy_script(runs) -> None:
    """RetiariiExperiment + nni.retiarii.strategy.DARTS + the Lightning Classification evaluator."""
    stdout, db = runs["nni2-strategy"].result()
    arch = _check_nni2(stdout, db)
    best = max((t for t in _trials(db) if _role(t) == "subnet"), key=lambda t: (t.metric, -t.id))
    assert arch == best.sample


def test_nni2_darts_trainer_script(runs) -> None:
    """The legacy DartsTrainer: fit() trains the supernet, export() is the argmax of alpha."""
    stdout, db = runs["nni2-darts-trainer"].result()
    arch = _check_nni2(stdout, db)
    [supernet] = [t for t in _trials(db) if _role(t) == "supernet"]
    assert arch == supernet.info["oneshot"]["argmax"]
    assert "is not applied" not in stdout  # NNI's default clipping (grad_clip=5.0): applied


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["enas-trainer", "spos-trainer"])
def test_nni2_other_trainers(tmp_path: Path, mode: str) -> None:
    stdout, db = _script("retiarii_nni2.py", mode, tmp_path)
    _check_nni2(stdout, db)


def _check_plain(stdout: str, db: Path) -> dict:
    """A plain nn.Module (no @model_wrapper) with LayerChoice, InputChoice and a ValueChoice width:
    every label is searched and fixed_arch builds the exported architecture."""
    arch = json.loads(re.search(r"^Final architecture: (.*)$", stdout, re.M).group(1).replace("'", '"'))
    assert set(arch) == {"width", "node0_op0", "node0_switch", "node1_op0", "node1_op1", "node1_switch"}
    assert arch["width"] in (8, 16) and arch["node1_switch"] in (0, 1)
    params, out = re.search(r"final model: (\d+) parameters, output \((\d+), (\d+)\)", stdout).group(1, 2)
    assert int(out) == 4 and int(params) > 0
    [supernet] = [t for t in _trials(db) if _role(t) == "supernet"]
    assert supernet.status is TrialStatus.COMPLETED and len(supernet.metrics["train_loss"]) == 2
    assert set(supernet.info["oneshot"].get("argmax", arch)) == set(arch)
    return arch


def test_nni2_plain_module_darts_trainer(runs) -> None:
    stdout, db = runs["nni2-plain-darts"].result()
    arch = _check_plain(stdout, db)
    [supernet] = [t for t in _trials(db) if _role(t) == "supernet"]
    assert arch == supernet.info["oneshot"]["argmax"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["enas", "spos"])
def test_nni2_plain_module_other_trainers(tmp_path: Path, mode: str) -> None:
    stdout, db = _script("plain_module_nni2.py", mode, tmp_path)
    _check_plain(stdout, db)


@pytest.mark.slow
def test_nni3_darts_tutorial(tmp_path: Path) -> None:
    """NNI 3.0's DARTS tutorial (condensed, see darts_tutorial_nni3.py) with its own fast_dev_run:
    the pre-searched DARTS-V2 evaluated, DartsSpace(16, 8) searched by DARTS, the exported cells
    in the form the tutorial draws, the final model retrained by evaluator.fit; its last part's
    DartsClassificationModule drives the DARTS search under Lightning (DartsStrategy(gradient_clip_val=5.)),
    then retrains the final model."""
    stdout, db = _script("darts_tutorial_nni3.py", "run", tmp_path)
    assert re.search(r"^Accuracy: [\d.]+$", stdout, re.M)
    arch = ast.literal_eval(re.search(r"^exported_arch: (.*)$", stdout, re.M).group(1))
    assert set(arch) == {f"{cell}/{kind}_{i}_{j}" for cell in ("normal", "reduce") for kind in ("op", "input")
                         for i in range(2, 6) for j in range(2)}
    assert all(arch[f"{c}/input_{i}_{j}"] < i for c in ("normal", "reduce") for i in range(2, 6) for j in range(2))
    trials = _all_trials(db)  # two searches: the Classification one, the tutorial's module's
    supernets = [t for t in trials if _role(t) == "supernet"]
    [supernet] = [t for t in supernets if "lightning" not in t.info["oneshot"]]
    assert len(supernet.metrics["train_loss"]) == 1  # fast_dev_run: one epoch of one batch
    assert arch in [t.sample for t in trials if _role(t) == "subnet"]
    retrained = ast.literal_eval(re.search(r"^retrained: (.*)$", stdout, re.M).group(1))
    assert set(retrained) == {"train_loss", "val_acc", "val_loss"} and 0 <= retrained["val_acc"] <= 1
    # the search with the tutorial's own module: one epoch of one batch (fast_dev_run) under Lightning
    [searched] = [t for t in supernets if t.info["oneshot"].get("lightning") == "DartsClassificationModule"]
    assert searched.status is td.TrialStatus.COMPLETED and searched.info["oneshot"]["steps"] == 1
    assert {"train_loss", "train_acc", "lr"} <= set(searched.metrics)  # logged by its training_step and epoch start
    # its SGD's learning rate, as its configure_optimizers set it (self.log keeps it as a float32 tensor)
    assert searched.metrics["lr"] == [pytest.approx(0.025, rel=1e-6)]
    lit_arch = ast.literal_eval(re.search(r"^lightning exported_arch: (.*)$", stdout, re.M).group(1))
    assert set(lit_arch) == set(arch) and lit_arch in [t.sample for t in trials if _role(t) == "subnet"]
    # each search exported its argmax, as NNI's DARTS does: the one subnet scored (fast_dev_run too)
    assert sorted(map(str, (t.sample for t in trials if _role(t) == "subnet"))) == sorted(map(str, (arch, lit_arch)))
    assert (supernet.info["oneshot"]["argmax"], searched.info["oneshot"]["argmax"]) == (arch, lit_arch)
    final = ast.literal_eval(re.search(r"^final retrained: (.*)$", stdout, re.M).group(1))  # under Lightning
    assert {"train_loss_main", "train_loss_aux", "val_acc", "lr"} <= set(final)


def test_plain_module_is_rebuilt_as_a_space_from_its_arguments() -> None:
    """A plain nn.Module of nni.retiarii.nn.pytorch keeps its arguments; as_space builds it again
    as @model_wrapper would; RetiariiExperiment takes it too; a torch.nn.Module with a Cell is
    refused naming the compat nn.Module."""
    from tridens.compat.nni.retiarii import as_space

    class Plain(rnn.Module):
        def __init__(self, width: int, classes: int = 10) -> None:
            super().__init__()
            w = rnn.ValueChoice([width, 2 * width], label="w")
            self.op = rnn.LayerChoice([rnn.Conv2d(1, w, 3, padding=1), rnn.Conv2d(1, w, 5, padding=2)], label="k")
            self.fc = rnn.Linear(w, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.op(x).mean((2, 3)))

    model = Plain(4, classes=3)
    assert not isinstance(model, td.ModelSpace) and model.fc.in_features == 4  # first candidates
    space = as_space("DartsTrainer", model)
    assert isinstance(space, td.ModelSpace) and set(space.search_space()) == {"w", "k"} and space.size() == 4
    assert space.freeze({"w": 8, "k": 1}).fc.out_features == 3
    with fixed_arch({"w": 8, "k": 1}):
        fixed = Plain(4, classes=3)
    assert fixed.op.kernel_size == (5, 5) and fixed.fc.in_features == 8
    assert isinstance(RetiariiExperiment(model, None, [], nni2.DARTS()).model_space, td.ModelSpace)

    class Torch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.op = rnn.LayerChoice([torch.nn.ReLU(), torch.nn.Tanh()], label="op")
            self.cell = rnn.Cell([torch.nn.ReLU()], 2, label="cell")

    with pytest.raises(NotSupported, match="retiarii.nn.pytorch's nn.Module"):
        Torch()  # a Cell needs its constructor to run again (a LayerChoice alone is taken: test_nni_plain_module)
    with pytest.raises(NotSupported, match="must be a model space"):
        as_space("DartsTrainer", torch.nn.Linear(1, 1))


# -- argument mapping (no training) ------------------------------------------------------------------
def test_nni3_strategies_map_their_arguments() -> None:
    darts = nni3.DARTS(arc_learning_rate=1e-2, samples=8, retrain=True)
    assert isinstance(darts, td.oneshot.DARTS) and (darts.arch_lr, darts.samples, darts.retrain) == (1e-2, 8, True)
    gdas = nni3.GumbelDARTS(temperature=(2.0, 0.5))
    assert isinstance(gdas, td.oneshot.GumbelDARTS) and (gdas.tau_max, gdas.tau_min) == (2.0, 0.5)
    assert (nni3.GumbelDARTS(temperature=0.7).tau_max, nni3.GumbelDARTS(temperature={"init": 3, "min": 1}).tau_min) == (0.7, 1.0)
    enas = nni3.ENAS(batches_per_update=5, controller_lr=3e-3)
    assert (enas.controller_every, enas.controller_samples, enas.controller_lr) == (5, 5, 3e-3)
    spos = nni3.RandomOneShot(fair=True)
    assert isinstance(spos, td.oneshot.RandomOneShot) and spos.fair
    # logging-only arguments are accepted at any value
    assert nni3.DARTS(log_prob_every_n_step=1).arch_lr == 3e-4
    # NNI's DARTS and GumbelDARTS export their argmax: the one subnet scored, unless samples= asks for a search
    assert (nni3.DARTS().samples, nni3.GumbelDARTS().samples, nni2.DARTS().samples, nni2.GumbelDARTS().samples) == (1,) * 4
    assert (nni3.DARTS(warmup_epochs=1).samples, nni3.ENAS().samples, nni3.RandomOneShot().samples) == (1, 64, 64)
    # NNI's DARTS updates the architecture from the first step unless warmup_epochs says otherwise
    assert nni3.DARTS().warmup == 0.0 and nni3.DARTS(warmup=0.5).warmup == 0.5 and nni2.DARTS().warmup == 0.0


def test_warmup_epochs_freeze_alpha_for_that_many_epochs(tmp_path: Path, data) -> None:
    """GumbelDARTS(warmup_epochs=k) over 2 epochs: with k=2 alpha never moves from its 1e-3-scale
    start; with k=1 the architecture steps of epoch 2 move it."""
    train, val = data
    ev = Classification(learning_rate=1e-2, train_dataloaders=DataLoader(Subset(train, range(256)), batch_size=64),
                        val_dataloaders=DataLoader(Subset(val, range(64)), batch_size=64), max_epochs=2)
    moved = {}
    for k in (2, 1):
        strategy = nni3.GumbelDARTS(warmup_epochs=k, arc_learning_rate=0.1, samples=1)
        assert type(strategy).__name__ == "GumbelDARTS" and isinstance(strategy, td.oneshot.GumbelDARTS)
        td.Experiment(_Tiny(), ev, strategy, store=tmp_path / "w.db", name=f"warm{k}",
                      options=td.RunOptions(verbose=False)).run()
        # 128 of the 256 examples train the weights (arch_fraction=0.5): 2 steps per epoch
        assert strategy.cfg.steps_per_epoch == 2 and strategy.warmup_steps() == 2 * k
        moved[k] = max(float(a.detach().abs().max()) for a in strategy.alpha.values())
    assert moved[2] < 1e-2 < moved[1]


def test_fast_dev_run_scores_only_the_strategys_export(tmp_path: Path, data) -> None:
    """Classification(fast_dev_run=True) trains one epoch of one batch (its translation keeps no flag
    for the trainer) and says so: a one-shot search then scores only its strategy's export, one
    subnet whatever ``samples`` asks, as NNI exports one architecture without a search."""
    train, val = data
    loaders = {"train_dataloaders": DataLoader(Subset(train, range(256)), batch_size=64),
               "val_dataloaders": DataLoader(Subset(val, range(64)), batch_size=64)}
    ev = Classification(learning_rate=1e-2, max_epochs=10, fast_dev_run=True, **loaders)
    assert ev.fast_dev_run and ev.epochs == 1 and not Classification(max_epochs=10, **loaders).fast_dev_run
    for name, strategy in (("darts", nni3.DARTS(samples=8)), ("spos", nni3.RandomOneShot(samples=8))):
        td.Experiment(_Tiny(), ev, strategy, store=tmp_path / "f.db", name=name, options=td.RunOptions(verbose=False)).run()
        with Store(tmp_path / "f.db", readonly=True) as store:
            trials = store.trials(name)
        [supernet] = [t for t in trials if _role(t) == "supernet"]
        assert len(supernet.metrics["train_loss"]) == 1 and supernet.info["oneshot"]["steps"] == 1
        [subnet] = [t for t in trials if _role(t) == "subnet"]
        assert subnet.status is TrialStatus.COMPLETED
        if name == "darts":
            assert subnet.sample == supernet.info["oneshot"]["argmax"]


@pytest.mark.parametrize("make, name, hint", [
    (lambda: nni3.DARTS(gradient_clip_val="5"), "gradient_clip_val", "number"),
    (lambda: nni2.ENAS(ctrl_grad_clip=1.0), "ctrl_grad_clip", "ctrl_lr"),
    (lambda: nni3.DARTS(warmup_epochs=1.5), "warmup_epochs", "int"),
    (lambda: nni3.ENAS(warmup_epochs=2), "warmup_epochs", "RandomOneShot"),
    (lambda: nni3.DARTS(penalty={"profiler": None}), "penalty", "Constraint"),
    (lambda: nni3.GumbelDARTS(mutation_hooks=[print]), "mutation_hooks", "LayerChoice"),
    (lambda: nni3.ENAS(policy_fn=print), "policy_fn", "controller_lr"),
    (lambda: nni3.ENAS(reward_metric_name="train_loss"), "reward_metric_name", "val_loss"),
    (lambda: nni3.RandomOneShot(filter=lambda s: True), "filter", "Constraint"),
    (lambda: nni3.DARTS(arc_lr=1e-3), "arc_lr", "arch_lr"),
    (lambda: nni3.GumbelDARTS(temperature="hot"), "temperature", "(init, min)"),
    (lambda: nni2.ENAS(skip_weight=0.5), "skip_weight", "entropy_weight"),
    (lambda: nni2.ENAS(ctrl_kwargs={"tanh_constant": 2.0}), "tanh_constant", "lstm_size"),
])
def test_arguments_without_tridens_meaning_are_refused(make, name: str, hint: str) -> None:
    with pytest.raises(NotSupported) as err:
        make()
    assert name in str(err.value) and hint in str(err.value)


def _grad_norm(strategy: Any) -> float:
    grads = [p.grad for group in strategy.optimizer.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def test_gradient_clipping_of_the_one_shot_trainers_is_applied(tmp_path: Path, data, monkeypatch) -> None:
    """NNI 3's gradient_clip_val and 2.x's grad_clip become td.oneshot's grad_clip: the weights'
    gradient norm at the last step is the clip value (unclipped it is larger)."""
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "trainer.db"))
    from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer

    assert nni3.DARTS(gradient_clip_val=5.0).grad_clip == 5.0 and nni3.GumbelDARTS(gradient_clip_val=2).grad_clip == 2.0
    assert nni3.DARTS().grad_clip is None
    train, val = data
    ev = Classification(learning_rate=1e-2, train_dataloaders=DataLoader(Subset(train, range(256)), batch_size=64),
                        val_dataloaders=DataLoader(Subset(val, range(64)), batch_size=64), max_epochs=1)
    norms = {}
    for clip in (None, 1e-3):
        strategy = nni3.DARTS(gradient_clip_val=clip, samples=1)
        td.Experiment(_Tiny(), ev, strategy, store=tmp_path / "c.db", name=f"clip-{clip}",
                      options=td.RunOptions(verbose=False)).run()
        norms[clip] = _grad_norm(strategy)
    assert norms[1e-3] == pytest.approx(1e-3, rel=1e-3) and norms[None] > 1e-2
    trainer = DartsTrainer(_Tiny(), torch.nn.CrossEntropyLoss(), None, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(),
                           lr=0.01), 1, Subset(train, range(256)), grad_clip=1e-3, batch_size=64)
    trainer.fit()
    assert trainer.experiment.strategy.grad_clip == 1e-3 and _grad_norm(trainer.experiment.strategy) == pytest.approx(
        1e-3, rel=1e-3)
    with pytest.raises(ValueError, match="grad_clip"):
        td.oneshot.RandomOneShot(grad_clip=0).validate()


def test_average_meter_group() -> None:
    from tridens.compat.nni.retiarii.oneshot.pytorch.utils import AverageMeterGroup

    meters = AverageMeterGroup()
    for loss, acc in ((2.0, 0.5), (1.0, 0.7)):
        meters.update({"loss": loss, "acc": acc})
    assert (meters.loss.avg, meters["acc"].val, meters.acc.count) == (1.5, 0.7, 2)
    assert str(meters) == "loss 1.000000 (1.500000)  acc 0.700000 (0.600000)"
    assert meters.summary() == "loss: 1.500000  acc: 0.600000"
    with pytest.raises(AttributeError):
        meters.missing


def test_proxyless_and_policy_rl_name_the_alternatives() -> None:
    for make in (nni3.Proxyless, nni2.Proxyless, lambda: ProxylessTrainer(None), nni3.PolicyBasedRL):
        with pytest.raises(NotSupported) as err:
            make()
        message = str(err.value)
        assert "not provided by tridens" in message and ("GumbelDARTS" in message or "ENAS" in message)


def test_enas_reward_metric_name(tmp_path: Path, data) -> None:
    """reward_metric_name="val_loss": the controller is rewarded with minus the loss of the sampled
    path on the held-out batch (its baseline is a negative loss); the default rewards accuracy."""
    assert nni3.ENAS(reward_metric_name="val_loss").reward_metric == "val_loss"
    assert nni3.ENAS(reward_metric_name="default").reward_metric is None
    assert nni2.ENAS(reward_metric_name="acc").reward_metric == "val_acc"
    train, val = data
    ev = Classification(learning_rate=1e-2, train_dataloaders=DataLoader(Subset(train, range(320)), batch_size=64),
                        val_dataloaders=DataLoader(Subset(val, range(64)), batch_size=64), max_epochs=1)
    baselines = {}
    for name in ("val_loss", None):
        strategy = nni3.ENAS(reward_metric_name=name, batches_per_update=1, samples=1)
        td.Experiment(_Tiny(), ev, strategy, store=tmp_path / "r.db", name=f"reward-{name}",
                      options=td.RunOptions(verbose=False)).run()
        baselines[name] = strategy.baseline
        x, y = val.tensors[0][:64], val.tensors[1][:64]
        with torch.no_grad():
            out = strategy.net.model(x)
        expected = -float(torch.nn.functional.cross_entropy(out, y)) if name else float((out.argmax(1) == y).float().mean())
        assert strategy.reward_of(out, y) == pytest.approx(expected, rel=1e-5)
    assert baselines["val_loss"] < 0 <= baselines[None] <= 1
    with pytest.raises(ValueError, match="reward_metric"):
        td.Experiment(_Tiny(), ev, td.oneshot.ENAS(reward_metric="val_mse"), store=tmp_path / "r.db", name="mse",
                      options=td.RunOptions(verbose=False)).run()


def test_nni2_strategies_map_their_arguments() -> None:
    gdas = nni2.GumbelDARTS(gumbel_temperature=2.0, use_temp_anneal=True, min_temp=0.5)
    assert (gdas.tau_max, gdas.tau_min) == (2.0, 0.5)
    assert (nni2.GumbelDARTS(gumbel_temperature=2.0).tau_max, nni2.GumbelDARTS(gumbel_temperature=2.0).tau_min) == (2.0, 2.0)
    enas = nni2.ENAS(ctrl_kwargs={"lstm_size": 16}, ctrl_steps_aggregate=3, entropy_weight=1e-3, baseline_decay=0.9)
    assert (enas.controller_hidden, enas.controller_every, enas.entropy_weight, enas.baseline_decay) == (16, 3, 1e-3, 0.9)
    assert nni2.TPEStrategy is nni2.TPE and isinstance(nni2.DARTS(), td.oneshot.DARTS)


# -- evaluators --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data() -> tuple[TensorDataset, TensorDataset]:
    return td.datasets.digits()


def test_lightning_classification_becomes_declarative(data) -> None:
    train, val = data
    ev = Classification(criterion=torch.nn.CrossEntropyLoss, learning_rate=0.05, weight_decay=1e-4,
                        optimizer=torch.optim.SGD, train_dataloaders=DataLoader(train, batch_size=32, shuffle=True),
                        val_dataloaders=[DataLoader(val, batch_size=128)], max_epochs=3, accelerator="cpu",
                        limit_train_batches=2, enable_progress_bar=False, num_classes=10, callbacks=[])
    cfg = ev.config()
    assert (cfg.epochs, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.weight_decay) == (3, 32, "sgd", 0.05, 1e-4)
    assert cfg.momentum == 0.0  # NNI builds SGD(params, lr, weight_decay): no momentum
    assert isinstance(cfg.train, Subset) and len(cfg.train) == 64 and cfg.val is val
    assert str(cfg.device) == "cpu" and ev.objective.metric == "val_acc" and ev.objective.mode == "max"
    fast = Classification(train_dataloaders=DataLoader(train, batch_size=16), val_dataloaders=DataLoader(val),
                          fast_dev_run=True).config()
    assert fast.epochs == 1 and len(fast.train) == 16 and len(fast.val) == 1
    assert Classification(train_dataloaders=DataLoader(train), val_dataloaders=DataLoader(val)).epochs == 1000  # Lightning's


def test_evaluator_fit_trains_the_model_in_place(data) -> None:
    """NNI's evaluator.fit(model): max_epochs epochs of the evaluator's training on the model itself."""
    train, val = data
    ev = Classification(learning_rate=1e-2, train_dataloaders=DataLoader(train, batch_size=64),
                        val_dataloaders=DataLoader(val, batch_size=128), max_epochs=3)
    torch.manual_seed(0)
    model = _Tiny().freeze({"width": 16})
    before = [p.detach().clone() for p in model.parameters()]
    metrics = ev.fit(model)
    assert set(metrics) == {"train_loss", "val_acc", "val_loss"} and metrics["val_acc"] > 0.12  # chance: 0.1
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.eval()
    with torch.no_grad():
        x, y = val.tensors
        assert float((model(x).argmax(1) == y).float().mean()) == pytest.approx(metrics["val_acc"], abs=1e-6)


def test_lightning_regression_becomes_declarative() -> None:
    ds = TensorDataset(torch.randn(40, 3), torch.randn(40))
    ev = Regression(train_dataloaders=DataLoader(ds, batch_size=8), val_dataloaders=DataLoader(ds), max_epochs=2,
                    criterion=torch.nn.L1Loss)
    assert ev.config().loss is not None and ev.loss == "l1" and ev.objective.metric == "val_mse"


@pytest.mark.parametrize("kwargs, name", [
    ({"callbacks": [object()]}, "callbacks"),
    ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
    ({"devices": 2}, "devices"),
    ({"precision": 16}, "precision"),
    ({"max_stepz": 10}, "max_stepz"),
    ({"optimizer": torch.optim.Adagrad}, "optimizer"),
    ({"datamodule": object()}, "datamodule"),
    ({"val_dataloaders": None}, "val_dataloaders"),
])
def test_lightning_arguments_tridens_cannot_honour_are_refused(data, kwargs: dict, name: str) -> None:
    train, val = data
    args = {"train_dataloaders": DataLoader(train, batch_size=32), "val_dataloaders": DataLoader(val), **kwargs}
    with pytest.raises(NotSupported, match=name):
        Classification(**args)


class _Tiny(td.ModelSpace):
    def __init__(self) -> None:
        super().__init__()
        w = td.choice("width", [8, 16])
        self.conv = torch.nn.Conv2d(1, w, 3, padding=1)
        self.fc = torch.nn.Linear(w, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def test_multi_trial_with_the_lightning_evaluator_exports_trained_instances(tmp_path: Path, data, monkeypatch) -> None:
    """The same compat evaluator drives a multi-trial search; 'instance' models carry their trial's weights."""
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "t.db"))
    train, val = data
    ev = Classification(learning_rate=1e-2, train_dataloaders=DataLoader(train, batch_size=64),
                        val_dataloaders=DataLoader(val, batch_size=64), max_epochs=1)
    exp = NasExperiment(_Tiny(), ev, nni3.GridSearch())
    exp.config.max_trial_number = 2
    exp.run()
    [best] = exp.experiment.top(1)
    [model] = exp.export_top_models(formatter="instance")
    model.eval()
    with torch.no_grad():
        x, y = val.tensors
        acc = float((model(x).argmax(1) == y).float().mean())
    assert acc == pytest.approx(best.metric, abs=1e-6)
    assert exp.export_top_models(formatter="dict") == [best.sample]
    with pytest.raises(NotSupported, match="formatter"):
        exp.export_top_models(formatter="code")


def test_oneshot_needs_the_declarative_evaluator(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "t.db"))
    exp = NasExperiment(_Tiny(), FunctionalEvaluator(lambda model: 0.5), nni3.DARTS())
    with pytest.raises(NotSupported, match="Classification, Regression or Lightning"):
        exp.run()
    assert not (tmp_path / "t.db").exists()


# -- NNI 2.x space and fixed_arch ------------------------------------------------------------------
@model_wrapper
class _Wrapped(rnn.Module):
    def __init__(self) -> None:
        super().__init__()
        w = rnn.ValueChoice([4, 8], label="w")
        self.conv = rnn.LayerChoice([rnn.Conv2d(1, w, 3, padding=1), rnn.Conv2d(1, w, 5, padding=2)], label="k")
        self.fc = rnn.Linear(w, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


def test_model_wrapper_makes_a_space_and_fixed_arch_builds_a_sample(tmp_path: Path) -> None:
    space = _Wrapped()
    assert isinstance(space, td.ModelSpace) and type(space).__qualname__ == "_Wrapped"
    assert set(space.search_space()) == {"w", "k"} and space.size() == 4
    with fixed_arch({"w": 8, "k": 1}):
        model = _Wrapped()
    assert model.conv.kernel_size == (5, 5) and model.fc.in_features == 8
    path = tmp_path / "arch.json"
    path.write_text(json.dumps({"w": 4, "k": 0}))
    with fixed_arch(path):
        assert _Wrapped().conv.out_channels == 4
    with model_context({"w": 4}), pytest.raises(td.InvalidSample, match="'k'"):
        _Wrapped()
    with pytest.raises(NotSupported, match="label"):
        rnn.ValueChoice([1, 2])


def test_fixed_arch_reads_nni_spellings_of_a_layer_choice() -> None:
    """NNI's SPOS architecture_final.json writes a list LayerChoice's index as a string; NNI 2.x's graph
    engine names a candidate layerchoice_{label}_{name}. A ValueChoice keeps its exact value."""
    with fixed_arch({"w": 8, "k": "1"}):
        assert _Wrapped().conv.kernel_size == (5, 5)
    with fixed_arch({"w": 4, "k": "layerchoice_k_0"}):
        assert _Wrapped().conv.kernel_size == (3, 3)
    with fixed_arch({"w": "8", "k": 0}), pytest.raises(td.InvalidSample, match="'w'"):
        _Wrapped()


def test_a_base_engine_run_exports_layer_choices_by_candidate_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    train, val = (Subset(part, [i for i, label in enumerate(part.labels.tolist()) if label < 2]) for part in td.datasets.digits())
    exp = RetiariiExperiment(_Wrapped(), Classification(train_dataloaders=DataLoader(train, batch_size=32),
                                                        val_dataloaders=DataLoader(val, batch_size=32), max_epochs=1),
                             [], nni2.Random())  # 0s and 1s: _Wrapped has two outputs
    config = RetiariiExeConfig("local")
    config.max_trial_number, config.execution_engine = 2, "base"
    exp.run(config)
    [arch] = exp.export_top_models(formatter="dict")
    assert arch["k"] in ("layerchoice_k_0", "layerchoice_k_1") and arch["w"] in (4, 8)
    with fixed_arch(arch):
        assert _Wrapped().conv.kernel_size == ((3, 3) if arch["k"].endswith("0") else (5, 5))
