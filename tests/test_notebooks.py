"""The notebooks in notebooks/ run top to bottom on a CPU machine; their last cells assert what they show."""

from __future__ import annotations

import pathlib

import pytest

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ is empty"


@pytest.mark.cluster
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DASK_LM_CACHE_DIR", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path):
    """A reader on GitHub sees the results without running anything: a plot and a table saved from a real run, no
    error, and no forced non-interactive matplotlib backend (which would hide the plots in Jupyter)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in code for o in c.get("outputs", [])]
    kinds = {k for o in outputs for k in (o.get("data") or {})}
    assert {"image/png", "text/html"} <= kinds, kinds
    assert all(c.get("execution_count") for c in code), "a code cell was not run"
    assert not [o for o in outputs if o.output_type == "error"]
    assert not any("matplotlib.use(" in c.source for c in code)
