"""The documentation site's build, which the suite starts early (tests/conftest.py) and tests/test_docs.py judges."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from background_run import BackgroundRun

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


class SiteBuild(BackgroundRun):
    """``sphinx -W --keep-going -b html docs`` into a scratch directory, in a process of its own."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        sphinx = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS)]
        super().__init__(lambda scratch: [*sphinx, str(scratch / "html")], cwd=ROOT, env=env, prefix="dask-lm-site-")
        self.html = self.scratch / "html"

    def result(self, timeout: float) -> tuple[int, str, pathlib.Path]:
        """Waits for the build: ``(exit code, sphinx's output, the HTML directory)``."""
        code, output = self.wait(timeout)
        return code, output, self.html


SITE_BUILD = pytest.StashKey[SiteBuild]()
