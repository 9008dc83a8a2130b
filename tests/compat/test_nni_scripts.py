"""NNI 2.10's own example scripts, end to end, as a user would run them on tridens: read from the NNI
snapshot (skipped without one), their ``nni`` imports rewritten to ``tridens.compat.nni`` and their
``torchvision`` / ``graphviz`` imports to the offline stand-ins in ``standins/`` -- and, where a
script needs what this machine lacks, only that changed: no GPU (``gpus=0``, ``cuda=False``,
``model.cuda()`` left out), no downloads (``pretrained=False``). Each runs with the fewest epochs its
own arguments allow. Slow: minutes each on two shared cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tridens.store import Store
from tridens.trial import TrialStatus

from . import _upstream

pytestmark = pytest.mark.slow


def _edit(path: Path, *changes: tuple[str, str]) -> None:
    """Replace each ``old`` of ``changes`` in the file (every occurrence; it must be there)."""
    text = path.read_text()
    for old, new in changes:
        assert old in text, f"{old!r} is not in {path.name}"
        text = text.replace(old, new)
    path.write_text(text)


def _run(folder: Path, script: str, *args: str, timeout: int = 900, check: bool = True,
         **env: str) -> tuple[subprocess.CompletedProcess[str], list]:
    db = folder / "nni.db"
    done = subprocess.run([sys.executable, script, *args], cwd=folder, capture_output=True, text=True,
                          timeout=timeout, env=_upstream.script_env(db, MPLBACKEND="Agg", **env))
    if check:
        assert done.returncode == 0, done.stderr[-4000:]
    with Store(db, readonly=True) as store:
        trials = [t for e in store.experiments() for t in store.trials(e.name)]
    return done, trials


def test_nni2_hello_nas_tutorial(tmp_path: Path) -> None:
    """examples/tutorials/hello_nas.py: a FunctionalEvaluator training on MNIST, Random(dedup=True), 4 trials."""
    folder = _upstream.example(tmp_path, "examples/tutorials", ["hello_nas.py"])
    done, trials = _run(folder, "hello_nas.py")
    assert len(trials) == 4 and all(t.status == TrialStatus.COMPLETED for t in trials)
    assert all(t.metric > 50 for t in trials)  # accuracy in percent, as NNI's script reports it
    assert "{'layerchoice_1':" in done.stdout  # export_top_models(formatter='dict') printed


def test_nni2_mnist_search(tmp_path: Path) -> None:
    """examples/nas/multi-trial/mnist/search.py: 20 trials asked, the space has 18 models; Random stops there."""
    folder = _upstream.example(tmp_path, "examples/nas/multi-trial/mnist", ["search.py"])
    done, trials = _run(folder, "search.py")
    assert len(trials) == 18 and len({tuple(sorted(t.sample.items())) for t in trials}) == 18
    assert all(t.status == TrialStatus.COMPLETED for t in trials)
    assert "Final model:" in done.stdout


def test_nni2_spos_supernet(tmp_path: Path) -> None:
    """examples/nas/oneshot/spos/supernet.py: NNI's ShuffleNetV2OneShot under SinglePathTrainer, one
    epoch of batches of 16 (its --epochs / --batch-size), ImageNet-sized stand-in images."""
    folder = _upstream.example(tmp_path, "examples/nas/oneshot/spos",
                               ["supernet.py", "network.py", "blocks.py", "utils.py"])
    _edit(folder / "supernet.py", ("    model.cuda()\n", "    pass  # no GPU here\n"))
    _, trials = _run(folder, "supernet.py", "--epochs", "1", "--batch-size", "16", "--workers", "0",
                     TRIDENS_STANDIN_SIZE="64,32")
    roles = {t.info["oneshot"]["role"] for t in trials}
    assert roles >= {"supernet", "subnet"} and all(t.status == TrialStatus.COMPLETED for t in trials)
    subnets = [t for t in trials if t.info["oneshot"]["role"] == "subnet"]
    assert subnets and all(len(t.sample) == 20 for t in subnets)  # NNI's 20 LayerChoices


def test_nni2_spos_evolution_search(tmp_path: Path) -> None:
    """examples/nas/oneshot/spos/search.py: RegularizedEvolution over NNI's ShuffleNetV2OneShot with its
    FunctionalEvaluator (BN recalibration, AverageMeterGroup), execution_engine='base' and dummy_input;
    3 cycles of populations of 2 (its arguments). Without a GPU, nn_meter (used only by
    --latency-filter) or SPOS's downloaded checkpoint: those lines left out, an empty checkpoint file."""
    folder = _upstream.example(tmp_path, "examples/nas/oneshot/spos", ["search.py", "network.py", "blocks.py", "utils.py"])
    _edit(folder / "search.py",
          ("from nn_meter import load_latency_predictor\n", "load_latency_predictor = None  # nn_meter: not installed\n"),
          ("inputs.to('cuda'), targets.to('cuda')", "inputs, targets"), ("    model.cuda()\n", "    pass  # no GPU here\n"),
          ("    assert torch.cuda.is_available()\n", ""))
    (folder / "data").mkdir()
    torch.save({"state_dict": {}}, folder / "data" / "checkpoint-150000.pth.tar")
    done, trials = _run(folder, "search.py", "--workers", "0", "--train-batch-size", "16", "--test-batch-size", "16",
                        "--train-iters", "2", "--evolution-sample-size", "2", "--evolution-population-size", "2",
                        "--evolution-cycles", "3", TRIDENS_STANDIN_SIZE="64,32")
    assert len(trials) == 3 and all(t.status == TrialStatus.COMPLETED for t in trials)
    arch = json.loads((folder / "architecture_final_0.json").read_text())  # NNI's get_archchoice_by_model
    assert len(arch) == 20 and all(v in ("0", "1", "2", "3") for v in arch.values())
    assert "'LayerChoice1': 'layerchoice_LayerChoice1_" in done.stdout  # the graph engine's candidate names


