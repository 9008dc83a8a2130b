"""Conditions on shapes in a forward are decided from the example inputs while tracing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tridens as td
from tridens.graph import OpaqueModuleWarning, ShapeSpecializedWarning


class FlatOrImage(nn.Module):
    """Takes flat (N, 64) or image (N, 1, 8, 8) digits: the most common shape check in user code."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        if x.dim() == 2:
            x = x.view(-1, 1, 8, 8)
        if x.ndim != 4 or x.shape[1] != 1:
            raise ValueError("not a digit")
        x = torch.relu(self.conv(x))
        return self.head(x.view(x.size(0), -1))  # a shape as a value: stays symbolic


class ValueCheck(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        if x.sum() > 0:  # a condition on values, not shapes
            x = -x
        return self.lin(x)


@pytest.fixture(scope="module")
def images():
    train, _ = td.datasets.digits()
    return train.tensors[0][:16]


def test_shape_conditions_become_a_graph_with_a_warning_naming_the_line(images):
    model = FlatOrImage()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = td.graph.trace(model, images.flatten(1))
    shape_warnings = [w for w in caught if issubclass(w.category, ShapeSpecializedWarning)]
    assert not [w for w in caught if issubclass(w.category, OpaqueModuleWarning)]
    messages = [str(w.message) for w in shape_warnings]
    assert len(messages) == 3 and "if x.dim() == 2:" in messages[0] and "(True)" in messages[0]
    assert "test_shape_conditions.py" in messages[0]
    assert all("if x.ndim != 4 or x.shape[1] != 1:" in m and "(False)" in m for m in messages[1:])  # both sides
    assert [n.op_type for n in g.nodes(op_type=nn.Conv2d)] == [nn.Conv2d]
    module = g.to_module()
    x = images.flatten(1)
    torch.testing.assert_close(module(x), model(x))
    more = torch.cat([x, x])  # another batch size: x.size(0) stayed symbolic
    torch.testing.assert_close(module(more), model(more))


def test_shape_conditions_without_example_inputs_and_value_conditions_stay_opaque(images):
    with pytest.warns(OpaqueModuleWarning):
        td.graph.trace(FlatOrImage())
    with pytest.warns(OpaqueModuleWarning, match="whole model ValueCheck"):
        td.graph.trace(ValueCheck(), images.flatten(1))
