"""The store's API on real SQLite files: experiments, trials, metrics, checkpoints, transactions."""

from __future__ import annotations

import math
import os
import pickle
import sqlite3
import threading

import numpy as np
import pytest
import torch

from tridens.errors import StoreError, TridensError
from tridens.store import ExperimentRecord, Store
from tridens.trial import Trial, TrialStatus


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "tridens.db")
    s.create_experiment("exp", {"space": "models:Net", "max_trials": 8, "seed": 0})
    yield s
    s.close()


def new_trial(**kw) -> Trial:
    return Trial(id=-1, sample=kw.pop("sample", {"width": 32, "op": 1}), seed=kw.pop("seed", 0), **kw)


# -- experiments ----------------------------------------------------------------------------------

def test_experiments_create_get_list_update(tmp_path):
    with Store(tmp_path / "t.db") as s:
        a = s.create_experiment("a", {"space": "pkg.mod:Net", "evaluator": {"type": "Classification",
                                      "params": {"lr": 0.1}}, "max_trials": 4, "seed": 1, "extra": [1, None]})
        assert isinstance(a, ExperimentRecord) and a.status == "created" and a.created_at == a.updated_at
        s.create_experiment("b")
        assert [e.name for e in s.experiments()] == ["a", "b"]
        assert s.get_experiment("a").config["evaluator"]["params"] == {"lr": 0.1}
        u = s.update_experiment("a", status="running")
        assert u.status == "running" and u.config == a.config and u.updated_at >= a.updated_at
        u = s.update_experiment("a", config={"max_trials": 5})
        assert u.config == {"max_trials": 5} and u.status == "running"
    with Store(tmp_path / "t.db") as s:  # persisted
        assert s.get_experiment("a").config == {"max_trials": 5}


def test_experiment_errors(store):
    with pytest.raises(StoreError, match=r"experiment 'exp' already exists in the store .*tridens\.db"):
        store.create_experiment("exp")
    assert store.create_experiment("exp", {"other": 1}, exist_ok=True).config["max_trials"] == 8
    with pytest.raises(StoreError, match=r"no experiment 'nope' in the store .*tridens\.db \(it holds: 'exp'\)"):
        store.get_experiment("nope")
    with pytest.raises(StoreError, match="no experiment 'nope'"):
        store.update_experiment("nope", status="done")
    with pytest.raises(StoreError, match="no experiment 'nope'"):
        store.add_trial("nope", new_trial())
    for bad in ["", "a/b", "../x", ".hidden", "-x", "a" * 129, 3]:
        with pytest.raises(ValueError, match="experiment name"):
            store.create_experiment(bad)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match=r"config of experiment 'x'.*object value .* is not JSON"):
        store.create_experiment("x", {"model": object()})
    assert issubclass(StoreError, TridensError)


# -- trials and metrics -----------------------------------------------------------------------------

def test_trial_round_trip_every_field(store, tmp_path):
    store.create_experiment("other")
    t = store.add_trial("exp", new_trial(seed=7, fingerprint="abc", group=2, max_steps=9,
                                         info={"params": 1234, "flops": 5.5e6}, started_at=10.0))
    assert t.id == 1 and t.experiment == "exp"
    child = store.add_trial("exp", new_trial(sample={"width": 64, "lr": 0.01, "act": "relu", "nested": [1, 2]},
                                             parent=t.id))
    assert child.id == 2
    assert store.add_trial("other", new_trial()).id == 3  # ids are unique in the whole store
    t.status, t.metric, t.finished_at, t.error = TrialStatus.FAILED, 0.25, 12.5, "Traceback ...\nValueError: x"
    store.update_trial(t)
    with Store(tmp_path / "tridens.db") as again:
        got = again.trials("exp")
    assert [x.id for x in got] == [1, 2]
    a, b = got
    assert (a.sample, a.seed, a.fingerprint, a.group, a.max_steps) == ({"width": 32, "op": 1}, 7, "abc", 2, 9)
    assert a.info == {"params": 1234, "flops": 5.5e6}
    assert (a.status, a.metric, a.started_at, a.finished_at, a.duration) == (TrialStatus.FAILED, 0.25, 10.0, 12.5, 2.5)
    assert a.error.endswith("ValueError: x") and a.experiment == "exp" and a.parent is None
    assert b.sample == {"width": 64, "lr": 0.01, "act": "relu", "nested": [1, 2]} and b.parent == 1
    assert b.status is TrialStatus.PENDING and b.metric is None and b.metrics == {} and b.checkpoint is None
    assert store.trial(2).sample == b.sample


