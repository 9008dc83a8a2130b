"""Time ``tridens.graph.trace`` + ``fingerprint`` on a hand-written ResNet-18 (1x3x32x32 input).

Run: ``.venv/bin/python bench/graph_trace.py``. Prints the median of repeated runs for the
torchvision-layout ResNet-18 (7x7 stride-2 stem) and the CIFAR variant (3x3 stem, no max-pool), with
the model's construction ("freeze") timed separately, and the cost of a first shape read (one
forward pass at batch 1) for reference.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "graph"))
from graph_models import torch_resnet18  # noqa: E402

import tridens.graph as tg  # noqa: E402


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(repeat: int = 20) -> None:
    x = torch.randn(1, 3, 32, 32)
    for cifar in (False, True):
        model = torch_resnet18(cifar_stem=cifar)
        tg.trace(model, x).fingerprint()  # warm-up (first fx trace patches torch functions)
        build = _median_ms(lambda: torch_resnet18(cifar_stem=cifar), max(3, repeat // 4))
        trace = _median_ms(lambda: tg.trace(model, x), repeat)
        both = _median_ms(lambda: tg.trace(model, x).fingerprint(), repeat)
        shapes = _median_ms(lambda: tg.trace(model, x).output.output_shape, repeat) - trace
        stem = "cifar 3x3 stem" if cifar else "imagenet 7x7 stem"
        print(f"ResNet-18 ({stem}), 1x3x32x32, torch {torch.__version__}, {torch.get_num_threads()} threads:")
        print(f"  construct model   {build:7.1f} ms")
        print(f"  trace             {trace:7.1f} ms")
        print(f"  trace+fingerprint {both:7.1f} ms")
        print(f"  first shape read  {shapes:7.1f} ms  (shape propagation, one forward pass)")


if __name__ == "__main__":
    main()
