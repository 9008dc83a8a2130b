"""A supernet over MultiheadAttention widths and head counts, on the digits' rows as a sequence:
slicing equals a fixed model given the sliced weights, weights mix the candidates, and one-shot
searches run end to end and export the chosen width."""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.errors import InvalidSpace
from tridens.oneshot import build_supernet
from tridens.oneshot._entangled import EntangledLayerNorm, EntangledLinear, EntangledMultiheadAttention
from tridens.trial import TrialStatus

from .spaces import spos_steps

EMBED, HEADS = [8, 16, 24], [2, 4]


def _tokens(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """An 8x8 digit as 8 tokens: each row's pixels and the row's one-hot ``position``."""
    rows = x.reshape(-1, 8, 8)
    return torch.cat([rows, position.expand_as(rows)], dim=-1)


class DigitsAttention(tnn.ModelSpace):
    """One self-attention layer over the digit rows, its width and head count chosen."""

    def __init__(self):
        super().__init__()
        e = td.choice("embed_dim", EMBED)
        h = td.choice("num_heads", HEADS)
        self.embed = nn.Linear(16, e)
        self.attn = nn.MultiheadAttention(e, h, batch_first=True)
        self.norm = nn.LayerNorm(e)
        self.head = nn.Linear(e, 10)
        self.register_buffer("position", torch.eye(8))
        self.example_inputs = (torch.rand(3, 1, 8, 8),)

    def forward(self, x):
        t = self.embed(_tokens(x, self.position))
        y = self.attn(t, t, t, need_weights=False)[0]
        return self.head(self.norm(t + y).mean(1))


class FixedAttention(nn.Module):
    """The same network written without tridens, at one width and head count."""

    def __init__(self, e: int, h: int):
        super().__init__()
        self.embed = nn.Linear(16, e)
        self.attn = nn.MultiheadAttention(e, h, batch_first=True)
        self.norm = nn.LayerNorm(e)
        self.head = nn.Linear(e, 10)
        self.register_buffer("position", torch.eye(8))

    def forward(self, x):
        t = self.embed(_tokens(x, self.position))
        y = self.attn(t, t, t, need_weights=False)[0]
        return self.head(self.norm(t + y).mean(1))


def _trained_supernet(digits_data, steps=20):
    """A supernet after a few SPOS steps on digits (weights no longer at their initial values)."""
    torch.manual_seed(0)
    net = build_supernet(DigitsAttention())
    x, y = digits_data[0].tensors
    spos_steps(net, x, y, steps)
    return net


def _copy_sliced(net, e: int, h: int) -> FixedAttention:
    """A FixedAttention(e, h) holding the supernet's leading slices, copied by hand."""
    big = max(EMBED)
    sup = net.model
    fixed = FixedAttention(e, h)
    with torch.no_grad():
        fixed.embed.weight.copy_(sup.embed.weight[:e])
        fixed.embed.bias.copy_(sup.embed.bias[:e])
        w, b = sup.attn.in_proj_weight, sup.attn.in_proj_bias
        fixed.attn.in_proj_weight.copy_(torch.cat([w[:e, :e], w[big:big + e, :e], w[2 * big:2 * big + e, :e]]))
        fixed.attn.in_proj_bias.copy_(torch.cat([b[:e], b[big:big + e], b[2 * big:2 * big + e]]))
        fixed.attn.out_proj.weight.copy_(sup.attn.out_proj.weight[:e, :e])
        fixed.attn.out_proj.bias.copy_(sup.attn.out_proj.bias[:e])
        fixed.norm.weight.copy_(sup.norm.weight[:e])
        fixed.norm.bias.copy_(sup.norm.bias[:e])
        fixed.head.weight.copy_(sup.head.weight[:, :e])
        fixed.head.bias.copy_(sup.head.bias)
    return fixed


def test_the_supernet_holds_the_largest_attention_and_slices_it(digits_data):
    net = _trained_supernet(digits_data)
    attn = net.model.attn
    assert isinstance(attn, EntangledMultiheadAttention) and isinstance(attn.out_proj, EntangledLinear)
    assert isinstance(net.model.norm, EntangledLayerNorm)
    assert attn.in_proj_weight.shape == (3 * 24, 24) and attn.out_proj.weight.shape == (24, 24)
    assert net.claimed["embed_dim"] and net.claimed["num_heads"]
    x = digits_data[1].tensors[0][:64]
    net.model.eval()
    for e in EMBED:
        for h in HEADS:
            sample = {"embed_dim": e, "num_heads": h}
            fixed = _copy_sliced(net, e, h).eval()
            net.set_path(sample)
            with torch.no_grad():
                got = net.model(x)
                want = fixed(x)  # nn.MultiheadAttention's own (fast-path) kernel
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (sample, (got - want).abs().max())
            # the extracted subnet is the frozen model of the sample with exactly those weights
            child = net.extract(sample)
            assert child.attn.embed_dim == e and child.attn.num_heads == h
            for name, tensor in fixed.state_dict().items():
                assert torch.equal(child.state_dict()[name], tensor), name
    # in training mode (the slow path, gradients through the slices) it matches too
    net.model.train()
    net.set_path({"embed_dim": 16, "num_heads": 4})
    fixed = _copy_sliced(net, 16, 4).train()
    got, want = net.model(x), fixed(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    grad = net.model.attn.in_proj_weight.grad
    assert grad[:16, :16].abs().sum() > 0 and grad[16:24].abs().sum() == 0 and grad[24 + 16:48].abs().sum() == 0


def test_one_hot_weights_reproduce_each_path_and_soft_weights_carry_gradients(digits_data):
    net = _trained_supernet(digits_data, steps=5)
    net.model.eval()
    x = digits_data[1].tensors[0][:32]
    values = net.state.values
    for sample in ({"embed_dim": 8, "num_heads": 4}, {"embed_dim": 24, "num_heads": 2}):
        probs = {label: torch.tensor([1.0 if v == sample[label] else 0.0 for v in values[label]]) for label in sample}
        net.set_path(sample)
        with torch.no_grad():
            path = net.model(x)
        net.set_weights(probs)
        with torch.no_grad():
            mixed = net.model(x)
        assert torch.allclose(path, mixed, rtol=1e-5, atol=1e-6)
    alpha = {label: torch.zeros(len(v), requires_grad=True) for label, v in values.items()}
    net.set_weights({label: F.softmax(a, -1) for label, a in alpha.items()})
    F.cross_entropy(net.model(x), digits_data[1].tensors[1][:32]).backward()
    assert all(a.grad is not None and a.grad.abs().sum() > 0 for a in alpha.values())


class AttentionOptions(tnn.ModelSpace):
    """An attention with one of nn.MultiheadAttention's options set; width, heads and dropout chosen."""

    def __init__(self, bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, batch_first=True,
                 key_padding_mask=False, need_weights=False):
        super().__init__()
        e, h = td.choice("embed_dim", [4, 8]), td.choice("num_heads", [1, 2])
        self.batch_first, self.key_padding_mask, self.need_weights = batch_first, key_padding_mask, need_weights
        self.query = nn.Linear(6, e)
        self.memory = nn.Linear(6, e) if kdim is None else nn.Identity()
        self.attn = nn.MultiheadAttention(e, h, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                          kdim=kdim, vdim=kdim, batch_first=batch_first,
                                          dropout=td.choice("dropout", [0.0, 0.1]))
        self.out = nn.Linear(e, 3)
        self.example_inputs = (torch.randn(2, 5, 6), torch.randn(2, 5, kdim or 6))

    def forward(self, x, m):
        q, kv = self.query(x), self.memory(m)
        if not self.batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        mask = torch.arange(5).expand(2, 5) == 4 if self.key_padding_mask else None
        y, w = self.attn(q, kv, kv, key_padding_mask=mask, need_weights=self.need_weights)
        if not self.batch_first:
            y = y.transpose(0, 1)
        out = self.out(y).mean(1)
        return (out, w) if self.need_weights else out


@pytest.mark.parametrize("options", [{"bias": False}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 7},
                                     {"batch_first": False}, {"key_padding_mask": True}, {"need_weights": True}],
                         ids=lambda o: next(iter(o)))
def test_every_attention_option_slices_like_the_model_built_alone(options):
    space = AttentionOptions(**options)
    net = build_supernet(space)  # checks paths against space.freeze on the example inputs
    net.model.eval()
    sample = {"embed_dim": 4, "num_heads": 2, "dropout": 0.0}
    child = space.freeze(sample).eval()
    child.load_state_dict(net.extract(sample).state_dict())
    net.set_path(sample)
    with torch.no_grad():
        path, alone = net.model(*space.example_inputs), child(*space.example_inputs)
    net.set_weights({label: torch.tensor([1.0 if v == sample[label] else 0.0 for v in net.state.values[label]])
                     for label in sample})
    with torch.no_grad():
        mixed = net.model(*space.example_inputs)
    for got in (path, mixed):
        for a, b in zip(got if isinstance(got, tuple) else (got,), alone if isinstance(alone, tuple) else (alone,)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kdim_chosen_apart_from_embed_dim_is_refused():
    class KeyWidth(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            e = td.choice("embed_dim", [8, 16])
            self.attn = nn.MultiheadAttention(e, 2, kdim=td.choice("kdim", [4, 8]), vdim=4)

        def forward(self, q, k, v):
            return self.attn(q, k, v)[0]

    with pytest.raises(InvalidSpace, match=r"label 'kdim' sets the attention's kdim apart from its embed_dim"):
        build_supernet(KeyWidth(), verify=False)


@pytest.fixture
def evaluator(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)


def test_random_one_shot_searches_widths_and_retrains_the_best(tmp_path, evaluator):
    exp = td.Experiment(DigitsAttention(), evaluator, td.oneshot.RandomOneShot(samples=5, population=3, retrain=1),
                        store=tmp_path / "t.db", name="attention", options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    subnets = [t for t in trials if t.info["oneshot"]["role"] == "subnet"]
    [retrained] = [t for t in trials if t.info["oneshot"]["role"] == "retrain"]
    assert len(subnets) == 5 and all(t.status is TrialStatus.COMPLETED for t in subnets)
    assert max(t.metric for t in subnets) > 0.3  # chance is 0.1: the shared attention learned the digits
    best = max(subnets, key=lambda t: (t.metric, -t.metrics["val_loss"][-1], -t.id))
    assert retrained.status is TrialStatus.COMPLETED and retrained.sample == best.sample
    out = exp.export(tmp_path / "export")
    models = {path.name: td.load(path) for path in out}
    for trial, model in zip(exp.top(len(out)), models.values()):
        assert model.attn.embed_dim == trial.sample["embed_dim"] and model.attn.num_heads == trial.sample["num_heads"]
        assert model.attn.in_proj_weight.shape == (3 * trial.sample["embed_dim"], trial.sample["embed_dim"])


def test_darts_mixes_widths_and_head_counts(tmp_path, evaluator):
    exp = td.Experiment(DigitsAttention(), evaluator, td.oneshot.DARTS(samples=3, search="random", warmup=0.25),
                        store=tmp_path / "t.db", name="attention-darts", options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    [supernet] = [t for t in trials if t.info["oneshot"]["role"] == "supernet"]
    probs = supernet.info["oneshot"]["probabilities"]
    assert set(probs) == {"embed_dim", "num_heads"}
    assert len(probs["embed_dim"]) == 3 and probs["embed_dim"] != pytest.approx([1 / 3] * 3, abs=1e-4)
    subnets = [t for t in trials if t.info["oneshot"]["role"] == "subnet"]
    assert subnets and all(t.status is TrialStatus.COMPLETED and 0.0 <= t.metric <= 1.0 for t in subnets)


def test_autoformer_is_searched_one_shot(tmp_path, digits_data):
    """td.hub.AutoFormer (NNI's space): SPOS over widths, depths, heads and MLP ratios; every
    subnet is scored with the supernet's sliced weights and exports at its own width."""
    space = td.hub.AutoFormer(search_embed_dim=(12, 24), search_mlp_ratio=(2.0, 4.0), search_num_heads=(2, 3),
                              search_depth=(1, 2), img_size=8, patch_size=2, in_chans=1, num_classes=10)
    evaluator = td.evaluators.Classification(*digits_data, epochs=3, batch_size=32, optimizer="adam", lr=0.002)
    exp = td.Experiment(space, evaluator, td.oneshot.RandomOneShot(samples=4, population=2), store=tmp_path / "t.db",
                        name="autoformer", options=td.RunOptions(verbose=False)).run()
    subnets = [t for t in exp.trials() if t.info["oneshot"]["role"] == "subnet"]
    assert len(subnets) == 4 and all(t.status is TrialStatus.COMPLETED for t in subnets)
    assert max(t.metric for t in subnets) > 0.15  # chance is 0.1; a ViT learns slowly on 1,400 digits
    best = exp.top(1)[0]
    [path] = exp.export(tmp_path / "export", top=1)
    model = td.load(path)
    width = best.sample["embed_dim"]
    assert model.cls_token.weight.shape == (1, width) and model.head.in_features == width
    assert [block.attn.num_heads for block in model.blocks] == [best.sample[f"num_heads_{i}"]
                                                               for i in range(best.sample["depth"])]
