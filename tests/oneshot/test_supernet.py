"""The supernet built from a space: slicing, extraction, mixing, and spaces it refuses."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.oneshot import build_supernet
from tridens.oneshot._entangled import EntangledBatchNorm2d, EntangledConv2d, EntangledLinear

from .spaces import DigitsCNN, spos_steps


class ConvBN(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [4, 8])
        k = td.choice("kernel", [3, 5])
        self.conv = nn.Conv2d(2, w, k, padding=k // 2)
        self.bn = nn.BatchNorm2d(w)
        self.fc = nn.Linear(w, 3)
        self.example_inputs = (torch.randn(2, 2, 6, 6),)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_entangled_slicing_equals_a_smaller_layer_with_copied_weights():
    torch.manual_seed(0)
    net = build_supernet(ConvBN())
    conv, bn, fc = net.model.conv, net.model.bn, net.model.fc
    assert isinstance(conv, EntangledConv2d) and isinstance(bn, EntangledBatchNorm2d) and isinstance(fc, EntangledLinear)
    assert conv.weight.shape == (8, 2, 5, 5)  # built at the largest width and kernel
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
    x = torch.randn(4, 2, 6, 6)
    small = nn.Conv2d(2, 4, 3, padding=1)
    small_bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        small.weight.copy_(conv.weight[:4, :, 1:4, 1:4])  # the centred 3x3 window of the first 4 filters
        small.bias.copy_(conv.bias[:4])
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(small_bn, name).copy_(getattr(bn, name)[:4])
    net.set_path({"width": 4, "kernel": 3})
    net.model.eval()
    small_bn.eval()
    with torch.no_grad():
        assert torch.allclose(conv(x), small(x), atol=1e-6)
        assert torch.allclose(bn(conv(x)), small_bn(small(x)), atol=1e-6)
    # training-mode BatchNorm updates only the sliced part of the shared running statistics
    net.model.train()
    before = bn.running_mean.clone()
    with torch.no_grad():
        bn(conv(x))
    assert not torch.equal(bn.running_mean[:4], before[:4]) and torch.equal(bn.running_mean[4:], before[4:])


def _trained_supernet(steps=15):
    """A supernet after a few SPOS steps on digits (non-trivial weights and BatchNorm statistics)."""
    torch.manual_seed(0)
    net = build_supernet(DigitsCNN())
    train, _ = td.datasets.digits()
    x, y = train.tensors
    spos_steps(net, x, y, steps)
    return net, x[:50]


def test_every_structural_kind_becomes_a_mixed_module():
    net = build_supernet(DigitsCNN())
    assert set(net.state.values) == set(net.search_space)
    kinds = net.claimed
    assert kinds["op"] == "LayerChoice" and kinds["skip"] == "InputChoice" and kinds["depth"] == "Repeat depth"
    assert "kernel_size" in kinds["k1"] and "out_features" in kinds["hidden"]
    assert len(net.model.blocks) == 2  # the largest depth


def test_extracted_subnet_computes_the_supernet_path():
    net, x = _trained_supernet()
    rng = random.Random(1)
    for _ in range(6):
        sample = net.search_space.random_sample(rng)
        child = net.extract(sample)
        assert not any(isinstance(m, (EntangledConv2d, EntangledLinear)) for m in child.modules())
        net.set_path(sample)
        net.model.eval()
        child.eval()
        with torch.no_grad():
            assert torch.allclose(net.model(x), child(x), atol=1e-5), sample
        # the extracted model has the sample's own sizes
        assert child.fc1.out_features == sample["hidden"] and child.stem.kernel_size == (sample["stem_k"],) * 2


def test_one_hot_weights_reproduce_the_path():
    net, x = _trained_supernet()
    net.model.eval()
    rng = random.Random(2)
    for _ in range(4):
        sample = net.search_space.random_sample(rng)
        net.set_path(sample)
        with torch.no_grad():
            path = net.model(x)
        full = net.search_space.default_sample() | {k: v for k, v in sample.items()}
        probs = {}
        for label, values in net.state.values.items():
            value = full.get(label, values[0])
            probs[label] = torch.tensor([1.0 if v == value else 0.0 for v in values])
        net.set_weights(probs)
        with torch.no_grad():
            mixed = net.model(x)
        assert torch.allclose(path, mixed, atol=1e-5), sample


def test_soft_weights_mix_candidates_and_carry_gradients():
    net, x = _trained_supernet(steps=3)
    alphas = {label: torch.zeros(len(v), requires_grad=True) for label, v in net.state.values.items()}
    net.set_weights({k: F.softmax(a, -1) for k, a in alphas.items()})
    net.model(x).sum().backward()
    for label in ("op", "width", "hidden", "depth", "skip", "stem_k", "k0", "k1"):
        assert alphas[label].grad is not None and alphas[label].grad.abs().sum() > 0, label


# -- spaces that cannot be one-shot --------------------------------------------------------------
class StringChoice(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        act = td.choice("act", ["relu", "gelu"])
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU() if act == "relu" else nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class ControlFlow(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [4, 8])
        self.fc = nn.Linear(4, w)
        if w > 4:
            self.extra = nn.Linear(w, w)
        self.example_inputs = (torch.randn(2, 4),)

    def forward(self, x):
        x = self.fc(x)
        return self.extra(x) if hasattr(self, "extra") else x


class LoopCount(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        n = td.choice("layers", [1, 2])
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(n)])
        self.example_inputs = (torch.randn(2, 4),)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Continuous(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(td.uniform("p", 0.0, 0.5))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.drop(x))


class CellInputs(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.cell = tnn.Cell([nn.Identity(), nn.ReLU()], num_nodes=2, label="cell")

    def forward(self, x):
        return self.cell(x)


@pytest.mark.parametrize("cls, label, reason", [
    (StringChoice, "act", "not numbers"),
    (ControlFlow, "width", "cannot follow"),
    (LoopCount, "layers", "does not reach a layer"),
    (Continuous, "p", "continuous"),
])
def test_a_space_that_cannot_be_one_shot_is_refused_naming_the_label(cls, label, reason):
    with pytest.raises(td.InvalidSpace) as err:
        build_supernet(cls())
    message = str(err.value)
    assert repr(label) in message and reason in message and "multi-trial" in message


def test_a_cell_with_input_choices_is_held_whole_and_each_path_matches_its_frozen_model():
    space = CellInputs()
    space.example_inputs = (torch.randn(3, 4),)
    net = build_supernet(space)  # verifies every checked path against space.freeze
    assert {"cell/input_2_0", "cell/op_2_0"} <= set(net.claimed)
    x = torch.randn(3, 4)
    for seed in range(4):
        sample = space.random_sample(seed)
        net.set_path(sample)
        assert torch.allclose(net.model(x), space.freeze(sample)(x))


class TwoOpCell(tnn.ModelSpace):
    """A DARTS-like cell: two ops per node, each an op with weights (or none) on any earlier state;
    the ``wide`` op is built wider for a node's second op (its factory reads the op index)."""

    def __init__(self):
        super().__init__()
        ops = {"lin": lambda j, k, i: nn.Linear(4, 4), "mlp": lambda j, k, i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
               "wide": lambda j, k, i: nn.Sequential(nn.Linear(4, 4 + 4 * k), nn.Linear(4 + 4 * k, 4)),
               "skip": lambda j, k, i: nn.Identity()}
        self.cell = tnn.Cell(ops, num_nodes=3, num_ops_per_node=2, num_predecessors=2, label="cell")
        self.example_inputs = (torch.randn(3, 4), torch.randn(3, 4))

    def forward(self, x, y):
        return self.cell([x, y])


