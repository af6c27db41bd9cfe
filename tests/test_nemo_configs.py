"""NeMo RL's configs load: a ``policy`` section shaped as NeMo RL's own (keys from its typed configs and from its
example, recipe and unit-test configs at 7ea279a, written here since CI cannot fetch NeMo RL) is accepted, each key
it carries honoured, reported in the one warning, or refused by name; a key NeMo RL has no such name for is still
refused with the close one suggested. ``tools/nemo_rl_configs.py`` runs the same checks on NeMo RL's real files."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from dask_lm import PolicyConfig


def grpo_policy() -> dict:
    """The policy section of NeMo RL's examples/configs/grpo_math_1B.yaml as its loader resolves it (the keys that
    matter here; the values its file gives), with the other keys gaps 2 and 6 of issue 46 name."""
    return {
        "model_name": "Qwen/Qwen2.5-1.5B",
        "tokenizer": {"name": "Qwen/Qwen2.5-1.5B", "chat_template_kwargs": None, "use_fastokens": False},
        "train_global_batch_size": 512,
        "train_micro_batch_size": 4,
        "generation_batch_size": 32,
        "logprob_batch_size": 4,
        "max_total_sequence_length": 512,
        "precision": "bfloat16",
        "logprob_chunk_size": None,
        "offload_optimizer_for_logprob": False,
        "learning_rate": 5e-6,  # NeMo RL's unit-test config carries it; NeMo RL reads optimizer.kwargs.lr
        "activation_checkpointing_enabled": False,  # in its rm.yaml; NeMo RL reads no such key
        "dequantize_base_checkpoint": True,  # read by NeMo RL's DTensor v2 worker (Automodel's checkpointer)
        "dtensor_cfg": {
            "_v2": True,
            "enabled": True,
            "cpu_offload": False,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "custom_parallel_plan": None,
            "env_vars": {},
            "lora_cfg": {
                "enabled": False,
                "target_modules": [],
                "exclude_modules": [],
                "match_all_linear": True,
                "dim": 8,
                "alpha": 32,
                "dropout": 0.0,
                "dropout_position": "post",
                "lora_A_init": "xavier",
                "use_triton": True,
            },
            # the LoRA section of NeMo RL's unit-test config (tests/unit/models/policy/test_dtensor_worker.py)
            "lora": {
                "enabled": False,
                "target_modules": [],
                "exclude_modules": [],
                "match_all_linear": True,
                "dim": 32,
                "alpha": 32,
                "dropout": 0.0,
                "dropout_position": "post",
                "lora_A_init": "xavier",
            },
            "automodel_kwargs": {
                "use_liger_kernel": True,
                "force_hf": True,
                "freeze_config": {
                    "freeze_audio_tower": True,
                    "freeze_language_model": False,
                    "freeze_vision_tower": True,
                },
            },
        },
        "megatron_cfg": {"enabled": False, "tensor_model_parallel_size": 1, "optimizer": {"optimizer": "adam"}},
        "dynamic_batching": {
            "enabled": False,
            "train_mb_tokens": 2048,
            "logprob_mb_tokens": 2048,
            "sequence_length_round": 64,
        },
        "sequence_packing": {
            "enabled": True,
            "train_mb_tokens": 2048,
            "logprob_mb_tokens": 2048,
            "algorithm": "modified_first_fit_decreasing",
            "sequence_length_round": 64,
            "microbatch_order": "packer",
            "fuse_loss": True,
        },
        "make_sequence_length_divisible_by": 1,
        "max_grad_norm": 1.0,
        "optimizer": {
            "name": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
            "kwargs": {
                "lr": 5e-6,
                "weight_decay": 0.01,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "master_weights": True,
                "store_param_remainders": True,
                "exp_avg_dtype": "torch.bfloat16",
                "exp_avg_sq_dtype": "torch.bfloat16",
            },
        },
        "scheduler": [
            {
                "name": "torch.optim.lr_scheduler.LinearLR",
                "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 50},
            },
            {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10000000000}},
            {"milestones": [50]},
        ],
        "generation": {
            "backend": "vllm",
            "max_new_tokens": 512,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "val_temperature": 0.6,
            "val_top_p": 1.0,
            "val_top_k": None,  # validation hotter than training
            "stop_token_ids": None,
            "stop_strings": None,
            "model_name": "Qwen/Qwen2.5-1.5B",
            "port_range_low": 3000,
            "port_range_high": 4999,
            "use_async_rollouts": False,
            "refit_transport": None,
            "real_quant_export_cpu_offload": True,
            "refit_cfg": {"nixl": {"backend_name": "UCX", "device": "cuda"}, "sparse": {"request_timeout_s": 600.0}},
            "mcore_generation_config": {"buffer_size_gb": 20, "block_size_tokens": 256, "num_cuda_graphs": 16},
            "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
            "vllm_cfg": {"async_engine": False, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.6},
            "vllm_kwargs": {},
        },
    }


def _load(data: dict) -> tuple[PolicyConfig, list[str]]:
    """The config and the warning lines of its one warning (``- `policy.key` = value: what it does here``)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        cfg = PolicyConfig.from_dict(data)
    ours = [w for w in got if "NeMo RL config key" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in got]  # one warning for the whole config
    return cfg, [line for line in str(ours[0].message).splitlines() if line.startswith("- ")]


