"""Multi-trial exploration strategies behind one interface, :class:`Strategy`."""

from ._base import Strategy

__all__ = ["Strategy"]
