"""Edit primitives: each edit keeps the graph linted, shapes re-propagate lazily, to_module runs."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from graph_models import MLP, Branches, SmallCNN

import tridens.graph as tg
from tridens.errors import GraphError, InvalidSample


def _x(batch: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 1, 8, 8)


def _run(graph: tg.Graph, *inputs: torch.Tensor) -> torch.Tensor:
    graph.fx_graph.lint()
    module = graph.to_module().eval()
    with torch.no_grad():
        return module(*inputs)


class SharedReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc2(self.act(self.fc1(x))))


def test_insert_after():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    conv2 = graph["conv2"]
    old_users = conv2.users
    new = graph.insert_after(conv2, nn.ReLU())
    assert [src for src, _ in new.inputs] == [conv2]
    assert conv2.users == [new]
    assert all(u.inputs[0][0] is new for u in old_users)
    assert new.output_shape == torch.Size([2, 32, 8, 8])
    assert new.op_type is nn.ReLU and new.name == "re_lu" and new.target == "re_lu"
    with torch.no_grad():
        h = F.relu(model.bn1(model.conv1(x)))
        expected = model.fc(torch.flatten(model.pool(F.relu(model.bn2(F.relu(model.conv2(h))))), 1))
    torch.testing.assert_close(_run(graph, x), expected)
    second = graph.insert_after(conv2, nn.ReLU())  # fresh unique names
    assert second.target == "re_lu_1" and second.users == [new]


def test_insert_after_batchnorm_like_a_mutator():
    graph = tg.trace(SmallCNN(), _x())
    for node in graph.nodes(op_type=nn.Conv2d):
        graph.insert_after(node, nn.BatchNorm2d(node.output_shape[1]))
    assert len(graph.nodes(op_type=nn.BatchNorm2d)) == 4
    assert _run(graph, _x()).shape == (2, 10)


def test_insert_before():
    model, x = MLP().eval(), _x()
    graph = tg.trace(model, x)
    fc2 = graph["fc2"]
    act = graph["act"]
    new = graph.insert_before(fc2, nn.Tanh())
    assert new.inputs == [(act, 0)]
    assert fc2.inputs == [(new, 0)]
    assert act.users == [new]
    assert new.output_shape == torch.Size([2, 32])
    with torch.no_grad():
        expected = model.fc2(torch.tanh(model.act(model.fc1(x.flatten(1)))))
    torch.testing.assert_close(_run(graph, x), expected)


def test_insert_before_replaces_only_the_first_input():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    model, x = Square(), torch.randn(3)
    graph = tg.trace(model, x)
    mul = graph.nodes(op_type=operator.mul)[0]
    new = graph.insert_before(mul, nn.ReLU())
    assert [src.name for src, _ in mul.inputs] == [new.name, "x"]
    torch.testing.assert_close(_run(graph, x), F.relu(x) * x)


def test_insert_on_edge_changes_that_edge_only():
    class Fanout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return torch.cat([torch.relu(h), h], dim=1)

    model, x = Fanout().eval(), torch.randn(2, 4)
    graph = tg.trace(model, x)
    fc, relu = graph["fc"], graph.nodes(op_type=torch.relu)[0]
    cat = graph.nodes(op_type=torch.cat)[0]
    new = graph.insert_on_edge(fc, relu, nn.Tanh(), name="squash")
    assert new.name == "squash" and [src for src, _ in new.inputs] == [fc]
    assert relu.inputs == [(new, 0)] and [src.name for src, _ in cat.inputs] == [relu.name, "fc"]
    with torch.no_grad():
        h = model.fc(x)
        expected = torch.cat([torch.relu(torch.tanh(h)), h], dim=1)
    torch.testing.assert_close(_run(graph, x), expected)
    with pytest.raises(GraphError, match="no edge"):
        graph.insert_on_edge(relu, fc, nn.Tanh())


def test_remove():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    bn2 = graph["bn2"]
    graph.remove(bn2)
    assert [src.name for src, _ in graph["relu_1"].inputs] == ["conv2"]
    assert not hasattr(graph.root, "bn2") and hasattr(model, "bn2")  # the graph's root only
    assert "bn2" not in [n.name for n in graph]
    with torch.no_grad():
        h = F.relu(model.bn1(model.conv1(x)))
        expected = model.fc(torch.flatten(model.pool(F.relu(model.conv2(h))), 1))
    torch.testing.assert_close(_run(graph, x), expected)
    with pytest.raises(GraphError, match="does not belong"):
        graph.remove(bn2)
    with pytest.raises(GraphError, match="cannot remove %x"):
        graph.remove(graph.inputs[0])
    with pytest.raises(GraphError, match="cannot remove return"):
        graph.remove(graph.output)


def test_replace_call_module_in_place():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    conv1 = graph["conv1"]
    wide = nn.Conv2d(1, 16, 5, padding=2)
    assert conv1.replace(wide) is conv1
    assert conv1.module is wide and conv1.target == "conv1" and conv1.name == "conv1"
    assert conv1.param_shapes["weight"] == torch.Size([16, 1, 5, 5])
    assert model.conv1.kernel_size == (3, 3)  # the model is untouched
    with torch.no_grad():
        h = F.relu(model.bn1(wide(x)))
        expected = model.fc(torch.flatten(model.pool(F.relu(model.bn2(model.conv2(h)))), 1))
    torch.testing.assert_close(_run(graph, x), expected)


def test_replace_shared_module_changes_only_that_node():
    model, x = SharedReLU(), torch.randn(3, 4)
    graph = tg.trace(model, x)
    first, second = graph.nodes(op_type=nn.ReLU)
    assert first.target == second.target == "act"
    first.replace(nn.Tanh())
    assert first.op_type is nn.Tanh and second.op_type is nn.ReLU and first.target != "act"
    torch.testing.assert_close(_run(graph, x), F.relu(model.fc2(torch.tanh(model.fc1(x)))))


def test_replace_function_and_method():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    relu = graph["relu"]
    relu.replace(nn.GELU())
    assert relu.op == "call_module" and relu.op_type is nn.GELU and relu.name == "relu"
    assert relu.inputs == [(graph["bn1"], 0)]
    flatten = graph["flatten"]
    flatten.replace(nn.Flatten())
    assert flatten.op_type is nn.Flatten and flatten.output_shape == torch.Size([2, 512])
    with torch.no_grad():
        h = F.gelu(model.bn1(model.conv1(x)))
        expected = model.fc(torch.flatten(model.pool(F.relu(model.bn2(model.conv2(h)))), 1))
    torch.testing.assert_close(_run(graph, x), expected)
    mlp = tg.trace(MLP(), x)
    mlp.nodes(op_type="flatten")[0].replace(nn.Flatten())
    assert mlp["fc2"].output_shape == torch.Size([2, 10])
    with pytest.raises(GraphError, match="only call nodes"):
        mlp.inputs[0].replace(nn.ReLU())


def test_add_node_and_connect_skip():
    model, x = MLP().eval(), _x()
    graph = tg.trace(model, x)
    fc1, act = graph["fc1"], graph["act"]
    add = graph.add_node(operator.add, [act, fc1], name="skip")
    assert add.name == "skip" and add.users == [] and add.output_shape == torch.Size([2, 32])
    order = [n.name for n in graph]
    assert order.index("skip") == order.index("act") + 1  # placed after its last input
    graph.connect(add, graph["fc2"], slot=0)
    assert graph["fc2"].inputs == [(add, 0)]
    with torch.no_grad():
        h = model.fc1(x.flatten(1))
        expected = model.fc2(model.act(h) + h)
    torch.testing.assert_close(_run(graph, x), expected)
    # a module node
    drop = graph.add_node(nn.Dropout(0.5), [add], name="drop")
    assert drop.target == "drop" and drop.op_type is nn.Dropout
    graph.connect(drop, graph["fc2"], slot=0)
    torch.testing.assert_close(_run(graph, x), expected)  # eval: dropout is identity


def test_connect_appends_to_cat_list_and_breaks_shapes():
    model, x = Branches(), _x()
    graph = tg.trace(model, x)
    extra = graph.add_node(nn.Conv2d(1, 2, 1), [graph.inputs[0]], name="c")
    cat = graph.nodes(op_type=torch.cat)[0]
    graph.connect(extra, cat)  # slot=None: into the list
    assert [src.name for src, _ in cat.inputs] == ["a", "b", "c"]
    assert cat.output_shape == torch.Size([2, 12, 8, 8])
    with pytest.raises(InvalidSample, match=r"While executing %fc : Linear\(in_features=640.*\n.*%flatten -> \[2, 768\]"):
        graph["fc"].output_shape
    assert cat.output_shape == torch.Size([2, 12, 8, 8])  # shapes before the broken node stay readable
    with pytest.raises(InvalidSample, match="%fc"):
        graph.flops()
    text = str(graph)  # printing never raises
    assert "shapes do not fit" in text and "%cat : torch.cat -> [2, 12, 8, 8]" in text and "%fc : Linear" in text
    graph["fc"].replace(nn.Linear(12 * 8 * 8, 10))
    assert graph["fc"].output_shape == torch.Size([2, 10])
    assert _run(graph, x).shape == (2, 10)


def test_disconnect_from_list_and_replace_to_fix():
    model, x = Branches(), _x()
    graph = tg.trace(model, x)
    cat = graph.nodes(op_type=torch.cat)[0]
    graph.disconnect(graph["b"], cat)
    assert [src.name for src, _ in cat.inputs] == ["a"]
    assert graph["b"].users == []
    with pytest.raises(InvalidSample, match=r"%fc.*\n.*\[2, 256\]"):
        graph.output.inputs[0][0].output_shape
    graph["fc"].replace(nn.Linear(4 * 8 * 8, 10))
    assert _run(graph, x).shape == (2, 10)
    with pytest.raises(GraphError, match="not an input"):
        graph.disconnect(graph["b"], cat)


def test_disconnect_positional_and_output_rules():
    model, x = MLP(), _x()
    graph = tg.trace(model, x)
    with pytest.raises(GraphError, match="only output"):
        graph.disconnect(graph["fc2"], graph.output)
    fc1 = graph["fc1"]
    graph.disconnect(graph["flatten"], fc1)
    assert fc1.inputs == []
    with pytest.raises(InvalidSample, match="While executing %fc1"):
        fc1.output_shape
    graph.connect(graph["flatten"], fc1)
    assert fc1.output_shape == torch.Size([2, 32])


def test_connect_moves_nodes_and_refuses_cycles():
    model, x = Branches(), _x()
    graph = tg.trace(model, x)
    a, b = graph["a"], graph["b"]
    add = graph.add_node(operator.add, [a, a], name="mix")  # placed after a, before b
    graph.connect(graph.add_node(nn.Conv2d(6, 4, 1), [b], name="bid"), add, slot=1)  # bid was after mix
    order = [n.name for n in graph]
    assert order.index("b") < order.index("bid") < order.index("mix")
    graph.connect(add, graph.nodes(op_type=torch.cat)[0])
    assert graph.nodes(op_type=torch.cat)[0].output_shape == torch.Size([2, 14, 8, 8])
    with pytest.raises(GraphError, match="cycle"):
        graph.connect(graph["fc"], a, slot=0)
    with pytest.raises(GraphError, match="slot"):
        graph.connect(a, graph["fc"], slot=5)


def test_connect_output_grows_tuple():
    model, x = MLP(), _x()
    graph = tg.trace(model, x)
    graph.connect(graph["fc1"], graph.output)
    out = _run(graph, x)
    assert isinstance(out, tuple) and out[0].shape == (2, 10) and out[1].shape == (2, 32)
    assert graph.output.output_shape == (torch.Size([2, 10]), torch.Size([2, 32]))


def test_edits_on_foreign_nodes_fail():
    g1, g2 = tg.trace(MLP(), _x()), tg.trace(MLP(), _x())
    with pytest.raises(GraphError, match="does not belong"):
        g1.insert_after(g2["fc1"], nn.ReLU())
    with pytest.raises(TypeError, match="nn.Module"):
        g1.insert_after(g1["fc1"], F.relu)


def test_copy_is_independent():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    clone = graph.copy()
    assert clone.fingerprint() == graph.fingerprint()
    assert clone["conv1"].module is not graph["conv1"].module
    torch.testing.assert_close(clone["conv1"].module.weight, graph["conv1"].module.weight)
    clone.insert_after(clone["conv1"], nn.ReLU())
    clone["conv1"].module.weight.data.zero_()
    assert len(clone) == len(graph) + 1 and clone.fingerprint() != graph.fingerprint()
    assert model.conv1.weight.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(_run(graph, x), model(x))
    assert _run(clone, x).shape == (2, 10)


def test_shapes_repropagate_lazily():
    graph = tg.trace(SmallCNN(), _x())
    assert graph["conv1"].output_shape == torch.Size([2, 16, 8, 8])
    version = graph._version
    graph["conv1"].replace(nn.Conv2d(1, 16, 3, padding=0))  # 6x6 now: fc no longer fits
    assert graph._version == version + 1 and graph._shapes_version == version  # nothing ran yet
    with pytest.raises(InvalidSample, match=r"%fc .*\n.*\[2, 288\]"):
        graph["fc"].output_shape
    # the shapes before the failing node are still readable, to repair it
    assert graph["flatten"].output_shape == torch.Size([2, 288])
    graph["fc"].replace(nn.Linear(graph["flatten"].output_shape[1], 10))
    assert graph.output.output_shape == torch.Size([2, 10])


def test_insert_after_an_input():
    model, x = SmallCNN().eval(), _x()
    graph = tg.trace(model, x)
    norm = graph.insert_after(graph.inputs[0], nn.BatchNorm2d(1).eval())
    assert graph["conv1"].inputs == [(norm, 0)] and graph.inputs[0].users == [norm]
    with torch.no_grad():
        torch.testing.assert_close(_run(graph, x), model(norm.module(x)))
