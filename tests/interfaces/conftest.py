"""One real small experiment (tiny MLPs trained on digits), shared by the interface tests; tests
that write to it work on a copy."""

import shutil
from pathlib import Path

import pytest

from . import tiny_search, views_search


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """A store holding experiment ``tiny``: 4 trials of 3 epochs on digits, trained for real."""
    db = tmp_path_factory.mktemp("tiny") / "tridens.db"
    tiny_search.experiment(db, 4).run()
    return db


@pytest.fixture
def tiny_copy(tiny_store, tmp_path) -> Path:
    """A copy of the tiny store (with its checkpoints) that a test may extend."""
    target = tmp_path / "tridens.db"
    shutil.copy(tiny_store, target)
    files = Path(str(tiny_store) + ".files")
    if files.exists():
        shutil.copytree(files, Path(str(target) + ".files"))
    return target


@pytest.fixture(scope="session")
def views_store(tmp_path_factory) -> Path:
    """The plan/stage-tree/ASHA/one-shot/log-scale searches of :mod:`views_search`, run for real."""
    db = tmp_path_factory.mktemp("views") / "views.db"
    views_search.build(db)
    return db
