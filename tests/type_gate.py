"""The type gate's mypy process, which the suite starts early (tests/conftest.py) and tests/test_types.py judges."""

from __future__ import annotations

import pathlib
import sys

import pytest
from background_run import BackgroundRun

ROOT = pathlib.Path(__file__).resolve().parents[1]


class MypyRun(BackgroundRun):
    """``mypy`` over the package with pyproject.toml's settings, in a process of its own, its output kept in a file
    (a pipe nobody reads while the suite runs would fill and stall it).

    Its cache is mypy's own default, ``.mypy_cache`` of the tree (git-ignored; the one ``mypy`` by hand uses): a
    first run checks torch's, transformers' and distributed's types too (about two minutes of one core), a later one
    only the modules changed since and those importing them (seconds when nothing changed). mypy keys every cache
    entry by the file's content and by mypy's version and options, and replaces entries atomically, so the verdict
    is that of a fresh run."""

    def __init__(self) -> None:
        super().__init__(lambda _scratch: [sys.executable, "-m", "mypy"], cwd=ROOT, prefix="dask-lm-mypy-")

    def verdict(self, timeout: float) -> tuple[int, str]:
        """Waits for mypy; its exit status and what it printed."""
        return self.wait(timeout)


MYPY_RUN = pytest.StashKey[MypyRun]()


def start_mypy() -> MypyRun:
    return MypyRun()