def test_nni2_darts_tutorial(tmp_path: Path) -> None:
    """examples/tutorials/darts.py with its own fast_dev_run=True, to its end: the searched DARTS-V2 model
    evaluated (untrained: nothing is downloaded), DartsSpace(16, 8) searched by DARTS, the exported cells
    drawn, the chosen model retrained by evaluator.fit; then the one-shot search with its own
    DartsClassificationModule (a custom LightningModule) under Lightning and DartsStrategy(gradient_clip_val=5.),
    and the final DARTS model (auxiliary head, drop path, cutout) retrained by that module."""
    folder = _upstream.example(tmp_path, "examples/tutorials", ["darts.py"])
    _edit(folder / "darts.py", ("pretrained=True, download=True", "pretrained=False"),
          ("evaluate_model(darts_v2_model, cuda=True)", "evaluate_model(darts_v2_model, cuda=False)"),
          ("gpus=1", "gpus=0"))
    done, trials = _run(folder, "darts.py", timeout=1800)
    assert "Accuracy:" in done.stdout
    roles = {t.info["oneshot"]["role"] for t in trials}
    assert roles == {"supernet", "subnet"} and all(t.status == TrialStatus.COMPLETED for t in trials)
    supernets = [t for t in trials if t.info["oneshot"]["role"] == "supernet"]
    assert len(supernets) == 2  # the Classification search and the module's
    # each exported its argmax, as NNI's DARTS does: the one subnet scored (fast_dev_run too)
    subnets = [t for t in trials if t.info["oneshot"]["role"] == "subnet"]
    assert sorted(map(str, (t.sample for t in subnets))) == sorted(str(s.info["oneshot"]["argmax"]) for s in supernets)
    [searched] = [t for t in supernets if t.info["oneshot"].get("lightning") == "DartsClassificationModule"]
    assert searched.info["oneshot"]["steps"] == 1 and {"train_loss", "lr"} <= set(searched.metrics)


