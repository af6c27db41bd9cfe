"""``dask-lm logprobs`` and ``dask-lm score`` tokenize a text differently by default, and both say so: logprobs
leaves a text's first token unscored (``tokenizer(text)``, as ``score --convention separate``), score's default
(``lm-eval``) scores it too, conditioned on BOS. Their help, their output and their numbers agree with that: the
sums are checked against a Hugging Face forward of each encoding."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli

TEXTS = ["the dask tokens of a score", "parquet rows with a model"]


def test_both_helps_name_the_convention_and_the_difference():
    logprobs = " ".join(CliRunner().invoke(cli, ["logprobs", "--help"]).output.split())
    score = " ".join(CliRunner().invoke(cli, ["score", "--help"]).output.split())
    assert "its first token has no context, so it is not scored" in logprobs, logprobs
    assert "(dask-lm score --convention separate)" in logprobs and "default convention (lm-eval)" in logprobs
    assert (
        "By default (--convention lm-eval) every token of a text is scored, the first one conditioned on BOS" in score
    ), score
    assert "dask-lm logprobs leaves a text's first token unscored, as --convention separate does" in score


def _hf_sum(model, ids: list[int]) -> float:
    """Sum of log p(token_i | tokens_<i) for i >= 1: every token of ``ids`` but the first, scored."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return float(lp.sum())


@pytest.mark.cluster
def test_each_command_names_its_convention_and_computes_it(client, tiny, tmp_path):
    model_dir = tiny["llama"]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = [tok(t)["input_ids"] for t in TEXTS]
    assert all(ids[0] != tok.bos_token_id for ids in encoded)  # a tokenizer that adds no BOS: the two differ
    separate = [_hf_sum(hf, ids) for ids in encoded]
    lm_eval = [_hf_sum(hf, [tok.bos_token_id, *ids]) for ids in encoded]
    assert all(abs(a - b) > 0.01 for a, b in zip(separate, lm_eval))

    address = client.scheduler.address
    base = ["logprobs", "--model", model_dir, "--scheduler-address", address, "--precision", "fp32"]
    table = CliRunner().invoke(cli, [*base, *TEXTS])
    assert table.exit_code == 0, table.output
    assert (
        "convention: separate: each text as tokenizer(text) encodes it, its first token unscored (sums over "
        "tokens 2..n, as dask-lm logprobs)" in table.output
    ), table.output
    as_json = CliRunner().invoke(cli, [*base, "--json", *TEXTS])
    assert as_json.exit_code == 0, as_json.output
    lines = [line.rsplit("\r", 1)[-1].strip() for line in as_json.output.split("\n")]  # the bar's \r lines aside
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["convention"] for r in records] == ["separate", "separate"]
    assert [r["sum_logprob"] for r in records] == pytest.approx(separate, abs=1e-3)

    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": TEXTS}), data)
    for convention, expected, line in (
        (
            "lm-eval",
            lm_eval,
            "lm-eval: every token of each text scored, the first one conditioned on BOS (EOS "
            "when the tokenizer has no BOS), as lm-evaluation-harness scores a text",
        ),
        ("separate", separate, "separate: each text as tokenizer(text) encodes it, its first token unscored"),
    ):
        out = tmp_path / convention
        result = CliRunner().invoke(
            cli,
            [
                "score",
                str(data),
                "--model",
                model_dir,
                "--text-column",
                "text",
                "--output",
                str(out),
                "--convention",
                convention,
                "--precision",
                "fp32",
                "--scheduler-address",
                address,
                "--no-progress",
            ],
        )
        assert result.exit_code == 0, result.output
        assert _summary(result.output)["convention"].startswith(line), result.output
        assert json.loads((out / "_SUCCESS").read_text())["convention"].startswith(line)
        assert dask_lm.read_scores(out)["sum_logprob"].tolist() == pytest.approx(expected, abs=1e-3)
    # a finished output's --resume prints its summary at once, the convention its manifest pins included
    again = CliRunner().invoke(cli, ["score", "--output", str(tmp_path / "separate"), "--resume", "--no-progress"])
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    assert _summary(again.output)["convention"].startswith("separate: each text as tokenizer(text)"), again.output


def _summary(output: str) -> dict[str, str]:
    return {row.split("  ", 1)[0]: row.split("  ", 1)[1].strip() for row in output.splitlines() if "  " in row}
