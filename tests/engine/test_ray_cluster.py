"""A search on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head and worker
raylets on this machine) survives losing a worker node: the actor the search talks through stays
on the driver's node, the lost node's trials restart on another node from their last checkpoints,
and every trial ends exactly as in an undisturbed run."""

from __future__ import annotations

import pytest

import tridens as td
from tridens.trial import TrialStatus

from .spaces import TinyMLP

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")


@pytest.fixture
def cluster():
    """A head with no CPUs (the driver and its hub live there; no task runs there) and one worker
    node with two CPUs."""
    if ray.is_initialized():
        ray.shutdown()
    made = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False})
    made.first_worker = made.add_node(num_cpus=2)
    made.wait_for_nodes()
    yield made
    ray.shutdown()
    made.shutdown()


RUNNING = {}  # the test's cluster and what happened to it (the experiment works on a copy of its strategy)


def lose_the_worker_node(trial_id: int) -> None:
    """Remove the node every task runs on and add a fresh one: a node lost mid-search."""
    if not RUNNING["lost"]:
        RUNNING["lost"].append(trial_id)
        cluster = RUNNING["cluster"]
        cluster.remove_node(cluster.first_worker)
        cluster.add_node(num_cpus=2)


class LoseTheWorkerNode(td.strategy.GridSearch):
    """Grid search that loses the worker node when the first trial reports epoch ``at``."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def decide(self, trial, step):
        if step == self.at:
            lose_the_worker_node(trial.id)
        return super().decide(trial, step)


class PBTLosingTheWorkerNode(td.strategy.PBT):
    """PBT that loses the worker node when the first member reports epoch ``at``."""

    def __init__(self, at: int, **kw):
        super().__init__(**kw)
        self.at = at

    def decide(self, trial, step):
        if step == self.at:
            lose_the_worker_node(trial.id)
        return super().decide(trial, step)


def test_a_lost_worker_node_restarts_its_trials_elsewhere_from_their_checkpoints(cluster, digits_data, tmp_path):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003]))
    RUNNING.update(cluster=cluster, lost=[])
    strategy = LoseTheWorkerNode(at=1)
    executor = td.executors.Ray(workers=2, address=cluster.address, storage=tmp_path / "ckpt", max_retries=2,
                                optimize=False)
    exp = td.Experiment(TinyMLP(), ev, strategy, executor=executor, store=tmp_path / "lost.db", name="lost",
                        options=td.RunOptions(seed=5, verbose=False))
    trials = exp.run().trials()
    assert RUNNING["lost"], "the node was never removed"
    assert len(trials) == 4 and all(t.status is TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    restarted = [t for t in trials if t.info.get("ray_restarts")]
    assert restarted and all(t.info["ray_restarts"] == 1 for t in restarted)
    # each epoch recorded once, and the metrics of a run that lost nothing
    undisturbed = td.Experiment(TinyMLP(), ev, td.strategy.GridSearch(), options=td.RunOptions(seed=5, verbose=False),
                                executor=td.executors.Inline(optimize=False), store=tmp_path / "inline.db",
                                name="lost").run().trials()
    by_sample = {tuple(sorted(t.sample.items())): t for t in undisturbed}
    for trial in trials:
        assert trial.metrics == by_sample[tuple(sorted(trial.sample.items()))].metrics


def test_the_hub_lives_on_the_drivers_node(cluster, tmp_path):
    executor = td.executors.Ray(workers=2, address=cluster.address, storage=tmp_path / "ckpt")
    try:
        executor._connect()
        driver = ray.get_runtime_context().get_node_id()
        assert ray.get(executor._hub.hub.node_id.remote()) == driver
    finally:
        executor.close()


def _search(kind, digits_data):
    """(evaluator, strategy class and its arguments, the run's setup: budget, seeds, the executor's
    optimize and allocation) of one unit kind."""
    train, val = digits_data
    if kind == "stage tree":   # one initial model; trials part at their milestones: a tree of stages
        ev = td.evaluators.Classification(
            train=train, val=val, epochs=4, batch_size=128, optimizer="sgd", lr=0.05, momentum=0.9, schedule="step",
            milestones=td.choice("milestones", [[1], [2]]), gamma=td.choice("gamma", [0.1, 0.5]))
        return ev, (LoseTheWorkerNode, td.strategy.GridSearch, {}), {"seeds": "per-architecture", "optimize": True}
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [0.05, 0.02]), momentum=td.choice("momentum", [0.5, 0.9]))
    if kind == "pbt":
        return ev, (PBTLosingTheWorkerNode, td.strategy.PBT, {"population": 4, "interval": 2}), {"budget": 8}
    options = {"fused": {"optimize": td.xopt.Settings().with_batching(mode="force")},
               "fluid": {"optimize": False, "allocation": "static"}}[kind]
    return ev, (LoseTheWorkerNode, td.strategy.GridSearch, {}), options


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fused", "stage tree", "pbt", "fluid"])
def test_every_unit_kind_survives_a_lost_node(cluster, digits_data, tmp_path, kind):
    ev, (losing, plain, args), setup = _search(kind, digits_data)
    RUNNING.update(cluster=cluster, lost=[])
    optimize, options = setup.get("optimize"), td.RunOptions(seed=5, seeds=setup.get("seeds", "per-trial"), verbose=False)
    executor = td.executors.Ray(workers=2, address=cluster.address, storage=tmp_path / "ckpt", max_retries=2,
                                optimize=optimize, allocation=setup.get("allocation"))
    trials = td.Experiment(TinyMLP(), ev, losing(at=1, **args), budget=setup.get("budget"), options=options,
                           executor=executor, store=tmp_path / "lost.db", name="lost").run().trials()
    assert RUNNING["lost"], "the node was never removed"
    assert all(t.status is TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert any(t.info.get("ray_restarts") for t in trials)
    # in-process, without Fluid (it places trials; training is the same)
    undisturbed = td.Experiment(TinyMLP(), ev, plain(**args), budget=setup.get("budget"), options=options,
                                executor=td.executors.Inline(optimize=optimize), store=tmp_path / "inline.db",
                                name="lost").run().trials()
    assert len(trials) == len(undisturbed)
    for trial, alone in zip(sorted(trials, key=lambda t: t.number), sorted(undisturbed, key=lambda t: t.number)):
        assert trial.sample == alone.sample
        assert trial.metrics.keys() == alone.metrics.keys()
        for name, values in trial.metrics.items():   # restarted members train on as separate trainers: rounding
            assert values == pytest.approx(alone.metrics[name], abs=1e-4), (trial.number, name)
