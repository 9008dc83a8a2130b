"""The cost of a lost node: the same search on a two-node Ray cluster, undisturbed and with its
worker node lost mid-search.

A ``ray.cluster_utils.Cluster`` on this machine: a head with no CPUs (the driver and the search's
hub live there) and a worker node with two CPUs. The search: a grid of 12 small CNNs on digits,
6 epochs each, one Ray task per trial (``optimize=False``), ``td.executors.Ray(workers=2,
max_retries=2)``. In ``lost``, when the first trial reports its third epoch the worker node is
removed (its raylet and workers killed) and a fresh two-CPU node is started beside it (the
driver waits for it to join), as an autoscaler would replace it; the lost node's trials restart there from their last epoch
checkpoints. The node is added from the main thread: ``Cluster.add_node`` starts a
``ray._private.node.Node``, which installs a SIGTERM handler, and Python allows that only in the
main thread -- from another thread ``add_node`` raises ``ValueError: signal only works in main
thread`` before any raylet starts, so no node joins and the retried tasks wait for CPUs that never
come (the head has none): the run looks hung. Each run in a fresh process, interleaved (A B, B A, ...); wall time and CPU-seconds
of the whole process tree (the driver, the raylets, the workers) from the search's start to its
end (the cluster's start is not counted); the extra of ``lost`` over ``undisturbed`` beside the
time the replacement node took to join (part of the restart cost). The restarted trials record
every epoch once: they restart from the checkpoint of their last reported epoch, so what is
trained twice is the epoch in flight.

    .venv/bin/python bench/node_loss.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402

STATE: dict[str, Any] = {}


class CNN(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16, 24])
        self.net = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
                                 nn.MaxPool2d(2), nn.Flatten(), nn.Linear(w * 16, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.net(x)


class LoseANode(td.strategy.GridSearch):
    """Grid search that loses the worker node when the first trial reports epoch ``at``; a fresh
    node joins in the background."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def decide(self, trial, step):
        if step == self.at and "lost_at" not in STATE:
            cluster = STATE["cluster"]
            STATE["lost_at"] = time.perf_counter()
            cluster.remove_node(cluster.first_worker)
            t0 = time.perf_counter()
            cluster.add_node(num_cpus=2)   # in the main thread: from another one Ray cannot start a node (see above)
            STATE["join_s"] = time.perf_counter() - t0
        return super().decide(trial, step)


def one(mode: str) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.first_worker = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    STATE["cluster"] = cluster
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=6, batch_size=64, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003, 0.001, 0.03]))
    strategy = LoseANode(at=2) if mode == "lost" else td.strategy.GridSearch()
    clock = C.ProcessTreeClock(interval=0.25)
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(CNN(), ev, strategy, options=td.RunOptions(seed=0, verbose=False),
                            store=os.path.join(d, "n.db"), name="nodes",
                            executor=td.executors.Ray(workers=2, address=cluster.address, storage=os.path.join(d, "ckpt"), max_retries=2, optimize=False))
        clock.start()
        t0 = time.perf_counter()
        exp.run()
        wall = time.perf_counter() - t0
        clock.stop()
        cpu = clock.elapsed_cpu()
        trials = exp.trials()
    ray.shutdown()
    cluster.shutdown()
    return {"wall": wall, "cpu": cpu, "completed": sum(t.status.value == "completed" for t in trials),
            "restarted": sum(bool(t.info.get("ray_restarts")) for t in trials),
            "epochs": sum(len(t.metrics.get("val_acc", [])) for t in trials),
            "best": max(t.metric for t in trials if t.metric is not None), "join_s": STATE.get("join_s", 0.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", choices=["undisturbed", "lost"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        C.emit(one(args.one))
        return
    C.print_machine()
    script = os.path.abspath(__file__)
    res = C.interleave(["undisturbed", "lost"], args.rounds,
                       lambda name, r: C.run_worker(script, ["--one", name], timeout=300))
    pairs = list(zip(res["undisturbed"], res["lost"]))
    rows = [[name, C.median(r["wall"] for r in res[name]), C.median(r["cpu"] for r in res[name]),
             C.median(r["restarted"] for r in res[name]), C.median(r["epochs"] for r in res[name]),
             C.median(r["best"] for r in res[name])] for name in res]
    print(C.table(["run", "wall s", "CPU s", "trials restarted", "epochs recorded", "best"], rows))
    print(f"extra of a lost node (paired medians over {args.rounds} rounds): "
          f"wall +{C.median(b['wall'] - a['wall'] for a, b in pairs):.1f} s, "
          f"CPU +{C.median(b['cpu'] - a['cpu'] for a, b in pairs):.1f} s; "
          f"the replacement node joined in {C.median(b['join_s'] for _, b in pairs):.1f} s")


if __name__ == "__main__":
    main()
