"""NNI 2.x's graph mutators (``nni.retiarii.Mutator``, ``applied_mutators``) on tridens' graph IR.

A small mutator written as NNI's mnasnet ``BlockMutator`` is (``self.choice``, ``get_nodes_by_label``,
``update_operation``, ``insert_node_on_edge``, a successor's ``operation.parameters`` edited in
place) runs on a small model everywhere; NNI's own ``mutator.py`` and ``base_mnasnet.py`` run from
the NNI snapshot when there is one (imports rewritten only), and its ``search.py`` end to end under
``-m slow``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tridens as td
import tridens.compat.nni.retiarii.nn.pytorch as rnn
from tridens.compat.nni._common import NotSupported
from tridens.compat.nni.retiarii import Mutator, model_wrapper
from tridens.compat.nni.retiarii import strategy as nni2
from tridens.compat.nni.retiarii.evaluator.pytorch.lightning import Classification, DataLoader
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment
from tridens.datasets import digits
from tridens.space import build_space, space_recipe
from tridens.store import Store
from tridens.trial import TrialStatus

from . import _upstream

BLOCK = f"__mutated__.{__name__}.Block"


class Block(rnn.Module):
    """A candidate operation, named by import path as NNI's mutators name theirs."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@model_wrapper
class Base(rnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = rnn.Sequential(
            rnn.Conv2d(1, 8, 3, padding=1), rnn.ReLU(),
            rnn.Placeholder(label="block", in_ch=8, width_options=[8, 16], kernel_options=[1, 3]),
            rnn.Conv2d(8, 16, 1), rnn.ReLU())
        self.head = rnn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x).mean((2, 3)))


