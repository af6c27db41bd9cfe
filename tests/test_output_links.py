"""The output folder is the job's, and only the job's: a symbolic link planted under a name the job owns (the
lock, ``_errors``, a part, ``_manifest.json``, a checkpoint) is refused, naming it, and what it points to is left
byte for byte as it was. The victim here is a file or directory outside the output that the link leads to."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.io import parquet as pio
from dask_lm.jobs import folder
from dask_lm.sft.job import sft_parquet

TEXTS = ["the cat sat on the mat", "a dog ran in the park today", "dask runs tasks on workers", "tokens have logprobs"]
VICTIM = b"the user's own file: not dask-lm's\n"


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "in" / "data.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"id": list(range(4)), "text": TEXTS}), path, row_group_size=2)
    return path


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


def _score(data, out, tiny, client, **kw):
    return dask_lm.score_parquet(
        data, out, model=tiny["llama"], client=client, text_column="text", id_column="id", progress=False, **kw
    )


def _sft(data, out, tiny, client, **kw):
    return sft_parquet(
        data,
        out,
        model=tiny["llama"],
        client=client,
        text_column="text",
        global_batch_size=4,
        micro_batch_size=2,
        epochs=1,
        progress=False,
        **kw,
    )


def _plant_lock(out, victim):
    os.makedirs(out, exist_ok=True)
    lock = out / folder.LOCK
    if os.path.lexists(lock):
        os.remove(lock)
    os.symlink(victim, lock)
    return lock


# ----------------------------------------------------------------------------------------- the lock
def test_locked_output_refuses_a_linked_lock(tmp_path, victim):
    out = tmp_path / "out"
    lock = _plant_lock(out, victim)
    with (
        pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link.*remove the link"),
        folder.locked_output(str(out)),
    ):
        pass
    assert victim.read_bytes() == VICTIM
    # a dangling link: O_CREAT would have created the file it names
    os.remove(victim)
    with pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link"), folder.locked_output(str(out)):
        pass
    assert not victim.exists()


@pytest.mark.cluster
def test_score_refuses_a_linked_lock_new_and_resumed(client, tiny, data, tmp_path, victim):
    out = tmp_path / "out"
    lock = _plant_lock(out, victim)
    with pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link"):
        _score(data, out, tiny, client)
    assert victim.read_bytes() == VICTIM
    os.remove(lock)
    assert _score(data, out, tiny, client).rows == 4
    _plant_lock(out, victim)
    with pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link"):
        _score(data, out, tiny, client, resume=True)
    assert victim.read_bytes() == VICTIM


@pytest.mark.cluster
def test_cli_score_with_a_linked_lock_exits_2(client, tiny, data, tmp_path, victim):
    out = tmp_path / "out"
    lock = _plant_lock(out, victim)
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
            "--no-progress",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"{lock} is a symbolic link" in result.output and "--output" in result.output
    assert victim.read_bytes() == VICTIM


@pytest.mark.cluster
def test_sft_refuses_a_linked_lock_new_and_resumed(client, tiny, data, tmp_path, victim):
    out = tmp_path / "run"
    lock = _plant_lock(out, victim)
    with pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link"):
        _sft(data, out, tiny, client)
    assert victim.read_bytes() == VICTIM
    os.remove(lock)
    assert _sft(data, out, tiny, client).steps == 1
    _plant_lock(out, victim)
    with pytest.raises(ValueError, match=rf"{lock}.* is a symbolic link"):
        sft_parquet(None, out, client=client, resume=True, progress=False)
    assert victim.read_bytes() == VICTIM


# ----------------------------------------------------------------------------------------- _errors
def _linked_dir(tmp_path):
    """A directory outside the output, holding what a link to it must not lose: a file that looks like a killed
    writer's temporary, and one that looks like a part."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".x.tmp-1").write_bytes(b"not debris: the user's\n")
    (target / "part-00000.parquet").write_bytes(b"not a part either\n")
    return target


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.cluster
def test_resume_refuses_a_linked_errors_dir(client, tiny, data, tmp_path):
    out = tmp_path / "out"
    _score(data, out, tiny, client)
    # an unfinished job: its last part and its _SUCCESS gone, as after a kill
    os.remove(out / "part-00000.parquet")
    os.remove(out / pio.SUCCESS)
    target = _linked_dir(tmp_path)
    before = _snapshot(target)
    os.symlink(target, out / "_errors")
    with pytest.raises(ValueError, match=rf"{out / '_errors'} is a symbolic link.*remove the link"):
        _score(data, out, tiny, client, resume=True, skip_bad_rows=True)
    assert _snapshot(target) == before