def _line(lines: list[str], key: str) -> str:
    found = [line for line in lines if line.startswith(f"- `policy.{key}` = ")]
    assert len(found) == 1, (key, lines)
    return found[0]


def test_a_nemo_rl_grpo_policy_section_loads_with_one_warning_naming_each_key_that_acts_differently():
    cfg, lines = _load(grpo_policy())
    # each key that acts differently here is named, with what it does here
    assert "optimizer.kwargs.lr" in _line(lines, "learning_rate")
    assert "dtensor_cfg.activation_checkpointing" in _line(lines, "activation_checkpointing_enabled")
    assert "from_pretrained" in _line(lines, "dequantize_base_checkpoint")
    assert "dtensor_cfg.lora_cfg" in _line(lines, "dtensor_cfg.lora")
    assert "Liger" in _line(lines, "dtensor_cfg.automodel_kwargs.use_liger_kernel")
    assert "Megatron backend only" in _line(lines, "sequence_packing.fuse_loss")
    assert "generate() samples with temperature" in _line(lines, "generation.val_temperature")
    assert "generate() refuses" in _line(lines, "generation.backend")
    fused = _line(lines, "optimizer.name")
    assert "torch.optim.AdamW" in fused and "float32, not bfloat16" in fused
    # and only those: keys with no effect here (the ports of servers NeMo RL launches, its vLLM refit, its Megatron
    # engine), or at their inert values (val_top_p equal to top_p, force_hf true, use_async_rollouts false), are
    # accepted silently
    assert len(lines) == 9, lines
    for quiet in (
        "port_range",
        "refit_transport",
        "refit_cfg",
        "real_quant",
        "mcore_generation_config",
        "val_top_p",
        "val_top_k",
        "force_hf",
        "use_async_rollouts",
        "freeze_config",
        "lora_cfg",
    ):
        assert not any(quiet in line.split(" = ")[0] for line in lines), quiet
    # every key is kept as given: NeMo RL code reading the config sees its values
    assert cfg.generation.port_range_low == 3000 and cfg.generation["real_quant_export_cpu_offload"] is True
    assert cfg.generation.val_temperature == 0.6 and cfg.sequence_packing.fuse_loss is True
    assert cfg.dtensor_cfg.lora == grpo_policy()["dtensor_cfg"]["lora"] and cfg.learning_rate == 5e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert PolicyConfig.from_dict(cfg.to_dict()) == cfg  # what the ranks rebuild


@pytest.mark.parametrize("backend", ["trtllm", "dynamo"])
def test_the_generation_engines_nemo_rl_runs_beside_its_policy_load_with_a_warning(backend):
    """NeMo RL builds TRT-LLM / Dynamo generation workers of its own beside the Policy (grpo.py's setup), never
    Policy.generate: their configs load, and the warning says generate() refuses them."""
    data = grpo_policy()
    data["generation"].update(
        backend=backend,
        trtllm_cfg={"async_engine": True, "max_batch_size": 64},
        trtllm_kwargs={"batch_wait_timeout_iters": 32},
        dynamo_cfg={"engine": "vllm"},
    )
    cfg, lines = _load(data)
    assert cfg.generation.backend == backend and cfg.generation.trtllm_cfg == {
        "async_engine": True,
        "max_batch_size": 64,
    }
    assert f"= '{backend}': " in _line(lines, "generation.backend")


