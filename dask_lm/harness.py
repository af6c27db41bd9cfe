"""An lm-evaluation-harness model that runs on a Dask cluster: ``--model dask-lm``.

::

    dask-lm-eval --model dask-lm --model_args pretrained=DIR,scheduler_address=tcp://host:8786 --tasks hellaswag

``dask-lm-eval`` is lm-eval's own command line (``lm_eval.__main__.cli_evaluate``) with this module imported
first: lm-eval 0.4 finds models only in its registry, so the class must be registered before the command parses
``--model``. In Python, ``import dask_lm.harness`` registers it, and ``DaskLM(..., client=client)`` is an
``lm_eval.api.model.LM`` for ``lm_eval.simple_evaluate(model=...)``.

Each request type is lm-eval's ``HFLM`` semantics on :class:`dask_lm.evaluation.engine.RequestEngine`: the driver
tokenizes (no model and no GPU here), the workers score or generate in batches spread over the cluster.

- ``loglikelihood``: pairs tokenized by :func:`dask_lm.data.continuation.encode_pairs`, which equals lm-eval's split
  whenever lm-eval's is coherent (the context's encoding a prefix of the whole text's) and neither drops nor
  repeats a token where it is not; with ``add_bos_token`` set, lm-eval's own ``TemplateLM`` split instead.
- ``loglikelihood_rolling``: lm-eval's rolling windows (``get_rolling_token_windows`` + ``make_disjoint_window``),
  every window of every request in one pass over the cluster.
- ``generate_until``: requests grouped by their generation kwargs, contexts left-truncated to ``max_length -
  max_gen_toks``, stop strings plus the EOS text, new tokens decoded without special tokens and cut at the stop
  strings with lm-eval's ``postprocess_generated_text``. Each row stops on its own, as ``HFLM`` with
  ``batch_size=1`` (batched ``HFLM`` runs a row on until every row of its batch has stopped).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the eval extra is missing
    raise ImportError('dask_lm.harness needs lm-evaluation-harness 0.4: pip install "dask-lm[eval]"') from e

from dask_lm.config.defaults import PADDED_BATCH_TOKENS
from dask_lm.data.continuation import encode_pairs
from dask_lm.data.continuation import prefix_token_id as _prefix_token_id
from dask_lm.evaluation.engine import DEFAULT_TASK_TOKENS, RequestEngine

__all__ = ["DaskLM", "main"]

_PRECISIONS = {
    "auto": None,
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}
_OPEN: weakref.WeakSet[DaskLM] = weakref.WeakSet()  # what main() closes when lm-eval's command returns


def _int(key: str, value: Any) -> int:
    """A positive integer from model_args, which lm-eval hands over parsed ("2" is 2 already) from the command
    line, or as the caller's dict of anything from Python."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = 0.0
    if isinstance(value, bool) or number < 1 or number != int(number):
        raise ValueError(f"model_args {key}={value!r}: expected a positive integer")
    return int(number)


def _opt_int(key: str, value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _int(key, value)


def _bool(key: str, value: Any, optional: bool = False) -> bool | None:
    text = str(value).strip().lower()
    if optional and (value is None or text in ("", "none")):
        return None
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"model_args {key}={value!r}: expected true or false")


