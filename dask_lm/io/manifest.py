"""A job's ``_manifest.json``: its format, its seal and the types of its entries.

The manifest pins what a job's results depend on: the model files, the input files (path, size, SHA-256: see
:mod:`dask_lm.io.fingerprint`) and the options; ``--resume`` compares a run against it
(:func:`dask_lm.jobs.resume.check_resume`). A manifest that is not a JSON object, or whose entry has the wrong type,
is an error naming its path (and the entry). It is sealed (:func:`sealed`): a digest of each entry as dask-lm wrote
it, so a hand edit (``"topk": 3`` in an unfinished job's manifest, then a bare ``--resume``) is refused naming the
edited entry instead of resuming into parts computed two ways. The output folder around it, and its lock, are
:mod:`dask_lm.jobs.folder`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from dask_lm.interface import opt
from dask_lm.io import safe_paths
from dask_lm.io.parquet import MANIFEST

__all__ = ["FORMAT", "SEAL", "read_manifest", "sealed"]

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
    "format": int,
    "dask_lm_version": str,
    "model": str,
    "tokenizer": str,
    "options": dict,
    "settings": dict,
    "model_source": dict,
    "partitions": int,
    "partition_plan": str,
    "inputs": list,
    "model_files": list,
    "tokenizer_files": list,
    SEAL: dict,
}
_FILE_LISTS = ("inputs", "model_files", "tokenizer_files")


def read_manifest(output: str) -> dict[str, Any] | None:
    """``output/_manifest.json`` as a dict, ``None`` when there is none; ``ValueError`` naming it when damaged."""
    path = os.path.join(output, MANIFEST)
    if not os.path.lexists(path):
        return None
    fix = (
        f"it is not a dask-lm manifest, so what {output} holds cannot be checked: move {output} aside (or delete "
        f"it) and run again, or choose another {opt('output')}"
    )
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
    fix = (
        f"a manifest pins what the job's parts were computed with, and one edited by hand would resume into an "
        f"output computed two ways: put back what dask-lm wrote, pass {opt('overwrite', True)} (instead of "
        f"{opt('resume', True)}) to start again with the options you want, or write into a new {opt('output')}"
    )
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
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("path"), str)
                and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), (str, type(None)))
            ):
                raise wrong(key, entry, 'a file entry ({"path": ..., "size": ..., "sha256": ...})')
    for section in ("options", "settings"):
        for key, value in (manifest.get(section) or {}).items():
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise wrong(f"{section}.{key}", value, "a string, a number, true, false or null")
