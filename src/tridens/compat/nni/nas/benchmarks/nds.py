"""NNI 2.x's ``nni.nas.benchmarks.nds``: see ``tridens.compat.nni.nas.benchmark``."""

from ..benchmark.nds import query_nds_trial_stats

__all__ = ["query_nds_trial_stats"]
