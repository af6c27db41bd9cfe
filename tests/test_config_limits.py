"""A model config that asks for an impossible model is refused by the driver, naming the key and the file, before
any cluster starts (exit 2): a 10^9 vocabulary, sizes whose parameters no machine holds, JSON nested past what the
code reading it can recurse through. Real models' sizes pass."""

from __future__ import annotations

import json
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import dask_lm
from dask_lm.cli import main as cli


def _model(tiny, tmp_path, **changes) -> pathlib.Path:
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def _command(command: str, model: pathlib.Path, tmp_path: pathlib.Path) -> list[str]:
    if command == "logprobs":
        return ["logprobs", "--model", str(model), "a text"]
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": ["a text", "another text"]}), data)
    return [
        command,
        str(data),
        "--model",
        str(model),
        "--text-column",
        "text",
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
    ]


@pytest.mark.parametrize("command", ["score", "logprobs", "sft"])
def test_a_billion_token_vocabulary_exits_2_before_any_cluster(tiny, tmp_path, no_cluster, command):
    """The tiny model with ``vocab_size`` 10^9: its embedding alone would be 256 GB per worker."""
    model = _model(tiny, tmp_path, vocab_size=10**9)
    result = CliRunner().invoke(cli, _command(command, model, tmp_path))
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert (
        f"{model / 'config.json'}: vocab_size = 1,000,000,000 is larger than any model dask-lm can load (limit "
        "16,777,216" in flat
    ), result.output
    assert not no_cluster and not (tmp_path / "out").exists()


def test_sizes_no_machine_holds_are_refused_naming_the_file(tiny, tmp_path, no_cluster):
    """Each size under its own limit, together about 1.2e15 parameters (2.4 PB in bf16): the MLPs' three
    hidden x intermediate matrices per layer, the rest (the tiny model's 4 x 16-wide attention, embeddings) 0.04%."""
    model = _model(tiny, tmp_path, hidden_size=100_000, intermediate_size=1_000_000, num_hidden_layers=4000)
    result = CliRunner().invoke(cli, _command("score", model, tmp_path))
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    mlps = 4000 * 3 * 100_000 * 1_000_000
    assert f"{model / 'config.json'}: its sizes describe about {mlps:.3g} parameters" in flat, result.output
    assert "hidden_size = 100,000" in flat and "limit 2.2e+12" in flat, result.output
    assert not no_cluster


def test_policy_refuses_impossible_sizes_in_a_nested_config_and_in_overrides(tiny, tmp_path):
    """``Policy`` checks the file before transformers reads it, and the overrides it applies; ``object()`` as the
    cluster fails any use of it, so a refusal shows the check came first."""
    model = _model(tiny, tmp_path, text_config={"vocab_size": 2**30})
    config = model / "config.json"
    with pytest.raises(ValueError, match=rf"{config}: text_config\.vocab_size = 1,073,741,824 is larger"):
        dask_lm.Policy(object(), {"model_name": str(model)}, None, init_optimizer=False, init_reference_model=False)
    with pytest.raises(ValueError, match=r"`policy.hf_config_overrides` .*: vocab_size = 1,000,000,000 is larger"):
        dask_lm.Policy(
            object(),
            {"model_name": tiny["llama"], "hf_config_overrides": {"vocab_size": 10**9}},
            None,
            init_optimizer=False,
            init_reference_model=False,
        )


@pytest.mark.parametrize("depth", [200, 100_000])
def test_a_deeply_nested_config_is_a_value_error_naming_the_file(tiny, tmp_path, no_cluster, depth):
    """200 levels parse, and are refused by the depth limit; 100,000 exhaust json's recursion, which is caught.
    Both for a job (exit 2) and for ``Policy`` (``ValueError``, not ``RecursionError``)."""
    model = tmp_path / "model"
    shutil.copytree(tiny["llama"], model)
    text = (model / "config.json").read_text().rstrip().rstrip("}")
    (model / "config.json").write_text(f'{text}, "nested": {"[" * depth}{"]" * depth}}}')
    result = CliRunner().invoke(cli, _command("score", model, tmp_path))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"{model / 'config.json'} nests" in " ".join(result.output.split()), result.output
    assert not no_cluster
    with pytest.raises(ValueError, match=rf"{model / 'config.json'} nests"):
        dask_lm.Policy(object(), {"model_name": str(model)}, None, init_optimizer=False, init_reference_model=False)


# the sizes of released models, from their config.json (the largest vocabularies, widths, depths, contexts and
# expert counts there are): each must pass, or the limits refuse a real model
REAL = {
    "Llama-3.1-405B": {
        "vocab_size": 128256,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    },
    "DeepSeek-V3": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_routed_experts": 256,
        "max_position_embeddings": 163840,
    },
    "Kimi-K2": {
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "n_routed_experts": 384,
        "max_position_embeddings": 131072,
    },
    "Gemma-3-27B": {
        "model_type": "gemma3",
        "text_config": {
            "vocab_size": 262208,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "head_dim": 128,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
        },
        "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27},
    },
    "Llama-4-Scout": {
        "text_config": {
            "vocab_size": 202048,
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48,
            "num_local_experts": 16,
            "max_position_embeddings": 10485760,
        }
    },
    "GPT-2-XL": {"vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25, "n_positions": 1024},
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_models_pass(name):
    from dask_lm.io.config_limits import check_config_limits

    check_config_limits(REAL[name], f"{name}/config.json")
