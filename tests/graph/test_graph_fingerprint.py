"""Structural fingerprints: invariance (names, weights, branch order) and sensitivity; prefixes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from graph_models import MLP, Branches, DataDependent, ResNetish, SmallCNN, torch_resnet18

import tridens.graph as tg


def _x() -> torch.Tensor:
    return torch.randn(2, 1, 8, 8)


def fp(model: nn.Module, x: torch.Tensor | None = None) -> str:
    return tg.trace(model, _x() if x is None else x).fingerprint()


class MLPRenamed(nn.Module):
    """MLP with other attribute names and another placeholder name."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.first = nn.Linear(64, hidden)
        self.nonlinearity = nn.ReLU()
        self.last = nn.Linear(hidden, 10)

    def forward(self, inp):
        return self.last(self.nonlinearity(self.first(inp.flatten(1))))


class MLPSkip(MLP):
    def forward(self, x):
        h = self.fc1(x.flatten(1))
        return self.fc2(self.act(h) + h)


class TiedMLP(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = self.a if tied else nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Gate(nn.Module):
    """Data-dependent (opaque) module whose submodule names are constructor arguments."""

    def __init__(self, names: tuple[str, str] = ("pos", "neg"), width: int = 8) -> None:
        super().__init__()
        self.names = len(names)  # plain config value
        self._names = names
        setattr(self, names[0], nn.Linear(8, width))
        setattr(self, names[1], nn.Linear(8, width))

    def forward(self, x):
        first, second = self._names
        return getattr(self, first)(x) if x.sum() > 0 else getattr(self, second)(x)


def test_invariant_to_attribute_and_input_names():
    assert fp(MLP()) == fp(MLPRenamed())
    assert fp(MLP(), None) == fp(MLPRenamed(), None)


def test_invariant_to_weights_and_buffers():
    torch.manual_seed(0)
    a = SmallCNN()
    torch.manual_seed(1)
    b = SmallCNN()
    b.bn1.running_mean.add_(3.0)
    assert not torch.equal(a.conv1.weight, b.conv1.weight)
    assert fp(a) == fp(b)
    assert fp(a.eval()) == fp(a.train())  # the training flag is not structure


def test_invariant_to_branch_order():
    ab, ba = tg.trace(Branches(first_a=True), _x()), tg.trace(Branches(first_a=False), _x())
    assert [n.name for n in ab][1:3] == ["a", "b"] and [n.name for n in ba][1:3] == ["b", "a"]
    assert ab.fingerprint() == ba.fingerprint()
    assert ab["a"].prefix_fingerprint() == ba["a"].prefix_fingerprint()


def test_invariant_for_resnet18_instances():
    x = torch.randn(1, 3, 32, 32)
    assert fp(torch_resnet18(), x) == fp(torch_resnet18(), x)


@pytest.mark.parametrize("variant", [
    "op", "width", "kernel", "connection", "frozen", "dropout_p", "input_shape", "tied_weights", "cat_order",
])
def test_sensitive_to(variant):
    if variant == "op":
        other = MLP()
        other.act = nn.GELU()
        assert fp(MLP()) != fp(other)
    elif variant == "width":
        assert fp(MLP(32)) != fp(MLP(16))
    elif variant == "kernel":
        assert fp(SmallCNN(kernel=3)) != fp(SmallCNN(kernel=5))
    elif variant == "connection":
        assert fp(MLP()) != fp(MLPSkip())
    elif variant == "frozen":
        frozen = MLP()
        frozen.fc1.weight.requires_grad_(False)
        assert fp(MLP()) != fp(frozen)
    elif variant == "dropout_p":
        other = SmallCNN()
        other.drop = nn.Dropout(0.5)
        assert fp(SmallCNN()) != fp(other)
    elif variant == "input_shape":
        assert fp(MLP(), torch.randn(2, 64)) != fp(MLP(), torch.randn(2, 1, 64))
    elif variant == "tied_weights":
        x = torch.randn(2, 8)
        assert fp(TiedMLP(True), x) != fp(TiedMLP(False), x)
    elif variant == "cat_order":
        graph = tg.trace(Branches(), _x())
        before = graph.fingerprint()
        cat = graph.nodes(op_type=torch.cat)[0]
        graph.disconnect(graph["a"], cat)
        graph.connect(graph["a"], cat)  # now cat([b, a])
        assert graph.fingerprint() != before


def test_prefix_fingerprints_shared_prefix():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU())
    torch.manual_seed(1)
    b = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.ReLU(),
                      nn.Flatten())
    ga, gb = tg.trace(a, _x()), tg.trace(b, _x())
    assert ga.fingerprint() != gb.fingerprint()
    nodes_a, nodes_b = ga.nodes(), gb.nodes()
    for na, nb in zip(nodes_a[:4], nodes_b[:4]):  # input, conv, bn, relu
        assert na.prefix_fingerprint() == nb.prefix_fingerprint()
    for na, nb in zip(nodes_a[4:6], nodes_b[4:6]):  # the second conv diverges, so does what follows
        assert na.prefix_fingerprint() != nb.prefix_fingerprint()
    assert ga.fingerprint() == ga.output.prefix_fingerprint()


