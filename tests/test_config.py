"""Config: NeMo RL key names, documented defaults, errors that name the dotted key."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dask_lm import PolicyConfig


def test_defaults_and_derived_values():
    cfg = PolicyConfig.from_dict({"model_name": "m", "train_micro_batch_size": 3, "max_total_sequence_length": 100})
    assert cfg.logprob_batch_size == 3 and cfg.precision == "bfloat16"
    assert cfg.dynamic_batching.logprob_mb_tokens == 300 and cfg.sequence_packing.train_mb_tokens == 300
    assert cfg.tokenizer.name == "m" and cfg["dtensor_cfg"]["_v2"] is True
    assert PolicyConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "data, key",
    [
        ({}, "policy.model_name"),
        ({"model_name": "m", "lr": 1}, "policy.lr"),
        ({"model_name": "m", "precision": "fp8"}, "policy.precision"),
        ({"model_name": "m", "train_micro_batch_size": "4"}, "policy.train_micro_batch_size"),
        ({"model_name": "m", "dynamic_batching": {"enabled": "yes"}}, "policy.dynamic_batching.enabled"),
        ({"model_name": "m", "dynamic_batching": {"logprob_mb_token": 5}}, "policy.dynamic_batching.logprob_mb_token"),
        ({"model_name": "m", "sequence_packing": {"algorithm": "best_fit"}}, "policy.sequence_packing.algorithm"),
        ({"model_name": "m", "dtensor_cfg": {"tensor_parallel_size": 2}}, "policy.dtensor_cfg.tensor_parallel_size"),
        ({"model_name": "m", "generation": {"temperature": 0}}, "policy.generation.temperature"),
        (
            {"model_name": "m", "dynamic_batching": {"enabled": True}, "sequence_packing": {"enabled": True}},
            "policy.dynamic_batching.enabled",
        ),
        ({"model_name": "m", "megatron_cfg": {"enabled": True}}, "policy.megatron_cfg.enabled"),
        (
            {"model_name": "m", "train_compile": True, "dtensor_cfg": {"activation_checkpointing": True}},
            "policy.train_compile",
        ),
        ({"model_name": "m", "train_compile": "yes"}, "policy.train_compile"),
        ({"model_name": "m", "generation": {"backend": "hff"}}, "policy.generation.backend"),
        (
            {"model_name": "m", "generation": {"sglang_cfg": {"server_urls": "http://h:1"}}},
            "policy.generation.sglang_cfg.server_urls",
        ),
        ({"model_name": "m", "generation": {"sglang_cfg": {"retries": "3"}}}, "policy.generation.sglang_cfg.retries"),
        (
            {"model_name": "m", "generation": {"sglang_cfg": {"rows_per_request": 0}}},
            "policy.generation.sglang_cfg.rows_per_request",
        ),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        PolicyConfig.from_dict(data)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ValueError, match=r"did you mean `policy.logprob_batch_size`"):
        PolicyConfig.from_dict({"model_name": "m", "logprob_batchsize": 2})


def test_yaml_with_policy_section(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("policy:\n  model_name: m\n  precision: float32\n  sequence_packing:\n    enabled: true\n")
    cfg = PolicyConfig.from_yaml(str(path))
    assert cfg.precision == "float32" and cfg.sequence_packing.enabled


@pytest.mark.parametrize(
    "data, key",
    [
        ({"dtensor_cfg": {"cpu_offload": True}}, "policy.dtensor_cfg.cpu_offload"),
        ({"dtensor_cfg": {"context_parallel_size": 2}}, "policy.dtensor_cfg.context_parallel_size"),
        ({"dtensor_cfg": {"dp_replicate_size": 2}}, "policy.dtensor_cfg.dp_replicate_size"),
        ({"dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 8}}}, "policy.dtensor_cfg.lora_cfg"),
        (
            {"dtensor_cfg": {"automodel_kwargs": {"freeze_config": {"freeze_language_model": True}}}},
            "policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_language_model",
        ),
        ({"draft": {"enabled": True}}, "policy.draft"),
        ({"router_replay": {"enabled": True}}, "policy.router_replay"),
        ({"quant_cfg": {"fp8": True}}, "policy.quant_cfg"),
        ({"is_vlm": True}, "policy.is_vlm"),
        ({"tokenizer": {"use_processor": True}}, "policy.tokenizer.use_processor"),
    ],
)
def test_keys_that_would_change_results_are_refused(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r"` = .* is not supported: "):
        PolicyConfig.from_dict({"model_name": "m", **data})


@pytest.mark.parametrize(
    "key, value",
    [
        ("dtensor_cfg.sequence_parallel", True),
        ("dtensor_cfg.defer_fsdp_grad_sync", True),
        ("dtensor_cfg.clear_cache_every_n_steps", 10),
        ("dtensor_cfg.custom_parallel_plan", "my.plan"),
        ("dtensor_cfg.moe_parallelizer", {"ignore_router_for_ac": True}),
        ("generation_batch_size", 64),
        ("pretrained_checkpoint", {"path": "/ckpt/megatron"}),
        ("tokenizer.chat_template", "{{ messages }}"),
        ("tokenizer.use_fastokens", True),
    ],
)
def test_performance_knobs_warn_and_are_kept(key, value):
    section, _, name = key.rpartition(".")
    data = {"model_name": "m", **({section: {name: value}} if section else {name: value})}
    with pytest.warns(UserWarning, match=re.escape(f"- `policy.{key}` = ") + ".*: "):
        cfg = PolicyConfig.from_dict(data)
    assert (cfg[section][name] if section else cfg[name]) == value  # kept as given: to_dict() round-trips it


def test_inert_values_are_accepted_silently():
    import warnings

    inert = {
        "model_name": "m",
        "generation_batch_size": 32,
        "draft": {"enabled": False, "num_layers": 1},
        "router_replay": {"enabled": False},
        "pretrained_checkpoint": None,
        "quant_cfg": None,
        "tokenizer": {"chat_template": "default", "use_fastokens": False},
        "dtensor_cfg": {
            "_v2": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "sequence_parallel": False,
            "cpu_offload": False,
            "defer_fsdp_grad_sync": False,
            "clear_cache_every_n_steps": None,
            "lora_cfg": {"enabled": False, "dim": 8},
            "automodel_kwargs": {},
        },
        "generation": {"colocated": {"enabled": True}, "vllm_cfg": {"tensor_parallel_size": 4}, "model_name": "m"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PolicyConfig.from_dict(inert)


def test_every_unhonoured_key_is_a_config_key():
    from dask_lm import config
    from dask_lm.config.keys import UNHONOURED

    cfg = PolicyConfig.from_dict({"model_name": "m", "generation": {}})
    for key, action, _inert, reason in UNHONOURED:
        owner: object = cfg
        for name in key.split("."):  # down the sections, to the field that holds the key (or a mapping above it)
            if not dataclasses.is_dataclass(owner):
                break  # a key inside a plain mapping (dtensor_cfg.automodel_kwargs.*): its field was found above
            assert name in {f.metadata.get("key", f.name) for f in dataclasses.fields(owner)}, key
            owner = owner[name] if owner[name] is not None else {"sglang_cfg": config.SGLangConfig}.get(name, dict)()
        assert action in ("refuse", "warn", "accept") and reason


def test_a_disabled_megatron_section_as_nemo_rl_ships_it_loads():
    """NeMo RL's examples/configs/grpo_math_1B.yaml carries a whole megatron_cfg with enabled: false (keys from that
    file, interpolations resolved): it loads, its keys kept aside; enabled: true is still refused."""
    megatron = {
        "enabled": False,
        "empty_unused_memory_level": 0,
        "activation_checkpointing": False,
        "converter_type": "Qwen2ForCausalLM",
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "pipeline_dtype": "bfloat16",
        "optimizer": {"optimizer": "adam", "lr": 5.0e-6},
        "scheduler": {"lr_decay_style": "constant"},
        "distributed_data_parallel_config": {"overlap_grad_reduce": True},
        "fp8_cfg": None,
        "env_vars": None,
    }
    cfg = PolicyConfig.from_dict({"model_name": "m", "megatron_cfg": megatron})
    assert cfg.megatron_cfg.enabled is False
    assert cfg.megatron_cfg.extra["tensor_model_parallel_size"] == 1
    assert cfg.megatron_cfg.extra["optimizer"] == {"optimizer": "adam", "lr": 5.0e-6}
    with pytest.raises(ValueError, match=r"policy.megatron_cfg.enabled"):
        PolicyConfig.from_dict({"model_name": "m", "megatron_cfg": {**megatron, "enabled": True}})


def test_generation_backend_is_a_checked_choice():
    """Every backend name NeMo RL configs use loads; those NeMo RL runs beside its Policy (which generate() refuses)
    with a warning naming them; anything else fails when the config is read, naming the key and the allowed values."""
    import warnings

    for backend in ("hf", "dtensor", "megatron", "sglang"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert (
                PolicyConfig.from_dict({"model_name": "m", "generation": {"backend": backend}}).generation.backend
                == backend
            )
    for backend in ("vllm", "trtllm", "dynamo"):
        with pytest.warns(UserWarning, match=f"`policy.generation.backend` = '{backend}': .*generate\\(\\) refuses"):
            assert (
                PolicyConfig.from_dict({"model_name": "m", "generation": {"backend": backend}}).generation.backend
                == backend
            )
    with pytest.raises(ValueError) as e:
        PolicyConfig.from_dict({"model_name": "m", "generation": {"backend": "sglan"}})
    assert "`policy.generation.backend`" in str(e.value) and "'sglang'" in str(e.value) and "'hf'" in str(e.value)


def test_sglang_cfg_is_typed_and_keeps_nemo_rls_server_options():
    """The dict form loads into a typed section; NeMo RL's options for the servers it launches itself (SGLang's
    ServerArgs, which its TypedDict lists and does not check at run time) load too, kept aside unread."""
    from dask_lm.config import SGLangConfig

    sglang = {
        "server_urls": ["http://h:30000"],
        "retries": 1,
        "model_path": "/m",
        "mem_fraction_static": 0.7,
        "sglang_server_config": {"needs_offload": True},
    }
    cfg = PolicyConfig.from_dict({"model_name": "m", "generation": {"backend": "sglang", "sglang_cfg": sglang}})
    sg = cfg.generation.sglang_cfg
    assert isinstance(sg, SGLangConfig) and sg.server_urls == ["http://h:30000"] and sg.retries == 1
    assert (sg.rows_per_request, sg.timeout_s) == (64, 600.0)  # the defaults generate() used before it was typed
    assert sg.extra == {"model_path": "/m", "mem_fraction_static": 0.7, "sglang_server_config": {"needs_offload": True}}
    assert sg["server_urls"] == ["http://h:30000"]  # NeMo RL code reading it as a dict still works
    assert PolicyConfig.from_dict(cfg.to_dict()) == cfg  # what the ranks rebuild


def test_the_config_reference_table_is_the_generated_one():
    """docs/reference/config.md holds exactly what ``python -m dask_lm.config.doc`` generates from the fields'
    docstrings, and every field has one: the page cannot drift from the code."""
    from dask_lm.config import doc

    assert doc.current() == doc.markdown(), "stale: run `python -m dask_lm.config.doc --write`"
    for field in dataclasses.fields(PolicyConfig):
        key = field.metadata.get("key", field.name)
        assert f"| `policy.{key}` |" in doc.current(), key
