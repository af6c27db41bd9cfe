"""Old import paths: each still gives the same object and warns with a ``FutureWarning`` naming the new path; a
plain ``import dask_lm`` and the CLI import none of them (so they never warn)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED_NAMES = [
    ("dask_lm.refit.wire", name, "dask_lm.model.cuda_ipc")
    for name in ("encode_cuda", "cuda_handle", "cuda_rebuild_args", "open_cuda")
] + [
    ("dask_lm.scoring.scorer", name, "dask_lm.scoring.replicas")
    for name in ("Replica", "preload_replica", "release_idle", "release_scorers", "replica_for")
]


@pytest.mark.parametrize("old,name,new", MOVED_NAMES)
def test_an_old_name_warns_naming_its_new_path(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(FutureWarning, match=rf"import it from {new}\b"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(new), name)
    with pytest.warns(FutureWarning, match=rf"import it from {new}\b"):
        exec(f"from {old} import {name}", {})


@pytest.mark.parametrize("old", sorted({old for old, _, _ in MOVED_NAMES}))
def test_other_missing_names_still_raise_attribute_error(old):
    name = "no_such_name"
    with pytest.raises(AttributeError, match=name):
        getattr(importlib.import_module(old), name)


def test_the_old_receiver_module_warns_naming_its_new_path(monkeypatch):
    from dask_lm.refit import receiver

    monkeypatch.delitem(sys.modules, "dask_lm.refit_receiver", raising=False)
    with pytest.warns(FutureWarning, match=r"import from dask_lm\.refit\.receiver\b"):
        old = importlib.import_module("dask_lm.refit_receiver")
    assert old.receive_via_zmq is receiver.receive_via_zmq and old.CollectiveReceiver is receiver.CollectiveReceiver


@pytest.mark.parametrize("args", [["-c", "import dask_lm"], ["-m", "dask_lm", "--help"]], ids=["import", "cli"])
def test_dask_lm_and_its_cli_use_no_old_path(args):
    out = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
