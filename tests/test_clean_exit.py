"""The fast end of a closed worker process keeps its exit status (:mod:`dask_lm.workers.clean_exit`): a process that
registered :func:`~dask_lm.workers.clean_exit.exit_once_closed` exits with the status its interpreter would have
given, and skips the interpreter's slow end where it knows that status.

Plain subprocesses, no cluster: the status is what the process returns; whether the fast end ran is seen from an
``atexit`` handler registered before it, which only the interpreter's usual end runs (it prints ``slow end``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import atexit, sys
atexit.register(lambda: print("slow end", flush=True))  # runs only if the interpreter ends as usual
from dask_lm.workers.clean_exit import exit_once_closed
exit_once_closed()
exit_once_closed()  # asked twice, registered once
print("closed", flush=True)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("status", [0, 3])
def test_sys_exit_keeps_its_status_and_ends_fast(status):
    out = _run(f"sys.exit({status})")
    assert out.returncode == status, out.stderr
    assert out.stdout.splitlines() == ["closed"]  # the fast end: the earlier atexit handler never ran
    assert out.stderr == ""


def test_an_uncaught_exception_exits_with_1_after_its_traceback():
    out = _run("raise RuntimeError('the worker failed')")
    assert out.returncode == 1
    assert out.stdout.splitlines() == ["closed"]
    assert "RuntimeError: the worker failed" in out.stderr  # the traceback came before the end


def test_the_way_a_worker_process_ends_keeps_its_status():
    """A nanny's worker process ends as ``multiprocessing``'s spawned children do: its target's exception becomes
    status 1, given to ``sys.exit`` by ``spawn_main``; modelled here by the same steps in the main thread."""
    out = _run(
        """
        import multiprocessing.process as mp
        class Failing(mp.BaseProcess):
            def run(self):
                raise ValueError("in the worker")
        sys.exit(Failing()._bootstrap())
        """
    )
    assert out.returncode == 1 and out.stdout.splitlines() == ["closed"], out.stderr


@pytest.mark.parametrize(
    "body, status",
    [
        ("raise SystemExit(3)", 3),  # not through sys.exit: the interpreter's own end, which knows the status
        ("pass", 0),  # the script's end
        ("sys.exit('a message')", 1),  # printed by the interpreter as it exits
        ("import threading; t = threading.Thread(target=sys.exit, args=(5,)); t.start(); t.join()", 0),
    ],
)
def test_an_exit_of_unknown_status_is_left_to_the_interpreter(body, status):
    out = _run(body)
    assert out.returncode == status, out.stderr
    assert out.stdout.splitlines() == ["closed", "slow end"]


def test_a_task_cancelled_by_the_close_is_not_warned_about_and_other_warnings_are():
    """distributed's WARNING for a task whose execution the worker's close cancelled (a preload the finished job no
    longer needs) is dropped in a worker prepared for its close; its other warnings are kept."""
    out = _run(
        """
        import logging
        logging.basicConfig(format="%(name)s - %(levelname)s - %(message)s")
        log = logging.getLogger("distributed.worker.state_machine")
        log.warning("Async instruction for <Task cancelled name='execute(dask-lm-preload-1)'> "
                    "ended with CancelledError")
        log.warning("another warning")
        sys.exit(0)
        """
    )
    assert out.returncode == 0
    assert out.stderr.splitlines() == ["distributed.worker.state_machine - WARNING - another warning"]
