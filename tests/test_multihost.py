"""A multi-host rehearsal on one machine (issue 17): a ``dask scheduler`` and ``dask worker`` processes that present
themselves as two hosts, each pair bound to its own loopback address (127.0.0.2 and 127.0.0.3).

``workers_per_node``, rank placement, the process-group rendezvous across the two "hosts" (rank 0's store on its own
address), the refit addresses and scoring then run as they would on two nodes. On the CPU the ranks talk gloo; the
GPU variant gives each "host" one GPU (NCCL). Every check compares with an independent reference: the scheduler's
view of the workers, the workers' own sockets, and single-process Hugging Face forwards and training steps.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from distributed import get_task_stream
from helpers import (
    TEXTS,
    hf_logprobs,
    hf_nll_steps,
    make_batch,
    model_logprobs,
    sft_batch,
)

import dask_lm
from dask_lm import BatchedDataDict
from dask_lm.engine.cluster import count_gpus
from dask_lm.engine.worker_group import WorkerGroup, scheduler_info
from dask_lm.workers import tasks

pytestmark = pytest.mark.cluster

HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3"}  # worker-name prefix -> the "host" its workers listen on
NAMES = {"a0": "127.0.0.2", "a1": "127.0.0.2", "b0": "127.0.0.3", "b1": "127.0.0.3"}
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
DASK = os.path.join(os.path.dirname(sys.executable), "dask")
CORPUS = TEXTS + ["Tokens flow through the cluster.", "Every rank runs the same steps.", "Short one."]
SCORE_TEXTS = [
    f"host {i % 2} row {i}: " + " ".join(["dask", "tokens", "score", "parquet"][: 1 + i % 4]) * (1 + i % 3)
    for i in range(16)
]


# ----------------------------------------------------------------------------------------- the two-host cluster
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _can_bind(host: str) -> bool:
    try:
        _free_port(host)
        return True
    except OSError:
        return False


def _tails(logs: Path, lines: int = 40) -> str:
    out = []
    for f in sorted(logs.glob("*.log")):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"----- {f.name} (last {len(text)} lines) -----\n" + "\n".join(text))
    return "\n".join(out)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM (workers first, then the scheduler), then SIGKILL what is still there after ``grace_s``. A worker
    closes within a second of SIGTERM ("End worker" in its log); a process that imported transformers then spends
    10-20 s of this 2-core machine in the interpreter's final garbage collection, which is not worth waiting for."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@contextlib.contextmanager
def two_hosts(root: Path, host_env: dict[str, dict[str, str]] | None = None) -> Iterator[tuple[Any, Path]]:
    """A client of a ``dask scheduler`` on 127.0.0.1 with workers a0, a1 on 127.0.0.2 and b0, b1 on 127.0.0.3
    (``dask worker --no-nanny``, one thread each); ``host_env[prefix]`` adds to one host's environment."""
    for host in HOSTS.values():
        if not _can_bind(host):
            pytest.skip(f"cannot bind {host}: the rehearsal needs the loopback range 127.0.0.0/8 (Linux's lo)")
    logs = root / "logs"
    logs.mkdir(parents=True)
    port = _free_port("127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        # tests/ importable on the workers: tasks from refit_peers and this module run there
        "PYTHONPATH": os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p),
        "DASK_LM_LEASE_CHECK_S": "2",
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen[bytes]] = []
    names: list[str] = []
    files = []

    def spawn(name: str, args: list[str], extra: dict[str, str]) -> None:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115  (closed in the finally below)
        files.append(log)
        names.append(name)
        procs.append(
            subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT, env={**env, **extra}, cwd=root)
        )

    client = None
    try:
        # --no-dashboard still serves Dask's HTTP routes (health, metrics), on every interface unless told where
        # (--idle-timeout: a scheduler orphaned by a killed pytest goes away by itself, and its workers with it)
        spawn(
            "scheduler",
            [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-dashboard",
                "--dashboard-address",
                f"127.0.0.1:{_free_port('127.0.0.1')}",
                "--idle-timeout",
                "600",
            ],
            {},
        )
        for name, host in NAMES.items():
            spawn(
                name,
                [
                    "worker",
                    address,
                    "--host",
                    host,
                    "--name",
                    name,
                    "--nthreads",
                    "1",
                    "--no-nanny",
                    "--no-dashboard",
                    "--dashboard-address",
                    f"{host}:0",
                    "--memory-limit",
                    "0",
                    "--death-timeout",
                    "60",
                    "--local-directory",
                    str(root / name),
                ],
                (host_env or {}).get(name[0], {}),
            )
        deadline = time.time() + 90
        while client is None:
            dead = [n for n, p in zip(names, procs) if p.poll() is not None]
            if dead or time.time() > deadline:
                raise RuntimeError(f"the two-host cluster did not start (exited: {dead})\n{_tails(logs)}")
            try:
                client = dask_lm.connect(address)
            except OSError:
                time.sleep(0.5)
        while len(scheduler_info(client)["workers"]) < len(NAMES):
            dead = [n for n, p in zip(names, procs) if p.poll() is not None]
            if dead or time.time() > deadline:
                raise RuntimeError(
                    f"only {len(scheduler_info(client)['workers'])} of {len(NAMES)} workers "
                    f"joined (exited: {dead})\n{_tails(logs)}"
                )
            time.sleep(0.5)
        yield client, logs
    finally:
        if client is not None:
            client.close()
        # workers first: a scheduler gone before them makes them wait out --death-timeout
        _stop(procs[1:] + procs[:1])
        for f in files:
            f.close()


