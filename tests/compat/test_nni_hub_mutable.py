"""NNI's nni.mutable, label scopes, the model-space hub, NNI 2.x's FunctionalEvaluator (model class)
and 2.x module paths, on tridens (real training on scikit-learn's digits)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
import tridens.compat.nni as nni
from tridens.compat.nni import mutable
from tridens.compat.nni._common import NotSupported
from tridens.compat.nni.nas.experiment import unique_name
from tridens.compat.nni.nas.hub import pytorch as hub
from tridens.compat.nni.nas.nn.pytorch import LayerChoice, ModelSpace, NasBench101Cell, NasBench201Cell


class Backbone(ModelSpace, label_prefix="backbone"):
    def __init__(self):
        super().__init__()
        width = mutable.Categorical([4, 8], label="width")
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        with mutable.label_scope("head"):
            self.act = LayerChoice([nn.ReLU(), nn.Tanh()], label="act")
            p = mutable.ensure_frozen(mutable.Numerical(0.0, 0.5, quantize=0.25, label="dropout"))
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc(self.drop(self.act(self.conv(x))).mean((2, 3)))


def test_mutables_resolve_to_values_inside_a_space_with_scoped_labels():
    space = Backbone()
    assert list(space.search_space()) == ["backbone/width", "backbone/head/act", "backbone/head/dropout"]
    assert space.search_space()["backbone/head/dropout"].domain.values() == [0.0, 0.25, 0.5]
    assert space.act.label == "backbone/head/act"
    model = space.freeze({"backbone/width": 8, "backbone/head/act": 1, "backbone/head/dropout": 0.25})
    assert model.conv.out_channels == 8 and isinstance(model.act, nn.Tanh) and model.drop.p == 0.25
    with mutable.frozen_context({"backbone/width": 4, "backbone/head/act": 0, "backbone/head/dropout": 0.0}):
        assert Backbone().conv.out_channels == 4


def test_mutables_outside_a_space_are_placeholders_with_nni_methods():
    lr = mutable.Numerical(1e-3, 1e-1, log_distributed=True, label="lr")
    assert 1e-3 <= lr.random(random_state=random.Random(0)) <= 1e-1
    bs = mutable.Categorical([32, 64], label="batch_size")
    assert bs.values == [32, 64] and bs.default() == 32 and list(bs.grid()) == [32, 64]
    assert bs.freeze({"batch_size": 64}) == 64 and (bs * 2).resolve({"batch_size": 64}) == 128
    pairs = mutable.CategoricalMultiple(["a", "b", "c"], n_chosen=2, label="pair")
    assert pairs.values == [["a", "b"], ["a", "c"], ["b", "c"]]
    with mutable.label_scope("model"):
        assert nni.choice("depth", [1, 2]).label == "model/depth"
    assert issubclass(mutable.SampleValidationError, td.InvalidSample)
    with pytest.raises(NotSupported, match="mu/sigma"):
        mutable.Numerical(0, 1, mu=0.5, sigma=0.1, label="x")
    with pytest.raises(NotSupported, match="td.choice"):
        class Custom(mutable.Mutable):
            pass


def test_nasbench_cells_in_an_nni_space_freeze_and_run():
    class Net(ModelSpace):
        def __init__(self):
            super().__init__()
            ops101 = {"conv3x3": lambda c: nn.Conv2d(c, c, 3, padding=1), "maxpool": lambda c: nn.MaxPool2d(3, 1, 1)}
            self.c101 = NasBench101Cell(5, 1, 8, ops101, lambda i, o: nn.Conv2d(i, o, 1), label="c101")
            ops201 = {"conv": lambda i, o: nn.Conv2d(i, o, 3, padding=1), "skip": lambda i, o: nn.Identity()}
            self.c201 = NasBench201Cell(ops201, 8, 8, label="c201")
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(self.c201(self.c101(x)).mean((2, 3)))

    space = Net()
    assert "c101/input4" in space.search_space() and "c201/3_2" in space.search_space()
    built = 0
    for seed in range(30):
        try:
            model = space.freeze(space.random_sample(random.Random(seed)))
        except td.InvalidSample:
            continue
        assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
        built += 1
    assert built >= 3


def test_the_nni_hub_names_map_onto_tridens_hub():
    space = hub.NasBench201(stem_out_channels=4, num_modules_per_stack=1)
    assert isinstance(space, td.hub.NasBench201) and len(space.search_space()) == 6
    model = hub.DARTS.load_searched_model("darts-v2")
    assert sum(p.numel() for p in model.parameters()) == 3_349_342
    with pytest.raises(NotSupported, match="pretrained"):
        hub.DARTS.load_searched_model("darts-v2", pretrained=True)
    with pytest.raises(NotSupported, match="drop_path_rate"):
        hub.AutoFormer(drop_path_rate=0.1)
    for path in ("tridens.compat.nni.retiarii.hub.pytorch", "tridens.compat.nni.retiarii.fixed",
                 "tridens.compat.nni.retiarii.serializer", "tridens.compat.nni.retiarii.utils",
                 "tridens.compat.nni.retiarii.evaluator.functional", "tridens.compat.nni.retiarii.oneshot.pytorch.enas"):
        importlib.import_module(path)


def test_unnamed_nni_experiments_started_in_one_second_get_different_names():
    assert len({unique_name("nni") for _ in range(20)}) == 20


def test_nni2_functional_evaluator_hands_the_model_class(tmp_path, monkeypatch):
    import tridens.compat.nni.retiarii.nn.pytorch as rnn
    from tridens.compat.nni.retiarii import model_wrapper
    from tridens.compat.nni.retiarii.evaluator.functional import FunctionalEvaluator
    from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment, debug_mutated_model
    from tridens.compat.nni.retiarii.serializer import trace_symbol
    import tridens.compat.nni.retiarii.strategy as strategy

    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "t.db"))
    monkeypatch.chdir(tmp_path)

    @model_wrapper
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = rnn.LayerChoice([nn.Linear(64, 32), nn.Linear(64, 16)], label="hidden")
            self.fc = nn.Linear(self.hidden.out_features, 10)

        def forward(self, x):
            return self.fc(F.relu(self.hidden(x.flatten(1))))

    train, val = td.datasets.digits()
    received = []

    @trace_symbol
    def evaluate(model_cls):
        received.append(model_cls)
        model = model_cls()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for x, y in torch.utils.data.DataLoader(train, batch_size=128):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        x, y = next(iter(torch.utils.data.DataLoader(val, batch_size=len(val))))
        nni.report_final_result(float((model(x).argmax(1) == y).float().mean()))

    assert Net().hidden.label == "hidden"
    exp = RetiariiExperiment(Net(), FunctionalEvaluator(evaluate), [], strategy.Random())
    config = RetiariiExeConfig("local")
    config.max_trial_number = 2
    config.experiment_name = "nni two x"
    exp.run(config)
    assert received and all(not isinstance(m, nn.Module) and isinstance(m(), nn.Module) for m in received)
    assert exp.export_top_models(formatter="dict")[0]["hidden"] in (0, 1)
    assert exp.experiment.top(1)[0].metric > 0.5
    debug_mutated_model(Net(), FunctionalEvaluator(evaluate))
    assert len(received) == 3


def test_lightning_module_and_trainer_become_a_declarative_evaluator():
    from tridens.compat.nni.nas.evaluator.pytorch import (Classification, ClassificationModule, DataLoader, Lightning,
                                                          Trainer)

    train, val = td.datasets.digits()
    evaluator = Lightning(ClassificationModule(learning_rate=0.01, optimizer=torch.optim.SGD),
                          Trainer(max_epochs=2, gpus=0, enable_progress_bar=False),
                          train_dataloaders=DataLoader(train, batch_size=32), val_dataloaders=DataLoader(val))
    assert isinstance(evaluator, Classification)
    assert (evaluator.epochs, evaluator.batch_size, evaluator.lr, evaluator.device) == (2, 32, 0.01, "cpu")
    with pytest.raises(NotSupported, match="gpus"):
        Classification(train_dataloaders=DataLoader(train, batch_size=32), val_dataloaders=DataLoader(val), gpus=2)
    with pytest.raises(NotSupported, match="must be a LightningModule"):
        Lightning(nn.Linear(1, 1), Trainer(max_epochs=1))


def test_value_choices_in_a_plain_module_are_refused_naming_model_wrapper():
    import tridens.compat.nni.retiarii.nn.pytorch as rnn

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = rnn.Repeat(nn.ReLU(), (1, 2), label="depth")

    with pytest.raises(NotSupported, match="@model_wrapper") as err:
        Plain()
    assert "retiarii.nn.pytorch's nn.Module" in str(err.value)
