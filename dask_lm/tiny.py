"""Tiny random models and a tokenizer trained on the spot: for the CLI's no-``--model`` mode, demos and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a built-in corpus, the models are built from a
config with random weights, and both are written with ``save_pretrained`` so they load back the way users load
theirs (``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import os
from typing import Literal

__all__ = ["SAMPLE_TEXTS", "train_tiny_tokenizer", "build_tiny_model"]

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Dask schedules tasks across the workers of a cluster.",
    "A language model assigns a probability to every next token.",
    "Log probabilities are summed to score a whole sequence.",
    "Sequence packing puts several short rows into one long row.",
    "Reward models give each response a single scalar score.",
    "Gradient descent follows the slope of the loss downhill.",
    "Parquet files store columns of data efficiently on disk.",
    "The policy generates text, the reward rises, and the loop repeats.",
    "Numbers like 3, 14, 159 and 2653 appear in text as well.",
]

Family = Literal["llama", "qwen2"]


def train_tiny_tokenizer(path: str, *, vocab_size: int = 384) -> str:
    """Train a byte-level BPE tokenizer and save it (with pad / bos / eos tokens) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE_TEXTS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def build_tiny_model(
    path: str,
    *,
    family: Family = "llama",
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    sequence_classification: bool = False,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    tokenizer_path: str | None = None,
) -> str:
    """A randomly initialised model of ``family`` saved to ``path`` (plus the tokenizer when given)."""
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    tie = (family == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    cfg = cfg_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_labels=1,
    )
    torch.manual_seed(seed)
    auto = (
        transformers.AutoModelForSequenceClassification
        if sequence_classification
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
    # random init keeps logits near zero; widen them so logprobs and top-k orders are not near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if tokenizer_path:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False).save_pretrained(path)
    return path
