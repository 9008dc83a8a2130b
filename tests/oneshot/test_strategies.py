"""One-shot strategies inside td.Experiment, on real digits: what each learns and what is stored."""

import json
import random

import pytest
import torch

import tridens as td
from tridens.oneshot import Controller, build_supernet, gumbel_softmax
from tridens.oneshot._strategies import fair_paths
from tridens.trial import TrialStatus

from .spaces import DigitsCNN, ToyChoice
from .spaces import role as _role


@pytest.fixture
def evaluator(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)


def test_random_one_shot_stores_architectures_as_trials(tmp_path, evaluator):
    db = tmp_path / "t.db"
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=6, population=4), store=db,
                        name="spos", options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    roles = [_role(t) for t in trials]
    assert roles.count("supernet") == 1 and roles.count("subnet") == 6
    supernet = next(t for t in trials if _role(t) == "supernet")
    assert supernet.status is TrialStatus.COMPLETED and supernet.metric is None
    assert len(supernet.metrics["train_loss"]) == 1
    subnets = [t for t in trials if _role(t) == "subnet"]
    assert len({json.dumps(t.sample, sort_keys=True) for t in subnets}) == 6  # distinct architectures
    for t in subnets:
        assert t.status is TrialStatus.COMPLETED and t.info["oneshot"]["inherited"] is True
        assert 0.0 <= t.metric <= 1.0 and t.metrics["val_acc"] == [t.metric]
        assert set(DigitsCNN().search_space().validate({k: v for k, v in t.sample.items()})) <= set(t.sample)
        assert t.fingerprint and t.checkpoint
    top = exp.top(3)
    assert len(top) == 3 and all(_role(t) == "subnet" for t in top)
    assert top[0].metric == max(t.metric for t in subnets) and exp.best().id == top[0].id
    # the stored subnet weights are the supernet's (BatchNorm recalibrated): the exported model
    # scores what the search measured
    out = exp.export(tmp_path / "export")
    model = td.load(out[0])
    x, y = evaluator.val.tensors
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    assert acc == pytest.approx(top[0].metric, abs=1e-6)
    # reading back from the store works as for a multi-trial search
    again = td.Experiment.load(db, "spos")
    assert [t.id for t in again.top(3)] == [t.id for t in top]


def test_retrain_trains_the_best_architecture_from_scratch(tmp_path, evaluator):
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=3, search="random", retrain=2),
                        store=tmp_path / "t.db", name="retrain", options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    # ranked by accuracy, ties broken by the lower validation loss
    subnets = sorted((t for t in trials if _role(t) == "subnet"), key=lambda t: (-t.metric, t.metrics["val_loss"][-1], t.id))
    retrained = [t for t in trials if _role(t) == "retrain"]
    assert [r.info["oneshot"]["of"] for r in retrained] == [subnets[0].number, subnets[1].number]  # the two best
    assert {s.info["oneshot"]["supernet"] for s in subnets} == {0}  # the supernet is trial #0 (store id 1)
    assert [r.sample for r in retrained] == [subnets[0].sample, subnets[1].sample]
    r = retrained[0]
    assert r.status is TrialStatus.COMPLETED and len(r.metrics["val_acc"]) == evaluator.epochs
    # the same sample trained by the evaluator alone gives the same metrics (same seed)
    space = DigitsCNN()
    torch.manual_seed(r.seed)
    model = space.freeze(space.restrict(r.sample))
    trainer = evaluator.trainer(model, {}, r.seed)
    trainer.train_epoch()
    assert trainer.validate()["val_acc"] == pytest.approx(r.metric, abs=1e-9)


def test_fair_paths_cover_every_value_of_every_label():
    ss = DigitsCNN().search_space()
    rng = random.Random(0)
    for _ in range(5):
        paths = fair_paths(ss, rng)
        assert len(paths) == max(spec.domain.size() for spec in ss.values())
        for path in paths:
            assert set(path) == {lb for lb, spec in ss.items() if spec.active(path)}  # a valid architecture
        for label, spec in ss.items():
            if label == "k1":  # active only when depth == 2
                continue
            assert {p[label] for p in paths} == set(spec.domain.values()), label


