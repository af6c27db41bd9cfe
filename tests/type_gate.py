"""The type gate's mypy process, which the suite starts early (tests/conftest.py) and tests/test_types.py judges."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


class MypyRun:
    """``mypy`` over the package with pyproject.toml's settings, in a process of its own, its output kept in a file
    (a pipe nobody reads while the suite runs would fill and stall it).

    Its cache is mypy's own default, ``.mypy_cache`` of the tree (git-ignored; the one ``mypy`` by hand uses): a
    first run checks torch's, transformers' and distributed's types too (about two minutes of one core), a later one
    only the modules changed since and those importing them (seconds when nothing changed). mypy keys every cache
    entry by the file's content and by mypy's version and options, and replaces entries atomically, so the verdict
    is that of a fresh run."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dask-lm-mypy-")
        self._out = open(pathlib.Path(self._dir.name) / "mypy.out", "w+")  # noqa: SIM115 (close() closes it)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mypy"],
            cwd=ROOT,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def verdict(self, timeout: float) -> tuple[int, str]:
        """Waits for mypy; its exit status and what it printed."""
        code = self._proc.wait(timeout=timeout)
        self._out.seek(0)
        return code, self._out.read()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._out.close()
        self._dir.cleanup()


MYPY_RUN = pytest.StashKey[MypyRun]()


def start_mypy() -> MypyRun:
    return MypyRun()
