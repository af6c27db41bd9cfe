"""Content fingerprints of the files a job's results depend on: its input parquet files and its model files.

A resumed job must write what the uninterrupted job would have written, so ``_manifest.json`` records, for every
input file and every model file that determines results, its path, its size and the SHA-256 of its bytes, and
``--resume`` hashes them again and refuses any difference (:mod:`dask_lm.io.jobdir`). Cheaper fingerprints were
fooled: path and size miss a file rewritten at the same size, and the first and last MiB miss weights changed in
the middle of a safetensors file. Only a hash of every byte says "same content".

Why SHA-256: it is the fastest hashlib algorithm on CPUs with SHA extensions (x86 ``sha_ni``, ARMv8), it is what
``sha256sum`` prints, and it is the Hugging Face Hub's LFS object id for a weight file, so a user can check a
pinned file by hand. Measured here (2-core x86 with ``sha_ni``, a 1 GiB file in the page cache, 8 MiB reads):
SHA-256 1,050 MB/s on one thread and 1,440 MB/s over two threads (blake2b: 625 MB/s). hashlib releases the GIL
while it hashes, so files are hashed in parallel threads (one thread per file). The cost is reading every byte
once per start or resume: about one second per GB and per core here, more when the files are not in the page
cache (then the disk or network sets the pace).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

__all__ = ["ALGORITHM", "file_sha256", "fingerprint_files", "relative_entries", "job_pins"]

logger = logging.getLogger("dask_lm")

ALGORITHM = "sha256"
_BLOCK = 8 << 20  # 8 MiB reads: large enough that the per-call overhead vanishes, small enough to stay in cache


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


def _threads(count: int) -> int:
    # one thread per core keeps the CPUs busy hashing; a few more hide the latency of network filesystems
    return max(1, min(count, 8, max(2, os.cpu_count() or 1)))


def fingerprint_files(paths: Sequence[str]) -> list[dict[str, Any]]:
    """``[{"path", "size", "sha256"}]`` for ``paths`` (in their order), hashed in parallel threads.

    Raises ``ValueError`` naming a file that cannot be read."""
    paths = list(paths)
    if not paths:
        return []
    t0 = time.perf_counter()

    def one(path: str) -> dict[str, Any]:
        try:
            size, digest = file_sha256(path)
        except OSError as e:
            raise ValueError(f"{path} cannot be read to fingerprint it: {e}") from None
        return {"path": path, "size": size, ALGORITHM: digest}

    with ThreadPoolExecutor(_threads(len(paths)), thread_name_prefix="dask-lm-hash") as pool:
        entries = list(pool.map(one, paths))
    seconds = time.perf_counter() - t0
    total = sum(e["size"] for e in entries)
    logger.info("hashed %d files (%.1f MB) in %.2f s (%.0f MB/s)", len(entries), total / 1e6, seconds,
                total / 1e6 / max(seconds, 1e-9))
    return entries


def relative_entries(entries: list[dict[str, Any]], root: str) -> list[dict[str, Any]]:
    """The entries with paths relative to ``root`` (a model directory is pinned by its content, not its place)."""
    return [{**e, "path": os.path.relpath(e["path"], root)} for e in entries]


def job_pins(model: str, model_files: Sequence[str], inputs: Sequence[str], *, tokenizer: str | None = None,
             tokenizer_files: Sequence[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """The manifest entries of a job: ``model_files`` and ``tokenizer_files`` (relative to their directories) and
    ``inputs`` (absolute), all hashed in one pool of threads."""
    model_paths = [os.path.join(model, f) for f in model_files]
    tokenizer_paths = [os.path.join(tokenizer, f) for f in tokenizer_files] if tokenizer else []
    entries = fingerprint_files([*model_paths, *tokenizer_paths, *inputs])
    a, b = len(model_paths), len(model_paths) + len(tokenizer_paths)
    return {"model_files": relative_entries(entries[:a], model),
            "tokenizer_files": relative_entries(entries[a:b], tokenizer) if tokenizer else [],
            "inputs": entries[b:]}
