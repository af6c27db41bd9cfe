"""Jobs trust only what they checked: content fingerprints for --resume, damaged models refused before any cluster,
inputs discovered as Dask and Spark discover them, one job per output directory, no debris left behind."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.io.parquet import resolve_input_files
from dask_lm.sft.job import sft_parquet

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

TEXTS = [f"sample {i:04d}: dask scores parquet rows with a model" for i in range(12)]
MiB = 1 << 20


def _write(path, texts, **kw):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, **kw)
    return path


def _score(data, out, model, client=None, **kw):
    return dask_lm.score_parquet(data, out, model=model, client=client, text_column="text", progress=False, **kw)


@pytest.fixture(scope="module")
def scored(tiny, client, tmp_path_factory):
    """A finished scoring job: (input directory, output directory)."""
    root = tmp_path_factory.mktemp("scored")
    (root / "data").mkdir()
    _write(root / "data" / "a.parquet", TEXTS, row_group_size=5)
    _score(root / "data", root / "out", tiny["llama"], client)
    return root / "data", root / "out"


def _copy_output(out, tmp_path):
    copy = tmp_path / "out-copy"
    shutil.copytree(out, copy)
    return copy


@pytest.mark.cluster
def test_same_size_rewrite_of_an_input_refuses_resume(client, tiny, tmp_path, no_cluster):
    data = tmp_path / "data.parquet"
    plain = dict(compression="none", use_dictionary=False, write_statistics=False)  # bytes follow the values
    _write(data, TEXTS, **plain)
    out = tmp_path / "out"
    _score(data, out, tiny["llama"], client)
    size = data.stat().st_size
    _write(data, [t.replace("0007", "0008") for t in TEXTS], **plain)  # one digit of one row
    assert data.stat().st_size == size and pq.read_table(data)["text"][7].as_py() != TEXTS[7]
    with pytest.raises(ValueError, match=rf"resume=True refused.*input file {data}.*same size.*different content"):
        _score(data, out, tiny["llama"], resume=True)  # finished job
    assert not no_cluster  # a finished output's resume starts nothing
    os.remove(out / "_SUCCESS")
    before = _snapshot(out)
    with pytest.raises(ValueError, match=rf"resume=True refused.*input file {data}"):
        _score(data, out, tiny["llama"], resume=True)  # interrupted job
    result = CliRunner().invoke(
        cli,
        [
            "score",
            str(data),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(out),
            "--resume",
            "--no-progress",
        ],
    )
    assert result.exit_code == 2 and str(data) in result.output, result.output
    # the content is known only once hashed, beside the cluster's start: the cluster may have been asked for
    # (here refused by the fixture), and the output is as it was
    assert _snapshot(out) == before


def _snapshot(out):
    """Every file of ``out`` (but the lock) with its bytes."""
    return {
        p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".dask-lm.lock"
    }


@pytest.fixture(scope="module")
def wide_model(tiny, tmp_path_factory):
    """A model whose safetensors file is several MiB, so a change can avoid its first and last MiB."""
    from dask_lm.tiny import build_tiny_model

    path = build_tiny_model(
        str(tmp_path_factory.mktemp("wide") / "model"),
        hidden_size=128,
        intermediate_size=1024,
        tokenizer_path=tiny["tokenizer"],
        seed=5,
    )
    assert os.path.getsize(os.path.join(path, "model.safetensors")) > 3 * MiB
    return path


@pytest.mark.cluster
def test_weights_changed_mid_file_refuse_resume(client, wide_model, tmp_path, no_cluster):
    model = tmp_path / "model"
    shutil.copytree(wide_model, model)
    data = _write(tmp_path / "data.parquet", TEXTS[:4])
    out = tmp_path / "out"
    _score(data, out, str(model), client)
    weights = model / "model.safetensors"
    before = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", before[:8])
    middle = 8 + header_len + (len(before) - 8 - header_len) // 2  # inside the tensor data
    changed = bytearray(before)
    changed[middle : middle + 16] = bytes(b ^ 0xFF for b in changed[middle : middle + 16])
    weights.write_bytes(bytes(changed))
    assert len(changed) == len(before) and changed[:MiB] == before[:MiB] and changed[-MiB:] == before[-MiB:]
    assert changed != before
    before = _snapshot(out)
    with pytest.raises(ValueError, match=rf"resume=True refused.*model file {weights}.*different content"):
        _score(data, out, str(model), resume=True)
    assert _snapshot(out) == before  # refused after hashing, beside the cluster's start: nothing written


@pytest.mark.cluster
def test_option_change_names_the_option_and_both_values(scored, tiny, no_cluster):
    data, out = scored
    with pytest.raises(ValueError, match=r"resume=True refused.*: topk was 0, now 2"):
        _score(data, out, tiny["llama"], topk=2, resume=True)
    with pytest.raises(ValueError, match=r": id_column was unset, now 'id'"):
        _score(data, out, tiny["llama"], id_column="id", resume=True)
    assert not no_cluster


@pytest.mark.cluster
def test_finished_resume_returns_at_once_without_a_cluster(scored, tiny, tmp_path, no_cluster):
    data, out = scored
    done = json.loads((out / "_SUCCESS").read_text())
    copy = _copy_output(out, tmp_path)
    before = {f: (copy / f).stat().st_mtime_ns for f in os.listdir(copy) if not f.startswith(".")}
    result = _score(data, copy, tiny["llama"], resume=True)
    assert result.parts == result.parts_skipped == done["parts"] and result.already_complete
    assert (result.rows, result.tokens) == (done["rows"], done["tokens"])  # the finished job's, as _SUCCESS says
    assert result.perplexity == pytest.approx(done["perplexity"])
    assert {f: (copy / f).stat().st_mtime_ns for f in before} == before  # nothing rewritten
    assert not no_cluster


@pytest.mark.cluster
@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_damaged_manifest_is_named(scored, tiny, tmp_path, no_cluster, content):
    data, out = scored
    copy = _copy_output(out, tmp_path)
    (copy / "_manifest.json").write_text(content)
    with pytest.raises(ValueError, match=rf"{copy / '_manifest.json'}.*(not valid JSON|not an object).*another"):
        _score(data, copy, tiny["llama"], resume=True)
    assert not no_cluster


def _damage(model, case):
    if case == "config not JSON":
        (model / "config.json").write_text('{"model_type": "llama",')
        return model / "config.json"
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    if case == "safetensors truncated":
        weights.write_bytes(raw[: len(raw) - 1000])
    else:  # garbage of the same size
        weights.write_bytes(bytes((i * 7 + 13) % 251 for i in range(len(raw))))
    return weights


@pytest.mark.parametrize("command", ["score", "sft"])
@pytest.mark.parametrize("case", ["config not JSON", "safetensors truncated", "safetensors garbage"])
def test_damaged_model_exits_2_before_any_cluster(tiny, tmp_path, no_cluster, command, case):
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    damaged = _damage(model, case)
    data = _write(tmp_path / "data.parquet", TEXTS[:4])
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, [command, str(data), "--model", str(model), "--text-column", "text", "--output", str(out), "--no-progress"]
    )
    assert result.exit_code == 2, result.output
    assert str(damaged) in result.output and "Traceback" not in result.output, result.output
    assert not no_cluster and not out.exists()


def test_topk_above_the_vocabulary_exits_2(tiny, tmp_path, no_cluster):
    vocab = json.loads(pathlib.Path(tiny["llama"], "config.json").read_text())["vocab_size"]
    data = _write(tmp_path / "data.parquet", TEXTS[:4])
    args = [
        "score",
        str(data),
        "--model",
        tiny["llama"],
        "--text-column",
        "text",
        "--output",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    result = CliRunner().invoke(cli, [*args, "--topk", str(vocab + 1)])
    assert result.exit_code == 2 and f"--topk {vocab + 1}" in result.output and str(vocab) in result.output, (
        result.output
    )
    assert not no_cluster


def test_sft_over_an_input_without_rows_exits_2(tiny, tmp_path, no_cluster):
    data = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), data)
    result = CliRunner().invoke(
        cli,
        [
            "sft",
            str(data),
            "--model",
            tiny["llama"],
            "--text-column",
            "text",
            "--output",
            str(tmp_path / "run"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 2 and "no rows" in result.output and str(data) in result.output, result.output
    assert not no_cluster


def test_paths_starting_with_underscore_or_dot_are_skipped_at_any_depth(tmp_path):
    root = tmp_path / "data"
    for rel in (
        "a.parquet",
        "_x/b.parquet",
        ".x/c.parquet",
        "sub/d.parquet",
        "sub/_y/e.parquet",
        "sub/.z/f.parquet",
        "sub/_g.parquet",
        "sub/.h.parquet",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        _write(root / rel, TEXTS[:2])
    assert resolve_input_files(root) == [str(root / "a.parquet"), str(root / "sub" / "d.parquet")]


def test_output_and_input_must_not_nest(tiny, tmp_path, no_cluster):
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "a.parquet", TEXTS[:4])
    for out in (data / "scores", data):
        with pytest.raises(ValueError, match=rf"output {out} is inside the input directory {data}"):
            _score(data, out, tiny["llama"])
    with pytest.raises(ValueError, match=rf"output {data / 'run'} is inside the input directory {data}"):
        sft_parquet(data, data / "run", model=tiny["llama"], text_column="text", progress=False)
    with pytest.raises(ValueError, match=rf"input {data / 'a.parquet'} is inside output {data}"):
        _score(data / "a.parquet", data, tiny["llama"])
    with pytest.raises(ValueError, match=r"input pattern .* matches files"):
        _score(str(tmp_path / "**" / "*.parquet"), tmp_path / "out", tiny["llama"])
    assert not (data / "scores").exists() and not no_cluster


def _hold_lock(out):
    out.mkdir(exist_ok=True)
    f = open(out / ".dask-lm.lock", "a+")  # noqa: SIM115 (held open: the lock lasts as long as the file)
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running job holds it
    return f


def test_a_second_job_on_a_locked_output_is_refused(tiny, tmp_path, no_cluster):
    data = _write(tmp_path / "data.parquet", TEXTS[:4])
    for name, job in (
        ("score", lambda out: _score(data, out, tiny["llama"], resume=True)),
        (
            "sft",
            lambda out: sft_parquet(data, out, model=tiny["llama"], text_column="text", resume=True, progress=False),
        ),
    ):
        out = tmp_path / name
        lock = _hold_lock(out)
        try:
            with pytest.raises(ValueError, match=rf"output {out} is in use by another dask-lm job"):
                job(out)
        finally:
            lock.close()
        assert os.listdir(out) == [".dask-lm.lock"]  # the refused job wrote nothing
    lock = _hold_lock(tmp_path / "score")
    try:  # said first: before a model that does not even exist is looked at
        with pytest.raises(ValueError, match="is in use by another dask-lm job"):
            _score(data, tmp_path / "score", str(tmp_path / "no-such-model"), resume=True)
    finally:
        lock.close()
    result = CliRunner().invoke(
        cli,
        ["score", str(data), "--model", tiny["llama"], "--text-column", "text", "--output", str(out), "--no-progress"],
    )
    assert result.exit_code == 1 and "connect() was called" in result.output  # unlocked: the job goes on
    assert len(no_cluster) == 1


@pytest.mark.cluster
def test_next_sft_start_removes_stale_checkpoint_temporaries(client, tiny, tmp_path):
    data = _write(tmp_path / "data.parquet", TEXTS[:4])
    out = tmp_path / "run"
    stale = out / ".step_3.tmp-0badf00d"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / "model.safetensors").write_bytes(b"\0" * 4096)  # a save killed halfway
    keep = out / ".notes"
    keep.write_text("not ours")
    res = sft_parquet(
        data,
        out,
        model=tiny["llama"],
        client=client,
        text_column="text",
        global_batch_size=4,
        micro_batch_size=2,
        max_steps=1,
        save_every=1,
        progress=False,
    )
    assert res.steps == 1 and (out / "step_1" / "weights" / "config.json").exists()
    assert not stale.exists() and keep.exists()
    assert not [d for d in os.listdir(out) if ".tmp-" in d]
