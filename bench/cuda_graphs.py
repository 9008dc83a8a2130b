"""CUDA graphs for a fused training step where it is launch-bound (Nimble: capture once, replay).

K small models trained as one: their stacked parameters (``torch.func.stack_module_state``), one
``vmap(functional_call)`` forward over a shared batch, one backward, one Adam step over the stacked
tensors (the form of tridens' vmap engine). Three ways to run the same step, per K:

* ``separate``: K plain models, one eager step each (forward, backward, ``Adam(foreach=True)``);
* ``fused``: the K models as one vmapped step, eager;
* ``fused+graph``: that step captured once in a CUDA graph (static input buffers, ``Adam(capturable=True)``)
  and replayed; the batch is copied into the static buffers before each replay.

Reported: milliseconds per step of all K models (synchronized wall time, median of ``--reps``
interleaved rounds of ``--steps`` steps), speed-ups over ``separate``, and the peak GPU memory.
On the CPU the graph mode is skipped (``--device cpu``: a dry run of the rest).

    .venv/bin/python bench/cuda_graphs.py --device cuda --ks 1,4,16,64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import tridens as td  # noqa: E402


def make_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 16, 10))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Separate:
    def __init__(self, models: list[nn.Module]) -> None:
        self.models = models
        self.opts = [torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True) for m in models]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for model, opt in zip(self.models, self.opts):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()


class Fused:
    """K models as one vmapped step over their stacked parameters."""

    def __init__(self, models: list[nn.Module], capturable: bool = False) -> None:
        params, buffers = stack_module_state(models)
        self.params = {k: v.detach().requires_grad_() for k, v in params.items()}
        self.buffers = buffers
        self.base = copy.deepcopy(models[0]).to("meta")
        self.k = len(models)
        self.opt = torch.optim.Adam(list(self.params.values()), lr=1e-3, capturable=capturable,
                                    foreach=not capturable or None)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def one(p: dict, b: dict) -> torch.Tensor:
            return F.cross_entropy(functional_call(self.base, (p, b), (x,)), y)

        return torch.vmap(one, randomness="different")(self.params, self.buffers).sum()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss(x, y).backward()
        self.opt.step()


class Graphed:
    """``Fused``'s step captured once in a CUDA graph, replayed on static input buffers."""

    def __init__(self, models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
        self.fused = Fused(models, capturable=True)
        self.x, self.y = x.clone(), y.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy state, cuBLAS workspaces)
            for _ in range(3):
                self.fused.opt.zero_grad(set_to_none=False)
                self.fused.loss(self.x, self.y).backward()
                self.fused.opt.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.fused.opt.zero_grad(set_to_none=True)  # the captured backward allocates the grads in the graph's pool
        with torch.cuda.graph(self.graph):
            self.fused.loss(self.x, self.y).backward()
            self.fused.opt.step()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()


def batches(device: torch.device, batch: int, kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = td.datasets.digits()
    x, y = train.tensors
    if kind == "mlp":
        x = x.flatten(1)
    out = []
    for i in range(0, len(x) - batch + 1, batch):
        out.append((x[i:i + batch].to(device), y[i:i + batch].to(device)))
    return out


def time_steps(runner: object, data: list, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        runner.step(*data[i % len(data)])  # type: ignore[attr-defined]
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ks", default="1,4,16,64")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", help="append the rows here (JSON lines)")
    args = p.parse_args()
    device = torch.device(args.device)
    C.print_machine()
    rows = []
    for kind in args.models.split(","):
        data = batches(device, args.batch, kind)
        for k in [int(v) for v in args.ks.split(",")]:
            torch.manual_seed(0)
            models = [make_model(kind).to(device) for _ in range(k)]
            modes: dict[str, object] = {"separate": Separate([copy.deepcopy(m) for m in models]),
                                        "fused": Fused([copy.deepcopy(m) for m in models])}
            if device.type == "cuda":
                try:
                    modes["fused+graph"] = Graphed([copy.deepcopy(m) for m in models], *data[0])
                except Exception as err:  # a step that cannot be captured: say why, measure the rest
                    print(f"{kind} K={k}: fused+graph not captured: {type(err).__name__}: {str(err)[:200]}")
            for runner in modes.values():
                time_steps(runner, data, 3, device)   # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times: dict[str, list[float]] = {m: [] for m in modes}
            names = list(modes)
            for r in range(args.reps):   # interleaved, order reversed every other round
                for name in (names if r % 2 == 0 else names[::-1]):
                    times[name].append(time_steps(modes[name], data, args.steps, device))
            med = {m: statistics.median(v) for m, v in times.items()}
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
            row = {"model": kind, "k": k, "device": str(device), **{f"{m} ms": round(v, 3) for m, v in med.items()},
                   **{f"{m} x": round(med["separate"] / v, 2) for m, v in med.items() if m != "separate"},
                   "peak MiB": round(peak, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    headers = sorted({h for r in rows for h in r}, key=lambda h: (h not in ("model", "k", "device"), h))
    print(C.table(headers, [[r.get(h, "") for h in headers] for r in rows]))
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
