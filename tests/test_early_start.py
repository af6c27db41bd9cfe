"""The overlapped start of a scoring job: the workers load their replicas while the driver checks and hashes, and
a preloaded replica is used only where it was loaded from the bytes the job pinned (else the model loads again).

Loads are counted in the worker processes themselves; results are compared with a single-process HF forward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

import dask_lm
from dask_lm.data.messages import ScoreOptions
from dask_lm.io import fingerprint
from dask_lm.io.fingerprint import Pin, Stamp
from dask_lm.scoring import replicas

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

IDS = [[3 + (7 * i + 5 * j) % 90 for j in range(4 + i)] for i in range(12)]


def _pin(path: str, stamp: Stamp, racy: bool = False) -> Pin:
    return Pin(path, stamp.size, "0" * 64, stamp, racy)


class _Preloaded:
    compile_requested = True

    def __init__(self, stamps):
        self.stamps = stamps


def test_a_preloaded_replica_is_adopted_only_under_the_pinned_stamps():
    a, b = Stamp(10, 1, 2), Stamp(20, 3, 4)
    rep = _Preloaded({"/m/model.safetensors": a, "/m/config.json": b})

    def opts(*pins):
        return ScoreOptions(model="/m", tokenizer="/m", precision="float32", output="/o", model_pins=pins)

    assert replicas.adopt(rep, opts(_pin("/m/model.safetensors", a), _pin("/m/config.json", b))) is rep
    assert replicas.adopt(rep, opts(_pin("/m/model.safetensors", Stamp(10, 1, 5)))) is None  # ctime moved
    assert replicas.adopt(rep, opts(_pin("/m/model.safetensors", a, racy=True))) is None  # cannot vouch
    assert replicas.adopt(rep, opts(_pin("/m/tokenizer.json", a))) is None  # a file the preload did not see settled
    assert replicas.adopt(rep, opts()) is None  # nothing pinned: nothing to vouch for the bytes
    assert replicas.adopt(None, opts(_pin("/m/model.safetensors", a))) is None


def _count_loads(racy_ns: int) -> None:
    """On a worker: count replica loads, and take stamps as settled after ``racy_ns``."""
    from dask_lm.scoring import replicas as s

    if not hasattr(s, "_real_init"):
        s._real_init = s.Replica.__init__

        def counted(self, *args, **kwargs):
            s._loads = getattr(s, "_loads", 0) + 1
            s._real_init(self, *args, **kwargs)

        s.Replica.__init__ = counted
    s._loads = 0
    s.RACY_NS = racy_ns


def _loads() -> int:
    from dask_lm.scoring import replicas as s

    return getattr(s, "_loads", 0)


def _restore() -> None:
    from dask_lm.io.fingerprint import RACY_NS
    from dask_lm.scoring import replicas as s

    if hasattr(s, "_real_init"):
        s.Replica.__init__ = s._real_init
        del s._real_init
    s.RACY_NS = RACY_NS


@pytest.fixture
def settled_model(tiny, tmp_path, monkeypatch):
    """A copy of the tiny llama whose files count as settled at once on the driver (the workers are told by each
    test), so a preload can be adopted without waiting two seconds."""
    model = str(tmp_path / "model")
    shutil.copytree(tiny["llama"], model)
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    monkeypatch.setenv("DASK_LM_HASH_CACHE", "0")
    time.sleep(0.05)  # past the filesystem clock's tick
    return model


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.table({"id": list(range(12)), "ids": IDS}), d / "a.parquet", row_group_size=3)
    return d


def _check_against_hf(model: str, out: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = {}
    for f in sorted(os.listdir(out)):
        if f.startswith("part-"):
            rows.update({r["id"]: r for r in pq.read_table(os.path.join(out, f)).to_pylist()})
    assert sorted(rows) == list(range(12))
    for i, ids in enumerate(IDS):
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        total = float(lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).double().sum())
        assert rows[i]["sum_logprob"] == pytest.approx(total, abs=1e-3)


@pytest.mark.cluster
def test_the_workers_load_once_while_the_driver_checks(client, settled_model, data, tmp_path):
    client.run(_count_loads, 0)
    try:
        res = dask_lm.score_parquet(
            data, tmp_path / "out", model=settled_model, client=client, ids_column="ids", id_column="id", progress=False
        )
        loads = client.run(_loads)
    finally:
        client.run(_restore)
    assert list(loads.values()) == [1, 1]  # the preload, adopted: no second load in the first partition
    assert res.rows == 12 and res.start_phases["checks"] <= res.start_phases["first_row"]
    assert res.started_at < res.first_row_at <= res.started_at + res.wall_seconds
    _check_against_hf(settled_model, str(tmp_path / "out"))


@pytest.mark.cluster
def test_a_replica_whose_files_were_not_settled_is_loaded_again(client, settled_model, data, tmp_path):
    client.run(_count_loads, 3600 * 10**9)  # on the workers no stamp is settled: the preload cannot vouch
    try:
        dask_lm.score_parquet(
            data, tmp_path / "out", model=settled_model, client=client, ids_column="ids", id_column="id", progress=False
        )
        loads = client.run(_loads)
    finally:
        client.run(_restore)
    # every worker preloaded; each that scored a partition then loaded from the pinned bytes (the scheduler may
    # give one worker every partition)
    assert all(n in (1, 2) for n in loads.values()) and sum(loads.values()) >= 3
    _check_against_hf(settled_model, str(tmp_path / "out"))


@pytest.mark.cluster
def test_a_refused_job_closes_the_cluster_it_started_and_writes_nothing(tiny, data, tmp_path):
    import distributed

    before = set(distributed.Client._instances) if hasattr(distributed.Client, "_instances") else set()
    with pytest.raises(ValueError, match="column 'body' is missing"):
        dask_lm.score_parquet(
            data, tmp_path / "out", model=tiny["llama"], text_column="body", n_workers=1, progress=False
        )
    assert not (tmp_path / "out").exists()
    after = {c for c in getattr(distributed.Client, "_instances", set()) if c.status != "closed"}
    assert after <= before  # no client (and so no cluster) left running


@pytest.mark.cluster
def test_a_config_transformers_cannot_load_is_refused_by_a_worker_before_anything_is_written(
    client, tiny, data, tmp_path
):
    """The config check runs on a worker (scoring/preload.py: Preload), through the workers' transformers; its
    refusal still comes before the output exists, and names the file."""
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-architecture"}))
    with pytest.raises(ValueError, match=r"config\.json is not a config transformers can load"):
        dask_lm.score_parquet(
            data, tmp_path / "out", model=str(model), client=client, ids_column="ids", id_column="id", progress=False
        )
    assert not (tmp_path / "out").exists()
    # and the check was the workers': none of this process's modules loaded the config
    code = f"""
