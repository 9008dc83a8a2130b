"""``nni.nas.benchmark.nds``: refused, naming the alternative (see ``tridens.compat.nni.nas.benchmark``)."""

from . import refused

__all__ = ["query_nds_trial_stats"]

query_nds_trial_stats = refused("nds", "query_nds_trial_stats")
