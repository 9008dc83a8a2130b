"""PBT through the engine on real data: exploits are forks of running members (fused or not),
their hyperparameters change mid-training, the lineage survives the store, a schedule replayed
alone reports what its trials reported, and a killed run resumes to the uninterrupted result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rich.console import Console

import tridens as td
from tridens._views import trial_details
from tridens.store import Store
from tridens.trial import Trial, TrialStatus
from tridens.units import Job, SeparateUnit

from .pbt_script import MLP, evaluator

SCRIPT = Path(__file__).parent / "pbt_script.py"


@pytest.fixture(scope="module")
def ev():
    return evaluator()


def lineage_metrics(trials: dict[int, Trial], trial: Trial, metric: str = "val_acc") -> list[float]:
    """Per epoch, what the trial that trained that epoch of ``trial``'s weights reported."""
    schedule = trial.schedule()
    out = []
    for epoch in range(len(trial.metrics[metric])):
        stage = [s for s in schedule.stages if s.epoch <= epoch][-1]
        out.append(trials[stage.trial].metrics[metric][epoch])
    return out


@pytest.mark.parametrize("optimize", [True, False], ids=["fused", "separate"])
def test_exploits_are_recorded_and_replay_alone(tmp_path, ev, optimize):
    db = tmp_path / "pbt.db"
    exp = td.Experiment(MLP(), ev, td.strategy.PBT(population=6, interval=2), budget=6,
                        options=td.RunOptions(seed=0, verbose=False), store=db, name="pbt",
                        executor=td.executors.Inline(optimize=optimize))
    exp.run()
    if optimize:  # the population started as one vectorized unit
        assert {t.info["unit"]["kind"] for t in exp.trials()} == {"batched"}
    trials = {t.id: t for t in td.Experiment.load(db, "pbt").trials()}   # everything read back from the store
    assert all(t.status is TrialStatus.COMPLETED and len(t.metrics["val_acc"]) == 6 for t in trials.values())
    forked = [t for t in trials.values() if t.info.get("exploits")]
    assert forked
    for t in forked:
        for exploit in t.info["exploits"]:
            assert exploit["epoch"] in (2, 4) and exploit["from"] in trials and exploit["from"] != t.id
        # the schedule: the source's stages before the exploit, then the explored sample
        last = t.info["exploits"][-1]
        assert t.schedule()(last["epoch"]) == last["sample"] != t.sample
        assert t.schedule().stages[-1].trial == t.id
    shown = Console(width=200, record=True)  # tridens show NAME N
    for renderable in trial_details(forked[0], list(trials.values()), ev.objective):
        shown.print(renderable)
    first = forked[0].info["exploits"][0]
    assert f"at epoch {first['epoch']} copied #{trials[first['from']].number}" in shown.export_text()
    for t in forked[:2] + [max(trials.values(), key=lambda t: t.metric)]:
        curve = td.evaluators.replay(ev, MLP(), t)
        expected = lineage_metrics(trials, t)
        assert [m["val_acc"] for m in curve] == pytest.approx(expected, abs=1e-6)
        assert curve[-1]["val_acc"] == pytest.approx(t.metric, abs=1e-6)


def test_a_forked_member_trains_with_its_new_momentum_and_weight_decay(ev):
    sample = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
    torch.manual_seed(0)
    unit = SeparateUnit([Job(Trial(id=1, sample=sample, seed=0), MLP())], ev)
    unit.train_epoch()
    moved = {"lr": 0.02, "momentum": 0.5, "weight_decay": 1e-3}
    torch.manual_seed(1)
    unit.fork(1, Job(Trial(id=2, sample=dict(sample), seed=1), MLP(), hparams=moved))
    group = unit.trainers[2].optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 1e-3)
    assert unit.trainers[1].optimizer.param_groups[0]["momentum"] == 0.9
    after = unit.train_epoch()
    assert unit.trainers[2].optimizer.param_groups[0]["lr"] == 0.02 and after[1] != after[2]


def test_refused_at_start_where_members_cannot_fork(tmp_path, ev):
    strategy = td.strategy.PBT(population=2)
    with pytest.raises(ValueError, match="PBT forks running trials .* declarative evaluator"):
        td.Experiment(None, td.evaluators.FunctionalEvaluator(lambda x: x, x=td.uniform("x", 0, 1)), strategy,
                      store=tmp_path / "b.db", options=td.RunOptions(verbose=False)).run()


def _trials(db):
    with Store(db, readonly=True) as store:
        return [(t.sample, t.status.value, t.metrics.get("val_acc"), t.info.get("exploits"))
                for t in store.trials("pbt")]


@pytest.mark.parametrize("executor", ["inline", pytest.param("process", marks=pytest.mark.slow),
                                      pytest.param("ray", marks=pytest.mark.slow)])
def test_a_killed_pbt_run_resumes_to_the_uninterrupted_result(tmp_path, executor):
    whole = tmp_path / "whole.db"
    subprocess.run([sys.executable, str(SCRIPT), str(whole), "0", executor], check=True, timeout=300)
    killed = tmp_path / "killed.db"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(killed), "0.05", executor],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # inside the second population, after its first exploit
        time.sleep(0.05)
        try:
            with Store(killed, readonly=True) as store:
                trials = store.trials("pbt")
        except Exception:  # the store is being created
            continue
        second = [t for t in trials if t.group == 1]
        if sum(t.status is TrialStatus.COMPLETED for t in trials) >= 4 and any(t.info.get("exploits") for t in second):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sum(status == "completed" for _, status, _, _ in _trials(killed))
    assert 4 <= done < 8, done
    subprocess.run([sys.executable, str(SCRIPT), str(killed), "0", executor], check=True, timeout=300)
    assert _trials(killed) == _trials(whole)
