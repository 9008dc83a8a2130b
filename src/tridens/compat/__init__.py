"""Compatibility layers for code written for other tools (``tridens.compat.nni``)."""
