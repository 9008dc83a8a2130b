"""math functions on traced values become call_function nodes (fx's autowrap, with wrappers made
once per process), and the math module is itself again after every trace, failed ones included."""

from __future__ import annotations

import math
import warnings
from math import sqrt

import torch
import torch.nn as nn

import tridens.graph as tg

_ORIGINALS = {k: v for k, v in vars(math).items() if not k.startswith("_") and callable(v)}


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        scale = math.sqrt(x.size(-1)) + sqrt(x.size(0)) + math.prod([x.size(0), x.size(1)])
        return self.fc(x) / scale + math.pi


class Branchy(nn.Module):
    def forward(self, x):
        if math.isfinite(x.sum()):  # data-dependent control flow: fx fails, the model is opaque
            return x
        return -x


def _math_is_itself():
    return all(getattr(math, k) is v for k, v in _ORIGINALS.items())


def test_math_calls_are_nodes_and_math_is_restored():
    model = Scaled()
    x = torch.randn(2, 4)
    graph = tg.trace(model, x)
    targets = {n.target for n in graph._fx.nodes if n.op == "call_function"}
    assert {math.sqrt, sqrt, math.prod} <= targets
    assert _math_is_itself()
    torch.testing.assert_close(graph.to_module()(x), model(x))
    assert tg.trace(Scaled(), x).fingerprint() == graph.fingerprint()


def test_math_is_restored_after_a_failed_trace():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = tg.trace(Branchy(), torch.randn(2, 2))
    assert len([n for n in graph._fx.nodes if n.op == "call_module"]) == 1  # one opaque node
    assert _math_is_itself()
    assert math.sqrt(4.0) == 2.0
