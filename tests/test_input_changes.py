"""No ``_SUCCESS`` over content the output was not computed from, and no input dropped by discovery.

A file a job pinned (an input, a model file) that changes while the job runs fails it with exit 1, naming the file,
and leaves no ``_SUCCESS``: each partition's read checks its file's stamp against the pin, and before ``_SUCCESS``
every pinned file is confirmed (re-hashed where its stamp moved). Input directories reached through symlinks are
scored, loops survived, and every row is scored once."""

from __future__ import annotations

import os
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.errors import InputChangedError
from dask_lm.io import fingerprint
from dask_lm.io import parquet as pio
from dask_lm.scoring import run as job  # the driver of score_parquet (scoring/job.py is its entry point)
from dask_lm.sft import job as sft

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")


def _texts(n, letter="a", start=0):
    # every row the same length whatever the letter: a rewrite with another letter keeps the file's size
    return [f"row {i:05d} {letter * 12} dask scores parquet rows" for i in range(start, start + n)]


def _write(path, texts, row_group_size=None):
    # no dictionary, no compression, no statistics: the file's size depends on the rows' lengths only
    pq.write_table(
        pa.table({"id": list(range(len(texts))), "text": texts}),
        path,
        row_group_size=row_group_size,
        use_dictionary=False,
        compression="none",
        write_statistics=False,
    )
    return str(path)


def _replace_same_size(path, texts, row_group_size=None):
    """Replace ``path`` by a new file (new inode, as ``cp`` / a pipeline's rename does) of the same size."""
    size = os.path.getsize(path)
    tmp = f"{path}.new"
    _write(tmp, texts, row_group_size)
    os.replace(tmp, path)
    assert os.path.getsize(path) == size  # the attack: only the content differs


