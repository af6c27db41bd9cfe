"""The Policy's model, as the driver sees it before any rank loads it: Hub names resolved to one local snapshot,
the model's config.json checked within :mod:`dask_lm.io.config_limits`, and transformers' parse of it (the driver's
FLOP count and vocabulary size)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from dask_lm.config import PolicyConfig
from dask_lm.io import hub, modelcheck
from dask_lm.io.config_limits import check_config_limits
from dask_lm.io.hub import ModelSource

__all__ = ["resolve_names", "check_model_config", "model_config"]


def resolve_names(cfg: PolicyConfig) -> tuple[PolicyConfig, ModelSource]:
    """``cfg`` with a Hub ``model_name`` (and a Hub tokenizer name) replaced by local snapshot directories, resolved
    here on the driver once, so every worker loads the same commit (:mod:`dask_lm.io.hub`). A copy: the caller's
    config object keeps the names it was given."""
    source = hub.resolve_model(cfg.model_name, revision=cfg.model_revision, what="`policy.model_name`")
    tok = cfg.tokenizer.name
    if tok == cfg.model_name:
        tok = source.path
    elif tok is not None and not os.path.exists(tok) and hub.looks_like_hub_id(tok):
        tok = hub.resolve_model(tok, what="`policy.tokenizer.name`").path
    elif tok is not None and os.path.isdir(tok):  # the workers' generation loads it: no code of its own either
        modelcheck.refuse_remote_code(tok, "`policy.tokenizer.name`")
    if source.path == cfg.model_name and tok == cfg.tokenizer.name:
        return cfg, source
    return dataclasses.replace(
        cfg, model_name=source.path, tokenizer=dataclasses.replace(cfg.tokenizer, name=tok)
    ), source


def check_model_config(model_name: str, overrides: dict[str, Any] | None) -> bool:
    """The model's config.json within :mod:`dask_lm.io.config_limits` (``hf_config_overrides`` applied), read as
    JSON on the driver before any worker allocates its sizes; whether there is one (without, transformers' own
    error for the directory is the one to give, before any worker starts)."""
    config_path = os.path.join(model_name, modelcheck.CONFIG)
    if not os.path.isfile(config_path):
        return False
    # before transformers parses it: sizes, and nesting it would recurse on
    raw = modelcheck.check_config(model_name)
    if overrides:  # AutoConfig sets each override as a top-level attribute
        check_config_limits({**raw, **overrides}, f"{config_path} with `policy.hf_config_overrides` {overrides}")
    return True


def model_config(model_name: str, overrides: dict[str, Any] | None) -> Any:
    """The model's Hugging Face config as transformers parses it (no weights, no CUDA), for the driver's FLOP count
    and vocabulary size."""
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_name, trust_remote_code=False, **(overrides or {}))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"`policy.model_name` = {model_name!r} is not a readable Hugging Face model directory: {e}"
        ) from e
    if overrides:
        config_path = os.path.join(model_name, modelcheck.CONFIG)
        check_config_limits(config.to_dict(), f"{config_path} with `policy.hf_config_overrides` {overrides}")
    return config
