"""Suite-wide settings. Tiny models train fastest on one thread, and CI machines are shared.
Fused-or-not decisions are measured in every test process (no user cache file read or written:
a decision cached by one test would change what another measures); the cache's own tests give
it a file."""

import os

import torch

torch.set_num_threads(1)
os.environ["TRIDENS_DECISION_CACHE"] = "off"

# The longest test files (seconds, both workers of a 2-core machine busy). `make test` hands whole
# files to the pytest-xdist workers in collection order (`--dist loadfile --no-loadscope-reorder`),
# so these go first: a long file that started last would run on while the other worker idles.
_LONGEST_FILES = {
    "tests/engine/test_executor_conformance.py": 131,
    "tests/cli/test_cli.py": 58,
    "tests/engine/test_ray_units.py": 54,
    "tests/engine/test_first_day.py": 50,
    "tests/engine/test_ray.py": 42,
    "tests/interfaces/test_dashboard_browser.py": 39,
    "tests/engine/test_pool_units.py": 35,
    "tests/examples/test_examples.py": 34,
    "tests/xopt/test_stage_store.py": 32,
    "tests/oneshot/test_resume.py": 31,
    "tests/hub/test_hub.py": 29,
    "tests/engine/test_fluid.py": 27,
    "tests/xopt/test_cse.py": 27,
    "tests/compat/test_nni_oneshot.py": 26,
    "tests/xopt/test_batching.py": 25,
    "tests/strategy/test_pbt.py": 24,
    "tests/compat/test_nni2_transformer.py": 23,
    "tests/xopt/test_supergraph.py": 22,
    "tests/engine/test_process_pool.py": 20,
    "tests/strategy/test_conformance.py": 19,
    "tests/xopt/test_decision_cache.py": 19,
}


def pytest_collection_modifyitems(items):
    """Longest files first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: -_LONGEST_FILES.get(item.nodeid.split("::")[0], 0))
