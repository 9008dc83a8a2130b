"""``sys.exit()`` inside a trial on the in-process executor fails that trial, not the process."""

import sys

import pytest

import tridens as td
from tridens.engine._experiment import ExperimentFailed


def _exits_on_x_2(x):
    if x == 2:
        sys.exit(3)
    td.report({"value": float(x)}, step=0)
    return float(x)


def _search(db):
    evaluator = td.evaluators.FunctionalEvaluator(_exits_on_x_2, x=td.choice("x", [1, 2, 3, 4]))
    return td.Experiment(None, evaluator, td.strategy.GridSearch(), budget=4, store=str(db), name="exits",
                         executor=td.executors.Inline(), options=td.RunOptions(verbose=False))


def test_sys_exit_in_an_inline_trial_fails_that_trial_and_resume_does_not_loop(tmp_path):
    db = tmp_path / "t.db"
    exp = _search(db).run()
    by_x = {t.sample["x"]: t for t in exp.trials()}
    assert by_x[2].status is td.TrialStatus.FAILED
    assert "sys.exit(3)" in by_x[2].error.splitlines()[-1]
    assert all(by_x[x].status is td.TrialStatus.COMPLETED for x in (1, 3, 4))
    with pytest.raises(ExperimentFailed, match="sys.exit"):   # the rerun tries it once more, in this process
        _search(db).run()
    again = td.Experiment.load(str(db), "exits")
    assert [t.status for t in again.trials()] == [t.status for t in exp.trials()]
    assert len(again.trials()) == 4
