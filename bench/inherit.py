"""Weight inheritance in regularized evolution (the super-graph of parent and children): time per child with the merged
super-graph vs children trained apart, each from its parent's checkpoint (load + match + copy);
and, for context, the accuracy the children reach vs no inheritance at the same epochs.

Scenario (the same children in every variant). A CNN space on scikit-learn's digits (width and
kernel of the first block, width of the second, learning rate: 72 models). For each seed, an
initial population of ``--population`` random models is trained ONCE into a store; every
measured run starts from a copy of that store and runs ONE generation of ``--children`` children of
RegularizedEvolution (``sample_size = population``, so every child's parent is the best model:
one super-graph of all children). Since the history and the strategy's seed are the same, every
variant trains the same children of the same parent; only how they start and train differs:

* ``supergraph``   inherit_weights=True, optimize=True: children of distinct architectures merged
  in one SuperGraphUnit (inherited tensors stored once; the nodes they compute alike -- the
  shared prefix -- computed once per batch; one backward over the sum of their losses; one step
  per shared tensor from their mean gradient; one data pipeline); learning-rate siblings apart;
* ``ckpt-cse``     inherit_weights=True, optimize=True, super-graph planner off: each child from
  the parent's checkpoint, trained independently, on one shared data pipeline (CSE);
* ``ckpt-separate`` inherit_weights=True, optimize=False: each child from the parent's checkpoint,
  trained alone (what checkpoint save/load + transfer means without any fusion);
* ``scratch``      inherit_weights=False, optimize=True: no inheritance (accuracy context).

Each run is a fresh process (``--one``), the variants interleaved (A B C D, rotating), medians
over seeds x rounds. Time per child = the run's wall (and process CPU) seconds / children; it
covers asking, building, inheriting (checkpoint read, IR matching, copy), planning, training,
validation and the children's checkpoints.

    .venv/bin/python bench/inherit.py --seeds 3 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402

from _common import emit, interleave, median, print_machine, run_worker, table  # noqa: E402

VARIANTS = ["supergraph", "ckpt-cse", "ckpt-separate", "scratch"]
NAME = "inherit-bench"


class BenchNet(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 24, 32])
        w2 = td.choice("width2", [16, 32, 48])
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.block = tnn.LayerChoice([nn.Conv2d(16, w, 3, padding=1), nn.Conv2d(16, w, 5, padding=2)], label="op")
        self.bn = nn.BatchNorm2d(w)
        self.block2 = nn.Conv2d(w, w2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(w2)
        self.head = nn.Linear(w2 * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.bn(self.block(x)))
        x = torch.relu(self.bn2(self.block2(x)))
        return self.head(nn.functional.max_pool2d(x, 2).flatten(1))


class DeepNet(tnn.ModelSpace):
    """``--space deep``: the choices at the END (a fixed trunk of three conv layers, then a 1x1 or
    3x3 conv of width 16/32/48 and the head), so children of one parent share most of their
    FLOPs -- the case a super-graph's shared prefix is for."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32, 48])
        self.stem = nn.Conv2d(1, 32, 3, padding=1)
        self.block = nn.Conv2d(32, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.block2 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.last = tnn.LayerChoice([nn.Conv2d(32, w, 1), nn.Conv2d(32, w, 3, padding=1)], label="op")
        self.head = nn.Linear(w * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.bn(self.block(x)))
        x = torch.relu(self.bn2(self.block2(x)))
        x = torch.relu(self.last(x))
        return self.head(nn.functional.max_pool2d(x, 2).flatten(1))


SPACES = {"cnn": BenchNet, "deep": DeepNet}


def _experiment(store: str, args: argparse.Namespace, variant: str, max_trials: int) -> td.Experiment:
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=args.epochs, batch_size=64,
                                      lr=td.choice("lr", [0.02, 0.05, 0.1, 0.2]))
    strategy = td.strategy.RegularizedEvolution(population=args.population, sample_size=args.population,
                                                batch_size=args.children, mutation_prob=0.25,
                                                inherit_weights=variant != "scratch")
    from tridens.xopt import Settings

    # ckpt-cse: the optimizations without super-graphs; ckpt-separate: none
    optimize = False if variant == "ckpt-separate" else dataclasses.replace(Settings.from_env(), supergraph=variant != "ckpt-cse")
    return td.Experiment(SPACES[getattr(args, "space", "cnn")](), ev, strategy, budget=max_trials, store=store,
                         name=NAME, options=td.RunOptions(seed=args.seed, verbose=False),
                         executor=td.executors.Inline(optimize=optimize))


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def one(args: argparse.Namespace) -> None:
    """Worker: one generation from a copy of the prepared store; prints one RESULT line."""
    torch.set_num_threads(1)
    exp = _experiment(args.store, args, args.one, args.population + args.children)
    import tridens.xopt  # noqa: F401  (imported before timing, as in any run after the first group)
    cpu0, t0 = _cpu(), time.perf_counter()
    exp.run()
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    children = [t for t in exp.trials() if t.id > args.last_init]
    accs = [t.metric for t in children if t.metric is not None]
    inh = [t.info.get("inherit", {}) for t in children]
    emit({
        "variant": args.one, "children": len(children),
        "wall_per_child": wall / max(len(children), 1), "cpu_per_child": cpu / max(len(children), 1),
        "train_s_per_child": statistics.mean(t.info.get("train_seconds", 0.0) for t in children),
        "inherit_s_per_child": statistics.mean(i.get("seconds", 0.0) for i in inh),
        "mean_acc": statistics.mean(accs), "best_acc": max(accs),
        "fraction": statistics.mean(i.get("fraction", 0.0) for i in inh),
        "merged": sum("merged" in i for i in inh),
        # nodes the merged unit computes per batch / nodes of its children's graphs
        "node_share": (lambda m: m["nodes"][0] / m["nodes"][1] if m else 1.0)(
            next((i["merged"] for i in inh if "merged" in i and "nodes" in i["merged"]), None)),
        "samples": [t.sample for t in children], "parents": [t.parent for t in children],
    })


