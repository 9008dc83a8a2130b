"""Benchmark: ``Experiment.export`` (``tridens export``) time per model, and where it goes.

A 4-trial grid search over :class:`_models.DigitsCNN` (the grid's first four samples) with two
learning rates, one epoch on digits, is trained once; then
``exp.export(dir, top=4)`` runs ``--repeats`` times in this process (each into a new directory),
and once in a fresh process (``--one``: the first export of a process, which pays its imports).
Each export writes, per model, the weights, the manifest and the ``torch.export`` program; the
script times the whole export and the ``torch.export.export`` / ``torch.export.save`` calls
inside it, and ``--profile`` prints the top functions by cumulative time.

    .venv/bin/python bench/export.py --repeats 3
    .venv/bin/python bench/export.py --profile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from _models import DigitsCNN  # noqa: E402

import torch  # noqa: E402

import tridens as td  # noqa: E402


class Timed:
    """Wraps torch.export.export and torch.export.save to add up their seconds."""

    def __init__(self) -> None:
        self.seconds = {"export": 0.0, "save": 0.0}
        self.calls = {"export": 0, "save": 0}

    def __enter__(self) -> "Timed":
        self.originals = torch.export.export, torch.export.save

        def wrap(name: str, fn: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1
            return timed

        torch.export.export = wrap("export", self.originals[0])
        torch.export.save = wrap("save", self.originals[1])
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.export.export, torch.export.save = self.originals


def searched(root: str) -> td.Experiment:
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam",
                                             lr=td.choice("lr", [1e-3, 1e-2]))
    exp = td.Experiment(DigitsCNN(), evaluator, td.strategy.GridSearch(), budget=4, store=os.path.join(root, "e.db"),
                        name="export", options=td.RunOptions(verbose=False))
    return exp


def export_once(exp: td.Experiment, target: str) -> dict[str, Any]:
    with Timed() as timed:
        t0 = time.perf_counter()
        folders = exp.export(target, top=4)
        wall = time.perf_counter() - t0
    return {"models": len(folders), "wall_s": wall, "per_model_s": wall / len(folders),
            "torch_export_s": timed.seconds["export"], "torch_save_s": timed.seconds["save"],
            "programs": timed.calls["export"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--one", help="export the experiment of this store directory once, print the JSON")
    args = p.parse_args()
    if args.one:
        exp = td.Experiment.load(os.path.join(args.one, "e.db"), "export")
        C.emit(export_once(exp, tempfile.mkdtemp(dir=args.one)))
        return
    C.print_machine()
    with tempfile.TemporaryDirectory() as root:
        exp = searched(root)
        exp.run()
        first = C.run_worker(os.path.abspath(__file__), ["--one", root])
        print(f"first export in a fresh process: {json.dumps({k: round(v, 3) for k, v in first.items()})}")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            export_once(exp, os.path.join(root, "profiled"))
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
        runs = [export_once(exp, os.path.join(root, f"out{i}")) for i in range(args.repeats)]
        for r in runs:
            print(json.dumps({k: round(v, 3) for k, v in r.items()}))
        print(f"median per model (warm process): {C.median(r['per_model_s'] for r in runs):.3f} s; "
              f"torch.export.export {C.median(r['torch_export_s'] / r['programs'] for r in runs):.3f} s per model")


if __name__ == "__main__":
    main()
