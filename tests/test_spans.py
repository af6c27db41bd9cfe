"""Scoring tasks sized by tokens (dask_lm.scoring.spans): the plan itself, and jobs over a file written as one row group
(pandas' and pyarrow's default), which used to be one task for one worker."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dask_lm
from dask_lm.scoring import spans

GROUPS = [("a", 0, 0, 7), ("a", 1, 7, 7), ("a", 2, 14, 6), ("b", 0, 0, 10)]


def _rows(plan):
    return [(s.file, r) for s in plan for r in range(s.first_row, s.first_row + s.num_rows)]


def test_every_row_is_in_exactly_one_span_in_order():
    every = [(f, r) for f, _g, first, n in GROUPS for r in range(first, first + n)]
    for target in (None, 0, 1, 30, 60, 10**9):
        plan = spans.plan_spans(GROUPS, [50, 50, 40, 60], target)
        assert _rows(plan) == every, target
        assert all(len({GROUPS[g][0] for g in s.groups} | {s.file}) == 1 for s in plan)  # one file per span


def test_large_groups_are_split_and_small_ones_merged_within_a_file():
    split = spans.plan_spans(GROUPS, [50, 50, 40, 60], 30)
    assert [(s.groups, s.num_rows, s.whole) for s in split][:2] == [((0,), 3, False), ((0,), 4, False)]
    assert [s.offset for s in split if s.groups == (3,)] == [0, 5]  # b's 10 rows in two slices
    merged = spans.plan_spans(GROUPS, [5, 5, 4, 6], 100)
    assert [(s.file, s.groups, s.num_rows) for s in merged] == [("a", (0, 1, 2), 20), ("b", (3,), 10)]
    assert [(s.groups, s.num_rows) for s in spans.plan_spans(GROUPS, [5, 5, 4, 6], 0)] == [
        ((0,), 7),
        ((1,), 7),
        ((2,), 6),
        ((3,), 10),
    ]  # as written
    one_row = spans.plan_spans([("c", 0, 0, 1)], [10**7], 100)
    assert [(s.num_rows, s.whole) for s in one_row] == [(1, True)]  # a single row is never cut


def test_the_default_target_follows_the_job_size():
    assert spans.task_tokens(1000) == spans.MIN_TASK_TOKENS
    assert spans.task_tokens(64e6) == spans.MAX_TASK_TOKENS
    assert spans.task_tokens(4.4e6) == int(4.4e6 / spans.TASKS_PER_JOB)


def test_the_digest_names_the_cut():
    a = spans.plan_spans(GROUPS, [50, 50, 40, 60], 30)
    b = spans.plan_spans(GROUPS, [50, 50, 40, 60], 60)
    assert spans.plan_digest(a, ["a", "b"]) == spans.plan_digest(list(a), ["a", "b"])
    assert spans.plan_digest(a, ["a", "b"]) != spans.plan_digest(b, ["a", "b"])


@pytest.fixture
def one_group(tmp_path):
    """120 rows of token ids in one row group, as pandas / pyarrow write a file by default."""
    d = tmp_path / "data"
    d.mkdir()
    ids = [[3 + (i * 7 + j * 3) % 90 for j in range(8 + i % 17)] for i in range(120)]
    pq.write_table(pa.table({"id": list(range(120)), "ids": ids}), d / "a.parquet")
    assert pq.ParquetFile(d / "a.parquet").metadata.num_row_groups == 1
    return d


def _sums(out):
    got = {}
    for f in sorted(os.listdir(out)):
        if f.startswith("part-"):
            t = pq.read_table(os.path.join(out, f), columns=["id", "sum_logprob"]).to_pydict()
            got.update(zip(t["id"], t["sum_logprob"]))
    return got


def _hf_sums(model_dir, rows):
    """Each row's summed logprob of ids 1.. from a single-process float32 Hugging Face forward."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = []
    with torch.no_grad():
        for ids in rows:
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            sums.append(float(lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).double().sum()))
    return sums


@pytest.mark.cluster
def test_one_row_group_is_scored_by_every_worker_and_resumed_by_span(client, tiny, one_group, tmp_path):
    from distributed import get_task_stream

    whole = dask_lm.score_parquet(
        one_group,
        tmp_path / "whole",
        model=tiny["llama"],
        client=client,
        ids_column="ids",
        id_column="id",
        task_tokens=0,
        progress=False,
    )
    assert whole.parts == 1
    out = tmp_path / "out"
    with get_task_stream(client) as stream:
        res = dask_lm.score_parquet(
            one_group,
            out,
            model=tiny["llama"],
            client=client,
            ids_column="ids",
            id_column="id",
            task_tokens=300,
            progress=False,
        )
    scored_on = {t["worker"] for t in stream.data if str(t["key"]).startswith("score_partition")}
    assert res.parts >= 4 and res.rows == 120 and len(scored_on) == 2  # the one row group, on both workers
    reads = [t for t in stream.data if str(t["key"]).startswith("read_partition")]
    assert len(reads) == 1  # read once, sliced where it was read
    reference = _hf_sums(tiny["llama"], pq.read_table(one_group / "a.parquet").column("ids").to_pylist())
    for got in (_sums(tmp_path / "whole"), _sums(out)):  # one task, and the row group cut into many
        assert sorted(got) == list(range(120))
        assert all(got[i] == pytest.approx(reference[i], abs=1e-3) for i in range(120))

    # a lost part is redone alone, from its own rows, and the plan is pinned: another cut is refused
    before = pq.read_table(out / "part-00002.parquet")
    os.remove(out / "part-00002.parquet")
    os.remove(out / "_SUCCESS")
    again = dask_lm.score_parquet(
        one_group,
        out,
        model=tiny["llama"],
        client=client,
        ids_column="ids",
        id_column="id",
        task_tokens=300,
        resume=True,
        progress=False,
    )
    assert again.parts_skipped == res.parts - 1 and (again.rows, again.run_rows) == (120, before.num_rows)
    assert pq.read_table(out / "part-00002.parquet").column("id").equals(before.column("id"))
    os.remove(out / "_SUCCESS")
    with pytest.raises(ValueError, match=r"resume=True refused.*cut into parts another way"):
        dask_lm.score_parquet(
            one_group,
            out,
            model=tiny["llama"],
            client=client,
            ids_column="ids",
            id_column="id",
            task_tokens=150,
            resume=True,
            progress=False,
        )
