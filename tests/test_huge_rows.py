"""A text row longer than the model could take is a bad row found from its byte length, before it is copied out of
Arrow or tokenized: named with file, row and column, refused (exit 2) or listed by --skip-bad-rows, at a memory
cost of reading the value, not of tokenizing it (one 600 MB row used to take every worker past 11 GiB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from click.testing import CliRunner
from tokenizer_kinds import _train

import dask_lm
from dask_lm.cli import main as cli
from dask_lm.data.text_bytes import (
    ALWAYS_TOKENIZED_BYTES,
    MAX_TEXT_BYTES,
    max_token_bytes,
    text_bound,
    tokenizer_token_bytes,
)
from dask_lm.errors import BadRowError

HUGE = 8 << 20  # bytes of one repeated letter: a few KB of zstd; tokenizing it takes the tiny tokenizer ~40 s, 1.6 GB


def _huge_file(path, size=HUGE):
    pq.write_table(
        pa.table({"id": [0, 1, 2], "text": ["dask tokens score", "a" * size, "parquet model worker"]}),
        path,
        compression="zstd",
    )
    assert os.path.getsize(path) < size // 100  # the shape of the report: a small file, one enormous value
    return path


def _fast(kind):
    tok, specials = _train(kind)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "llama2"])
def test_no_text_has_fewer_tokens_than_its_bytes_over_the_bound(kind):
    """The bound's direction: every text of n bytes has at least n / K tokens, so refusing rows over (limit + 1) * K
    bytes refuses none that fits; checked against the tokenizer itself, on the texts that pack the most bytes into
    a token (runs of its longest token, of spaces, of unknown characters, of multi-byte characters)."""
    tok = _fast(kind)
    k = tokenizer_token_bytes(tok)
    assert k is not None and k >= 4
    longest = max((tok.convert_tokens_to_string([t]) for t in tok.get_vocab()), key=lambda s: len(s.encode()))
    texts = [
        longest * 50,
        " " * 5000,
        "a" * 5000,
        "é" * 3000,
        "日本語" * 1000,
        "\U0001f600" * 1000,
        "dask tokens score parquet model cluster worker " * 100,
        "x=1; y=2\n" * 500,
    ]
    for text in texts:
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert n * k >= len(text.encode()), (kind, text[:20], n, k)
    assert text_bound(tok, 100_000, "", truncate=False).max_bytes == 100_001 * k  # over ALWAYS_TOKENIZED_BYTES
    assert text_bound(tok, 64, "", truncate=False).max_bytes == ALWAYS_TOKENIZED_BYTES  # tokenized: exact counts
    assert text_bound(tok, 64, "", truncate=True).max_bytes == MAX_TEXT_BYTES


def test_tokenizers_that_make_one_token_of_much_text_get_only_the_absolute_bound():
    """WordLevel makes one <unk> of a word of any length: no bytes-per-token bound holds, so only MAX_TEXT_BYTES."""
    tok = _fast("word")
    assert len(tok("x" * 10_000, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer_token_bytes(tok) is None
    assert text_bound(tok, 64, "64 positions", truncate=False).max_bytes == MAX_TEXT_BYTES


def test_the_bound_from_a_tokenizer_json_by_rule():
    """Closed-form values of max_token_bytes for hand-written tokenizer.json specs."""
    vocab = {"a": 0, "abc": 1, "▁▁": 2}  # "▁" is 3 bytes of UTF-8: "▁▁" bounds at 6 (it stands for 2 spaces)
    bpe = {"type": "BPE", "vocab": vocab, "unk_token": None, "fuse_unk": False, "byte_fallback": False}
    assert max_token_bytes({"model": bpe}) == 6
    assert max_token_bytes({"model": bpe, "added_tokens": [{"content": "<|a-long-special-token|>"}]}) == 24
    assert max_token_bytes({"model": bpe, "normalizer": {"type": "NFKC"}}) == 24  # U+107A5: 4 bytes, 1 after
    replace = {"type": "Replace", "pattern": {"String": "    "}, "content": "\t"}  # 4 bytes become 1
    assert max_token_bytes({"model": bpe, "normalizer": {"type": "Sequence", "normalizers": [replace]}}) == 24
    byte_level = {"type": "ByteLevel", "add_prefix_space": False}  # one character per byte: "▁▁" is 2 bytes
    assert max_token_bytes({"model": {**bpe, "vocab": {"a": 0, "ĠĠĠĠĠ": 1}}, "pre_tokenizer": byte_level}) == 5
    # what can make one token of unbounded text, or drop text, has no bound
    for spec in (
        {"model": {**bpe, "unk_token": "<unk>", "fuse_unk": True}},
        {"model": {"type": "WordPiece", "vocab": vocab, "unk_token": "[UNK]"}},
        {"model": {"type": "Unigram", "vocab": [["a", 0.0]], "unk_id": 0}},
        {"model": bpe, "normalizer": {"type": "Strip", "left": True, "right": True}},
        {"model": bpe, "normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
        {"model": bpe, "pre_tokenizer": {"type": "Whitespace"}},
        {"model": bpe, "added_tokens": [{"content": "<mask>", "lstrip": True}]},
    ):
        assert max_token_bytes(spec) is None, spec
    # byte fallback: no unknown token, the pieces bound it
    assert max_token_bytes({"model": {**bpe, "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True}}) == 6


_MEASURE = """
import json, resource, sys
import transformers
from dask_lm.data.messages import ScoreOptions
from dask_lm.data.rows import RowModel, prepare_rows
from dask_lm.io import parquet as pio

