"""The fused-or-not decisions kept across processes: a second run on this machine plans from the
first one's measurement, with the same results, and a damaged cache file is only a cache."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tridens.units import PlanContext
from tridens.xopt import CSESettings, Settings
from tridens.xopt._decision_cache import SEPARATE_STEP, DecisionCache, default_path

ROOT = Path(__file__).resolve().parents[2]


def run_search(tmp_path: Path, name: str, cache: Path) -> tuple[dict[str, float], str]:
    env = dict(os.environ, TRIDENS_DECISION_CACHE=str(cache), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tests.xopt.decision_script", str(tmp_path / f"{name}.db")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_second_run_plans_from_the_first_runs_measurement(tmp_path):
    cache = tmp_path / "cache" / "batching.sqlite"
    first, log1 = run_search(tmp_path, "first", cache)
    assert "fused or not as measured on their first real steps" in log1
    with sqlite3.connect(cache) as db:
        rows = db.execute("SELECT key, speedup FROM measurements").fetchall()
    ratios = [v for k, v in rows if not k.endswith(SEPARATE_STEP)]
    steps = [v for k, v in rows if k.endswith(SEPARATE_STEP)]
    assert len(ratios) == 1  # one structure (both activations), one unit size
    assert len(steps) == 1 and 0 < steps[0] < 1  # one model's separate step, CPU s
    [stored] = ratios
    assert stored > 1.1 * 1.25  # a clear decision (a marginal one would be measured again)
    second, log2 = run_search(tmp_path, "second", cache)
    assert "on an earlier run on this machine" in log2 and f"{stored:.2f}x" in log2
    assert "as measured on their first real steps" not in log2
    assert second == first  # the same decision: the same training, bit for bit


def test_the_environment_names_the_file_or_switches_it_off(tmp_path):
    assert Settings.from_env({}).batching.decision_cache == str(default_path())
    assert Settings.from_env({"TRIDENS_DECISION_CACHE": "off"}).batching.decision_cache == ""
    path = str(tmp_path / "c.sqlite")
    assert Settings.from_env({"TRIDENS_DECISION_CACHE": path}).batching.decision_cache == path
    assert Settings().batching.decision_cache == ""  # settings made in code: this process only


def test_a_damaged_or_unwritable_file_is_only_a_cache(tmp_path):
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(b"not a database" * 100)
    cache = DecisionCache(damaged)
    cache.put("k", 2.0)
    assert cache.get("k") == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = DecisionCache(blocked / "sub" / "batching.sqlite")  # its folder cannot be made
    unwritable.put("k", 2.0)
    assert unwritable.get("k") == []
    fine = DecisionCache(tmp_path / "ok.sqlite")
    fine.put("k", 2.5)
    fine.put("k", 0.8)
    assert fine.get("k") == [2.5, 0.8] and fine.get("other") == []


def test_the_file_keeps_the_latest_measurements_of_a_key(tmp_path):
    cache = DecisionCache(tmp_path / "c.sqlite")
    for value in range(1, 9):
        cache.put("k", float(value))
    cache.put("j", 3.0)
    assert cache.get("k") == [4.0, 5.0, 6.0, 7.0, 8.0] and cache.get("j") == [3.0]  # KEPT = 5
    cache.put("k", 0.0, replace=True)  # e.g. the models turned out not to vectorize
    assert cache.get("k") == [0.0] and cache.get("j") == [3.0]


def test_structure_keys_are_the_same_in_every_process():
    """The stored key must not depend on the process (Python salts str hashes per process)."""
    code = ("import torch, torch.nn as nn\n"
            "from tridens.xopt._batching import _structure_key\n"
            "print(_structure_key(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))))\n")
    keys = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=str(seed)),
                           capture_output=True, text=True, check=True).stdout for seed in (1, 2)}
    assert len(keys) == 1


def test_a_group_planned_from_the_file_knows_the_separate_step_to_compare_with(tmp_path):
    """A group planned fused from an earlier run's file starts fused with that run's separate step,
    so it measures again if its stack shrinks (tests/xopt/test_adaptive.py runs that path)."""
    import tridens as td
    from tridens.xopt._batching import plan_batching

    from .test_batching import SAMPLES, evaluator, make_jobs, mlp

    data = td.datasets.digits()
    ev = evaluator(data, "sgd", epochs=1)
    settings = Settings().with_batching(decision_cache=str(tmp_path / "c.sqlite"))
    cache = DecisionCache(tmp_path / "c.sqlite")
    [unit], _ = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=settings, context=PlanContext())
    key = unit.member.stored_key
    cache.put(key, 4.0)  # a clear speed-up, as an earlier run stored it
    cache.put(key + SEPARATE_STEP, 0.002)
    # a new run: its own plan context
    [planned], _ = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=settings, context=PlanContext())
    assert planned.member.state == "fused" and "earlier run on this machine" in planned.summary()
    assert planned.member._separate_step == 0.002
    assert isinstance(planned.member.cse, CSESettings)  # how its trials step if it goes separate
