"""Shared fixtures: tiny models saved to disk the way users have them, and one CPU cluster per session."""

from __future__ import annotations

import os
import tempfile

import pytest
from site_build import SITE_BUILD, SiteBuild
from type_gate import MYPY_RUN

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dask-lm's own cache (the digests of hashed files, the demo's model) goes to a directory of this run, never the
# user's ~/.cache; the tests that check where it goes by default set their own XDG_CACHE_HOME and drop this
os.environ.setdefault("DASK_LM_CACHE_DIR", tempfile.mkdtemp(prefix="dask-lm-test-cache-"))


def pytest_collection_finish(session):
    """The type gate (tests/test_types.py) is one mypy process: about two minutes of one core in a tree whose
    ``.mypy_cache`` is cold, seconds once it is warm (tests/type_gate.py). Started here, as soon as the suite knows it
    will run the gate, it overlaps the tests before it (most of which wait on worker processes, subprocesses or the
    network) instead of adding its whole length to the suite's; the test collects its verdict. A run without that
    test starts nothing."""
    if any(item.nodeid.split("::")[0].endswith("test_types.py") for item in session.items):
        from type_gate import start_mypy

        session.config.stash[MYPY_RUN] = start_mypy()
    # the documentation site's build (tests/test_docs.py), about 15 s of one core, likewise
    if any("site" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[SITE_BUILD] = SiteBuild()


def pytest_unconfigure(config):
    for key in (MYPY_RUN, SITE_BUILD):
        run = config.stash.get(key, None)
        if run is not None:
            run.stop()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of a tokenizer trained on the fly and tiny random models saved with save_pretrained."""
    from dask_lm.tiny import build_tiny_model, train_tiny_tokenizer

    root = tmp_path_factory.mktemp("models")
    tok = train_tiny_tokenizer(str(root / "tokenizer"))
    paths = {
        "tokenizer": tok,
        "llama": build_tiny_model(str(root / "llama"), family="llama", tokenizer_path=tok, seed=1),
        "qwen2": build_tiny_model(str(root / "qwen2"), family="qwen2", tokenizer_path=tok, seed=2),
        "llama_rm": build_tiny_model(
            str(root / "llama_rm"), family="llama", sequence_classification=True, tokenizer_path=tok, seed=3
        ),
        "llama_tuned": build_tiny_model(str(root / "llama_tuned"), family="llama", tokenizer_path=tok, seed=4),
    }
    return paths


@pytest.fixture(scope="session")
def client():
    """A real LocalCluster: 2 worker processes, 1 thread each (gloo collectives between them)."""
    import dask_lm

    c = dask_lm.connect(n_workers=2, cluster="cpu")
    yield c
    c.close()
    c.cluster.close()


@pytest.fixture()
def attached_cluster(tmp_path):
    """A cluster started apart from the job, as a user's is (``dask scheduler`` and ``dask worker`` processes):
    ``attached_cluster(nworkers)`` starts it and returns its scheduler file; it is stopped after the test."""
    import subprocess
    import sys
    import time

    procs = []
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}

    def start(nworkers=1):
        sched = tmp_path / "scheduler.json"
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--dashboard-address",
                    ":0",
                    "--scheduler-file",
                    str(sched),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        deadline = time.time() + 60
        while not sched.exists():
            assert time.time() < deadline, "the scheduler did not start"
            time.sleep(0.2)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    "--scheduler-file",
                    str(sched),
                    "--nthreads",
                    "1",
                    "--nworkers",
                    str(nworkers),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        return sched

    yield start
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


@pytest.fixture()
def no_cluster(monkeypatch):
    """Fails the test if a job tries to start or attach to a cluster."""
    calls = []

    def connect(*args, **kwargs):
        calls.append(args)
        raise AssertionError("connect() was called: the job got past its checks")

    monkeypatch.setattr("dask_lm.engine.cluster.connect", connect)
    return calls
