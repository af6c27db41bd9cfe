"""What a scoring part proves about itself: whose job wrote it, which input rows it holds, and that its bytes are
the ones written.

``--resume`` skips the parts an output already holds, and ``_SUCCESS`` vouches for every one of them, so a part may
not be trusted by its name: a part copied in from another job, a symbolic link, or a part with flipped bytes would
otherwise end under ``_SUCCESS`` with rows missing, foreign or unreadable. Each part therefore carries, in its own
parquet footer (key-value metadata :data:`KEY`), a :class:`PartProof`:

- ``identity``: a digest of what the job's manifest pins (:func:`job_identity`: model and input files by content,
  the options, the span plan), so a part of another job, or of another cut of the same rows, is known as such;
- ``part`` and the span (``file``, ``first_row``, ``num_rows``: which input rows it covers), ``rows`` (written) and
  ``bad_rows`` (left out with ``--skip-bad-rows``), which must add up to the span;
- ``data_sha256``: the SHA-256 of the file's bytes before its footer (every data and dictionary page).

Why this checksum. A parquet footer cannot hold a digest of a file that contains it, but it can hold one of the
bytes *before* it, which are all the pages: that is what :func:`write` records, by writing the file with a
placeholder of the digest's length and putting the digest in its place once the pages are on disk (the same number
of bytes in the footer's thrift encoding, so nothing else moves). The alternatives cost more or prove less: page
CRCs (``write_page_checksum``) are verified only by decoding every page, and a digest kept beside the part (in a
sidecar or the manifest) is lost for the parts a killed job wrote but never reported. Checking a part costs its
footer plus one sequential read of its pages (about 1 GB/s on one core): :func:`check` does it once for the parts
a ``--resume`` keeps, and the check before ``_SUCCESS`` re-reads only the parts whose :class:`~dask_lm.io.
fingerprint.Stamp` moved since they were checked or written (:func:`confirm`). The footer itself is not covered by
the digest; what in it decides what a reader gets (the row count, the column names and the output columns' types)
is compared with what the job writes, and the rest of it must parse.

A part that fails is either the job's own (its footer carries the job's identity: a damaged or misplaced copy of
what this job wrote), which the job deletes and scores again, or not provably the job's (another job's identity, no
proof, an unreadable footer, a symbolic link, not a regular file): that may be someone's data, so the job refuses,
naming the part and the fix, and deletes nothing (:class:`NotOurs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from dask_lm.io import safe_paths
from dask_lm.io.fingerprint import Stamp

__all__ = [
    "KEY",
    "PartProof",
    "NotOurs",
    "Damaged",
    "job_identity",
    "write",
    "data_sha256",
    "read_proof",
    "check",
    "confirm",
]

KEY = "dask_lm.part"
_DIGEST_LEN = 64  # hex SHA-256
_BLOCK = 8 << 20
# the manifest entries that say what a part's values depend on; the rest are records (version, how the model was
# named), settings that change no value, the seal of the manifest itself, and skip_bad_rows, which a resume may
# add: the parts written before it hold every row of their spans, as the ones written after hold the good ones
_RECORDS = ("dask_lm_version", "model", "tokenizer", "model_source", "settings", "seal")


@dataclass(frozen=True)
class PartProof:
    """The footer record of one part (see the module docstring)."""

    identity: str
    part: int
    file: str
    first_row: int
    num_rows: int
    rows: int
    bad_rows: int
    data_sha256: str = ""

    def span(self) -> tuple[str, int, int]:
        return self.file, self.first_row, self.num_rows


class NotOurs(ValueError):
    """A part the job cannot prove it wrote: it refuses to trust it and will not delete it."""


class Damaged(Exception):
    """A part the job wrote (its identity) that no longer proves its rows: deleted and scored again."""


def job_identity(manifest: dict[str, Any]) -> str:
    """The digest of what a job's parts depend on: its manifest less records and settings (see :data:`_RECORDS`).
    Computed from the manifest in force, so a resume (on another host, with the model elsewhere) agrees."""
    pinned = {k: v for k, v in manifest.items() if k not in _RECORDS}
    pinned["options"] = {k: v for k, v in (manifest.get("options") or {}).items() if k != "skip_bad_rows"}
    text = json.dumps(pinned, sort_keys=True, separators=(",", ":"), default=str)
    return "job-v1:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def write(table: pa.Table, sink: IO[bytes], proof: PartProof) -> None:
    """Write ``table`` to ``sink`` (a new file opened for reading and writing, e.g.
    :func:`dask_lm.io.safe_paths.create_new`) with ``proof`` (its ``data_sha256`` filled in here) in the footer."""
    placeholder = uuid.uuid4().hex * 2  # 64 random hex digits: found once in the footer, nowhere else
    record = json.dumps({**asdict(proof), "data_sha256": placeholder}, sort_keys=True)
    with pq.ParquetWriter(sink, table.schema) as writer:  # a file object it is given stays open
        writer.write_table(table)
        writer.add_key_value_metadata({KEY: record})
    sink.flush()
    start, footer = _footer(sink)
    digest = _digest(sink, start)
    at = footer.find(placeholder.encode())
    assert at >= 0 and footer.find(placeholder.encode(), at + 1) < 0, "the proof's placeholder is not unique"
    sink.seek(start + at)
    sink.write(digest.encode())
    sink.flush()


def _footer(f: Any) -> tuple[int, bytes]:
    """(where the footer starts, its bytes) of the open parquet file ``f``; ``ValueError`` when it has none."""
    size = f.seek(0, os.SEEK_END)
    if size < 12:
        raise ValueError(f"{size} bytes: too short for parquet")
    f.seek(size - 8)
    tail = f.read(8)
    if tail[4:] != b"PAR1":
        raise ValueError("no parquet footer at its end")
    (length,) = struct.unpack("<I", tail[:4])
    start = size - 8 - length
    if start < 4:
        raise ValueError("its footer's length is out of range")
    f.seek(start)
    return start, f.read(length)


def _digest(f: Any, end: int) -> str:
    h = hashlib.sha256()
    f.seek(0)
    left = end
    while left > 0:
        chunk = f.read(min(_BLOCK, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def data_sha256(path: str) -> str:
    """The SHA-256 of ``path``'s bytes before its footer: what :func:`write` recorded, when the pages are intact."""
    with os.fdopen(safe_paths.open_no_follow(path, os.O_RDONLY), "rb") as f:  # a link is refused, not hashed
        start, _ = _footer(f)
        return _digest(f, start)