def test_prefix_fingerprint_ignores_unrelated_branch():
    ab = tg.trace(Branches(), _x())
    other = Branches()
    other.b = nn.Conv2d(1, 6, 3, padding=1)  # the b branch differs
    ob = tg.trace(other, _x())
    assert ab["a"].prefix_fingerprint() == ob["a"].prefix_fingerprint()
    assert ab["b"].prefix_fingerprint() != ob["b"].prefix_fingerprint()
    assert ab.fingerprint() != ob.fingerprint()


def test_edits_invalidate_memo_and_undo_restores():
    graph = tg.trace(ResNetish(), _x())
    before = graph.fingerprint()
    stem = graph["stem"]
    stem_fp = stem.prefix_fingerprint()
    relu = graph.insert_after(stem, nn.ReLU())
    assert graph.fingerprint() != before
    assert stem.prefix_fingerprint() == stem_fp
    graph.remove(relu)
    assert graph.fingerprint() == before
    graph["stem"].replace(nn.Conv2d(1, 8, 3, padding=1))  # same config, new weights
    assert graph.fingerprint() == before


def test_edit_equals_written_model():
    """Inserting a ReLU by edit gives the fingerprint of the model written with it."""

    class WithRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)
            self.extra = nn.ReLU()

        def forward(self, x):
            return self.fc2(self.extra(self.act(self.fc1(x.flatten(1)))))

    graph = tg.trace(MLP(), _x())
    graph.insert_after(graph["act"], nn.ReLU())
    assert graph.fingerprint() == fp(WithRelu())


def test_opaque_fingerprint_from_module_structure():
    x = torch.randn(2, 8)
    with pytest.warns(tg.OpaqueModuleWarning):
        base = fp(Gate(("pos", "neg")), x)
    with pytest.warns(tg.OpaqueModuleWarning):
        assert fp(Gate(("up", "down")), x) == base  # attribute names don't count
    with pytest.warns(tg.OpaqueModuleWarning):
        assert fp(Gate(("pos", "neg"), width=8), x) == base  # weights don't count
    with pytest.warns(tg.OpaqueModuleWarning):
        assert fp(Gate(("pos", "neg"), width=4), x) != base  # parameter shapes do
    with pytest.warns(tg.OpaqueModuleWarning):
        frozen = Gate()
        frozen.pos.bias.requires_grad_(False)
        assert fp(frozen, x) != base
    with pytest.warns(tg.OpaqueModuleWarning):
        assert fp(DataDependent(), x) != base  # the class counts


def test_factory_made_functions_are_told_apart():
    import torch.nn.functional as F

    class Pool1(torch.nn.Module):
        def forward(self, x):
            return F.max_pool1d(x, 2)

    class Pool2(torch.nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 2)

    x = torch.zeros(1, 4, 8)
    g1, g2 = tg.trace(Pool1(), (x,)), tg.trace(Pool2(), (x,))
    assert g1.fingerprint() != g2.fingerprint()
    assert "max_pool1d" in str(g1) and "max_pool2d" in str(g2)
