"""GPU tier, one process and no cluster: the kernels and loads a replica's forward stands on, each against an
independent reference (a float64 head, transformers' own from_pretrained). Skipped without a GPU; the cluster tests
are in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import transformers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_direct_model_load_on_cuda_equals_from_pretrained(tiny, tmp_path, stored):
    """The scoring replica's direct load (model/load.py) puts the bits from_pretrained does on the GPU."""
    from dask_lm.model import load as model_load

    path = str(tmp_path / "m")
    transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"]).to(stored).save_pretrained(path)
    where = torch.device("cuda")
    got = model_load.load_causal_lm(path, torch.bfloat16, where)
    assert model_load.direct_files(path) is not None
    ref = model_load._from_pretrained(path, torch.bfloat16, where)
    sa, sb = got.state_dict(), ref.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].device.type == "cuda" and torch.equal(sa[k], sb[k]), k
    for (k, a), (_, b) in zip(got.named_buffers(), ref.named_buffers()):
        assert a.device.type == "cuda" and torch.equal(a, b), k
    x = torch.randint(3, got.config.vocab_size, (2, 33), device=where)
    with torch.no_grad():
        assert torch.equal(got(x).logits, ref(x).logits)


def test_fused_output_head_against_float64():
    """bf16 hidden states and weights: the fp32-output matmul + compiled logsumexp equals a float64 head to 1e-4
    (the bf16-rounded logits of a plain head are off by up to ~4e-3), with temperature, and for top-k."""
    from dask_lm.model import fused
    from dask_lm.model.logprobs import OutputHead, next_token_logprobs, topk_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, v = 3, 300, 64, 5000
    hidden = torch.randn(b, s, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, s), device="cuda", generator=g)
    lens = torch.tensor([300, 17, 120], device="cuda")
    valid = torch.arange(s, device="cuda")[None, :] < lens[:, None]
    head = OutputHead(weight, fp32_out=True)
    for temperature in (1.0, 0.7):
        got = next_token_logprobs(hidden, ids, valid, head, temperature=temperature, chunk_size=128)
        logits = (hidden.double() @ weight.double().t()) / temperature
        want = torch.zeros(b, s, dtype=torch.float64, device="cuda")
        want[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
        want = want * valid
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    assert "pick_minus_lse" in fused._COMPILED and not fused._BROKEN
    vals, _idx = topk_logits(hidden, valid, head, 5, chunk_size=128, normalize=True)
    want_v = torch.log_softmax(hidden.double() @ weight.double().t(), -1).topk(5, -1).values
    torch.testing.assert_close(vals.double(), want_v * valid[..., None], atol=1e-4, rtol=0)


def test_liger_head_against_float64_and_the_compiled_reduction():
    """liger-kernel's kernel (the ``cuda`` extra installs it) gives the same logprobs as a float64 head to 1e-4
    and as the compiled reduction to 1e-5, and lm-eval's greedy flag (first argmax == target), on a vocabulary
    that is not a power of two and with planted ties and targets at the row's maximum; the logits stay unchanged."""
    from dask_lm.model import fused, liger_head

    g = torch.Generator(device="cuda").manual_seed(1)
    n, v = 700, 50257
    z = torch.randn(n, v, device="cuda", generator=g) * 3
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[:100] = z[:100].argmax(-1)  # greedy rows
    z[100:110, 7] = z[100:110].amax(-1) + 1  # a tie between index 7 and a later target: not greedy
    z[100:110, 9] = z[100:110, 7]
    t[100:110] = 9
    z[110:120, 11] = z[110:120].amax(-1) + 1  # a tie whose first index is the target: greedy
    z[110:120, 40000] = z[110:120, 11]
    t[110:120] = 11
    before = z.clone()
    assert liger_head.available(z), "liger-kernel is not importable: pip install 'dask-lm[cuda]'"
    lp, greedy = fused.pick_minus_logsumexp_greedy(z, t)
    assert liger_head._STATE["kernel"] is not None  # it ran, and did not fall back
    assert torch.equal(z, before)
    want = torch.log_softmax(z.double(), -1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), want, atol=1e-4, rtol=0)
    assert torch.equal(greedy, z.argmax(-1) == t)  # torch's argmax is the first index of the maximum
    with fused.use_compiled(True):
        compiled = fused._run("pick_minus_lse_greedy", fused._pick_minus_lse_greedy, z, t)[0]
    torch.testing.assert_close(lp, compiled, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.pick_minus_logsumexp(z, t).double(), want, atol=1e-4, rtol=0)


def test_training_head_gradients_in_bf16_against_float64():
    """The training head's own backward on a GPU in bf16 (fp32-output matmuls, the weight's gradient accumulated in
    place over the chunks) against autograd in float64 on the same bf16 values: values to 1e-4, gradients to bf16
    rounding."""
    from dask_lm.model.linear_logprob import linear_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 700, 64, 5000
    hid = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    up = torch.randn(n, device="cuda", generator=g)
    got = linear_logprobs(hid, w, None, t, scale=1 / 0.7, chunk_size=128)
    gh, gw = torch.autograd.grad(got, [hid, w], up)
    h64, w64 = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.log_softmax(h64 @ w64.t() / 0.7, -1).gather(1, t[:, None])[:, 0]
    wh, ww = torch.autograd.grad(want, [h64, w64], up.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.double(), wh, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.double(), ww, atol=2e-2, rtol=2e-2)


def test_liger_layers_match_hf_modules_in_bf16(tiny):
    """The scoring replica's liger RMSNorm / SwiGLU patch (model/liger_layers.py): every norm and MLP of a Qwen2
    model is patched, its bf16 logits are no further from a float32 HF forward than HF's own bf16 modules are (and
    within bf16 rounding of them), and unpatching restores HF's bits exactly."""
    from dask_lm.model import liger_layers

    fp32 = transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"], dtype=torch.float32).cuda().eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["qwen2"], dtype=torch.bfloat16).cuda().eval()
    layers = model.config.num_hidden_layers
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 300), device="cuda", generator=g)
    with torch.no_grad():
        want = fp32(ids).logits
        eager = model(ids).logits.float()
        assert liger_layers.patch(model) == 3 * layers + 1  # two norms and an MLP per layer, and the final norm
        assert all("forward" in m.__dict__ for m in liger_layers.targets(model)[0] + liger_layers.targets(model)[1])
        patched = model(ids).logits.float()
        assert liger_layers.unpatch(model) == 3 * layers + 1
        again = model(ids).logits.float()
    assert torch.equal(again, eager)
    err_eager, err_patched = (eager - want).abs().max().item(), (patched - want).abs().max().item()
    assert err_patched <= 1.25 * err_eager + 1e-3, (err_patched, err_eager)
    torch.testing.assert_close(patched, eager, atol=4 * err_eager + 1e-3, rtol=0)
    assert not torch.equal(patched, want)  # the comparison is of two bf16 forwards, not of a tensor with itself
