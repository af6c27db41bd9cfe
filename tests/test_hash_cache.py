"""The digest cache (dask_lm.io.local_cache): a second job over unchanged files skips re-hashing them, and any
change that moves a stamp (a rewrite, a rename over the file, a utime back to the old mtime) is hashed afresh.

The reference digest is always hashlib's over the file's bytes, read here."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from dask_lm.io import fingerprint, local_cache


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own; stamps count as settled at once (else every fresh file is racy for 2 s); and a
    counter of the reads that hash."""
    monkeypatch.setenv("DASK_LM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DASK_LM_HASH_CACHE", raising=False)
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    reads: list[str] = []
    real = fingerprint.file_sha256

    def counting(path):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(fingerprint, "file_sha256", counting)
    return reads


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_an_unchanged_file_is_hashed_once_across_jobs(tmp_path, cache):
    a = write(tmp_path / "a.bin", os.urandom(3 << 20))
    b = write(tmp_path / "b.bin", os.urandom(1000))
    first = fingerprint.fingerprint_files([a, b])
    second = fingerprint.fingerprint_files([a, b])
    assert [p.sha256 for p in first] == [p.sha256 for p in second] == [sha(a), sha(b)]
    assert [p.stamp for p in first] == [p.stamp for p in second]
    assert sorted(cache) == sorted([a, b])  # the second call read neither file


def test_a_same_size_rewrite_with_the_old_mtime_restored_is_hashed_again(tmp_path, cache):
    path = write(tmp_path / "w.bin", b"x" * 4096)
    old = os.stat(path)
    pinned = fingerprint.fingerprint_files([path])[0]
    time.sleep(0.05)  # past the filesystem clock's tick (a few ms), which RACY_NS 0 no longer allows for
    write(path, b"y" * 4096)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))  # size and mtime as before: only ctime tells
    again = fingerprint.fingerprint_files([path])[0]
    assert again.sha256 == sha(path) != pinned.sha256
    assert len(cache) == 2


def test_a_file_renamed_over_the_path_is_hashed_again(tmp_path, cache):
    path = write(tmp_path / "r.bin", b"a" * 100)
    fingerprint.fingerprint_files([path])
    other = write(tmp_path / "other.bin", b"b" * 100)
    os.replace(other, path)  # another inode under the same name
    assert fingerprint.fingerprint_files([path])[0].sha256 == sha(path)
    assert len(cache) == 2


def test_a_damaged_cache_entry_is_ignored(tmp_path, cache):
    path = write(tmp_path / "d.bin", b"data" * 100)
    fingerprint.fingerprint_files([path])
    entry = local_cache._entry_path(os.path.abspath(path))
    for junk in ("not json", '["a list"]', f'{{"path": "{os.path.abspath(path)}", "sha256": "short"}}'):
        with open(entry, "w") as f:
            f.write(junk)
        assert fingerprint.fingerprint_files([path])[0].sha256 == sha(path)
    assert len(cache) == 4


def test_a_racy_stamp_is_not_remembered(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_NS", 60 * 10**9)  # the file changed "just now"
    path = write(tmp_path / "fresh.bin", b"f" * 100)
    pins = [fingerprint.fingerprint_files([path])[0] for _ in range(2)]
    assert all(p.racy and p.sha256 == sha(path) for p in pins)
    assert len(cache) == 2
    assert not os.path.exists(local_cache._entry_path(os.path.abspath(path)))


def test_the_cache_can_be_turned_off_and_an_unwritable_one_is_skipped(tmp_path, cache, monkeypatch):
    path = write(tmp_path / "o.bin", b"o" * 100)
    monkeypatch.setenv("DASK_LM_HASH_CACHE", "0")
    fingerprint.fingerprint_files([path])
    fingerprint.fingerprint_files([path])
    assert len(cache) == 2
    monkeypatch.delenv("DASK_LM_HASH_CACHE")
    blocker = write(tmp_path / "not-a-dir", b"")
    monkeypatch.setenv("DASK_LM_CACHE_DIR", blocker)  # a file where the cache directory should be
    assert fingerprint.fingerprint_files([path])[0].sha256 == sha(path)
    assert fingerprint.fingerprint_files([path])[0].sha256 == sha(path)
    assert len(cache) == 4
