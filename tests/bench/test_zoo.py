"""The zoo of ``bench/zoo.py``: every space freezes random samples that run forward and backward,
and traces with the expected outcome (a full graph, except the early-exit model whose
data-dependent cascade becomes exactly one opaque node)."""

from __future__ import annotations

import importlib.util
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tridens as td

graph = pytest.importorskip("tridens.graph", reason="tridens.graph is not on main yet")

_ZOO_PATH = Path(__file__).resolve().parents[2] / "bench" / "zoo.py"


def _load_zoo() -> Any:
    """Import bench/zoo.py under a private name (bench/ is not a package)."""
    name = "_tridens_bench_zoo"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _ZOO_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


zoo = _load_zoo()
SEEDS = (0, 1)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models: one intra-op thread is as fast, and far steadier on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _build(name: str) -> Any:
    if name == "darts":  # same labels and Cell machinery, one cell fewer: discovery is cheaper
        return zoo.DartsNet(layout=("normal", "reduce"))
    return zoo.ZOO[name].build()


def test_zoo_has_ten_models_and_one_expected_opaque() -> None:
    assert len(zoo.ZOO) == 10
    assert [n for n, e in zoo.ZOO.items() if e.expect_opaque] == ["early_exit"]


def _check_trace(name: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    """Trace ``model``; check the opaque outcome and the codegen round trip; return the fingerprint."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = td.graph.trace(model, inputs)
    opaque = [n.name for n in g if n.opaque]
    opaque_warnings = [str(w.message) for w in caught if issubclass(w.category, td.graph.OpaqueModuleWarning)]
    if zoo.ZOO[name].expect_opaque:
        assert opaque == ["cascade"], f"{name}: opaque nodes {opaque}"
        assert len(opaque_warnings) == 1
        assert "ExitCascade" in opaque_warnings[0] and "control flow" in opaque_warnings[0]
    else:
        assert opaque == [], f"{name}: unexpected opaque nodes {opaque}"
        assert opaque_warnings == []
        assert sum(n.op == "call_module" for n in g) >= 2
    regenerated = g.to_module().eval()
    with torch.no_grad():
        torch.testing.assert_close(regenerated(*inputs), model(*inputs))
    return g.fingerprint()


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_space(name: str) -> None:
    """Real choices; random samples freeze (with the forward check), train a step, and trace as
    expected; different samples have different fingerprints."""
    space = _build(name)
    assert len(space.search_space()) >= 4
    assert space.size() >= 40
    inputs = space.example_inputs
    fingerprints = set()
    for seed in SEEDS:
        sample = space.random_sample(random.Random(seed))
        torch.manual_seed(seed)
        model = space.freeze(sample)  # the space has example inputs: freeze runs the forward check
        assert model.tridens_sample == space.search_space().validate(sample)
        out = model(*inputs)
        assert out.shape[0] == inputs[0].shape[0]
        assert torch.isfinite(out).all()
        out.float().square().mean().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        fingerprints.add(_check_trace(name, model.eval(), inputs))
    assert len(fingerprints) == len(SEEDS), f"{name}: different samples gave one fingerprint"


def test_meta_device_freeze_fingerprints_like_cpu() -> None:
    """A sample built on the meta device (no weights allocated or initialised) has the CPU
    model's fingerprint: the fast path measured in bench/space_freeze.py."""
    space = zoo.ResNet()
    sample = space.random_sample(random.Random(3))
    cpu = td.graph.trace(space.freeze(sample, check=False), space.example_inputs).fingerprint()
    with torch.device("meta"):
        meta_model = space.freeze(sample, check=False)
    assert next(meta_model.parameters()).is_meta
    assert td.graph.trace(meta_model, space.example_inputs).fingerprint() == cpu
