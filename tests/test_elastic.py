"""Workers that come and go during a scoring job: a real ``dask scheduler`` and ``dask worker`` processes
(``--no-nanny``, one thread each), a worker that joins mid-job, one retired mid-job (``client.retire_workers``), one
retired before the job's warm-up ran on it, a job started before any worker; and an in-process
``LocalCluster.adapt`` that scales up mid-job. Each output is compared, exactly, with an undisturbed run on the same
scheduler, and holds every row once.

The workers order their partitions through files (tests/elastic_worker.py, their preload): the first worker waits,
after its first partition, until the joiner has begun one, so the join is mid-job by construction rather than by a
sleep; a worker to be retired holds its partition until it is retiring. A wait that never ends fails the job after
two minutes, and the test waits for the job with a timeout: a hang fails, it never blocks."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TEXTS

import dask_lm
from dask_lm.engine.worker_group import scheduler_info

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROWS = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(10)]  # one row group, and so one part, each
JOB_S = 180.0  # a job waited for longer than this has hung: the test fails


def _tests_path() -> str:
    """PYTHONPATH with tests/ on it: the workers' preload (elastic_worker) and this module's functions are found."""
    return os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(ready: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.1)
    return got


def _background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
    """``fn`` in a daemon thread: a hung job fails its test through ``result(timeout=)`` and holds no exit."""
    fut: Future[Any] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # re-raised by result() in the test
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return fut


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL: a worker that imported transformers spends many seconds of a loaded 2-core machine in the
    interpreter's final garbage collection after a SIGTERM, and nothing here needs a graceful end (the scheduler
    drops a killed worker as its connection closes)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _start_scheduler(logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    address = f"tcp://127.0.0.1:{_free_port()}"
    with open(logs / "scheduler.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                address.rsplit(":", 1)[1],
                "--dashboard-address",
                "127.0.0.1:0",
                "--idle-timeout",
                "600",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": _tests_path()},
        )  # run_on_scheduler(_clients)
    return proc, address


@contextlib.contextmanager
def _cluster(root: Path) -> Iterator[Workers]:
    """A ``dask scheduler`` process on a free port, a client of it, and no worker yet: :meth:`Workers.start`."""
    root.mkdir(parents=True, exist_ok=True)
    proc, address = _start_scheduler(root)
    client = None
    workers = None
    try:
        deadline = time.monotonic() + 60
        while client is None:
            assert proc.poll() is None and time.monotonic() < deadline, (root / "scheduler.log").read_text()
            try:
                client = dask_lm.connect(address)
            except OSError:
                time.sleep(0.3)
        workers = Workers(address, client, root)
        yield workers
    except BaseException:
        print(workers.logs() if workers is not None else "")
        raise
    finally:
        if workers is not None:
            workers.stop()
        if client is not None:
            client.close()
        _kill([proc])


class Workers:
    """The ``dask worker`` processes of a scheduler (``address``, with ``client``), started with :meth:`start`; each
    reads its settings for tests/elastic_worker.py from ``root/NAME.json``, which :meth:`arm` rewrites."""

    def __init__(self, address: str, client: Any, root: Path) -> None:
        self.address, self.client, self.root = address, client, root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # one thread each, on the CPU: every worker computes the same bits as the undisturbed run's
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "DASK_LM_FORCE_CPU": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": _tests_path(),
        }

    def arm(self, name: str, **settings: Any) -> None:
        tmp = self.root / f".{name}.json"
        tmp.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))
        os.replace(tmp, self.root / f"{name}.json")  # read whole by the worker, never half written

    def start(self, name: str, **settings: Any) -> subprocess.Popen[bytes]:
        self.arm(name, **settings)
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (the child holds it; closed here after)
        self.procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                self.address,
                "--name",
                name,
                "--nthreads",
                "1",
                "--no-nanny",
                "--no-dashboard",
                "--memory-limit",
                "0",
                "--death-timeout",
                "60",
                "--preload",
                "elastic_worker",
                "--local-directory",
                str(self.root / name),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, "ELASTIC_CONFIG": str(self.root / f"{name}.json")},
        )
        log.close()
        return self.procs[name]

    def addresses(self) -> dict[str, str]:
        return {w["name"]: a for a, w in scheduler_info(self.client)["workers"].items()}

    def joined(self, *names: str) -> dict[str, str]:
        return _until(lambda: set(names) <= set(self.addresses()) and self.addresses(), f"workers {names} to join")

    def logs(self) -> str:
        return "\n".join(
            f"----- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.root.glob("*.log"))
        )

    def stop(self, *names: str) -> None:
        """Kill the workers ``names`` (all without), and wait until the scheduler has dropped them."""
        names = names or tuple(self.procs)
        _kill([self.procs.pop(n) for n in names if n in self.procs])
        _until(lambda: not set(names) & set(self.addresses()), f"the scheduler to drop {names}", 60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Workers]:
    """The module's scheduler with one worker, ``a``, that outlives the tests (each arms it as it needs)."""
    with _cluster(tmp_path_factory.mktemp("elastic_cluster")) as workers:
        workers.start("a")
        workers.joined("a")
        yield workers


