import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class BaseCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.head(x.mean((2, 3)))


class AddBatchNorm(td.Mutator):
    def mutate(self, graph):
        for node in graph.nodes(op_type=nn.Conv2d):
            if self.choice([False, True], label=f"bn.{node.name}"):
                graph.insert_after(node, nn.BatchNorm2d(node.output_shape[1]))


class DepthwiseSeparable(td.Mutator):
    """Swap each 3x3 conv for a depthwise-separable one, per a choice."""

    def mutate(self, graph):
        for node in graph.nodes(op_type=nn.Conv2d):
            conv = node.module
            if conv.kernel_size != (3, 3):
                continue
            if self.choice(["conv", "sep"], label=f"sep.{node.name}") == "sep":
                c_in, c_out = conv.in_channels, conv.out_channels
                node.replace(nn.Sequential(nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in), nn.Conv2d(c_in, c_out, 1)))


class DropHead(td.Mutator):
    """A mutator whose second decision exists only when the first is taken (a conditional label)."""

    def mutate(self, graph):
        if self.choice([False, True], label="extra"):
            node = graph.nodes(op_type=nn.Linear)[0]
            act = self.choice(["relu", "tanh"], label="extra.act")
            graph.insert_before(node, nn.ReLU() if act == "relu" else nn.Tanh())


X = torch.zeros(2, 1, 8, 8)


def test_add_batchnorm_mutator(digits_batch):
    space = td.ModelSpace.from_base(BaseCNN(), [AddBatchNorm()], example_inputs=(X,))
    labels = list(space.search_space())
    assert labels == ["bn.conv1", "bn.conv2", "bn.conv3"]
    assert space.size() == 8
    model = space.freeze({"bn.conv1": True, "bn.conv2": False, "bn.conv3": True})
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert [b.num_features for b in bns] == [8, 16]
    assert model(digits_batch).shape == (32, 10)
    assert model.tridens_history[-1] == {"by": "AddBatchNorm", "choices": {"bn.conv1": True, "bn.conv2": False, "bn.conv3": True}}


def test_depthwise_mutator_changes_fingerprint_and_keeps_shapes(digits_batch):
    space = td.ModelSpace.from_base(BaseCNN(), [DepthwiseSeparable()], example_inputs=(X,))
    assert list(space.search_space()) == ["sep.conv1", "sep.conv2"]  # conv3 is 1x1
    plain = space.freeze({"sep.conv1": "conv", "sep.conv2": "conv"})
    sep = space.freeze({"sep.conv1": "sep", "sep.conv2": "sep"})
    assert sep(digits_batch).shape == plain(digits_batch).shape == (32, 10)
    fp = lambda m: td.graph.trace(m, (X,)).fingerprint()
    assert fp(plain) != fp(sep)
    assert fp(plain) == fp(space.freeze({"sep.conv1": "conv", "sep.conv2": "conv"}))
    assert sum(p.numel() for p in sep.parameters()) < sum(p.numel() for p in plain.parameters())


def test_freezing_the_same_sample_twice_gives_the_same_fingerprint():
    space = td.ModelSpace.from_base(BaseCNN(), [DepthwiseSeparable(), AddBatchNorm()], example_inputs=(X,))
    for seed in range(4):
        sample = space.random_sample(seed)
        a, b = space.freeze(sample), space.freeze(sample)
        assert td.graph.trace(a, (X,)).fingerprint() == td.graph.trace(b, (X,)).fingerprint()
        assert [h["by"] for h in a.tridens_history] == ["inline", "DepthwiseSeparable", "AddBatchNorm"]


def test_conditional_mutator_labels():
    space = td.ModelSpace.from_base(BaseCNN(), [DropHead()], example_inputs=(X,))
    ss = space.search_space()
    assert [str(c) for c in ss["extra.act"].conditions] == ["extra == True"]
    assert space.size() == 3
    model = space.freeze({"extra": True, "extra.act": "tanh"})
    assert any(isinstance(m, nn.Tanh) for m in model.modules())
    assert space.freeze({"extra": False}).tridens_history[-1]["choices"] == {"extra": False}


def test_inline_choices_and_mutators_combine(digits_batch):
    class Inline(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("width", [8, 12])
            self.conv1 = nn.Conv2d(1, w, 3, padding=1)
            self.conv2 = nn.Conv2d(w, w, 3, padding=1)
            self.head = nn.Linear(w, 10)
            self.example_inputs = (X,)

        def forward(self, x):
            return self.head(torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean((2, 3)))

    space = td.ModelSpace.from_base(Inline(), [AddBatchNorm()])
    assert list(space.search_space()) == ["width", "bn.conv1", "bn.conv2"]
    model = space.freeze({"width": 12, "bn.conv1": True, "bn.conv2": True})
    assert [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == [12, 12]
    assert model(digits_batch).shape == (32, 10)
    assert model.tridens_history[0] == {"by": "inline", "choices": {"width": 12}}


def test_mutator_that_breaks_shapes_names_the_node():
    class Widen(td.Mutator):
        def mutate(self, graph):
            if self.choice([False, True], label="widen"):
                graph.nodes(name="conv2")[0].replace(nn.Conv2d(8, 24, 3, padding=1))

    space = td.ModelSpace.from_base(BaseCNN(), [Widen()], example_inputs=(X,))
    space.freeze({"widen": False})
    with pytest.raises(td.InvalidSample, match="conv3"):
        space.freeze({"widen": True})


def test_mutator_bad_input():
    with pytest.raises(td.InvalidSpace, match="td.Mutator"):
        td.ModelSpace.from_base(BaseCNN(), [lambda g: None], example_inputs=(X,))
    with pytest.raises(td.InvalidSpace, match="example_inputs"):
        td.ModelSpace.from_base(BaseCNN(), [AddBatchNorm()])
    with pytest.raises(td.InvalidSample, match="unknown label 'bn.conv9'"):
        td.ModelSpace.from_base(BaseCNN(), [AddBatchNorm()], example_inputs=(X,)).freeze({"bn.conv9": True})