def test_metrics_per_step_ordered_and_replaced(store):
    t = store.add_trial("exp", new_trial())
    store.add_metrics(t.id, 2, {"val_acc": 0.3})
    store.add_metrics(t.id, 0, {"val_acc": 0.1, "loss": 2.0})
    store.add_metrics(t.id, 1, {"val_acc": 0.2, "loss": 1.5})
    store.add_metrics(t.id, 1, {"val_acc": 0.25})  # a step written again replaces its value
    got = store.trial(t.id)
    assert got.metrics == {"loss": [2.0, 1.5], "val_acc": [0.1, 0.25, 0.3]}
    assert got.steps == 3


def test_nan_and_inf_metrics_read_back(store):
    t = store.add_trial("exp", new_trial())
    store.add_metrics(t.id, 0, {"loss": float("nan"), "val_acc": float("inf")})
    store.add_metrics(t.id, 1, {"loss": np.float32("nan"), "val_acc": torch.tensor(-math.inf)})
    t.metric, t.status = float("nan"), TrialStatus.FAILED
    store.update_trial(t)
    u = store.add_trial("exp", new_trial())  # no metric yet: None, not NaN
    got, other = store.trials("exp")
    assert all(math.isnan(v) for v in got.metrics["loss"])
    assert got.metrics["val_acc"] == [math.inf, -math.inf]
    assert math.isnan(got.metric) and other.metric is None and other.id == u.id


def test_metric_errors_name_trial_and_value(store):
    t = store.add_trial("exp", new_trial())
    with pytest.raises(StoreError, match=r"metric 'acc' of trial 1 at step 0 must be a number, got 'high'"):
        store.add_metrics(t.id, 0, {"acc": "high"})
    with pytest.raises(StoreError, match=r"no trial with id 99 in the store .*tridens\.db"):
        store.add_metrics(99, 0, {"acc": 0.5})
    with pytest.raises(StoreError, match="no trial with id 99"):
        store.update_trial(Trial(id=99, sample={}, seed=0))
    with pytest.raises(StoreError, match="parent trial 42 is not in the store"):
        store.add_trial("exp", new_trial(parent=42))
    with pytest.raises(StoreError, match=r"cannot write the sample .*object value .* is not JSON"):
        store.add_trial("exp", new_trial(sample={"act": object()}))
    assert [x.id for x in store.trials("exp")] == [1]  # failed writes left nothing behind


def test_add_trial_with_metrics_and_numpy_values(store):
    t = store.add_trial("exp", new_trial(sample={"width": np.int64(16), "lr": np.float32(0.5)},
                                         metrics={"val_acc": [0.1, 0.2]}, status=TrialStatus.DUPLICATE, metric=0.2))
    got = store.trial(t.id)
    assert got.sample == {"width": 16, "lr": 0.5} and got.metrics == {"val_acc": [0.1, 0.2]}
    assert got.status is TrialStatus.DUPLICATE


def test_trials_filtered_by_status(store):
    for i in range(4):
        t = store.add_trial("exp", new_trial(seed=i))
        if i % 2:
            t.status = TrialStatus.COMPLETED
            store.update_trial(t)
    assert [t.seed for t in store.trials("exp", status="completed")] == [1, 3]
    assert [t.seed for t in store.trials("exp", status=TrialStatus.PENDING)] == [0, 2]


# -- checkpoints ------------------------------------------------------------------------------------