def test_nni2_oneshot_darts_search(tmp_path: Path) -> None:
    """examples/nas/oneshot/darts/search.py as written, its 2.x branch (no --v1): NNI's CNN (a plain
    torch.nn.Module with LayerChoice / InputChoice) under DartsTrainer, CIFAR-10 through its own
    datasets.py (the stand-in's images), one epoch of a 3-layer, 4-channel network; its top-level
    import of NNI 1.x's callbacks (used only by --v1) resolves. It prints and saves trainer.export()."""
    folder = _upstream.example(tmp_path, "examples/nas/oneshot/darts",
                               ["search.py", "datasets.py", "model.py", "ops.py", "utils.py"])
    done, trials = _run(folder, "search.py", "--epochs", "1", "--layers", "3", "--channels", "4", "--batch-size", "16")
    arch = json.loads((folder / "checkpoint.json").read_text())
    assert f"Final architecture: {arch}" in done.stdout
    # layers 3: one normal cell, two reduction cells; each cell's nodes 2..5 choose an op per input, two inputs
    ops = {"maxpool", "avgpool", "skipconnect", "sepconv3x3", "sepconv5x5", "dilconv3x3", "dilconv5x5"}
    assert set(arch) == {f"{cell}_n{n}_{key}" for cell in ("normal", "reduce") for n in range(2, 6)
                         for key in [f"p{i}" for i in range(n)] + ["switch"]}
    assert all(arch[k] in ops for k in arch if not k.endswith("switch"))
    assert all(len(arch[k]) == 2 and len(set(arch[k])) == 2 for k in arch if k.endswith("switch"))
    roles = {t.info["oneshot"]["role"] for t in trials}
    assert roles == {"supernet", "subnet"} and all(t.status == TrialStatus.COMPLETED for t in trials)
    [subnet] = [t for t in trials if t.info["oneshot"]["role"] == "subnet"]
    assert subnet.sample == arch  # the argmax exported is the subnet scored


def test_nni2_nasbench201_network(tmp_path: Path) -> None:
    """examples/nas/multi-trial/nasbench201/network.py: NNI's NasBench201 space (NasBench201Cell) under
    Random, its own NasBench201TrainingModule (a custom LightningModule, RMSprop and cosine schedule)
    through pl.Lightning, CIFAR-100 the stand-in's images, --epochs 1. Two lines are not the script's
    as written, both for reasons outside tridens: timm (not installed here; it needs torchvision) gives
    RMSpropTF, here torch's RMSprop; and torchmetrics 0.11 and later refuse ``Accuracy()`` without
    ``task=``. The script's candidates are lambdas in a comprehension that all read the loop variable
    at call time, so every choice builds 'avg_pool_3x3' (in NNI too): every sample is one model, and
    tridens records the repeats as duplicates of the trained ones and stops when Random finds no new model."""
    folder = _upstream.example(tmp_path, "examples/nas/multi-trial/nasbench201", ["network.py", "base_ops.py"])
    _edit(folder / "network.py", ("from timm.optim import RMSpropTF\n", "from torch.optim import RMSprop as RMSpropTF\n"),
          ("AccuracyWithLogits()", "AccuracyWithLogits(task='multiclass', num_classes=100)"), ("gpus=1", "gpus=0"))
    done, trials = _run(folder, "network.py", "--epochs", "1", "--batch_size", "64", TRIDENS_STANDIN_SIZE="128,64")
    trained = [t for t in trials if t.status != TrialStatus.DUPLICATE]
    assert trained and all(t.status == TrialStatus.COMPLETED and t.metric is not None for t in trained)
    assert all(set(t.sample) == {f"cell/{j}_{i}" for j in range(1, 4) for i in range(j)} for t in trials)
    assert len({t.fingerprint for t in trials}) == 1  # NNI's file: every candidate is avg_pool_3x3
    assert all(t.info["duplicate_of"] in {u.id for u in trained} for t in trials if t.status == TrialStatus.DUPLICATE)
    assert "the space is exhausted" in done.stdout + done.stderr
