"""forward_flops: matmul-like FLOPs of an eager forward, counted as it runs."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tridens.graph import forward_flops


class Mixed(nn.Module):
    """Modules, functional calls, matmul methods and attention in one forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, groups=4)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.fc = nn.Linear(4 * 12 * 12, 32)
        self.w = nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        x = self.up(F.relu(self.grouped(F.relu(self.conv(x)))))
        h = self.fc(x.flatten(1)) @ self.w                       # (B, 16)
        h = torch.addmm(torch.zeros(16), h, torch.eye(16))
        q = h.view(-1, 2, 4, 2)                                   # (B, heads, L, E)
        att = F.scaled_dot_product_attention(q, q, q)
        return torch.bmm(att.flatten(0, 1), q.flatten(0, 1).transpose(1, 2)).sum((1, 2))


def test_matches_torch_flop_counter_on_matmul_like_ops():
    model, x = Mixed().eval(), torch.randn(5, 3, 8, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    attention = 4 * (5 * 2 * 4) * 4 * 2  # torch's counter has no rule for CPU attention: 4 * B*H*L * S * E
    with torch.no_grad():
        assert forward_flops(model, x) == counter.get_total_flops() + attention


def test_counts_recurrent_and_attention_layers():
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)
    x = torch.randn(3, 5, 8)
    weights = sum(p.numel() for n, p in lstm.named_parameters() if n.startswith("weight"))
    assert forward_flops(lstm, x) == 2 * 3 * 5 * weights
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2], batch_first=True)
    assert forward_flops(lstm, packed) == 2 * (5 + 4 + 2) * weights
    attention, q = nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(2, 5, 16)
    b, length, e, heads = 2, 5, 16, 2
    projections = 4 * (2 * b * length * e * e + b * length * e)  # q, k, v and out, with their biases
    assert forward_flops(attention, q, q, q) == projections + 4 * b * length * length * e + 3 * b * heads * length ** 2


def test_counting_needs_no_dynamo():
    """torch.utils.flop_counter imports torch._dynamo on first use: about a second of CPU per process."""
    code = ("import sys, torch, torch.nn as nn\n"
            "from tridens.executors._threads import step_flops\n"
            "assert step_flops(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), torch.zeros(1, 8, 8), 4) > 0\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
