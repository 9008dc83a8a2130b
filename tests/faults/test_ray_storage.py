"""Storage hygiene on Ray: once a run ends, nothing of its tasks is left under ``storage=`` --
per-epoch checkpoints, final weights and hand-off files of finished and failed trials are removed
-- and what a crashed run left there (a task killed between writing a hand-off and its reading, a
driver killed mid-trial) is removed when the experiment runs again. A real local Ray."""

from __future__ import annotations

import pytest

import tridens as td
from tridens.trial import TrialStatus

from tests.engine.spaces import TinyMLP

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    from tridens.executors._ray_local import start_local_ray

    started = not ray.is_initialized()
    if started:
        start_local_ray(2)
    yield ray
    if started:
        ray.shutdown()


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_ray_run_leaves_nothing_under_storage_and_cleans_what_a_crash_left(local_ray, tmp_path):
    root = tmp_path / "ckpt"
    crashed = root / "hygiene"   # what a killed run leaves: a hand-off nobody took, a trial's checkpoints
    (crashed / "handoff").mkdir(parents=True)
    (crashed / "handoff" / "0123abcd.pt").write_bytes(b"left by a task that died")
    (crashed / "trial-99").mkdir()
    (crashed / "trial-99" / "epoch-1.pt").write_bytes(b"left by a killed driver")
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=128,
                                             lr=td.choice("lr", [0.01, 0.003]))
    exp = td.Experiment(TinyMLP(), evaluator, td.strategy.GridSearch(), options=td.RunOptions(verbose=False),
                        executor=td.executors.Ray(workers=2, storage=root, optimize=False), store=tmp_path / "t.db",
                        name="hygiene")
    trials = exp.run().trials()
    assert trials and all(t.status is TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert all(t.checkpoint for t in trials)   # the weights are in the store
    assert _files(root) == []