def test_checkpoint_files_beside_the_database(store, tmp_path):
    t = store.add_trial("exp", new_trial())
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "epoch": 3, "shape": torch.Size([2, 3]),
             "dtype": torch.float16, "opt": {"lr": [0.1, 0.01]}}
    path = store.save_checkpoint(t.id, state)
    assert path == tmp_path / "tridens.db.files" / "exp" / f"trial-{t.number}.pt"
    loaded = store.load_checkpoint(path)
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert (loaded["epoch"], loaded["shape"], loaded["dtype"]) == (3, torch.Size([2, 3]), torch.float16)
    assert torch.equal(store.load_checkpoint(f"exp/trial-{t.number}.pt")["model"]["bias"], state["model"]["bias"])
    assert store.trial(t.id).checkpoint == str(path)
    branch = store.save_checkpoint(t.id, {"step": 1}, kind="step-1")
    assert branch.name == f"trial-{t.number}-step-1.pt"
    assert store.trials("exp")[0].checkpoint == str(branch)  # the latest one
    store.save_checkpoint(t.id, {"epoch": 4})  # replaces the final one, atomically
    assert store.load_checkpoint(path) == {"epoch": 4} and store.trial(t.id).checkpoint == str(path)
    assert sorted(p.name for p in path.parent.iterdir()) == [f"trial-{t.number}-step-1.pt", f"trial-{t.number}.pt"]


class InterruptsWhenSaved(torch.Tensor):
    """A tensor whose pickling is interrupted, as by a Ctrl-C that lands inside torch.save."""

    def __reduce_ex__(self, protocol):
        raise KeyboardInterrupt


def test_ctrl_c_while_a_checkpoint_is_written_is_a_keyboard_interrupt_and_leaves_the_last_one(store, tmp_path):
    """An interrupt inside torch.save: the caller sees KeyboardInterrupt (not what torch's zip
    writer may raise after it), the previous checkpoint stays and no temporary file is left."""
    t = store.add_trial("exp", new_trial())
    path = store.save_checkpoint(t.id, {"epoch": 1})
    state = {"weight": torch.zeros(1000), "bias": torch.zeros(4).as_subclass(InterruptsWhenSaved)}
    with pytest.raises(KeyboardInterrupt):
        store.save_checkpoint(t.id, state)
    assert os.listdir(path.parent) == [path.name] and store.load_checkpoint(path) == {"epoch": 1}


def test_checkpoint_errors(store, tmp_path):
    t = store.add_trial("exp", new_trial())
    with pytest.raises(StoreError, match=r"state\['net'\] is a Linear module; save its state_dict\(\)"):
        store.save_checkpoint(t.id, {"net": torch.nn.Linear(2, 2)})
    with pytest.raises(StoreError, match=r"state\['a'\]\[1\] is a ndarray"):
        store.save_checkpoint(t.id, {"a": [1, np.zeros(2)]})
    with pytest.raises(StoreError, match="no trial with id 77"):
        store.save_checkpoint(77, {})
    missing = tmp_path / "tridens.db.files" / "exp" / "trial-5.pt"
    with pytest.raises(StoreError, match=f"no checkpoint file {missing}"):
        store.load_checkpoint("exp/trial-5.pt")
    broken = store.save_checkpoint(t.id, {"w": torch.ones(3)})
    broken.write_bytes(broken.read_bytes()[:40])
    with pytest.raises(StoreError, match=f"cannot load the checkpoint {broken}"):
        store.load_checkpoint(broken)


# -- transactions, threads, pickling ------------------------------------------------------------------

def test_transaction_commits_together_or_not_at_all(store, tmp_path):
    with store.transaction():
        t = store.add_trial("exp", new_trial())
        store.add_metrics(t.id, 0, {"a": 1.0, "b": 2.0})
        with store.transaction():  # nested blocks join the outer one
            t.status = TrialStatus.COMPLETED
            store.update_trial(t)
    assert store.trial(t.id).status is TrialStatus.COMPLETED
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction():
            store.create_experiment("temp")
            u = store.add_trial("temp", new_trial())
            store.add_metrics(u.id, 0, {"a": 1.0})
            raise RuntimeError("boom")
    assert [e.name for e in store.experiments()] == ["exp"]
    with Store(tmp_path / "tridens.db") as other:
        assert [x.id for x in other.trials("exp")] == [t.id]
    store.create_experiment("temp")  # the rolled-back name is free, and its cached id forgotten
    assert store.add_trial("temp", new_trial()).experiment == "temp"


