"""``--resume``: a resumed call's spec completed from the manifest it resumes (:func:`spec_for`), and what differs
named (:func:`check_resume`).

A job's ``_manifest.json`` (:mod:`dask_lm.io.manifest`) pins its input files and model by content, the options its
results depend on (``options``: the spec's ``pinned`` fields, compared on resume), and records the ones that change no
written value (``settings``: ``--task-tokens``, ``--max-steps``, ..., not compared; a resume that gives one records
the new value). A job function takes ``None`` as "not given": on ``resume`` such an option takes the manifest's value,
and one that *is* given is kept, so the comparison refuses it, naming it, when it differs from the pinned one. What is
still not given then gets the spec's default. So ``dask-lm score --output scores/ --resume`` alone finishes a job,
while ``--resume --skip-bad-rows`` may still add the flag to a job that stopped at a bad row
(:func:`added_skip_bad_rows`). :meth:`dask_lm.jobs.output.JobOutput.precheck` compares a resume's options with the
manifest's before any cluster starts, :meth:`~dask_lm.jobs.output.JobOutput.pin` the files' content once hashed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

from dask_lm.interface import current, opt
from dask_lm.io.manifest import read_manifest
from dask_lm.io.parquet import MANIFEST
from dask_lm.jobs.spec import JobSpec

__all__ = ["spec_for", "added_skip_bad_rows", "check_resume"]

_S = TypeVar("_S", bound=JobSpec)


def spec_for(spec: type[_S], output: str | os.PathLike[str], *, resume: bool, given: Mapping[str, Any]) -> _S:
    """The job's ``spec`` from what the call ``given`` (``None``: not given), on ``resume`` completed from the
    manifest in ``output`` (:meth:`~dask_lm.jobs.spec.JobSpec.build`). ``ValueError`` when the inputs or the model
    are still missing: "nothing to resume" on a ``resume`` of a folder without a manifest."""
    path = os.path.abspath(os.fspath(output))
    manifest = read_manifest(path) if resume and os.path.isdir(path) else None
    values = spec.completed(given, manifest=manifest, manifest_path=os.path.join(path, MANIFEST))
    inputs = "the inputs" if current() == "cli" else "input"
    missing = [name for key, name in (("input", inputs), ("model", opt("model"))) if values.get(key) is None]
    if missing and resume and manifest is None:
        raise ValueError(
            f"{opt('resume', True)}: nothing to resume in {path}: it holds no {MANIFEST} (no dask-lm "
            f"{spec.JOB} was started there), so {' and '.join(missing)} cannot be taken from it; pass "
            f"the {opt('output')} of the job to resume, or give {inputs}, {opt('model')} and the options "
            "to start one"
        )
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} must be given (only {opt('resume', True)} takes them from the "
            f"{MANIFEST} of the job in {opt('output')})"
        )
    return spec(**values)


def added_skip_bad_rows(old: dict[str, Any] | None, skip_bad_rows: bool) -> bool:
    """``--skip-bad-rows`` added by a resume of a job that stopped at a bad row: allowed, as the parts written
    before hold every row of their row groups, which is what skipping would have written for them too."""
    return old is not None and skip_bad_rows and not (old.get("options") or {}).get("skip_bad_rows")


def check_resume(
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    output: str,
    what: str,
    ignore: tuple[str, ...] = (),
    flags: dict[str, str] | None = None,
) -> None:
    """Refuse (``ValueError``) to resume ``output`` when ``new`` pins anything else than ``old`` did.

    ``what`` completes "was ... with different ...", e.g. "scored" or "trained". Option keys in ``ignore`` are
    not compared (one not known yet, like an automatic precision before the cluster is up). ``flags`` maps an option
    key to the name users know it by (default: ``--key-with-dashes``)."""
    resume, overwrite, out_opt = opt("resume", True), opt("overwrite", True), opt("output")
    fix = (
        f"resume with the files and options {MANIFEST} pins, pass {overwrite} instead of {resume} to discard "
        f"what {output} holds and start again with these, or write into a new {out_opt}"
    )
    if old.get("format") != new.get("format"):
        raise ValueError(
            f"{resume} refused: {output} was {what} by dask-lm {old.get('dask_lm_version', '?')} "
            f"(manifest format {old.get('format', 1)}); this dask-lm writes format {new.get('format')}, "
            f"whose pins and results may differ; pass {overwrite} instead of {resume} to run it again "
            f"with this dask-lm, or write into a new {out_opt}"
        )
    diffs = _differences(old, new, ignore, flags or {})
    if diffs:
        kinds = list(dict.fromkeys(kind for kind, _ in diffs))
        raise ValueError(
            f"{resume} refused: {output} was {what} with different {', '.join(kinds)}: "
            f"{'; '.join(text for _, text in diffs)} (see {MANIFEST}); {fix}"
        )


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def _differences(
    old: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...], flags: dict[str, str]
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    # a model or tokenizer is pinned by its files' content: the same files copied elsewhere give the same results
    for key, label in (("model", "model"), ("tokenizer", "tokenizer")):
        files = _file_differences(f"{label} file", old.get(f"{key}_files"), new.get(f"{key}_files"), new.get(key) or "")
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
    if not inputs and (old.get("partitions"), old.get("partition_plan")) != (
        new.get("partitions"),
        new.get("partition_plan"),
    ):
        inputs.append(
            f"the rows were cut into parts another way ({old.get('partitions')} parts, now "
            f"{new.get('partitions')}: another {opt('task_tokens')}, or another dask-lm version)"
        )
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
            out.append(
                f"{label} {shown} changed: same size ({n['size']} bytes), different content (sha256 "
                f"{str(o.get('sha256'))[:12]}... -> {str(n.get('sha256'))[:12]}...)"
            )
    return out
