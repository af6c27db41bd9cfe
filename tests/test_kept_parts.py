"""A kept part proves what it is, and a manifest proves it was not edited.

``--resume`` keeps a part only where its footer proves it is this job's part for its span, with its pages as
written (:mod:`dask_lm.io.part_proof`): a part copied in from another job or a symbolic link is refused, named,
and left as it is; a part of the job with flipped bytes is scored again. A hand-edited ``_manifest.json`` is
refused naming the edited key; a wrong-typed entry is a ``ValueError`` naming the key and the file. Each case is
checked against what the input holds (its ids and texts) or the bytes of the file that must stay untouched."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.engine import cluster
from dask_lm.io import parquet as pio
from dask_lm.io import part_proof, safe_paths
from dask_lm.io.manifest import read_manifest
from dask_lm.jobs.resume import spec_for
from dask_lm.scoring.spec import ScoreSpec

# `cluster` is marked per test here: the tests without it start no cluster and run in the fast tier


def _texts(n, letter="a", start=0):
    return [f"row {i:05d} {letter * 8} dask keeps parts it can prove" for i in range(start, start + n)]


def _write(path, texts, row_group_size=None):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=row_group_size)
    return str(path)


def _score(data, out, model, client, **kw):
    return dask_lm.score_parquet(
        data, out, model=model, client=client, text_column="text", progress=False, task_tokens=0, **kw
    )


@pytest.fixture(scope="module")
def jobs(tiny, client, tmp_path_factory):
    """Two finished jobs: ``a`` (120 rows in 4 parts) and ``b`` (40 other rows, one part), each kept as a template
    that a test copies and makes unfinished."""
    root = tmp_path_factory.mktemp("kept")
    a = _write(root / "a.parquet", _texts(120), row_group_size=30)
    b = _write(root / "b.parquet", _texts(40, "b", start=500))
    _score(a, root / "out-a", tiny["llama"], client)
    _score(b, root / "out-b", tiny["llama"], client)
    return {"a": a, "b": b, "out_a": root / "out-a", "out_b": root / "out-b"}


def _unfinished(jobs, tmp_path):
    """A copy of job a's output without _SUCCESS: an output a --resume finishes."""
    out = tmp_path / "out"
    shutil.copytree(jobs["out_a"], out)
    (out / "_SUCCESS").unlink()
    return out


def _rows(out):
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    return table.column("id").to_pylist(), table.column("text").to_pylist()


def _no_cluster(monkeypatch):
    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("a cluster was started"))


# ----------------------------------------------------------------------------------------- parts
@pytest.mark.cluster
def test_a_part_copied_from_another_job_is_refused_by_name_and_left_as_it_is(jobs, tiny, client, tmp_path):
    out = _unfinished(jobs, tmp_path)
    foreign = out / "part-00001.parquet"
    foreign.unlink()  # 30 of the input's rows missing...
    shutil.copy(jobs["out_b"] / "part-00000.parquet", foreign)  # ...and 40 rows of another job in their place
    before = foreign.read_bytes()
    with pytest.raises(ValueError, match=r"part-00001\.parquet was written by another job") as e:
        _score(jobs["a"], out, tiny["llama"], client, resume=True)
    assert str(foreign) in str(e.value) and "move" in str(e.value)
    assert not (out / "_SUCCESS").exists() and foreign.read_bytes() == before  # not deleted: it may be the user's
    # the fix the message gives: moved out, the resume scores its span, and the output holds exactly the input
    os.replace(foreign, tmp_path / "moved.parquet")
    result = _score(jobs["a"], out, tiny["llama"], client, resume=True)
    assert (result.rows, result.run_rows, result.parts_skipped) == (120, 30, 3) and (out / "_SUCCESS").exists()
    source = pq.read_table(jobs["a"])
    assert _rows(out) == (source.column("id").to_pylist(), source.column("text").to_pylist())


