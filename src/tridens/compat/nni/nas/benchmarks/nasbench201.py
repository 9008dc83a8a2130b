"""NNI 2.x's ``nni.nas.benchmarks.nasbench201``: see ``tridens.compat.nni.nas.benchmark``."""

from ..benchmark.nasbench201 import query_nb201_trial_stats

__all__ = ["query_nb201_trial_stats"]