def test_threads_share_one_store(store):
    def work(k: int) -> None:
        for i in range(25):
            t = store.add_trial("exp", new_trial(seed=k * 100 + i))
            store.add_metrics(t.id, 0, {"acc": float(i)})
            t.status = TrialStatus.COMPLETED
            store.update_trial(t)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    trials = store.trials("exp")
    assert len(trials) == 100 and len({t.id for t in trials}) == 100
    assert all(t.status is TrialStatus.COMPLETED and len(t.metrics["acc"]) == 1 for t in trials)


def test_pickled_store_reopens_the_file(store):
    store.add_trial("exp", new_trial())
    copy = pickle.loads(pickle.dumps(store))
    assert copy.path == store.path and [t.id for t in copy.trials("exp")] == [1]
    copy.close()


def test_readonly_store_reads_but_refuses_writes(store, tmp_path):
    store.add_trial("exp", new_trial())
    ro = Store(tmp_path / "tridens.db", readonly=True)
    assert len(ro.trials("exp")) == 1
    with pytest.raises(StoreError, match=r"tridens\.db is open read-only; cannot write while adding a trial"):
        ro.add_trial("exp", new_trial())
    with pytest.raises(StoreError, match="open read-only"):
        ro.save_checkpoint(1, {})
    with pytest.raises(StoreError, match=r"cannot open the store .*missing\.db read-only: the file does not exist"):
        Store(tmp_path / "missing.db", readonly=True)
    ro.close()
    with pytest.raises(StoreError, match="is closed"):
        ro.trials("exp")


def test_parameter_validation(tmp_path):
    with pytest.raises(ValueError, match=r"'timeout' parameter of Store must be a number >= 0. Got -1"):
        Store(tmp_path / "a.db", timeout=-1)
    with pytest.raises(ValueError, match=r"'synchronous' parameter of Store must be 'NORMAL' or 'FULL'. Got 'OFF'"):
        Store(tmp_path / "a.db", synchronous="OFF")
    with pytest.raises(StoreError, match="it is a directory"):
        Store(tmp_path)
    with Store(tmp_path / "full.db", synchronous="FULL") as s:  # fsyncs checkpoints too
        s.create_experiment("e")
        t = s.add_trial("e", new_trial())
        assert s.load_checkpoint(s.save_checkpoint(t.id, {"x": 1})) == {"x": 1}


def test_relative_path_gives_absolute_checkpoint_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Store("rel.db") as s:
        assert s.path == tmp_path / "rel.db" and s.files_dir == tmp_path / "rel.db.files"
        s.create_experiment("e")
        t = s.add_trial("e", new_trial())
        path = s.save_checkpoint(t.id, {"x": 1})
    assert path.is_absolute() and path == tmp_path / "rel.db.files" / "e" / "trial-0.pt"


def test_forked_child_reopens_instead_of_sharing_the_connection(store):
    store.add_trial("exp", new_trial())
    pid = os.fork()
    if pid == 0:  # child: the inherited connection must not be used across fork()
        code = 1
        try:
            t = store.add_trial("exp", new_trial(seed=5))
            store.add_metrics(t.id, 0, {"acc": 1.0})
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [(t.seed, t.metrics) for t in store.trials("exp")] == [(0, {}), (5, {"acc": [1.0]})]
    store.add_trial("exp", new_trial())  # the parent's connection is unharmed