@pytest.mark.cluster
def test_a_symlinked_part_is_never_trusted(jobs, tiny, client, tmp_path):
    out = _unfinished(jobs, tmp_path)
    target = tmp_path / "elsewhere.parquet"
    os.replace(out / "part-00002.parquet", target)  # the job's own part, even: a link to it proves nothing
    os.symlink(target, out / "part-00002.parquet")
    before = target.read_bytes()
    with pytest.raises(ValueError, match=r"part-00002\.parquet is a symbolic link"):
        _score(jobs["a"], out, tiny["llama"], client, resume=True)
    assert not (out / "_SUCCESS").exists() and os.path.islink(out / "part-00002.parquet")
    assert target.read_bytes() == before


@pytest.mark.cluster
def test_a_part_with_flipped_bytes_is_scored_again(jobs, tiny, client, tmp_path):
    out = _unfinished(jobs, tmp_path)
    part = out / "part-00003.parquet"
    good = pq.read_table(part)
    data = bytearray(part.read_bytes())
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # where the footer begins
    for at in (start // 3, start // 2):  # two bytes in the pages, the footer intact
        data[at] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"part-00003\.parquet's pages do not hash to what was written"):
        result = _score(jobs["a"], out, tiny["llama"], client, resume=True)
    assert (result.rows, result.run_rows, result.parts_skipped) == (120, 30, 3) and (out / "_SUCCESS").exists()
    again = dask_lm.read_scores(out)  # every part reads: no "Corrupt snappy compressed data"
    source = pq.read_table(jobs["a"])
    assert again["id"].tolist() == source.column("id").to_pylist()
    redone = pq.read_table(part)
    assert redone.column("text").equals(good.column("text"))
    assert redone.column("sum_logprob").to_pylist() == pytest.approx(good.column("sum_logprob").to_pylist(), abs=1e-5)


def test_a_part_proof_hashes_the_pages_and_a_check_catches_each_lie(tmp_path):
    """The proof's digest is of the bytes before the footer, read back independently; each field is checked."""
    table = pa.table({"id": list(range(50)), "text": _texts(50)})
    path = str(tmp_path / "part-00000.parquet")
    proof = part_proof.PartProof("job-v1:x", 0, "/in.parquet", 10, 50, rows=50, bad_rows=0)
    with safe_paths.create_new(path) as sink:
        part_proof.write(table, sink, proof)
    raw = pathlib.Path(path).read_bytes()
    length = int.from_bytes(raw[-8:-4], "little")
    import hashlib

    written, _ = part_proof.read_proof(path)
    assert written.data_sha256 == hashlib.sha256(raw[: len(raw) - 8 - length]).hexdigest()
    assert pq.read_table(path).equals(table)
    columns = [("id", None), ("text", pa.string())]
    part_proof.check(path, proof, columns)
    with pytest.raises(part_proof.NotOurs, match="another job"):
        part_proof.check(path, part_proof.PartProof("job-v1:y", 0, "/in.parquet", 10, 50, 0, 0), columns)
    with pytest.raises(part_proof.Damaged, match="not this part's span"):
        part_proof.check(path, part_proof.PartProof("job-v1:x", 0, "/in.parquet", 60, 50, 0, 0), columns)
    with pytest.raises(part_proof.Damaged, match="columns"):
        part_proof.check(path, proof, [("id", None), ("text", pa.string()), ("logprobs", None)])
    pq.write_table(table, path)  # the same rows, written by another program
    with pytest.raises(part_proof.NotOurs, match="carries no dask-lm part proof"):
        part_proof.check(path, proof, columns)


# ----------------------------------------------------------------------------------------- the manifest
def _edit(out, **options):
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest["options"].update(options)
    (out / "_manifest.json").write_text(json.dumps(manifest))


@pytest.mark.cluster
@pytest.mark.parametrize("key, value", [("topk", 3), ("convention", "separate")])
def test_an_edited_manifest_is_refused_naming_the_key(jobs, tmp_path, monkeypatch, key, value):
    out = _unfinished(jobs, tmp_path)
    parts = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    _edit(out, **{key: value})
    _no_cluster(monkeypatch)
    with pytest.raises(ValueError, match=rf'_manifest\.json was edited: "{key}" \(in "options"\)'):
        dask_lm.score_parquet(None, out, resume=True, progress=False)
    shown = CliRunner().invoke(cli, ["score", "--output", str(out), "--resume"])
    assert shown.exit_code == 2 and f'was edited: "{key}"' in shown.output and "--overwrite" in shown.output, (
        shown.output
    )
    assert not (out / "_SUCCESS").exists()
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == parts


