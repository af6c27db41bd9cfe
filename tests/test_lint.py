"""The lint and format gate: ``ruff check`` (the rules in pyproject's ``[tool.ruff.lint]``) and ``ruff format
--check`` (one line length, 120, for both) pass on the whole tree.

ruff comes with the ``test`` extra, so a missing ruff fails here rather than skipping the gate. To fix what this
reports: ``ruff check --fix`` for the fixable findings, ``ruff format`` for the layout (CONTRIBUTING.md)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATHS = ["."]  # the whole tree: the package, tests, benchmarks, tools, notebooks, the docs' Python


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"ruff {' '.join(command)}:\n{out.stdout}{out.stderr}"
