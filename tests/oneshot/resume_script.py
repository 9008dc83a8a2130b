"""A one-shot search run as a separate process by the resume test: ``python resume_script.py DB EPOCHS``."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.oneshot.spaces

import tridens as td  # noqa: E402
from tests.oneshot.spaces import DigitsCNN  # noqa: E402


def main(db: str, epochs: int) -> None:
    torch.set_num_threads(1)  # the same float results in every process
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    td.Experiment(DigitsCNN(), evaluator, td.oneshot.ENAS(samples=4, population=2, retrain=True, epochs=epochs),
                  store=db, name="resume", options=td.RunOptions(verbose=True)).run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
