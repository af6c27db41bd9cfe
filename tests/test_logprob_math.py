"""The worker's numerics in one process: chunked logprobs / top-k vs full log-softmax, and a packed forward vs
unpacked, on a tiny Hugging Face model."""

from __future__ import annotations

import pytest
import torch
import transformers

from dask_lm.data.tokens import TokenRows
from dask_lm.model.forward import block_causal_mask, final_hidden_states, unpack_positions
from dask_lm.model.logprobs import apply_top_k_top_p, next_token_logprobs, output_head, topk_logits


def _reference(logits, ids, lens):
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = lp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    return out * (torch.arange(ids.shape[1])[None, :] < lens[:, None])


@pytest.mark.parametrize("chunk", [1, 3, 1000, None])
def test_chunked_logprobs_equal_full_log_softmax(chunk):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 9, 16), torch.randn(50, 16)
    ids, lens = torch.randint(0, 50, (3, 9)), torch.tensor([9, 4, 1])
    valid = torch.arange(9)[None, :] < lens[:, None]
    out = next_token_logprobs(hidden, ids, valid, lambda h: h @ weight.T, chunk_size=chunk, temperature=0.5)
    torch.testing.assert_close(out, _reference(hidden @ weight.T / 0.5, ids, lens), atol=1e-5, rtol=0)
    v, i = topk_logits(hidden, valid, lambda h: h @ weight.T, 3, chunk_size=chunk, temperature=0.5)
    top = (hidden @ weight.T / 0.5).topk(3, dim=-1)
    torch.testing.assert_close(v * valid[..., None], top.values * valid[..., None], atol=1e-5, rtol=0)
    assert torch.equal(i * valid[..., None], top.indices * valid[..., None])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(apply_top_k_top_p(logits, None, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(apply_top_k_top_p(logits, None, 0.81))
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.isfinite(apply_top_k_top_p(logits, 1, 1.0)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_unpacked(tiny, attn):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny["llama"], dtype=torch.float32, attn_implementation=attn
    ).eval()
    lens = torch.tensor([7, 3, 5])
    ids = torch.randint(3, 300, (3, 7)) * (torch.arange(7)[None, :] < lens[:, None])
    with torch.no_grad():
        expected = _reference(model(ids).logits, ids, lens)
        pids, pos, cu = TokenRows.from_padded(ids, lens).packed()
        assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3, 4]
        mask = block_causal_mask(cu, pids.shape[1], additive_dtype=None if attn == "sdpa" else torch.float32)
        hidden = final_hidden_states(model, pids, position_ids=pos, attention_mask=mask)
        packed = next_token_logprobs(hidden, pids, pos > 0, output_head(model))
    rows, cols = unpack_positions(cu, lens, 7)
    out = torch.zeros(3, 7)
    out[rows, cols] = packed[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_logprobs_values_and_gradients_equal_autograd(chunk, with_bias):
    """The training head's own backward (closed-form softmax gradient, logits recomputed per chunk) against
    autograd through ``log_softmax(linear(h) * scale)``, in float64: values and the gradients of h, W and b for
    an arbitrary per-token incoming gradient (zeros included, as masked tokens give)."""
    from dask_lm.model.linear_logprob import linear_logprobs

    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 7, 5, 11
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    upstream[2] = 0.0
    scale = 0.7
    want = torch.log_softmax(torch.nn.functional.linear(h, w, b) * scale, -1).gather(1, t[:, None])[:, 0]
    want_grads = torch.autograd.grad(want, [h, w] + ([b] if with_bias else []), upstream)
    got = linear_logprobs(h, w, b, t, scale=scale, chunk_size=chunk)
    got_grads = torch.autograd.grad(got, [h, w] + ([b] if with_bias else []), upstream.float())
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)  # the values are float32
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)
