"""A web dashboard over a tridens store: ``tridens dashboard --db tridens.db``.

A Starlette JSON API (paginated, aggregated on the server) read with SQLite's ``mode=ro``, and
pages drawn with Plotly.js from the installed ``plotly`` package: experiments with their progress
and best value over time, the trial table, learning curves, hyperparameter views and importance
(:mod:`optuna.importance`), the Pareto front, the cross-model plan as the store records it, and
a trial's architecture. The pages poll the API, so trials a running experiment writes appear
without a reload. It never writes to the store.

>>> from tridens.dashboard import serve
>>> serve("tridens.db", port=8765)     # doctest: +SKIP
"""

from ._app import Server, create_app, serve
from ._reader import StoreReader, log_scale_labels

__all__ = ["create_app", "serve", "Server", "StoreReader", "log_scale_labels"]
