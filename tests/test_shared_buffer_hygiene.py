"""``/dev/shm`` buffers of ``get_full_logits_ipc`` (CPU ranks): a worker killed while holding one no longer leaks
its file for good (the next buffer made, or ``release_ipc_buffer``, reclaims it), a file that is not a dead maker's
of this user is never removed, and the consumer maps only its own user's files that no one else may write."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dask_lm.model import shared_buffer
from dask_lm.model.shared_buffer import SHM_DIR, SharedBuffer, open_payload
from dask_lm.teacher_logits import open_full_logits
from dask_lm.workers.full_logits import FullLogitsExport

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="POSIX shared memory (/dev/shm) is Linux's")

CPU = torch.device("cpu")


def _killed_maker() -> str:
    """The path of the buffer of a process that made one and was killed (SIGKILL: no finalizer, no atexit)."""
    code = textwrap.dedent("""
        import os, signal, sys, torch
        from dask_lm.model.shared_buffer import SharedBuffer
        buf = SharedBuffer((4, 8), torch.float32, torch.device("cpu"))
        buf.tensor.fill_(1.0)
        print(buf.payload["name"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == -9, proc.stderr
    path = os.path.join(SHM_DIR, proc.stdout.strip())
    assert os.path.exists(path), "the killed process's buffer is expected to be left behind"
    return path


def test_a_killed_makers_buffer_is_reclaimed_by_the_next_buffer_and_by_release():
    leaked = _killed_maker()
    buf = SharedBuffer((2, 2), torch.float32, CPU)
    try:
        assert not os.path.exists(leaked)
        assert os.path.exists(os.path.join(SHM_DIR, buf.payload["name"]))  # a live buffer is never reclaimed
    finally:
        buf.close()
    leaked = _killed_maker()
    assert FullLogitsExport(None).release()  # type: ignore[arg-type]  # release_ipc_buffer's worker side
    assert not os.path.exists(leaked)


def _planted(pid: int, tmp_name: str = "0123456789abcdef") -> str:
    path = os.path.join(SHM_DIR, f"dask_lm_{pid}_{tmp_name}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"x" * 64)
    os.close(fd)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=120)
    try:  # reaped: gone unless the kernel handed the pid out again meanwhile
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return proc.pid
    pytest.skip("the pid of a process that just exited was reused at once")


def test_reclaim_spares_other_users_locked_and_live_makers_files(monkeypatch):
    dead = _dead_pid()
    paths = []
    try:
        if os.geteuid() == 0:  # another user's file (a real one: root can give it away): never removed
            theirs = _planted(dead, "a" * 16)
            paths.append(theirs)
            os.chown(theirs, 12345, -1)
        locked = _planted(dead, "b" * 16)  # a maker in another pid namespace: its pid looks dead, its lock holds
        paths.append(locked)
        holder = os.open(locked, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)
        sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            alive = _planted(sleeper.pid, "c" * 16)  # a live process started before the file: possibly its maker
            paths.append(alive)
            removed = shared_buffer.reclaim_stale()
            assert not set(paths) & set(removed) and all(os.path.exists(p) for p in paths)
            # the same live pid, but its process started after the file last changed: a reused pid
            changed, real = os.stat(alive).st_ctime, shared_buffer._process_start
            monkeypatch.setattr(
                shared_buffer, "_process_start", lambda pid: changed + 60 if pid == sleeper.pid else real(pid)
            )
            removed = shared_buffer.reclaim_stale()
            assert alive in removed and not os.path.exists(alive)
            assert all(os.path.exists(p) for p in paths if p != alive)
        finally:
            sleeper.stdin.close()
            sleeper.wait(timeout=120)
            os.close(holder)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    # a file of the dead pid that no process holds: reclaimed
    locked = _planted(dead, "d" * 16)
    assert locked in shared_buffer.reclaim_stale() and not os.path.exists(locked)


def test_process_start_reads_when_this_process_started():
    import time

    started = shared_buffer._process_start(os.getpid())
    if started is None:
        pytest.skip("no /proc")
    assert started <= time.time() + 2 and not shared_buffer._maker_alive(os.getpid(), started - 60)
    assert shared_buffer._maker_alive(os.getpid(), time.time())


def _entry(buf: SharedBuffer) -> dict:
    _n, _b, s, v = buf.shape
    return {
        "payload_ipc": buf.payload,
        "buf_idx": 0,
        "sample_index_in_buf": 0,
        "actual_shape": [s, v],
        "storage_shape": list(buf.shape),
    }


def test_the_reader_maps_only_its_own_users_files_that_no_one_else_may_write(monkeypatch):
    buf = SharedBuffer((1, 1, 3, 5), torch.float32, CPU)
    path = os.path.join(SHM_DIR, buf.payload["name"])
    try:
        buf.tensor.copy_(torch.arange(15, dtype=torch.float32).view(1, 1, 3, 5))
        assert torch.equal(open_full_logits(_entry(buf)), torch.arange(15, dtype=torch.float32).view(3, 5))
        for mode in (0o666, 0o620):
            os.chmod(path, mode)
            with pytest.raises(ValueError, match=rf"{path} is writable by other users \(mode {mode:o}"):
                open_full_logits(_entry(buf))
        os.chmod(path, 0o600)
        if os.geteuid() == 0:  # a real file of another user
            os.chown(path, 12345, -1)
            owner = 12345
        else:  # not root: the file stays ours, and this process takes another uid
            owner = os.geteuid()
            monkeypatch.setattr(shared_buffer.os, "geteuid", lambda: owner + 1)
        with pytest.raises(ValueError, match=rf"{path} belongs to uid {owner}, not to this user"):
            open_payload(buf.payload)
    finally:
        buf.close()
    assert not os.path.exists(path)
