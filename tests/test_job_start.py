"""A job's start and end as a user sees them (issue 48): the output's lock is the first thing a job takes, so a second
identical job is refused before it starts anything; a bad row is reported by the driver, with the tokenizer alone,
before any cluster is up; and the runs end with nothing on stderr.

Counted and ordered, never timed: the cluster's start is replaced by one that blocks until the test lets it go,
and what the job did meanwhile is what is checked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dask_lm

TEXTS = [f"sample {i:04d}: dask scores parquet rows with a model" for i in range(12)]
FAILSAFE_S = 60  # a start held longer than this fails the test instead of hanging it


def _data(path, texts=TEXTS):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def _snapshot(folder):
    """Every entry of ``folder`` with its size, modification time and bytes: what a refused job must not touch."""
    entries = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        st = os.lstat(path)
        with open(path, "rb") as f:
            entries[name] = (st.st_size, st.st_mtime_ns, f.read())
    return entries


class _HeldStart:
    """``dask_lm.engine.cluster.connect`` replaced: each call is counted, and blocks until :attr:`release` is set
    (or :data:`FAILSAFE_S`), then fails: no worker process is ever started."""

    def __init__(self):
        self.calls, self.returned = [], []
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        self.reached.set()
        self.release.wait(FAILSAFE_S)
        self.returned.append(args)
        raise RuntimeError("the test's cluster start: no cluster")


def test_a_second_identical_job_is_refused_before_any_cluster_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    """A double-fired job: the second one into the same output, while the first is starting its cluster, is refused
    by the output's lock, before it starts a cluster, and changes nothing in the output."""
    held = _HeldStart()
    monkeypatch.setattr("dask_lm.engine.cluster.connect", held)
    data, out = _data(tmp_path / "data.parquet"), tmp_path / "out"
    first: list[BaseException] = []

    def run_first():
        try:
            dask_lm.score_parquet(data, out, model=tiny["llama"], text_column="text", progress=False)
        except BaseException as e:
            first.append(e)

    thread = threading.Thread(target=run_first, daemon=True)
    thread.start()
    try:
        assert held.reached.wait(FAILSAFE_S), "the first job never started its cluster"
        before = _snapshot(out)
        with pytest.raises(ValueError, match=rf"output {out} is in use by another dask-lm job"):
            dask_lm.score_parquet(data, out, model=tiny["llama"], text_column="text", progress=False)
        assert len(held.calls) == 1  # the first job's start only: the second started no cluster
        assert _snapshot(out) == before  # and created, wrote or removed nothing there
        assert before.keys() == {".dask-lm.lock"}  # what the first job holds while it starts
    finally:
        held.release.set()
        thread.join(FAILSAFE_S)
    assert len(first) == 1 and "the test's cluster start" in str(first[0])  # the first job went on to its start
    assert len(held.calls) == 1


def test_a_job_refused_by_a_check_after_the_lock_leaves_no_lock_and_no_folder(tiny, tmp_path, no_cluster):
    """The lock is taken first; a job that a later check refuses removes it, and the folder it created."""
    data, out = _data(tmp_path / "data.parquet"), tmp_path / "out"
    with pytest.raises(ValueError, match="column 'body' is missing"):
        dask_lm.score_parquet(data, out, model=tiny["llama"], text_column="body", progress=False)
    assert not out.exists() and not no_cluster
    out.mkdir()  # an empty folder the user made: it stays, and empty
    with pytest.raises(ValueError, match="column 'body' is missing"):
        dask_lm.score_parquet(data, out, model=tiny["llama"], text_column="body", progress=False)
    assert os.listdir(out) == []


