"""A job's output folder: one job at a time, in a place of its own, no debris, nothing outside it touched.

Scoring and SFT share these rules:

- **Lock.** A job holds an exclusive ``flock`` on ``output/.dask-lm.lock`` for its whole life, taken first, before
  the model or the inputs are looked at (:class:`OutputLock`), so a second job on the same output (a double-fired
  cron or Airflow task, two runs of ``--resume`` that overlap) is refused at once, before it starts a cluster,
  instead of writing beside the first or racing it to the lock. ``flock`` works on local filesystems and on NFSv4
  (Linux maps it to NFS byte-range locks), but not everywhere: some FUSE, CIFS and Lustre mounts refuse it or lock
  only per client machine. Where the filesystem refuses it, the job warns and runs unlocked. A job that ends
  having written nothing (refused by a later check, interrupted at once) removes the lock file and the folder it
  created, so a refused job leaves nothing; the file is unlinked while still locked, and a job locks a file only if
  the path still names it once locked, so a job that opened the old file retries instead of locking a file no one
  else sees.
- **Debris.** Only under the lock is it safe to delete temporary files and directories that a killed job left
  (nothing else can be writing them), so each job clears its own kind of debris when it starts.
- **Manifest.** ``_manifest.json`` pins what the results depend on; its format and seal are
  :mod:`dask_lm.io.manifest`'s, the comparison on ``--resume`` :mod:`dask_lm.jobs.resume`'s.
- **Place.** The output may not lie inside an input directory (its files would be read as input by the next run or
  ``--resume``), nor may an input lie inside the output.
- **States.** An output is new (missing or empty), unfinished (a manifest, no ``_SUCCESS``), finished, or foreign
  (files that are not the job's own). Without ``--resume`` an occupied output is refused with the next command
  to type; ``--overwrite`` deletes the job's own files (never foreign ones) and starts again; ``--resume`` of a
  finished job returns its summary without starting a cluster. The refusals need only the output folder, so
  they come first, before the model is even looked at (:func:`refuse_occupied`).
- **Links.** Nothing outside the output is touched: a symbolic link under a name the job owns (the lock, the
  manifest, ``_SUCCESS``, a part, ``_errors``, a checkpoint) is refused, naming it, at the first look and again
  under the lock, and every file is opened and removed without following links (:mod:`dask_lm.io.safe_paths`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from dask_lm.interface import opt
from dask_lm.io import safe_paths
from dask_lm.io.parquet import MANIFEST, SUCCESS

__all__ = [
    "LOCK",
    "OutputState",
    "output_state",
    "read_summary",
    "refuse_occupied",
    "clear_output",
    "OutputLock",
    "locked_output",
    "refuse_links",
    "remove_stale",
    "check_output_location",
]

logger = logging.getLogger("dask_lm")

LOCK = ".dask-lm.lock"


class OutputLock:
    """The job lock on ``output/.dask-lm.lock``, from :meth:`acquire` to :meth:`release` (the module docstring says
    what it guards). It remembers what taking it created, the output folder and the lock file, so that a job that
    ends having written nothing removes them again (:meth:`release` with ``remove``)."""

    def __init__(self, output: str) -> None:
        self.output, self.path = output, os.path.join(output, LOCK)
        self.fd: int | None = None
        self.created_dir = self.created_file = False

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        """Create ``output`` if needed and lock it; ``ValueError`` naming the holder when another job has it.
        Creates nothing when refused but what a job beside it may use (the folder, the lock file) and writes
        nothing."""
        assert self.fd is None, "acquire() of a held lock"
        if os.path.exists(self.output) and not os.path.isdir(self.output):
            raise ValueError(f"{opt('output')} {self.output!r} exists and is not a directory")
        # a job that removed its lock file (it wrote nothing) between our open and our flock leaves us a lock on a
        # file no one else can see: the lock is ours only if the path still names the file we locked
        for _attempt in range(20):
            created_dir = self._make_dir()
            try:
                fd, created_file = self._open()
            except FileNotFoundError:  # the folder went (its job removed it) between the two steps: again
                continue
            try:
                if not self._flock(fd):
                    raise _in_use(self.output, fd)
                here = os.lstat(self.path)
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            mine = os.fstat(fd)
            if (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            self.fd, self.created_dir, self.created_file = fd, created_dir, created_file
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            return
        raise ValueError(
            f"{opt('output')} {self.output}: its lock file {LOCK} keeps being removed by other jobs as this one "
            "takes it; wait for them to finish, or choose another output"
        )

    def _make_dir(self) -> bool:
        parent = os.path.dirname(os.path.abspath(self.output))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(self.output)
        except FileExistsError:
            if not os.path.isdir(self.output):
                raise ValueError(f"{opt('output')} {self.output!r} exists and is not a directory") from None
            return False
        return True

    def _open(self) -> tuple[int, bool]:
        # never through a link: the pid line would truncate and overwrite its target
        try:  # not inherited by exec'd children (PEP 446)
            return safe_paths.open_no_follow(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
        except FileExistsError:
            return safe_paths.open_no_follow(self.path, os.O_RDWR), False

    def _flock(self, fd: int) -> bool:
        """Whether ``fd`` is locked now (``False``: another job holds it). A filesystem that refuses ``flock``
        altogether gets a warning, and the job runs unlocked."""
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            logger.warning(
                "cannot lock %s (%s): a second job writing %s at the same time would not be noticed",
                self.path,
                e,
                self.output,
            )
        except ImportError:  # no fcntl (Windows): nothing to lock with
            logger.warning("no fcntl on this platform: concurrent jobs on %s are not detected", self.output)
        return True

    def release(self, *, remove: bool = False) -> None:
        """Let go of the lock (a no-op when not held). With ``remove`` (the job wrote nothing), the lock file and
        the output folder go too where taking the lock created them: unlinked while still held, so a job waiting on
        the old file sees it gone and takes a fresh one (:meth:`acquire`)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if remove and self.created_file:
                with contextlib.suppress(OSError):
                    os.remove(self.path)
                if self.created_dir:
                    with contextlib.suppress(OSError):  # not empty: something else is there, it stays
                        os.rmdir(self.output)
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked_output(output: str) -> Iterator[str]:
    """Create ``output`` if needed and hold its job lock until the block ends; ``ValueError`` when another job
    holds it. Yields the lock file's path."""
    lock = OutputLock(output)
    lock.acquire()
    try:
        yield lock.path
    finally:
        lock.release()


