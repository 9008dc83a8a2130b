"""A group of new trials starts in waves when warm start is on, so later members start warm."""

import pytest

import tridens as td
from tridens.warmup import Zoo

from .spaces import DigitsMLP


def test_wave_sizes(tmp_path):
    zoo = Zoo(tmp_path / "z.db")
    assert zoo.waves(10) == [1, 1, 2, 4, 2]          # the group's started total doubles
    assert zoo.waves(1) == [1] and zoo.waves(0) == []
    assert zoo.waves(10, first=2) == [2, 2, 4, 2]     # a parallel executor: its workers first
    assert sum(zoo.waves(37, first=3)) == 37
    assert Zoo(tmp_path / "z.db", wave_growth=1).waves(3) == [1, 1, 1]
    assert Zoo(tmp_path / "z.db", wave_growth=None).waves(5) == [5]
    with pytest.raises(ValueError, match="'wave_growth' parameter of Zoo"):
        Zoo(tmp_path / "z.db", wave_growth=0.5)


def _initial_group(tmp_path, digits_data, warm_start):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    strategy = td.strategy.RegularizedEvolution(population=4, sample_size=2, batch_size=1)
    exp = td.Experiment(DigitsMLP(), ev, strategy, budget=4, store=tmp_path / "w.db", name="w",
                        options=td.RunOptions(warm_start=warm_start, verbose=False))
    exp.run()
    return [t for t in exp.trials() if t.status is td.TrialStatus.COMPLETED]


def test_initial_group_runs_in_waves_and_later_members_start_warm(tmp_path, digits_data):
    trials = _initial_group(tmp_path, digits_data, True)
    assert len({t.group for t in trials}) == 1        # still one TrialGroup
    assert trials[0].parent is None
    later = trials[1:]
    assert later and all(t.parent is not None and t.parent < t.id for t in later), [t.info for t in trials]
    # a wave is instantiated only after the previous one finished: a parent finished before its child started
    by_id = {t.id: t for t in trials}
    assert all(by_id[t.parent].finished_at <= t.started_at for t in later)


def test_no_waves_when_turned_off(tmp_path, digits_data):
    zoo = Zoo(tmp_path / "w.db", wave_growth=None)
    trials = _initial_group(tmp_path, digits_data, zoo)
    assert trials and all(t.parent is None and t.info["warm_start"]["reason"] == "the zoo is empty" for t in trials)
    assert len(Zoo(tmp_path / "w.db")) == len(trials)   # all of them entered the zoo afterwards
