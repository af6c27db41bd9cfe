"""The documentation site's build, which the suite starts early (tests/conftest.py) and tests/test_docs.py judges."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


class SiteBuild:
    """``sphinx -W --keep-going -b html docs`` into a scratch directory, in a process of its own, its output kept in
    a file (a pipe nobody reads while the suite runs would fill and stall it)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dask-lm-site-")
        self.html = pathlib.Path(self._dir.name) / "html"
        self._out = open(pathlib.Path(self._dir.name) / "sphinx.out", "w+")  # noqa: SIM115 (close() closes it)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(self.html)],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def result(self, timeout: float) -> tuple[int, str, pathlib.Path]:
        """Waits for the build: ``(exit code, sphinx's output, the HTML directory)``."""
        code = self._proc.wait(timeout=timeout)
        self._out.seek(0)
        return code, self._out.read(), self.html

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._out.close()
        self._dir.cleanup()


SITE_BUILD = pytest.StashKey[SiteBuild]()