def _in_use(output: str, fd: int) -> ValueError:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
    return ValueError(
        f"{opt('output')} {output} is in use by another dask-lm job ({holder} holds {LOCK}); wait for "
        f"it to finish, or choose another {opt('output')}"
    )


@dataclass(frozen=True)
class OutputState:
    """What an output directory holds, read without the lock (a first look; the job looks again under it)."""

    kind: Literal["new", "unfinished", "finished", "foreign"]
    foreign: tuple[str, ...] = ()
    """Entries that are not the job's own files (``foreign`` outputs only)."""
    summary: dict[str, Any] | None = None
    """``_SUCCESS``'s contents (finished outputs; :func:`read_summary`)."""


def _names(output: str) -> list[str]:
    # dot entries are the lock and temporaries, never results
    return sorted(f for f in os.listdir(output) if not f.startswith(".")) if os.path.isdir(output) else []


def output_state(output: str, owned: str) -> OutputState:
    """The state of ``output``; ``owned`` is a regular expression for the names of the job's own entries (parts,
    checkpoints) besides ``_manifest.json`` and ``_SUCCESS``. ``ValueError`` naming a symbolic link under one of
    those names, or the lock's (:func:`refuse_links`)."""
    refuse_links(output, owned)
    names = _names(output)
    if not names:
        return OutputState("new")
    if MANIFEST not in names:  # without a manifest nothing there is known to be a job's own
        return OutputState("foreign", foreign=tuple(names))
    regex = re.compile(owned)
    foreign = tuple(n for n in names if n not in (MANIFEST, SUCCESS) and not regex.fullmatch(n))
    if foreign:
        return OutputState("foreign", foreign=foreign)
    if SUCCESS not in names:
        return OutputState("unfinished")
    return OutputState("finished", summary=read_summary(output))


def refuse_links(output: str, owned: str) -> None:
    """``ValueError`` naming the first symbolic link among ``output``'s entries that the job would open, write or
    delete: the lock, ``_manifest.json``, ``_SUCCESS`` and the names ``owned`` matches. Other links are the
    user's files (refused as foreign where it matters, never followed)."""
    if not os.path.isdir(output):
        return
    regex = re.compile(owned)
    for name in sorted(os.listdir(output)):
        if name in (LOCK, MANIFEST, SUCCESS) or regex.fullmatch(name):
            safe_paths.refuse_link(os.path.join(output, name))


