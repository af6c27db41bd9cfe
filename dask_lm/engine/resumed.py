"""``--resume`` without re-typing the job: what a resumed call is not given comes from the manifest it resumes.

A job's ``_manifest.json`` (:mod:`dask_lm.io.jobdir`) pins its input files, its model and the options its results
depend on (``options``, compared on resume), and records the ones that change no written value (``settings``:
``--task-tokens``, ``--max-steps``, ..., not compared; a resume that gives one records the new value). A job
function takes ``None`` as "not given": on ``resume`` such an option takes the manifest's value, and one that *is*
given is kept, so the job's own check (:func:`dask_lm.io.jobdir.check_resume`) refuses it, naming it, when it
differs from the pinned one. What is still ``None`` then gets the function's default. So
``dask-lm score --output scores/ --resume`` alone finishes a job, while ``--resume --skip-bad-rows`` may still add
the flag to a job that stopped at a bad row (:func:`added_skip_bad_rows`). :func:`precheck` compares a resume's
options with the manifest's before any cluster starts.
"""

from __future__ import annotations

import os
from typing import Any

from dask_lm.engine import jobs
from dask_lm.interface import current, opt
from dask_lm.io import jobdir
from dask_lm.io.parquet import MANIFEST

__all__ = ["fill", "precheck", "added_skip_bad_rows"]

# the columns that say how rows are read: one way only, so a resume that names one takes none of the others from
# the manifest (a job read by --ids-column resumed with --text-column is refused naming both, not given both)
_MODE_COLUMNS = ("text_column", "ids_column", "prompt_column", "response_column")


def fill(output: str | os.PathLike[str], *, resume: bool, given: dict[str, Any], defaults: dict[str, Any],
         job: str) -> dict[str, Any]:
    """``given`` (a job function's arguments, ``None`` where not given: ``input``, ``model``, options) completed:
    on ``resume`` from the manifest in ``output``, then from ``defaults``. ``ValueError`` when the inputs or the
    model are still missing: "nothing to resume" on a ``resume`` of a folder without a manifest. ``job`` names
    what the folder would hold ("scoring job", "sft run"). Returns ``given``'s keys, in its order."""
    assert set(defaults) <= set(given), "a default for an argument not given"
    values = dict(given)
    path = os.path.abspath(os.fspath(output))
    manifest = jobdir.read_manifest(path) if resume and os.path.isdir(path) else None
    if manifest is not None:
        pinned = {**(manifest.get("settings") or {}), **(manifest.get("options") or {})}
        if values.get("input") is None:
            values["input"] = [e["path"] for e in manifest.get("inputs") or [] if isinstance(e, dict)] or None
        if values.get("model") is None:
            values["model"] = manifest.get("model")
        # the tokenizer is recorded even where it is the model's own: taken only when it was a separate one
        if "tokenizer" in values and values["tokenizer"] is None and manifest.get("tokenizer") != manifest.get("model"):
            values["tokenizer"] = manifest.get("tokenizer")
        mode_given = any(values.get(k) is not None for k in _MODE_COLUMNS)
        for key, value in values.items():
            if value is None and key in pinned and not (mode_given and key in _MODE_COLUMNS):
                values[key] = _typed(pinned[key], key, defaults.get(key), os.path.join(path, MANIFEST))
    inputs = "the inputs" if current() == "cli" else "input"
    missing = [name for key, name in (("input", inputs), ("model", opt("model"))) if values.get(key) is None]
    if missing and resume and manifest is None:
        raise ValueError(f"{opt('resume', True)}: nothing to resume in {path}: it holds no {MANIFEST} (no dask-lm "
                         f"{job} was started there), so {' and '.join(missing)} cannot be taken from it; pass the "
                         f"{opt('output')} of the job to resume, or give {inputs}, {opt('model')} and the options to "
                         "start one")
    if missing:
        raise ValueError(f"{' and '.join(missing)} must be given (only {opt('resume', True)} takes them from the "
                         f"{MANIFEST} of the job in {opt('output')})")
    for key, default in defaults.items():
        if values.get(key) is None:
            values[key] = default
    return values


def _typed(value: Any, key: str, default: Any, path: str) -> Any:
    """``value``, a manifest's ``key``, when it has the type of the option's ``default`` (where there is one):
    ``ValueError`` naming the key and the manifest else, not a ``TypeError`` deep in the job."""
    if value is None or default is None or type(value) is type(default) or (
            isinstance(default, float) and type(value) is int):
        return value
    raise ValueError(f'{path}: "{key}" holds {value!r}, a {type(value).__name__}, where the option takes a '
                     f"{type(default).__name__}; put back what dask-lm wrote there, or pass {opt('overwrite', True)} "
                     "to start again")


def added_skip_bad_rows(old: dict[str, Any] | None, skip_bad_rows: bool) -> bool:
    """``--skip-bad-rows`` added by a resume of a job that stopped at a bad row: allowed, as the parts written
    before hold every row of their row groups, which is what skipping would have written for them too."""
    return old is not None and skip_bad_rows and not (old.get("options") or {}).get("skip_bad_rows")


def precheck(out: jobs.JobOutput, probe: dict[str, Any], *, skip_bad_rows: bool) -> None:
    """A resume's options (and a job's own entries, such as a scoring job's plan) in ``probe`` against the
    manifest it resumes, before any cluster starts (the files' content is compared once hashed, by
    :meth:`~dask_lm.engine.jobs.JobOutput.pin`)."""
    old = jobdir.read_manifest(out.path)
    if old is None:
        return
    # the input files by path and size (their content is hashed later): a file added to an input folder is named,
    # not reported as rows "cut into parts another way"
    pinned = {e.get("path"): e for e in old.get("inputs") or [] if isinstance(e, dict)}
    sizes = {f: os.path.getsize(f) for f in out.files}
    inputs = [{"path": f, "size": size, "sha256": pinned[f].get("sha256") if pinned.get(f, {}).get("size") == size
               else None} for f, size in sizes.items()]
    probe = {**old, "inputs": inputs, **probe}
    ignore: tuple[str, ...] = ("skip_bad_rows",) if added_skip_bad_rows(old, skip_bad_rows) else ()
    if None in ((old.get("options") or {}).get("precision"), probe["options"].get("precision")):
        ignore += ("precision",)
    jobdir.check_resume(old, probe, output=out.path, what=out.kind.did, ignore=ignore, flags=out.kind.flags)
