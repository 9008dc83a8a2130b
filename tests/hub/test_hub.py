"""td.hub: every space freezes random samples that run, fingerprints are stable, the one-shot
spaces build their supernet, reference architectures have their published parameter counts,
and small configurations train on real data (scikit-learn's digits)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import tridens as td
from tridens import hub
from tridens.evaluators import nasbench201
from tridens.oneshot import build_supernet


def params(model: nn.Module, skip: str = "auxiliary") -> int:
    return sum(p.numel() for name, p in model.named_parameters() if skip not in name)


# -- small configurations of every space, on 8x8 one-channel digits ---------------------------------
def small_spaces() -> dict[str, tuple[td.ModelSpace, torch.Tensor]]:
    digit = torch.randn(2, 1, 8, 8)
    return {
        "nasbench201": (hub.NasBench201(channels=4, cells=1, in_channels=1), digit),
        "nasbench101": (hub.NasBench101(stem_out_channels=8, num_stacks=2, num_modules_per_stack=1, in_channels=1), digit),
        "darts": (hub.DARTS(width=4, num_cells=3, in_channels=1), digit),
        "pnas": (hub.PNAS(width=4, num_cells=3, in_channels=1), digit),
        "nasnet": (hub.NASNet(width=4, num_cells=3, in_channels=1), digit),
        "enas": (hub.ENAS(width=(4, 8), num_cells=(3, 4), in_channels=1), digit),
        "amoebanet": (hub.AmoebaNet(width=4, num_cells=3, in_channels=1), digit),
        "proxylessnas": (hub.ProxylessNAS(num_labels=10, base_widths=(8, 8, 8, 16, 16, 24, 24, 32, 64),
                                          depths=(2, 2, 1, 1, 1, 1), in_channels=1), digit),
        "mobilenetv3": (hub.MobileNetV3Space(num_labels=10, width_multiplier=0.25, depths=((1, 2),) * 5,
                                             in_channels=1), digit),
        "shufflenet": (hub.ShuffleNetSpace(num_labels=10, stage_repeats=(1, 2, 1, 1),
                                           stage_out_channels=(8, 16, 32, 48, 64, 96), in_channels=1), digit),
        "autoformer": (hub.AutoFormer(search_embed_dim=(12, 24), search_mlp_ratio=(2.0, 4.0), search_num_heads=(2, 3),
                                      search_depth=(1, 2), img_size=8, patch_size=2, in_chans=1, num_classes=10), digit),
    }


SPACES = small_spaces()


@pytest.mark.parametrize("name", list(SPACES))
def test_random_samples_freeze_and_run_and_their_fingerprints_are_stable(name):
    space, x = SPACES[name]
    assert space.size() > 1
    seen, fingerprints = 0, {}
    for seed in range(4):  # every random sample is valid (NAS-Bench-101 draws wirings within its edge budget)
        sample = space.random_sample(random.Random(seed))
        model = space.freeze(sample)
        model.eval()
        with torch.no_grad():
            assert model(x).shape == (2, 10)
        first = td.graph.trace(model, example_inputs=(x,)).fingerprint()
        again = td.graph.trace(space.freeze(sample), example_inputs=(x,)).fingerprint()
        assert first == again
        fingerprints.setdefault(first, repr(sorted(sample.items())))
        seen += 1
    assert seen >= 3
    assert len(fingerprints) >= 2  # different architectures, different fingerprints


@pytest.mark.parametrize("name", ["nasbench201", "darts", "pnas", "proxylessnas", "mobilenetv3", "shufflenet",
                                  "autoformer"])
def test_one_shot_spaces_build_a_supernet_whose_paths_are_the_frozen_models(name):
    space, x = SPACES[name]
    space.example_inputs = (x,)
    try:
        net = build_supernet(space, max_checks=6)  # checks paths against space.freeze
    finally:
        space.example_inputs = None
    assert set(net.claimed) == set(space.search_space())
    net.model.eval()
    sample = space.random_sample(random.Random(3))
    net.set_path(sample)
    child = space.freeze(sample)
    child.load_state_dict(net.extract(sample).state_dict())
    child.eval()
    with torch.no_grad():
        assert torch.allclose(net.model(x), child(x), atol=1e-5)


def test_nasbench101_drops_nodes_off_every_path_and_refuses_more_than_nine_edges():
    space = hub.NasBench101(stem_out_channels=8, num_stacks=1, num_modules_per_stack=1, in_channels=1)
    chain = {**{f"cell/op{i}": "conv3x3-bn-relu" for i in range(1, 6)},
             **{f"cell/input{i}": [i - 1] for i in range(1, 7)}}
    model = space.freeze(chain)
    assert len(model.features[3].ops) == 5
    dangling = {**chain, "cell/input6": [0, 1]}      # nodes 2..5 lead nowhere
    cell = space.freeze(dangling).features[3]
    assert sorted(cell.ops) == ["1"] and cell.channels[1] == 8
    dense = {**chain, **{f"cell/input{i}": list(range(i)) for i in range(1, 7)}}
    with pytest.raises(td.InvalidSample, match="21 edges, more than max_num_edges=9"):
        space.freeze(dense)


# -- published parameter counts ---------------------------------------------------------------------
@pytest.mark.slow
def test_reference_architectures_have_their_published_parameter_counts():
    darts_v2 = hub.DARTS(width=36, num_cells=20, auxiliary_loss=True).freeze(hub.DARTS_V2)
    assert params(darts_v2) == 3_349_342                      # DARTS paper: 3.3 M (auxiliary head not counted)
    v3 = hub.MobileNetV3Space().freeze(hub.MOBILENETV3_LARGE)
    assert params(v3) == 5_483_032                            # MobileNetV3-Large: 5.4 M (torchvision: 5,483,032)
    v2_space = hub.ProxylessNAS(base_widths=(32, 16, 24, 32, 64, 96, 160, 320, 1280), depths=(2, 3, 4, 3, 3, 1))
    v2 = v2_space.freeze({label: "k3_e6" for label in v2_space.search_space()})
    assert params(v2) == 3_504_872                            # MobileNetV2: 3.4-3.5 M (torchvision: 3,504,872)
    deit = hub.AutoFormer(search_embed_dim=(192,), search_mlp_ratio=(4.0,), search_num_heads=(3,), search_depth=(12,))
    assert params(deit.freeze(deit.default_sample())) == 5_717_416   # DeiT-Tiny: 5.7 M (timm: 5,717,416)
    darts_v2.train()
    logits, aux = darts_v2(torch.randn(2, 3, 32, 32))
    assert logits.shape == aux.shape == (2, 10)


def test_nasbench201_parameter_counts_match_the_benchmark_table():
    space = hub.NasBench201()
    table = nasbench201.table("cifar10")
    for text in ("|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|nor_conv_3x3~0|nor_conv_3x3~1|nor_conv_3x3~2|",
                 "|none~0|+|none~0|none~1|+|none~0|none~1|none~2|",
                 "|nor_conv_1x1~0|+|skip_connect~0|avg_pool_3x3~1|+|nor_conv_3x3~0|none~1|nor_conv_1x1~2|"):
        sample = nasbench201.from_arch_str(text)
        recorded = table.lookup(sample)[0]["model_size"]       # MB = millions of parameters
        assert params(space.freeze(sample)) / 1e6 == pytest.approx(recorded, abs=1e-3), text


# -- training on real data --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["darts", "mobilenetv3", "shufflenet", "autoformer"])
def test_a_small_configuration_trains_on_digits(name):
    space, _ = SPACES[name]
    train, _ = td.datasets.digits()
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = space.freeze(space.random_sample(random.Random(0)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step, (x, y) in zip(range(40), loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_a_hub_space_is_searched_one_shot_by_an_experiment(tmp_path):
    train, val = td.datasets.digits()
    space = hub.DARTS(width=4, num_cells=3, in_channels=1)
    evaluator = td.evaluators.Classification(train, val, epochs=2, batch_size=128, lr=0.05)
    exp = td.Experiment(space, evaluator, td.oneshot.DARTS(samples=2), store=str(tmp_path / "t.db"), name="hub darts")
    exp.run()
    best = exp.top(1)[0]
    assert set(space.restrict(best.sample)) == set(space.search_space())
    assert best.metric is not None and best.metric > 0.1
