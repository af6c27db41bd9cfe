"""Independent references for the tests: single-process Hugging Face forwards of the saved weights."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import transformers


class _Missing:
    """Stands in for a module of the test extra that is not installed: using it fails the test that does."""

    def __init__(self, name: str, error: ImportError) -> None:
        self._name, self._error = name, error

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's collection probes module members for markers and fixtures
            raise AttributeError(attr)
        pytest.fail(
            f"{self._name} is not installed ({self._error}); these tests compare against it: install the "
            "test extra, pip install -e '.[test]'",
            pytrace=False,
        )


def extra(name: str) -> Any:
    """``import name`` for a module of the test extra (lm-eval, which the tests take as their reference).

    Where it is missing the test module still collects, so ``pytest -m gpu tests`` runs on a GPU machine that has
    only the runtime dependencies; every test that uses the module then fails (never skips), so a CI run without
    the extra fails as it should. Use the result's attributes inside tests, not at module level."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        return _Missing(name, e)


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


def hf_nll_steps(
    model_dir: str, batches, *, lr: float, max_grad_norm: float | None, optimizer: str = "sgd", lr_factors=None
):
    """The reference trainer: one process, plain Hugging Face, fp32. For each global batch (ids, lens, token_mask,
    sample_mask): the NLL over all its valid tokens, backward, clip by total norm, one optimizer step. Returns
    (losses, pre-clip grad norms, model)."""
    import math

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
    losses, norms = [], []
    for i, (ids, lens, token_mask, sample_mask) in enumerate(batches):
        if lr_factors is not None:
            for g in opt.param_groups:
                g["lr"] = lr * lr_factors[i]
        opt.zero_grad()
        mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
        logits = model(ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
        m = token_mask[:, 1:] * sample_mask[:, None]
        loss = -(lp * m).sum() / m.sum()
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        if max_grad_norm is not None and max_grad_norm / (norm + 1e-6) < 1:
            for p in params:
                p.grad.mul_(max_grad_norm / (norm + 1e-6))
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(norm)
    return losses, norms, model


def model_logprobs(model, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """get_logprobs' contract from an in-memory HF model."""
    mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits.float()
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(2, input_ids[:, 1:, None]).squeeze(2)
    return out * mask


def sft_batch(tokenizer, texts, pad_to: int | None = None):
    """A BatchedDataDict for NLL training: every real token but the first is trained on."""
    from dask_lm import BatchedDataDict

    ids, lens = make_batch(tokenizer, texts, pad_to)
    token_mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=token_mask, sample_mask=torch.ones(ids.shape[0])
    )


def saved_weights(policy, path) -> dict[str, torch.Tensor]:
    """What ``policy.save_checkpoint(path)`` writes, read back from its safetensors files."""
    import glob

    from safetensors.torch import load_file

    policy.save_checkpoint(str(path))
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


def launch_chromium(playwright: Any) -> Any:
    """Debian's headless Chromium under Playwright, with the flags this machine's closed network needs (no
    background connections, no QUIC), as both browser tests launch it. Fails under CI when it is missing
    (``.ci/run`` installs it); skips elsewhere."""
    import os
    import shutil

    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("needs Debian's chromium (apt-get install chromium); .ci/run installs it")
    return playwright.chromium.launch(
        executable_path=chromium,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
    )


class WritesMarker:
    """A pickle that creates a file when unpickled: proof that a process deserialised it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def qkv_reference_samples(model_dir, ids, lens, rows_per_forward):
    """calibrate_qkv_fp8_scales' reference: {layer: {"q"|"k"|"v": [the largest magnitude over the real tokens of
    each forward of `rows_per_forward` rows, in order]}}, Q / K / V recomputed from each layer's input (the
    projections and RoPE applied here, not read from an attention hook). Llama-family models."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = {}

    def hook(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    out = {}
    for s in range(0, ids.shape[0], rows_per_forward):
        x, n = ids[s : s + rows_per_forward], lens[s : s + rows_per_forward]
        x = x[:, : int(n.max())]  # the rows as a micro-batch holds them: padded to its longest row
        real = (torch.arange(x.shape[1])[None, :] < n[:, None]).float()
        with torch.no_grad():
            model(input_ids=x, attention_mask=real.long())
            for i, (h, (cos, sin)) in seen.items():
                att = model.model.layers[i].self_attn
                shape = (*h.shape[:-1], -1, att.head_dim)
                q, k, v = (p(h).view(shape).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                for name, t in (("q", q), ("k", k), ("v", v)):
                    amax = (t.abs().amax(dim=(1, 3)) * real).amax().item()
                    out.setdefault(i, {}).setdefault(name, []).append(amax)
    return out
