"""The worker's numerics in one process: chunked logprobs / top-k vs full log-softmax, and a packed forward vs
unpacked, on a tiny Hugging Face model."""

from __future__ import annotations

import pytest
import torch
import transformers

from dask_lm.workers.forward import block_causal_mask, final_hidden_states, pack, unpack_positions
from dask_lm.workers.logprobs import apply_top_k_top_p, next_token_logprobs, output_head, topk_logits


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
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32,
                                                              attn_implementation=attn).eval()
    lens = torch.tensor([7, 3, 5])
    ids = torch.randint(3, 300, (3, 7)) * (torch.arange(7)[None, :] < lens[:, None])
    with torch.no_grad():
        expected = _reference(model(ids).logits, ids, lens)
        pids, pos, cu = pack(ids, lens)
        assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3, 4]
        mask = block_causal_mask(cu, pids.shape[1], additive_dtype=None if attn == "sdpa" else torch.float32)
        hidden = final_hidden_states(model, pids, position_ids=pos, attention_mask=mask)
        packed = next_token_logprobs(hidden, pids, pos > 0, output_head(model))
    rows, cols = unpack_positions(cu, lens, 7)
    out = torch.zeros(3, 7)
    out[rows, cols] = packed[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
