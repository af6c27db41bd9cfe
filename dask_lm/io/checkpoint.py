"""Checkpoint files: Hugging Face safetensors directories, and directories that appear only when complete.

Every checkpoint directory is written under a temporary sibling name (``.<name>.tmp-<id>``, same filesystem) and
renamed into place once every byte is on disk (files and directories fsync'ed). A crash, a killed worker or an
exception therefore never leaves a half-written directory under the final name, and a previous checkpoint under
that name stays intact until the new one is complete; replacing it costs two renames.

The weights directory is what ``save_pretrained`` writes and ``AutoModelForCausalLM.from_pretrained`` reads:
``config.json``, ``generation_config.json`` when the model has one, and ``model.safetensors`` or, above
``max_shard_size``, ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. The shard
plan is made up front from names, shapes and dtypes, so rank 0 can write each shard as soon as its tensors are
gathered and never holds more than one shard (unless an async save keeps them staged for the writer thread).

Nothing here touches CUDA: tensors arrive on the CPU.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from dask_lm.errors import CheckpointWriteError
from dask_lm.io import safe_paths

__all__ = [
    "temporary_sibling",
    "publish",
    "discard",
    "parse_size",
    "plan_shards",
    "write_shard",
    "write_index",
    "fsync_tree",
    "BackgroundWriter",
    "CheckpointWriteError",
    "write_error",
    "writing",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# an optimizer directory saved before any step: the optimizer's config only (no torch.distributed.checkpoint state)
FRESH_OPTIMIZER = "optimizer_without_state.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str, key: str = "checkpointing.max_shard_size") -> int:
    """Bytes from ``5GB`` / ``512MiB`` / an int; ``ValueError`` naming ``key`` otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE.match(str(size))
    if not m:
        raise ValueError(f"`{key}` must be a size such as '5GB' or a number of bytes, got {size!r}")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"`{key}` must be positive, got {size!r}")
    return value


def temporary_sibling(final: str) -> str:
    """A fresh temporary path next to ``final`` (same directory, so the final rename is atomic)."""
    final = os.path.abspath(final)
    parent, base = os.path.split(final.rstrip(os.sep))
    return os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | safe_paths.NOFOLLOW)
    except OSError:
        if safe_paths.is_link(path):  # a link in a checkpoint is synced where it lives, not through it
            return
        raise
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the data files were synced
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path``, deepest first."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def publish(tmp: str, final: str) -> None:
    """Rename the complete directory ``tmp`` to ``final``; an existing ``final`` is replaced only afterwards."""
    final = os.path.abspath(final)
    assert os.path.isdir(tmp), f"temporary checkpoint {tmp} is missing"
    fsync_tree(tmp)
    parent = os.path.dirname(final)
    old = None
    if os.path.lexists(final):
        old = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:  # put the previous checkpoint back
            os.rename(old, final)
        raise
    _fsync(parent)
    if old is not None:
        _remove_quietly(old)


def discard(tmp: str | None) -> None:
    """Remove the temporary directory ``tmp`` (a link there goes as a link: its target is not the save's)."""
    if tmp:
        _remove_quietly(tmp)


def _remove_quietly(path: str) -> None:
    try:
        safe_paths.remove(path)
    except OSError:  # a leftover to clear by hand must not hide the save's own outcome
        pass


