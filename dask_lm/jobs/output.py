"""A job's output folder, from the first look at it to ``_SUCCESS``: :class:`JobOutput`, for each kind of job
(:class:`JobKind`).
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dask_lm.interface import opt
from dask_lm.io import fingerprint
from dask_lm.io import parquet as pio
from dask_lm.io.manifest import read_manifest, sealed
from dask_lm.jobs import folder
from dask_lm.jobs.resume import added_skip_bad_rows, check_resume
from dask_lm.jobs.spec import SHORT_PRECISION

__all__ = ["JobKind", "JobOutput"]


@dataclass(frozen=True)
class JobKind:
    """What the scaffold needs to know of one kind of job."""

    name: str
    """What an output holds, in messages: "scoring job", "sft run"."""
    did: str
    """Completes "--resume refused: OUTPUT was ... with different ...": "scored", "trained"."""
    owned: str
    """A regular expression for the job's own entries besides ``_manifest.json`` and ``_SUCCESS`` (what
    ``--overwrite`` may delete)."""
    debris: Callable[[str], Any]
    """Deletes, from the output, the temporaries a killed job left (called under the lock: nothing writes them)."""
    resume_hint: Callable[[], str] = str
    """Added to the advice for an unfinished output (rendered when refused: it may name an option)."""
    flags: dict[str, str] = field(default_factory=dict)
    """Option keys to the names users know them by, where not ``--key-with-dashes``."""


@dataclass
class JobOutput:
    """A job's output folder, from the first look at it to ``_SUCCESS``."""

    kind: JobKind
    path: str
    files: list[str]
    """The input files, resolved."""
    resume: bool
    overwrite: bool
    state: folder.OutputState
    pins: list[fingerprint.Pin] = field(default_factory=list)
    """What :meth:`pin` pinned: :meth:`finish` confirms every file still holds it."""
    created: bool = False
    """The output folder did not exist before this job: an interrupted job that kept nothing removes it."""
    settings: dict[str, Any] | None = None
    """How the job runs without changing what it writes (``--task-tokens``, ``--max-steps``, ...): recorded in the
    manifest by :meth:`pin`, not compared; what a later resume that is not given them takes
    (:mod:`dask_lm.jobs.resume`)."""

    lock: folder.OutputLock | None = field(default=None, repr=False)
    """The output's lock, taken by :meth:`open` and held until :meth:`close` (or the end of :meth:`locked`)."""

    @classmethod
    def open(
        cls, kind: JobKind, input: Any, output: str | os.PathLike[str], *, resume: bool, overwrite: bool
    ) -> JobOutput:
        """Resolve the inputs, take the output's lock (the first thing the job creates: a second job on the same
        output is refused here, before the model is looked at or a cluster starts) and look at the output: what
        the folder allows needs only its listing, so a refusal comes before the model is looked at. The caller
        holds the lock until :meth:`close` (:meth:`locked` ends it too); a refusal here releases it, leaving
        nothing behind."""
        path = os.path.abspath(os.fspath(output))
        files = pio.resolve_input_files(input)
        folder.check_output_location(path, input, files)  # before the lock creates the folder
        folder.refuse_links(path, kind.owned)  # the lock's own name too: never opened through a link
        lock = folder.OutputLock(path)
        lock.acquire()
        try:
            out = cls(
                kind,
                path,
                files,
                resume,
                overwrite,
                folder.output_state(path, kind.owned),
                created=lock.created_dir,
                lock=lock,
            )
            # a safety net for a caller that drops it unclosed: the lock goes with the object
            weakref.finalize(out, lock.release)
            out._refuse_occupied()
        except BaseException:
            lock.release(remove=True)
            raise
        return out

    def close(self) -> None:
        """Release the output's lock, if still held; where the job wrote nothing (no manifest: refused, or stopped
        before it pinned anything), the lock file and the folder go too, where this job created them."""
        if self.lock is not None:
            self.lock.release(remove=not os.path.lexists(os.path.join(self.path, pio.MANIFEST)))

    def _refuse_occupied(self) -> None:
        folder.refuse_occupied(
            self.path,
            self.state,
            job=self.kind.name,
            resume=self.resume,
            overwrite=self.overwrite,
            resume_hint=self.kind.resume_hint(),
        )

    @property
    def finished(self) -> bool:
        return os.path.exists(os.path.join(self.path, pio.SUCCESS))

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any] | None]:
        """Hold the output's lock for the block (taken by :meth:`open`; again here where it was released), and
        release it when the block ends; yields the manifest of the job to resume, or ``None`` for a new output (an
        ``--overwrite`` one is emptied of the earlier job's files first)."""
        if self.lock is None or not self.lock.held:
            self.lock = folder.OutputLock(self.path)
            self.lock.acquire()
        try:
            self.state = folder.output_state(self.path, self.kind.owned)
            self._refuse_occupied()
            old = None
            if self.state.kind != "new" and self.overwrite:
                folder.clear_output(self.path, self.kind.owned)
            elif self.state.kind != "new":
                old = read_manifest(self.path)
                assert old is not None  # output_state calls an output without one foreign
            self.kind.debris(self.path)
            try:
                yield old
            except KeyboardInterrupt:
                if old is None and not self.kept():  # a new job stopped before it kept anything: as if never run
                    folder.clear_output(self.path, self.kind.owned)  # its manifest too: close() removes the rest
                raise
        finally:
            self.close()

    def kept(self) -> list[str]:
        """The job's own results in the output: its entries that are not empty folders (parts, checkpoints)."""
        regex = re.compile(self.kind.owned)
        names = [n for n in os.listdir(self.path) if regex.fullmatch(n)] if os.path.isdir(self.path) else []
        return sorted(
            n
            for n in names
            if not (os.path.isdir(os.path.join(self.path, n)) and not os.listdir(os.path.join(self.path, n)))
        )

    def precheck(self, probe: dict[str, Any], *, skip_bad_rows: bool) -> None:
        """A resume's options (and a job's own entries, such as a scoring job's plan) in ``probe`` against the
        manifest it resumes, before any cluster starts (the files' content is compared once hashed, by
        :meth:`pin`)."""
        old = read_manifest(self.path)
        if old is None:
            return
        # the input files by path and size (their content is hashed later): a file added to an input folder is
        # named, not reported as rows "cut into parts another way"
        pinned = {e.get("path"): e for e in old.get("inputs") or [] if isinstance(e, dict)}
        sizes = {f: os.path.getsize(f) for f in self.files}
        inputs = [
            {
                "path": f,
                "size": size,
                "sha256": pinned[f].get("sha256") if pinned.get(f, {}).get("size") == size else None,
            }
            for f, size in sizes.items()
        ]
        probe = {**old, "inputs": inputs, **probe}
        ignore: tuple[str, ...] = ("skip_bad_rows",) if added_skip_bad_rows(old, skip_bad_rows) else ()
        if None in ((old.get("options") or {}).get("precision"), probe["options"].get("precision")):
            ignore += ("precision",)
        check_resume(old, probe, output=self.path, what=self.kind.did, ignore=ignore, flags=self.kind.flags)

    def pin(
        self,
        new: dict[str, Any],
        old: dict[str, Any] | None,
        pins: list[fingerprint.Pin],
        *,
        ignore: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Under the lock: write the manifest of a new output, or refuse (``ValueError``) to resume one whose
        pins differ from ``new`` (options in ``ignore`` aside). Returns the manifest in force. A precision that
        one side leaves automatic (``None``) is compared by :meth:`pin_precision` once the workers are known.
        ``pins`` are the files behind ``new`` as this run hashed them (equal to ``old``'s when it resumes).
        :attr:`settings` are recorded, a resume's replacing the old ones (another ``--max-steps``, for the next)."""
        self.pins = pins
        if self.settings is not None:
            new = {**new, "settings": self.settings}
        if old is None:
            self.write_manifest(new)
            return new
        if None in ((old.get("options") or {}).get("precision"), new["options"].get("precision")):
            ignore += ("precision",)
        check_resume(old, new, output=self.path, what=self.kind.did, ignore=ignore, flags=self.kind.flags)
        if "settings" in new and new["settings"] != old.get("settings"):
            old = {**old, "settings": new["settings"]}
            self.write_manifest(old)
        return old

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write ``manifest``, sealed (:func:`~dask_lm.io.manifest.sealed`: a later hand edit is refused)."""
        pio.write_json_atomic(sealed(manifest), os.path.join(self.path, pio.MANIFEST))

    def pin_precision(self, precision: str) -> None:
        """Record the precision the job runs in (an automatic one is known only once the cluster is up), or refuse
        a resume that would continue the job in another one (bf16 on GPUs resumed on CPUs in fp32, say)."""
        pinned = read_manifest(self.path)
        assert pinned is not None, "pin_precision comes after pin"
        was = pinned["options"].get("precision")
        if was is None:
            pinned["options"]["precision"] = precision
            self.write_manifest(pinned)
        elif was != precision:
            short = SHORT_PRECISION.get(was, was)
            raise ValueError(
                f"{opt('resume', True)} refused: {self.path} was {self.kind.did} in {was}, and these "
                f"workers would run in {precision} ({opt('precision')} was {was}, now {precision}); "
                f"resume on workers like the first run's or pass {opt('precision', short)}, "
                f"or write into a new {opt('output')}"
            )

    def reopen(self) -> None:
        """The job goes on (a resumed run given more steps): its output is no longer finished."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, pio.SUCCESS))

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``_SUCCESS`` (the job's summary): last, as it marks the output complete, and only once every
        pinned file (inputs, model, tokenizer) is confirmed to hold what the job pinned
        (:func:`~dask_lm.io.fingerprint.confirm_unchanged`: :class:`~dask_lm.errors.InputChangedError` else)."""
        fingerprint.confirm_unchanged(self.pins)
        pio.write_json_atomic(summary, os.path.join(self.path, pio.SUCCESS))
