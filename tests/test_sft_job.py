"""`dask-lm sft`: NLL fine-tuning over parquet with resumable checkpoints."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner

from dask_lm.cli import main as cli
from dask_lm.jobs import interrupts
from dask_lm.sft import job as sft
from dask_lm.sft.job import sft_parquet

pytestmark = pytest.mark.cluster

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "dask runs tasks on workers",
    "tokens become logprobs",
    "gradients flow backwards",
    "the loss goes down",
    "two ranks agree",
    "parquet holds columns",
    "checkpoints appear whole",
    "resume continues the run",
]


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "sft.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": [c.split()[0] for c in CORPUS],
                "response": [" " + " ".join(c.split()[1:]) for c in CORPUS],
                "text": CORPUS,
            }
        ),
        path,
        row_group_size=4,
    )
    return path


def _run(data, out, tiny, client, **kw):
    args = dict(
        model=tiny["llama"],
        client=client,
        text_column="text",
        global_batch_size=4,
        micro_batch_size=2,
        lr=3e-3,
        epochs=3,
        save_every=2,
        keep=2,
        progress=False,
    )
    args.update(kw)
    return sft_parquet(data, out, **args)


def test_interrupted_then_resumed_equals_one_run(client, tiny, data, tmp_path, monkeypatch):
    """Interrupted once step 4 of 9 is saved, resumed given nothing but the output (the options are the
    manifest's): the losses and the final weights equal one uninterrupted run."""
    whole = _run(data, tmp_path / "whole", tiny, client)
    assert whole.steps == 9 and whole.losses[-1] < whole.losses[0]
    # three epochs of every row's tokens (the padding rows of a short last batch are not counted)
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    assert whole.tokens == 3 * sum(1 + len(ids) for ids in tok(CORPUS)["input_ids"])  # each text after BOS
    assert 0 < whole.checkpoint_seconds < whole.seconds and 0 < whole.train_seconds < whole.seconds
    save = sft._save

    def save_then_interrupt(policy, output, state, keep):  # Ctrl-C just after step 4's checkpoint
        save(policy, output, state, keep)
        if state["step"] == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(sft, "_save", save_then_interrupt)
        with pytest.raises(interrupts.JobInterrupted, match="checkpoint step_4 kept"):
            _run(data, tmp_path / "part", tiny, client)
    resumed = sft_parquet(None, tmp_path / "part", client=client, resume=True, progress=False)
    assert resumed.resumed_from == 4
    assert resumed.losses == pytest.approx(whole.losses, abs=1e-5)
    # the totals are the trained model's (all 9 steps), this run's 5 steps apart; _SUCCESS says the same
    first4 = sum(
        1 + len(ids)
        for s in range(4)
        for ids, _ in sft._step_rows([(tok(c)["input_ids"], 1) for c in CORPUS], s, 4, 0, True)
    )
    assert resumed.tokens == whole.tokens == whole.run_tokens and resumed.run_tokens == whole.tokens - first4
    assert json.loads((tmp_path / "part" / "_SUCCESS").read_text())["tokens"] == whole.tokens
    done = _run(data, tmp_path / "part", tiny, client, resume=True)
    assert done.already_complete and done.tokens == whole.tokens
    steps = sorted(d for d in os.listdir(tmp_path / "part") if d.startswith("step_"))
    assert steps == ["step_8", "step_9"]  # keep=2
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "step_9" / "weights").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "step_9" / "weights").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)
    state = json.loads((tmp_path / "part" / "step_9" / "training_state.json").read_text())
    assert state["step"] == 9
    with pytest.raises(ValueError, match=r"resume=True refused: .* different options: lr was 0.003, now 0.001 "):
        sft_parquet(None, tmp_path / "part", client=client, resume=True, lr=1e-3)


def test_cli_prompt_response_and_bad_input(client, tiny, data, tmp_path):
    out = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "sft",
            str(data),
            "--model",
            tiny["llama"],
            "--output",
            str(out),
            "--prompt-column",
            "prompt",
            "--response-column",
            "response",
            "--max-steps",
            "2",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--save-every",
            "1",
            "--no-progress",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "steps       2" in result.output and (out / "step_2" / "weights" / "config.json").exists()
    assert result.output.startswith("steps ") and "loading the model" not in result.output  # --no-progress: no bar
    # --resume alone: the run reached its --max-steps 2, so it returns at once
    resumed = runner.invoke(
        cli, ["sft", "--output", str(out), "--resume", "--scheduler-address", client.scheduler.address]
    )
    assert resumed.exit_code == 0 and resumed.output.startswith(f"already complete: the run in {out} reached step 2")
    # a larger --max-steps trains on, and is what the next --resume goes by
    longer = runner.invoke(
        cli,
        [
            "sft",
            "--output",
            str(out),
            "--resume",
            "--max-steps",
            "3",
            "--no-progress",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert longer.exit_code == 0 and "steps       3 " in longer.output and "resumed from step 2" in longer.output
    again = runner.invoke(
        cli, ["sft", "--output", str(out), "--resume", "--scheduler-address", client.scheduler.address]
    )
    assert again.exit_code == 0 and again.output.startswith(f"already complete: the run in {out} reached step 3")
    again = runner.invoke(
        cli,
        [
            "sft",
            str(data),
            "--model",
            tiny["llama"],
            "--output",
            str(out),
            "--text-column",
            "text",
            "--scheduler-address",
            client.scheduler.address,
        ],
    )
    assert again.exit_code == 2 and "holds a finished dask-lm sft run" in again.output, again.output
    bad = runner.invoke(
        cli, ["sft", str(data), "--model", tiny["llama"], "--output", str(tmp_path / "x"), "--text-column", "nope"]
    )
    assert bad.exit_code == 2 and "column 'nope' is missing" in bad.output
    assert not (tmp_path / "x").exists()
