"""The opt-in warm local cluster (``dask-lm cluster start | status | stop``, dask_lm/engine/warm_cluster.py): started
as its own process by the command, found by ``connect()`` and the jobs of other processes, never closed by them,
left holding no model after a job, stopped with nothing left behind; stale, planted and foreign files handled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dask_lm
from dask_lm.engine import warm_cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_KEYS = ("DASK_LM_CACHE_DIR", "DASK_LM_WARM_CLUSTER", "DASK_SCHEDULER_ADDRESS", "DASK_LM_LEASE_CHECK_S")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "dask_lm", "cluster", *args], env=env, capture_output=True, text=True, timeout=600
    )


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: a process that exited and waits for its parent to reap it (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(client) -> dict[str, int]:
    return client.run(os.getpid)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """``dask-lm cluster start --n-workers 2 --cluster cpu`` in a cache folder of this module's (the environment
    points there while the module runs); stopped at the end whatever happened, its process group killed if the
    stop did not end it."""
    cache = tmp_path_factory.mktemp("warm-cache")
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ["DASK_LM_CACHE_DIR"] = str(cache)
    os.environ["DASK_LM_LEASE_CHECK_S"] = "1"  # the workers free a gone driver's Policy within a second or two
    os.environ.pop("DASK_LM_WARM_CLUSTER", None)
    os.environ.pop("DASK_SCHEDULER_ADDRESS", None)
    folder = cache / "warm-cluster"
    server: list[int] = []
    try:
        started = _cli("start", "--n-workers", "2", "--cluster", "cpu")
        if (folder / "warm-cluster.json").exists():
            server.append(json.loads((folder / "warm-cluster.json").read_text())["pid"])
        assert started.returncode == 0, started.stdout + started.stderr
        scheduler = json.loads((folder / "scheduler.json").read_text())
        yield SimpleNamespace(folder=folder, pid=server[0], address=scheduler["address"], started=started)
    finally:
        _cli("stop")
        for pid in server:
            if _running(pid):
                os.killpg(pid, 9)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.cluster
def test_start_leaves_a_private_folder_and_refuses_a_second_start(warm):
    assert warm.address in warm.started.stdout and "dask-lm cluster stop" in warm.started.stdout
    assert oct(warm.folder.stat().st_mode & 0o777) == "0o700"
    from distributed import Client

    with Client(warm.address, timeout=30) as c:  # start returned once the workers had imported torch
        assert [h["warm"] for h in c.run(warm_cluster.holdings).values()] == [True, True]
    again = _cli("start", "--cluster", "cpu")
    assert again.returncode == 2 and "already running" in again.stderr and warm.address in again.stderr
    assert _running(warm.pid)


@pytest.mark.cluster
def test_connect_finds_it_and_never_closes_it(warm, capfd):
    before = None
    first = dask_lm.connect()
    second = dask_lm.connect()  # a second connect attaches too: no local cluster of its own
    try:
        assert first.scheduler.address == second.scheduler.address == warm.address
        assert first.cluster is None and not getattr(first, "_dask_lm_owns_cluster", False)
        assert "using the warm local cluster" in capfd.readouterr().err
        before = _pids(first)
        assert len(before) == 2
        # what it cannot honour is refused, naming the option and the way out
        with pytest.raises(
            ValueError, match=r"`n_workers`=3 .* 2 workers.*dask-lm cluster stop.*DASK_LM_WARM_CLUSTER=0"
        ):
            dask_lm.connect(n_workers=3)
        with pytest.raises(ValueError, match="`cluster`='cuda' but the warm local cluster runs cpu workers"):
            dask_lm.connect(cluster="cuda")
        with dask_lm.connect(n_workers=2, cluster="cpu") as third:  # what it is, asked for explicitly
            assert third.scheduler.address == warm.address
        os.environ["DASK_LM_WARM_CLUSTER"] = "0"
        try:
            assert warm_cluster.attach() is None  # connect() would start its own cluster here
        finally:
            del os.environ["DASK_LM_WARM_CLUSTER"]
    finally:
        first.close()
        second.close()
    from distributed import Client

    with Client(warm.address, timeout=30) as c:  # closing the attached clients left the cluster as it was
        assert _pids(c) == before


@pytest.mark.cluster
def test_a_score_job_runs_on_it_and_leaves_no_replica(warm, tiny, tmp_path):
    import torch
    import transformers
    from distributed import Client

    texts = [f"row {i}: " + "dask tokens score " * (1 + i % 4) for i in range(12)]
    pq.write_table(pa.table({"id": list(range(12)), "text": texts}), tmp_path / "in.parquet")
    with Client(warm.address, timeout=30) as c:
        before = _pids(c)
    result = dask_lm.score_parquet(
        tmp_path / "in.parquet", tmp_path / "out", model=tiny["llama"], text_column="text", progress=False
    )
    assert result.rows == 12
    # the scores are the model's (a single-process HF forward, lm-eval's convention: BOS first, every token scored)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    table = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "out").glob("part-*.parquet")))
    for r in table.to_pylist():
        ids = [tok.bos_token_id] + tok(texts[r["id"]])["input_ids"]
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        expected = float(lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).double().sum())
        assert r["sum_logprob"] == pytest.approx(expected, abs=1e-3)
    with Client(warm.address, timeout=30) as c:
        held = c.run(warm_cluster.holdings)
        assert _pids(c) == before  # the same workers: the job neither started nor closed a cluster
    # the job ran on the warm workers (its plugin state is there) and freed its replicas as it ended
    assert [(h["jobs_ran"], h["replicas"], h["policies"]) for h in held.values()] == [(True, 0, 0)] * 2, held


POLICY_SCRIPT = """
import sys, torch, transformers, dask_lm
if __name__ == "__main__":
    client = dask_lm.connect()
    tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
    policy = dask_lm.Policy(client, {"model_name": sys.argv[1], "precision": "float32",
                                     "max_total_sequence_length": 128}, tok)
    enc = tok(sys.argv[3:], padding=True, return_tensors="pt")
    data = dask_lm.BatchedDataDict(input_ids=enc["input_ids"], input_lengths=enc["attention_mask"].sum(1))
    torch.save(policy.get_logprobs(data)["logprobs"], sys.argv[2])
    print(client.scheduler.address, policy.data_parallel_size, flush=True)
    # no shutdown: a script that ends with its Policy open