def _report_failures(request: pytest.FixtureRequest, failed_before: int, logs: Path) -> None:
    """At the end of the module: the processes' log tails, when a test of it failed (for CI)."""
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        text = f"\n===== two-host cluster logs =====\n{_tails(logs)}"
        if reporter is not None:
            reporter.write_line(text)
        else:
            print(text, file=sys.stderr)


# ----------------------------------------------------------------------------------------- what the workers report
def default_store_address() -> tuple[str, int]:
    """(host, port) of this worker's torch.distributed world store, under its prefix wrappers (run on a worker)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return str(store.host), int(store.port)


def _listeners(pid: int) -> list[Any]:
    return [c.laddr for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _unix_sockets(pid: int) -> set[str]:
    """Paths of the Unix sockets ``pid`` has bound (psutil reports no listening state for them)."""
    return {c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr}


def _hosts_by_address(client: Any) -> dict[str, str]:
    return {addr: w["host"] for addr, w in scheduler_info(client)["workers"].items()}


def _by_name(client: Any) -> dict[str, str]:
    return {w["name"]: addr for addr, w in scheduler_info(client)["workers"].items()}


def _cfg(model_dir: str, **extra: Any) -> dict[str, Any]:
    return {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": 128,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        **extra,
    }


# ----------------------------------------------------------------------------------------- checks (CPU and GPU)
def check_placement(client: Any, policy: Any) -> None:
    info = scheduler_info(client)["workers"]
    assert {w["name"]: w["host"] for w in info.values()} == NAMES
    assert all(addr.startswith(f"tcp://{NAMES[w['name']]}:") for addr, w in info.items())
    assert WorkerGroup.per_node(client, 1) == ["a0", "b0"]
    assert WorkerGroup.per_node(client, 2) == ["a0", "a1", "b0", "b1"]
    # the rendezvous port is found on the asked worker's own address
    for name, host in NAMES.items():
        got_host, port = client.submit(
            tasks.find_free_port, workers=[name], allow_other_workers=False, pure=False
        ).result()
        assert got_host == host and 0 < port < 65536
    assert policy.data_parallel_size == 2
    assert policy.group.names == ["a0", "b0"] and policy.group.hosts == ["127.0.0.2", "127.0.0.3"]
    # rank r's model is in the process of worker names[r] (its pid, and what that worker's plugin holds)
    pids = {addr: pid for addr, pid in client.run(os.getpid).items()}
    addr = _by_name(client)
    assert [i["pid"] for i in policy.worker_info] == [pids[addr["a0"]], pids[addr["b0"]]]
    held = client.run(lambda dask_worker: {p: w.rank for p, w in dask_worker.plugins["dask-lm"].policies.items()})
    pid = policy.group.policy_id
    assert {n: held[addr[n]] for n in NAMES} == {"a0": {pid: 0}, "a1": {}, "b0": {pid: 1}, "b1": {}}
    # what the policy itself reports per rank: its host's address
    assert [ip for ip, _gpu in policy.print_node_ip_and_gpu_id()] == ["127.0.0.2", "127.0.0.3"]


def check_forward(policy: Any, model_dir: str, tok: Any, atol: float) -> None:
    ids, lens = make_batch(tok, CORPUS)
    got = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
    expected, _ = hf_logprobs(model_dir, ids, lens)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def train_step(policy: Any, model_dir: str, tok: Any) -> dict[str, Any]:
    """One clipped SGD step of the policy over both "hosts", and the same step in one process of plain HF."""
    batch = sft_batch(tok, CORPUS)
    losses, norms, ref_model = hf_nll_steps(
        model_dir,
        [(batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch["sample_mask"])],
        lr=0.5,
        max_grad_norm=1.0,
    )
    out = policy.train(batch, dask_lm.NLLLoss())
    after = policy.get_logprobs(batch)["logprobs"]
    return {"batch": batch, "out": out, "after": after, "losses": losses, "norms": norms, "ref_model": ref_model}


def check_train_step(step: dict[str, Any], atol: float) -> None:
    assert step["norms"][0] > 1.0, "the reference step must clip for the grad norm to be checked"
    assert float(step["out"]["loss"][0]) == pytest.approx(step["losses"][0], abs=atol)
    assert float(step["out"]["grad_norm"][0]) == pytest.approx(step["norms"][0], rel=max(atol, 1e-5))
    batch = step["batch"]
    expected = model_logprobs(step["ref_model"], batch["input_ids"], batch["input_lengths"])
    torch.testing.assert_close(step["after"], expected, atol=10 * atol, rtol=0)


def check_listeners(client: Any, policy: Any) -> None:
    """Rank 0's store is on rank 0's host address (both ranks use it there), and no worker listens anywhere but
    on loopback (nothing on 0.0.0.0 / ::)."""
    addr = _by_name(client)
    stores = client.run(default_store_address, workers=[addr["a0"], addr["b0"]])
    store_host, store_port = stores[addr["a0"]]
    assert store_host == policy.group.hosts[0] == "127.0.0.2"
    assert stores[addr["b0"]] == (store_host, store_port)  # rank 1, on the other host, reached it there
    # gloo's and NCCL's own sockets are pinned to the interface of the ranks' addresses: the loopback one
    lo = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    expected = (os.environ.get("GLOO_SOCKET_IFNAME", lo), os.environ.get("NCCL_SOCKET_IFNAME", lo))
    pinned = client.run(
        lambda: (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")),
        workers=[addr["a0"], addr["b0"]],
    )
    assert set(pinned.values()) == {expected}, pinned
    pids = client.run(os.getpid)
    found = {a: _listeners(pid) for a, pid in pids.items()}
    on_store_port = {(a, la.ip) for a, las in found.items() for la in las if la.port == store_port}
    assert on_store_port == {(addr["a0"], "127.0.0.2")}, on_store_port
    for a, las in found.items():
        host = _hosts_by_address(client)[a]
        assert any(la.ip == host and a.endswith(f":{la.port}") for la in las), (a, las)  # Dask's own listener
        bad = [
            la
            for la in las
            if ipaddress.ip_address(la.ip).is_unspecified or not ipaddress.ip_address(la.ip).is_loopback
        ]
        assert not bad, f"worker {a} listens off loopback: {bad} (all: {las})"


def _import_transformers() -> None:
    import transformers

    transformers.AutoModelForCausalLM  # noqa: B018 (the lazy module imports its model classes here)


def check_scoring(client: Any, model_dir: str, tok: Any, root: Path, atol: float) -> None:
    """score_parquet over the four workers: partitions on both hosts, sums as one HF process computes them.

    The workers load their replicas as the job starts (each a few hundred ms apart here), and a partition goes to
    whichever worker is free: transformers imported on every worker first (most of a load's time), and enough
    partitions (one per 2-row row group, 16 copies of the texts) that every worker takes some after its load."""
    client.run(_import_transformers)
    texts = SCORE_TEXTS * 16
    data = root / "score.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), data, row_group_size=2)
    with get_task_stream(client=client) as stream:
        res = dask_lm.score_parquet(
            data,
            root / "scored",
            model=model_dir,
            client=client,
            text_column="text",
            precision="float32",
            progress=False,
            task_tokens=0,
        )  # a task per row group
    assert res.parts == len(texts) // 2 and res.rows == len(texts)
    hosts = _hosts_by_address(client)
    ran = [t["worker"] for t in stream.data if str(t["key"]).startswith("score_partition")]
    assert len(ran) == res.parts, stream.data
    assert {hosts[w] for w in ran} == set(HOSTS.values()), ran
    table = pa.concat_tables([pq.read_table(f) for f in sorted((root / "scored").glob("part-*.parquet"))])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == list(range(len(texts)))
    for r in rows:
        # lm-evaluation-harness's convention: BOS (which this tokenizer does not add) then the text, scored whole
        ids = [tok.bos_token_id] + tok(texts[r["id"]])["input_ids"]
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        lp = lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert r["num_tokens"] == len(ids) and r["num_scored"] == len(ids) - 1
        assert r["sum_logprob"] == pytest.approx(float(lp.double().sum()), abs=10 * atol)
        torch.testing.assert_close(torch.tensor(r["logprobs"][1:]), lp, atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------- CPU (gloo)
@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("two_hosts")
    failed_before = request.session.testsfailed
    # the CPU path on every worker, also on a machine with GPUs: gloo between the "hosts"
    cpu = {"DASK_LM_FORCE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}
    with two_hosts(root, {"a": cpu, "b": cpu}) as (client, logs):
        yield client, logs
        _report_failures(request, failed_before, logs)


@pytest.fixture(scope="module")
def client(cluster):
    return cluster[0]


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def policy(client, tiny, tok):
    p = dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1)
    yield p
    p.shutdown()


def test_workers_present_two_hosts_and_the_policy_takes_one_rank_on_each(client, policy):
    check_placement(client, policy)
    assert [i["device"] for i in policy.worker_info] == ["cpu", "cpu"]


@pytest.fixture(scope="module")
def trained(policy, tiny, tok):
    return train_step(policy, tiny["llama"], tok)


def test_rendezvous_across_hosts_forward_matches_one_process(policy, tiny, tok):
    """FSDP over gloo between 127.0.0.2 and 127.0.0.3 (before any training step): plain HF's logprobs."""
    check_forward(policy, tiny["llama"], tok, atol=1e-4)


def test_rendezvous_across_hosts_train_step_matches_one_process(trained):
    """One clipped SGD step over both hosts: loss, pre-clip grad norm and the logprobs after it as one HF
    process computes them."""
    check_train_step(trained, atol=1e-5)


def test_store_on_rank0s_host_and_no_listener_off_loopback(client, policy):
    check_listeners(client, policy)


def test_zmq_refit_sockets_are_private_ipc_files_of_each_rank(client, policy):
    """The ZMQ refit endpoints are Unix sockets (no TCP address to get wrong), one per rank, each bound by that
    rank's own worker process."""
    addresses = policy.get_zmq_addresses()
    assert len(set(addresses)) == 2 and all(a.startswith("ipc://") for a in addresses), addresses
    pids = client.run(os.getpid)
    addr = _by_name(client)
    for rank, (name, address) in enumerate(zip(policy.group.names, addresses)):
        path = address[len("ipc://") :]
        assert f"dask-lm-refit-r{rank}-" in path
        owners = {n for n in NAMES if path in _unix_sockets(pids[addr[n]])}
        assert owners == {name}, (path, owners)


def test_refit_collective_store_on_rank0s_host_reaches_a_worker_of_the_other_host(client, policy, trained, tmp_path):
    """init_collective at rank 0's host address, with the inference rank on worker b1 (the other host): the store
    listens there only, and the broadcast delivers the weights a single HF process has after the same step."""
    import refit_peers

    info = policy.prepare_refit_info()
    host = policy.group.hosts[0]
    port = _free_port(host)
    out = tmp_path / "peer.pt"
    peer = client.submit(
        refit_peers.collective_peer,
        host,
        port,
        3,
        2,
        info,
        str(out),
        workers=["b1"],
        allow_other_workers=False,
        pure=False,
    )
    client.gather(policy.init_collective(host, port, 3, train_world_size=2))
    addr = _by_name(client)
    pids = client.run(os.getpid)
    on_port = {(n, la.ip) for n in NAMES for la in _listeners(pids[addr[n]]) if la.port == port}
    assert on_port == {("a0", host)}, on_port
    client.gather(policy.broadcast_weights_for_collective(buffer_size_bytes=64 * 1024))
    peer.result(timeout=120)
    got = torch.load(out)[0]["weights"]
    assert sorted(got) == sorted(info)
    expected = trained["ref_model"].state_dict()
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name].detach(), atol=1e-5, rtol=0, msg=name)


