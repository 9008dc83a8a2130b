import json
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.space import Choice, resolve_value

from .spaces import DartsNet, HelloNet, SkipNet


def test_choice_in_any_constructor_argument():
    space = HelloNet()
    model = space.freeze({"width": 32, "op": 1, "depth": 2, "kernel0": 3, "kernel1": 5, "dropout": 0.25})
    assert model.stem.out_channels == 32
    assert model.op.kernel_size == (5, 5)
    assert [b.conv.kernel_size for b in model.blocks] == [(3, 3), (5, 5)]
    assert model.drop.p == 0.25
    assert model.head.in_features == 32


def test_frozen_model_is_plain_torch(digits_batch):
    space = HelloNet()
    model = space.freeze(space.default_sample())
    kinds = {type(m).__module__.split(".")[0] for m in model.modules() if m is not model}
    assert kinds <= {"torch", "tests"}  # tests: the user's own Block class
    assert isinstance(model.blocks, nn.Sequential)
    assert model(digits_batch).shape == (32, 10)
    assert model.tridens_sample["width"] == 8
    assert model.tridens_history[0]["by"] == "inline"


def test_space_object_is_the_default_model(digits_batch):
    space = HelloNet()
    assert space(digits_batch).shape == (32, 10)
    assert space.stem.out_channels == 8


def test_search_space_describes_conditions():
    desc = HelloNet().search_space().describe()
    assert desc["width"] == {"type": "categorical", "values": [8, 16, 32], "source": "choice"}
    assert desc["op"]["values"] == [0, 1] and desc["op"]["source"] == "layer_choice"
    assert "condition" not in desc["kernel0"]
    assert desc["kernel1"]["condition"] == "depth in [2, 3]"
    assert desc["kernel2"]["condition"] == "depth == 3"
    assert desc["dropout"] == {"type": "uniform", "low": 0.0, "high": 0.5, "source": "uniform"}
    json.dumps(desc)