"""


@pytest.mark.cluster
def test_a_policy_script_runs_on_it_and_its_policy_is_freed_when_it_exits(warm, tiny, tmp_path):
    import time

    import torch
    from distributed import Client
    from helpers import TEXTS, hf_logprobs

    script = tmp_path / "policy_script.py"
    script.write_text(POLICY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    texts = TEXTS[:3]
    run = subprocess.run(
        [sys.executable, str(script), tiny["llama"], str(tmp_path / "lp.pt"), *texts],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [warm.address, "2"]  # the warm cluster's two workers were its ranks
    assert "using the warm local cluster" in run.stderr
    import transformers

    enc = transformers.AutoTokenizer.from_pretrained(tiny["llama"])(texts, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1)
    expected, _ = hf_logprobs(tiny["llama"], enc["input_ids"], lengths)
    torch.testing.assert_close(torch.load(tmp_path / "lp.pt") * enc["attention_mask"], expected, atol=1e-4, rtol=0)
    with Client(warm.address, timeout=30) as c:
        # its driver is gone: each rank frees the Policy at its next lease check (DASK_LM_LEASE_CHECK_S=1 here)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(h["policies"] for h in c.run(warm_cluster.holdings).values()):
            time.sleep(0.5)
        held = c.run(warm_cluster.holdings)
    assert [(h["jobs_ran"], h["replicas"], h["policies"]) for h in held.values()] == [(True, 0, 0)] * 2, held


@pytest.mark.cluster
def test_status_says_where_it_is_and_what_it_holds(warm):
    out = _cli("status")
    assert out.returncode == 0, out.stderr
    assert warm.address in out.stdout and f"pid {warm.pid}" in out.stdout and "workers: 2 (cpu)" in out.stdout
    assert out.stdout.count("0 model replica(s), 0 Policy shard(s)") == 2


@pytest.mark.cluster
def test_stop_ends_its_processes_and_removes_its_files(warm):
    from distributed import Client

    with Client(warm.address, timeout=30) as c:
        workers = list(_pids(c).values())
    assert all(_running(p) for p in [warm.pid, *workers])
    out = _cli("stop")
    assert out.returncode == 0 and "stopped the warm local cluster" in out.stdout, out.stdout + out.stderr
    assert not any(_running(p) for p in [warm.pid, *workers])
    assert sorted(p.name for p in warm.folder.iterdir() if p.name.endswith(".json")) == []
    assert "no warm local cluster is running" in _cli("status").stdout
    assert warm_cluster.find() is None


# the files' checks: no cluster is started (a refusal or a stale record must not reach a cluster's start)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_LM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DASK_LM_WARM_CLUSTER", raising=False)
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    folder = tmp_path / "warm-cluster"
    folder.mkdir(mode=0o700)
    return folder


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _record(folder, pid: int) -> None:
    (folder / "warm-cluster.json").write_text(
        json.dumps({"pid": pid, "kind": "cpu", "n_workers": 2, "memory_limit": "auto", "started_at": 0.0})
    )
    (folder / "scheduler.json").write_text(json.dumps({"address": "tcp://127.0.0.1:9"}))


@pytest.mark.parametrize("who", ["a dead server", "a reused pid"])
def test_a_record_whose_server_is_gone_is_removed_and_ignored(cache, who):
    # a reused pid: a live process that is not a warm cluster server (this test's own)
    _record(cache, _dead_pid() if who == "a dead server" else os.getpid())
    assert warm_cluster.find() is None
    assert not (cache / "warm-cluster.json").exists() and not (cache / "scheduler.json").exists()
    assert warm_cluster.attach() is None


def test_a_live_server_that_does_not_answer_is_passed_over_and_kept(cache, capsys):
    # a process that looks like the server (its command line names the server's module) but answers nothing
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", warm_cluster.SERVER]) as fake:
        try:
            _record(cache, fake.pid)
            assert warm_cluster.find().pid == fake.pid
            assert warm_cluster.attach() is None  # connect() then starts a local cluster of its own
            assert "did not answer at tcp://127.0.0.1:9" in capsys.readouterr().err
            assert (cache / "warm-cluster.json").exists()  # left for `dask-lm cluster stop`, which ends it
            assert warm_cluster.stop(timeout=30).pid == fake.pid
            assert fake.wait(timeout=30) == -15 and not (cache / "warm-cluster.json").exists()
        finally:
            fake.kill()


@pytest.mark.parametrize("name", ["warm-cluster.json", "scheduler.json"])
def test_a_planted_link_is_refused_naming_it(cache, tmp_path, name):
    _record(cache, os.getpid())
    target = tmp_path / "elsewhere.json"
    os.replace(cache / name, target)
    os.symlink(target, cache / name)
    with pytest.raises(ValueError, match=re.escape(f"{cache / name} is a symbolic link")):
        dask_lm.connect()
    assert (cache / name).is_symlink()  # refused, not removed: the user sees what was planted


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused_naming_it(cache):
    _record(cache, os.getpid())
    os.chown(cache / "warm-cluster.json", 65534, 65534)
    with pytest.raises(ValueError, match=re.escape(f"{cache / 'warm-cluster.json'} is not a regular file of yours")):
        dask_lm.connect()


def test_a_folder_others_can_write_or_a_linked_folder_is_refused(cache, tmp_path):
    os.chmod(cache, 0o777)
    with pytest.raises(ValueError, match=re.escape(f"{cache} is writable by other users")):
        dask_lm.connect()
    os.chmod(cache, 0o700)
    os.rename(cache, tmp_path / "real")
    os.symlink(tmp_path / "real", cache)
    with pytest.raises(ValueError, match=re.escape(f"{cache} is not a directory")):
        dask_lm.connect()


def test_start_refuses_what_connect_would_refuse_before_any_process_starts(cache, monkeypatch):
    from click.testing import CliRunner

    from dask_lm.cli import main as cli

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine has
    out = CliRunner().invoke(cli, ["cluster", "start", "--cluster", "cuda"])
    assert out.exit_code == 2 and "--cluster cuda but no GPU is visible" in out.output, out.output
    out = CliRunner().invoke(cli, ["cluster", "start", "--n-workers", "0"])
    assert out.exit_code == 2 and "--n-workers must be >= 1" in out.output, out.output
    assert sorted(p.name for p in cache.iterdir()) == []  # no log, no record: nothing was started