class BlockMutator(Mutator):
    """NNI's mnasnet BlockMutator in small."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def mutate(self, model: Any) -> None:
        [node] = model.get_nodes_by_label(self.target)
        graph, info = node.graph, node.operation.parameters
        width = self.choice(info["width_options"])
        kernel = self.choice(info["kernel_options"])
        node.update_operation(BLOCK, {"in_ch": info["in_ch"], "out_ch": width, "kernel_size": kernel})
        for i in range(1, self.choice([1, 2])):
            node = graph.insert_node_on_edge(node.outgoing_edges[0], f"{self.target}_{i}", BLOCK,
                                             {"in_ch": width, "out_ch": width, "kernel_size": kernel})
        if len(node.successors) == 1 and "in_channels" in node.successors[0].operation.parameters:
            node.successors[0].operation.parameters["in_channels"] = width


X = torch.zeros(2, 1, 8, 8)


def _space(*mutators: Mutator) -> Any:
    return td.ModelSpace.from_base(Base(), list(mutators) or [BlockMutator("block")], example_inputs=X)


def test_choices_are_labels_and_each_sample_builds_its_model() -> None:
    space = _space()
    assert list(space.search_space()) == ["BlockMutator_1", "BlockMutator_2", "BlockMutator_3"]
    assert space.size() == 8
    model = space.freeze({"BlockMutator_1": 16, "BlockMutator_2": 3, "BlockMutator_3": 2})
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert [(b.conv.in_channels, b.conv.out_channels, b.conv.kernel_size) for b in blocks] == \
        [(8, 16, (3, 3)), (16, 16, (3, 3))]
    assert not any(isinstance(m, rnn.Placeholder) for m in model.modules())
    [after] = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.out_channels == 16 and m.kernel_size == (1, 1)]
    assert after.in_channels == 16 and after.bias is not None  # rebuilt from its parameters, bias kept
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    small = space.freeze(space.default_sample())
    assert [b.conv.out_channels for b in small.modules() if isinstance(b, Block)] == [8]


def test_the_view_reads_nodes_as_nni_does() -> None:
    seen: dict[str, Any] = {}

    class Look(Mutator):
        def mutate(self, model: Any) -> None:
            [ph] = model.get_nodes_by_label("block")
            seen["placeholder"] = dict(ph.operation.parameters)
            [conv] = ph.predecessors[0].predecessors
            seen["conv"] = (conv.operation.type, conv.operation.parameters)
            seen["edges"] = [(e.head.name, e.tail.name, e.tail_slot) for e in ph.incoming_edges + ph.outgoing_edges]
            seen["successor"] = ph.successors[0].operation.type
            seen["convs"] = [n.python_name for n in model.get_nodes_by_type("__torch__.torch.nn.modules.conv.Conv2d")]
            seen["io"] = (ph.graph.input_node.operation.type, ph.graph.output_node.operation.type)

    _space(Look()).freeze({})
    assert seen["placeholder"] == {"in_ch": 8, "width_options": [8, 16], "kernel_options": [1, 3]}
    kind, params = seen["conv"]
    assert kind == "__torch__.torch.nn.modules.conv.Conv2d"
    assert params["in_channels"] == 1 and params["out_channels"] == 8 and params["bias"] is True
    assert params["padding"] == (1, 1)
    assert seen["edges"] == [("layers_1", "layers_2", 0), ("layers_2", "layers_3", 0)]
    assert seen["successor"] == "__torch__.torch.nn.modules.conv.Conv2d"
    assert seen["convs"] == ["layers.0", "layers.3"] and seen["io"] == ("_inputs", "_outputs")


def test_a_labelled_mutator_labels_its_choices_by_position() -> None:
    class Labelled(BlockMutator):
        def __init__(self, target: str) -> None:
            Mutator.__init__(self, label=f"m.{target}")
            self.target = target

    assert list(_space(Labelled("block")).search_space()) == ["m.block/0", "m.block/1", "m.block/2"]


def test_a_mutator_space_is_stored_as_json_and_rebuilt() -> None:
    space = _space()
    recipe = space_recipe(space)
    assert recipe["mutators"][0]["args"] == {"target": "block"}
    again = build_space(recipe, allow_modules=[__name__])
    assert list(again.search_space()) == list(space.search_space())


def test_errors_name_the_operation_type_and_the_node() -> None:
    class Unknown(Mutator):
        def mutate(self, model: Any) -> None:
            model.get_nodes_by_label("block")[0].update_operation("__mutated__.nowhere.Nothing", {})

    with pytest.raises(NotSupported, match=r"'__mutated__\.nowhere\.Nothing'"):
        _space(Unknown()).freeze({})

    class BadArgs(Mutator):
        def mutate(self, model: Any) -> None:
            model.get_nodes_by_label("block")[0].update_operation(BLOCK, {"in_ch": 8})

    with pytest.raises(td.InvalidSpace, match=r"node 'layers_2': Block\(\*\*\{'in_ch': 8\}\) failed"):
        _space(BadArgs()).freeze({})
    with pytest.raises(NotSupported, match="sampler"):
        Mutator(sampler=object())
    with pytest.raises(NotSupported, match="Mutator"):
        RetiariiExperiment(Base(), None, [object()], nni2.Random())


def test_retiarii_experiment_trains_the_models_its_mutators_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    train, val = digits()
    evaluator = Classification(train_dataloaders=DataLoader(train, batch_size=64),
                               val_dataloaders=DataLoader(val, batch_size=64), max_epochs=3, learning_rate=0.01)
    exp = RetiariiExperiment(Base(), evaluator, [BlockMutator("block")], nni2.Random())
    config = RetiariiExeConfig("local")
    config.max_trial_number = 3
    exp.run(config)
    trials = exp.experiment.trials()
    assert len(trials) == 3 and all(t.status == TrialStatus.COMPLETED for t in trials)
    assert len({t.fingerprint for t in trials}) == 3  # three different models
    assert exp.experiment.best().metric > 0.3  # three times chance after three epochs
    [arch] = exp.export_top_models(formatter="dict")
    assert set(arch) == {"BlockMutator_1", "BlockMutator_2", "BlockMutator_3"}
    [model] = exp.export_top_models(formatter="instance")
    assert sum(isinstance(m, Block) for m in model.modules()) == arch["BlockMutator_3"]


# -- NNI's own files ---------------------------------------------------------------------------------
MNASNET = "examples/nas/multi-trial/mnasnet"


def test_nni_mnasnet_block_mutator_builds_nni_mnasnet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NNI's mutator.py and base_mnasnet.py as written (imports rewritten): the search space its two
    BlockMutators make, and one model of it."""
    folder = _upstream.example(tmp_path, MNASNET, ["base_mnasnet.py", "mutator.py"])
    monkeypatch.syspath_prepend(str(folder))
    for name in ("base_mnasnet", "mutator"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    base_mnasnet, mutator = importlib.import_module("base_mnasnet"), importlib.import_module("mutator")
    depths, convops = [16, 24, 40, 80, 96, 192, 320], ["dconv"] + ["mconv"] * 6
    base = base_mnasnet.MNASNet(0.5, depths, convops, [3, 3, 5, 5, 3, 5, 3], [1, 3, 3, 3, 2, 4, 1], [False] + [True] * 6)
    space = td.ModelSpace.from_base(base, [mutator.BlockMutator("mutable_0"), mutator.BlockMutator("mutable_1")],
                                    example_inputs=torch.zeros(2, 3, 32, 32))
    labels = space.search_space()
    assert len(labels) == 10 and space.size() == (3 * 3 * 2 * 3 * 4) ** 2
    sample = dict(zip(labels, [5, "__mutated__.base_mnasnet.MobileConv", "identity", 20, 3,
                               3, "__mutated__.base_mnasnet.DepthwiseConv", "no", 30, 2]))
    model = space.freeze(sample)
    called = [model.get_submodule(n.target) for n in model.graph.nodes if n.op == "call_module"]  # in graph order
    blocks = [(type(m).__name__, m.in_ch, m.out_ch, m.kernel_size, m.stride, m.skip) for m in called
              if type(m).__name__ in ("RegularConv", "DepthwiseConv", "MobileConv")]
    assert blocks == [("MobileConv", 16, 20, 5, 1, "no"), ("MobileConv", 20, 20, 5, 1, "identity"),
                      ("MobileConv", 20, 20, 5, 1, "identity"),
                      ("DepthwiseConv", 20, 30, 3, 2, "no"), ("DepthwiseConv", 30, 30, 3, 1, "no")]
    [last] = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.out_channels == 1280]
    assert last.in_channels == 30  # the mutator's "fix possible shape mismatch" line, applied
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)


@pytest.mark.slow
def test_nni_mnasnet_search_script(tmp_path: Path) -> None:
    """NNI 2.10's examples/nas/multi-trial/mnasnet/search.py end to end: imports rewritten only,
    CIFAR-10 from the offline torchvision stand-in; TPE over the two BlockMutators, 10 trials."""
    folder = _upstream.example(tmp_path / "mnasnet", MNASNET, ["base_mnasnet.py", "mutator.py", "search.py"])
    db = tmp_path / "nni.db"
    done = subprocess.run([sys.executable, "search.py"], cwd=folder, capture_output=True, text=True, timeout=900,
                          env=_upstream.script_env(db))
    assert done.returncode == 0, done.stderr[-3000:]
    with Store(db, readonly=True) as store:
        [name] = [e.name for e in store.experiments()]
        trials = store.trials(name)
    assert name == "mnasnet_search" and len(trials) == 10
    assert all(t.status == TrialStatus.COMPLETED for t in trials)
    assert all(len(t.sample) == 10 for t in trials) and len({t.fingerprint for t in trials}) > 1
