"""The driver's model check: refuses, from the config alone, the models the ranks could not run.

Toy architectures are defined here and registered with transformers' Auto classes (as a user's own model would
be), each missing one thing the workers need. Every refusal is also checked against the worker code itself: the
same toy built for real (tiny, on the CPU) makes the worker's lookup fail, so the driver and the ranks agree.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from dask_lm import PolicyConfig
from dask_lm.model.forward import decoder_of
from dask_lm.model.hf import check_policy_model, fsdp_blocks, model_class
from dask_lm.model.logprobs import output_head


class ToyConfig(PretrainedConfig):
    model_type = "dask_lm_test_toy"

    def __init__(self, vocab_size: int = 16, hidden_size: int = 8, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kwargs)


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)


class ToyBody(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ToyBlock(config.hidden_size) for _ in range(2)])


class ToyForCausalLM(PreTrainedModel):
    """Has everything: blocks named in _no_split_modules, a decoder, output embeddings."""

    config_class = ToyConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str] | None] = ["ToyBlock"]

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.model = ToyBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head


def _variant(name: str, **attrs) -> tuple[type, type]:
    """A config type of its own (the Auto mappings are keyed by config class) and a model class for it."""

    class VariantConfig(PretrainedConfig):
        model_type = f"dask_lm_test_{name.lower()}"

        def __init__(self, vocab_size: int = 16, hidden_size: int = 8, **kwargs):
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            super().__init__(**kwargs)

    cfg_cls = VariantConfig
    model_cls = type(f"{name}ForCausalLM", (ToyForCausalLM,), {"config_class": cfg_cls, **attrs})
    transformers.AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
    transformers.AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)
    return cfg_cls, model_cls


transformers.AutoConfig.register(ToyConfig.model_type, ToyConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(ToyConfig, ToyForCausalLM, exist_ok=True)
NO_BLOCKS = _variant("NoBlocks", _no_split_modules=None)
WRONG_BLOCKS = _variant("WrongBlocks", _no_split_modules=["LlamaDecoderLayer"])  # names no submodule of the toy
NO_DECODER = _variant("NoDecoder", base_model_prefix="transformer", get_decoder=lambda self: self)
NO_HEAD = _variant("NoHead", get_output_embeddings=lambda self: None)


def _cfg(reward: bool = False) -> PolicyConfig:
    return PolicyConfig.from_dict({"model_name": "/models/toy", "reward_model_cfg": {"enabled": reward}})


def _llama(**kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **kw,
    )


def _real(variant: tuple[type, type]) -> nn.Module:
    cfg_cls, model_cls = variant
    return model_cls(cfg_cls())


@pytest.mark.parametrize("world_size", [1, 2])
def test_standard_models_pass(world_size):
    check_policy_model(_llama(architectures=["LlamaForCausalLM"]), _cfg(), world_size=world_size)
    check_policy_model(_llama(), _cfg(reward=True), world_size=world_size)
    check_policy_model(ToyConfig(), _cfg(), world_size=world_size)


def test_a_70b_sized_config_is_checked_without_allocating_it():
    # 80 layers of width 8192: ~70e9 parameters, 280 GB in fp32, far beyond this machine; on the meta device the
    # structure costs nothing, so the check completes
    big = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    check_policy_model(big, _cfg(), world_size=8)


def test_architecture_without_a_causal_lm_class_is_refused():
    t5 = transformers.T5Config(
        num_layers=1, d_model=8, d_ff=16, num_heads=1, architectures=["T5ForConditionalGeneration"]
    )
    assert model_class(t5, reward_model=False) is None
    with pytest.raises(
        ValueError,
        match=r"`policy\.model_name` = '/models/toy' \(T5ForConditionalGeneration\).*"
        r"no causal-LM class for model type 't5'",
    ):
        check_policy_model(t5, _cfg(), world_size=1)


def test_reward_model_needs_a_sequence_classification_class():
    # the toy registers a causal LM only
    assert model_class(ToyConfig(), reward_model=True) is None
    with pytest.raises(ValueError, match=r"no sequence-classification class for model type 'dask_lm_test_toy'"):
        check_policy_model(ToyConfig(), _cfg(reward=True), world_size=1)


def test_reward_model_needs_a_score_head():
    # BertForSequenceClassification calls its head `classifier`; the worker's score() reads `model.score`
    bert = transformers.BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=16,
        architectures=["BertForSequenceClassification"],
    )
    real = transformers.BertForSequenceClassification(bert)
    assert getattr(real, "score", None) is None  # what the worker's assert would trip on
    with pytest.raises(ValueError, match=r"\(BertForSequenceClassification\).*has no `score` head"):
        check_policy_model(bert, _cfg(reward=True), world_size=1)


@pytest.mark.parametrize("variant", [NO_BLOCKS, WRONG_BLOCKS], ids=["none-declared", "names-no-submodule"])
def test_sharding_needs_blocks_named_by_no_split_modules(variant):
    assert fsdp_blocks(_real(variant)) == []  # the rule _apply_fsdp shards by finds nothing in the real model
    check_policy_model(variant[0](), _cfg(), world_size=1)  # one rank does not shard: fine
    with pytest.raises(ValueError, match=r"declares no transformer block to shard by.*across 2 ranks"):
        check_policy_model(variant[0](), _cfg(), world_size=2)


def test_fsdp_blocks_matches_the_declared_class():
    blocks = fsdp_blocks(_real((ToyConfig, ToyForCausalLM)))
    assert len(blocks) == 2 and all(type(b) is ToyBlock for b in blocks)


def test_a_model_whose_decoder_cannot_be_found_is_refused():
    with pytest.raises(AssertionError, match="cannot find the decoder"):
        decoder_of(_real(NO_DECODER))  # the worker's own lookup fails on the real model
    with pytest.raises(ValueError, match=r"cannot find the decoder inside NoDecoderForCausalLM.*`transformer`"):
        check_policy_model(NO_DECODER[0](), _cfg(), world_size=1)


def test_a_causal_lm_without_output_embeddings_is_refused():
    with pytest.raises(AssertionError, match="has no output embeddings"):
        output_head(_real(NO_HEAD))  # the worker's own lookup fails on the real model
    with pytest.raises(ValueError, match=r"NoHeadForCausalLM has no output embeddings"):
        check_policy_model(NO_HEAD[0](), _cfg(), world_size=1)


def test_the_check_agrees_with_the_worker_on_real_models():
    # what passes the check must pass the worker's lookups on the model built for real
    for model in (_real((ToyConfig, ToyForCausalLM)), transformers.LlamaForCausalLM(_llama())):
        assert isinstance(decoder_of(model), nn.Module) and output_head(model).weight is not None
        assert fsdp_blocks(model)
    rm = transformers.LlamaForSequenceClassification(_llama(num_labels=1))
    assert isinstance(rm.score, nn.Module) and isinstance(decoder_of(rm), nn.Module)


def test_the_check_leaves_the_config_alone():
    config = _llama()
    before = config.to_dict()
    check_policy_model(config, _cfg(reward=True), world_size=2)  # builds with num_labels=1 on a copy
    assert config.to_dict() == before
    assert torch.empty(1).device.type == "cpu"  # the meta-device context ended with the check
