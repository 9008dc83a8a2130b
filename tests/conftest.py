"""Suite-wide settings. Tiny models train fastest on one thread, and CI machines are shared.
Fused-or-not decisions are measured in every test process (no user cache file read or written:
a decision cached by one test would change what another measures); the cache's own tests give
it a file."""

import os

import torch

torch.set_num_threads(1)
os.environ["TRIDENS_DECISION_CACHE"] = "off"
# Subprocesses import the tridens this suite tests, whatever folder they start in: a relative
# PYTHONPATH (``PYTHONPATH=src pytest``) is made absolute once, here.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                               for p in os.environ["PYTHONPATH"].split(os.pathsep))

# The longest test files (seconds, both workers of a 2-core machine busy). `make test` hands whole
# files to the pytest-xdist workers in collection order (`--dist loadfile --no-loadscope-reorder`),
# so these go first: a long file that started last would run on while the other worker idles.
_LONGEST_FILES = {
    "tests/engine/test_executor_conformance.py": 92,
    "tests/engine/test_ray_units.py": 50,
    "tests/cli/test_cli.py": 45,
    "tests/engine/test_ray.py": 44,
    "tests/engine/test_ray_cluster.py": 36,
    "tests/interfaces/test_dashboard_browser.py": 41,
    "tests/engine/test_first_day.py": 37,
    "tests/examples/test_examples.py": 34,
    "tests/hub/test_hub.py": 23,
    "tests/xopt/test_batching.py": 23,
    "tests/xopt/test_stage_store.py": 21,
    "tests/xopt/test_cse.py": 21,
    "tests/oneshot/test_resume.py": 20,
    "tests/engine/test_pool_units.py": 18,
    "tests/xopt/test_supergraph.py": 17,
    "tests/compat/test_nni_oneshot.py": 17,
    "tests/compat/test_nni2_transformer.py": 16,
    "tests/strategy/test_pbt.py": 16,
    "tests/engine/test_ray_loopback.py": 13,
    "tests/xopt/test_decision_cache.py": 11,
    "tests/security/test_stores.py": 10,
    "tests/compat/test_nni_compat.py": 10,
}


def pytest_collection_modifyitems(items):
    """Longest files first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: -_LONGEST_FILES.get(item.nodeid.split("::")[0], 0))
