"""Child process of the crash and concurrency tests: writes trials like the engine does.

Usage: python _store_writer.py DB N  (N < 0: until killed). Prints ``ready``, waits for a line on
stdin, then for each trial prints ``done <id> <i>`` once the trial is committed as completed.
"""

from __future__ import annotations

import sys

import torch

from tridens.store import Store
from tridens.trial import Trial, TrialStatus


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2])
    store = Store(path, timeout=30)
    store.create_experiment("run", exist_ok=True)
    print("ready", flush=True)
    sys.stdin.readline()
    i = 0
    while n < 0 or i < n:
        t = store.add_trial("run", Trial(id=-1, sample={"i": i, "width": 16 * (1 + i % 4)}, seed=i))
        t.status = TrialStatus.RUNNING
        store.update_trial(t)
        for step in range(3):
            store.add_metrics(t.id, step, {"acc": i + step / 10, "loss": float(i)})
        store.save_checkpoint(t.id, {"w": torch.full((256,), float(i)), "i": i})
        t.status, t.metric = TrialStatus.COMPLETED, float(i)
        store.update_trial(t)
        print(f"done {t.id} {i}", flush=True)
        i += 1
    store.close()


if __name__ == "__main__":
    main()