def test_a_lock_file_removed_while_a_job_waits_on_it_is_not_locked_beside_the_new_one(tmp_path, monkeypatch):
    """A refused job removes the lock file it created while it still holds it. A job that opened that file before
    the removal and locks it after must not count that as the lock (nobody else can see the file): it takes the
    file at the path, and a third job is refused. Without that check two jobs would hold "the" lock."""
    from dask_lm.jobs import folder

    out = tmp_path / "out"
    first = folder.OutputLock(str(out))
    first.acquire()
    real = folder.OutputLock._flock
    removed = []

    def flock_after_the_removal(self, fd):
        if not removed:  # the first job lets go between this job's open and its flock, removing the file
            first.release(remove=True)
            removed.append(True)
        return real(self, fd)

    monkeypatch.setattr(folder.OutputLock, "_flock", flock_after_the_removal)
    second = folder.OutputLock(str(out))
    second.acquire()
    monkeypatch.setattr(folder.OutputLock, "_flock", real)
    assert removed and second.held
    with pytest.raises(ValueError, match="is in use by another dask-lm job"):
        folder.OutputLock(str(out)).acquire()
    second.release(remove=True)
    assert not out.exists()  # the second job made the folder again, and removed it: it wrote nothing


@pytest.mark.cluster
def test_the_checks_time_is_the_drivers_own_and_the_cluster_start_has_its_own(client, tiny, tmp_path, monkeypatch):
    """``wall_phases["checks"]`` is the driver's own checks (``prepare_seconds``), not the cluster's start that runs
    beside them: with the start held until the driver's row check and hashes have ended, the cluster is up after
    ``checks``, ``start_phases`` gives the start its own stamps, and what the job waited for after its checks (the
    cluster, the worker's config check) is ``cluster_start``."""
    import distributed

    from dask_lm.scoring import run

    checked = {"rows": threading.Event(), "hashes": threading.Event()}
    timed = run._timed

    def noting(ended, name, fn):  # the job's own stamp of a check's end, then the test's event
        inner = timed(ended, name, fn)

        def call(*args):
            try:
                return inner(*args)
            finally:
                checked[name].set()

        return call

    def connect(*args, **kwargs):  # the cluster is reached once the driver's checks are over
        assert all(e.wait(FAILSAFE_S) for e in checked.values()), "the driver's checks never ended"
        return distributed.Client(client.scheduler.address)

    monkeypatch.setattr(run, "_timed", noting)
    monkeypatch.setattr("dask_lm.engine.cluster.connect", connect)
    data, out = _data(tmp_path / "data.parquet"), tmp_path / "out"
    res = dask_lm.score_parquet(data, out, model=tiny["llama"], text_column="text", progress=False)
    start, wall = res.start_phases, res.wall_phases
    assert res.rows == len(TEXTS)
    assert wall["checks"] == pytest.approx(res.prepare_seconds, abs=1e-6) == pytest.approx(start["checks"], abs=1e-6)
    # the cluster came up after the checks had ended: none of its start is in them
    assert start["cluster_began"] <= start["cluster_up"] and start["checks"] < start["cluster_up"]
    assert start["cluster_up"] <= start["checks_passed"] <= start["cluster"]  # the worker's config check after it
    assert wall["checks"] + wall["cluster_start"] == pytest.approx(start["cluster"], abs=1e-6)
    assert sum(wall.values()) == pytest.approx(res.wall_seconds, abs=1e-6)


BAD_ROW_SCRIPT = """
import os, sys, threading
from dask_lm.engine import cluster

returned = []

def connect(*args, **kwargs):  # a start that never ends in time: no worker, no model load
    threading.Event().wait({failsafe})
    returned.append(True)
    raise RuntimeError("the test's cluster start")

cluster.connect = connect
import dask_lm
from dask_lm.errors import BadRowError

try:
    dask_lm.score_parquet({data!r}, {out!r}, model={model!r}, text_column="text", progress=False)
    print("scored")
except BadRowError as e:
    print("refused", "row 3, column 'text'" in str(e), "returned" if returned else "held", "torch" in sys.modules)
sys.stdout.flush()
os._exit(0)  # the held start is not waited for
"""


