"""Counting a space's samples stays polynomial in its labels: N optional layers, each with a
width that exists only when its layer does, hold (1 + widths) ** N samples."""

import random

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.space import Categorical, Condition, LabelSpec, SearchSpace

WIDTHS = [8, 16, 32]


class OptionalLayers(tnn.ModelSpace):
    """``n`` optional hidden layers; layer i's width is a label only when layer i is used."""

    def __init__(self, n: int = 40):
        super().__init__()
        layers, width = [], 4
        for i in range(n):
            if td.choice(f"use{i}", [False, True]):
                out = td.choice(f"width{i}", WIDTHS)
                layers += [nn.Linear(width, out), nn.ReLU()]
                width = out
        self.body = nn.Sequential(*layers, nn.Linear(width, 2))
        self.example_inputs = (torch.zeros(2, 4),)

    def forward(self, x):
        return self.body(x)


def test_forty_optional_layers_are_counted_exactly():
    space = OptionalLayers(40)
    # each layer: absent (1) or present with one of the widths
    assert space.size() == float((1 + len(WIDTHS)) ** 40)


def test_a_strategy_proposes_from_a_space_of_sixty_optional_layers():
    space = OptionalLayers(60).search_space()
    strategy = td.strategy.Random()
    strategy.start(space, td.Objective(), random.Random(0))
    group = strategy.ask(4)
    assert len(group.samples) == 4
    assert all(space.validate(s) == s for s in group.samples)


def test_shared_parents_and_unused_parents_are_counted_like_the_enumeration():
    # "b" hangs under "a"; "c" under "a" and "b"; "d" under nothing
    specs = [LabelSpec("a", Categorical([0, 1, 2])),
             LabelSpec("b", Categorical(["x", "y"]), [Condition("a", (1, 2))]),
             LabelSpec("c", Categorical([1, 2, 3, 4]), [Condition("a", (2,)), Condition("b", ("y",))]),
             LabelSpec("d", Categorical([True, False]))]
    space = SearchSpace(specs)
    assert space.size() == float(len(list(space.grid())))
