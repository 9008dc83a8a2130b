"""Run every example as a real subprocess, as a user would, and check what it prints and stores.

Each example trains a handful of tiny models on 8x8 digits (a few seconds each). The examples
run with one intra-op thread (``OMP_NUM_THREADS=1``): on a shared 2-core machine two threads per
process only make them slower and less steady.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

import tridens as td

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = ("hello_nas.py", "mutator_depthwise.py", "mutator_batchnorm.py", "darts_cell.py")


@dataclasses.dataclass
class Run:
    """One finished example run: its stdout, its store (None without --store), its directories."""

    stdout: str
    store: Path | None
    cwd: Path
    tmpdir: Path

    def trials(self, name: str) -> list[td.Trial]:
        assert self.store is not None and self.store.exists(), f"--store {self.store} was not used"
        return td.Experiment.load(self.store, name).trials()

    def assert_left_nothing(self) -> None:
        """Nothing in the working directory, no tridens temporary directory left behind."""
        assert list(self.cwd.iterdir()) == []
        assert [p.name for p in self.tmpdir.iterdir() if p.name.startswith("tridens-")] == []


def _run(script: str, args: list[str], root: Path, with_store: bool) -> Run:
    cwd, tmpdir = root / "cwd", root / "tmp"
    cwd.mkdir(parents=True)
    tmpdir.mkdir()
    store = root / "store.db" if with_store else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir)}
    command = [sys.executable, str(EXAMPLES / script), *args] + (["--store", str(store)] if store else [])
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return Run(proc.stdout, store, cwd, tmpdir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """Every example run, two at a time (the machine has two cores), started once for the module.
    Each runs in an empty working directory with its own TMPDIR."""
    jobs = {script: ([], True) for script in SCRIPTS}
    jobs["default_store"] = (["--trials", "2"], False)
    jobs["hub_search.py"] = (["--trials", "3", "--epochs", "1"], True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(_run, "mutator_batchnorm.py" if key == "default_store" else key, args,
                                    tmp_path_factory.mktemp(key.removesuffix(".py")), store)
                   for key, (args, store) in jobs.items()}
        yield futures


def test_hello_nas(runs: dict[str, Future[Run]]) -> None:
    run = runs["hello_nas.py"].result()
    out = run.stdout
    assert "conv2    ['conv3x3', 'depthwise_separable']" in out
    assert "dropout  [0.25, 0.5, 0.75]" in out
    assert "top trials of 4" in out
    ranks = re.findall(r"^  ([123]) +(0\.\d{3})  [0-9a-f]{12}  \{'conv2'", out, re.M)
    assert [r for r, _ in ranks] == ["1", "2", "3"]
    accs = [float(a) for _, a in ranks]
    assert accs == sorted(accs, reverse=True)
    assert re.search(r"^best: (conv3x3|depthwise_separable) conv2, dropout 0\.\d+, \d+ features, lr 0\.00\d: "
                     r"val_acc 0\.\d{3}$", out, re.M)
    trials = run.trials("hello-nas")
    assert len(trials) == 4 and all(t.status.finished for t in trials)
    run.assert_left_nothing()


def test_mutator_depthwise(runs: dict[str, Future[Run]]) -> None:
    run = runs["mutator_depthwise.py"].result()
    out = run.stdout
    assert out.count("history: ToDepthwiseSeparable") == 4
    assert "decided {'conv2.kind': 'depthwise_separable', 'conv3.kind': 'conv'}" in out
    models = re.findall(r"params +(\d+)  fingerprint ([0-9a-f]{12})  prefix fingerprint of conv1 ([0-9a-f]{12})", out)
    assert len(models) == 4
    assert len({fp for _, fp, _ in models}) == 4          # four different models
    assert len({prefix for _, _, prefix in models}) == 1  # one shared first convolution
    assert int(models[0][0]) > int(models[-1][0])         # depthwise-separable convs have fewer parameters
    assert "freezing the last sample again gives the same fingerprint: True" in out
    assert "trained 4 models for 1 epoch(s)" in out
    assert len(run.trials("mutator-depthwise")) == 4
    run.assert_left_nothing()


def test_mutator_batchnorm(runs: dict[str, Future[Run]]) -> None:
    run = runs["mutator_batchnorm.py"].result()
    out = run.stdout
    assert "search space: width [16, 32], bn.conv1 [False, True], bn.conv2 [False, True]" in out
    assert re.search(r"%batch_norm2d : BatchNorm2d\(16, .*\(%conv1\)$", out, re.M)
    assert re.search(r"%batch_norm2d_1 : BatchNorm2d\(16, .*\(%conv2\)$", out, re.M)
    assert ("mutation history: [('inline', {'width': 16}), "
            "('AddBatchNorm', {'bn.conv1': True, 'bn.conv2': True})]") in out
    assert "4 trials, best first:" in out
    assert len(re.findall(r"^  val_acc 0\.\d{3}  width (16|32)  BatchNorm after: ", out, re.M)) == 4
    assert len(run.trials("mutator-batchnorm")) == 4
    run.assert_left_nothing()


def test_darts_cell(runs: dict[str, Future[Run]]) -> None:
    run = runs["darts_cell.py"].result()
    out = run.stdout
    assert "DARTS cell space: 12 labels, 1679616 genotypes" in out
    assert "4 trials, best first:" in out
    assert "best genotype (val_acc" in out
    nodes = re.findall(r"^  node (\d) = (\w+)\((input|node \d)\) \+ (\w+)\((input|node \d)\)$", out, re.M)
    assert [n[0] for n in nodes] == ["1", "2", "3"]          # numbered after the input, as NNI does
    for node, _, left, _, right in nodes:                     # each reads the input or an earlier node
        assert all(src == "input" or int(src.split()[1]) < int(node) for src in (left, right))
    assert len(run.trials("darts-cell")) == 4
    run.assert_left_nothing()


def test_default_store_is_temporary(runs: dict[str, Future[Run]]) -> None:
    """Without --store an example keeps its store in a temporary directory and removes it."""
    run = runs["default_store"].result()
    assert "2 trials, best first:" in run.stdout
    run.assert_left_nothing()


def test_hub_search(runs: dict[str, Future[Run]]) -> None:
    """examples/hub_search.py on a small budget: the hub's DARTS space searched by evolution, the
    three best cells printed as genotypes (two (op, input) pairs per node, inputs earlier states)."""
    run = runs["hub_search.py"].result()
    out = run.stdout
    assert "td.hub.DARTS: 32 labels, " in out
    accs = [float(a) for a in re.findall(r"^  [123]\. val_acc (0\.\d{3}|1\.000)$", out, re.M)]
    assert len(accs) == 3 and accs == sorted(accs, reverse=True) and accs[0] > 0.3  # 10 classes, one epoch
    for kind in ("normal", "reduce"):
        cells = re.findall(rf"^     {kind}: (\[.*\])$", out, re.M)
        assert len(cells) == 3
        for cell in cells:
            pairs = ast.literal_eval(cell)  # node n = 2 + i // 2 reads one of the states 0 .. n - 1
            assert len(pairs) == 8 and all(op in td.hub.OPS and 0 <= src < 2 + i // 2 for i, (op, src) in enumerate(pairs))
    trials = run.trials("hub-evolution")
    assert len(trials) == 3 and all(t.status.finished for t in trials)
    run.assert_left_nothing()