def test_a_bad_row_is_reported_before_the_cluster_is_up_without_torch_on_the_driver(tiny, tmp_path):
    """The driver checks every row with the tokenizer alone while (or before) the cluster starts: a bad row is
    refused while the start is still held (no worker, so no model load), and the driver imported no torch for it."""
    texts = list(TEXTS)
    texts[3] = None
    data, out = _data(tmp_path / "bad.parquet", texts), tmp_path / "out"
    script = BAD_ROW_SCRIPT.format(failsafe=FAILSAFE_S, data=str(data), out=str(out), model=tiny["llama"])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=FAILSAFE_S * 3, env=_env()
    )
    assert done.stdout.strip().splitlines()[-1:] == ["refused True held False"], done.stdout + done.stderr[-3000:]
    assert not out.exists()  # refused before anything was written: the lock and the folder it made are gone


def _env():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DASK_LM_PROGRESS": "0"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(dask_lm.__file__))), env.get("PYTHONPATH", "")]
    )
    return env


# A worker process's exit made as slow as unloading torch and transformers is on a busy machine (the nanny's 4 s
# limit passed), in every process this interpreter spawns: what a worker does after its close decides the end.
SLOW_EXIT = """
import atexit, multiprocessing, time

def _slow_exit():
    if multiprocessing.parent_process() is not None:
        time.sleep(6)

atexit.register(_slow_exit)
"""

SCORE_SCRIPT = """
import dask_lm

if __name__ == "__main__":  # Dask starts worker processes: a script needs this guard
    result = dask_lm.score_parquet({data!r}, "demo-scores/", model={model!r}, text_column="text")
    print(result.rows)
"""

POLICY_SCRIPT = """
import torch
import transformers

import dask_lm
from dask_lm import BatchedDataDict

if __name__ == "__main__":  # Dask starts worker processes: a script needs this guard
    client = dask_lm.connect()
    tok = transformers.AutoTokenizer.from_pretrained({model!r})
    config = {{"model_name": {model!r}, "precision": "float32", "train_global_batch_size": 4,
              "train_micro_batch_size": 2}}
    enc = tok(["dask scores rows", "a policy on dask workers"], padding=True, return_tensors="pt")
    batch = BatchedDataDict(input_ids=enc["input_ids"], input_lengths=enc["attention_mask"].sum(1))
    with dask_lm.Policy(client, config, tok) as policy:
        print(policy.get_logprobs(batch)["logprobs"].shape)
"""


def _clean_run(args, cwd, env):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip()
    # nothing at all on stderr: no nanny WARNING about a worker it had to kill, no traceback
    assert "WARNING" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-6000:]
    return done


@pytest.mark.cluster
def test_the_readme_scoring_runs_end_with_nothing_on_stderr(tiny, tmp_path):
    """The README's two ways of scoring, as a user runs them: ``dask-lm score`` and ``score_parquet`` from a script,
    each starting and closing its own local cluster, with slow-exiting worker processes."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_EXIT)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    data = _data(tmp_path / "mydata.parquet")
    (tmp_path / "example.py").write_text(SCORE_SCRIPT.format(data=str(data), model=tiny["llama"]))
    _clean_run([sys.executable, "example.py"], tmp_path, env)
    command = [sys.executable, "-m", "dask_lm", "score", str(data), "--model", tiny["llama"], "--text-column", "text"]
    _clean_run([*command, "--id-column", "id", "--output", "scores/"], tmp_path, env)
    assert (tmp_path / "scores" / "_SUCCESS").exists() and (tmp_path / "demo-scores" / "_SUCCESS").exists()


@pytest.mark.cluster
def test_a_policy_script_on_connect_ends_with_nothing_on_stderr(tiny, tmp_path):
    """The Policy guide's shape: ``connect()``, ``Policy(...)``, a call, the end of the script (the cluster closed at
    the interpreter's exit), with slow-exiting worker processes."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_EXIT)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    (tmp_path / "example.py").write_text(textwrap.dedent(POLICY_SCRIPT.format(model=tiny["llama"])))
    _clean_run([sys.executable, "example.py"], tmp_path, env)
