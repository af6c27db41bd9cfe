"""Ctrl-C and SIGTERM (dask_lm/jobs/interrupts.py): ``dask-lm score`` as a real process in its own session, the
signal sent to its whole process group as a terminal (or a batch scheduler) does; then ``--resume`` finishes the
job exactly once. And a job interrupted before it kept anything leaves no trace, so the same call runs again.

The signals are sent with the machine busy (two CPU-bound processes beside the job, :func:`_busy`): the races between
a signal and what the job is doing show there, not on an idle machine."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dask_lm
from dask_lm.jobs import interrupts
from dask_lm.jobs.start import ClusterStart

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

ROWS = 900


@pytest.fixture(scope="module")
def long_job(tmp_path_factory):
    """A job of many small parts (about 60), long enough on 2 CPU workers to be interrupted mid-way."""
    rng = random.Random(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "dask",
        "schedules",
        "tasks",
        "on",
        "workers",
    ]
    path = tmp_path_factory.mktemp("interrupts") / "data.parquet"
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 160))) for _ in range(ROWS)]
    pq.write_table(pa.table({"id": list(range(ROWS)), "text": texts}), path, row_group_size=100)
    return str(path)


def _score(data, model, out, *extra, task_tokens=3000):
    return [
        sys.executable,
        "-m",
        "dask_lm",
        "score",
        data,
        "--model",
        model,
        "--text-column",
        "text",
        "--id-column",
        "id",
        "--output",
        str(out),
        "--task-tokens",
        str(task_tokens),
        "--no-progress",
        *extra,
    ]


@contextlib.contextmanager
def _busy():
    """Two CPU-bound processes beside the block (this suite's machine has 2 cores), stopped after it."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


def _interrupt_after_first_part(cmd, out, sig, **popen):
    with _busy():
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
        )
        deadline = time.time() + 400
        while not glob.glob(os.path.join(out, "part-*.parquet")):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no part was written"
            time.sleep(0.05)
        sent = time.perf_counter()
        os.killpg(proc.pid, sig)  # the whole group: the driver and the local cluster's worker processes
        stdout, stderr = proc.communicate(timeout=240)
    print(f"{signal.Signals(sig).name}: exited {proc.returncode} after {time.perf_counter() - sent:.2f} s")
    return proc.returncode, stdout, stderr


