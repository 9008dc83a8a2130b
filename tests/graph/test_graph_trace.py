"""trace(): nodes and their attributes, codegen round trip, printing, the opaque fallback."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from graph_models import (
    MLP, Branches, DataDependent, Encoder, LSTMClassifier, Residual, ResNetish, SmallCNN,
    WithDataDependentBlock,
    torch_resnet18,
)

import tridens as td
import tridens.graph as tg
from tridens.errors import InvalidSample


def _digits(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 1, 8, 8)


ROUND_TRIP = {
    "mlp": (MLP, lambda: _digits()),
    "cnn_bn_dropout": (SmallCNN, lambda: _digits()),
    "residual": (ResNetish, lambda: _digits()),
    "cat_branches": (Branches, lambda: _digits()),
    "transformer_encoder": (Encoder, lambda: torch.randn(3, 5, 8)),
    "lstm": (LSTMClassifier, lambda: torch.randn(3, 6, 8)),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip_same_outputs_same_weights(name):
    make, inputs = ROUND_TRIP[name]
    torch.manual_seed(0)
    model = make().eval()
    x = inputs()
    graph = tg.trace(model, x)
    module = graph.to_module()
    assert isinstance(module, torch.fx.GraphModule)
    assert not module.training  # the root's mode is kept
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x))
    assert {id(p) for p in module.parameters()} == {id(p) for p in model.parameters()}
    # trainable: gradients reach the model's own parameters
    module.train()
    module(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_round_trip_train_mode_batchnorm_matches():
    torch.manual_seed(0)
    model, x = SmallCNN(), _digits(4)
    model.drop.p = 0.0
    module = tg.trace(model, x).to_module()
    assert module.training
    torch.testing.assert_close(module(x), model(x))


def test_resnet18_round_trip():
    model, x = torch_resnet18().eval(), torch.randn(1, 3, 32, 32)
    graph = tg.trace(model, x)
    with torch.no_grad():
        torch.testing.assert_close(graph.to_module()(x), model(x))
    assert graph.output.inputs[0][0].output_shape == torch.Size([1, 10])
    assert len(graph.nodes(op_type=nn.Conv2d)) == 20
    assert graph.num_params() == sum(p.numel() for p in model.parameters())


def test_node_attributes():
    model, x = SmallCNN(), _digits()
    graph = tg.trace(model, x)
    conv1 = graph["conv1"]
    assert conv1.op == "call_module" and conv1.op_type is nn.Conv2d and conv1.module is model.conv1
    assert conv1.param_shapes == {"weight": torch.Size([16, 1, 3, 3]), "bias": torch.Size([16])}
    assert conv1.output_shape == torch.Size([2, 16, 8, 8])
    (src, slot), = conv1.inputs
    assert src is graph.inputs[0] and src.name == "x" and slot == 0
    assert [u.name for u in conv1.users] == ["bn1"]
    relu = graph["relu"]
    assert relu.op == "call_function" and relu.op_type is F.relu and relu.module is None
    assert relu.param_shapes == {}
    flatten = graph["flatten"]
    assert flatten.op_type is torch.flatten and flatten.output_shape == torch.Size([2, 512])
    assert graph.output.op_type == "output" and graph.inputs[0].op_type == "placeholder"
    assert graph.output.inputs[0][0] is graph["fc"]
    assert graph["fc"].users == [graph.output]


def test_method_node_and_list_slots():
    graph = tg.trace(MLP(), _digits())
    flat = graph.nodes(op_type="flatten")
    assert len(flat) == 1 and flat[0].op == "call_method" and flat[0].op_type == "flatten"
    branches = tg.trace(Branches(), _digits())
    cat = branches.nodes(op_type=torch.cat)[0]
    assert [(src.name, slot) for src, slot in cat.inputs] == [("a", 0), ("b", 0)]
    assert cat.output_shape == torch.Size([2, 10, 8, 8])


def test_multiple_outputs_shape():
    graph = tg.trace(LSTMClassifier(hidden=12), torch.randn(3, 6, 8))
    lstm = graph.nodes(op_type=nn.LSTM)[0]
    assert lstm.output_shape == (torch.Size([3, 6, 12]), (torch.Size([1, 3, 12]), torch.Size([1, 3, 12])))
    assert graph.nodes(op_type=operator.getitem)[0].output_shape == torch.Size([3, 6, 12])


def test_nodes_filters():
    graph = tg.trace(torch_resnet18(), torch.randn(1, 3, 32, 32))
    convs = graph.nodes(op_type=nn.modules.conv._ConvNd)  # isinstance match
    assert len(convs) == 20 and all(n.op_type is nn.Conv2d for n in convs)
    assert [n.name for n in graph.nodes(name="layer1_0_conv1")] == ["layer1_0_conv1"]
    by_path = graph.nodes(name="layer2.0.*")  # module paths match too
    assert {n.target for n in by_path} >= {"layer2.0.conv1", "layer2.0.downsample.0"}
    assert graph.nodes(name="layer2_0_*", op_type=nn.BatchNorm2d) == graph.nodes(name="layer2.0.*", op_type=nn.BatchNorm2d)
    assert len(graph.nodes(op_type=operator.add)) == 8
    assert graph.nodes(op_type="placeholder") == graph.inputs
    assert [n.name for n in graph] == [n.name for n in graph.nodes()]
    assert len(graph) == len(graph.nodes())


def test_print_reads_like_code():
    graph = tg.trace(SmallCNN(), _digits())
    text = str(graph)
    assert text.startswith("graph SmallCNN(%x):")
    assert "%conv1 : Conv2d(1, 16, kernel_size=(3, 3)" in text
    assert "-> [2, 16, 8, 8]  (%x)" in text
    assert "%fc : Linear(in_features=512, out_features=10, bias=True) -> [2, 10]  (%drop)" in text
    assert "%relu : torch.nn.functional.relu -> [2, 16, 8, 8]  (%bn1, inplace=False)" in text
    assert text.rstrip().endswith("return %fc")
    assert str(graph["conv2"]).startswith("%conv2 : Conv2d(16, 32")
    assert repr(graph["conv2"]).startswith("Node(%conv2 : Conv2d(16, 32")


def test_without_example_inputs():
    graph = tg.trace(SmallCNN())
    assert graph["conv1"].output_shape is None
    assert "%conv1 : Conv2d(1, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)) -> ?  (%x)" in str(graph)
    assert graph.flops() == 0
    assert len(graph.fingerprint()) == 32
    graph.propagate_shapes(_digits(5))
    assert graph["fc"].output_shape == torch.Size([5, 10])


def test_example_inputs_that_do_not_fit_raise_invalid_sample():
    graph = tg.trace(SmallCNN(), torch.randn(2, 3, 8, 8))  # 3 channels, conv1 wants 1
    with pytest.raises(InvalidSample, match=r"While executing %conv1 : Conv2d\(1, 16.*\n.*%x -> \[2, 3, 8, 8\]"):
        graph["fc"].output_shape
    with pytest.raises(InvalidSample, match="takes 1 input"):
        graph.propagate_shapes((torch.randn(2, 1, 8, 8), torch.randn(2)))


def test_trace_leaves_the_model_alone_and_optional_args():
    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            y = self.fc(x)
            if mask is not None:
                y = y * mask
            return y + torch.tensor([1.0, 2.0, 3.0, 4.0])  # a tensor constant fx stores as an attribute

    model, x = WithMask(), torch.randn(2, 4)
    before = dict(vars(model))
    graph = tg.trace(model, x)
    assert vars(model).keys() == before.keys()
    torch.testing.assert_close(graph.to_module()(x), model(x))
    with_mask = tg.trace(model, (x, torch.full((2, 4), 2.0)))
    m = torch.randn(2, 4)
    torch.testing.assert_close(with_mask.to_module()(x, m), model(x, m))


def test_leaf_modules_option():
    assert tg.trace(ResNetish(), _digits()).nodes(name="block_conv1")  # traced through by default
    leaf = tg.trace(ResNetish(), _digits(), leaf_modules=[Residual])
    block = leaf.nodes(op_type=Residual)
    assert len(block) == 1 and not block[0].opaque and block[0].output_shape == torch.Size([2, 8, 8, 8])


# ---- the opaque fallback ---------------------------------------------------------------------

def test_opaque_submodule():
    torch.manual_seed(0)
    model = WithDataDependentBlock()
    x = torch.randn(4, 4)
    with pytest.warns(tg.OpaqueModuleWarning, match=r"WithDataDependentBlock\.block \(DataDependent\).*control flow"):
        graph = tg.trace(model, x)
    block = graph["block"]
    assert block.opaque and block.op_type is DataDependent and block.module is model.block
    assert block.output_shape == torch.Size([4, 8])
    assert not graph["inp"].opaque
    assert "[opaque]" in str(graph)
    module = graph.to_module()
    for sign in (1.0, -1.0):  # both branches of the data-dependent forward
        inp = sign * x.abs()
        torch.testing.assert_close(module(inp), model(inp))
    module(x).sum().backward()
    assert model.block.pos.weight.grad is not None or model.block.neg.weight.grad is not None
    # stable: another instance (other weights) has the same fingerprint
    with pytest.warns(tg.OpaqueModuleWarning):
        again = tg.trace(WithDataDependentBlock(), x)
    assert again.fingerprint() == graph.fingerprint()


def test_opaque_whole_model():
    model, x = DataDependent(), torch.randn(3, 8)
    with pytest.warns(tg.OpaqueModuleWarning, match=r"whole model DataDependent.*TraceError"):
        graph = tg.trace(model, x)
    assert [n.op for n in graph] == ["placeholder", "call_module", "output"]
    node = graph.nodes(op_type=DataDependent)[0]
    assert node.opaque and node.module is model and node.output_shape == torch.Size([3, 8])
    module = graph.to_module()
    for inp in (x.abs(), -x.abs()):
        torch.testing.assert_close(module(inp), model(inp))
    module(x).sum().backward()
    assert model.pos.weight.grad is not None or model.neg.weight.grad is not None
    with pytest.warns(tg.OpaqueModuleWarning):
        assert tg.trace(DataDependent(), x).fingerprint() == graph.fingerprint()


def test_public_api():
    assert td.graph.trace is tg.trace
    assert set(tg.__all__) >= {"trace", "Graph", "Node"}
    with pytest.raises(TypeError, match="trace"):
        tg.Graph()
    with pytest.raises(TypeError, match="nn.Module"):
        tg.trace(lambda x: x)


def test_several_opaque_modules_nested_and_shared():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), DataDependent())
            self.other = DataDependent()
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.other(self.other(self.inner(x))))

    model, x = Outer(), torch.randn(2, 8)
    with pytest.warns(tg.OpaqueModuleWarning) as record:
        graph = tg.trace(model, x)
    messages = [str(w.message) for w in record]
    assert any("Outer.inner.1 (DataDependent)" in m for m in messages)
    assert any("Outer.other (DataDependent)" in m for m in messages)
    assert [n.name for n in graph if n.opaque] == ["inner_1", "other", "other_1"]
    assert not graph["inner_0"].opaque
    torch.testing.assert_close(graph.to_module()(x), model(x))
