"""Independent references for the tests: single-process Hugging Face forwards of the saved weights."""

from __future__ import annotations

import torch
import transformers


def hf_logprobs(model_dir: str, input_ids: torch.Tensor, lengths: torch.Tensor, temperature: float = 1.0):
    """float32 [B, S] per-token logprobs from a plain HF forward, with the contract's conventions."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits.float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = lp[:, :-1].gather(2, input_ids[:, 1:, None]).squeeze(2)
    return out * mask, logits


def make_batch(tokenizer, texts, pad_to: int | None = None):
    """Right-padded ids and lengths, as tokenizer(text) gives them."""
    enc = tokenizer(texts, padding="max_length" if pad_to else True, max_length=pad_to, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].sum(1)


TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Dask",
    "A language model assigns a probability to every next token in a long sentence like this one here.",
    "Parquet files store columns.",
    "Numbers like 3, 14, 159",
]
