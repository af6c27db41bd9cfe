"""The type gate: ``mypy`` over the package with the settings in pyproject.toml (strict flags for the driver's
packages and the boundary types) reports no error."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)
def test_mypy_reports_no_error(tmp_path):
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("mypy is not installed: it is in the `test` extra (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                         capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