def test_scoring_spreads_over_both_hosts_and_matches_one_process(client, tiny, tok, tmp_path):
    check_scoring(client, tiny["llama"], tok, tmp_path, atol=1e-4)


# ----------------------------------------------------------------------------------------- GPU (NCCL)
@pytest.mark.gpu
def test_two_hosts_one_gpu_each_over_nccl(tiny, tmp_path):
    """The same rehearsal with GPU 0 on 127.0.0.2 and GPU 1 on 127.0.0.3: NCCL between the "hosts"."""
    if count_gpus() < 2:  # NVML, not torch.cuda: this process stays the driver
        pytest.skip("needs two GPUs")
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",") if d.strip()][:2]
    gpu = {prefix: {"CUDA_VISIBLE_DEVICES": d, "DASK_LM_FORCE_CPU": "0"} for prefix, d in zip(HOSTS, visible)}
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    with two_hosts(tmp_path, gpu) as (client, logs):
        try:
            with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, workers_per_node=1) as policy:
                check_placement(client, policy)
                assert [(i["device"], i["gpu_id"]) for i in policy.worker_info] == [("cuda", d) for d in visible]
                check_forward(policy, tiny["llama"], tok, atol=1e-3)
                check_train_step(train_step(policy, tiny["llama"], tok), atol=1e-4)
                check_listeners(client, policy)
            check_scoring(client, tiny["llama"], tok, tmp_path, atol=1e-3)
        except BaseException:
            print(f"===== two-host cluster logs =====\n{_tails(logs)}")
            raise
