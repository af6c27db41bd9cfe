"""A tensor another process on the same machine can map without a copy, described by a payload of plain data.

``Policy.get_full_logits_ipc`` leaves each rank's logits in one of these and hands the consumer (a distillation
student, an analysis process) a payload per buffer; :func:`open_payload` maps it there. Two kinds, one per device
(:func:`dask_lm.model.device.ipc_kind`):

- ``"cuda"``: CUDA IPC. The payload is the handle torch's ``reduce_tensor`` exports, as plain fields
  (:func:`dask_lm.model.cuda_ipc.encode_cuda`: the same checked codec the ZMQ refit uses);
- ``"shm"``: CPU ranks. A POSIX shared-memory file under ``/dev/shm`` named ``dask_lm_<pid>_<random>``, so CI runs
  the same path as a GPU machine.

A shared-memory file outlives a process killed while holding it (a worker's OOM kill, ``kill -9``): gigabytes of
RAM for a real teacher, until the machine reboots. So the maker holds a shared ``flock`` on the file for the
buffer's life (the kernel drops it when the process dies, however it dies), and the next buffer made on the
machine, or ``release_ipc_buffer`` on any of its workers, reclaims the files of dead makers
(:func:`reclaim_stale`): only this user's, only under dask-lm's name, only when the pid in the name is gone (or
was reused by a process that started after the file's last change) and no process holds the file's lock (a
maker in another pid namespace, sharing ``/dev/shm`` but not its pids, keeps its file). A file is named only once
it is locked: it is made under a hidden name first.

A payload is a dict of ints, strings, bools, bytes and lists (msgpack-able): nothing in it is unpickled and no
class or function is looked up by a name from it. The consumer may have received it from anywhere, so
:func:`open_payload` checks every field (kind, keys, types, the shared-memory name, sizes against the file) before
mapping anything, and maps only a regular file of its own user that no other user may write (``/dev/shm`` is
world-writable: anyone can make a file under a name dask-lm would use): a hostile payload can only fail validation.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dask_lm.model import cuda_ipc, device

__all__ = ["SharedBuffer", "open_payload", "reclaim_stale", "PAYLOAD_VERSION"]

logger = logging.getLogger("dask_lm.worker")

PAYLOAD_VERSION = 1
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"dask_lm_([0-9]{1,10})_[0-9a-f]{16}")  # a plain file name: no directory, no traversal
_SHM_KEYS = {"v", "kind", "name", "shape", "dtype", "nbytes"}
_CUDA_KEYS = {"v", "kind", "cuda"}
_DTYPES = device.dtypes_by_name(torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 8


def _dtype_name(dtype: torch.dtype) -> str:
    name = device.dtype_name(dtype)
    assert name in _DTYPES, f"shared buffers hold {sorted(_DTYPES)}, not {name}"
    return name


class SharedBuffer:
    """A zero-filled tensor of ``shape`` on this rank's device, shareable with a process on the same machine.

    ``payload`` describes it (the same object for the buffer's life, so a consumer can tell two calls' entries of
    one buffer apart from a new one); :meth:`close` frees it (the shared-memory file is removed; a CUDA buffer is
    freed once every consumer let go of its mapping). A buffer not closed is removed when it is garbage-collected
    or the process exits."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, where: torch.device) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self._path: str | None = None
        self._map: mmap.mmap | None = None
        if device.ipc_kind() == "cuda":
            self.tensor = torch.zeros(self.shape, dtype=dtype, device=where)
            self.payload: dict[str, Any] = {
                "v": PAYLOAD_VERSION,
                "kind": "cuda",
                "cuda": cuda_ipc.encode_cuda(self.tensor),
            }
            return
        reclaim_stale()
        name = f"dask_lm_{os.getpid()}_{secrets.token_hex(8)}"
        self._path = os.path.join(SHM_DIR, name)
        fd = _create_locked(self._path)
        try:
            os.ftruncate(fd, max(self.nbytes, 1))  # a new file reads as zeros
            self._map = mmap.mmap(fd, max(self.nbytes, 1))
        except BaseException:
            os.unlink(self._path)
            os.close(fd)
            raise
        # the file outlives this process unless removed: on garbage collection and at exit, whichever comes first;
        # the descriptor (and its lock, which tells reclaim_stale the file is in use) lives as long as the file
        self._finalizer = weakref.finalize(self, _remove, self._path, fd)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=math.prod(self.shape)).view(self.shape)
        self.payload = {
            "v": PAYLOAD_VERSION,
            "kind": "shm",
            "name": name,
            "shape": list(self.shape),
            "dtype": _dtype_name(dtype),
            "nbytes": self.nbytes,
        }

    def fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether a request of ``shape`` fits inside this buffer (every dimension at most as large)."""
        return (
            dtype == self.dtype
            and len(shape) == len(self.shape)
            and all(int(a) <= b for a, b in zip(shape, self.shape))
        )

    def close(self) -> None:
        del self.tensor  # the mapping cannot close while a tensor still exports it
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._path is not None:
            self._finalizer()
            self._path = None


def _create_locked(path: str) -> int:
    """A new file at ``path``, only this user's (0600), already holding a shared ``flock`` when it appears under
    ``path``: made under a hidden name, locked, then renamed, so :func:`reclaim_stale` never sees it unlocked."""
    import fcntl

    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(hidden, path)
    except BaseException:
        os.unlink(hidden)
        os.close(fd)
        raise
    return fd


def _remove(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # after the unlink: a file still named is never left unlocked by a live maker


# ----------------------------------------------------------------------------------------- dead makers' files
def reclaim_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the shared-memory files of makers that died without removing them (a killed worker's); returns
    their paths.

    A file goes only when all of these hold: its name is dask-lm's (``dask_lm_<pid>_<hex>``), it is a regular
    file of this user (another user's file is never touched), its pid is not this process, the process of that pid
    is gone or started after the file last changed (so a reused pid does not keep a dead maker's file alive), and
    no process holds its ``flock`` (every live maker does, whatever its pid namespace)."""
    try:
        names = os.listdir(directory)
    except OSError:  # no /dev/shm (not Linux): nothing was ever made there
        return []
    removed = []
    for name in names:
        m = _SHM_NAME.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(directory, name)
        if _reclaim(path, int(m.group(1))):
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory buffer(s) left by dead processes: %s", len(removed), ", ".join(removed))
    return removed