def flop_share(args: argparse.Namespace) -> None:
    """``--flops``: the FLOPs a merged super-graph computes per batch over its children's FLOPs
    (graph IR FLOP counts, each node key once), for ``--children`` distinct children mutated from
    one random parent of the space (1 or 2 labels re-drawn), per seed. Tracing only, no training."""
    import random
    import warnings

    from tridens.units import Job
    from tridens.graph import _meta, trace
    from tridens.trial import Trial
    from tridens.warmup import describe
    from tridens.xopt._cse import _example_batch
    from tridens.xopt._supergraph import _analyse, _identities, inherit

    space = SPACES[args.space]()
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=args.epochs, batch_size=64, lr=0.05)
    x = space.example_inputs[0]
    labels = {k: v for k, v in space.search_space().items() if k != "lr"}  # architecture labels
    for seed in range(args.seeds):
        rng = random.Random(seed)
        domains = {label: list(spec.domain.values()) for label, spec in labels.items()}
        parent_sample = {label: rng.choice(values) for label, values in domains.items()}
        torch.manual_seed(seed)
        parent = space.freeze(parent_sample)
        state, desc = parent.state_dict(), describe(parent, x)
        samples: list[dict] = []
        for _ in range(1000):
            s = dict(parent_sample)
            for label in rng.sample(sorted(domains), min(len(domains), rng.choice([1, 1, 2]))):
                s[label] = rng.choice([v for v in domains[label] if v != s[label]] or [s[label]])
            if s not in samples and s != parent_sample:
                samples.append(s)
            if len(samples) == args.children:
                break
        jobs = []
        for i, s in enumerate(samples):
            model = space.freeze(space.restrict(s))
            record = inherit(model, state, describe(model, x), desc)
            jobs.append(Job(Trial(id=i + 1, sample=s, seed=i, info={"inherit": {"parent": 0, **record}}), model))
        cfg = ev.config({})
        example = _example_batch(cfg)
        ident = _identities(jobs)
        total, merged = 0.0, {}
        for job in jobs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = trace(job.model, (example.clone(),))
                graph.flops()
            flops = {n.name: float(n.meta.get(_meta.FLOPS, 0) or 0) for n in graph.fx_graph.nodes}
            total += sum(flops.values())
            child = _analyse(job, cfg, example, ident[job.trial.id])
            for n in child.nodes or ():
                if n.op not in ("placeholder", "output"):
                    merged.setdefault(child.keys[n], flops.get(n.name, 0.0))
        print(f"space {args.space}, seed {seed}: {len(jobs)} children of {parent_sample}: the merged graph computes "
              f"{sum(merged.values()) / total:.3f} of their FLOPs", flush=True)


