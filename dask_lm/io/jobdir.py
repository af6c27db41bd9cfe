"""A job's output directory: one job at a time, a manifest that pins what the results depend on, no debris.

Scoring and SFT share these rules:

- **Lock.** A job holds an exclusive ``flock`` on ``output/.dask-lm.lock`` for its whole life, so a second job on
  the same output (two cron runs of ``--resume`` that overlap) is refused at once instead of writing beside the
  first. ``flock`` works on local filesystems and on NFSv4 (Linux maps it to NFS byte-range locks), but not
  everywhere: some FUSE, CIFS and Lustre mounts refuse it or lock only per client machine. Where the filesystem
  refuses it, the job warns and runs unlocked. The lock file is never deleted: unlinking it while a second job
  has it open would let a third job lock a fresh inode beside the second.
- **Debris.** Only under the lock is it safe to delete temporary files and directories that a killed job left
  (nothing else can be writing them), so each job clears its own kind of debris when it starts.
- **Manifest.** ``_manifest.json`` pins the model files, the input files (path, size, SHA-256: see
  :mod:`dask_lm.io.fingerprint`) and the options. ``--resume`` is refused, with every difference named, when any of
  them changed; a manifest that is not a JSON object is an error naming its path.
- **Place.** The output may not lie inside an input directory (its files would be read as input by the next run or
  ``--resume``), nor may an input lie inside the output.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
import shutil
import socket
from typing import Any, Iterator

from dask_lm.io.parquet import MANIFEST

__all__ = ["FORMAT", "LOCK", "locked_output", "read_manifest", "check_resume", "remove_stale",
           "check_output_location"]

logger = logging.getLogger("dask_lm")

LOCK = ".dask-lm.lock"
# What a manifest's pins mean. Bump it when the manifest's layout changes, or when a dask-lm change alters the
# results written for the same model files, input files and options (numbers, schema): --resume then refuses an
# output started by the older code instead of mixing the two. ``dask_lm_version`` is recorded for people but not
# compared: most releases do not change results, and refusing every resume across an upgrade would strand
# long jobs for nothing. Format 1 (no key) pinned files by size and a partial hash.
FORMAT = 2


@contextlib.contextmanager
def locked_output(output: str) -> Iterator[str]:
    """Create ``output`` if needed and hold its job lock until the block ends; ``ValueError`` when another job
    holds it. Yields the lock file's path."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output!r} exists and is not a directory")
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): a second job writing %s at the same time would not be "
                               "noticed", path, e, output)
            else:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
                raise ValueError(f"--output {output} is in use by another dask-lm job ({holder} holds {LOCK}); "
                                 "wait for it to finish, or choose another --output") from None
        except ImportError:  # no fcntl (Windows): nothing to lock with
            logger.warning("no fcntl on this platform: concurrent jobs on %s are not detected", output)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def read_manifest(output: str) -> dict[str, Any] | None:
    """``output/_manifest.json`` as a dict, ``None`` when there is none; ``ValueError`` naming it when damaged."""
    path = os.path.join(output, MANIFEST)
    if not os.path.exists(path):
        return None
    fix = (f"it is not a dask-lm manifest, so what {output} holds cannot be checked: move {output} aside (or delete "
           "it) and run again, or choose another --output")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


def check_resume(old: dict[str, Any], new: dict[str, Any], *, output: str, what: str, ignore: tuple[str, ...] = (),
                 flags: dict[str, str] | None = None) -> None:
    """Refuse (``ValueError``) to resume ``output`` when ``new`` pins anything else than ``old`` did.

    ``what`` completes "was ... with different ...", e.g. "scored" or "trained". Option keys in ``ignore`` are
    not compared (one not known yet, like an automatic precision before the cluster is up). ``flags`` maps an option
    key to the name users know it by (default: ``--key-with-dashes``)."""
    fix = (f"resume with the files and options {MANIFEST} pins, or write into a new --output (delete {output} to "
           "start it again)")
    if old.get("format") != new.get("format"):
        raise ValueError(f"--resume refused: {output} was {what} by dask-lm {old.get('dask_lm_version', '?')} "
                         f"(manifest format {old.get('format', 1)}); this dask-lm writes format {new.get('format')}, "
                         f"whose pins and results may differ; write into a new --output instead")
    diffs = _differences(old, new, ignore, flags or {})
    if diffs:
        kinds = list(dict.fromkeys(kind for kind, _ in diffs))
        raise ValueError(f"--resume refused: {output} was {what} with different {', '.join(kinds)}: "
                         f"{'; '.join(text for _, text in diffs)} (see {MANIFEST}); {fix}")


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def _differences(old: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...], flags: dict[str, str]
                 ) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    # a model or tokenizer is pinned by its files' content: the same files copied elsewhere give the same results
    for key, label in (("model", "model"), ("tokenizer", "tokenizer")):
        files = _file_differences(f"{label} file", old.get(f"{key}_files"), new.get(f"{key}_files"),
                                  new.get(key) or "")
        if files and old.get(key) != new.get(key):
            files.insert(0, f"--{key} was {_show(old.get(key))}, now {_show(new.get(key))}")
        out += [(label, text) for text in files]
    old_opts, new_opts = old.get("options") or {}, new.get("options") or {}
    for key in sorted(set(old_opts) | set(new_opts)):
        if key not in ignore and old_opts.get(key) != new_opts.get(key):
            flag = flags.get(key, f"--{key.replace('_', '-')}")
            out.append(("options", f"{flag} was {_show(old_opts.get(key))}, now {_show(new_opts.get(key))}"))
    inputs = _file_differences("input file", old.get("inputs"), new.get("inputs"), "")
    old_paths = [e.get("path") for e in old.get("inputs") or []]
    new_paths = [e.get("path") for e in new.get("inputs") or []]
    if not inputs and old_paths != new_paths:
        inputs.append("the same input files in another order (parts are numbered in input order)")
    if not inputs and old.get("partitions") != new.get("partitions"):
        inputs.append(f"input row groups were {old.get('partitions')}, now {new.get('partitions')}")
    out += [("inputs", text) for text in inputs]
    return out


