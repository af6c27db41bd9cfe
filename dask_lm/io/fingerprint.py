"""Content fingerprints of the files a job's results depend on: its input parquet files and its model files.

A resumed job must write what the uninterrupted job would have written, so ``_manifest.json`` records, for every
input file and every model file that determines results, its path, its size and the SHA-256 of its bytes, and
``--resume`` hashes them again and refuses any difference (:mod:`dask_lm.jobs.resume`). Cheaper fingerprints were
fooled: path and size miss a file rewritten at the same size, and the first and last MiB miss weights changed in
the middle of a safetensors file. Only a hash of every byte says "same content".

Why SHA-256: it is the fastest hashlib algorithm on CPUs with SHA extensions (x86 ``sha_ni``, ARMv8), it is what
``sha256sum`` prints, and it is the Hugging Face Hub's LFS object id for a weight file, so a user can check a
pinned file by hand. Measured here (2-core x86 with ``sha_ni``, a 1 GiB file in the page cache, 8 MiB reads):
SHA-256 1,050 MB/s on one thread and 1,440 MB/s over two threads (blake2b: 625 MB/s). hashlib releases the GIL
while it hashes, so files are hashed in parallel threads (one thread per file). The cost is reading every byte
once per start or resume: about one second per GB and per core here, more when the files are not in the page
cache (then the disk or network sets the pace). A later job over the same files reuses the digests where their
stamps are the ones hashed (:mod:`dask_lm.io.local_cache`).

A file can also change while the job runs (a pipeline rewrites it, a user replaces it), and a ``_SUCCESS`` over
parts computed from two versions would vouch for content the output was not computed from. Hashing every byte per
partition would double the job's reads, so the pin also keeps the file's :class:`Stamp` (size, mtime, ctime) taken
around the hash: every partition's read compares the file's stamp with the pinned one (one ``stat``), and before
``_SUCCESS`` every pinned file, model files included, is stamped again (:func:`confirm_unchanged`). A stamp that
moved is not yet a change (``touch``, a copy of the same bytes): the file is re-hashed, and only different bytes
fail the job (:class:`~dask_lm.errors.InputChangedError`, exit 1).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from dask_lm.errors import InputChangedError
from dask_lm.io import local_cache

__all__ = [
    "ALGORITHM",
    "Stamp",
    "Pin",
    "stamp",
    "file_sha256",
    "fingerprint_files",
    "job_pins",
    "verify",
    "confirm_unchanged",
]

logger = logging.getLogger("dask_lm")

ALGORITHM = "sha256"
_SUCCESS = "_SUCCESS"  # dask_lm.io.parquet.SUCCESS, named here without importing pyarrow
_BLOCK = 8 << 20  # 8 MiB reads: large enough that the per-call overhead vanishes, small enough to stay in cache
# A file modified this close to its hash may change again without its stamp changing: filesystems keep times at
# their own granularity (ext4 takes them from a clock that ticks every few ms, FAT and some NFS servers in whole
# seconds), git's "racily clean" index entries. Such a pin is re-hashed before _SUCCESS whatever its stamp says.
RACY_NS = 2_000_000_000


class Stamp(NamedTuple):
    """What ``stat`` says of a file's content without reading it: size, modification and change times.

    ``st_ctime`` moves on every write, rename and ``utime`` and cannot be set back by a user, so a file rewritten
    to the same size with its old mtime restored still gets a new stamp. Inode and device numbers are left out:
    hosts that mount one NFS export see different device numbers for it, and a worker on another host must agree
    with the driver."""

    size: int
    mtime_ns: int
    ctime_ns: int


def stamp(path: str) -> Stamp:
    st = os.stat(path)
    return Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Pin:
    """One file as a job pinned it: the manifest's record (size, SHA-256) and the stamp it had while hashed."""

    path: str  # absolute
    size: int
    sha256: str
    stamp: Stamp
    racy: bool = False  # modified within RACY_NS of the hash: its stamp cannot vouch for its content

    def entry(self, root: str | None = None) -> dict[str, Any]:
        """The manifest's entry: the path relative to ``root`` where given (a model is pinned by content)."""
        return {
            "path": os.path.relpath(self.path, root) if root else self.path,
            "size": self.size,
            ALGORITHM: self.sha256,
        }


def file_sha256(path: str) -> tuple[int, str]:
    """(size in bytes, hex SHA-256) of ``path``, read in 8 MiB blocks into one reused buffer.

    The size is the number of bytes hashed, so the pair always describes one and the same read."""
    digest = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])  # hashlib drops the GIL for updates over 2 KiB: threads hash in parallel
            size += n
    return size, digest.hexdigest()