def test_size_counts_conditional_labels():
    assert HelloNet().size() == math.inf  # dropout is continuous

    class Finite(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("width", [8, 16, 32])
            self.blocks = tnn.Repeat(lambda i: nn.Linear(w, w, bias=td.choice(f"bias{i}", [True, False])),
                                     depth=td.choice("depth", [1, 2, 3]))

    # 3 widths x (2 + 4 + 8) kernel combinations
    assert Finite().size() == 3 * 14
    assert len(list(Finite().search_space().grid())) == 42


def test_nested_conditions_are_discovered():
    class Inner(nn.Module):
        def __init__(self, i):
            super().__init__()
            kind = td.choice(f"b{i}.kind", ["conv", "sep"])
            if kind == "sep":
                k = td.choice(f"b{i}.sep_kernel", [3, 5])
                self.op = nn.Conv2d(4, 4, k, padding=k // 2, groups=4)
            else:
                self.op = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.op(x)

    class Nested(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.blocks = tnn.Repeat(lambda i: Inner(i), depth=td.choice("depth", [1, 2]))

    ss = Nested().search_space()
    assert [str(c) for c in ss["b1.kind"].conditions] == ["depth == 2"]
    assert [str(c) for c in ss["b1.sep_kernel"].conditions] == ["depth == 2", "b1.kind == 'sep'"]
    assert [str(c) for c in ss["b0.sep_kernel"].conditions] == ["b0.kind == 'sep'"]
    # depth 1: 1 + 2 ; depth 2: 3 * 3
    assert ss.size() == 3 + 9


def test_same_label_is_one_decision():
    class Shared(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, td.choice("w", [8, 16]))
            self.b = nn.Linear(td.choice("w", [8, 16]), 2)

    space = Shared()
    assert list(space.search_space()) == ["w"]
    model = space.freeze({"w": 16})
    assert model.a.out_features == model.b.in_features == 16


def test_arithmetic_on_choices():
    class Arith(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("w", [8, 16])
            self.a = nn.Linear(4, w * 2)
            self.b = nn.Linear(w * 2, w // 4)

    model = Arith().freeze({"w": 16})
    assert (model.a.out_features, model.b.out_features) == (32, 4)
    # Outside a space, choices are placeholders resolved later (evaluator hyperparameters).
    lr = td.choice("lr", [0.1, 0.2])
    assert isinstance(lr, Choice)
    assert resolve_value({"x": lr * 10, "y": [lr, 3]}, {"lr": 0.2}) == {"x": 2.0, "y": [0.2, 3]}


def test_choice_as_space_constructor_argument():
    class Parametrized(tnn.ModelSpace):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(4, width)

    space = Parametrized(width=td.choice("width", [3, 5]))
    assert list(space.search_space()) == ["width"]
    assert space.freeze({"width": 5}).fc.out_features == 5


def test_numeric_hyperparameters():
    class Hp(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, td.randint("units", 2, 6))
            self.drop = nn.Dropout(td.uniform("p", 0.0, 0.5))
            self.scale = td.loguniform("scale", 1e-3, 1e-1)

    space = Hp()
    for seed in range(10):
        s = space.random_sample(seed)
        assert 2 <= s["units"] <= 6 and 0 <= s["p"] <= 0.5 and 1e-3 <= s["scale"] <= 1e-1
        assert space.freeze(s).fc.out_features == s["units"]
    assert space.random_sample(3) == space.random_sample(3)


def test_layer_choice_dict_and_input_choice(digits_batch):
    space = SkipNet()
    ss = space.search_space()
    assert ss["act"].domain.values() == ["relu", "gelu", "tanh"]
    assert ss["skip"].domain.values() == [0, 1]
    model = space.freeze({"hidden": 32, "act": "gelu", "skip": 0})
    assert isinstance(model.act, nn.GELU)
    assert model(digits_batch).shape == (32, 10)
    assert space.size() == 2 * 3 * 2


def test_input_choice_many_chosen():
    class Multi(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.pick = tnn.InputChoice(3, n_chosen=2, reduction="concat", label="pick")

        def forward(self, xs):
            return self.pick(xs)

    space = Multi()
    assert space.search_space()["pick"].domain.values() == [[0, 1], [0, 2], [1, 2]]
    model = space.freeze({"pick": [0, 2]})
    xs = [torch.full((1, 1), float(i)) for i in range(3)]
    assert model(xs).tolist() == [[0.0, 2.0]]


def test_repeat_forms():
    class R(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.a = tnn.Repeat(nn.Linear(3, 3), depth=(1, 3), label="a_depth")
            self.b = tnn.Repeat([nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)], depth=td.choice("b_depth", [0, 3]))

    space = R()
    assert space.search_space()["a_depth"].domain.values() == [1, 2, 3]
    model = space.freeze({"a_depth": 2, "b_depth": 0})
    assert len(model.a) == 2 and len(model.b) == 0
    assert model.a[0].weight is not model.a[1].weight


def test_darts_cell(digits_batch):
    space = DartsNet()
    ss = space.search_space()
    assert "cell/op_3_1" in ss and ss["cell/input_3_1"].domain.values() == [0, 1, 2]
    assert ss["cell/input_1_0"].domain.values() == [0] and "cell/op_0_0" not in ss
    for seed in range(5):
        model = space.freeze(space.random_sample(seed))
        assert model(digits_batch).shape == (32, 10)


def test_unknown_label():
    with pytest.raises(td.InvalidSample, match="unknown label 'widht'"):
        HelloNet().freeze({"widht": 8})


def test_value_outside_domain():
    space = HelloNet()
    sample = space.default_sample() | {"width": 12}
    with pytest.raises(td.InvalidSample, match=r"value 12 of label 'width' is outside its domain"):
        space.freeze(sample)
    with pytest.raises(td.InvalidSample, match="'dropout'"):
        space.validate(space.default_sample() | {"dropout": 0.9})


def test_missing_label():
    space = HelloNet()
    sample = space.default_sample()
    sample["depth"] = 2
    with pytest.raises(td.InvalidSample, match="missing label 'kernel1'"):
        space.freeze(sample)
    # inactive labels are accepted and ignored
    assert "kernel2" not in space.validate(space.default_sample() | {"kernel2": 5})


def test_bool_is_not_int():
    class B(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2, bias=td.choice("bias", [True, False]))

    with pytest.raises(td.InvalidSample, match="'bias'"):
        B().freeze({"bias": 1})


def test_conflicting_candidates():
    class Conflict(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, td.choice("w", [8, 16]))
            self.b = nn.Linear(4, td.choice("w", [8, 32]))

    with pytest.raises(td.InvalidSpace, match="label 'w' is used with conflicting candidates"):
        Conflict()


def test_empty_candidates():
    class Empty(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, td.choice("w", []))

    with pytest.raises(td.InvalidSpace, match="label 'w' has no candidates"):
        Empty()
    with pytest.raises(td.InvalidSpace, match="'lr'"):
        td.loguniform("lr", 0.0, 1.0)
    with pytest.raises(td.InvalidSpace, match=r"low=3, high=1"):
        td.uniform("x", 3, 1)


def test_shapes_that_dont_fit_name_the_layer():
    class Misfit(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))
            self.head = nn.Linear(td.choice("head_in", [16, 24]), 10)
            self.example_inputs = (torch.zeros(1, 1, 8, 8),)

        def forward(self, x):
            return self.head(self.body(x))

    space = Misfit()
    space.freeze({"head_in": 16})
    with pytest.raises(td.InvalidSample, match=r"sample \{'head_in': 24\}.*layer 'head' \(Linear\)"):
        space.freeze({"head_in": 24})
    with pytest.raises(td.InvalidSample, match="'head'"):
        space.validate({"head_in": 24}, example_inputs=torch.zeros(1, 1, 8, 8))


def test_choice_outside_space_errors():
    with pytest.raises(td.InvalidSpace, match="inside a ModelSpace"):
        tnn.LayerChoice([nn.ReLU()])


def test_freezing_a_frozen_model_errors():
    space = SkipNet()
    model = space.freeze(space.default_sample())
    with pytest.raises(td.InvalidSpace, match="frozen model"):
        model.freeze(space.default_sample())


def _nested_space():
    class Leaf(nn.Module):
        def __init__(self, i, width):
            super().__init__()
            self.op = tnn.LayerChoice({
                "conv": lambda: nn.Conv2d(width, width, td.choice(f"l{i}.k", [1, 3]), padding="same"),
                "pool": lambda: nn.MaxPool2d(3, 1, 1),
                "id": nn.Identity,
            }, label=f"l{i}.op")

        def forward(self, x):
            return self.op(x)

    class Deep(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("w", [4, 8])
            self.stem = nn.Conv2d(1, w, 3, padding=1)
            self.layers = tnn.Repeat(lambda i: Leaf(i, w), depth=td.randint("depth", 0, 3))
            self.mix = tnn.InputChoice(2, 1, label="mix")
            self.head = nn.Linear(w, 10)

        def forward(self, x):
            s = self.stem(x)
            return self.head(self.mix([s, self.layers(s)]).mean((2, 3)))

    return Deep()


_DEEP = None


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=2**31))
def test_random_samples_of_a_nested_space_run(seed):
    global _DEEP
    if _DEEP is None:
        _DEEP = _nested_space()
    space = _DEEP
    sample = space.random_sample(random.Random(seed))
    assert space.validate(sample) == sample
    model = space.freeze(sample)
    out = model(torch.zeros(2, 1, 8, 8))
    assert out.shape == (2, 10)
    json.dumps(sample)


def test_meta_freeze_has_the_structure_without_weights():
    space = HelloNet()
    sample = space.random_sample(4)
    real = space.freeze(sample)
    meta = space.freeze(sample, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    x = space.example_inputs
    assert td.graph.trace(meta, x).fingerprint() == td.graph.trace(real, x).fingerprint()
