"""NNI 2.x's ``nni.nas.benchmarks.nasbench101``: see ``tridens.compat.nni.nas.benchmark``."""

from ..benchmark.nasbench101 import query_nb101_trial_stats

__all__ = ["query_nb101_trial_stats"]
