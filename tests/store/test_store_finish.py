"""Store.finish_trial: the checkpoint file, then its row and the trial's in one transaction."""

from __future__ import annotations

import pytest
import torch

from tridens.errors import StoreError
from tridens.store import Store
from tridens.trial import Trial, TrialStatus


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "tridens.db") as s:
        s.create_experiment("exp")
        s.create_experiment("other")
        yield s


def test_finish_writes_checkpoint_then_trial(store, tmp_path):
    t = store.add_trial("exp", Trial(id=-1, sample={"w": 4}, seed=3))
    t.status, t.metric, t.fingerprint = TrialStatus.COMPLETED, 0.75, "abc"
    state = torch.nn.Linear(3, 2).state_dict()
    path = store.finish_trial(t, state)
    assert path == tmp_path / "tridens.db.files" / "exp" / f"trial-{t.number}.pt" and t.checkpoint == str(path)
    with Store(tmp_path / "tridens.db", readonly=True) as other:  # committed: another connection sees it
        back = other.trial(t.id)
        assert (back.status, back.metric, back.fingerprint, back.checkpoint) == (TrialStatus.COMPLETED, 0.75, "abc", str(path))
        assert torch.equal(other.load_checkpoint(back.checkpoint)["weight"], state["weight"])
    # a trial made by hand (no .experiment) finds its folder through the store
    bare = store.add_trial("other", Trial(id=-1, sample={}, seed=0))
    bare.experiment = None
    bare.status = TrialStatus.COMPLETED
    assert store.finish_trial(bare, {"x": torch.ones(1)}).parent.name == "other"
    # without a state it is update_trial
    t.status = TrialStatus.FAILED
    assert store.finish_trial(t) is None and store.trial(t.id).status is TrialStatus.FAILED


def test_finish_refuses_a_trial_of_another_experiment_and_writes_no_row(store):
    t = store.add_trial("exp", Trial(id=-1, sample={}, seed=0))
    t.experiment, t.status = "other", TrialStatus.COMPLETED
    with pytest.raises(StoreError, match=f"no trial with id {t.id} in experiment 'other'"):
        store.finish_trial(t, {"x": torch.ones(1)})
    back = store.trial(t.id)
    assert back.status is TrialStatus.PENDING and back.checkpoint is None
    with pytest.raises(StoreError, match=r"state\['net'\] is a Linear module"):
        store.finish_trial(back, {"net": torch.nn.Linear(1, 1)})
