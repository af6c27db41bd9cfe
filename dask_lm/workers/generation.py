"""KV-cached batched decoding in the policy's own workers (the ``hf`` generation backend).

Prompts arrive right-padded (the data contract); decoding runs them left-padded, with position ids counted from
each row's first real token, so every row's next token sits in the last column. Each step takes the last
position's logits, divides by ``temperature``, applies the sampler's top-k / top-p, and picks the argmax (greedy)
or a sample; the logprob of the picked token is read from the same filtered distribution, which is what
``get_logprobs`` computes on the returned sequence. A row ends at a stop token (the model's EOS, or
``stop_token_ids``), when its text ends with a stop string, or at ``max_new_tokens``. With FSDP every rank runs
the same number of steps (each forward all-gathers parameters): the ranks agree each step whether any row is
still running anywhere.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

import torch

from dask_lm.comm import collectives
from dask_lm.losses.sampling import apply_top_k_top_p
from dask_lm.workers.state import record_call

if TYPE_CHECKING:
    from dask_lm.data.batch import BatchedDataDict
    from dask_lm.workers.rank_model import RankModel

__all__ = ["generate_batch", "generate", "cache_argument"]


def cache_argument(model: torch.nn.Module) -> str:
    """The name a model's forward takes its KV cache by, and returns it under: ``cache`` since transformers renamed
    ``past_key_values`` (5.2x; the old name still works there, with a FutureWarning on every call), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _stop_ids(host: RankModel) -> set[int]:
    gen = host.cfg.generation
    ids = set(gen.stop_token_ids or []) if gen is not None else set()
    eos = getattr(host.model.generation_config, "eos_token_id", None) or getattr(
        host.model.config, "eos_token_id", None
    )
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def generate_batch(
    host: RankModel, data: BatchedDataDict, *, greedy: bool = False, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """``Policy.generate`` on this rank: the weights on the device, the stop strings' tokenizer, then
    :func:`generate` over ``data``'s rows (its tokens and seconds recorded for the worker's gauges)."""
    gen = host.cfg.generation
    assert gen is not None and gen.max_new_tokens, "the driver checks generation.max_new_tokens"
    tokenizer = None
    if gen.stop_strings:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(
            host.cfg.tokenizer.name or host.cfg.model_name, trust_remote_code=False
        )
    host.ensure_on_device()
    host.model.eval()
    start = time.perf_counter()
    out = generate(
        host,
        data["input_ids"],
        data["input_lengths"],
        greedy=greedy,
        max_new_tokens=int(gen.max_new_tokens),
        tokenizer=tokenizer,
        seed=seed,
    )
    record_call(int(data["input_lengths"].sum()) if data.size else 0, start)
    return out


@torch.no_grad()
def generate(
    host: RankModel,
    ids: torch.Tensor,
    lens: torch.Tensor,
    *,
    greedy: bool,
    max_new_tokens: int,
    tokenizer: Any = None,
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    gen = host.cfg.generation
    temperature = gen.temperature if gen is not None else 1.0
    top_k = gen.top_k if gen is not None else None
    top_p = gen.top_p if gen is not None else 1.0
    stop_strings = list(gen.stop_strings or []) if gen is not None else []
    stops = _stop_ids(host)
    pad = host.pad_token_id
    model, dev = host.model, host.device
    b = ids.shape[0]
    width = int(lens.max()) if b else 1
    left = torch.full((max(b, 1), width), pad, dtype=torch.int64)
    mask = torch.zeros(max(b, 1), width, dtype=torch.int64)
    for r in range(b):
        n = int(lens[r])
        left[r, width - n :] = ids[r, :n]
        mask[r, width - n :] = 1
    if b == 0:  # a rank with no rows still steps with its peers: one pad token
        mask[0, -1] = 1
    left, mask = left.to(dev), mask.to(dev)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    rows = left.shape[0]
    new_ids = torch.full((rows, max_new_tokens), pad, dtype=torch.int64, device=dev)
    new_lp = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=dev)
    finished = torch.zeros(rows, dtype=torch.bool, device=dev)
    if b == 0:
        finished[:] = True
    lengths = torch.zeros(rows, dtype=torch.int64, device=dev)
    stop_tensor = torch.tensor(sorted(stops), dtype=torch.int64, device=dev) if stops else None
    generator = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    cache = None
    cache_key = cache_argument(model)
    step_input, step_pos = left, positions
    step = 0
    try:
        while step < max_new_tokens and collectives.any_rank(not bool(finished.all()), host.group, where=dev):
            out = model(
                input_ids=step_input,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{cache_key: cache},
            )
            cache = out[cache_key]
            logits = out.logits[:, -1].float()
            if temperature != 1.0:
                logits = logits / temperature
            logits = apply_top_k_top_p(logits, top_k, top_p)
            logprobs = torch.log_softmax(logits, dim=-1)
            if greedy:
                nxt = logits.argmax(dim=-1)
            else:
                nxt = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
            lp = logprobs.gather(1, nxt[:, None]).squeeze(1)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            new_ids[:, step] = nxt
            new_lp[:, step] = torch.where(finished, torch.zeros_like(lp), lp)
            lengths += (~finished).long()
            if stop_tensor is not None:
                finished |= torch.isin(nxt, stop_tensor)
            if stop_strings and tokenizer is not None:
                for r in (~finished).nonzero().flatten().tolist():
                    text = tokenizer.decode(new_ids[r, : step + 1].tolist())
                    if any(s in text for s in stop_strings):
                        finished[r] = True
            step_input = nxt[:, None]
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=dev)], dim=1)
            step_pos = step_pos[:, -1:] + 1
            step += 1
    finally:
        host.end_pass()
    new_ids, new_lp, lengths = new_ids[:b].cpu(), new_lp[:b].cpu(), lengths[:b].cpu()
    finished = finished[:b].cpu()
    total = lens + lengths
    s_out = int(total.max()) if b else 0
    output_ids = torch.full((b, s_out), pad, dtype=torch.int64)
    logprobs_out = torch.zeros(b, s_out, dtype=torch.float32)
    for r in range(b):
        n, g = int(lens[r]), int(lengths[r])
        output_ids[r, :n] = ids[r, :n]
        output_ids[r, n : n + g] = new_ids[r, :g]
        logprobs_out[r, n : n + g] = new_lp[r, :g]
    return {
        "output_ids": output_ids,
        "logprobs": logprobs_out,
        "generation_lengths": lengths,
        "unpadded_sequence_lengths": total,
        "truncated": ~finished,
    }
