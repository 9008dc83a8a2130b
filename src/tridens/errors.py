"""Errors a user can cause. Every message names the label, value or file involved."""

from __future__ import annotations

__all__ = ["TridensError", "InvalidSpace", "InvalidSample", "GraphError", "StoreError", "StorageFault", "ExecutorFault", "UnknownMetric"]


class TridensError(Exception):
    """Base class of every error tridens raises on purpose."""


class InvalidSpace(TridensError, ValueError):
    """The space itself is malformed: empty candidates, one label with two domains, ..."""


class InvalidSample(TridensError, ValueError):
    """A sample does not fit its space: unknown or missing label, value outside the domain,
    or a model whose shapes don't fit its example inputs."""


class GraphError(TridensError, RuntimeError):
    """An edit on the graph IR left it inconsistent (reported with the node, fx style)."""


class StoreError(TridensError, RuntimeError):
    """The experiment store cannot be opened, read or written: corrupt, locked, read-only, written
    by a newer tridens, or asked for an experiment or trial it does not hold (names the file)."""


class StorageFault(StoreError):
    """The store's storage failed under a write: the disk (or a quota, or the file size limit) is
    full, the disk failed, or the store file was deleted or replaced while open. Nothing committed
    is lost; a run stops with this one line, and its running trials run again on the next run."""


class ExecutorFault(TridensError, RuntimeError):
    """The machinery that runs trials failed outside every trial: the process that starts pool
    workers (multiprocessing's forkserver) died, and so did a fresh one. Nothing committed is lost;
    a run stops with this one line, and its running trials run again on the next run."""


class UnknownMetric(TridensError, ValueError):
    """An objective, second objective or constraint names a metric the evaluator never reports (or
    a fact tridens does not measure). Raised before the run where the evaluator declares its
    metrics, else at the first report, which then stops the run: it is the run's mistake, not
    the trial's, so a user's loop catching ``Exception`` does not turn it into a failed trial."""
