"""Benchmark: which zoo models trace to a full graph, which keep opaque nodes, and how long it takes.

For every space of ``bench/zoo.py`` and ``--samples`` random samples each (seeds 0..n-1) it
freezes the sample, runs it once, traces it with ``td.graph.trace``, counts the opaque nodes,
fingerprints the graph, regenerates a module with ``graph.to_module()`` and checks that it computes
the same outputs as the frozen model (eval mode). A model "traces fully" when it has no opaque node
and the regenerated module matches. Every model but ``early_exit`` (data-dependent ``break``) should.

Run::

    .venv/bin/python bench/zoo_trace.py                    # 5 samples per model, table on stdout
    .venv/bin/python bench/zoo_trace.py --samples 10 --models resnet,darts
    .venv/bin/python bench/zoo_trace.py --json zoo.json
    .venv/bin/python bench/zoo_trace.py --threads 1         # one torch intra-op thread

Exits with status 1 when a model's outcome differs from the one :data:`zoo.ZOO` expects.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tridens as td  # noqa: E402
import tridens.graph  # noqa: E402,F401  (td.graph, whether or not tridens/__init__ imports it)
from zoo import ZOO, ZooEntry  # noqa: E402


@dataclasses.dataclass
class SampleResult:
    """What tracing one frozen sample gave."""

    seed: int
    nodes: int
    opaque: list[str]
    reasons: list[str]
    params: int
    fingerprint: str
    roundtrip: bool
    freeze_ms: float
    trace_ms: float
    fingerprint_ms: float

    @property
    def full(self) -> bool:
        return not self.opaque and self.roundtrip


@dataclasses.dataclass
class ModelResult:
    """Every sample of one zoo model, plus the space's own figures."""

    name: str
    labels: int
    size: float
    discovery_ms: float
    expect_opaque: bool
    samples: list[SampleResult]

    @property
    def n_full(self) -> int:
        return sum(s.full for s in self.samples)

    @property
    def as_expected(self) -> bool:
        if self.expect_opaque:
            return all(s.opaque and s.roundtrip for s in self.samples)
        return self.n_full == len(self.samples)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def trace_sample(space: Any, sample: dict[str, Any], seed: int) -> SampleResult:
    """Freeze, trace, fingerprint and round-trip one sample."""
    inputs = space.example_inputs
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = space.freeze(sample, check=False)
    freeze_ms = _ms(start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", td.graph.OpaqueModuleWarning)
        start = time.perf_counter()
        graph = td.graph.trace(model, inputs)
        trace_ms = _ms(start)
    start = time.perf_counter()
    fingerprint = graph.fingerprint()
    fingerprint_ms = _ms(start)
    opaque_nodes = [n for n in graph if n.opaque]
    reasons = [str(w.message) for w in caught if issubclass(w.category, td.graph.OpaqueModuleWarning)]
    regenerated = graph.to_module()
    model.eval()
    regenerated.eval()
    with torch.no_grad():
        expected = model(*inputs)
        got = regenerated(*inputs)
    return SampleResult(
        seed=seed, nodes=len(graph), opaque=[n.name for n in opaque_nodes], reasons=reasons,
        params=sum(p.numel() for p in model.parameters()), fingerprint=fingerprint,
        roundtrip=bool(torch.allclose(expected, got, atol=1e-5)),
        freeze_ms=freeze_ms, trace_ms=trace_ms, fingerprint_ms=fingerprint_ms)


def run_model(entry: ZooEntry, n_samples: int) -> ModelResult:
    """Build the space (timing construction + discovery) and trace ``n_samples`` samples."""
    start = time.perf_counter()
    space = entry.build()
    search_space = space.search_space()
    discovery_ms = _ms(start)
    samples = [trace_sample(space, space.random_sample(random.Random(seed)), seed) for seed in range(n_samples)]
    return ModelResult(entry.name, len(search_space), space.size(), discovery_ms, entry.expect_opaque, samples)


def _range(values: list[int], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    lo, hi = min(values) / scale, max(values) / scale
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(results: list[ModelResult]) -> str:
    """The results as a Markdown table."""
    head = ("| model | labels | space size | traced fully | opaque nodes / sample | distinct fp | nodes "
            "| params (k) | freeze ms | trace ms | fp ms | discovery ms | as expected |")
    lines = [head, "|" + "|".join(["---"] * 13) + "|"]
    for r in results:
        s = r.samples
        opaque = ",".join(str(len(x.opaque)) for x in s)
        size = f"{r.size:.3g}" if r.size < 1e6 else f"{r.size:.1e}"
        lines.append(
            f"| {r.name} | {r.labels} | {size} | {r.n_full}/{len(s)} | {opaque} | {len({x.fingerprint for x in s})} "
            f"| {_range([x.nodes for x in s])} | {_range([x.params for x in s], 1e3)} "
            f"| {statistics.median(x.freeze_ms for x in s):.1f} | {statistics.median(x.trace_ms for x in s):.1f} "
            f"| {statistics.median(x.fingerprint_ms for x in s):.1f} | {r.discovery_ms:.0f} "
            f"| {'yes' if r.as_expected else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=5, help="random samples per model (default 5)")
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated subset of: " + ", ".join(ZOO))
    parser.add_argument("--json", metavar="PATH", help="write per-sample results here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, = cores)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(ZOO)}")
    warnings.simplefilter("ignore")

    run_model(ZOO[names[0]], 1)  # warm-up: one-time costs of the process (lazy imports, first meta ops)
    results = []
    for name in names:
        results.append(run_model(ZOO[name], args.samples))
        print(f"  {name}: {results[-1].n_full}/{args.samples} traced fully", file=sys.stderr)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs (load avg {load}), {torch.get_num_threads()} threads; "
          f"{args.samples} random samples per model; times are medians over the samples")
    print()
    print(table(results))
    full = [r.name for r in results if r.n_full == len(r.samples)]
    partial = [r.name for r in results if r.n_full < len(r.samples)]
    print()
    print(f"traced fully (every sample): {len(full)}/{len(results)}: {', '.join(full) or '-'}")
    print(f"with opaque nodes: {', '.join(partial) or '-'}")
    for r in results:
        reasons = sorted({reason for s in r.samples for reason in s.reasons})
        for reason in reasons:
            print(f"  {r.name}: {reason}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in results], fh, indent=1)
    mismatched = [r.name for r in results if not r.as_expected]
    if mismatched:
        print(f"\nUNEXPECTED outcome for: {', '.join(mismatched)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