def test_checkpoint_files_are_named_by_trial_number_and_old_names_stay_readable(store, tmp_path):
    """Files are named after the number a user reads in tables (``trial-1.pt`` for #1, whatever its
    store id); a store written when files were named by store id keeps them readable, and a new
    file never replaces an old one that another trial's row names."""
    store.create_experiment("other")
    store.add_trial("other", new_trial())  # store ids and numbers differ from here on
    first, second = store.add_trial("exp", new_trial()), store.add_trial("exp", new_trial())
    assert (first.id, first.number, second.id, second.number) == (2, 0, 3, 1)
    path = store.save_checkpoint(second.id, {"w": torch.ones(1)})
    assert path.name == "trial-1.pt" and store.save_checkpoint(second.id, {}, kind="step-1").name == "trial-1-step-1.pt"
    # as an older tridens wrote it: trial #0 (store id 2) in a file named after its id
    old = tmp_path / "tridens.db.files" / "exp" / "trial-2.pt"
    torch.save({"w": torch.full((1,), 2.0)}, old)
    with sqlite3.connect(tmp_path / "tridens.db") as conn:
        conn.execute("INSERT INTO checkpoints (trial_id, kind, path, saved_at) VALUES (?, 'final', ?, 0)",
                     (first.id, "exp/trial-2.pt"))
    assert store.load_checkpoint(store.trial(first.id).checkpoint)["w"].item() == 2.0
    third = store.add_trial("exp", new_trial())  # trial #2: its number's name is taken by #0's old file
    path = store.save_checkpoint(third.id, {"w": torch.full((1,), 3.0)})
    assert path.name == f"trial-2-id{third.id}.pt"
    assert store.load_checkpoint(old)["w"].item() == 2.0 and store.load_checkpoint(path)["w"].item() == 3.0


def test_numbers_and_file_names_stay_right_with_other_writers_and_late_finishers(store, tmp_path):
    """A trial's number counts every trial of its experiment with a smaller id, whoever added them:
    another process's store object, trials finished long after later ones were added, other
    experiments in between, ids given out again after a rollback."""
    other = Store(tmp_path / "tridens.db")
    store.create_experiment("side")
    added = []
    for i in range(12):
        writer = other if i % 3 == 1 else store
        added.append(writer.add_trial("exp", new_trial(seed=i)))
        if i % 4 == 0:
            store.add_trial("side", new_trial())
    numbers = {t.id: t.number for t in store.trials("exp")}
    assert [t.number for t in added] == [numbers[t.id] for t in added] == list(range(12))
    for t in [added[1], added[11], added[0], added[6]]:  # finished out of order, one added by the other writer
        t.status, t.metric = TrialStatus.COMPLETED, 0.5
        assert store.finish_trial(t, {"w": torch.ones(1)}).name == f"trial-{numbers[t.id]}.pt"
    assert other.save_checkpoint(added[4].id, {}, kind="best").name == "trial-4-best.pt"
    with pytest.raises(RuntimeError), store.transaction():  # rolled back: their ids are given out again
        store.add_trial("exp", new_trial()), store.add_trial("exp", new_trial())
        raise RuntimeError
    other.add_trial("side", new_trial())  # takes the first of those ids
    assert store.add_trial("exp", new_trial()).number == 12
    other.close()


def test_a_trial_costs_the_store_the_same_work_however_many_trials_came_before(store):
    """Adding and finishing a trial runs about as many SQLite instructions at the 2,000th trial as at
    the 50th: its number is counted from the latest trial numbered, not over the whole experiment,
    and its file name is checked against one row, not every checkpoint."""
    def instructions_of_one_trial() -> int:
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        store._conn.set_progress_handler(count, 10)
        try:
            t = store.add_trial("exp", new_trial())
            t.status, t.metric = TrialStatus.COMPLETED, 0.5
            store.finish_trial(t, {"w": torch.ones(1)})
        finally:
            store._conn.set_progress_handler(None, 10)
        return steps[0]

    def add(n: int) -> None:
        for _ in range(n):
            t = store.add_trial("exp", new_trial())
            t.status = TrialStatus.COMPLETED
            store.finish_trial(t, {})

    add(50)
    early = instructions_of_one_trial()
    add(1950)
    late = instructions_of_one_trial()
    assert late < 1.5 * early, (early, late)
