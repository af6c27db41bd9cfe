"""Which modules the scoring replica's liger patch takes (model/liger_layers.py), on the CPU: the Llama-family
RMSNorms and SiLU-gated MLPs only, never a CPU model's forward. The kernels' numbers are checked against HF's
modules on the GPU (tests/test_gpu_kernels.py)."""

from __future__ import annotations

import torch
import transformers

from dask_lm.model import liger_layers


def _model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_config(config)


def test_targets_are_the_llama_family_norms_and_silu_mlps(tiny):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"])
    norms, mlps = liger_layers.targets(model)
    layers = model.config.num_hidden_layers
    assert len(norms) == 2 * layers + 1 and len(mlps) == layers
    assert {type(m).__name__ for m in norms} == {"Qwen2RMSNorm"} and {type(m).__name__ for m in mlps} == {"Qwen2MLP"}


def test_other_formulas_are_left_alone():
    small = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    gelu = _model(transformers.Qwen2Config(hidden_act="gelu", **small))
    norms, mlps = liger_layers.targets(gelu)
    assert len(norms) == 5 and mlps == []  # a GELU gate is not liger's SiLU product
    gemma = _model(transformers.GemmaConfig(**small))  # Gemma's norm scales by 1 + weight in float32
    assert liger_layers.targets(gemma) == ([], [])


def test_a_cpu_model_is_never_patched(tiny):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"])
    ids = torch.randint(3, 100, (2, 17))
    with torch.no_grad():
        before = model(ids).logits
        assert liger_layers.patch(model) == 0
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert torch.equal(model(ids).logits, before)