def read_proof(path: str) -> tuple[PartProof | None, pq.FileMetaData]:
    """The proof in ``path``'s footer (``None`` when it carries none) and the footer; ``ValueError`` when the
    footer cannot be read."""
    try:
        meta = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(" ".join(str(e).split())) from None
    raw = (meta.metadata or {}).get(KEY.encode())
    if raw is None:
        return None, meta
    try:
        fields = json.loads(raw)
        return PartProof(**fields), meta
    except (ValueError, TypeError):
        return None, meta


def _describe_type(path: str) -> str | None:
    """Why ``path`` is not a plain part file the job could have written (a link, a directory...), or ``None``."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)}): dask-lm writes its parts in place, never as links"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return None


def check(
    path: str, expected: PartProof, columns: Sequence[tuple[str, pa.DataType | None]], *, data: bool = True
) -> Stamp:
    """That the part at ``path`` proves to be ``expected`` (all but its ``data_sha256``): written by this job
    (identity), for this span, with as many rows as its footer holds and the columns the job writes (``columns``:
    name and type, ``None`` where the input decides it); with ``data``, that its pages hash to the recorded digest.
    Returns its stamp as checked. :class:`NotOurs` when it cannot be shown to be the job's, :class:`Damaged` when
    it is the job's but proves something else."""
    name = os.path.basename(path)
    why = _describe_type(path)
    if why is not None:
        raise NotOurs(f"{name} is {why}")
    before = os.lstat(path)
    try:
        proof, meta = read_proof(path)
    except ValueError as e:
        raise NotOurs(f"{name} cannot be read as parquet ({e})") from None
    if proof is None:
        raise NotOurs(f"{name} carries no dask-lm part proof in its footer (key {KEY!r}): another program wrote it")
    if proof.identity != expected.identity:
        raise NotOurs(
            f"{name} was written by another job (identity {proof.identity}, this job's is "
            f"{expected.identity}: other inputs, model or options)"
        )
    if proof.part != expected.part or proof.span() != expected.span():
        raise Damaged(
            f"{name} holds part {proof.part} (rows {proof.first_row}..{proof.first_row + proof.num_rows - 1} "
            f"of {proof.file}), not this part's span"
        )
    if proof.rows + proof.bad_rows != proof.num_rows or meta.num_rows != proof.rows:
        raise Damaged(
            f"{name} holds {meta.num_rows} rows, its proof says {proof.rows} (+ {proof.bad_rows} bad) of "
            f"{proof.num_rows}"
        )
    schema = meta.schema.to_arrow_schema()
    if schema.names != [c for c, _ in columns] or any(t is not None and schema.field(c).type != t for c, t in columns):
        raise Damaged(f"{name} has the columns {schema.names}, this job writes {[c for c, _ in columns]}")
    if data:
        try:
            digest = data_sha256(path)
        except (OSError, ValueError) as e:
            raise Damaged(f"{name} cannot be read ({e})") from None
        if digest != proof.data_sha256:
            raise Damaged(
                f"{name}'s pages do not hash to what was written (sha256 {proof.data_sha256[:12]}... when "
                f"written, now {digest[:12]}...): its bytes changed"
            )
    after = os.lstat(path)
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
    ):
        raise Damaged(f"{name} changed while it was checked")
    return Stamp(after.st_size, after.st_mtime_ns, after.st_ctime_ns)