def test_a_misspelt_key_is_still_refused_with_the_close_one_suggested():
    data = grpo_policy()
    data["generation"]["val_temprature"] = data["generation"].pop("val_temperature")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "unknown config key `policy.generation.val_temprature`; did you mean `policy.generation.val_temperature`?"
        ),
    ):
        PolicyConfig.from_dict(data)
    data = grpo_policy()
    data["sequence_packing"]["fuse_los"] = data["sequence_packing"].pop("fuse_loss")
    with pytest.raises(ValueError, match=re.escape("did you mean `policy.sequence_packing.fuse_loss`?")):
        PolicyConfig.from_dict(data)


def test_an_automodel_option_that_may_change_the_model_is_refused_by_name():
    """dtensor_cfg.automodel_kwargs goes to NeMo Automodel's from_pretrained: a kernel choice is warned about, a
    change of the model (a fake router, a frozen language model) or a key dask-lm does not know is refused."""
    data = grpo_policy()
    data["dtensor_cfg"]["automodel_kwargs"]["backend"] = {
        "_target_": "nemo_automodel.components.models.common.utils.BackendConfig",
        "attn": "te",
        "linear": "te",
        "rms_norm": "te",
        "enable_deepep": True,
        "fake_balanced_gate": False,
    }
    _, lines = _load(data)
    assert "transformers' modules" in _line(lines, "dtensor_cfg.automodel_kwargs.backend")
    for path, value in (
        (("backend", "fake_balanced_gate"), True),
        (("freeze_config", "freeze_language_model"), True),
        (("output_router_logits",), True),
    ):
        changed = copy.deepcopy(data)
        owner = changed["dtensor_cfg"]["automodel_kwargs"]
        for part in path[:-1]:
            owner = owner[part]
        owner[path[-1]] = value
        key = "policy.dtensor_cfg.automodel_kwargs." + ".".join(path)
        with pytest.raises(ValueError, match=re.escape(f"`{key}` = True is not supported: ")):
            PolicyConfig.from_dict(changed)


@pytest.mark.parametrize(
    "section, key, value, says",
    [
        ("dtensor_cfg", "tensor_parallel_size", 2, "set it to 1"),
        ("dtensor_cfg", "context_parallel_size", 2, "set it to 1"),
        ("dtensor_cfg", "expert_parallel_size", 8, "set it to 1"),
        ("dtensor_cfg", "dp_replicate_size", 2, "no HSDP replicas"),
        ("dtensor_cfg", "cpu_offload", True, "set it to false"),
        ("dtensor_cfg", "lora_cfg", {"enabled": True, "dim": 8}, "set lora_cfg.enabled to false"),
        ("dtensor_cfg", "lora", {"enabled": True, "dim": 32}, "set lora.enabled to false"),
    ],
)
def test_an_enabled_parallelism_or_lora_in_a_nemo_rl_config_is_refused_naming_the_key(section, key, value, says):
    data = grpo_policy()
    data[section][key] = value
    with pytest.raises(
        ValueError, match=re.escape(f"`policy.{section}.{key}` = ") + r".* is not supported: .*" + re.escape(says)
    ):
        PolicyConfig.from_dict(data)


# ---------------------------------------------------------------------------------- Transformer Engine's FusedAdam
def _one_step(optimizer_cfg: dict, p0: torch.Tensor, grad: torch.Tensor) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    from dask_lm.config.optim import check_optim_config
    from dask_lm.workers.optim import build_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = PolicyConfig.from_dict({"model_name": "m", "precision": "float32", "optimizer": optimizer_cfg})
    check_optim_config(cfg)  # the driver's check: Transformer Engine is not installed, and need not be
    param = torch.nn.Parameter(p0.clone())
    optimizer = build_optimizer([param], cfg)
    param.grad = grad.clone()
    optimizer.step()
    return optimizer, param.detach()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_te_fused_adam_runs_as_torch_adam_with_its_update(adam_w_mode):
    """One step of FusedAdam as TE documents it (bias-corrected moments; AdamW: the decay added to the update, Adam:
    to the gradient), written out here, equals the step of the optimizer dask-lm builds for it."""
    torch.manual_seed(0)
    p0, g = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    lr, (b1, b2), eps, wd = 1e-2, (0.8, 0.95), 1e-6, 0.1
    kwargs = {
        "lr": lr,
        "betas": [b1, b2],
        "eps": eps,
        "weight_decay": wd,
        "adam_w_mode": adam_w_mode,
        "master_weights": True,
        "store_param_remainders": True,
        "exp_avg_dtype": "torch.float32",
    }
    optimizer, p1 = _one_step(
        {"name": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "kwargs": kwargs}, p0, g
    )
    grad = g if adam_w_mode else g + wd * p0
    m_hat = (1 - b1) * grad / (1 - b1)
    v_hat = (1 - b2) * grad * grad / (1 - b2)
    update = m_hat / (v_hat.sqrt() + eps) + (wd * p0 if adam_w_mode else 0)
    torch.testing.assert_close(p1, p0 - lr * update, rtol=1e-12, atol=1e-12)
    assert type(optimizer) is (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)


