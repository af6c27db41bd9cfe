"""Whether the workers can run a model, decided from its Hugging Face config alone, before any weights are read.

The ranks find the parts of a model they use after the weights have loaded: the FSDP blocks named by
``_no_split_modules`` (:meth:`~dask_lm.workers.rank_model.RankModel._apply_fsdp`, world size > 1), the
decoder whose last hidden state every pass reads (:func:`dask_lm.model.forward.decoder_of`), the output
embeddings of a causal LM (:func:`dask_lm.model.logprobs.output_head`) and the ``score`` head of a reward
model. A model without one of them would fail there, minutes into a job, as an ``AssertionError`` in a
worker's traceback. :func:`check_policy_model` asks the same questions first, and answers with a ``ValueError`` that
names ``policy.model_name``, the architecture and the fix. Each rank asks it as its load task begins, before it
joins the process group or reads a weight (:func:`dask_lm.workers.tasks.init_policy`): the question needs the
model's modelling code, 3-6 s of imports that the workers have made in their warm-up already
(:mod:`dask_lm.workers.warm`) and that the driver, which needs none of it, would make on the Policy's critical path.

Nothing here reads weights or touches CUDA: the class transformers would build is resolved from its auto
mappings, and where the structure matters it is built on the ``meta`` device (shapes without storage). The
decoder and the output head are found by calling the worker's own functions on that meta model, so the two
cannot disagree; the FSDP block search is :func:`fsdp_blocks`, the same rule ``_apply_fsdp`` applies.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from dask_lm.config import PolicyConfig

__all__ = ["check_policy_model", "find_decoder", "find_output_embeddings", "fsdp_blocks", "model_class", "rank_config"]


def rank_config(cfg: PolicyConfig, pad_token_id: int) -> Any:
    """The Hugging Face config a rank builds its model from: ``policy.model_name``'s with ``hf_config_overrides``,
    one label for a reward model, and ``pad_token_id`` where the config names no pad id."""
    import transformers

    overrides = dict(cfg.hf_config_overrides or {})
    if cfg.reward_model_cfg.enabled:
        overrides["num_labels"] = 1  # a Bradley-Terry reward model has one score
    hf_config = transformers.AutoConfig.from_pretrained(cfg.model_name, trust_remote_code=False, **overrides)
    if getattr(hf_config, "pad_token_id", None) is None:
        # sequence-classification heads refuse batches > 1 without a pad id; we pool by length anyway
        hf_config.pad_token_id = pad_token_id
    return hf_config


def model_class(hf_config: Any, *, reward_model: bool) -> type[PreTrainedModel] | None:
    """The class ``AutoModelForCausalLM`` (``AutoModelForSequenceClassification`` for a reward model) builds for
    ``hf_config``, or None when transformers has none for this config type. Classes registered with
    ``Auto*.register`` are in the same mapping, so they resolve too."""
    import transformers

    auto = transformers.AutoModelForSequenceClassification if reward_model else transformers.AutoModelForCausalLM
    mapping = auto._model_mapping
    try:
        # transformers types a mapping's values as a class or a (slow, fast) pair: a model mapping holds classes
        return cast("type[PreTrainedModel]", mapping[type(hf_config)])
    except KeyError:
        return None


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP shards one by one: those whose class is named in the model's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def check_policy_model(hf_config: Any, cfg: PolicyConfig, *, world_size: int) -> None:
    """Raise ``ValueError`` when the workers could not run ``policy.model_name`` under ``cfg`` on ``world_size``
    ranks: no causal-LM (or sequence-classification) class, no FSDP blocks when sharded, no findable decoder,
    no output embeddings (causal LM) or no ``score`` head (reward model)."""
    reward = bool(cfg.reward_model_cfg.enabled)
    arch = _architecture(hf_config)
    where = f"`policy.model_name` = {cfg.model_name!r} ({arch})"
    cls = model_class(hf_config, reward_model=reward)
    if cls is None:
        if reward:
            raise ValueError(
                f"{where}: transformers has no sequence-classification class for model type "
                f"{getattr(hf_config, 'model_type', '?')!r}, which a reward model "
                "(`policy.reward_model_cfg.enabled: true`) is built with; use an architecture "
                "AutoModelForSequenceClassification supports, or disable reward_model_cfg"
            )
        raise ValueError(
            f"{where}: transformers has no causal-LM class for model type "
            f"{getattr(hf_config, 'model_type', '?')!r} (AutoModelForCausalLM cannot build it); use a "
            "decoder-only language model, or a sequence-classification checkpoint with "
            "`policy.reward_model_cfg.enabled: true`"
        )
    model = _meta_model(cls, hf_config, reward=reward, where=where)
    name = cls.__name__
    if world_size > 1 and not fsdp_blocks(model):
        declared = getattr(model, "_no_split_modules", None)
        raise ValueError(
            f"{where}: {name} declares no transformer block to shard by (_no_split_modules = "
            f"{declared!r} names no submodule), which FSDP needs across {world_size} ranks; run it "
            "on a single rank (a cluster of one worker), or use a model class whose "
            "_no_split_modules names its decoder-layer class"
        )
    if find_decoder(model) is None:
        raise ValueError(
            f"{where}: cannot find the decoder inside {name} (get_decoder() gives none and there "
            f"is no `{getattr(model, 'base_model_prefix', 'model')}` submodule), whose hidden states "
            "every pass reads; use a standard Hugging Face *ForCausalLM / "
            "*ForSequenceClassification model"
        )
    if reward:
        if getattr(model, "score", None) is None:
            raise ValueError(
                f"{where}: {name} has no `score` head, which reward-model scoring reads; point "
                "`policy.model_name` at a checkpoint whose sequence-classification class has a "
                "`score` head (Llama, Qwen2, Mistral, ...), or disable `policy.reward_model_cfg`"
            )
    elif find_output_embeddings(model) is None:
        raise ValueError(
            f"{where}: {name} has no output embeddings (get_output_embeddings() gives none), "
            "which logprobs and training project hidden states through; use a causal LM with a "
            "language-model head"
        )


def _architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return ", ".join(str(a) for a in archs)
    return f"model_type {getattr(hf_config, 'model_type', '?')!r}"


def _meta_model(cls: type[PreTrainedModel], hf_config: Any, *, reward: bool, where: str) -> torch.nn.Module:
    """``cls`` built on the meta device from a copy of the config the worker would use (no storage allocated)."""
    import torch

    config = copy.deepcopy(hf_config)
    if reward:
        config.num_labels = 1  # as the worker builds it: a Bradley-Terry reward model has one score
    try:
        with torch.device("meta"):
            model: torch.nn.Module = cls._from_config(config)  # untyped in transformers
            return model
    except Exception as e:  # a config the class rejects fails the same way on every worker
        raise ValueError(
            f"{where}: transformers cannot build {cls.__name__} from this config "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); fix config.json or "
            "`policy.hf_config_overrides`"
        ) from None


def find_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The base transformer inside a ``*ForCausalLM`` / ``*ForSequenceClassification`` model, or None. The ranks
    find it the same way (:func:`dask_lm.model.forward.decoder_of`), so this check and they cannot disagree."""
    import torch

    getter = getattr(model, "get_decoder", None)
    if getter is not None:
        try:
            dec = getter()
            if dec is not None and dec is not model:
                return dec if isinstance(dec, torch.nn.Module) else None
        except (AttributeError, NotImplementedError):
            pass
    dec = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return dec if isinstance(dec, torch.nn.Module) else None


def find_output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output projection (``lm_head``) with a ``weight``, or None; what :func:`dask_lm.model.logprobs.output_head`
    reads on the ranks."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    return head if head is not None and getattr(head, "weight", None) is not None else None
