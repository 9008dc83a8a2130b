"""Function preservation (Net2Wider, Net2Deeper), centred kernels, BatchNorm statistics."""

import torch
from torch import nn

import tridens as td
from tridens.warmup import align, describe, replication_map, transfer


def mlp(h, depth=1):
    layers = [nn.Flatten(), nn.Linear(64, h), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(h, h), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(h, 10))


def cnn(w, k=3, hidden_k=3):
    return nn.Sequential(nn.Conv2d(1, w, k, padding=k // 2), nn.BatchNorm2d(w), nn.ReLU(),
                         nn.Conv2d(w, w, hidden_k, padding=hidden_k // 2), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(w * 16, 10))


def _same(child, parent, x, atol=1e-5):
    child.eval(), parent.eval()
    with torch.no_grad():
        a, b = child(x), parent(x)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


def _val(data):
    return data[1].tensors[0][:200]


def test_net2wider_mlp_preserves_function(digits_data, train):
    torch.manual_seed(0)
    parent = train(mlp(16), digits_data)
    child = mlp(40)
    score, stats = td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    assert 0 < score < 1 and stats["transformed"] == 4
    _same(child, parent, _val(digits_data))
    # the replicas really are copies: a widened unit equals its source
    g = replication_map(16, 40)
    assert torch.equal(child[1].weight[20], parent[1].weight[g[20]])


def test_net2wider_cnn_preserves_function(digits_data, train):
    torch.manual_seed(0)
    parent = train(cnn(6), digits_data)
    child = cnn(11)
    td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    _same(child, parent, _val(digits_data))


def test_net2deeper_identity_layers(digits_data, train):
    torch.manual_seed(0)
    parent = train(mlp(16), digits_data)
    child = mlp(16, depth=3)
    _, stats = td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    assert stats["identity"] == 2
    _same(child, parent, _val(digits_data))
    # wider and deeper at once
    child = mlp(24, depth=2)
    td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    _same(child, parent, _val(digits_data))


def test_net2deeper_conv(digits_data, train):
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10))
    parent = train(parent, digits_data, epochs=1)
    child = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(256, 10))
    _, stats = td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    assert stats["identity"] == 1
    _same(child, parent, _val(digits_data))


def test_kernels_are_centred():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 9, 9)
    small = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1))
    big = nn.Sequential(nn.Conv2d(3, 5, 5, padding=2))  # padding adjusted to the kernel
    td.warmup.warm_start(big, small, x, x)
    assert torch.equal(big[0].weight[:, :, 1:4, 1:4], small[0].weight)
    assert big[0].weight[:, :, 0].abs().sum() == 0 and big[0].weight[:, :, :, 4].abs().sum() == 0
    _same(big, small, x)
    # and cropped from the centre the other way
    small2 = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1))
    td.warmup.warm_start(small2, big, x, x)
    assert torch.equal(small2[0].weight, big[0].weight[:, :, 1:4, 1:4])


def test_batchnorm_statistics_carried(digits_data, train):
    torch.manual_seed(0)
    parent = train(cnn(6), digits_data, epochs=1)
    bn = parent[1]
    assert bn.num_batches_tracked > 0 and bn.running_var.sub(1).abs().max() > 1e-3
    same = cnn(6)
    td.warmup.warm_start(same, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    for name in ("running_mean", "running_var", "weight", "bias", "num_batches_tracked"):
        assert torch.equal(getattr(same[1], name), getattr(bn, name)), name
    wide = cnn(9)
    td.warmup.warm_start(wide, parent, _val(digits_data)[:2], _val(digits_data)[:2])
    g = replication_map(6, 9)
    assert torch.equal(wide[1].running_mean, bn.running_mean[g])
    assert torch.equal(wide[1].running_var, bn.running_var[g])


def test_narrower_child_takes_a_slice():
    torch.manual_seed(0)
    parent, child = mlp(32), mlp(8)
    x = torch.zeros(2, 1, 8, 8)
    cd, pd = describe(child, x), describe(parent, x)
    s, pairs = align(cd, pd)
    assert s == 1.0
    new, _ = transfer(cd, pd, pairs, parent.state_dict(), child.state_dict())
    assert torch.equal(new["1.weight"], parent[1].weight[:8])
    assert torch.equal(new["3.weight"], parent[3].weight[:, :8])


def test_zero_widening_preserves_function_with_fresh_units(digits_data, train):
    """widen="zero" (the zoo's default): extra units keep their init, consumers see them with zero
    weights -- the same function, and the new units are not copies of old ones."""
    torch.manual_seed(0)
    parent = train(mlp(16), digits_data)
    child = mlp(40, depth=2)
    init = child[1].weight.detach().clone()
    td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2], widen="zero")
    _same(child, parent, _val(digits_data))
    assert torch.equal(child[1].weight[:16], parent[1].weight)
    assert torch.equal(child[1].weight[16:], init[16:])                 # fresh units keep their init
    assert child[5].weight[:, 16:].abs().sum() == 0                     # ... and start unheard (head)
    torch.manual_seed(0)
    pcnn = train(cnn(6), digits_data, epochs=1)                        # BatchNorm and a flatten
    ccnn = cnn(11)
    td.warmup.warm_start(ccnn, pcnn, _val(digits_data)[:2], _val(digits_data)[:2], widen="zero")
    _same(ccnn, pcnn, _val(digits_data))


def test_noise_widening_breaks_symmetry_and_stays_close(digits_data, train):
    torch.manual_seed(0)
    parent = train(mlp(16), digits_data)
    child = mlp(40)
    td.warmup.warm_start(child, parent, _val(digits_data)[:2], _val(digits_data)[:2], widen="noise")
    g = replication_map(16, 40)
    assert not torch.equal(child[1].weight[20], parent[1].weight[g[20]])
    _same(child, parent, _val(digits_data), atol=0.2)
