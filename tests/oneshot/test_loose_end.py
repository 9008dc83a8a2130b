"""One-shot supernets of loose-end cells (``tnn.Cell(merge_op="loose_end")``): the supernet
concatenates every node and masks the nodes a path reads; a subnet built alone (only its loose
ends, the next layers narrower) takes the matching columns of the supernet's weights and computes
the supernet's path, and every one-shot strategy searches such a space on the digits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tridens as td
from tridens import hub
from tridens import nn as tnn
from tridens.oneshot import build_supernet
from tridens.store import Store


class LooseEnd(tnn.ModelSpace):
    """Three nodes of two ops each; the head is sized by the cell's loose ends, and a
    BatchNorm follows its first convolution (its statistics take the kept channels too)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.cell = tnn.Cell({"conv": lambda n, k, i: nn.Conv2d(8, 8, 3, padding=1),
                              "pool": lambda n, k, i: nn.MaxPool2d(3, 1, 1)},
                             num_nodes=3, num_ops_per_node=2, num_predecessors=1, merge_op="loose_end", label="cell")
        width = 8 * len(self.cell.output_nodes)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(width, 16, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cell(self.stem(x)))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    _, val = td.datasets.digits()
    x, y = val.tensors
    return x[:32], y[:32]


def test_every_subnet_of_a_loose_end_cell_is_the_supernet_path() -> None:
    x, _ = _digits()
    space = LooseEnd()
    net = build_supernet(space, example_inputs=(x[:4],))  # verifies 24 paths against space.freeze
    widths = set()
    for seed in range(12):
        sample = space.random_sample(seed)
        child = net.extract(sample)
        widths.add(len(child.cell.output_nodes))
        net.set_path(sample)
        net.model.eval(), child.eval()
        with torch.no_grad():
            assert torch.allclose(net.model(x), child(x), atol=1e-5)
    assert len(widths) > 1  # the wirings differ in how many nodes are loose ends


def test_darts_mixes_loose_ends_by_the_probability_no_op_reads_them() -> None:
    space = LooseEnd()
    net = build_supernet(space, verify=False)
    cell = net.model.cell
    probs = {label: torch.softmax(torch.randn(len(values)), 0) for label, values in net.state.values.items()}
    net.set_weights(probs)
    weights = cell.loose_weights()
    # node 1 may be read by the two ops of nodes 2 and 3; node 3 by none
    read_1 = [probs[f"cell/input_{n}_{k}"][1] for n in (2, 3) for k in (0, 1)]
    expected = torch.prod(torch.stack([1 - p for p in read_1]))
    assert torch.allclose(weights[0], expected) and weights[2] is None
    one_hot = {label: torch.nn.functional.one_hot(p.argmax(), len(p)).float() for label, p in probs.items()}
    net.set_weights(one_hot)
    hard = [float(w) if w is not None else None for w in cell.loose_weights()]
    net.set_path({label: net.state.values[label][int(p.argmax())] for label, p in probs.items()})
    assert hard == [float(w) if w is not None else None for w in cell.loose_weights()]


@pytest.mark.parametrize("strategy", [
    "DARTS", pytest.param("GumbelDARTS", marks=pytest.mark.slow),
    pytest.param("ENAS", marks=pytest.mark.slow), pytest.param("RandomOneShot", marks=pytest.mark.slow)])
def test_one_shot_strategies_search_a_loose_end_space(tmp_path: Path, strategy: str) -> None:
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, optimizer="adam", lr=3e-3)
    exp = td.Experiment(LooseEnd(), ev, getattr(td.oneshot, strategy)(samples=8), store=tmp_path / "t.db",
                        options=td.RunOptions(verbose=False))
    exp.run()
    subnets = [t for t in exp.trials() if t.info["oneshot"]["role"] == "subnet"]
    assert len(subnets) == 8 and max(t.metric for t in subnets) > 0.2  # twice chance after 2 epochs
    # a stored subnet is the frozen model of its sample, with the weights it was scored with
    best = exp.top(1)[0]
    model = LooseEnd().freeze(exp.space.restrict(best.sample))
    with Store(tmp_path / "t.db", readonly=True) as store:
        model.load_state_dict(store.load_checkpoint(best.checkpoint))
    x, y = val.tensors
    with torch.no_grad():
        assert float((model.eval()(x).argmax(1) == y).float().mean()) == pytest.approx(best.metric, abs=1e-6)


@pytest.mark.parametrize("name", ["NASNet", "ENAS", "AmoebaNet"])
def test_hub_loose_end_spaces_are_one_shot(name: str) -> None:
    space = getattr(hub, name)(width=4, num_cells=3, in_channels=1)
    x, _ = _digits()
    net = build_supernet(space, example_inputs=(x[:2],), max_checks=6)
    sample = space.random_sample(3)
    net.set_path(sample)
    child = net.extract(sample)
    net.model.eval(), child.eval()
    with torch.no_grad():
        assert torch.allclose(net.model(x[:4]), child(x[:4]), atol=1e-5)


def test_a_loose_end_space_without_inputs_is_refused_naming_them() -> None:
    space = LooseEnd()
    with pytest.raises(td.InvalidSpace, match="example_inputs"):
        build_supernet(space)
