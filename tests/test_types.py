"""The type gate: ``mypy`` over the package with the settings in pyproject.toml (strict flags for the driver's
packages and the boundary types) reports no error. The suite starts mypy when it collects this test
(tests/conftest.py), so it runs beside the tests before it; run alone, the test starts it itself."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from type_gate import MYPY_RUN, start_mypy


@pytest.mark.timeout(1200)
def test_mypy_reports_no_error(request):
    if (
        shutil.which("mypy") is None
        and subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0
    ):
        pytest.fail("mypy is not installed: it is in the `test` extra (pip install -e '.[test]')")
    run = request.config.stash.get(MYPY_RUN, None)
    if run is None:  # collected without the conftest hook's knowledge (e.g. -p no:... or a plugin reordering)
        run = request.config.stash[MYPY_RUN] = start_mypy()
    code, out = run.verdict(timeout=1100)
    assert code == 0, out[-10000:]
    assert "Success: no issues found" in out
