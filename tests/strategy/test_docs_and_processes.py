from __future__ import annotations

import doctest
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import tridens.strategy

from .harness import Bench, mixed_space, run
from .test_conformance import STRATEGIES

MODULES = sorted(p.stem for p in pathlib.Path(tridens.strategy.__file__).parent.glob("_*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    result = doctest.testmod(importlib.import_module(f"tridens.strategy.{module}"))
    assert result.failed == 0


def test_public_names() -> None:
    assert sorted(tridens.strategy.__all__) == sorted(
        ["Strategy", "Random", "GridSearch", "RegularizedEvolution", "TPE", "Hyperband", "BOHB", "ASHA",
         "SS", "AsyncSS", "BOSS", "MedianStopping", "PBT", "Constraint", "pareto_front", "best_first"])


SCRIPT = """
import sys
from tests.strategy.harness import Bench, mixed_space, run
from tests.strategy.test_conformance import STRATEGIES
for name in sys.argv[1:]:
    print(repr(run(STRATEGIES[name](), Bench(mixed_space()), seed=11, max_trials=24).signature()))
"""


def test_same_search_in_another_process() -> None:
    """A resumed experiment runs in a new process (another hash seed): the search must not change."""
    names = ["evolution", "tpe", "bohb", "asha", "boss", "async-ss", "pbt"]
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, *names], cwd=root, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    here = [repr(run(STRATEGIES[n](), Bench(mixed_space()), seed=11, max_trials=24).signature()) for n in names]
    assert out == here
