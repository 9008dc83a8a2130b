"""NNI's one-shot test space "multi-head attention" (a choice of ``embed_dim`` into
``nn.MultiheadAttention``) under NNI's one-shot strategies, as a real subprocess on digits."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tridens.trial import TrialStatus

from .test_nni_oneshot import _role, _script, _trials


def _check(stdout: str, db: Path, argmax: bool = False) -> dict:
    """``argmax``: a DARTS-style strategy, whose export (as NNI's) is its argmax, the one subnet scored."""
    arch = ast.literal_eval(re.search(r"^exported: (.*)$", stdout, re.M).group(1))
    [(label, width)] = arch.items()
    assert width in (32, 64)
    embed, rows, cols = re.search(r"final model: embed_dim (\d+) in_proj_weight \((\d+), (\d+)\)", stdout).groups()
    assert (int(embed), int(rows), int(cols)) == (width, 3 * width, width)  # fixed_arch builds the exported width
    trials = _trials(db)
    [supernet] = [t for t in trials if _role(t) == "supernet"]
    assert supernet.status is TrialStatus.COMPLETED and len(supernet.metrics["train_loss"]) == 1  # max_epochs=1
    subnets = [t for t in trials if _role(t) == "subnet" and t.status is TrialStatus.COMPLETED]
    if argmax:
        assert [t.sample for t in subnets] == [arch] == [supernet.info["oneshot"]["argmax"]]
    else:
        assert {t.sample[label] for t in subnets} == {32, 64}  # both widths scored with the supernet's weights
    assert all(t.info["oneshot"]["inherited"] and "val_mse" in t.metrics for t in subnets)
    return {"arch": arch, "supernet": supernet, "label": label}


def test_nni2_attention_space_under_darts(tmp_path: Path) -> None:
    stdout, db = _script("attention_nni2.py", "darts", tmp_path)
    found = _check(stdout, db, argmax=True)
    probabilities = found["supernet"].info["oneshot"]["probabilities"]
    assert len(probabilities[found["label"]]) == 2  # DARTS learned a weight per candidate width


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["enas", "random", "gumbel"])
def test_nni2_attention_space_under_other_strategies(tmp_path: Path, strategy: str) -> None:
    _check(*_script("attention_nni2.py", strategy, tmp_path), argmax=strategy == "gumbel")