def _reclaim(path: str, pid: int) -> bool:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, a link, or not ours to open
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or _maker_alive(pid, st.st_ctime):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live process holds it: its maker, under a pid we cannot see
            return False
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):  # replaced since it was opened
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _maker_alive(pid: int, changed: float) -> bool:
    """Whether the process ``pid`` may be the one that made a file last changed at ``changed`` (epoch seconds):
    it exists and did not start after that (a process that started later reuses the maker's pid). Where its start
    cannot be read it counts as alive: a file is kept, never removed, on doubt."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    started = _process_start(pid)
    # the start time is known to about a second (the boot time has whole seconds)
    return started is None or started <= changed + 2.0


def _process_start(pid: int) -> float | None:
    """When ``pid`` started, in epoch seconds (Linux's ``/proc``); ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start, in ticks since boot
    except (OSError, IndexError, ValueError, StopIteration):
        return None


# ----------------------------------------------------------------------------------------- the consumer's side
def _is_int(x: Any) -> bool:
    return type(x) is int  # a bool is no size


def _check_keys(payload: dict[str, Any], keys: set[str]) -> None:
    if set(payload) != keys:
        raise ValueError(
            f"a shared-buffer payload of kind {payload.get('kind')!r} has keys {sorted(map(str, payload))}"
            f", expected {sorted(keys)}"
        )


def _check_owner(path: str, st: os.stat_result) -> None:
    """A buffer a Policy of this user made: a regular file of this user that no other user may write. Anyone can
    make a file in ``/dev/shm``, under any name not taken: another user's file there would feed this process
    logits of their choosing, or change under it."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"the shared buffer {path} is not a regular file; it was not made by a dask-lm Policy: refusing to map it"
        )
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"the shared buffer {path} belongs to uid {st.st_uid}, not to this user (uid "
            f"{os.geteuid()}); a Policy's buffers are its user's own: refusing to map it (run the "
            "consumer as the Policy's user, or call get_full_logits_ipc again if the file was replaced)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"the shared buffer {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}; "
            "a Policy makes its buffers 600): refusing to map it; remove the file and call "
            "get_full_logits_ipc again"
        )


def open_payload(payload: Any) -> torch.Tensor:
    """The tensor a :class:`SharedBuffer`'s ``payload`` describes, mapped into this process without a copy (on the
    GPU that made it, for ``"cuda"``; in host memory, for ``"shm"``). Every field is checked first; nothing in
    the payload is unpickled or imported."""
    if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
        raise ValueError(
            f'not a dask-lm shared-buffer payload (a dict with "v": {PAYLOAD_VERSION}): got {type(payload).__name__}'
        )
    kind = payload.get("kind")
    if kind == "cuda":
        _check_keys(payload, _CUDA_KEYS)
        if not isinstance(payload["cuda"], dict):
            raise ValueError("`cuda` of a shared-buffer payload must be a dict of the handle's fields")
        return cuda_ipc.open_cuda(payload["cuda"])
    if kind != "shm":
        raise ValueError(f"a shared-buffer payload's kind must be 'cuda' or 'shm', got {kind!r}")
    _check_keys(payload, _SHM_KEYS)
    name, shape, dtype_name, nbytes = payload["name"], payload["shape"], payload["dtype"], payload["nbytes"]
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
        raise ValueError(f"the shared-memory name {str(name)[:80]!r} is not one dask-lm makes (dask_lm_<pid>_<hex>)")
    if not isinstance(shape, list) or not 0 < len(shape) <= _MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError("`shape` of a shared-buffer payload must be a list of 1 to 8 non-negative ints")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"`dtype` of a shared-buffer payload must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"`nbytes` {nbytes!r} of a shared-buffer payload is not shape x itemsize")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ValueError(
            f"the shared buffer {name} is gone: the Policy released it (release_ipc_buffer) or its "
            "worker exited; call get_full_logits_ipc again"
        ) from None
    try:
        st = os.fstat(fd)
        _check_owner(path, st)
        size = st.st_size
        if size < max(nbytes, 1):
            raise ValueError(f"the shared buffer {name} holds {size} bytes, the payload says {nbytes}")
        view = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    # shared, as a CUDA IPC mapping is: the consumer sees the producer's memory (an in-place op changes it for every
    # reader until the next call overwrites it)
    return torch.frombuffer(view, dtype=dtype, count=math.prod(shape)).view(shape)
