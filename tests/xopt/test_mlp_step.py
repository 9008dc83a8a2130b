"""The fused MLP step's pieces: dropout masks bit-identical to ``F.dropout``'s, the (K, C, B)
output layout of the grouped program and its cross entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens.units import Job
from tridens.trial import Trial
from tridens.xopt import BatchingSettings
from tridens.xopt._batched import BatchedMember, _stacked_loss

PS = [0.0, 0.3, 0.5, 1.0, 0.2]


def mlp(p: float, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 10)).to(dtype)


def member(ps=PS, dtype=torch.float32, exact=True) -> BatchedMember:
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="sgd",
                                      lr=td.loguniform("lr", 1e-4, 1.0))
    jobs = []
    for i, p in enumerate(ps):
        torch.manual_seed(10 + i)
        jobs.append(Job(Trial(id=i, sample={"lr": 0.01 * (i + 1)}, seed=10 + i), mlp(p, dtype)))
    return BatchedMember(jobs, ev, settings=BatchingSettings(exact=exact))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_are_f_dropouts_bit_for_bit(dtype):
    """Each row is the mask F.dropout draws from that trial's stream (seeded like the separate
    trainer's), call after call, whatever the memory layout asked for."""
    m = member(dtype=dtype)
    shape = (64, 32)
    layouts = [None, torch.empty(len(PS), 32, 64, dtype=dtype).transpose(1, 2)]
    drawn = [m._draw(shape, dtype, PS, like=like) for like in layouts]
    for r, p in enumerate(PS):
        torch.manual_seed(10 + r)
        for mask in drawn:  # F.dropout of ones is its mask
            assert torch.equal(mask[r], F.dropout(torch.ones(shape, dtype=dtype), p, training=True)), (r, p)
    assert drawn[1].stride() == layouts[1].stride() and drawn[0].is_contiguous()


def test_grouped_outputs_are_class_major_and_their_loss_per_model():
    """Inexact settings: outputs (K, C, B) (one batched matmul); exact ones: each model's (B, C) as
    the separate model's Linear lays it out."""
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    exact = member()
    exact.begin_epoch()
    assert exact._train_outputs(x).is_contiguous()
    m = member(exact=False)
    m.begin_epoch()
    out = m._train_outputs(x)
    assert m.engine == "grouped kernels"
    assert out.shape == (len(PS), 64, 10) and out.transpose(1, 2).is_contiguous()
    losses = _stacked_loss(F.cross_entropy, out, y)
    expected = torch.stack([F.cross_entropy(o, y) for o in out])
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    contiguous = _stacked_loss(F.cross_entropy, out.contiguous(), y)  # the vmap engine's layout
    torch.testing.assert_close(contiguous, expected, rtol=1e-6, atol=1e-6)


def test_validation_accuracy_takes_the_first_maximum():
    """val_acc from the (K, C, B) outputs counts argmax's class (the first of tied maxima)."""
    m = member(ps=[0.0, 0.0])
    with torch.no_grad():
        for t in m.params.values():
            t.zero_()
        m.params["4.bias"][1, [3, 5]] = 2.0  # model 0: ten tied classes; model 1: classes 3 and 5
    m.begin_epoch()
    m.begin_validation()
    m.validate_batch(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 0, 3]))
    acc = m.end_validation()
    assert [acc[i]["val_acc"] for i in (0, 1)] == [0.5, 0.25]  # class 0, class 3 win their ties
