"""``nni.nas.benchmark.nasbench201``: refused, naming the alternative (see ``tridens.compat.nni.nas.benchmark``)."""

from . import refused

__all__ = ["query_nb201_trial_stats"]

query_nb201_trial_stats = refused("nasbench201", "query_nb201_trial_stats")
