"""Four kinds of tokenizer, trained on the fly and saved with ``save_pretrained`` (tests never download), each
with a tiny Llama model of its vocabulary beside it: the tokenization conventions of prompt + response differ by
kind, so the lm-evaluation-harness tests run over all four.

- ``word``: word-level, whitespace split, no BOS added (EOS ``</s>``);
- ``gpt2``: byte-level BPE without BOS (its one special token, ``<|endoftext|>``, is EOS too), as GPT-2's;
- ``llama3``: byte-level BPE that adds ``<|begin_of_text|>``, as Llama 3's;
- ``llama2``: Metaspace BPE (``▁`` for a space, prefix space on the first word) that adds ``<s>``, as Llama 2's.
"""

from __future__ import annotations

import os

from dask_lm.tiny import SAMPLE_TEXTS, build_tiny_model

KINDS = ("word", "gpt2", "llama3", "llama2")

_EXTRA = ["Answer: 42", "Q: what is it? A: yes!", "hello world", "  spaced   out  ", "line\nbreak", "x=1; y=2"]


def _train(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    texts = (list(SAMPLE_TEXTS) + _EXTRA) * 4
    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "</s>"]))
        return tok, {"pad_token": "<pad>", "unk_token": "<unk>", "eos_token": "</s>"}
    if kind in ("gpt2", "llama3"):
        bos = "<|begin_of_text|>"
        specials = ["<|endoftext|>"] if kind == "gpt2" else [bos, "<|end_of_text|>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(
            texts,
            trainers.BpeTrainer(
                vocab_size=400,
                special_tokens=specials,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            ),
        )
        if kind == "gpt2":
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
            return tok, {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        return tok, {"bos_token": bos, "eos_token": "<|end_of_text|>"}
    assert kind == "llama2", kind
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build(kind: str, path: str) -> str:
    """Save a ``kind`` tokenizer and a tiny fp32 Llama of its vocabulary to ``path``; return ``path``."""
    from transformers import PreTrainedTokenizerFast

    tok, specials = _train(kind)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    if fast.pad_token is None:
        fast.pad_token = fast.eos_token
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    build_tiny_model(path, vocab_size=len(fast))
    return path