def confirm(
    path: str, expected: PartProof, columns: Sequence[tuple[str, pa.DataType | None]], known: Stamp | None
) -> Stamp:
    """:func:`check` before ``_SUCCESS``: the pages are read again only where the part's stamp is not ``known``
    (the one it had when a resume checked it, or when its worker wrote it)."""
    st = os.lstat(path)
    same = known is not None and Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns) == known and stat.S_ISREG(st.st_mode)
    return check(path, expected, columns, data=not same)


def expected_parts(identity: str, spans: Sequence[Any]) -> list[PartProof]:
    """What part ``i`` of a job must prove, for each of its planned ``spans`` (:class:`~dask_lm.scoring.spans.Span`):
    the identity and the span (the counts are the part's own, checked against its footer)."""
    return [PartProof(identity, i, s.file, s.first_row, s.num_rows, rows=0, bad_rows=0) for i, s in enumerate(spans)]


def _part_path(output: str, index: int) -> str:
    return os.path.join(output, f"part-{index:05d}.parquet")  # dask_lm.io.parquet.part_name


def _refusal(output: str, path: str, e: NotOurs) -> NotOurs:
    from dask_lm.interface import again, opt

    return NotOurs(
        f"{opt('resume', True)} refused: {e}, so it cannot be kept as this job's part; dask-lm deletes "
        f"nothing it did not write: move {path} out of {output} (its target stays where it is, if it is a "
        f"link), then {again(resume=True)} to score its rows"
    )


def kept_parts(
    output: str, expected: Sequence[PartProof], columns: Sequence[tuple[str, pa.DataType | None]]
) -> dict[int, Stamp]:
    """A resume's parts: those of ``expected`` that ``output`` holds and that prove to be them (:func:`check`,
    pages hashed), each with its stamp as checked. A part of this job that proves something else is deleted (with a
    warning naming it), so that its span is scored again; one that is not provably this job's is refused
    (:class:`NotOurs`, a ``ValueError`` naming it and the fix), and left as it is."""
    from dask_lm.interface import warn

    kept: dict[int, Stamp] = {}
    for proof in expected:
        path = _part_path(output, proof.part)
        if not os.path.lexists(path):
            continue
        try:
            kept[proof.part] = check(path, proof, columns)
        except NotOurs as e:
            raise _refusal(output, path, e) from None
        except Damaged as e:
            warn(f"{e}: this job wrote it, so it is deleted and its rows are scored again")
            os.remove(path)
    return kept


def confirm_parts(
    output: str,
    expected: Sequence[PartProof],
    columns: Sequence[tuple[str, pa.DataType | None]],
    stamps: dict[int, Stamp],
) -> None:
    """Before ``_SUCCESS``: every part of ``expected`` is there and proves to be it (:func:`confirm`: pages read
    again only where the stamp moved since ``stamps``). A part missing or damaged meanwhile raises
    :class:`~dask_lm.errors.InputChangedError` (the job stops without ``_SUCCESS``; a resume scores it again), one
    that is not the job's :class:`NotOurs`."""
    from dask_lm.errors import InputChangedError
    from dask_lm.interface import again

    for proof in expected:
        path = _part_path(output, proof.part)
        try:
            if not os.path.lexists(path):
                raise Damaged(f"{os.path.basename(path)} is missing")
            confirm(path, proof, columns, stamps.get(proof.part))
        except NotOurs as e:
            raise _refusal(output, path, e) from None
        except Damaged as e:
            raise InputChangedError(
                f"{e}: a part of {output} changed after it was written, so the job stops "
                f"without _SUCCESS; {again(resume=True)} to score it again"
            ) from None
