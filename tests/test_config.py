"""Config: NeMo RL key names, documented defaults, errors that name the dotted key."""

from __future__ import annotations

import pytest

from dask_lm import PolicyConfig


def test_defaults_and_derived_values():
    cfg = PolicyConfig.from_dict({"model_name": "m", "train_micro_batch_size": 3, "max_total_sequence_length": 100})
    assert cfg.logprob_batch_size == 3 and cfg.precision == "bfloat16"
    assert cfg.dynamic_batching.logprob_mb_tokens == 300 and cfg.sequence_packing.train_mb_tokens == 300
    assert cfg.tokenizer.name == "m" and cfg["dtensor_cfg"]["_v2"] is True
    assert PolicyConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("data, key", [
    ({}, "policy.model_name"),
    ({"model_name": "m", "learning_rate": 1}, "policy.learning_rate"),
    ({"model_name": "m", "precision": "fp8"}, "policy.precision"),
    ({"model_name": "m", "train_micro_batch_size": "4"}, "policy.train_micro_batch_size"),
    ({"model_name": "m", "dynamic_batching": {"enabled": "yes"}}, "policy.dynamic_batching.enabled"),
    ({"model_name": "m", "dynamic_batching": {"logprob_mb_token": 5}}, "policy.dynamic_batching.logprob_mb_token"),
    ({"model_name": "m", "sequence_packing": {"algorithm": "best_fit"}}, "policy.sequence_packing.algorithm"),
    ({"model_name": "m", "dtensor_cfg": {"tensor_parallel_size": 2}}, "policy.dtensor_cfg.tensor_parallel_size"),
    ({"model_name": "m", "generation": {"temperature": 0}}, "policy.generation.temperature"),
    ({"model_name": "m", "dynamic_batching": {"enabled": True}, "sequence_packing": {"enabled": True}},
     "policy.dynamic_batching.enabled"),
    ({"model_name": "m", "megatron_cfg": {"enabled": True}}, "policy.megatron_cfg.enabled"),
    ({"model_name": "m", "train_compile": True, "dtensor_cfg": {"activation_checkpointing": True}},
     "policy.train_compile"),
    ({"model_name": "m", "train_compile": "yes"}, "policy.train_compile"),
])
def test_errors_name_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        PolicyConfig.from_dict(data)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ValueError, match="did you mean `policy.logprob_batch_size`"):
        PolicyConfig.from_dict({"model_name": "m", "logprob_batchsize": 2})


def test_yaml_with_policy_section(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("policy:\n  model_name: m\n  precision: float32\n  sequence_packing:\n    enabled: true\n")
    cfg = PolicyConfig.from_yaml(str(path))
    assert cfg.precision == "float32" and cfg.sequence_packing.enabled
