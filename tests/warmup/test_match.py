"""DP alignment scores, parent choice, k-medoids on a synthetic zoo."""


import numpy as np
import pytest
import torch
from torch import nn

import tridens as td
from tridens.warmup import align, describe, node_score, score

X = torch.zeros(2, 1, 8, 8)


def mlp(h, depth=1):
    layers = [nn.Flatten(), nn.Linear(64, h), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(h, h), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(h, 10))


def cnn(w, k=3):
    return nn.Sequential(nn.Conv2d(1, w, k, padding=k // 2), nn.BatchNorm2d(w), nn.ReLU(), nn.Flatten(), nn.Linear(w * 64, 10))


def test_identical_graph_scores_one():
    for m in (mlp(16), mlp(8, 3), cnn(4)):
        d = describe(m, X)
        assert score(d, d) == pytest.approx(1.0)


def test_partial_width_overlap_in_proportion():
    child, parent = describe(mlp(16), X), describe(mlp(8), X)
    lin_c, lin_p = child["nodes"][2], parent["nodes"][2]
    assert lin_c["p"] == [[16, 64], [16]] and lin_p["p"] == [[8, 64], [8]]
    # 8*64 + 8 of the child's 16*64 + 16 elements can be inherited
    assert node_score(lin_c, lin_p) == pytest.approx((8 * 64 + 8) / (16 * 64 + 16))
    head = (10 * 8 + 10) / (10 * 16 + 10)
    n = len(child["nodes"])  # input, flatten, linear, relu, linear, output
    assert score(child, parent) == pytest.approx((4 + 0.5 + head) / n)
    # the reverse (narrower child from a wider parent) inherits every child element
    assert score(parent, child) == pytest.approx(1.0)
    # not an integer division: a 9-wide parent gives more than an 8-wide one
    assert score(child, describe(mlp(9), X)) > score(child, parent) > 0.5


def test_type_mismatch_scores_zero():
    lin = describe(nn.Linear(4, 4), torch.zeros(1, 4))["nodes"][1]
    conv = describe(nn.Conv2d(4, 4, 1), torch.zeros(1, 4, 2, 2))["nodes"][1]
    assert node_score(lin, conv) == 0.0
    # a child made only of types the parent lacks scores 0
    a = describe(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh()), X)
    b = describe(nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU()), X)
    _, pairs = align(a, b)
    matched = {a["nodes"][i]["t"] for i, _ in pairs}
    assert not any("Conv" in t or "Tanh" in t for t in matched)


def test_extra_parent_layers_cost():
    shallow, deep = describe(mlp(16), X), describe(mlp(16, 3), X)
    assert score(deep, shallow) > 0.5            # the child's extra layers keep their init (cost 0)
    assert score(shallow, deep) < 1.0            # skipping the parent's layers costs 1 each


def test_branches_and_multiple_inputs_outputs():
    class Two(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.a, self.b = nn.Linear(4, w), nn.Linear(6, w)
            self.head1, self.head2 = nn.Linear(w, 2), nn.Linear(w, 3)

        def forward(self, x, y):
            h = torch.relu(self.a(x)) + torch.relu(self.b(y))
            return self.head1(h), self.head2(h)

    inputs = (torch.zeros(1, 4), torch.zeros(1, 6))
    p, c = Two(8), Two(12)
    p.eval()
    d = describe(c, inputs)
    assert score(d, d) == pytest.approx(1.0)
    s, pairs = align(d, describe(p, inputs))
    assert 0.5 < s < 1.0 and len(pairs) == len(d["nodes"])  # every node aligned, widths partial
    td.warmup.warm_start(c, p, inputs, inputs)
    with torch.no_grad():
        for o1, o2 in zip(c(*inputs), p(*inputs)):
            torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)


def test_parent_choice_bucket_then_accuracy(tmp_path):
    zoo = td.warmup.Zoo(tmp_path / "z.db", bucket=0.1)
    close_low = zoo.add(mlp(30), X, accuracy=0.80)       # same bucket as close_high
    close_high = zoo.add(mlp(28), X, accuracy=0.90)
    far_best = zoo.add(cnn(4), X, accuracy=0.99)          # most accurate, but another graph
    entry, s = zoo.match(mlp(32), X)
    assert entry.id == close_high.id and s > 0.8
    scores = zoo.scores(describe(mlp(32), X))
    assert scores[far_best.id] < scores[close_low.id]


