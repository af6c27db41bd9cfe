"""dask-lm's cache directory on this machine, and the digests kept there so that a second job does not re-hash.

A job pins every file its results depend on by SHA-256 (:mod:`dask_lm.io.fingerprint`): about a second per GB and
core, paid again by every job over the same model and dataset (10 s of a 1.5B model's start on the H200 host).
A job already trusts a file's :class:`~dask_lm.io.fingerprint.Stamp` (size, mtime, ctime) to say "unchanged" from
one partition's read to the next; this cache extends that trust from one job to the next, as git's index does
for ``git status``: a digest is reused only for the same path, inode and device, under the very stamp it was
hashed at, and only if that stamp was not racy then (the file had last changed at least two seconds before the
hash began, so a write in the same clock tick could not have left the stamp as it was). A write, a rename over
the file, a ``touch`` or a ``utime`` back to the old mtime all move ``ctime``, and the file is hashed afresh.

The entries are small JSON files under ``<cache root>/sha256/``, one per path, written atomically; a cache that
cannot be read or written is skipped (the file is hashed), never an error. ``DASK_LM_HASH_CACHE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any

__all__ = ["cache_root", "cached_digest", "remember_digest"]


def cache_root() -> str:
    """``$DASK_LM_CACHE_DIR``, else ``$XDG_CACHE_HOME/dask-lm``, else ``~/.cache/dask-lm``."""
    explicit = os.environ.get("DASK_LM_CACHE_DIR")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dask-lm")


def _enabled() -> bool:
    return os.environ.get("DASK_LM_HASH_CACHE", "1") != "0"


def _entry_path(path: str) -> str:
    name = hashlib.sha256(os.fsencode(path)).hexdigest()[:40]
    return os.path.join(cache_root(), "sha256", name + ".json")


def _identity(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


def cached_digest(path: str, st: os.stat_result) -> str | None:
    """The SHA-256 remembered for absolute ``path`` if ``st`` (its ``stat`` now) is exactly the one it was hashed
    at; ``None`` otherwise (no entry, another stamp, an unreadable cache)."""
    if not _enabled():
        return None
    try:
        with open(_entry_path(path), encoding="utf-8") as f:
            entry: Any = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("path") != path:
        return None
    if any(entry.get(k) != v for k, v in _identity(st).items()):
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def remember_digest(path: str, st: os.stat_result, digest: str) -> None:
    """Keep ``digest`` for absolute ``path`` at stamp ``st``; the caller passes only stamps that were not racy
    when hashed. Best effort: a cache that cannot be written is left as it is."""
    if not _enabled():
        return
    target = _entry_path(path)
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"path": path, **_identity(st), "sha256": digest}, f)
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