def read_summary(output: str) -> dict[str, Any]:
    """``output/_SUCCESS`` as a dict: the finished job's summary, ``{}`` when it is missing or not a JSON object
    (an older or hand-made marker still marks the job finished; its numbers are then unknown)."""
    try:
        fd = safe_paths.open_no_follow(os.path.join(output, SUCCESS), os.O_RDONLY)
        with open(fd, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def refuse_occupied(
    output: str, state: OutputState, *, job: str, resume: bool, overwrite: bool, resume_hint: str = ""
) -> None:
    """Refuse (``ValueError``, naming the next command to type) an output that this call may not write into:
    an occupied one without ``--resume`` / ``--overwrite``, a foreign one, both flags at once. ``job`` names what
    the output holds ("scoring job", "sft run"); ``resume_hint`` adds to the unfinished case's advice."""
    if resume and overwrite:
        raise ValueError(
            f"{opt('resume', True)} and {opt('overwrite', True)} exclude each other: "
            f"{opt('resume', True)} continues the job in {opt('output')}, {opt('overwrite', True)} "
            "deletes it and starts again; pass one of them"
        )
    if state.kind == "new":
        return
    if state.kind == "foreign":
        shown = ", ".join(state.foreign[:3]) + (f" and {len(state.foreign) - 3} more" if len(state.foreign) > 3 else "")
        raise ValueError(
            f"{opt('output')} {output} holds files that are not a dask-lm {job}'s ({shown}); dask-lm "
            f"deletes nothing it did not write: choose a new {opt('output')}, or move those files away"
        )
    if resume or overwrite:
        return
    if state.kind == "finished":
        rows = (state.summary or {}).get("rows")
        done = f" ({rows:,} rows)" if isinstance(rows, int) and job == "scoring job" else ""
        raise ValueError(
            f"{opt('output')} {output} holds a finished dask-lm {job}{done}; pass {opt('resume', True)} "
            f"to keep it (returns its summary at once), {opt('overwrite', True)} to run again into it, "
            f"or choose a new {opt('output')}"
        )
    raise ValueError(
        f"{opt('output')} {output} holds an unfinished dask-lm {job} (no {SUCCESS}); pass "
        f"{opt('resume', True)} to finish it with the options {MANIFEST} pins{resume_hint}, "
        f"{opt('overwrite', True)} to discard it and start again with these options, or choose a new "
        f"{opt('output')}"
    )


def clear_output(output: str, owned: str) -> list[str]:
    """``--overwrite``: delete the job's own entries of ``output`` (``_SUCCESS`` first, the manifest last, so an
    interruption leaves a resumable unfinished output, never a finished-looking partial one). Call it under the
    lock, after :func:`refuse_occupied` made sure nothing foreign is there. Returns what was removed."""
    regex = re.compile(owned)
    names = [n for n in _names(output) if regex.fullmatch(n)]
    removed = []
    for name in [SUCCESS, *names, MANIFEST]:
        path = os.path.join(output, name)
        if safe_paths.remove(path):  # a link goes as a link: its target is not the job's
            removed.append(path)
    if removed:
        logger.info("--overwrite: removed %d entries of the earlier job in %s", len(removed), output)
    return removed


def remove_stale(output: str, pattern: str) -> list[str]:
    """Delete the entries of ``output`` whose names match ``pattern`` (files or directories): the temporaries of
    a killed job. Call it only while holding the lock. Returns what was removed."""
    regex = re.compile(pattern)
    removed = []
    for name in sorted(os.listdir(output)):
        if regex.fullmatch(name):
            path = os.path.join(output, name)
            safe_paths.remove(path)
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
                raise ValueError(
                    f"{opt('output')} {output} is where the input pattern {path!r} matches files: its "
                    f"own files would be read as input by the next run or {opt('resume', True)}; choose "
                    "an output directory the pattern does not reach"
                )
        elif os.path.isdir(path) and _within(out, os.path.realpath(path)):
            raise ValueError(
                f"{opt('output')} {output} is inside the input directory {path}: its own files would be "
                f"read as input by the next run or {opt('resume', True)}; choose an output directory "
                f"outside {path}"
            )
    for f in files:
        if _within(os.path.realpath(f), out):
            raise ValueError(
                f"input {f} is inside {opt('output')} {output}; keep inputs and outputs in separate directories"
            )


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
