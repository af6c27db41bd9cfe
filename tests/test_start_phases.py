"""A Policy's start: the workers of ``connect()`` warm up in the background, and ``Policy.start_phases`` says where
the start went in every process. Counted and compared, never timed."""

from __future__ import annotations

import sys

import pytest
import transformers

import dask_lm
from dask_lm.workers import warm


@pytest.mark.cluster
def test_the_workers_of_connect_import_torch_and_transformers_in_the_background(client):
    """Each worker process of a ``connect()`` cluster imported what a rank needs in its own thread, from its
    preload: by the end of the warm-up every module of the list is in ``sys.modules``, and the report names each
    step, in order, with no error."""

    def warm_state():  # a local function: sent by value, so the worker imports nothing of this test module
        from dask_lm.workers import warm

        warm.wait(timeout=600)
        return {"report": warm.report(), "modules": sorted(m for m in warm.MODULES if m in sys.modules)}

    got = client.run(warm_state)
    assert len(got) == 2
    for state in got.values():
        report = state["report"]
        assert "error" not in report, report
        assert report["began_at"] <= report["ended_at"]
        assert list(report["steps"])[: len(warm.MODULES)] == [f"import {m}" for m in warm.MODULES]
        assert state["modules"] == sorted(warm.MODULES)


def test_no_warm_up_when_turned_off(monkeypatch):
    """``DASK_LM_WARM_WORKERS=0``: nothing starts, and a task's wait returns at once (no thread to wait for)."""
    monkeypatch.setenv("DASK_LM_WARM_WORKERS", "0")
    monkeypatch.setattr(warm, "_STARTED", False)
    assert warm.start() is False
    warm.wait()  # returns: nothing was started
    assert warm._DONE.is_set() is False


@pytest.mark.cluster
def test_start_phases_name_the_drivers_and_each_ranks_steps(client, tiny):
    """``Policy.start_phases``: the driver's three steps, and for each of the two ranks its warm-up, its load task and
    the build's steps (FSDP's shard step, as two ranks shard; the reference copy, kept by default), ordered as they
    ran on one clock."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    cfg = {
        "model_name": tiny["llama"],
        "precision": "float32",
        "max_total_sequence_length": 64,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    }
    policy = dask_lm.Policy(client, cfg, tok)
    try:
        phases = policy.start_phases
    finally:
        policy.shutdown()
    assert list(phases["driver"]) == ["config", "workers", "load"]
    assert all(v >= 0 for v in phases["driver"].values())
    assert len(phases["ranks"]) == 2
    for rank in phases["ranks"]:
        assert rank["warm_up_began"] <= rank["warm_up_ended"]
        assert rank["load_began"] <= rank["ready"]
        # the load task did not import beside the warm-up: it waited until the warm-up had ended (stamps rounded)
        assert rank["waited_for_warm_up"] >= rank["warm_up_ended"] - rank["load_began"] - 0.01
        assert list(rank["build"]) == ["weights", "shard", "reference"]
        assert rank["warm_up_steps"]["import torch"] > 0


@pytest.mark.cluster
def test_a_model_the_ranks_cannot_run_is_refused_before_any_weight_is_read(client, tmp_path, tiny):
    """The ranks check the model's class against the config as their load task begins: a T5 directory (no
    causal-LM class) with no weight file at all is refused with the check's ValueError naming the model, not with
    a missing-weights error from a load that started."""
    path = tmp_path / "t5"
    transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8).save_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    cfg = {"model_name": str(path), "precision": "float32", "max_total_sequence_length": 64}
    with pytest.raises(ValueError, match=r"policy.model_name.*t5.*no causal-LM class for model type 't5'"):
        dask_lm.Policy(client, cfg, tok, init_optimizer=False, init_reference_model=False)


def test_a_task_can_wait_for_one_module_of_the_warm_up(monkeypatch):
    """``wait(until=m)`` returns once ``m`` has been imported by the warm-up thread (a config check needs torch and
    transformers, not the modelling code after them); ``wait()`` once all of it has ended."""
    import threading

    gate = threading.Event()
    imported = []

    def import_module(name):
        imported.append(name)
        if name == "email":  # the second module holds the warm-up until the test lets it go on
            assert gate.wait(60)
        return __import__(name)

    monkeypatch.setenv("DASK_LM_WARM_WORKERS", "1")
    monkeypatch.setattr(warm, "MODULES", ("json", "email"))
    monkeypatch.setattr(warm, "COMPILER_MODULES", ())
    monkeypatch.setattr(warm.importlib, "import_module", import_module)
    monkeypatch.setattr(warm, "_STARTED", False)
    monkeypatch.setattr(warm, "_DONE", threading.Event())
    monkeypatch.setattr(warm, "_REPORT", {})
    assert warm.start()
    warm.wait(timeout=60, until="json")
    assert "import json" in warm.report()["steps"] and not warm._DONE.is_set()  # "email" is still held
    gate.set()
    warm.wait(timeout=60)
    assert warm._DONE.is_set() and imported == ["json", "email"]
    assert list(warm.report()["steps"])[:2] == ["import json", "import email"]


def test_a_policy_load_waits_for_the_device_not_for_the_compiler_imports(monkeypatch):
    """``wait(until="device")`` (what a rank's load waits for) returns once the modules and the CUDA context are
    ready, while the compiler's imports, which only the background compile needs, still run."""
    import threading

    from dask_lm.model import device

    gate = threading.Event()

    def import_module(name):
        if name == "email":  # the compiler's import holds the warm-up until the test lets it go on
            assert gate.wait(60)
        return __import__(name)

    monkeypatch.setenv("DASK_LM_WARM_WORKERS", "1")
    monkeypatch.setattr(warm, "MODULES", ("json",))
    monkeypatch.setattr(warm, "COMPILER_MODULES", ("email",))
    monkeypatch.setattr(device, "compile_capable", lambda: True)
    monkeypatch.setattr(warm.importlib, "import_module", import_module)
    monkeypatch.setattr(warm, "_STARTED", False)
    monkeypatch.setattr(warm, "_DONE", threading.Event())
    monkeypatch.setattr(warm, "_REPORT", {})
    assert warm.start()
    try:
        warm.wait(timeout=60, until="device")
        assert "device" in warm.report()["steps"] and not warm._DONE.is_set()  # "email" is still held
    finally:
        gate.set()
    warm.wait(timeout=60)
    assert "import email" in warm.report()["steps"]
