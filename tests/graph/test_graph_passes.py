"""Passes: shape propagation side effects, parameter counts, FLOP estimates, node.meta."""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
from graph_models import MLP, Encoder, LSTMClassifier, SmallCNN, torch_resnet18

import tridens.graph as tg


def test_shape_propagation_changes_nothing():
    model, x = SmallCNN(), torch.randn(1, 1, 8, 8)  # batch 1 in train mode: BN would refuse it
    model.train()
    model.drop.eval()
    stats = model.bn1.running_mean.clone(), model.bn1.num_batches_tracked.clone()
    graph = tg.trace(model, x)
    assert graph["fc"].output_shape == torch.Size([1, 10])
    assert torch.equal(model.bn1.running_mean, stats[0]) and torch.equal(model.bn1.num_batches_tracked, stats[1])
    assert model.training and model.bn1.training and not model.drop.training
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tg.trace(model, x).output.output_shape
    assert torch.equal(torch.rand(3), expected)  # the RNG stream is untouched


def test_meta_holds_what_passes_learn():
    graph = tg.trace(SmallCNN(), torch.randn(2, 1, 8, 8))
    conv = graph["conv1"]
    graph.fingerprint()
    graph.flops()
    assert conv.meta["tridens.shape"] == torch.Size([2, 16, 8, 8])
    assert conv.meta["tridens.dtype"] == torch.float32
    assert conv.meta["tridens.prefix_fp"][1] == conv.prefix_fingerprint()
    assert conv.meta["tridens.flops"] == 2 * 2 * 16 * 8 * 8 * 9 + 2 * 16 * 8 * 8


def test_num_params():
    model = SmallCNN()
    graph = tg.trace(model)
    assert graph.num_params() == sum(p.numel() for p in model.parameters())
    model.conv1.weight.requires_grad_(False)
    assert graph.num_params(trainable_only=True) == graph.num_params() - model.conv1.weight.numel()
    graph.remove(graph["bn2"])
    assert graph.num_params() == sum(p.numel() for p in model.parameters()) - 64

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(self.fc(x)) * self.fc.weight.sum()

    tied = tg.trace(Tied())
    assert tied.num_params() == 20


def test_flops_mlp_exact():
    graph = tg.trace(MLP(32), torch.randn(2, 1, 8, 8))
    fc1 = 2 * 2 * 32 * 64 + 2 * 32
    relu = 2 * 32
    fc2 = 2 * 2 * 10 * 32 + 2 * 10
    assert graph.flops() == fc1 + relu + fc2
    assert graph.nodes(op_type="flatten")[0].meta["tridens.flops"] == 0


def test_flops_matmul_and_functions():
    class Attention(nn.Module):
        def forward(self, q, k):
            scores = torch.matmul(q, k.transpose(-1, -2))
            return scores.softmax(-1) @ k

    q, k = torch.randn(2, 5, 4), torch.randn(2, 7, 4)
    graph = tg.trace(Attention(), (q, k))
    matmul = graph.nodes(op_type=torch.matmul)[0]
    at = graph.nodes(op_type=operator.matmul)[0]
    total = graph.flops()
    assert matmul.meta["tridens.flops"] == 2 * (2 * 5 * 7) * 4
    assert at.meta["tridens.flops"] == 2 * (2 * 5 * 4) * 7
    assert total == 2 * 2 * 5 * 7 * 4 + 3 * 2 * 5 * 7 + 2 * 2 * 5 * 4 * 7


def test_flops_resnet18_and_composites():
    graph = tg.trace(torch_resnet18(), torch.randn(1, 3, 32, 32))
    # ~1.82 GMACs at 224x224 scale by (32/224)^2: about 37 MMACs, 74 MFLOPs
    assert 60e6 < graph.flops() < 90e6
    enc = tg.trace(Encoder().eval(), torch.randn(3, 5, 8))
    assert enc.nodes(op_type=nn.TransformerEncoderLayer)[0].meta.get("tridens.flops") is None
    enc.flops()
    layer = enc.nodes(op_type=nn.TransformerEncoderLayer)[0].meta["tridens.flops"]
    # 4 projections of 16x16, 2 feed-forward 16x32 layers on 15 tokens dominate
    assert layer > 2 * 15 * (4 * 16 * 16 + 2 * 16 * 32)
    lstm = tg.trace(LSTMClassifier(12), torch.randn(3, 6, 8))
    lstm.flops()
    assert lstm.nodes(op_type=nn.LSTM)[0].meta["tridens.flops"] == 2 * 18 * (48 * 8 + 48 * 12)