def prepare(args: argparse.Namespace, seed: int, directory: str) -> tuple[str, int]:
    """Train the initial population once; returns (store path, id of its last trial)."""
    store = os.path.join(directory, f"init-{seed}.db")
    args.seed = seed
    torch.set_num_threads(1)
    exp = _experiment(store, args, "supergraph", args.population)
    exp.run()
    return store, max(t.id for t in exp.trials())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--children", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--space", choices=sorted(SPACES), default="cnn",
                        help="cnn: choices from the second layer on; deep: choices in the last conv only")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset, in this order")
    parser.add_argument("--flops", action="store_true", help="print the FLOP share a merged super-graph computes")
    parser.add_argument("--one", choices=VARIANTS)
    parser.add_argument("--store")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--last-init", type=int, default=0)
    args = parser.parse_args()
    if args.one:
        one(args)
        return
    if args.flops:
        flop_share(args)
        return
    print_machine()
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            store, last = prepare(args, seed, tmp)
            print(f"seed {seed}: initial population of {args.population} trained (trials up to {last})", flush=True)

            def run_one(variant: str, r: int) -> dict:
                copy = os.path.join(tmp, f"run-{seed}-{variant}-{r}.db")
                shutil.copy(store, copy)
                if os.path.exists(store + ".files"):
                    shutil.copytree(store + ".files", copy + ".files")
                common = ["--store", copy, "--seed", str(seed), "--last-init", str(last),
                          "--population", str(args.population), "--children", str(args.children),
                          "--epochs", str(args.epochs), "--space", args.space]
                res = run_worker(os.path.abspath(__file__), ["--one", variant, *common], timeout=1800)
                res.pop("samples"), res.pop("parents")
                return res

            for variant, runs in interleave(variants, args.rounds, run_one).items():
                results[variant].extend(runs)
    rows = []
    base = median(r["wall_per_child"] for r in results.get("ckpt-separate", []))
    base_cse = median(r["wall_per_child"] for r in results.get("ckpt-cse", []))
    for variant in variants:
        runs = results[variant]
        wall = median(r["wall_per_child"] for r in runs)
        rows.append([variant, len(runs), wall, median(r["cpu_per_child"] for r in runs),
                     median(r["train_s_per_child"] for r in runs), median(r["inherit_s_per_child"] for r in runs),
                     base / wall, base_cse / wall, median(r["mean_acc"] for r in runs),
                     median(r["best_acc"] for r in runs), median(r["fraction"] for r in runs),
                     median(r["merged"] for r in runs), median(r.get("node_share", 1.0) for r in runs)])
    print(table(["variant", "runs", "wall s/child", "CPU s/child", "train s/child", "inherit s/child",
                 "vs ckpt-separate", "vs ckpt-cse", "mean val_acc", "best val_acc", "inherited fraction",
                 "merged children", "nodes computed / children's nodes"], rows))
    for variant in variants:  # per run, in the order run (seed-major): for paired ratios
        print(variant, "cpu_per_child", [round(r["cpu_per_child"], 4) for r in results[variant]],
              "mean_acc", [round(r["mean_acc"], 4) for r in results[variant]])
    for other in [v for v in variants if v != "supergraph" and "supergraph" in results]:  # paired: same seed and round
        ratios = [a["cpu_per_child"] / b["cpu_per_child"] for a, b in zip(results["supergraph"], results[other])]
        print(f"CPU ratio supergraph / {other}: median {median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}) over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
