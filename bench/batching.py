"""Operator batching: K same-shaped models fused into one vectorized model vs a plain
sequential PyTorch loop over the same models, data and steps.

Scenarios (HPO over lr, weight decay and seed; every model has the same structure):

* ``digits-cnn`` / ``digits-mlp``: small CNNs / MLPs on scikit-learn's 8x8 digits, 3 epochs
  (the overhead-bound case, where fusion should pay: target >= 3x at K=16); ``digits-cnn-pool``:
  the same CNN LeNet-style, a 2x2 max-pool after each convolution (its second convolution runs
  on 4x4 maps: a quarter of ``digits-cnn``'s FLOPs, the kind of small CNN for which DESIGN.md's
  prototype gives plain ``vmap`` 2.5x);
* ``fashion-cnn``: a 16/32-channel CNN on 28x28 Fashion-MNIST, one epoch (the compute-bound case,
  where a vmapped model becomes grouped convolutions: the planner must not be slower than
  sequential). Debian's ``dataset-fashion-mnist`` (``make fashion-mnist``); without it mnist5k at
  28x28 is used and the header says so. ``--fashion-limit N`` trains on N training images and
  validates on max(1000, N/6) (default 2,000 of 60,000, to keep the run short; ``0``: the full
  epoch and the 10,000 test images); ``fashion-lenet``: the headline suite's HPO model
  (``bench/headline.py`` hpo: LeNet-5, 5x5 convolutions with 6 and 16 channels, three Linear
  layers) on the same data, where fused and separate steps run at nearly the same speed.

Every mode trains on ``--device`` (default ``auto``: CUDA where there is a GPU, else the CPU; on a
GPU the times are synchronized wall times, GFLOP/s per wall second against an 8192x8192 matmul,
and the peak GPU memory is reported beside the RSS). Each measurement runs in a fresh child
process (so peak RSS is its own), in the modes:

* ``sequential``: a plain PyTorch loop, model after model (``torch.optim.SGD``, the same data
  order, ``loss.item()`` per step, validation every epoch);
* ``vmap`` (not run by default): plain ``torch.func`` as DESIGN.md's prototype runs it, no tridens: the
  K models' stacked state, ``vmap(functional_call)`` with the batch shared and independent dropout
  masks, one ``autograd.grad``, SGD with momentum and weight decay on the stacked tensors;
* ``fused``: tridens' :class:`BatchedUnit` forced on all K (one vectorized model);
* ``planner``: what tridens does by default: ``plan_batching`` plans an adaptive unit, which
  decides fused or separate from its own first real training steps (``tridens.xopt._adaptive``);
  leftovers train as a ``SeparateUnit``. The time includes planning and deciding; the last column
  says what the unit decided and why (read after training).
* ``planner-cached`` (not run by default): ``planner`` on a machine where the same run happened
  before: an untimed identical run first measures and stores the decisions
  (``BatchingSettings.decision_cache``, a new file each time), the timed one plans from them.
* ``MODE-ref`` (with ``--ref-src DIR``): MODE with tridens imported from ``DIR/src``, e.g. the
  planner of an earlier commit (``git archive <commit> src | tar -x -C DIR``), run interleaved with
  the others.

Modes alternate (A B C, then C B A, ...) for ``--reps`` rounds; medians are reported, with the
speed-up over sequential, achieved GFLOP/s (training FLOPs from the graph IR: forward FLOPs x 3,
plus validation forwards) beside the peak fp32 matmul GFLOP/s measured in the same run, and the
peak memory of each child (max RSS, and its increase over the RSS before training).

    .venv/bin/python bench/batching.py                         # everything, ~30 min on 2 shared cores
    .venv/bin/python bench/batching.py --scenarios digits-cnn --ks 16 --reps 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tempfile

import torch
import torch.nn as nn

SCENARIOS = ("digits-cnn", "digits-cnn-pool", "digits-mlp", "fashion-cnn", "fashion-lenet")
MODES = ("sequential", "fused", "planner")  # and "vmap" on request (--modes)


# -- models and data -----------------------------------------------------------------------------------
def make_model(scenario: str) -> nn.Module:
    if scenario == "digits-cnn":
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16 * 16, 10))
    if scenario == "digits-cnn-pool":  # LeNet-style: a 2x2 max-pool after each convolution
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16 * 2 * 2, 10))
    if scenario == "digits-mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    if scenario == "fashion-cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    if scenario == "fashion-lenet":  # the headline suite's hpo model (bench/headline.py), without dropout
        return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))
    raise ValueError(scenario)


def load_data(scenario: str, fashion_limit: int) -> tuple[object, object, str]:
    import tridens as td

    if scenario.startswith("digits"):
        train, val = td.datasets.digits()
        return train, val, "digits (1,438 train / 359 val, 8x8)"
    try:
        train, val = td.datasets.fashion_mnist(limit=fashion_limit or None,
                                               val_limit=max(1000, fashion_limit // 6) if fashion_limit else None)
        name = "Fashion-MNIST"
    except td.datasets.DatasetNotFound:
        train, val = td.datasets.mnist5k()
        name = "mnist5k (FALLBACK: dataset-fashion-mnist is not installed)"
    return train, val, f"{name} ({len(train):,} train / {len(val):,} val, 28x28)"


EPOCHS = {"digits-cnn": 3, "digits-cnn-pool": 3, "digits-mlp": 3, "fashion-cnn": 1, "fashion-lenet": 1}
BATCH = {"digits-cnn": 64, "digits-cnn-pool": 64, "digits-mlp": 64, "fashion-cnn": 64, "fashion-lenet": 64}


def hparams(k: int) -> list[dict]:
    """K points of an HPO over lr, weight decay and seed (deterministic)."""
    import random

    rng = random.Random(0)
    return [{"lr": 10 ** rng.uniform(-2.5, -0.7), "wd": rng.choice([0.0, 1e-4, 1e-3]), "seed": 1000 + i}
            for i in range(k)]


# -- the child: one measurement ------------------------------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> None:
    import tridens as td
    from tridens.trial import Trial
    try:
        from tridens.units import Job, SeparateUnit
    except ImportError:  # a --ref-src snapshot from before tridens.units
        from tridens.executors._execution import Job
        from tridens.engine._units import SeparateUnit
    from tridens.xopt import _batching
    try:
        from tridens.xopt import Settings
        planner_options = {"settings": Settings()}  # the defaults: batching decided by measurement ("auto")
        if args.mode == "planner-cached":  # decisions read from the file an untimed identical run wrote
            planner_options = {"settings": Settings().with_batching(decision_cache=args.decision_cache)}
    except ImportError:  # a --ref-src snapshot from before td.xopt.Settings: module-level knobs, "auto" too
        planner_options = {}

    if args.threads:
        torch.set_num_threads(args.threads)
    scenario, k, mode = args.scenario, args.k, args.mode
    device = torch.device(resolve_device(args.device))
    train, val, _ = load_data(scenario, args.fashion_limit)
    epochs, batch = EPOCHS[scenario], BATCH[scenario]
    points = hparams(k)
    models = []
    for p in points:
        torch.manual_seed(p["seed"])
        # the plain loops train on the device themselves; tridens' units move the models they are given
        models.append(make_model(scenario).to(device) if mode in ("sequential", "vmap") else make_model(scenario))
    ev = td.evaluators.Classification(train, val, epochs=epochs, batch_size=batch, optimizer="sgd", momentum=0.9,
                                      lr=td.uniform("lr", 1e-4, 1.0), weight_decay=td.uniform("wd", 0.0, 1.0),
                                      device=str(device))
    cfg = ev.config({"lr": 0.1, "wd": 0.0})
    xs, ys = (t.to(device) for t in train.tensors)
    vx, vy = (t.to(device) for t in val.tensors)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    decision = ""
    # one-time imports (torch.optim pulls in torch._dynamo on first use) are not what is measured
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import tridens.graph  # noqa: F401  (the planner traces models)
    base_rss = _rss_mib()
    sync()
    c0 = time.process_time()
    t0 = time.perf_counter()
    if mode == "sequential":
        for model, p in zip(models, points):
            opt = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=0.9, weight_decay=p["wd"])
            torch.manual_seed(p["seed"])
            for epoch in range(epochs):
                model.train()
                for idx in cfg.epoch_order(0, epoch).split(batch):
                    opt.zero_grad(set_to_none=True)
                    loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
                    loss.item()
                    loss.backward()
                    opt.step()
                model.eval()
                with torch.no_grad():
                    for s in range(0, len(vy), 256):
                        out = model(vx[s:s + 256])
                        nn.functional.cross_entropy(out, vy[s:s + 256]).item()
                        (out.argmax(1) == vy[s:s + 256]).sum().item()
    elif mode == "vmap":
        # plain torch.func, as DESIGN.md's prototype runs it: stacked state, vmap(functional_call) over the
        # models with the batch shared, independent dropout masks (randomness="different"), per-model
        # losses, one autograd.grad, SGD with momentum and weight decay on the stacked tensors
        from torch.func import functional_call, stack_module_state, vmap

        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        lrs, wds = (torch.tensor([p[key] for p in points], device=device) for key in ("lr", "wd"))
        velocity = {n: torch.zeros_like(v) for n, v in params.items()}

        def losses(params, buffers, x, y):
            return nn.functional.cross_entropy(functional_call(base, (params, buffers), (x,)), y)

        def outputs(params, buffers, x):
            return functional_call(base, (params, buffers), (x,))

        train_losses = vmap(losses, in_dims=(0, 0, None, None), randomness="different")
        eval_outputs = vmap(outputs, in_dims=(0, 0, None))
        torch.manual_seed(points[0]["seed"])
        for epoch in range(epochs):
            base.train()
            for idx in cfg.epoch_order(0, epoch).split(batch):
                loss = train_losses(params, buffers, xs[idx], ys[idx])
                loss.tolist()
                grads = torch.autograd.grad(loss.sum(), list(params.values()))
                with torch.no_grad():
                    for (n, p), g in zip(params.items(), grads):
                        shape = (-1,) + (1,) * (p.dim() - 1)
                        velocity[n].mul_(0.9).add_(g.add(p * wds.view(shape)))
                        p.sub_(velocity[n] * lrs.view(shape))
            base.eval()
            with torch.no_grad():
                for s in range(0, len(vy), 256):
                    out = eval_outputs(params, buffers, vx[s:s + 256])
                    vmap(nn.functional.cross_entropy, in_dims=(0, None))(out, vy[s:s + 256]).tolist()
                    (out.argmax(2) == vy[s:s + 256]).sum(1).tolist()
    else:
        jobs = [Job(Trial(id=i, sample={"lr": p["lr"], "wd": p["wd"]}, seed=p["seed"]), m)
                for i, (m, p) in enumerate(zip(models, points))]
        if mode == "fused" and k > 1:
            units = [_batching.BatchedUnit(jobs, ev)]
            decision = f"fused {k}, {units[0].member.engine}"
        elif mode == "fused":
            units = [SeparateUnit(jobs, ev)]
            decision = "K=1: separate"
        else:
            units, rest = _batching.plan_batching(jobs, ev, **planner_options)
            if rest:
                units.append(SeparateUnit(rest, ev))
        sizes = [len(unit.jobs) for unit in units]  # (units drop their trials as they finish)
        for unit in units:
            while unit.active():
                for tid, result in unit.train_epoch().items():
                    if isinstance(result, BaseException):
                        raise result
                for job in unit.active():
                    if unit.epoch(job.trial.id) >= unit.limit(job.trial.id):
                        unit.weights(job.trial.id)
                        unit.drop(job.trial.id)
    sync()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if mode.startswith("planner"):  # what the units decided (adaptive ones on their first real steps), after timing
        decision = "; ".join(planner_decision(u, n) for u, n in zip(units, sizes))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gpu_peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_mib": peak, "base_mib": base_rss, "gpu_peak_mib": gpu_peak,
                      "decision": decision}))


def planner_decision(unit: object, size: int) -> str:
    from tridens.xopt import _batching

    try:
        from tridens.xopt import _adaptive
    except ImportError:  # a --ref-src from before adaptive units: what the planner measured up front
        speedup = next(iter(getattr(_batching, "_SPEEDUPS", {}).values()), None)
        eff = next(iter(getattr(_batching, "_EFFICIENCY", {}).values()), None)
        text = "fused" if isinstance(unit, _batching.BatchedUnit) else "separate"
        if speedup:
            return f"{text} (measured {speedup:.2f}x before training)"
        return f"{text} (one model at {100 * eff[0]:.0f}% of peak)" if eff else text
    if isinstance(unit, _adaptive.AdaptiveUnit):
        return (f"{len(unit.member.jobs)} trials {unit.member.decision} ({unit.member.engine}; steps of the "
                f"other kind while deciding: {unit.member.wasted_seconds:.3f} CPU s)")
    if isinstance(unit, _batching.BatchedUnit):
        return f"{unit.reason} ({unit.member.engine})"
    return f"{size} trial(s) separate (planned: nothing to fuse with)"


# -- the parent: interleaved rounds ---------------------------------------------------------------------
def resolve_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def peak_matmul_gflops(threads: int | None, device: str = "cpu") -> float:
    if threads:
        torch.set_num_threads(threads)
    n = 2048 if device == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = 0.0
    for _ in range(6):  # CPU: per CPU second, like the runs' GFLOP/s (wall time under load says little)
        if device == "cpu":
            t0 = time.process_time()
            a @ b
            seconds = time.process_time() - t0
        else:  # a GPU: wall time, synchronized
            a @ b
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        best = max(best, 2 * n ** 3 / seconds / 1e9)
    return best


def train_flops(scenario: str, k: int, fashion_limit: int) -> float:
    import tridens as td

    train, val, _ = load_data(scenario, fashion_limit)
    x = train.tensors[0][:1]
    fwd = td.graph.trace(make_model(scenario), (x,)).flops()
    return k * EPOCHS[scenario] * (3 * fwd * len(train) + fwd * len(val))


def run_child(args: argparse.Namespace, scenario: str, k: int, mode: str) -> dict:
    env = None
    if mode.endswith("-ref"):  # the same mode, with tridens imported from --ref-src (e.g. an older commit)
        mode = mode[:-len("-ref")]
        env = {**os.environ, "PYTHONPATH": os.path.join(args.ref_src, "src")}
    cmd = [sys.executable, __file__, "--child", "--scenario", scenario, "--k", str(k), "--mode", mode,
           "--fashion-limit", str(args.fashion_limit), "--device", args.device] + (
        ["--threads", str(args.threads)] if args.threads else [])
    if mode == "planner-cached":
        with tempfile.TemporaryDirectory() as d:
            cmd += ["--decision-cache", os.path.join(d, "batching.sqlite")]
            subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)  # measures and stores
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    else:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--ks", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=3, help="rounds per (scenario, K) on digits")
    parser.add_argument("--fashion-reps", type=int, default=1, help="rounds per (scenario, K) on Fashion-MNIST")
    parser.add_argument("--fashion-limit", type=int, default=2000)
    parser.add_argument("--fashion-ks", default="1,4,16", help="K on Fashion-MNIST (64 takes ~30 min here)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine 2 threads spin-wait)")
    parser.add_argument("--device", default="auto",
                        help="where every mode trains: auto (cuda if available, else cpu), cpu, cuda, cuda:1 ...")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="any of sequential, vmap, fused, planner, planner-cached; MODE-ref runs MODE with tridens from --ref-src")
    parser.add_argument("--ref-src", help="a checkout (e.g. `git archive <commit> src | tar -x -C DIR`) whose src/ "
                        "the -ref modes import tridens from")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--decision-cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    modes = args.modes.split(",")
    device = resolve_device(args.device)
    gpu = device != "cpu"
    peak = peak_matmul_gflops(args.threads or None, device)
    print(f"# bench/batching.py  torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if gpu else ""))
    print(f"# peak fp32 matmul (best of 6, {'8192x8192, wall' if gpu else '2048x2048, per CPU second'}): "
          f"{peak:.0f} GFLOP/s")
    for scenario in args.scenarios.split(","):
        print(f"\n## {scenario}: {load_data(scenario, args.fashion_limit)[2]}, {EPOCHS[scenario]} epoch(s), "
              f"batch {BATCH[scenario]}")
        print(f"| K | mode | wall s | CPU s | vs sequential (wall / CPU) | GFLOP/s ({'wall' if gpu else 'CPU'}) | "
              f"% of peak | peak RSS MiB (+ over start){' / GPU MiB' if gpu else ''} | planner |")
        print("|---|---|---|---|---|---|---|---|---|")
        reps = args.fashion_reps if scenario.startswith("fashion") else args.reps
        ks = args.fashion_ks if scenario.startswith("fashion") else args.ks
        for k in [int(v) for v in ks.split(",")]:
            results: dict[str, list[dict]] = {m: [] for m in modes}
            for r in range(reps):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    results[mode].append(run_child(args, scenario, k, mode))
            flops = train_flops(scenario, k, args.fashion_limit)
            seq = statistics.median(x["seconds"] for x in results["sequential"]) if "sequential" in results else None
            seq_cpu = statistics.median(x["cpu"] for x in results["sequential"]) if "sequential" in results else None
            for mode in modes:
                secs = statistics.median(x["seconds"] for x in results[mode])
                cpu = statistics.median(x["cpu"] for x in results[mode])
                peak_mib = max(x["peak_mib"] for x in results[mode])
                grow = max(x["peak_mib"] - x["base_mib"] for x in results[mode])
                # CPU: per CPU second, what one (shared) core achieved; a GPU: per wall second
                gflops = flops / (secs if gpu else cpu) / 1e9
                ratio = f"{seq / secs:.2f}x / {seq_cpu / cpu:.2f}x" if seq else ""
                decision = results[mode][0]["decision"]
                gpu_mib = f" / {max(x['gpu_peak_mib'] for x in results[mode]):.0f}" if gpu else ""
                print(f"| {k} | {mode} | {secs:.2f} | {cpu:.2f} | {ratio} | {gflops:.1f} | {100 * gflops / peak:.0f}% | "
                      f"{peak_mib:.0f} (+{grow:.0f}){gpu_mib} | {decision} |", flush=True)


if __name__ == "__main__":
    main()