def test_kmedoids_synthetic_zoo(tmp_path):
    zoo = td.warmup.Zoo(tmp_path / "z.db", cluster_threshold=10, probe=1)
    ids = {"mlp": [], "cnn": []}
    for w in (8, 12, 16, 20, 24, 28):
        ids["mlp"].append(zoo.add(mlp(w, 2), X, accuracy=0.5 + w / 100).id)
        ids["cnn"].append(zoo.add(cnn(w // 4 + 1), X, accuracy=0.5 + w / 100).id)
    clusters = zoo.clusters(force=True)
    assert len(clusters["medoids"]) == 4  # ceil(sqrt(12))
    # no cluster mixes the two families
    for m in clusters["medoids"]:
        members = {int(i) for i, med in clusters["assign"].items() if med == m}
        assert members <= set(ids["mlp"]) or members <= set(ids["cnn"])
    # matching through the medoids finds the same parent as the exhaustive scan
    for child in (mlp(22, 2), cnn(6)):
        d = describe(child, X)
        full = zoo.choose(zoo.scores(d))
        via = zoo.choose(zoo.candidates(d))
        assert via[0].id == full[0].id


def test_batched_scores_equal_single(tmp_path):
    zoo = td.warmup.Zoo(tmp_path / "z.db")
    models = [mlp(8), mlp(16, 2), cnn(3), cnn(5, 5), mlp(12, 3)]
    for i, m in enumerate(models):
        zoo.add(m, X, accuracy=0.5 + i / 100)
    child = describe(mlp(10, 2), X)
    batched = zoo.scores(child)
    for e in zoo:
        assert batched[e.id] == pytest.approx(score(child, e.desc))
        assert batched[e.id] == pytest.approx(align(child, e.desc)[0], abs=1e-9)


def test_signature_table_gives_the_same_scores_as_shape_arithmetic():
    """The batched scores gather MATCH values from a table of node signatures; they equal the
    per-pair shape arithmetic (``_match_matrix``) for every entry."""
    import random

    from tridens.warmup import _match

    def model(i):
        r = random.Random(i)
        layers, c = [], 1
        for _ in range(r.randint(1, 4)):
            w, k = r.choice([4, 8, 12]), r.choice([1, 3, 5])
            layers += [nn.Conv2d(c, w, k, padding=k // 2)] + ([nn.BatchNorm2d(w)] if r.random() < 0.5 else []) + [nn.ReLU()]
            c = w
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * 64, r.choice([10, 5])))

    x = torch.zeros(2, 1, 8, 8)
    encoded = [_match.encode(describe(model(i), x)) for i in range(25)]
    batch = _match.Batch(encoded)
    for child in encoded[:6]:
        fast = _match.scores(child, batch)
        for k, parent in enumerate(encoded):
            S = _match._match_matrix(child, parent.types[None], parent.dims[None], parent.ranks[None])
            slow = np.clip(_match._dp_last(S)[0, parent.n] / child.n, 0, 1)
            assert fast[k] == pytest.approx(slow, abs=1e-12)


class TwoBranch(nn.Module):
    """A residual block with a projection shortcut; ``shortcut_first`` only changes the order the
    code runs the two branches in (and so the traced topological order)."""

    def __init__(self, w, shortcut_first):
        super().__init__()
        self.stem = nn.Conv2d(1, w, 3, padding=1)
        self.a1, self.a2 = nn.Conv2d(w, w, 3, padding=1), nn.Conv2d(w, w, 3, padding=1)
        self.short = nn.Conv2d(w, w, 1)
        self.head = nn.Linear(w * 64, 10)
        self.shortcut_first = shortcut_first

    def forward(self, x):
        x = torch.relu(self.stem(x))
        if self.shortcut_first:
            s = self.short(x)
            a = self.a2(torch.relu(self.a1(x)))
        else:
            a = self.a2(torch.relu(self.a1(x)))
            s = self.short(x)
        return self.head(torch.relu(a + s).flatten(1))


def test_branches_are_aligned_per_predecessor():
    """The code order of a residual block's branches differs between parent and child: aligned in
    the traced order only one branch can match; aligned per branch, both do."""
    from tridens.warmup import transfer

    torch.manual_seed(0)
    parent, child = TwoBranch(6, shortcut_first=False), TwoBranch(6, shortcut_first=True)
    pd, cd = describe(parent, X), describe(child, X)
    linear, lpairs = align(cd, pd, branches=False)
    branched, bpairs = align(cd, pd)
    assert linear < 1.0 and branched == pytest.approx(1.0) and score(cd, pd) == pytest.approx(1.0)
    assert score(cd, pd, branches=False) == pytest.approx(linear)
    assert len(bpairs) > len(lpairs)
    new, stats = transfer(cd, pd, bpairs, parent.state_dict(), child.state_dict())
    assert all(torch.equal(new[k], v) for k, v in parent.state_dict().items())  # every weight inherited
    child.load_state_dict(new)
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(child(x), parent(x))
    # wider child: both branches still inherit (slices of both), the linear order loses one
    wide = TwoBranch(9, shortcut_first=True)
    wd = describe(wide, X)
    _, wl = align(wd, pd, branches=False)
    _, wb = align(wd, pd)
    inherited = lambda pairs: transfer(wd, pd, pairs, parent.state_dict(), wide.state_dict())[1]["inherited_elements"]
    assert inherited(wb) > inherited(wl)
    # a zoo picks the parent by the branch-aware score
    assert td.warmup._match.scores(td.warmup._match.encode(cd), td.warmup._match.Batch([td.warmup._match.encode(pd)]))[0] \
        == pytest.approx(1.0)


def test_chains_keep_their_order():
    from tridens.warmup._match import encode

    for m in (mlp(16, 3), cnn(4)):
        e = encode(describe(m, X))
        assert e.branched() is e
