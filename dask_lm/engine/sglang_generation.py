"""Generation through SGLang servers (``generation.backend: "sglang"``), mapped to dask-lm's Generate contract.

The driver sends the prompts as token ids to SGLang's native ``/generate`` route, in chunks spread round-robin
over the servers (``generation.sglang_cfg.server_urls``) and sent concurrently; each server batches what it
receives. A connection error is retried (the same chunk, the same server, with backoff); a server that stays
unreachable fails the call with its URL. Only sampling keys SGLang accepts are sent: it rejects unknown ones.

The logprobs are the ones the server reports for the sampled tokens (``return_logprob``), placed where dask-lm's
own backend puts them; the server decides how temperature and top-k/top-p enter them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dask_lm.data.batch import BatchedDataDict

__all__ = ["SGLangGenerator", "sampling_params", "per_row"]

CONNECT_TIMEOUT_S = 10.0


def sampling_params(gen: Any, *, greedy: bool) -> dict[str, Any]:
    """SGLang ``sampling_params`` from a dask-lm ``generation`` config."""
    params: dict[str, Any] = {"max_new_tokens": int(gen.max_new_tokens)}
    if greedy:
        params.update(temperature=0.0, top_k=1)
    else:
        params.update(temperature=float(gen.temperature), top_p=float(gen.top_p))
        if gen.top_k is not None:
            params["top_k"] = int(gen.top_k)
    if gen.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in gen.stop_token_ids]
    if gen.stop_strings:
        params["stop"] = list(gen.stop_strings)
    return params


def per_row(params: dict[str, Any], rows: list[int], seed: int | None) -> dict[str, Any] | list[dict[str, Any]]:
    """One ``sampling_params`` for a chunk, or one per row with its own seed (``seed + row``): SGLang's seeded
    sampler hashes only the seed and the position, so equal prompts with one seed would get equal samples."""
    if seed is None or params.get("top_k") == 1:
        return params
    return [dict(params, sampling_seed=int(seed) + r) for r in rows]


class SGLangGenerator:
    """Sends prompts to SGLang servers and assembles dask-lm's Generate output."""

    def __init__(
        self,
        urls: list[str],
        *,
        pad_token_id: int,
        timeout_s: float = 600.0,
        retries: int = 3,
        chunk_rows: int = 64,
        backoff_s: float = 0.5,
    ) -> None:
        if not urls:
            raise ValueError("`policy.generation.sglang_cfg.server_urls` must list at least one SGLang server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.pad_token_id = pad_token_id
        self.timeout = (CONNECT_TIMEOUT_S, timeout_s)
        self.retries = retries
        self.chunk_rows = chunk_rows
        self.backoff_s = backoff_s

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        import requests

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                resp = requests.post(url + "/generate", json=body, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = e
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                continue
            if resp.status_code != 200:
                raise RuntimeError(f"SGLang server {url} refused /generate: HTTP {resp.status_code}: {resp.text[:500]}")
            return resp.json()
        raise ConnectionError(
            f"SGLang server {url} is unreachable ({self.retries + 1} attempts): "
            f"{type(last).__name__}: {last}. Is it running, and is "
            "`policy.generation.sglang_cfg.server_urls` right?"
        )

    def generate(
        self, data: BatchedDataDict[Any], params: dict[str, Any], seed: int | None = None
    ) -> BatchedDataDict[Any]:
        ids, lengths = data["input_ids"], data["input_lengths"]
        prompts = [ids[i, : int(lengths[i])].tolist() for i in range(ids.shape[0])]
        chunks = [
            list(range(s, min(s + self.chunk_rows, len(prompts)))) for s in range(0, len(prompts), self.chunk_rows)
        ]

        def run(c: int) -> list[dict[str, Any]]:
            rows = chunks[c]
            body = {
                "input_ids": [prompts[i] for i in rows],
                "sampling_params": per_row(params, rows, seed),
                "return_logprob": True,
            }
            out = self._post(self.urls[c % len(self.urls)], body)
            if not isinstance(out, list) or len(out) != len(rows):
                raise RuntimeError(
                    f"SGLang server {self.urls[c % len(self.urls)]} answered /generate with "
                    f"{type(out).__name__} for a batch of {len(rows)} prompts"
                )
            return out

        with ThreadPoolExecutor(max_workers=min(len(chunks), 4 * len(self.urls)) or 1) as pool:
            answers = [a for part in pool.map(run, range(len(chunks))) for a in part]
        return self._assemble(prompts, answers)

    def _assemble(self, prompts: list[list[int]], answers: list[dict[str, Any]]) -> BatchedDataDict[Any]:
        rows, lps, gen_lens, truncated = [], [], [], []
        for i, (prompt, ans) in enumerate(zip(prompts, answers)):
            meta = ans.get("meta_info", {})
            finish = meta.get("finish_reason") or {}
            if finish.get("type") == "abort":
                raise RuntimeError(f"SGLang aborted the request for row {i}: {finish.get('message', finish)}")
            out_ids = [int(t) for t in ans["output_ids"]]
            token_lps = meta.get("output_token_logprobs") or []
            if len(token_lps) != len(out_ids):
                raise RuntimeError(
                    f"SGLang returned {len(token_lps)} logprobs for {len(out_ids)} tokens in row {i}: "
                    "is return_logprob supported by this server?"
                )
            rows.append(prompt + out_ids)
            lps.append([0.0] * len(prompt) + [float(lp[0]) for lp in token_lps])
            gen_lens.append(len(out_ids))
            truncated.append(finish.get("type") == "length")
        width = max((len(r) for r in rows), default=0)
        output_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (r, lp) in enumerate(zip(rows, lps)):
            output_ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            logprobs[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return BatchedDataDict(
            output_ids=output_ids,
            logprobs=logprobs,
            generation_lengths=torch.tensor(gen_lens, dtype=torch.int64),
            unpadded_sequence_lengths=torch.tensor([len(r) for r in rows], dtype=torch.int64),
            truncated=torch.tensor(truncated, dtype=torch.bool),
        )