# ----------------------------------------------------------------------------------------- the pins themselves
def test_verify_passes_a_touch_and_refuses_new_bytes(tmp_path):
    path = _write(tmp_path / "a.parquet", _texts(8))
    (pin,) = fingerprint.fingerprint_files([path])
    assert fingerprint.verify(pin) == pin.stamp
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched: same bytes, new stamp
    assert fingerprint.verify(pin) != pin.stamp  # re-hashed, and accepted
    _replace_same_size(path, _texts(8, "b"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime put back (ctime moves)
    with pytest.raises(InputChangedError, match="same size, different content") as e:
        fingerprint.verify(pin)
    assert path in str(e.value) and "resume=True" in str(e.value) and "overwrite=True" in str(e.value)
    _write(path, _texts(9))
    with pytest.raises(InputChangedError, match="bytes when the job pinned it"):
        fingerprint.verify(pin)
    os.remove(path)
    with pytest.raises(InputChangedError, match="cannot be read"):
        fingerprint.verify(pin)


def test_a_racy_pin_is_rehashed_before_success_under_its_own_stamp(tmp_path):
    """A file written moments before it was hashed may change again within the filesystem's time granularity
    without its stamp moving: the final check reads it again whatever the stamp says."""
    path = _write(tmp_path / "a.parquet", _texts(4))
    (pin,) = fingerprint.fingerprint_files([path])
    assert pin.racy  # just written
    with open(path, "r+b") as f:  # same size, new bytes, and then the exact stamp put back (as a coarse clock would)
        f.seek(8)
        f.write(b"X")
    os.utime(path, ns=(pin.stamp.mtime_ns, pin.stamp.mtime_ns))
    if fingerprint.stamp(path) != pin.stamp:  # ctime moved after all: the cheap check sees it too
        pin = fingerprint.Pin(pin.path, pin.size, pin.sha256, fingerprint.stamp(path), racy=True)
    assert fingerprint.verify(pin) == pin.stamp  # a partition's cheap check cannot tell
    with pytest.raises(InputChangedError, match="different content"):
        fingerprint.confirm_unchanged([pin])


def test_a_file_written_while_it_is_hashed_is_refused(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.parquet", _texts(4))
    real = fingerprint.file_sha256

    def hash_while_written(p):
        out = real(p)
        _write(p, _texts(5))
        return out

    monkeypatch.setattr(fingerprint, "file_sha256", hash_while_written)
    with pytest.raises(InputChangedError, match="changed while dask-lm was fingerprinting it"):
        fingerprint.fingerprint_files([path])


def test_a_partition_read_checks_its_file(tmp_path):
    path = _write(tmp_path / "a.parquet", _texts(10), row_group_size=5)
    (pin,) = fingerprint.fingerprint_files([path])
    assert list(pio.read_partition(path, 1, 5, 5, None, pin)["id"]) == [5, 6, 7, 8, 9]
    _replace_same_size(path, _texts(10, "z"), row_group_size=5)
    with pytest.raises(InputChangedError, match=path):
        pio.read_partition(path, 1, 5, 5, None, pin)


# ----------------------------------------------------------------------------------------- jobs
def _after_last_part(monkeypatch, action):
    """Run ``action`` on the driver once every part is written, just before the job's totals and _SUCCESS."""
    real = job.output_totals

    def totals(*args, **kwargs):
        action()
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "output_totals", totals)


@pytest.mark.cluster
def test_an_input_changed_after_its_last_read_fails_before_success(client, tiny, tmp_path, monkeypatch):
    data = _write(tmp_path / "a.parquet", _texts(20), row_group_size=5)
    out = tmp_path / "out"
    original = pathlib.Path(data).read_bytes()
    _after_last_part(monkeypatch, lambda: _replace_same_size(data, _texts(20, "q"), row_group_size=5))
    with pytest.raises(InputChangedError, match="same size, different content") as e:
        dask_lm.score_parquet(
            data, out, model=tiny["llama"], client=client, text_column="text", progress=False, task_tokens=0
        )
    assert data in str(e.value)
    assert not (out / "_SUCCESS").exists() and len(list(out.glob("part-*.parquet"))) == 4
    monkeypatch.undo()
    # the advice holds: the file restored, --resume finishes the job from the parts already written
    with open(data, "wb") as f:
        f.write(original)
    result = dask_lm.score_parquet(
        data, out, model=tiny["llama"], client=client, text_column="text", progress=False, resume=True, task_tokens=0
    )
    assert (result.run_rows, result.rows) == (0, 20) and result.parts_skipped == 4 and (out / "_SUCCESS").exists()


@pytest.mark.cluster
def test_a_model_file_changed_during_the_job_fails_before_success(client, tiny, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    config = model / "config.json"
    text = config.read_text()
    data = _write(tmp_path / "a.parquet", _texts(6))
    out = tmp_path / "out"
    # same length, another value: a different model with the same file size
    _after_last_part(
        monkeypatch, lambda: config.write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 9e-06'))
    )
    assert '"rms_norm_eps": 1e-06' in text
    with pytest.raises(InputChangedError, match=r"config.json") as e:
        dask_lm.score_parquet(data, out, model=str(model), client=client, text_column="text", progress=False)
    assert str(config) in str(e.value) and not (out / "_SUCCESS").exists()


@pytest.mark.cluster
def test_cli_input_replaced_mid_job_exits_1_without_success(client, tiny, tmp_path, monkeypatch):
    """The issue's attack: a 500-row file replaced (same size, new content) while its partitions are scored."""
    data = _write(tmp_path / "a.parquet", _texts(500), row_group_size=25)
    out = tmp_path / "out"
    replaced = []
    real = dask_lm.engine.progress.JobBar.update

    def update(self, n, postfix=None, **kwargs):
        if not replaced:  # the first partition is done; 19 are still to come
            replaced.append(True)
            _replace_same_size(data, _texts(500, "r"), row_group_size=25)
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
        ],
    )
    assert replaced and result.exit_code == 1, result.output
    assert "InputChangedError" in result.output and data in result.output and "--resume" in result.output, result.output
    assert not (out / "_SUCCESS").exists()
    written = sorted(out.glob("part-*.parquet"))
    assert 1 <= len(written) < 20
    for part in written:  # what was written came from the pinned rows (letter a), never the new ones
        assert all(" aaaaaaaaaaaa " in t for t in pq.read_table(part, columns=["text"]).column("text").to_pylist())


@pytest.mark.cluster
def test_sft_input_changed_during_the_run_fails_before_success(client, tiny, tmp_path, monkeypatch):
    data = _write(tmp_path / "a.parquet", _texts(8))
    out = tmp_path / "run"
    real = sft._save

    def save(policy, output, state, keep):
        real(policy, output, state, keep)
        _replace_same_size(data, _texts(8, "s"))

    monkeypatch.setattr(sft, "_save", save)
    with pytest.raises(InputChangedError, match="different content"):
        sft.sft_parquet(
            data,
            out,
            model=tiny["llama"],
            client=client,
            text_column="text",
            global_batch_size=8,
            micro_batch_size=4,
            max_steps=1,
            progress=False,
        )
    assert not (out / "_SUCCESS").exists() and (out / "step_1").is_dir()


# ----------------------------------------------------------------------------------------- discovery
@pytest.mark.cluster
def test_a_symlinked_directory_of_rows_is_scored(client, tiny, tmp_path):
    """100 rows in the input directory and 400 in a directory it links to: 500 rows scored, each once, and a
    symlink loop inside the input is survived without scoring anything twice."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    _write(elsewhere / "deep" / "b.parquet", _texts(400, start=100))
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "a.parquet", _texts(100))
    os.symlink(elsewhere, data / "more")
    os.symlink(data, data / "loop")  # a loop back to the input itself
    with pytest.warns(UserWarning, match="reached a second way"):
        files = pio.resolve_input_files(data)
    assert files == [str(data / "a.parquet"), str(data / "more" / "deep" / "b.parquet")]
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="reached a second way"):
        result = dask_lm.score_parquet(
            data, out, model=tiny["llama"], client=client, text_column="text", progress=False
        )
    assert result.rows == 500
    scored = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
    assert sorted(scored.column("text").to_pylist()) == sorted(_texts(100) + _texts(400, start=100))


def test_a_glob_matching_a_directory_walks_it_and_links_to_one_file_read_once(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    a = _write(root / "a.parquet", _texts(2))
    b = _write(root / "sub" / "b.parquet", _texts(2))
    assert pio.resolve_input_files(str(root / "*")) == [a, b]  # the shell's expansion would pass sub/ too
    assert pio.resolve_input_files(str(root / "**")) == [a, b]  # directories and files of every depth: once each
    os.symlink(a, root / "again.parquet")
    with pytest.warns(UserWarning, match="lead to a file already in the input"):
        assert pio.resolve_input_files(root) == [a, b]