import sys, dask_lm
from dask_lm.scoring import job
try:
    dask_lm.score_parquet({str(data)!r}, {str(tmp_path / "out2")!r}, model={str(model)!r},
                          client=dask_lm.connect({client.scheduler.address!r}), ids_column="ids", id_column="id",
                          progress=False)
except ValueError as e:
    print("refused", "config.json" in str(e), "transformers" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "refused True False", out.stderr[-3000:]


@pytest.mark.cluster
def test_the_driver_checks_the_config_itself_when_no_worker_answers_in_time(client, tiny, data, tmp_path, monkeypatch):
    """A worker busy with another task does not hold the job's checks: past CONFIG_CHECK_WAIT_S the driver loads the
    config itself, and the job runs as usual."""
    from dask_lm.scoring import preload

    monkeypatch.setattr(preload, "CONFIG_CHECK_WAIT_S", 0.5)
    busy = [client.submit(time.sleep, 4, workers=[w], pure=False) for w in client.scheduler_info()["workers"]]
    try:
        res = dask_lm.score_parquet(
            data, tmp_path / "out", model=tiny["llama"], client=client, ids_column="ids", id_column="id", progress=False
        )
    finally:
        client.cancel(busy)
    assert res.rows == 12 and "config_checked" not in res.start_phases
    _check_against_hf(tiny["llama"], str(tmp_path / "out"))


def _profiler_states() -> tuple[bool, bool, bool]:
    from distributed import get_worker

    from dask_lm.scoring.tasks import sampling_profiler_paused

    pc = get_worker().periodic_callbacks["profile"]
    before = pc.is_running()
    with sampling_profiler_paused():
        time.sleep(0.3)  # the stop is run by the event loop's thread
        during = pc.is_running()
    time.sleep(0.3)
    return before, during, pc.is_running()


@pytest.mark.cluster
def test_the_worker_profiler_pauses_for_the_imports_and_resumes(client):
    """The one-time imports run without the worker's stack sampling (scoring/tasks.py), which then resumes."""
    assert client.submit(_profiler_states, pure=False).result() == (True, False, True)
    from dask_lm.scoring.tasks import sampling_profiler_paused

    with sampling_profiler_paused():  # outside a worker: nothing to pause
        pass