def test_a_wrong_typed_manifest_entry_names_the_key_and_the_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "_manifest.json"
    # a manifest of format 4 has no seal to say it was edited: the type itself is refused
    manifest = {
        "format": 4,
        "options": {"topk": "3", "text_column": "text"},
        "model": "/m",
        "inputs": [{"path": "/in.parquet", "size": 10, "sha256": "ab"}],
        "partitions": 1,
    }
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r'_manifest\.json: "topk" holds \'3\', a str') as e:
        spec_for(ScoreSpec, out, resume=True, given={"input": None, "model": None, "topk": None})
    assert str(path) in str(e.value)
    path.write_text(json.dumps({**manifest, "options": {"topk": 3}, "inputs": 5}))
    with pytest.raises(ValueError, match=r'_manifest\.json: "inputs" holds 5, which is not a list') as e:
        read_manifest(str(out))
    assert str(path) in str(e.value)
    path.write_text(json.dumps({**manifest, "options": {"topk": 3}, "partitions": "1"}))
    with pytest.raises(ValueError, match=r'"partitions" holds "1", which is not an integer'):
        read_manifest(str(out))


# ----------------------------------------------------------------------------------------- messages
@pytest.mark.cluster
def test_a_file_added_to_the_input_folder_is_named_on_resume(tiny, client, tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "a.parquet", _texts(20))
    out = tmp_path / "out"
    _score(data, out, tiny["llama"], client)
    (out / "_SUCCESS").unlink()
    added = _write(data / "b.parquet", _texts(20, "c"))
    _no_cluster(monkeypatch)
    with pytest.raises(ValueError, match="different inputs") as e:
        _score(data, out, tiny["llama"], None, resume=True)
    assert f"input file {added} is new" in str(e.value) and "cut into parts" not in str(e.value), str(e.value)


@pytest.mark.cluster
def test_cli_input_changed_on_a_worker_says_resume_as_a_flag(client, tiny, tmp_path, monkeypatch):
    """The workers of an attached cluster were started by Python, not by the command: a worker's read still
    speaks the command's language."""
    data = _write(tmp_path / "a.parquet", _texts(100), row_group_size=10)
    size = os.path.getsize(data)
    out = tmp_path / "out"
    replaced = []
    real = dask_lm.engine.progress.JobBar.update

    def update(self, n, postfix=None, **kwargs):
        if not replaced:
            replaced.append(True)
            tmp = f"{data}.new"
            _write(tmp, _texts(100, "z"), row_group_size=10)
            os.replace(tmp, data)
            assert os.path.getsize(data) == size
        return real(self, n, postfix, **kwargs)

    monkeypatch.setattr(dask_lm.engine.progress.JobBar, "update", update)
    result = CliRunner().invoke(
        cli,
        [
            "score",
            data,
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(out),
            "--scheduler-address",
            client.scheduler.address,
            "--no-progress",
            "--task-tokens",
            "0",
        ],
    )
    assert replaced and result.exit_code == 1, result.output
    assert "InputChangedError" in result.output and "run the same command with --resume" in result.output
    assert "resume=True" not in result.output and "overwrite=True" not in result.output, result.output


@pytest.mark.cluster
def test_the_summary_names_the_errors_file_when_rows_were_skipped(tiny, client, tmp_path):
    data = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "text": ["a good row", None, "another good row"]}), data)
    out = tmp_path / "out"
    result = dask_lm.score_parquet(
        data, out, model=tiny["llama"], client=client, text_column="text", progress=False, skip_bad_rows=True
    )
    errors = os.path.join(str(out), pio.ERRORS)
    assert result.bad_rows == 1 and pq.read_table(errors).column("row").to_pylist() == [1]
    assert dict(result.summary())["bad rows"] == f"1 (left out, listed in {errors})"
    shown = CliRunner().invoke(cli, ["score", "--output", str(out), "--resume"])
    assert shown.exit_code == 0 and f"listed in {errors}" in shown.output, shown.output