def test_a_fair_step_trains_every_candidate_on_its_paths_and_a_plain_step_one(digits_data, evaluator):
    x, y = digits_data[0].tensors
    x, y = x[:64], y[:64]
    index = {"conv3": "0", "sep": "1"}  # op.candidates.<i>; the pool has no weights
    moved = set()
    for seed in range(3):
        changed, paths = {}, []
        for fair in (False, True):
            net = build_supernet(DigitsCNN())
            strategy = td.oneshot.RandomOneShot(fair=fair)
            strategy.validate()
            strategy.begin(net, evaluator.config({}), total_steps=1, rng=random.Random(seed))
            before = {k: v.clone() for k, v in net.model.named_parameters() if k.startswith("op.candidates.")}
            strategy.step(x, y, lambda: (x, y), 0)
            after = dict(net.model.named_parameters())
            changed[fair] = {k.split(".")[2] for k, v in before.items() if not torch.equal(v, after[k])}
        paths = fair_paths(DigitsCNN().search_space(), random.Random(seed))  # the step's paths (same rng)
        assert len(changed[False]) <= 1  # one path: at most one op candidate moved
        # one optimizer step moved every weighted op on a path that uses the op (skip == 1: the
        # op's branch is taken; skip == 0 bypasses it)
        assert changed[True] == {index[p["op"]] for p in paths if p["skip"] == 1 and p["op"] in index}
        moved |= changed[True]
    assert moved == {"0", "1"}


def test_darts_moves_architecture_weights_towards_the_better_op(tmp_path, evaluator):
    exp = td.Experiment(ToyChoice(), evaluator, td.oneshot.DARTS(arch_lr=0.05, samples=2), store=tmp_path / "t.db",
                        name="darts", options=td.RunOptions(verbose=False)).run()
    supernet = next(t for t in exp.trials() if _role(t) == "supernet")
    p_linear, p_zero = supernet.info["oneshot"]["probabilities"]["op"]
    assert p_linear > 0.6 > p_zero  # started at ~0.5 each
    assert supernet.info["oneshot"]["argmax"] == {"op": "linear"}
    best = exp.best()
    assert best.sample["op"] == "linear" and best.metric > 0.5


def test_darts_warmup_trains_the_weights_only_then_the_architecture(digits_data, evaluator):
    x, y = digits_data[0].tensors
    net = build_supernet(ToyChoice())
    strategy = td.oneshot.DARTS(arch_lr=0.05, warmup=0.5)
    strategy.validate()
    strategy.begin(net, evaluator.config({}), total_steps=8, rng=random.Random(0))
    assert strategy.warmup_steps() == 4
    alpha0 = strategy.alpha["op"].detach().clone()
    weight0 = net.model.op.candidates[0].weight.detach().clone()
    asked = []

    def arch_batch():
        asked.append(1)
        return x[512:576], y[512:576]
    for step in range(4):
        strategy.step(x[64 * step:64 * (step + 1)], y[64 * step:64 * (step + 1)], arch_batch, step)
    assert not asked and torch.equal(strategy.alpha["op"].detach(), alpha0)  # no architecture step
    assert not torch.equal(net.model.op.candidates[0].weight, weight0)  # the weights trained
    for step in range(4, 8):
        strategy.step(x[64 * step:64 * (step + 1)], y[64 * step:64 * (step + 1)], arch_batch, step)
    assert len(asked) == 4
    p_linear, p_zero = strategy.probabilities()["op"]
    assert p_linear > p_zero and not torch.equal(strategy.alpha["op"].detach(), alpha0)


def test_darts_second_order_also_prefers_the_better_op(tmp_path, evaluator):
    exp = td.Experiment(ToyChoice(), evaluator, td.oneshot.DARTS(arch_lr=0.05, samples=2, second_order=True),
                        store=tmp_path / "t.db", name="darts2", options=td.RunOptions(verbose=False)).run()
    supernet = next(t for t in exp.trials() if _role(t) == "supernet")
    p_linear, p_zero = supernet.info["oneshot"]["probabilities"]["op"]
    assert p_linear > 0.6 > p_zero


def test_gumbel_darts_learns_and_samples_are_one_hot_at_low_temperature(tmp_path, evaluator):
    exp = td.Experiment(ToyChoice(), evaluator, td.oneshot.GumbelDARTS(arch_lr=0.05, samples=2),
                        store=tmp_path / "t.db", name="gdas", options=td.RunOptions(verbose=False)).run()
    supernet = next(t for t in exp.trials() if _role(t) == "supernet")
    p_linear, p_zero = supernet.info["oneshot"]["probabilities"]["op"]
    assert p_linear > p_zero
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.3, -0.2, 0.1, 0.0])
    cold = torch.stack([gumbel_softmax(logits, 0.01, g) for _ in range(200)])
    hot = torch.stack([gumbel_softmax(logits, 10.0, g) for _ in range(200)])
    assert (cold.max(dim=1).values > 0.99).float().mean() > 0.9 and cold.max(dim=1).values.mean() > 0.97
    assert hot.max(dim=1).values.max() < 0.6
    # at low temperature the draws follow softmax(logits)
    freq = torch.bincount(cold.argmax(dim=1), minlength=4).float() / 200
    assert torch.allclose(freq, torch.softmax(logits, 0), atol=0.1)
    strategy = td.oneshot.GumbelDARTS(tau_max=5.0, tau_min=0.1)
    strategy.total_steps = 101
    assert strategy.temperature(0) == pytest.approx(5.0) and strategy.temperature(100) == pytest.approx(0.1)