def _ids(out):
    return [
        i
        for f in sorted(glob.glob(os.path.join(out, "part-*.parquet")))
        for i in pq.read_table(f).column("id").to_pylist()
    ]


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_job_says_what_is_kept_and_resume_finishes_exactly_once(tiny, long_job, tmp_path, sig):
    out = tmp_path / "out"
    code, _stdout, stderr = _interrupt_after_first_part(_score(long_job, tiny["llama"], out), str(out), sig)
    assert code == 128 + sig, (code, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    kept = len(glob.glob(str(out / "part-*.parquet")))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert lines[0] == (
        f"interrupted: {kept} of {manifest['partitions']} parts kept in {out}; run the same "
        "command with --resume to score the rest"
    )
    time.sleep(1.0)  # the workers are gone: nothing more is written after the command has exited
    assert len(glob.glob(str(out / "part-*.parquet"))) == kept
    assert not (out / "_SUCCESS").exists()
    # after SIGTERM the resume is given nothing but the output: the inputs, model and options are the manifest's
    resume = (
        _score(long_job, tiny["llama"], out, "--resume")
        if sig == signal.SIGINT
        else [sys.executable, "-m", "dask_lm", "score", "--output", str(out), "--resume", "--no-progress"]
    )
    done = subprocess.run(resume, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = _ids(out)
    assert sorted(ids) == list(range(ROWS))  # every row once: the kept parts were not scored again
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["rows"] == ROWS and success["parts_skipped"] == kept


@pytest.mark.cluster
def test_a_sigint_is_taken_even_where_the_command_was_started_with_it_ignored(tiny, long_job, tmp_path):
    """A non-interactive shell starts a background command (``cmd &``) with SIGINT ignored, and every child of that
    command inherits it (a test suite run so, and the job it starts): Python then never raises KeyboardInterrupt, and
    the job ran to its end, exit 0. The command takes SIGINT for its duration whatever it inherited."""
    out = tmp_path / "out"
    ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - in the child, before its exec
    code, _, stderr = _interrupt_after_first_part(
        _score(long_job, tiny["llama"], out), str(out), signal.SIGINT, preexec_fn=ignored
    )
    assert code == 130, (code, stderr)
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("interrupted: "), stderr
    assert not (out / "_SUCCESS").exists()


@pytest.mark.cluster
def test_a_ctrl_c_while_the_workers_start_prints_one_line_and_no_worker_traceback(tiny, tmp_path):
    """Ctrl-C as the local cluster's worker processes are spawned: they are still importing, long before their
    preload ignores SIGINT (dask_lm/workers/preload.py), and each printed its own KeyboardInterrupt traceback. They
    now start with SIGINT blocked (dask_lm/engine/cluster.py: spawning_without_sigint)."""
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "text": ["a b c", "dask scores rows", "the quick fox"]}), data)
    out = tmp_path / "out"
    with _busy():
        proc = subprocess.Popen(
            _score(str(data), tiny["llama"], out),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        driver, deadline = psutil.Process(proc.pid), time.time() + 300
        # a worker process well into its imports (a fifth of a CPU second: Python has set up its own SIGINT handler,
        # and the worker's preload is seconds away): a signal before that kills it silently, as SIG_DFL does
        while not [c for c in driver.children() if "spawn_main" in " ".join(_cmdline(c)) and _cpu(c) >= 0.2]:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no worker process was spawned"
            time.sleep(0.01)
        sent = time.perf_counter()
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the driver and every worker process
        # until every process that holds the pipe has exited: a worker's traceback would come in too
        _, stderr = proc.communicate(timeout=240)
    print(f"exited {proc.returncode} after {time.perf_counter() - sent:.2f} s")
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines() == [
        f"interrupted: nothing was written to {out}; run the same command again to start over"
    ], stderr
    assert not out.exists()


def _cmdline(p):
    try:
        return p.cmdline()
    except psutil.Error:  # exited meanwhile
        return []


def _cpu(p):
    try:
        times = p.cpu_times()
        return times.user + times.system
    except psutil.Error:  # exited meanwhile
        return 0.0


@pytest.mark.cluster
def test_a_lost_scheduler_is_one_line_that_names_resume(tiny, long_job, tmp_path, attached_cluster):
    """The scheduler of an attached cluster is killed mid-job: one line (no traceback of Dask's client before it)
    says what is kept and that --resume continues, and the command exits 1 (a runtime failure)."""
    from distributed import Client

    sched = attached_cluster(2)
    with Client(scheduler_file=str(sched)) as c:
        scheduler_pid = c.run_on_scheduler(os.getpid)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _score(long_job, tiny["llama"], out, "--scheduler-address", str(sched)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not glob.glob(str(out / "part-*.parquet")):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no part was written"
        time.sleep(0.05)
    os.kill(scheduler_pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, (proc.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    parts = json.loads((out / "_manifest.json").read_text())["partitions"]
    said = re.fullmatch(
        rf"Error: SchedulerLostError: lost the Dask scheduler at tcp://127\.0\.0\.1:\d+ \(stopped, or "
        rf"the network to it failed\): (\d+) of {parts} parts kept in {re.escape(str(out))}; once a "
        rf"scheduler is up, run the same command with --resume to score the rest",
        lines[0],
    )
    assert said, lines[0]
    # the workers outlive their scheduler: a part they were writing may still land after the line was said
    assert 1 <= int(said.group(1)) <= len(glob.glob(str(out / "part-*.parquet"))) < parts


@pytest.mark.cluster
def test_on_an_attached_cluster_no_part_appears_after_the_command_has_gone(tiny, long_job, tmp_path, attached_cluster):
    """The cluster outlives the command: its in-flight task must not write a part once the job is cancelled
    (scoring/scorer.py: _refuse_if_cancelled). Text rows, so that the driver's own config check runs beside the
    row pre-scan's tokenizer load, as it does when the cluster has no worker yet (modelcheck.transformers_module)."""
    sched = attached_cluster(2)
    out = tmp_path / "out"
    # parts of several seconds each: the other worker's is still running when the command exits
    cmd = _score(long_job, tiny["llama"], out, "--scheduler-address", str(sched), task_tokens=30000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not glob.glob(str(out / "part-*.parquet")):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no part was written"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # the command alone: the cluster is not its to stop
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.strip().startswith("interrupted: "), stderr
    kept = sorted(glob.glob(str(out / "part-*.parquet")))
    time.sleep(8)  # long enough for an in-flight part of the job to have finished on the surviving workers
    assert sorted(glob.glob(str(out / "part-*.parquet"))) == kept


@pytest.mark.cluster
def test_an_interrupted_start_leaves_nothing_and_the_same_call_runs_again(client, tiny, tmp_path, monkeypatch):
    """Ctrl-C while the cluster starts (here: as the job asks for its client, under the output's lock, with
    the manifest written): the output folder is gone again, and the same call then succeeds."""
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "text": ["a b c", "dask scores rows", "the quick fox"]}), data)
    out = tmp_path / "out"

    def interrupted(self):
        assert (out / "_manifest.json").exists() and (out / "_errors").is_dir()  # the job had begun writing
        raise KeyboardInterrupt

    monkeypatch.setattr(ClusterStart, "result", interrupted)
    with pytest.raises(interrupts.JobInterrupted, match="nothing was written") as e:
        dask_lm.score_parquet(data, out, model=tiny["llama"], client=client, text_column="text", progress=False)
    assert e.value.signum == signal.SIGINT and interrupts.exit_code(e.value) == 130
    assert not out.exists()
    monkeypatch.undo()
    res = dask_lm.score_parquet(data, out, model=tiny["llama"], client=client, text_column="text", progress=False)
    assert res.rows == 3 and (out / "_SUCCESS").exists()


def test_sigterm_becomes_an_interrupt_in_the_main_thread():
    with pytest.raises(interrupts.Terminated) as e, interrupts.terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at the next bytecode
    assert interrupts.exit_code(e.value) == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_sigint_is_taken_for_the_block_where_it_was_ignored_and_left_ignored_after():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts.signals_as_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, before)