path, tokenizer = sys.argv[1], sys.argv[2]
tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
part = pio.read_partition(path, 0, 0, 3, ["id", "text"])
opts = ScoreOptions(model="m", tokenizer=tokenizer, precision="float32", output="", text_column="text")
got = prepare_rows(part, opts, RowModel(tok, len(tok), 4096), file=path, first_row=0)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kib": grown, "errors": got.errors, "ids": [i is not None for i in got.ids]}))
"""


def test_a_huge_row_is_named_at_the_cost_of_reading_it_not_of_tokenizing_it(tiny, tmp_path):
    """A worker's read + row checks of a 16 MiB value, in a fresh process: its peak memory grows by less than 16x
    the value (reading it costs about 3x: the decompressed page, the dictionary, the array, plus pyarrow's pools);
    copying it into Python would cost 2x more and tokenizing it about 200x (3.6 GiB measured before the bound)."""
    size = 16 << 20
    path = _huge_file(tmp_path / "huge.parquet", size)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), tiny["tokenizer"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["errors"][0] is None and got["errors"][2] is None and got["ids"] == [True, False, True]
    assert got["errors"][1].startswith(f"{path}: row 1, column 'text': {size:,} bytes of text, more than the ")
    assert got["grown_kib"] * 1024 < 16 * size, got["grown_kib"]


def _cli(client, args):
    return CliRunner().invoke(
        cli, ["score", *map(str, args), "--scheduler-address", client.scheduler.address, "--no-progress"]
    )


@pytest.mark.cluster
def test_a_huge_row_is_refused_by_name_or_skipped_and_listed(client, tiny, tmp_path):
    data = _huge_file(tmp_path / "huge.parquet")
    tok = transformers.AutoTokenizer.from_pretrained(tiny["tokenizer"])
    bound = text_bound(tok, 4096, "", truncate=False).max_bytes

    result = _cli(client, [data, "--model", tiny["llama"], "--text-column", "text", "--output", tmp_path / "o1"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert (
        f"huge.parquet: row 1, column 'text': {HUGE:,} bytes of text, more than the {bound:,} a row may hold" in said
        and "--truncate" in said
    ), said
    assert not (tmp_path / "o1" / "_SUCCESS").exists()

    # --skip-bad-rows: the scan is left to the workers, which list the row and score the others
    res = dask_lm.score_parquet(
        data,
        tmp_path / "o2",
        model=tiny["llama"],
        client=client,
        text_column="text",
        skip_bad_rows=True,
        progress=False,
    )
    errors = pq.read_table(tmp_path / "o2" / "_errors.parquet").to_pylist()
    assert res.bad_rows == 1 and [(e["file"], e["row"]) for e in errors] == [(str(data), 1)]
    assert f"{HUGE:,} bytes of text" in errors[0]["error"]
    # the other rows score as they do in a file without the huge one
    pq.write_table(pq.read_table(data).take([0, 2]), tmp_path / "small.parquet")
    dask_lm.score_parquet(
        tmp_path / "small.parquet",
        tmp_path / "o3",
        model=tiny["llama"],
        client=client,
        text_column="text",
        progress=False,
    )
    got, expect = _rows(tmp_path / "o2"), _rows(tmp_path / "o3")
    assert [r["id"] for r in got] == [0, 2] and len(expect) == 2
    assert [r["num_tokens"] for r in got] == [r["num_tokens"] for r in expect]
    for a, b in zip(got, expect):  # batched with other rows: float32 sums in another order
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def _rows(out):
    parts = sorted(f for f in os.listdir(out) if f.startswith("part-"))
    return pa.concat_tables([pq.read_table(out / f) for f in parts]).to_pylist()


@pytest.mark.cluster
def test_dask_lm_score_names_or_drops_a_huge_python_string(client, tiny):
    """A pandas frame of Python strings: the same bound, from the string's length, before tokenizing."""
    frame = pd.DataFrame({"text": ["dask tokens score", "a" * HUGE, "parquet model worker"]}, index=[10, 11, 12])
    with pytest.raises(BadRowError, match=f"row 1 \\(index 11\\), column 'text': {HUGE:,} bytes of text"):
        dask_lm.score(frame, model=tiny["llama"], client=client, text_column="text")
    with pytest.warns(UserWarning, match="1 bad row of 3 left out"):
        out = dask_lm.score(frame, model=tiny["llama"], client=client, text_column="text", skip_bad_rows=True)
    assert list(out.index) == [10, 12]


def test_sft_refuses_a_huge_row_before_tokenizing_it(tiny, tmp_path):
    from dask_lm.io import parquet as pio
    from dask_lm.sft.job import _tokenize_partition

    path = str(_huge_file(tmp_path / "huge.parquet"))
    part = pio.read_partition(path, 0, 0, 3, ["text"])
    with pytest.raises(ValueError, match=f"huge.parquet: row 1, column 'text': {HUGE:,} bytes of text"):
        _tokenize_partition(part, "text", None, None, tiny["tokenizer"], path, 0, max_length=64)
