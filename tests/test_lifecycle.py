"""A Policy's life on a cluster that misbehaves: listeners on loopback, drivers that die, workers that die.

The destructive tests run on a cluster of their own (the session cluster stays whole for the other tests), with a
short lease check so a dead driver's Policy is freed within seconds.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import transformers
from helpers import TEXTS, hf_logprobs, make_batch

import dask_lm
from dask_lm import BatchedDataDict, WorkerLostError

pytestmark = pytest.mark.cluster


def _cfg(model_dir):
    return {"model_name": model_dir, "precision": "float32", "max_total_sequence_length": 128}


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture
def own_client(monkeypatch):
    """A 2-worker cluster for one destructive test; workers check leases every second."""
    monkeypatch.setenv("DASK_LM_LEASE_CHECK_S", "1")  # inherited by the worker processes
    c = dask_lm.connect(n_workers=2, cluster="cpu")
    try:
        yield c
    finally:
        cluster = c.cluster
        c.close()
        cluster.close()


def _policies_on_workers(client) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: sorted(dask_worker.plugins["dask-lm"].policies))


def _listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_every_listener_of_a_local_cluster_and_policy_is_on_loopback(client, tiny, tok):
    """Read the live sockets of the driver (scheduler, dashboard, nannies) and of every worker (Dask's listener,
    rank 0's torch.distributed store, gloo's pairs) while a 2-rank Policy is loaded."""
    ids, lens = make_batch(tok, TEXTS[:2])
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        assert policy.data_parallel_size == 2
        policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
        worker_pids = list(client.run(os.getpid).values())
        sockets = {pid: _listening(pid) for pid in [os.getpid(), *worker_pids]}
    assert all(sockets[pid] for pid in worker_pids), sockets  # the workers do listen (Dask, store, gloo)
    exposed = {
        pid: [(ip, port) for ip, port in found if not ipaddress.ip_address(ip).is_loopback]
        for pid, found in sockets.items()
    }
    assert not any(exposed.values()), f"listeners off loopback: {exposed}"


DRIVER = textwrap.dedent("""
    import sys, time, torch, transformers, dask_lm
    from distributed import Client
    client = Client(sys.argv[1])
    tok = transformers.AutoTokenizer.from_pretrained(sys.argv[2])
    policy = dask_lm.Policy(client, {"model_name": sys.argv[2], "precision": "float32",
                                     "max_total_sequence_length": 128}, tok)
    ids = torch.randint(3, 50, (2, 16))
    policy.get_logprobs(dask_lm.BatchedDataDict(input_ids=ids, input_lengths=torch.full((2,), 16)))
    print("READY", policy.data_parallel_size, flush=True)
    time.sleep(600)
""")


def test_a_dead_drivers_policy_does_not_brick_the_cluster(own_client, tiny, tok, tmp_path):
    """SIGKILL a driver that holds a 2-rank Policy, restart one worker, create a new Policy: it comes up as on a
    fresh cluster (today's failure mode was a ~730 s rendezvous timeout on every try), and the dead driver's
    model is freed on the surviving worker."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), own_client.scheduler.address, tiny["llama"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY 2"), line
        assert all(len(p) == 1 for p in _policies_on_workers(own_client).values())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    start = time.monotonic()
    names = sorted(w["name"] for w in own_client.scheduler_info()["workers"].values())
    own_client.restart_workers([names[1]])
    ids, lens = make_batch(tok, TEXTS)
    expected, _ = hf_logprobs(tiny["llama"], ids, lens)
    with dask_lm.Policy(own_client, _cfg(tiny["llama"]), tok) as policy:
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        seconds = time.monotonic() - start
        # only the new Policy is left anywhere: the orphan was freed on the worker that survived
        assert all(p == [policy.group.policy_id] for p in _policies_on_workers(own_client).values())
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    assert seconds < 60, f"a new Policy after a dead driver and a worker restart took {seconds:.0f} s"


def test_a_policy_whose_client_went_away_is_freed_by_its_workers(own_client, tiny, tok):
    """A driver that drops its connection without shutting down (a closed client, a lost kernel): the lease goes
    with it, and every rank frees the Policy within a few lease checks."""
    from distributed import Client

    other = Client(own_client.scheduler.address)
    policy = dask_lm.Policy(other, _cfg(tiny["llama"]), tok)
    policy_id = policy.group.policy_id
    policy._finalizer.detach()  # as if the process had died: no shutdown from this side
    assert all(p == [policy_id] for p in _policies_on_workers(own_client).values())
    other.close()
    deadline = time.monotonic() + 30
    while any(_policies_on_workers(own_client).values()):
        assert time.monotonic() < deadline, _policies_on_workers(own_client)
        time.sleep(0.5)


def test_a_lost_rank_is_explained_the_same_way_on_every_call(own_client, tiny, tok):
    """SIGKILL rank 1's worker (its nanny restarts it empty): every later call raises WorkerLostError naming the
    worker, its rank and the call, and shutdown returns at once."""
    ids, lens = make_batch(tok, TEXTS[:2])
    batch = BatchedDataDict(input_ids=ids, input_lengths=lens)
    policy = dask_lm.Policy(own_client, _cfg(tiny["llama"]), tok)
    victim = policy.group.names[1]
    pid = own_client.run(os.getpid, workers=[_address(own_client, victim)])
    os.kill(next(iter(pid.values())), signal.SIGKILL)
    message = f"worker {victim!r} (rank 1 of 2) died or restarted during get_logprobs"
    with pytest.raises(WorkerLostError, match=message.replace("(", r"\(").replace(")", r"\)")):
        policy.get_logprobs(batch)
    for call in (lambda: policy.get_logprobs(batch), lambda: policy.get_topk_logits(batch, k=2)):
        with pytest.raises(WorkerLostError) as info:
            call()
        assert message in str(info.value)
    start = time.monotonic()
    assert policy.shutdown() is False  # a rank was lost: not a clean shutdown, but a prompt one
    assert time.monotonic() - start < 10


def test_shutdown_with_a_worker_gone_for_good_returns_in_seconds(own_client, tiny, tok):
    """A worker retired from the cluster (no restart): the next call names it, shutdown() warns and returns."""
    policy = dask_lm.Policy(own_client, _cfg(tiny["llama"]), tok)
    victim = policy.group.names[1]
    own_client.retire_workers([_address(own_client, victim)], close_workers=True)
    ids, lens = make_batch(tok, TEXTS[:2])
    with pytest.raises(WorkerLostError, match=f"worker {victim!r}"):
        policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
    start = time.monotonic()
    assert policy.shutdown() is False
    assert time.monotonic() - start < 10
    assert all(p == [] for p in _policies_on_workers(own_client).values())


def _address(client, name) -> str:
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name)


def test_closing_a_connect_client_closes_the_local_cluster_it_started():
    """`client.close()` on a client of `dask_lm.connect()` stops the worker processes connect started (as for a bare
    `Client()`), so a script's exit does not kill them; a client attached to that cluster's scheduler leaves the
    cluster up when it closes."""
    client = dask_lm.connect(n_workers=1, cluster="cpu")
    cluster = client.cluster
    other = dask_lm.connect(cluster.scheduler_address)
    other.close()
    assert cluster.status.name == "running" and len(client.scheduler_info()["workers"]) == 1
    client.close()
    assert cluster.status.name == "closed"
