"""Benchmark: warm start (tridens.warmup, ModelKeeper).

1. ``search``: a regularized-evolution search of 50 trials (population 10, tournament 3, one child
   per generation, mutation probability 0.3) on ``td.datasets.digits()`` (1,438 train / 359
   validation 8x8 images) or, with ``--dataset fashion``, Fashion-MNIST (seeded subsets of 5,000
   train / 1,000 test images, 28x28), with and without ``warm_start=True``, same experiment seeds.
   Each trial trains one epoch (batch 64, Adam 3e-3) of a small CNN from the space: conv1 width
   {8, 16, 24, 32} kernel {3, 5}, an optional second 3x3 conv {conv, identity}, an MLP head of
   {32, 64, 128} units. Reported per seed: the cold run's best accuracy, the trials / epochs /
   process CPU-seconds each run needs to first reach it (CPU-seconds of the whole run up to that
   trial: training, warm-start matching and transformation, engine bookkeeping; the process's
   one-time import of torch._dynamo by the first optimizer is paid before and reported apart), and
   each run's final best accuracy. With warm start the engine starts a group in waves
   (``Zoo.waves``), so the evolution's initial population is warm-started too.
2. ``latency``: matching a new model against a zoo of 1,000 models (MLPs and CNNs of 1-6 layers,
   widths 8-128, BatchNorm or not; 10-40 IR nodes each): ``describe`` (trace) of the new model,
   ``Zoo.candidates`` + ``choose`` (exhaustive batched DP, and through k-medoids clusters), and the
   one-off clustering time. Medians over 20 queries of different models.

Each search runs in its own fresh process (``--one``), cold and warm interleaved per seed, one torch
thread (``OMP_NUM_THREADS=1``).

    .venv/bin/python bench/warmup.py                 # 3 seeds x {cold, warm} + latency
    .venv/bin/python bench/warmup.py --seeds 1       # quicker
    .venv/bin/python bench/warmup.py --latency-only [--deep]
    .venv/bin/python bench/warmup.py --search-only --seeds 5 --population 5
    .venv/bin/python bench/warmup.py --search-only --seeds 3 --dataset fashion
    .venv/bin/python bench/warmup.py --widen-only    # one-epoch accuracy per widen choice
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_space(dataset: str = "digits"):
    import tridens as td
    from tridens import nn as tnn

    if dataset == "fashion":
        return _fashion_space()

    class SearchCNN(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("width", [8, 16, 24, 32])
            k = td.choice("kernel", [3, 5])
            h = td.choice("hidden", [32, 64, 128])
            self.conv1 = nn.Conv2d(1, w, k, padding=k // 2)
            self.conv2 = tnn.LayerChoice([nn.Conv2d(w, w, 3, padding=1), nn.Identity()], label="conv2")
            self.fc = nn.Linear(w * 16, h)
            self.head = nn.Linear(h, 10)
            self.example_inputs = (torch.zeros(2, 1, 8, 8),)

        def forward(self, x):
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            x = nn.functional.max_pool2d(x, 2).flatten(1)
            return self.head(torch.relu(self.fc(x)))

    return SearchCNN()


def _fashion_space():
    """The same choices for 28x28 Fashion-MNIST: a 2x2 pooling after each conv (w x 7 x 7 features)."""
    import tridens as td
    from tridens import nn as tnn

    class FashionCNN(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            w = td.choice("width", [8, 16, 24, 32])
            k = td.choice("kernel", [3, 5])
            h = td.choice("hidden", [32, 64, 128])
            self.conv1 = nn.Conv2d(1, w, k, padding=k // 2)
            self.conv2 = tnn.LayerChoice([nn.Conv2d(w, w, 3, padding=1), nn.Identity()], label="conv2")
            self.fc = nn.Linear(w * 49, h)
            self.head = nn.Linear(h, 10)
            self.example_inputs = (torch.zeros(2, 1, 28, 28),)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
            x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2).flatten(1)
            return self.head(torch.relu(self.fc(x)))

    return FashionCNN()


def one_search(mode: str, seed: int, trials: int, population: int = 10, dataset: str = "digits") -> dict:
    import tridens as td

    torch.set_num_threads(1)
    if dataset == "fashion":
        train, val = td.datasets.fashion_mnist(limit=5000, val_limit=1000)
    else:
        train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.003)
    # One-time costs of the process, the same for both runs and not part of either search: the
    # first torch.optim optimizer imports torch._dynamo (~1.5 s CPU here). Paid and reported apart.
    c0 = time.process_time()
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    import_cpu = time.process_time() - c0
    marks: list[tuple[int, float, float | None]] = []
    spans: list[tuple[float, float]] = []  # (started, finished) wall time of each trial in ``marks``

    first_ask: list[float] = []

    class Timed(td.strategy.RegularizedEvolution):
        def ask(self, remaining=None):
            if not first_ask:
                first_ask.append(time.process_time() - t0)
            return super().ask(remaining)

        def tell(self, trial):
            super().tell(trial)
            if trial.status in (td.TrialStatus.COMPLETED, td.TrialStatus.STOPPED):
                marks.append((trial.id, time.process_time() - t0, trial.metric))
                spans.append((trial.started_at, trial.finished_at))

    strategy = Timed(population=population, sample_size=3, batch_size=1, mutation_prob=0.3)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.process_time()
        w0 = time.perf_counter()
        exp = td.Experiment(make_space(dataset), ev, strategy, budget=trials, store=os.path.join(d, "b.db"), name="b",
                            options=td.RunOptions(seed=seed, warm_start=mode == "warm", verbose=False))
        exp.run()
        wall = time.perf_counter() - w0
        rows = exp.trials()
        warm = sum(1 for t in rows if (t.info.get("warm_start") or {}).get("parent") is not None)
    # Epochs the run had trained when each trial's result came: every trial that had started by
    # then (one epoch each). A group trained in lockstep delivers all its results at its end, so
    # its first result already cost the whole group's epochs.
    trained = [sum(1 for start, _ in spans if start <= end) for _, end in spans]
    return {"mode": mode, "seed": seed, "curve": marks, "trained": trained, "setup_cpu_s": first_ask[0] if first_ask else 0.0, "wall_s": wall, "cpu_s": time.process_time() - t0,
            "warm_started": warm, "import_cpu_s": import_cpu}


def _run_one(mode: str, seed: int, trials: int, population: int, dataset: str = "digits") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "src"))
    out = subprocess.run([sys.executable, __file__, "--one", mode, "--seed", str(seed), "--trials", str(trials),
                          "--population", str(population), "--dataset", dataset],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _first_reach(curve, target, trained=None):
    """(results received, CPU-s) when a trial first reached ``target``; with ``trained``, the epochs
    trained by then instead of the results received."""
    for n, (_, cpu, metric) in enumerate(curve, 1):
        if metric is not None and metric >= target - 1e-12:
            return (trained[n - 1] if trained else n), cpu
    return None, None


def search(seeds: int, trials: int, population: int, dataset: str = "digits", first: int = 0) -> list[dict]:
    rows = []
    for seed in range(first, first + seeds):
        cold = _run_one("cold", seed, trials, population, dataset)
        warm = _run_one("warm", seed, trials, population, dataset)
        target = max(m for _, _, m in cold["curve"] if m is not None)
        cn, ccpu = _first_reach(cold["curve"], target)
        wn, wcpu = _first_reach(warm["curve"], target)
        thresholds = {}
        for th in (0.85, 0.88, 0.90):
            thresholds[str(th)] = [_first_reach(cold["curve"], th)[0], _first_reach(warm["curve"], th)[0]]
        row = {"seed": seed, "population": population, "trials_to_threshold_cold_warm": thresholds, "cold_best": target, "warm_best": max(m for _, _, m in warm["curve"] if m is not None),
               "cold_trials_to_target": cn, "warm_trials_to_target": wn,
               "cold_cpu_to_target": ccpu, "warm_cpu_to_target": wcpu,
               "cold_cpu_total": cold["cpu_s"], "warm_cpu_total": warm["cpu_s"],
               "warm_started": warm["warm_started"], "import_cpu_s": [cold["import_cpu_s"], warm["import_cpu_s"]],
               "wall_s": [cold["wall_s"], warm["wall_s"]]}
        row["epoch_ratio"] = cn / wn if wn else None
        # the same, counting the epochs each run had trained when the target was first reached
        ce, _ = _first_reach(cold["curve"], target, cold["trained"])
        we, _ = _first_reach(warm["curve"], target, warm["trained"])
        row["cold_epochs_trained_to_target"], row["warm_epochs_trained_to_target"] = ce, we
        row["trained_epoch_ratio"] = ce / we if we else None
        row["cpu_ratio"] = ccpu / wcpu if wcpu else None
        # the same without the run's fixed set-up (store, space, strategy start) before the first trial
        if wcpu:
            row["cpu_ratio_after_setup"] = (ccpu - cold["setup_cpu_s"]) / (wcpu - warm["setup_cpu_s"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


WIDEN_PAIRS = [  # (parent sample, child sample): wider, narrower, and with conv2 changed
    ({"width": 8, "kernel": 3, "hidden": 64, "conv2": 0}, {"width": 32, "kernel": 5, "hidden": 128, "conv2": 1}),
    ({"width": 24, "kernel": 3, "hidden": 128, "conv2": 0}, {"width": 16, "kernel": 5, "hidden": 64, "conv2": 1}),
    ({"width": 16, "kernel": 3, "hidden": 32, "conv2": 0}, {"width": 32, "kernel": 3, "hidden": 128, "conv2": 0}),
    ({"width": 32, "kernel": 3, "hidden": 128, "conv2": 0}, {"width": 8, "kernel": 3, "hidden": 32, "conv2": 0}),
]


def widen_pairs(seeds=(2, 3)) -> list[dict]:
    """Validation accuracy after one epoch (digits, batch 64, Adam 3e-3) of a child trained cold and
    warm-started from a parent trained one epoch, with each ``widen`` choice of ``transfer``."""
    import tridens as td
    from tridens.warmup import align, describe, transfer

    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    x, y, vx, vy = train.tensors[0], train.tensors[1], val.tensors[0], val.tensors[1]
    space = make_space()
    ex = space.example_inputs

    def build(sample, seed):
        torch.manual_seed(seed)
        return space.freeze(sample)

    def fit(m, seed):
        opt, g = torch.optim.Adam(m.parameters(), lr=3e-3), torch.Generator().manual_seed(seed)
        m.train()
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(m(x[idx]), y[idx]).backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            return float((m(vx).argmax(1) == vy).float().mean())

    rows = []
    for ps, cs in WIDEN_PAIRS:
        parent = build(ps, 1)
        row = {"parent": ps, "child": cs, "parent_acc": fit(parent, 1)}
        pd = describe(parent, ex)
        for seed in seeds:
            row[f"cold_{seed}"] = fit(build(cs, seed), seed)
            for widen in ("replicate", "noise", "zero"):
                child = build(cs, seed)
                cd = describe(child, ex)
                _, pairs = align(cd, pd)
                new, _ = transfer(cd, pd, pairs, parent.state_dict(), child.state_dict(), widen=widen)
                child.load_state_dict(new)
                row[f"{widen}_{seed}"] = fit(child, seed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _zoo_model(i: int) -> nn.Module:
    import random

    r = random.Random(i)
    if r.random() < 0.5:
        layers = [nn.Flatten()]
        width, n_in = r.choice([8, 16, 32, 64, 128]), 64
        for _ in range(r.randint(1, 6)):
            layers += [nn.Linear(n_in, width), nn.ReLU()]
            n_in, width = width, r.choice([8, 16, 32, 64, 128])
        return nn.Sequential(*layers, nn.Linear(n_in, 10))
    layers, c = [], 1
    for _ in range(r.randint(1, 5)):
        w, k = r.choice([8, 16, 24, 32]), r.choice([3, 5])
        layers += [nn.Conv2d(c, w, k, padding=k // 2)] + ([nn.BatchNorm2d(w)] if r.random() < 0.5 else []) + [nn.ReLU()]
        c = w
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * 64, 10))


def _deep_model(i: int) -> nn.Module:
    """A 25-35-layer MLP (~60 IR nodes): ResNet-sized graphs for the matcher."""
    import random

    r = random.Random(i)
    layers, n_in = [nn.Flatten()], 64
    for _ in range(r.randint(25, 35)):
        w = r.choice([16, 32, 64])
        layers += [nn.Linear(n_in, w), nn.ReLU()]
        n_in = w
    return nn.Sequential(*layers, nn.Linear(n_in, 10))


def latency(n: int = 1000, queries: int = 20, deep: bool = False) -> dict:
    import tridens as td
    from tridens.warmup import describe

    torch.set_num_threads(1)
    x = torch.zeros(2, 1, 8, 8)
    with tempfile.TemporaryDirectory() as d:
        zoo = td.warmup.Zoo(os.path.join(d, "zoo.db"), cluster_threshold=10**9)
        t = time.perf_counter()
        make = _deep_model if deep else _zoo_model
        distinct = [describe(make(i), x) for i in range(100 if deep else n)]  # deep: 100 graphs, 10 copies each
        for i in range(n):
            zoo.add_description(distinct[i % len(distinct)], {"w": torch.zeros(1)}, accuracy=0.5 + (i % 97) / 200, name=f"m{i}")
        build = time.perf_counter() - t
        nodes = [e.encoded.n for e in zoo]
        qs = [make(10_000 + q) for q in range(queries)]
        t_desc, t_full, t_clu, c_full, agree = [], [], [], [], 0
        zoo.choose(zoo.scores(describe(qs[0], x)))  # warm-up
        t, c = time.perf_counter(), time.process_time()
        zoo.cluster_threshold = 200
        clusters = zoo.clusters(force=True)
        t_cluster, c_cluster = time.perf_counter() - t, time.process_time() - c
        for q in qs:
            t = time.perf_counter()
            dq = describe(q, x)
            t_desc.append(time.perf_counter() - t)
            zoo.cluster_threshold = 10**9
            t, c = time.perf_counter(), time.process_time()
            full = zoo.choose(zoo.candidates(dq))
            t_full.append(time.perf_counter() - t)
            c_full.append(time.process_time() - c)
            zoo.cluster_threshold = 200
            t = time.perf_counter()
            via = zoo.choose(zoo.candidates(dq))
            t_clu.append(time.perf_counter() - t)
            if full and via and (via[1] >= full[1] - zoo.bucket):
                agree += 1
        med = statistics.median
        return {"zoo": n, "deep": deep, "nodes_median": med(nodes), "nodes_max": max(nodes), "build_s": build,
                "describe_ms": med(t_desc) * 1000, "match_exhaustive_ms": med(t_full) * 1000,
                "match_exhaustive_max_ms": max(t_full) * 1000, "match_exhaustive_cpu_ms": med(c_full) * 1000, "match_clusters_ms": med(t_clu) * 1000,
                "clusters": len(clusters["medoids"]), "clustering_s": t_cluster, "clustering_cpu_s": c_cluster,
                "clusters_same_bucket": f"{agree}/{queries}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=["cold", "warm"])
    ap.add_argument("--seed", type=int, default=0, help="the (first) experiment seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--population", type=int, default=10, help="evolution population (its first group is all cold)")
    ap.add_argument("--latency-only", action="store_true")
    ap.add_argument("--deep", action="store_true", help="latency with ~60-node graphs (slow clustering)")
    ap.add_argument("--search-only", action="store_true")
    ap.add_argument("--widen-only", action="store_true", help="one-epoch accuracy of warm-started pairs per widen choice")
    ap.add_argument("--dataset", choices=["digits", "fashion"], default="digits",
                    help="fashion: Fashion-MNIST, 5,000 train / 1,000 validation images (seeded subsets)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_search(args.one, args.seed, args.trials, args.population, args.dataset)))
        return
    print(f"# load average {os.getloadavg()}, torch {torch.__version__}", flush=True)
    if args.widen_only:
        widen_pairs()
        return
    if not args.search_only:
        print(json.dumps({"latency": latency()}), flush=True)
        if args.deep:
            print(json.dumps({"latency": latency(queries=5, deep=True)}), flush=True)
    if not args.latency_only:
        rows = search(args.seeds, args.trials, args.population, args.dataset, args.seed)
        med, mean = statistics.median, statistics.mean
        ratios = [r["epoch_ratio"] for r in rows if r["epoch_ratio"]]
        cpu = [r["cpu_ratio"] for r in rows if r["cpu_ratio"]]
        cpu2 = [r["cpu_ratio_after_setup"] for r in rows if r.get("cpu_ratio_after_setup")]
        trained = [r["trained_epoch_ratio"] for r in rows if r.get("trained_epoch_ratio")]
        print(json.dumps({"summary": {"dataset": args.dataset, "population": args.population,
                                      "seeds": len(rows), "epoch_ratio_median": med(ratios) if ratios else None,
                                      "epoch_ratio_mean": mean(ratios) if ratios else None,
                                      "trained_epoch_ratio_median": med(trained) if trained else None,
                                      "trained_epoch_ratio_mean": mean(trained) if trained else None,
                                      "cpu_ratio_median": med(cpu) if cpu else None,
                                      "cpu_ratio_mean": mean(cpu) if cpu else None,
                                      "cpu_ratio_after_setup_median": med(cpu2) if cpu2 else None,
                                      "warm_best_not_lower": sum(r["warm_best"] >= r["cold_best"] for r in rows)}}))


if __name__ == "__main__":
    main()
