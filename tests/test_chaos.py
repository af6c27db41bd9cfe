"""Chaos, small and bounded: a scoring job on a separately started cluster loses a worker (SIGKILL, restarted by its
nanny) and then its driver (SIGKILL); the workers free the dead job's model replicas, and ``--resume`` finishes the
job. Every id appears exactly once and every value is bit-identical to an undisturbed run of the same job on the
same cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TEXTS

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster(tmp_path):
    """``dask scheduler`` and two ``dask worker --nanny`` processes on 127.0.0.1, as users run them."""
    from distributed import Client

    sched_file = tmp_path / "scheduler.json"
    env = {
        **os.environ,
        "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
        "DASK_LM_LEASE_CHECK_S": "1",
        "DASK_LM_REPLICA_IDLE_S": "2",
    }
    procs = [
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
                "127.0.0.1:0",
                "--scheduler-file",
                str(sched_file),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    client = None
    try:
        deadline = time.time() + 60
        while not sched_file.exists():
            assert time.time() < deadline, "the scheduler did not start"
            time.sleep(0.2)
        for name in ("w0", "w1"):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "distributed.cli.dask_worker",
                        "--scheduler-file",
                        str(sched_file),
                        "--host",
                        "127.0.0.1",
                        "--nthreads",
                        "1",
                        "--name",
                        name,
                        "--nanny",
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        client = Client(scheduler_file=str(sched_file))
        client.wait_for_workers(2, timeout=120)
        yield client, str(sched_file)
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _score(data, out, model, sched, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dask_lm",
            "score",
            str(data),
            "--model",
            model,
            "--text-column",
            "text",
            "--id-column",
            "id",
            "--output",
            str(out),
            "--scheduler-address",
            sched,
            "--batch-tokens",
            "64",
            "--task-tokens",
            "0",
            "--no-progress",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _parts(out) -> int:
    return len([f for f in os.listdir(out) if f.startswith("part-") and f.endswith(".parquet")]) if out.exists() else 0


def _rows(out) -> dict[int, tuple]:
    table = pq.read_table([str(out / f) for f in sorted(os.listdir(out)) if f.startswith("part-")])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice"
    values = zip(table.column("logprobs").to_pylist(), table.column("sum_logprob").to_pylist())
    return dict(zip(ids, values))


def test_worker_and_driver_killed_mid_job_then_resumed(cluster, tiny, tmp_path):
    client, sched = cluster
    n, parts = 300, 30
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(
        pa.table({"id": list(range(n)), "text": [TEXTS[i % len(TEXTS)] * (1 + i % 4) for i in range(n)]}),
        data / "a.parquet",
        row_group_size=n // parts,
    )

    reference = tmp_path / "reference"
    proc = _score(data, reference, tiny["llama"], sched)
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-3000:]

    out = tmp_path / "out"
    proc = _score(data, out, tiny["llama"], sched)
    killed_worker = killed_driver = False
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            done = _parts(out)
            if not killed_worker and done >= 2:
                pid = client.run(os.getpid, workers=[_address(client, "w1")])
                os.kill(next(iter(pid.values())), signal.SIGKILL)  # its nanny starts it again
                killed_worker = True
            elif killed_worker and not killed_driver and done >= 8:
                proc.send_signal(signal.SIGKILL)
                killed_driver = True
            time.sleep(0.05)
    finally:
        if proc.poll() is None and not killed_driver:
            proc.kill()
        proc.wait()
    assert killed_worker and killed_driver, (killed_worker, killed_driver, proc.stdout.read()[-3000:])
    assert not (out / "_SUCCESS").exists() and _parts(out) < parts
    # the dead driver's model replicas do not hold the workers' memory for good
    deadline = time.time() + 60
    # a lambda travels by value (the workers cannot import this test module); the replicas are in the plugin state
    replicas = lambda dask_worker: len(getattr(dask_worker.plugins.get("dask-lm"), "scorers", ()))  # noqa: E731
    while any(client.run(replicas).values()):
        assert time.time() < deadline, client.run(replicas)
        time.sleep(0.5)

    resumed = _score(data, out, tiny["llama"], sched, "--resume")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()[-3000:]
    assert json.loads((out / "_SUCCESS").read_text())["rows"] > 0
    got, want = _rows(out), _rows(reference)
    assert sorted(got) == list(range(n))
    assert got == want  # bit-identical logprobs and sums, row for row
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def _address(client, name) -> str:
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name)
