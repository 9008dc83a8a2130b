"""The examples in the graph package's docstrings run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["tridens.graph", "tridens.graph._graph", "tridens.graph._trace"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