def _pin(path: str) -> Pin:
    """Hash ``path`` between two stamps; they must agree, else the bytes hashed may be a mix of two versions."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
        before = Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        racy = time.time_ns() - max(before.mtime_ns, before.ctime_ns) < RACY_NS
        known = local_cache.cached_digest(path, st)  # hashed by an earlier job under this very stamp
        if known is not None:
            return Pin(path, before.size, known, before, racy)
        size, digest = file_sha256(path)
        after = stamp(path)
    except OSError as e:
        raise ValueError(f"{path} cannot be read to fingerprint it: {e}") from None
    if after != before or size != before.size:
        raise InputChangedError(
            f"{path} changed while dask-lm was fingerprinting it (something is writing it); "
            "run the job again once the file is complete"
        )
    if not racy:  # a racy stamp cannot vouch for the content later: it is hashed again next time
        local_cache.remember_digest(path, st, digest)
    return Pin(path, size, digest, before, racy)


def _threads(count: int) -> int:
    # one thread per core keeps the CPUs busy hashing; a few more hide the latency of network filesystems
    return max(1, min(count, 8, max(2, os.cpu_count() or 1)))


def fingerprint_files(paths: Sequence[str]) -> list[Pin]:
    """A :class:`Pin` of each of ``paths`` (in their order), hashed in parallel threads.

    Raises ``ValueError`` naming a file that cannot be read, :class:`InputChangedError` one written meanwhile."""
    paths = list(paths)
    if not paths:
        return []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(_threads(len(paths)), thread_name_prefix="dask-lm-hash") as pool:
        pins = list(pool.map(_pin, paths))
    seconds = time.perf_counter() - t0
    total = sum(p.size for p in pins)
    logger.info(
        "hashed %d files (%.1f MB) in %.2f s (%.0f MB/s)",
        len(pins),
        total / 1e6,
        seconds,
        total / 1e6 / max(seconds, 1e-9),
    )
    return pins


def job_pins(
    model: str,
    model_files: Sequence[str],
    inputs: Sequence[str],
    *,
    tokenizer: str | None = None,
    tokenizer_files: Sequence[str] = (),
) -> tuple[dict[str, list[dict[str, Any]]], list[Pin]]:
    """The manifest entries of a job (``model_files`` and ``tokenizer_files`` relative to their directories,
    ``inputs`` absolute) and the pins behind them (model, tokenizer, inputs, in that order), hashed in one pool."""
    model_paths = [os.path.join(model, f) for f in model_files]
    tokenizer_paths = [os.path.join(tokenizer, f) for f in tokenizer_files] if tokenizer else []
    pins = fingerprint_files([*model_paths, *tokenizer_paths, *inputs])
    a, b = len(model_paths), len(model_paths) + len(tokenizer_paths)
    entries = {
        "model_files": [p.entry(model) for p in pins[:a]],
        "tokenizer_files": [p.entry(tokenizer) for p in pins[a:b]] if tokenizer else [],
        "inputs": [p.entry() for p in pins[b:]],
    }
    return entries, pins


# ------------------------------------------------------------------------------------------- unchanged since
@functools.lru_cache(maxsize=256)
def _rehash(path: str, now: Stamp) -> str:
    """The SHA-256 of ``path`` as it is at stamp ``now`` (cached: every partition of a touched file asks)."""
    return file_sha256(path)[1]


def _changed(pin: Pin, why: str) -> InputChangedError:
    return InputChangedError(
        f"{pin.path} changed while the job ran ({why}); results from two versions of a file "
        f"would be mixed, so the job stops without {_SUCCESS}. {_resume_fix()}"
    )


def _resume_fix() -> str:
    from dask_lm.interface import again, opt

    return (
        f"Restore the file as it was and {again(resume=True)} (the parts written so far came from the pinned "
        f"content), or pass {opt('overwrite', True)} to start again from the new content"
    )


def verify(pin: Pin, *, since: Stamp | None = None, rehash_racy: bool = False) -> Stamp:
    """That ``pin.path`` still holds the pinned content; returns its stamp now. Costs one ``stat`` while the stamp
    is the pinned one (or ``since``, what an earlier call returned: a read between the two calls saw one
    version); a file whose stamp moved (a ``touch``, a copy of the same bytes) is re-hashed, and only different
    bytes raise :class:`InputChangedError`, naming the file, what changed and how to go on. With ``rehash_racy`` a
    racy pin is re-hashed even under its pinned stamp."""
    try:
        now = stamp(pin.path)
    except OSError as e:
        raise _changed(pin, f"it cannot be read any more: {e.strerror or e}") from None
    if now == (since or pin.stamp) and not (rehash_racy and pin.racy and since is None):
        return now
    if now.size != pin.size:
        raise _changed(pin, f"{pin.size:,} bytes when the job pinned it, now {now.size:,}")
    try:
        # a racy pin under its pinned stamp is read afresh: the cache keyed by that stamp cannot tell versions apart
        digest = file_sha256(pin.path)[1] if now == pin.stamp else _rehash(pin.path, now)
    except OSError as e:
        raise _changed(pin, f"it cannot be read any more: {e.strerror or e}") from None
    if digest != pin.sha256:
        raise _changed(
            pin, f"same size, different content: {ALGORITHM} {pin.sha256[:12]}... when pinned, now {digest[:12]}..."
        )
    return now


def confirm_unchanged(pins: Sequence[Pin]) -> None:
    """Before ``_SUCCESS``: every pinned file still holds its pinned content (:func:`verify`, racy pins
    re-hashed), checked in parallel threads; :class:`InputChangedError` for the first that does not."""
    if not pins:
        return
    _rehash.cache_clear()  # the last word reads the bytes afresh wherever a stamp moved
    with ThreadPoolExecutor(_threads(len(pins)), thread_name_prefix="dask-lm-verify") as pool:
        list(pool.map(lambda p: verify(p, rehash_racy=True), pins))
