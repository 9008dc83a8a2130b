"""``nni.nas.benchmark.nasbench101``: refused, naming the alternative (see ``tridens.compat.nni.nas.benchmark``)."""

from . import refused

__all__ = ["query_nb101_trial_stats"]

query_nb101_trial_stats = refused("nasbench101", "query_nb101_trial_stats")