def test_a_cells_ops_share_one_op_per_edge_and_weights_run_each_once():
    """As NNI's one-shot cells and DARTS' edges: a node's ops hold one set of candidates per input
    (a factory that builds another op for another op index keeps its own), so the weighted cell
    runs each shared candidate once per edge, mixed by the sum over the node's ops, and computes
    what running every op apart computes; a path's subnet (its ops' weights taken from the shared ones)
    computes the supernet's path."""
    space = TwoOpCell()
    net = build_supernet(space)  # checks paths against space.freeze
    cell = net.model.cell
    first, second = cell.ops[0], cell.ops[1]  # node 2's two ops
    for i in range(2):
        for name in ("lin", "mlp"):
            o = first.edges[i].keys.index(name)
            assert first.edges[i].candidates[o] is second.edges[i].candidates[o]
        o = first.edges[i].keys.index("wide")
        assert first.edges[i].candidates[o] is not second.edges[i].candidates[o]
    x = space.example_inputs
    g = torch.Generator().manual_seed(0)
    alphas = {label: torch.randn(len(v), generator=g, requires_grad=True) for label, v in net.state.values.items()}
    net.set_weights({k: F.softmax(a, -1) for k, a in alphas.items()})
    mixed = net.model(*x)
    states = list(x)  # every op apart: sum over ops k of sum_i p(input_k = i) sum_o p(op_k = o) op(state_i)
    for j in range(3):
        states.append(sum(cell.ops[2 * j + k](states) for k in range(2)))
    assert torch.allclose(mixed, torch.cat(states[2:], dim=1), atol=1e-6)
    mixed.sum().backward()
    assert all(a.grad is not None and a.grad.abs().sum() > 0 for a in alphas.values())
    for seed in range(4):
        sample = space.random_sample(seed)
        net.set_path(sample)
        assert torch.allclose(net.model(*x), net.extract(sample, seed=0)(*x), atol=1e-6)  # its weights, as frozen


def test_a_mutator_space_is_refused():
    class AddBN(td.Mutator):
        def mutate(self, graph):
            self.choice([False, True], label="bn")

    base = nn.Sequential(nn.Linear(4, 4))
    space = td.ModelSpace.from_base(base, [AddBN()], example_inputs=(torch.randn(2, 4),))
    with pytest.raises(td.InvalidSpace, match="multi-trial"):
        build_supernet(space)


def test_experiment_with_an_unsupported_space_fails_before_writing(tmp_path, digits_data):
    train, val = digits_data
    ev = td.evaluators.Classification(train, val, epochs=1)
    with pytest.raises(td.InvalidSpace, match="'act'"):
        td.Experiment(StringChoice(), ev, td.oneshot.RandomOneShot(), store=tmp_path / "t.db",
                      options=td.RunOptions(verbose=False)).run()
    assert not (tmp_path / "t.db").exists()