def _file_differences(label: str, old: Any, new: Any, root: str) -> list[str]:
    old_by = {e.get("path"): e for e in old or [] if isinstance(e, dict)}
    new_by = {e.get("path"): e for e in new or [] if isinstance(e, dict)}
    out = []
    for path in sorted(set(old_by) | set(new_by), key=str):
        shown = os.path.join(root, path) if root else path
        o, n = old_by.get(path), new_by.get(path)
        if n is None:
            out.append(f"{label} {shown} is gone")
        elif o is None:
            out.append(f"{label} {shown} is new")
        elif o.get("size") != n.get("size"):
            out.append(f"{label} {shown} changed: {_show(o.get('size'))} -> {n['size']} bytes")
        elif o.get("sha256") != n.get("sha256"):
            out.append(f"{label} {shown} changed: same size ({n['size']} bytes), different content (sha256 "
                       f"{str(o.get('sha256'))[:12]}... -> {str(n.get('sha256'))[:12]}...)")
    return out


def remove_stale(output: str, pattern: str) -> list[str]:
    """Delete the entries of ``output`` whose names match ``pattern`` (files or directories): the temporaries of
    a killed job. Call it only while holding the lock. Returns what was removed."""
    regex = re.compile(pattern)
    removed = []
    for name in sorted(os.listdir(output)):
        if regex.fullmatch(name):
            path = os.path.join(output, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            removed.append(path)
    if removed:
        logger.info("removed %d temporary file(s) of an interrupted job in %s", len(removed), output)
    return removed


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_output_location(output: str, input: Any, files: list[str]) -> None:
    """Refuse an output inside an input directory (or one an input glob reaches), and an input inside the output:
    the job's own files would become its input on the next run or ``--resume``."""
    out = os.path.realpath(output)
    for item in input if isinstance(input, (list, tuple)) else [input]:
        path = os.fspath(item)
        if any(c in path for c in "*?["):
            if _glob_reaches(os.path.abspath(path), os.path.abspath(output)):
                raise ValueError(f"--output {output} is where the input pattern {path!r} matches files: its own "
                                 "files would be read as input by the next run or --resume; choose an output "
                                 "directory the pattern does not reach")
        elif os.path.isdir(path) and _within(out, os.path.realpath(path)):
            raise ValueError(f"--output {output} is inside the input directory {path}: its own files would be read "
                             f"as input by the next run or --resume; choose an output directory outside {path}")
    for f in files:
        if _within(os.path.realpath(f), out):
            raise ValueError(f"input {f} is inside --output {output}; keep inputs and outputs in separate "
                             "directories")


def _glob_reaches(pattern: str, output: str) -> bool:
    """Whether a file below ``output`` could match ``pattern`` as ``glob.glob(..., recursive=True)`` matches it:
    one component per separator, ``**`` any number of them, and wildcards never matching a leading dot."""
    parts, out = pattern.strip(os.sep).split(os.sep), output.strip(os.sep).split(os.sep)
    for i, name in enumerate(out):
        if i >= len(parts):
            return False  # the output lies deeper than the pattern reaches
        part = parts[i]
        if part == "**":
            return not any(n.startswith(".") for n in out[i:])
        if (name.startswith(".") and not part.startswith(".")) or not fnmatch.fnmatchcase(name, part):
            return False
    return len(parts) > len(out)  # components left over name files below the output