@pytest.fixture()
def workers(cluster) -> Iterator[Workers]:
    """The module's cluster for one test: the workers it starts are stopped after it, and ``a`` disarmed."""
    try:
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop(*(n for n in cluster.procs if n != "a"))
        cluster.arm("a")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("elastic_data") / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(len(ROWS))), "text": ROWS}), path, row_group_size=1)
    return path


def _frame() -> Any:
    import dask.dataframe as dd

    return dd.from_pandas(pd.DataFrame({"id": list(range(len(ROWS))), "text": ROWS}), npartitions=5)


def _score(data: Path, out: Path, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("precision", "float32")
    return dask_lm.score_parquet(
        data, out, model=model, text_column="text", id_column="id", progress=False, task_tokens=0, **kwargs
    )  # a part per row group: 10 parts


def _parts(out: Path) -> list[pa.Table]:
    return [pq.read_table(out / f"part-{i:05d}.parquet") for i in range(len(ROWS))]


@pytest.fixture(scope="module")
def reference(cluster, data, tiny, tmp_path_factory) -> dict[str, Any]:
    """The undisturbed runs, on worker ``a`` alone: score_parquet's parts and dask_lm.score's frame."""
    out = tmp_path_factory.mktemp("elastic_reference") / "scored"
    assert list(cluster.addresses()) == ["a"]
    res = _score(data, out, tiny["llama"], client=cluster.client)
    assert res.parts == len(ROWS) and res.rows == len(ROWS)
    frame = dask_lm.score(
        _frame(), model=tiny["llama"], client=cluster.client, text_column="text", precision="float32"
    ).compute()
    return {"parts": _parts(out), "frame": frame}


def _check_output(out: Path, reference: dict[str, Any]) -> None:
    """Every row once, in its part, with the undisturbed run's values bit for bit."""
    parts = _parts(out)
    ids = [i for t in parts for i in t.column("id").to_pylist()]
    assert ids == list(range(len(ROWS)))
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [f"part-{i:05d}.parquet" for i in range(len(ROWS))]
    for i, (got, want) in enumerate(zip(parts, reference["parts"])):
        assert got.equals(want), f"part {i} differs from the undisturbed run's"
    assert not list(out.glob(".*.tmp-*")), "a temporary part file was left behind"


def test_a_worker_that_joins_mid_job_scores_parts_and_the_output_is_the_undisturbed_one(
    workers, reference, data, tiny, tmp_path
):
    joined = tmp_path / "b.began"  # b's partitions mark it; a's wait for it after a's first
    workers.arm("a", wait_for=joined)
    out = tmp_path / "scored"
    job = _background(_score, data, out, tiny["llama"], client=workers.client)
    _until(lambda: list(out.glob("part-*.parquet")) or job.done(), "the first part")
    assert not job.done()  # a waits for b: the job is mid-way when b starts
    workers.start("b", mark=joined)
    res = job.result(timeout=JOB_S)
    addresses = workers.joined("a", "b")
    _check_output(out, reference)
    # b began a partition (its own mark) and the job counts the parts b wrote
    assert addresses["b"] in joined.read_text().split()
    assert res.parts_by_worker.get(addresses["b"], 0) >= 1, res.parts_by_worker
    assert set(res.parts_by_worker) <= {addresses["a"], addresses["b"]}
    assert sum(res.parts_by_worker.values()) == res.parts == len(ROWS)
    # b's replica was loaded after the first part came back: no part of the caller's wait for the model. The
    # phases still add up to the wall time, and the start's end no later than the first part.
    assert sum(res.wall_phases.values()) == pytest.approx(res.wall_seconds, abs=1e-6)
    start = sum(res.wall_phases[k] for k in ("checks", "cluster_start", "model_load", "compile"))
    assert start <= res.start_phases["first_row"] + 0.05, (res.wall_phases, res.start_phases)
    assert res.wall_phases["scoring"] == pytest.approx(res.scoring_seconds, abs=0.05)


def test_a_worker_retired_mid_job_hands_its_partition_back(workers, reference, data, tiny, tmp_path):
    began = tmp_path / "b.began"
    workers.arm("a", wait_for=began)
    workers.start("b", mark=began, hold=True)  # b holds its partition until it is retiring
    addresses = workers.joined("a", "b")
    out = tmp_path / "scored"
    job = _background(_score, data, out, tiny["llama"], client=workers.client)
    _until(lambda: began.exists() or job.done(), "b to begin a partition")
    assert not job.done()
    workers.client.retire_workers([addresses["b"]], close_workers=True)
    _until(lambda: "b" not in workers.addresses(), "b to leave")
    res = job.result(timeout=JOB_S)
    _check_output(out, reference)
    assert set(res.parts_by_worker) <= {addresses["a"], addresses["b"]}
    assert res.parts_by_worker.get(addresses["a"], 0) >= len(ROWS) - 1, res.parts_by_worker
    assert sum(res.parts_by_worker.values()) == res.parts == len(ROWS)


def test_a_dask_frame_scored_while_a_worker_joins_equals_the_undisturbed_one(workers, reference, tiny, tmp_path):
    from distributed import get_task_stream

    began, joined = tmp_path / "a.began", tmp_path / "b.began"
    workers.arm("a", mark=began, wait_for=joined)
    lazy = dask_lm.score(_frame(), model=tiny["llama"], client=workers.client, text_column="text", precision="float32")
    with get_task_stream(client=workers.client) as stream:
        fut = workers.client.compute(lazy)
        _until(lambda: began.exists() or fut.done(), "a to begin a partition")
        assert not fut.done()
        workers.start("b", mark=joined)
        got = fut.result(timeout=JOB_S)
    addresses = workers.joined("a", "b")
    pd.testing.assert_frame_equal(got, reference["frame"], check_exact=True)
    assert addresses["b"] in joined.read_text().split()
    ran = {t["worker"] for t in stream.data if t.get("status") == "OK"}
    assert addresses["b"] in ran, stream.data


def test_a_job_started_before_any_worker_waits_for_one_and_completes(reference, data, tiny, tmp_path):
    # a scheduler of its own, with no worker; the job connects a client of its own, as `dask-lm score
    # --scheduler-address` does, and its precision is the workers' (automatic)
    with _cluster(tmp_path / "cluster") as workers:
        out = tmp_path / "scored"
        job = _background(_score, data, out, tiny["llama"], scheduler_address=workers.address, precision=None)
        _until(lambda: workers.client.run_on_scheduler(_clients) >= 2 or job.done(), "the job's client")
        time.sleep(2.0)  # the job's checks of a tiny model end well before: it now waits for a worker
        assert not job.done()
        spawned = time.time()
        workers.start("late")
        res = job.result(timeout=JOB_S)
        _check_output(out, reference)
        assert res.start_phases["cluster"] >= spawned - res.started_at  # the cluster was up once the worker was
        assert _precision(out) == "float32"  # asked of the worker that came (a CPU one)
        assert list(res.parts_by_worker) == [workers.joined("late")["late"]]


def _clients(dask_scheduler: Any) -> int:
    return len(dask_scheduler.clients)


def _precision(out: Path) -> str:
    from dask_lm.io.manifest import read_manifest

    manifest = read_manifest(str(out))
    assert manifest is not None
    return str(manifest["options"]["precision"])


def test_the_config_check_and_preload_of_a_worker_retired_before_they_ran_run_on_another(
    workers, reference, data, tiny, tmp_path, monkeypatch
):
    """The job's config check and preload go to the workers there are at its start; one retired before they ran
    (here ``a``, busy with another task) hands them to a worker that joined, so the job's start does not wait out
    its config check's timeout (CONFIG_CHECK_WAIT_S) for a worker that is gone. Last in this module: ``a`` leaves.

    The check's timeout is raised to the test's own deadline: its clock runs from the job's start, through ``b``'s
    process start and its first imports of torch and transformers, which on a loaded 2-core CI machine took more
    than the default 60 s. A check queued on ``a`` is asked again elsewhere when its worker has left
    (``Preload._ask_again_if_gone``, dask_lm/scoring/preload.py); one left waiting for ``a`` would time out before
    the job's deadline, and fail the test."""
    from elastic_worker import hold_until_retiring

    from dask_lm.scoring import preload

    monkeypatch.setattr(preload, "CONFIG_CHECK_WAIT_S", JOB_S)
    client = workers.client
    busy = tmp_path / "a.busy"
    a = workers.addresses()["a"]
    blocker = client.submit(hold_until_retiring, str(busy), workers=[a], pure=False)
    _until(busy.exists, "a's other task to begin")
    out = tmp_path / "scored"
    job = _background(_score, data, out, tiny["llama"], client=client)
    # the job's warm-up is queued on a, behind the other task
    _until(lambda: client.run_on_scheduler(_queued_on, a) >= 2 or job.done(), "the job's warm-up on a")
    assert not job.done(), job.exception()
    workers.start("b")
    b = workers.joined("b")["b"]
    client.retire_workers([a], close_workers=True)
    _until(lambda: "a" not in workers.addresses(), "a to leave")
    # the other task was pinned hard, as the warm-up was before: with a gone it waits for a worker that is not there
    blocker.cancel()
    res = job.result(timeout=JOB_S)
    _check_output(out, reference)
    assert res.parts_by_worker == {b: len(ROWS)}
    # the worker's config check answered (the driver's own check, after the timeout, records no such phases)
    assert "config_check_began" in res.start_phases, res.start_phases


def _queued_on(address: str, dask_scheduler: Any = None) -> int:
    """The job's warm-up tasks (config check, preload) in processing on the worker at ``address``."""
    ws = dask_scheduler.workers.get(address)
    keys = [str(ts.key) for ts in (ws.processing if ws is not None else ())]
    return sum(1 for k in keys if k.startswith(("dask-lm-config", "dask-lm-preload")))


def test_an_adaptive_cluster_scales_up_mid_job_and_the_output_is_the_undisturbed_one(
    reference, data, tiny, tmp_path, monkeypatch
):
    """``LocalCluster.adapt(minimum=1, maximum=2)`` (in-process workers, which start at once): the job's queued
    parts make the scheduler ask for a second worker, which joins and scores some; the first waits, after its
    first part, until the second has begun one."""
    import torch
    from distributed import Client, LocalCluster
    from elastic_worker import Gate

    began = tmp_path / "began"
    config = tmp_path / "gate.json"
    config.write_text(json.dumps({"mark": str(began), "distinct": 2}))
    monkeypatch.setenv("ELASTIC_CONFIG", str(config))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits as the reference's one-thread worker processes
    try:
        with (
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
            Client(cluster) as client,
        ):
            client.register_plugin(Gate(), name="elastic-gate")
            cluster.adapt(minimum=1, maximum=2, interval="200ms")
            out = tmp_path / "scored"
            res = _score(data, out, tiny["llama"], client=client)
    finally:
        torch.set_num_threads(threads)
    _check_output(out, reference)
    assert len(set(began.read_text().split())) == 2
    assert len(res.parts_by_worker) == 2 and sum(res.parts_by_worker.values()) == len(ROWS), res.parts_by_worker