@register_model("dask-lm")
class DaskLM(TemplateLM):
    """lm-eval's model interface over a Dask cluster; ``model_args`` are the keyword arguments:

    ``pretrained`` (a model directory or Hub id), ``tokenizer`` (default the model's), ``revision`` (Hub only),
    ``scheduler_address`` (default ``DASK_SCHEDULER_ADDRESS``, else a local cluster of ``n_workers``: one per GPU
    or 2 CPU workers), ``client`` (Python only: a Dask client, kept open), ``dtype`` (alias ``precision``:
    auto, bfloat16, float32, float16; auto is bfloat16 on GPU workers, float32 on CPU ones), ``batch_tokens``
    (padded tokens per worker micro-batch), ``task_tokens`` (tokens per Dask task), ``max_length`` (default
    lm-eval's: the model's positions), ``max_gen_toks`` (default 256), ``add_bos_token`` (as ``HFLM``'s), ``compile``
    (compile the scoring forward on each worker)."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        revision: str | None = None,
        scheduler_address: str | None = None,
        n_workers: int | str | None = None,
        client: Any = None,
        dtype: str | None = None,
        precision: str | None = None,
        batch_tokens: int | str = PADDED_BATCH_TOKENS,
        task_tokens: int | str = DEFAULT_TASK_TOKENS,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        add_bos_token: bool | str | None = None,
        compile: bool | str = False,
        trust_remote_code: bool | str = False,
        batch_size: Any = None,
        max_batch_size: Any = None,
        device: Any = None,
        **unknown: Any,
    ) -> None:
        # batch_size / max_batch_size / device: lm-eval passes them to every model (its --batch_size / --device);
        # here the batches are cut by tokens (batch_tokens, task_tokens) and each worker uses its own device
        del batch_size, max_batch_size, device
        if unknown:
            key = min(unknown)
            raise ValueError(
                f"unknown model_args key {key!r} for dask-lm; it takes pretrained, tokenizer, revision, "
                "scheduler_address, n_workers, dtype (or precision), batch_tokens, task_tokens, "
                "max_length, max_gen_toks, add_bos_token, compile"
            )
        super().__init__()
        import transformers

        from dask_lm.io import hub, modelcheck
        from dask_lm.jobs import model_files

        if _bool("trust_remote_code", trust_remote_code):
            raise ValueError(
                "model_args trust_remote_code=true: dask-lm workers load models with the classes "
                "transformers ships, never remote code; drop trust_remote_code"
            )
        if dtype is not None and precision is not None and dtype != precision:
            raise ValueError(f"model_args dtype={dtype!r} and precision={precision!r}: give one of them")
        chosen = str(dtype if dtype is not None else precision if precision is not None else "auto").lower()
        if chosen not in _PRECISIONS:
            raise ValueError(f"model_args dtype={chosen!r}: expected auto, bfloat16, float32 or float16")
        source = hub.resolve_model(str(pretrained), revision=revision, what="pretrained")
        modelcheck.check_model(source.path)
        tok_dir = model_files.resolve_tokenizer(tokenizer, source.path, fix="pass tokenizer=DIR in model_args")
        self.add_bos_token = _bool("add_bos_token", add_bos_token, optional=True)
        extra = {} if self.add_bos_token is None else {"add_bos_token": self.add_bos_token}
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False, **extra)
        self.backend = "causal"
        self.pretrained, self.revision = str(pretrained), revision
        given = _opt_int("max_length", max_length)
        config = transformers.AutoConfig.from_pretrained(source.path, trust_remote_code=False)
        self._max_length = given or resolve_max_length(config, self.tokenizer)
        self._max_gen_toks = _int("max_gen_toks", max_gen_toks)
        self.engine = RequestEngine(
            source.path,
            tok_dir,
            client=client,
            scheduler_address=scheduler_address,
            n_workers=_opt_int("n_workers", n_workers),
            precision=_PRECISIONS[chosen],
            batch_tokens=_int("batch_tokens", batch_tokens),
            task_tokens=_int("task_tokens", task_tokens),
            max_length=self._max_length,
            compile=bool(_bool("compile", compile)),
        )
        _OPEN.add(self)

    # ------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"the tokenizer of {self.pretrained} has no EOS token, which generate_until adds to "
                "its stop strings; give the tokenizer an eos_token"
            )
        return int(eos)

    @property
    def prefix_token_id(self) -> int:
        return _prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return int(self._max_length)

    @property
    def max_gen_toks(self) -> int:
        return int(self._max_gen_toks)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def _special(self, add_special_tokens: bool | None) -> dict[str, bool]:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        """``HFLM.tok_encode``: the tokenizer's special tokens (or ``add_bos_token``), none for a text that already
        starts with the prefix token's text."""
        special = self._special(add_special_tokens)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def _encode_contexts(self, texts: list[str]) -> list[list[int]]:
        """Generation contexts as ``HFLM.tok_batch_encode`` encodes them (decided per text rather than by the
        batch's first text): no special tokens for a text starting with the BOS text, else ``add_bos_token``."""
        bos = getattr(self.tokenizer, "bos_token", None)
        out: list[list[int]] = [[] for _ in texts]
        groups: dict[bool | None, list[int]] = {}
        for i, text in enumerate(texts):
            groups.setdefault(False if has_bos_prefix(text, bos) else self.add_bos_token, []).append(i)
        for special, index in groups.items():
            extra = {} if special is None else {"add_special_tokens": special}
            for i, ids in zip(index, self.tokenizer([texts[i] for i in index], **extra)["input_ids"]):
                out[i] = list(ids)
        return out

    # ------------------------------------------------------------------------------------------ requests
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.add_bos_token is not None:  # encode_pairs keeps the tokenizer's own special tokens
            split: list[tuple[float, bool]] = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            return split
        args = [req.args for req in requests]
        pairs = encode_pairs(self.tokenizer, [a[0] for a in args], [a[1] for a in args])
        return self._loglikelihood_tokens([((c, x), p, q) for (c, x), (p, q) in zip(args, pairs)])

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` per ``(request strings or None, context ids, continuation ids)``; kwargs of
        HFLM's (``disable_tqdm``, ``override_bs``) mean nothing here."""
        answers = self.engine.loglikelihood([(list(r[1]), list(r[2])) for r in requests])
        for r, answer in zip(requests, answers):
            if r[0] is not None:  # rolling windows have none: their request is cached whole
                self.cache_hook.add_partial("loglikelihood", r[0], answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[None, list[int], list[int]]] = []
        counts: list[int] = []
        for (string,) in (req.args for req in requests):
            rolling = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, a, b) for a, b in rolling)
            counts.append(len(rolling))
        answers = self._loglikelihood_tokens(windows)
        out: list[float] = []
        at = 0
        for req, n in zip(requests, counts):
            total = sum(a[0] for a in answers[at : at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one generate call per set of kwargs, as HFLM's Collator groups them
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=repr), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for index in groups.values():
            gen_kwargs = requests[index[0]].args[1]
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            total = kwargs.pop("max_length", None)  # HF's prompt + generation length, which HFLM passes through
            if kwargs.get("do_sample") is False and kwargs.get("temperature", 0.0) == 0.0:
                kwargs.pop("temperature", None)  # greedy: HF warns about a temperature it does not use
            if max_gen_toks >= self.max_length:
                raise ValueError(
                    f"generate_until: max_gen_toks ({max_gen_toks}) leaves no room for a context in "
                    f"max_length ({self.max_length}); lower max_gen_toks or raise max_length"
                )
            contexts = [requests[i].args[0] for i in index]
            ids = [c[-(self.max_length - max_gen_toks) :] for c in self._encode_contexts(contexts)]
            limits = [max_gen_toks if total is None else max(1, int(total) - len(c)) for c in ids]
            new = self.engine.generate(ids, {**kwargs, "max_new_tokens": max(limits), "stop": until})
            for i, context, tokens, limit in zip(index, contexts, new, limits):
                text = postprocess_generated_text(self.tok_decode(tokens[:limit]), until, None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )
        )

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_dtype": self.engine.opts.precision,
            "model_revision": self.revision,
            "dask_workers": self.engine.workers,
        }

    # ------------------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the workers' model replicas, and the cluster when this model started it."""
        self.engine.close()
        _OPEN.discard(self)


def main() -> None:
    """``dask-lm-eval``: lm-eval's command line with the ``dask-lm`` model registered (importing this module)."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    finally:
        for lm in list(_OPEN):
            lm.close()


if __name__ == "__main__":
    main()
