"""An opt-in pytest plugin that checks the ``cluster`` marker: a test without it fails when it starts Dask worker
processes (a ``LocalCluster`` with processes, that is a ``Nanny``, or a ``dask worker`` / ``dask scheduler``
command), so that ``-m "not cluster"`` stays the fast tier. In-process clusters (``processes=False``) are allowed.

    PYTHONPATH=$PWD:tests pytest -p cluster_guard -m "not cluster" tests/test_x.py

A refusal raised where the test never sees it (the job's cluster start runs in a thread of its own, whose error
is dropped when the job stops first for another reason) still fails the test: each refusal is also recorded.

What it cannot see: a cluster a child process starts by itself (a test that runs ``python -m dask_lm score``
through ``subprocess``); those tests are marked by reading them.
"""

from __future__ import annotations

import subprocess

import pytest

_CLUSTER_COMMANDS = ("distributed.cli", "dask-worker", "dask_worker", "dask-scheduler", "dask_scheduler")


@pytest.fixture(autouse=True)
def _no_worker_processes_without_the_cluster_marker(request, monkeypatch):
    if request.node.get_closest_marker("cluster") is not None:
        yield
        return
    from distributed import nanny

    refused: list[str] = []

    def refuse(what: str) -> AssertionError:
        refused.append(f"{request.node.nodeid} starts {what}: mark it `cluster`")
        return AssertionError(refused[-1])

    def refuse_nanny(*args, **kwargs):
        raise refuse("a Dask worker process")

    real_popen = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if any(c in text for c in _CLUSTER_COMMANDS):
            raise refuse("a Dask cluster command")
        real_popen(self, args, *a, **kw)

    monkeypatch.setattr(nanny.Nanny, "__init__", refuse_nanny)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    yield
    if refused:
        pytest.fail(refused[0], pytrace=False)