def test_enas_controller_raises_the_probability_of_the_rewarded_choice():
    space = DigitsCNN().search_space()
    strategy = td.oneshot.ENAS(controller_lr=0.01)
    strategy.validate()
    torch.manual_seed(0)
    strategy.controller = Controller(space)
    strategy.controller_optimizer = torch.optim.Adam(strategy.controller.parameters(), lr=0.01)
    strategy._gen = torch.Generator().manual_seed(0)
    strategy.baseline = None
    before = strategy.controller.probability("op", "sep")
    for _ in range(60):
        strategy.reinforce(lambda s: 1.0 if s["op"] == "sep" else 0.0)
    after = strategy.controller.probability("op", "sep")
    assert before < 0.5 and after > 0.8, (before, after)


def test_enas_runs_in_an_experiment(tmp_path, evaluator):
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.ENAS(samples=3, population=2), store=tmp_path / "t.db",
                        name="enas", options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    supernet = next(t for t in trials if _role(t) == "supernet")
    greedy = supernet.info["oneshot"]["greedy"]
    subnets = [t for t in trials if _role(t) == "subnet"]
    assert len(subnets) == 3 and DigitsCNN().restrict(subnets[0].sample) == greedy  # the controller's pick first


@pytest.mark.parametrize("strategy, message", [
    (td.oneshot.RandomOneShot(samples=0), "'samples' parameter of RandomOneShot"),
    (td.oneshot.DARTS(arch_fraction=1.5), "'arch_fraction' parameter of DARTS"),
    (td.oneshot.DARTS(warmup=1.0), "'warmup' parameter of DARTS"),
    (td.oneshot.RandomOneShot(search="grid"), "'search' parameter of RandomOneShot"),
    (td.oneshot.RandomOneShot(fair="yes"), "'fair' parameter of RandomOneShot"),
    (td.oneshot.GumbelDARTS(tau_min=2.0, tau_max=1.0), "tau_min"),
])
def test_bad_parameters_are_named(tmp_path, evaluator, strategy, message):
    with pytest.raises(ValueError, match=message):
        td.Experiment(DigitsCNN(), evaluator, strategy, store=tmp_path / "t.db", options=td.RunOptions(verbose=False)).run()


def test_a_user_loop_evaluator_is_refused(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(lambda model: 0.5)
    with pytest.raises(ValueError, match="must be td.evaluators.Classification or Regression .* or td.evaluators.Lightning"):
        td.Experiment(DigitsCNN(), ev, td.oneshot.DARTS(), store=tmp_path / "t.db",
                      options=td.RunOptions(verbose=False)).run()


def test_retrained_models_rank_first_and_say_so(tmp_path, evaluator, capsys, monkeypatch):
    """With ``retrain``, the models trained from scratch come before every subnet scored with the
    supernet's weights (a proxy) in ``top``, ``tridens top`` and ``export --top``; each names its role,
    and an export of a supernet-scored subnet records that its weights are inherited."""
    from tridens.cli import main

    db = tmp_path / "t.db"
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=4, search="random", retrain=1),
                        store=db, name="roles", options=td.RunOptions(verbose=False)).run()
    top = exp.top(5)
    assert [t.role for t in top] == ["retrained"] + ["supernet-scored"] * 4
    assert exp.best().role == "retrained"
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["top", "roles", "-k", "3", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "role" in table and "retrained" in table and "supernet-scored" in table
    assert table.index("retrained") < table.index("supernet-scored")
    assert main(["top", "roles", "-k", "2", "--json", "--db", str(db)]) == 0
    assert [t["role"] for t in json.loads(capsys.readouterr().out)] == ["retrained", "supernet-scored"]
    assert main(["export", "roles", "--top", "2", "--to", str(tmp_path / "out"), "--db", str(db)]) == 0
    first, second = sorted((tmp_path / "out").iterdir())
    manifests = [json.loads((p / "tridens.json").read_text()) for p in (first, second)]
    assert [(m["role"], m["inherited_weights"]) for m in manifests] == [("retrained", False), ("supernet-scored", True)]
    assert "inherited from the one-shot supernet" in manifests[1]["note"]
