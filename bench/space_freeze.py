"""Benchmark: freeze + trace + fingerprint one sample of a ResNet-18-sized model space.

The space is a CIFAR-style ResNet-18 (3x32x32 input, four stages of BasicBlocks) with choices for
every stage's width, every stage's block count (``tnn.Repeat``) and every block's kernel size. Its
default sample (every label's first candidate) *is* ResNet-18: widths 64/128/256/512, two blocks
per stage, 3x3 kernels, 11.17 M parameters.

For each of ``--samples`` random samples, and as many runs of the default sample (ResNet-18
itself), it times, separately:

* ``freeze``      -- ``space.freeze(sample, check=False)``: validate, re-run ``__init__``
                     (including weight initialisation);
* ``trace``       -- ``td.graph.trace(model, example_inputs)``: torch.fx capture (shapes lazy);
* ``fingerprint`` -- ``graph.fingerprint()``: the structural hash;

and, reported apart from the target total, two optional passes the engine may also run:

* ``check``       -- the forward pass ``freeze`` runs when the space has example inputs;
* ``flops``       -- ``graph.flops()``, which propagates shapes (one forward through the graph);
                     the engine calls it for every new trial.

Each random sample is also run on the meta device (``with torch.device("meta"): space.freeze``):
no weight is allocated or initialised, and the fingerprint is the same.

Run::

    .venv/bin/python bench/space_freeze.py                 # 30 samples, table on stdout
    .venv/bin/python bench/space_freeze.py --profile       # + cProfile's top functions
    .venv/bin/python bench/space_freeze.py --json out.json # + raw timings
    .venv/bin/python bench/space_freeze.py --threads 1     # one torch intra-op thread
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

import tridens as td
import tridens.graph  # noqa: F401  (td.graph, whether or not tridens/__init__ imports it)
from tridens import nn as tnn

TARGET_MS = 50.0
STAGE_WIDTHS = ([64, 48, 32], [128, 96, 64], [256, 192, 128], [512, 384, 256])


class BasicBlock(nn.Module):
    """ResNet basic block: two convs with BatchNorm, identity or 1x1-projection shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, kernel: int):
        super().__init__()
        pad = kernel // 2
        self.conv1 = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=pad, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class ResNet18Space(tnn.ModelSpace):
    """ResNet-18 (CIFAR variant) with per-stage width and depth and per-block kernel choices.

    Labels: ``stage{s}.width`` (3 candidates), ``stage{s}.depth`` (2 or 1 blocks) and
    ``stage{s}.block{b}.kernel`` (3 or 5 for the first conv of the block; conditional on depth).
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        c_in = 64
        stages = []
        for s, widths in enumerate(STAGE_WIDTHS):
            width = td.choice(f"stage{s}.width", widths)
            stride = 1 if s == 0 else 2

            def block(b: int, s: int = s, c_in: int = c_in, width: int = width, stride: int = stride) -> nn.Module:
                kernel = td.choice(f"stage{s}.block{b}.kernel", [3, 5])
                return BasicBlock(c_in if b == 0 else width, width, stride if b == 0 else 1, kernel)

            stages.append(tnn.Repeat(block, depth=td.choice(f"stage{s}.depth", [2, 1])))
            c_in = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c_in, num_classes)
        self.example_inputs = (torch.randn(1, 3, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


# ---------------------------------------------------------------------------------------------
# measurement

PHASES = ("freeze", "trace", "fingerprint")
EXTRAS = ("check", "flops")


class Clock:
    """Wall and process-CPU milliseconds of a block (``with Clock() as c: ...; c.wall``)."""

    def __enter__(self) -> "Clock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = (time.perf_counter() - self._wall) * 1e3
        self.cpu = (time.process_time() - self._cpu) * 1e3


def run_once(space: ResNet18Space, sample: dict[str, Any], device: str = "cpu",
             extras: bool = True) -> dict[str, float]:
    """Freeze, trace and fingerprint ``sample`` on ``device`` (``"cpu"`` or ``"meta"``); return the
    wall milliseconds of each phase, their total (``total``), its process-CPU milliseconds
    (``total_cpu``), and with ``extras`` the shape-check forward (``check``) and ``graph.flops()``
    including the shape propagation it triggers (``flops``). On ``"meta"`` the model is built under ``with torch.device("meta")``: no weight
    is allocated or initialised; the fingerprint is the same (it never reads values)."""
    inputs = tuple(t.to(device) for t in space.example_inputs)
    with torch.device(device):
        with Clock() as c_freeze:
            model = space.freeze(sample, check=False)
    with Clock() as c_trace:
        graph = td.graph.trace(model, inputs)
    with Clock() as c_fp:
        fingerprint = graph.fingerprint()
    row: dict[str, Any] = {
        "freeze": c_freeze.wall, "trace": c_trace.wall, "fingerprint": c_fp.wall,
        "total": c_freeze.wall + c_trace.wall + c_fp.wall,
        "freeze_cpu": c_freeze.cpu, "trace_cpu": c_trace.cpu, "fingerprint_cpu": c_fp.cpu,
        "total_cpu": c_freeze.cpu + c_trace.cpu + c_fp.cpu,
        "params": sum(p.numel() for p in model.parameters()), "nodes": len(graph), "fp": fingerprint,
    }
    if extras:
        from tridens.space._model_space import check_forward
        with Clock() as c_check:
            check_forward(model, inputs, sample)
        with Clock() as c_flops:
            row["flop_count"] = graph.flops()
        row["check"], row["flops"] = c_check.wall, c_flops.wall
    return row


def measure(n_samples: int, seed: int, warmup: int = 3) -> dict[str, list[dict[str, Any]]]:
    """Time ``n_samples`` random samples and the default sample (ResNet-18 itself), each on the
    CPU and on the meta device, interleaved so that load changes on a shared machine hit every
    scenario alike. Returns scenario -> rows."""
    space = ResNet18Space()
    space.search_space()
    rng = random.Random(seed)
    default = space.default_sample()
    for _ in range(warmup):
        sample = space.random_sample(rng)
        run_once(space, sample, "cpu")
        run_once(space, sample, "meta")
    runs: dict[str, list[dict[str, Any]]] = {"random/cpu": [], "random/meta": [],
                                             "resnet18/cpu": [], "resnet18/meta": []}
    for _ in range(n_samples):
        sample = space.random_sample(rng)
        for kind, s in (("random", sample), ("resnet18", default)):
            for device in ("cpu", "meta"):
                gc.collect()
                row = run_once(space, s, device)
                row["sample"] = s
                runs[f"{kind}/{device}"].append(row)
    for a, b in zip(runs["random/cpu"], runs["random/meta"]):
        assert a["fp"] == b["fp"], "meta-device fingerprint differs from the CPU one"
    return runs


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile, ``q`` in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """phase -> {median, p90, min, max} in milliseconds."""
    out = {}
    for key in (*PHASES, "total", *[f"{p}_cpu" for p in PHASES], "total_cpu", *EXTRAS):
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "p90": percentile(values, 90),
                        "min": min(values), "max": max(values)}
    return out


# ---------------------------------------------------------------------------------------------
# where the time goes

def breakdown(reps: int = 21) -> str:
    """Time the parts of each phase directly on ResNet-18 (the default sample): no profiler, so
    no profiler overhead. Returns a table of medians over ``reps`` runs."""
    from tridens.graph._fingerprint import module_structure

    space = ResNet18Space()
    sample = space.default_sample()
    inputs = space.example_inputs
    model = space.freeze(sample, check=False)
    params = [p for p in model.parameters()]
    n_params = sum(p.numel() for p in params)
    resettable = [m for m in model.modules() if hasattr(m, "reset_parameters")]

    def freeze_meta() -> None:
        with torch.device("meta"):
            space.freeze(sample, check=False)

    def reset_all() -> None:
        with torch.no_grad():
            for m in resettable:
                m.reset_parameters()  # type: ignore[operator]

    def uniform_all() -> None:
        with torch.no_grad():
            for p in params:
                p.uniform_()

    def empty_all() -> None:
        for p in params:
            torch.empty_like(p)

    def fresh_uniform_all() -> None:
        with torch.no_grad():
            for p in params:
                torch.empty_like(p).uniform_()

    graph = td.graph.trace(model, inputs)
    call_modules = [graph._get(str(n.target)) for n in graph.fx_graph.nodes if n.op == "call_module"]
    parts: list[tuple[str, Callable[[], Any]]] = [
        ("freeze (CPU)", lambda: space.freeze(sample, check=False)),
        ("  freeze on the meta device (construction, no weights)", freeze_meta),
        ("  reset_parameters() of every module (= weight init)", reset_all),
        ("    of which uniform_() kernels alone", uniform_all),
        ("  allocation of every parameter (empty_like)", empty_all),
        ("  uniform_() into freshly allocated tensors (+ page faults)", fresh_uniform_all),
        ("trace", lambda: td.graph.trace(model, inputs)),
        ("  torch.fx Tracer().trace alone", lambda: torch.fx.Tracer().trace(model)),
        ("trace + fingerprint", lambda: td.graph.trace(model, inputs).fingerprint()),
        ("  module_structure() of every call_module node", lambda: [module_structure(m) for m in call_modules]),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in parts}
    for _ in range(reps):  # round-robin, so that load changes hit every part alike
        for name, fn in parts:
            gc.collect()
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t) for name, t in times.items()}
    medians["fingerprint (trace + fingerprint - trace)"] = medians.pop("trace + fingerprint") - medians["trace"]
    order = [name for name, _ in parts if name != "trace + fingerprint"]
    order.insert(order.index("  module_structure() of every call_module node"), "fingerprint (trace + fingerprint - trace)")
    rows = [(name, medians[name]) for name in order]
    init_ms = medians["    of which uniform_() kernels alone"]
    lines = [f"ResNet-18 (default sample, {n_params / 1e6:.2f} M params, {len(graph)} nodes, "
             f"{len(call_modules)} call_module nodes), median of {reps} runs, wall ms:"]
    lines += [f"  {name:<58}{ms:>8.2f}" for name, ms in rows]
    lines.append(f"  uniform_() throughput: {init_ms * 1e6 / n_params:.2f} ns per parameter "
                 f"({n_params / init_ms / 1e6:.2f} G params/s)")
    return "\n".join(lines)


def profile(n: int, seed: int, top: int = 20) -> str:
    """cProfile of ``n`` freeze + trace + fingerprint runs of random samples and ``n`` of
    ResNet-18: the top functions by own time."""
    space = ResNet18Space()
    space.search_space()
    rng = random.Random(seed)
    samples = [space.random_sample(rng) for _ in range(n)] + [space.default_sample()] * n
    inputs = space.example_inputs
    prof = cProfile.Profile()
    prof.enable()
    for sample in samples:
        model = space.freeze(sample, check=False)
        td.graph.trace(model, inputs).fingerprint()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    body = "\n".join(buf.getvalue().splitlines()[4:])
    return f"cProfile of {len(samples)} runs ({n} random samples + {n} x ResNet-18), top functions by own time:\n{body}"


# ---------------------------------------------------------------------------------------------
def machine() -> str:
    """CPU model, core count, torch version and threads, Python version."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{model}, {os.cpu_count()} CPUs (load avg {load}), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def report(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The figures as a text table."""
    summaries = {k: summarize(v) for k, v in runs.items()}
    params = sorted(r["params"] for r in runs["random/cpu"])
    nodes = sorted(r["nodes"] for r in runs["random/cpu"])
    n = len(runs["random/cpu"])
    lines = [
        f"{n} random samples: params min/median/max {params[0] / 1e6:.2f} / {statistics.median(params) / 1e6:.2f} / "
        f"{params[-1] / 1e6:.2f} M, graph nodes {nodes[0]}..{nodes[-1]}; "
        f"ResNet-18 (default sample): {runs['resnet18/cpu'][0]['params'] / 1e6:.2f} M params, "
        f"{runs['resnet18/cpu'][0]['nodes']} nodes",
        "",
        "milliseconds, median / p90" + " " * 8 + "".join(f"{k:>18}" for k in runs),
    ]
    for key in (*PHASES, "total", *[f"{p}_cpu" for p in PHASES], "total_cpu", *EXTRAS):
        name = {"total": "total (freeze+trace+fp)", "total_cpu": "total, process CPU ms",
                "freeze_cpu": "freeze, process CPU ms", "trace_cpu": "trace, process CPU ms",
                "fingerprint_cpu": "fingerprint, process CPU ms",
                "check": "(check: forward in freeze)", "flops": "(graph.flops(), shape prop.)"}.get(key, key)
        cells = "".join(f"{summaries[k][key]['median']:>10.1f} /{summaries[k][key]['p90']:>6.1f}" for k in runs)
        lines.append(f"{name:<34}{cells}")
        if key in ("total", "total_cpu"):
            lines.append("-" * (34 + 18 * len(runs)))
    lines.append("")
    for k in ("random/cpu", "resnet18/cpu", "random/meta", "resnet18/meta"):
        s, c = summaries[k]["total"], summaries[k]["total_cpu"]
        verdict = "under" if s["median"] < TARGET_MS else "OVER"
        lines.append(f"target total < {TARGET_MS:.0f} ms, {k:<14}: wall median {s['median']:6.1f} ms, "
                     f"p90 {s['p90']:6.1f} ms -> {verdict} (process CPU median {c['median']:.1f} ms)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30, help="random samples to time (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    parser.add_argument("--json", metavar="PATH", help="write the raw timings here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, = cores)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    with Clock() as c_setup:
        space = ResNet18Space()
        search_space = space.search_space()
    print(f"machine: {machine()}")
    print(f"space: ResNet18Space, {len(search_space)} labels, {space.size():.0f} samples; "
          f"construction + discovery {c_setup.wall:.0f} ms (once per space)")
    runs = measure(args.samples, args.seed)
    print(report(runs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "summary": {k: summarize(v) for k, v in runs.items()},
                       "runs": runs}, fh, indent=1, default=str)
    print()
    print(breakdown())
    if args.profile:
        print()
        print(profile(10, args.seed + 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
