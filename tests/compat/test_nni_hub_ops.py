"""The hub's NASNet-family spaces have NNI's candidate operations, in NNI's order."""

from __future__ import annotations

import pytest

from tridens import hub

from . import _upstream

# NNI 3.0's nni/nas/hub/pytorch/nasnet.py, the candidate lists of its five spaces (its DARTS_OPS
# leaves 'none' out of the candidates on purpose).
NNI_OPS = {
    "NASNet": ("NASNET_OPS", ["skip_connect", "conv_3x1_1x3", "conv_7x1_1x7", "dil_conv_3x3", "avg_pool_3x3",
                              "max_pool_3x3", "max_pool_5x5", "max_pool_7x7", "conv_1x1", "conv_3x3", "sep_conv_3x3",
                              "sep_conv_5x5", "sep_conv_7x7"]),
    "ENAS": ("ENAS_OPS", ["skip_connect", "sep_conv_3x3", "sep_conv_5x5", "avg_pool_3x3", "max_pool_3x3"]),
    "AmoebaNet": ("AMOEBA_OPS", ["skip_connect", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7", "avg_pool_3x3",
                                 "max_pool_3x3", "dil_sep_conv_3x3", "conv_7x1_1x7"]),
    "PNAS": ("PNAS_OPS", ["sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7", "conv_7x1_1x7", "skip_connect",
                          "avg_pool_3x3", "max_pool_3x3", "dil_conv_3x3"]),
    "DARTS": ("DARTS_OPS", ["max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5",
                            "dil_conv_3x3", "dil_conv_5x5"]),
}


@pytest.mark.parametrize("name", sorted(NNI_OPS))
def test_hub_space_candidates_are_nnis(name: str) -> None:
    space = getattr(hub, name)(width=4, num_cells=3)
    domain = space.search_space()["normal/op_2_0"].domain
    assert list(domain.values()) == NNI_OPS[name][1] == list(getattr(hub, name).OPS)
    assert "none" not in domain.values()


@pytest.mark.parametrize("ref", [_upstream.NNI3, _upstream.NNI2])
def test_candidate_lists_match_nnis_own_file(ref: str) -> None:
    source = _upstream.require("nni/nas/hub/pytorch/nasnet.py", ref)
    for name, (attribute, ops) in NNI_OPS.items():
        assert _upstream.class_lists(source, name)[attribute] == ops == list(getattr(hub, name).OPS), name


def test_drop_path_as_nni_schedules_it() -> None:
    import torch

    model = hub.DARTS(width=4, num_cells=3, drop_path_prob=0.2).freeze(hub.DARTS_V2)
    drops = [m for m in model.modules() if isinstance(m, hub.DropPath)]
    assert drops and all(m.drop_prob == 0.2 for m in drops) and model.drop_path_prob == 0.2
    model.set_drop_path_prob(0.1)
    assert all(m.drop_prob == 0.1 for m in drops)
    x = torch.ones(64, 4, 2, 2)
    drops[0].train()
    kept = drops[0](x)[:, 0, 0, 0]
    assert set(kept.unique().tolist()) <= {0.0, float(torch.tensor(1 / 0.9))} and 0 < (kept == 0).sum() < 64
    drops[0].eval()
    assert torch.equal(drops[0](x), x)


@pytest.mark.parametrize("module, name", [("nasbench101", "query_nb101_trial_stats"),
                                          ("nasbench201", "query_nb201_trial_stats"),
                                          ("nds", "query_nds_trial_stats")])
def test_benchmark_queries_are_refused_in_one_line_naming_the_table_tridens_has(module: str, name: str) -> None:
    import importlib

    from tridens.compat.nni._common import NotSupported

    for package in ("tridens.compat.nni.nas.benchmark", "tridens.compat.nni.nas.benchmarks"):
        query = getattr(importlib.import_module(f"{package}.{module}"), name)
        with pytest.raises(NotSupported) as err:
            query({}, 200, "cifar10")
        message = str(err.value)
        assert "\n" not in message and name in message and "td.evaluators.nasbench201.table" in message