def plan_shards(entries: Sequence[tuple[str, Sequence[int], torch.dtype]], max_shard_size: int) -> list[list[str]]:
    """Names grouped into shards of at most ``max_shard_size`` bytes, in order (a bigger tensor is alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    return WEIGHTS_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shard(directory: str, index: int, count: int, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # safetensors refuses views that share storage; every tensor here is its own contiguous CPU copy
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(directory, shard_file_name(index, count)),
        metadata={"format": "pt"},
    )


def write_index(directory: str, shards: list[list[str]], total_size: int) -> None:
    if len(shards) == 1:
        return
    weight_map = {name: shard_file_name(i, len(shards)) for i, names in enumerate(shards) for name in names}
    with open(os.path.join(directory, WEIGHTS_INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------- write errors

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error (safetensors) ends its message
_FULL_BYTES = 1 << 20  # less free than this after a failed write: the filesystem ran full
_FILE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EEXIST,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EIO,
    errno.EFBIG,
    errno.ENAMETOOLONG,
}


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: DCP's CheckpointException failures (one per rank), then causes and contexts."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo.extend(f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException))
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)


def _errno(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    m = _RUST_OS_ERROR.search(str(e))
    return int(m.group(1)) if m else None


def _free_bytes(path: str) -> int | None:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def write_error(exc: BaseException, path: str) -> BaseException:
    """``exc``, raised while writing the checkpoint ``path``, as one clear line (a :class:`CheckpointWriteError`).

    The writers bury the reason: DCP wraps every rank's traceback into its message, safetensors ends with
    ``(os error 28)``, and torch's zip writer reports a full disk as ``unexpected pos``. The operating system's
    error is found along the chain; failing that, a filesystem with (almost) no space left after the failure
    means it ran full. Anything else passes unchanged (a user's ``ValueError``, a lost peer in a collective),
    except DCP's wrapper, which becomes its first failure's last line."""
    if isinstance(exc, (ValueError, CheckpointWriteError)) or (
        not isinstance(exc, Exception) and not hasattr(exc, "failures")
    ):
        return exc  # user errors, and KeyboardInterrupt / SystemExit
    causes = list(_causes(exc))
    code = next((c for c in map(_errno, causes) if c), None)
    wrapped = any(hasattr(c, "failures") for c in causes)  # DCP's wrapper: a traceback as its message
    left = ""
    # only a failure that looks like a write (an OSError without errno, torch's zip writer, DCP) is blamed on a
    # full disk; a lost peer in the gather before the write is not, however little space is left
    if code is None and (wrapped or any(isinstance(c, OSError) or "unexpected pos" in str(c) for c in causes)):
        free = _free_bytes(path)
        if free is not None and free < _FULL_BYTES:
            code, left = errno.ENOSPC, f" ({free} bytes free there)"
    if code not in _FILE_ERRNOS and not wrapped:
        return exc  # not a filesystem error (a lost peer in a collective, say), and already readable
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space on that filesystem (or raise the quota) or save to another directory, then save again"
        reason = f"{os.strerror(code)}{left}"
    elif code in _FILE_ERRNOS:
        reason, fix = os.strerror(code), "check that the directory exists and is writable, then save again"
    elif code is not None:  # inside DCP's wrapper, e.g. a connection reset by a rank that went away
        reason = os.strerror(code)
        fix = "a rank or the network failed during the save; check the workers, then save again"
    else:  # DCP's wrapper around something other than an OS error: the innermost exception's last line
        root = causes[-1]
        lines = str(root).strip().splitlines()
        reason = f"{type(root).__name__}: {lines[-1] if lines else ''}"
        fix = "check the disk and the directory, then save again"
    return CheckpointWriteError(code, f"could not write the checkpoint {path}: {reason}; {fix}")


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Re-raise a failure inside as :func:`write_error` for ``path``."""
    try:
        yield
    except BaseException as e:
        err = write_error(e, path)
        if err is e:
            raise
        raise err from (None if hasattr(e, "failures") else e)  # DCP's wrapper only repeats the traceback


class BackgroundWriter:
    """One daemon thread per worker that runs write jobs in order; ``wait`` re-raises the first failure.

    Async checkpoints stage tensors on the host, queue the writes here and return; the job that finishes a
    checkpoint also publishes it, so it appears under its final name only after its last byte was written.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._pending: list[Future[Any]] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.add_done_callback(self._forget)
        with self._wake:
            self._jobs.append((job, fut))
            self._pending.append(fut)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dask-lm-checkpoint-writer", daemon=True)
                self._thread.start()
            self._wake.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    if not self._wake.wait(timeout=60):
                        self._thread = None
                        return
                job, fut = self._jobs.pop(0)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as e:  # reported by wait() / result(); without the traceback, whose frames
                fut.set_exception(e.with_traceback(None))  # would keep the staged tensors alive
            del job

    def _forget(self, fut: Future[Any]) -> None:
        with self._lock:
            if fut in self._pending and fut.exception() is None:
                self._pending.remove(fut)

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        errors = []
        for fut in pending:
            exc = fut.exception(timeout=timeout)
            if exc is not None:
                errors.append(exc)
        if errors:
            raise errors[0]

    @property
    def busy(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._pending)
