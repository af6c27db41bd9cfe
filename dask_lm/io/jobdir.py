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
  them changed; a manifest that is not a JSON object, or whose entry has the wrong type, is an error naming its
  path (and the entry). It is sealed (:func:`sealed`): a digest of each entry as dask-lm wrote it, so a hand edit
  (``"topk": 3`` in an unfinished job's manifest, then a bare ``--resume``) is refused naming the edited entry
  instead of resuming into parts computed two ways.
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
import hashlib
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from dask_lm.interface import current, opt
from dask_lm.io import safe_paths
from dask_lm.io.parquet import MANIFEST, SUCCESS

__all__ = ["FORMAT", "LOCK", "OutputState", "output_state", "read_summary", "refuse_occupied", "clear_output",
           "locked_output", "read_manifest", "refuse_links", "sealed", "check_resume", "remove_stale",
           "check_output_location"]

logger = logging.getLogger("dask_lm")

LOCK = ".dask-lm.lock"
# What a manifest's pins mean. Bump it when the manifest's layout changes, or when a dask-lm change alters the
# results written for the same model files, input files and options (numbers, schema): --resume then refuses an
# output started by the older code instead of mixing the two. ``dask_lm_version`` is recorded for people but not
# compared: most releases do not change results, and refusing every resume across an upgrade would strand
# long jobs for nothing. Format 1 (no key) pinned files by size and a partial hash; format 3 added the scoring
# column prompt_tokens (a format-2 output resumed by this code would mix parts with and without it); format 4 the
# column is_greedy, the lm-evaluation-harness tokenization of prompt + response (the manifest's option
# "convention") and ids mode's prompt-length column; format 5 the manifest's seal (:func:`sealed`) and each part's
# proof in its footer (:mod:`dask_lm.io.part_proof`), without which a format-5 resume keeps no part.
FORMAT = 5
SEAL = "seal"
# the manifest's entries and their JSON types, checked before any is used (a hand-made manifest of an older format
# has no seal to say it was edited); an entry that lists files holds objects with a path, a size and a SHA-256
_TYPES: dict[str, type] = {
    "format": int, "dask_lm_version": str, "model": str, "tokenizer": str, "options": dict, "settings": dict,
    "model_source": dict, "partitions": int, "partition_plan": str, "inputs": list, "model_files": list,
    "tokenizer_files": list, SEAL: dict}
_FILE_LISTS = ("inputs", "model_files", "tokenizer_files")


@contextlib.contextmanager
def locked_output(output: str) -> Iterator[str]:
    """Create ``output`` if needed and hold its job lock until the block ends; ``ValueError`` when another job
    holds it. Yields the lock file's path."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"{opt('output')} {output!r} exists and is not a directory")
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, LOCK)
    # never through a link: the pid line below would truncate and overwrite its target
    fd = safe_paths.open_no_follow(path, os.O_RDWR | os.O_CREAT)  # not inherited by exec'd children (PEP 446)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): a second job writing %s at the same time would not be "
                               "noticed", path, e, output)
            else:
                raise _in_use(output, fd) from None
        except ImportError:  # no fcntl (Windows): nothing to lock with
            logger.warning("no fcntl on this platform: concurrent jobs on %s are not detected", output)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _in_use(output: str, fd: int) -> ValueError:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
    return ValueError(f"{opt('output')} {output} is in use by another dask-lm job ({holder} holds {LOCK}); wait for "
                      f"it to finish, or choose another {opt('output')}")


def refuse_if_locked(output: str) -> None:
    """``ValueError`` now if another job holds ``output``'s lock: a probe that creates and writes nothing, for
    the cheap checks before a job starts anything (:func:`locked_output` takes the lock later, and decides)."""
    path = os.path.join(output, LOCK)
    try:
        fd = safe_paths.open_no_follow(path, os.O_RDWR)
    except OSError:  # no lock file, or none we may open: locked_output will say
        return
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _in_use(output, fd) from None
    except ImportError:
        pass
    finally:
        os.close(fd)


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


def refuse_occupied(output: str, state: OutputState, *, job: str, resume: bool, overwrite: bool,
                    resume_hint: str = "") -> None:
    """Refuse (``ValueError``, naming the next command to type) an output that this call may not write into:
    an occupied one without ``--resume`` / ``--overwrite``, a foreign one, both flags at once. ``job`` names what
    the output holds ("scoring job", "sft run"); ``resume_hint`` adds to the unfinished case's advice."""
    if resume and overwrite:
        raise ValueError(f"{opt('resume', True)} and {opt('overwrite', True)} exclude each other: "
                         f"{opt('resume', True)} continues the job in {opt('output')}, {opt('overwrite', True)} "
                         "deletes it and starts again; pass one of them")
    if state.kind == "new":
        return
    if state.kind == "foreign":
        shown = ", ".join(state.foreign[:3]) + (f" and {len(state.foreign) - 3} more" if len(state.foreign) > 3 else "")
        raise ValueError(f"{opt('output')} {output} holds files that are not a dask-lm {job}'s ({shown}); dask-lm "
                         f"deletes nothing it did not write: choose a new {opt('output')}, or move those files away")
    if resume or overwrite:
        return
    if state.kind == "finished":
        rows = (state.summary or {}).get("rows")
        done = f" ({rows:,} rows)" if isinstance(rows, int) and job == "scoring job" else ""
        raise ValueError(f"{opt('output')} {output} holds a finished dask-lm {job}{done}; pass {opt('resume', True)} "
                         f"to keep it (returns its summary at once), {opt('overwrite', True)} to run again into it, "
                         f"or choose a new {opt('output')}")
    raise ValueError(f"{opt('output')} {output} holds an unfinished dask-lm {job} (no {SUCCESS}); pass "
                     f"{opt('resume', True)} to finish it with the options {MANIFEST} pins{resume_hint}, "
                     f"{opt('overwrite', True)} to discard it and start again with these options, or choose a new "
                     f"{opt('output')}")


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


def read_manifest(output: str) -> dict[str, Any] | None:
    """``output/_manifest.json`` as a dict, ``None`` when there is none; ``ValueError`` naming it when damaged."""
    path = os.path.join(output, MANIFEST)
    if not os.path.lexists(path):
        return None
    fix = (f"it is not a dask-lm manifest, so what {output} holds cannot be checked: move {output} aside (or delete "
           f"it) and run again, or choose another {opt('output')}")
    try:
        fd = safe_paths.open_no_follow(path, os.O_RDONLY)  # a link: refused (a ValueError), naming it
        with open(fd, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; {fix}")
    if isinstance(obj.get("format"), int) and obj["format"] >= 5:  # sealed since format 5
        _check_seal(obj, path)
    _check_types(obj, path, fix)
    return obj


def _digests(manifest: dict[str, Any]) -> dict[str, str]:
    """A short SHA-256 of each entry of ``manifest`` as JSON (each option, setting and model-source field apart,
    so that an edit is named by its key), the seal itself aside."""
    out = {}
    for key, value in manifest.items():
        if key == SEAL:
            continue
        if isinstance(value, dict) and key in ("options", "settings", "model_source"):
            out.update({f"{key}.{k}": _digest(v) for k, v in value.items()})
            out[key] = _digest(sorted(value))
        else:
            out[key] = _digest(value)
    return out


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its seal: the digest of each entry (:func:`_digests`), taken of what the JSON file will
    hold. The seal is a check against edits and damage, not a signature: whoever recomputes it can forge it, which
    no one does by accident."""
    plain = json.loads(json.dumps({k: v for k, v in manifest.items() if k != SEAL}, default=str))
    return {**plain, SEAL: _digests(plain)}


def _check_seal(manifest: dict[str, Any], path: str) -> None:
    seal = manifest.get(SEAL)
    fix = (f"a manifest pins what the job's parts were computed with, and one edited by hand would resume into an "
           f"output computed two ways: put back what dask-lm wrote, pass {opt('overwrite', True)} (instead of "
           f"{opt('resume', True)}) to start again with the options you want, or write into a new {opt('output')}")
    if not isinstance(seal, dict):
        raise ValueError(f'{path} was edited: its "{SEAL}" is missing or not an object; {fix}')
    now = _digests(manifest)
    for key in [k for k in seal if k not in now] + [k for k in now if k not in seal] + sorted(now):
        if seal.get(key) == now.get(key):
            continue
        section, _, name = key.rpartition(".")
        where = f'"{name}" (in "{section}")' if section else f'"{name}"'
        if key not in now or key not in seal:
            what = "was removed" if key not in now else "was added"
        else:
            value = manifest[section][name] if section else manifest[name]
            what = f"is {json.dumps(value, default=str)[:80]}, not what dask-lm wrote"
        raise ValueError(f"{path} was edited: {where} {what}; {fix}")


def _check_types(manifest: dict[str, Any], path: str, fix: str) -> None:
    """Each known entry of ``manifest`` of its JSON type (:data:`_TYPES`), each option a JSON scalar: a
    ``ValueError`` naming the entry and ``path`` else (the job would fail on it later with a ``TypeError``)."""
    def wrong(key: str, value: Any, want: str) -> ValueError:
        return ValueError(f'{path}: "{key}" holds {json.dumps(value, default=str)[:80]}, which is not {want}; {fix}')

    names: dict[type, str] = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
    for key, want in _TYPES.items():
        value = manifest.get(key)
        if key in manifest and value is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise wrong(key, value, names.get(want, want.__name__))
    for key in _FILE_LISTS:
        for entry in manifest.get(key) or []:
            if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                    and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), (str, type(None)))):
                raise wrong(key, entry, 'a file entry ({"path": ..., "size": ..., "sha256": ...})')
    for section in ("options", "settings"):
        for key, value in (manifest.get(section) or {}).items():
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise wrong(f"{section}.{key}", value, "a string, a number, true, false or null")


def check_resume(old: dict[str, Any], new: dict[str, Any], *, output: str, what: str, ignore: tuple[str, ...] = (),
                 flags: dict[str, str] | None = None) -> None:
    """Refuse (``ValueError``) to resume ``output`` when ``new`` pins anything else than ``old`` did.

    ``what`` completes "was ... with different ...", e.g. "scored" or "trained". Option keys in ``ignore`` are
    not compared (one not known yet, like an automatic precision before the cluster is up). ``flags`` maps an option
    key to the name users know it by (default: ``--key-with-dashes``)."""
    resume, overwrite, out_opt = opt("resume", True), opt("overwrite", True), opt("output")
    fix = (f"resume with the files and options {MANIFEST} pins, pass {overwrite} instead of {resume} to discard "
           f"what {output} holds and start again with these, or write into a new {out_opt}")
    if old.get("format") != new.get("format"):
        raise ValueError(f"{resume} refused: {output} was {what} by dask-lm {old.get('dask_lm_version', '?')} "
                         f"(manifest format {old.get('format', 1)}); this dask-lm writes format {new.get('format')}, "
                         f"whose pins and results may differ; pass {overwrite} instead of {resume} to run it again "
                         f"with this dask-lm, or write into a new {out_opt}")
    diffs = _differences(old, new, ignore, flags or {})
    if diffs:
        kinds = list(dict.fromkeys(kind for kind, _ in diffs))
        raise ValueError(f"{resume} refused: {output} was {what} with different {', '.join(kinds)}: "
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
            files.insert(0, f"{opt(key)} was {_show(old.get(key))}, now {_show(new.get(key))}")
        out += [(label, text) for text in files]
    old_opts, new_opts = old.get("options") or {}, new.get("options") or {}
    for key in sorted(set(old_opts) | set(new_opts)):
        if key not in ignore and old_opts.get(key) != new_opts.get(key):
            flag = flags.get(key) if key in flags and current() == "cli" else opt(key)
            out.append(("options", f"{flag} was {_show(old_opts.get(key))}, now {_show(new_opts.get(key))}"))
    inputs = _file_differences("input file", old.get("inputs"), new.get("inputs"), "")
    old_paths = [e.get("path") for e in old.get("inputs") or []]
    new_paths = [e.get("path") for e in new.get("inputs") or []]
    if not inputs and old_paths != new_paths:
        inputs.append("the same input files in another order (parts are numbered in input order)")
    if not inputs and (old.get("partitions"), old.get("partition_plan")) != (new.get("partitions"),
                                                                             new.get("partition_plan")):
        inputs.append(f"the rows were cut into parts another way ({old.get('partitions')} parts, now "
                      f"{new.get('partitions')}: another {opt('task_tokens')}, or another dask-lm version)")
    out += [("inputs", text) for text in inputs]
    return out


def _file_differences(label: str, old: Any, new: Any, root: str) -> list[str]:
    old_by = {e.get("path"): e for e in old or [] if isinstance(e, dict)}
    new_by = {e.get("path"): e for e in new or [] if isinstance(e, dict)}
    out = []
    for path in sorted(set(old_by) | set(new_by), key=str):
        shown = os.path.join(root, str(path)) if root else path
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
                raise ValueError(f"{opt('output')} {output} is where the input pattern {path!r} matches files: its "
                                 f"own files would be read as input by the next run or {opt('resume', True)}; choose "
                                 "an output directory the pattern does not reach")
        elif os.path.isdir(path) and _within(out, os.path.realpath(path)):
            raise ValueError(f"{opt('output')} {output} is inside the input directory {path}: its own files would be "
                             f"read as input by the next run or {opt('resume', True)}; choose an output directory "
                             f"outside {path}")
    for f in files:
        if _within(os.path.realpath(f), out):
            raise ValueError(f"input {f} is inside {opt('output')} {output}; keep inputs and outputs in separate "
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