def test_te_fused_adam_defaults_are_its_own_not_torchs():
    """FusedAdam's weight decay defaults to 0 (torch's AdamW: 0.01): named without one, no decay is applied."""
    p0, g = torch.full((4,), 2.0, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    optimizer, p1 = _one_step(
        {"name": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "kwargs": {"lr": 0.1}}, p0, g
    )
    assert optimizer.defaults["weight_decay"] == 0.0 and optimizer.defaults["eps"] == 1e-8
    torch.testing.assert_close(p1, p0 - 0.1 * 0.5 / (0.5 + 1e-8), rtol=1e-12, atol=1e-12)


def test_te_fused_adam_is_built_fused_where_the_device_has_the_fused_step(monkeypatch):
    """What the name promises: one fused kernel per step, torch's own, wherever torch's AdamW would get it."""
    from dask_lm.model import device
    from dask_lm.workers.optim import build_optimizer

    monkeypatch.setattr(device, "fused_optimizer_capable", lambda params: True)  # as on a GPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = PolicyConfig.from_dict({"model_name": "m", "optimizer": grpo_policy()["optimizer"]})
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"]) == (5e-6, 0.01)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"bias_correction": False}, "bias_correction: false"),
        ({"amsgrad": True}, "amsgrad"),
        ({"foreach": False}, "['foreach'] are not keyword arguments of Transformer Engine's FusedAdam"),
    ],
)
def test_te_fused_adam_options_without_a_torch_equivalent_are_refused(kwargs, says):
    data = {
        "model_name": "m",
        "optimizer": {
            "name": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
            "kwargs": {"lr": 1e-6, **kwargs},
        },
    }
    with pytest.raises(ValueError, match=re.escape("`policy.optimizer.kwargs` = ") + ".*" + re.escape(says)):
        PolicyConfig.from_dict(data)


# ------------------------------------------------------------------------------------------- the key table page
def test_the_nemo_rl_key_table_page_is_the_generated_one():
    """docs/reference/nemo_rl_keys.md holds exactly what ``python -m dask_lm.config.nemo_table`` renders from the
    table the config check runs, and it covers the keys of NeMo RL's typed configs with what the check does."""
    from dask_lm.config import nemo_table

    assert nemo_table.current() == nemo_table.markdown(), "stale: run `python -m dask_lm.config.nemo_table --write`"
    status = {s.key: s for s in nemo_table.key_statuses()}
    assert status["dtensor_cfg.tensor_parallel_size"][1:3] == ("refused", "when > 1")
    assert status["generation.val_temperature"][1:3] == ("warned", "when it differs from `generation.temperature`")
    assert status["generation.port_range_low"].status == "no effect"
    assert status["dtensor_cfg.lora"].status == "refused / warned"
    assert status["sequence_packing.algorithm"].status == "honoured"
    assert status["dtensor_cfg.automodel_kwargs.*"].status == "refused"
    assert "inference_packing" not in status  # dask-lm's own keys are on the config reference page
    # the keys of NeMo RL's typed GenerationConfig and its backends' (nemo_rl/models/generation/interfaces.py:197,
    # vllm/config.py:154, sglang/config.py:189, trtllm/config.py:41, megatron/config.py:69), written out here
    for key in (
        "backend",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "val_temperature",
        "val_top_p",
        "val_top_k",
        "model_name",
        "stop_token_ids",
        "stop_strings",
        "bad_words",
        "colocated",
        "port_range_low",
        "port_range_high",
        "use_async_rollouts",
        "_pad_token_id",
        "_mtp_weights_from_refit",
        "_debug_payload_metrics",
        "vllm_cfg",
        "vllm_kwargs",
        "refit_transport",
        "refit_cfg",
        "quant_cfg",
        "real_quant",
        "real_quant_export_cpu_offload",
        "real_quant_ignore",
        "sglang_kwargs",
        "trtllm_cfg",
        "trtllm_kwargs",
        "mcore_generation_config",
        "dynamo_cfg",
    ):
        assert f"generation.{key}" in status, key