def test_debris_removal_and_merge_refuse_a_linked_errors_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = _linked_dir(tmp_path)
    before = _snapshot(target)
    os.symlink(target, out / "_errors")
    for call in (pio.remove_debris, pio.merge_errors):
        with pytest.raises(ValueError, match=rf"{out / '_errors'} is a symbolic link"):
            call(str(out))
        assert _snapshot(target) == before, call.__name__


def test_a_linked_part_or_manifest_is_refused_at_the_first_look(tmp_path, victim):
    owned = r"part-\d{5}\.parquet|_errors\.parquet|_errors"
    for name in ("part-00000.parquet", pio.MANIFEST, pio.SUCCESS, pio.ERRORS):
        out = tmp_path / name.strip("_.")
        out.mkdir()
        (out / pio.MANIFEST).write_text('{"format": 4}')
        if os.path.lexists(out / name):
            os.remove(out / name)
        os.symlink(victim, out / name)
        with pytest.raises(ValueError, match=rf"{out / name} is a symbolic link"):
            folder.output_state(str(out), owned)
    assert victim.read_bytes() == VICTIM


# ----------------------------------------------------------------------------------------- writes and removals
def test_temporaries_are_new_files_never_opened_through_a_link(tmp_path, victim, monkeypatch):
    """A link planted under the very name of a write's temporary (a guessed or raced name): the write fails, and
    the link's target keeps its bytes."""
    import uuid

    fixed = uuid.UUID(int=0x1234)
    monkeypatch.setattr(pio.uuid, "uuid4", lambda: fixed)
    out = tmp_path / "out"
    out.mkdir()
    tmp = out / f".{pio.SUCCESS}.tmp-{fixed.hex[:12]}"
    os.symlink(victim, tmp)
    with pytest.raises(FileExistsError):
        pio.write_json_atomic({"rows": 1}, str(out / pio.SUCCESS))
    assert victim.read_bytes() == VICTIM and not os.path.lexists(out / pio.SUCCESS)
    os.symlink(victim, out / f".part-00000.parquet.tmp-{fixed.hex[:12]}")
    with pytest.raises(OSError, match=r"could not write part-00000.parquet"):
        pio.write_part(pa.table({"a": [1]}), str(out), "part-00000.parquet")
    assert victim.read_bytes() == VICTIM and not os.path.lexists(out / "part-00000.parquet")


def test_safe_remove_unlinks_links_and_never_descends_through_one(tmp_path):
    from dask_lm.io import safe_paths

    target = _linked_dir(tmp_path)
    before = _snapshot(target)
    d = tmp_path / "step_1"
    (d / "weights").mkdir(parents=True)
    os.symlink(target, d / "weights" / "escape")
    os.symlink(target, tmp_path / "step_2")
    assert safe_paths.remove(str(d)) and safe_paths.remove(str(tmp_path / "step_2"))
    assert not os.path.lexists(d) and not os.path.lexists(tmp_path / "step_2")
    assert _snapshot(target) == before
    assert not safe_paths.remove(str(d))  # gone already


@pytest.mark.cluster
def test_read_scores_refuses_a_linked_part(client, tiny, data, tmp_path):
    out = tmp_path / "out"
    _score(data, out, tiny, client)
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pq.read_table(out / "part-00000.parquet"), foreign)
    os.remove(out / "part-00000.parquet")
    os.symlink(foreign, out / "part-00000.parquet")
    with pytest.raises(ValueError, match=rf"{out / 'part-00000.parquet'} is a symbolic link"):
        dask_lm.read_scores(out)
