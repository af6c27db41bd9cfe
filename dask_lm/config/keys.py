"""NeMo RL ``PolicyConfig`` keys that dask-lm accepts but does not act on (:data:`UNHONOURED`), and the check that
refuses or warns about them (:func:`check_unhonoured`, run by ``PolicyConfig.__post_init__``). The config reference
page reads the same table (:mod:`dask_lm.config.doc`), so what it says a key does is what the check does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_lm import interface

if TYPE_CHECKING:  # the type only: policy.py imports this module to run the check
    from dask_lm.config.policy import PolicyConfig

__all__ = ["UNHONOURED", "check_unhonoured"]


# ------------------------------------------------------------------------------------------ unhonoured keys
# NeMo RL PolicyConfig keys that dask-lm accepts (so NeMo configs load) but does not act on. One row per key
# (dotted under `policy.`): what happens when the value is not inert, and why. "refuse": honouring the key changes
# results or whether the job fits, so running without it would be wrong; "warn": a performance or placement knob,
# the job is correct without it; "accept": inert under dask-lm whatever the value. Every other field of the
# dataclasses of dask_lm.config is read somewhere in dask_lm/ (grep for its name).
_OFF = "off"  # inert: null, false or empty
_DISABLED = "disabled"  # inert: null, or a section without a true `enabled` (NeMo RL reads .get("enabled", False))
_ONE = "one"  # inert: 1
# key | action | inert: off / disabled / one / the one inert value ("-" for accept) | reason and fix (an
# indented line continues the reason)
_TABLE = """
dtensor_cfg.tensor_parallel_size       | refuse | one      | dask-lm shards with FSDP2 data parallelism only; set it
                                                             to 1
dtensor_cfg.context_parallel_size      | refuse | one      | dask-lm shards with FSDP2 data parallelism only (each
                                                             rank runs whole sequences); set it to 1
dtensor_cfg.expert_parallel_size       | refuse | one      | dask-lm shards with FSDP2 data parallelism only; set it
                                                             to 1
dtensor_cfg.dp_replicate_size          | refuse | one      | dask-lm shards with FSDP2 data parallelism only (no HSDP
                                                             replicas); set it to 1
dtensor_cfg.cpu_offload                | refuse | off      | FSDP CPU offload of parameters is not implemented, so a
                                                             model that only fits offloaded would not fit; set it to
                                                             false (or run on more ranks)
dtensor_cfg.lora_cfg                   | refuse | disabled | LoRA is not implemented yet (every parameter would
                                                             train); set lora_cfg.enabled to false
dtensor_cfg.automodel_kwargs           | refuse | off      | NeMo Automodel build options (custom backends,
                                                             freeze_config) change the model or what trains, and
                                                             dask-lm builds models with transformers' Auto classes;
                                                             remove it
dtensor_cfg.sequence_parallel          | warn   | off      | sequence parallelism splits activations over
                                                             tensor-parallel ranks and tensor_parallel_size is 1
dtensor_cfg.custom_parallel_plan       | warn   | off      | a tensor-parallel plan, and tensor_parallel_size is 1
dtensor_cfg.defer_fsdp_grad_sync       | warn   | off      | gradients are reduced after every micro-batch (FSDP2's
                                                             default), which gives the same result
dtensor_cfg.clear_cache_every_n_steps  | warn   | off      | the CUDA cache is left to PyTorch's allocator
dtensor_cfg.moe_parallelizer           | warn   | off      | MoE layers are sharded like any block (no expert
                                                             parallelism)
dtensor_cfg._v2                        | accept | -        | selects one of NeMo RL's two DTensor workers; dask-lm has
                                                             one
megatron_cfg.enabled                   | refuse | off      | dask-lm runs the DTensor (FSDP2) backend; set
                                                             megatron_cfg.enabled to false and dtensor_cfg.enabled to
                                                             true
megatron_cfg.extra                     | accept | -        | read only by the Megatron backend, which is refused
quant_cfg                              | refuse | off      | quantised training is not supported yet; remove it
is_vlm                                 | refuse | off      | dask-lm runs text-only causal LMs; set it to false
draft                                  | refuse | disabled | training an Eagle draft model alongside the policy is not
                                                             supported; set draft.enabled to false
router_replay                          | refuse | disabled | replaying the generation's MoE routing is not supported,
                                                             so train-time logprobs would route afresh; set
                                                             router_replay.enabled to false
pretrained_checkpoint                  | warn   | off      | a Megatron checkpoint (NeMo RL reads it with the Megatron
                                                             backend only); the weights load from model_name
generation_batch_size                  | warn   | 32       | the hf backend decodes each rank's whole shard as one
                                                             batch
tokenizer.chat_template                | warn   | default  | the Policy tokenizes nothing itself: apply the template
                                                             to the tokenizer you pass (NeMo RL's get_tokenizer does
                                                             that before the Policy sees it)
tokenizer.chat_template_kwargs         | warn   | off      | the Policy applies no chat template: pass these to
                                                             apply_chat_template where you tokenize
tokenizer.use_fastokens                | warn   | off      | the tokenizer you pass is used as it is
tokenizer.use_processor                | refuse | off      | multimodal processors are not supported yet; set it to
                                                             false and pass processor=None
tokenizer.audio                        | refuse | off      | audio inputs are not supported yet; remove it
tokenizer.video                        | refuse | off      | video inputs are not supported yet; remove it
generation.colocated                   | accept | -        | placement follows the backend: hf decodes on the policy's
                                                             own workers, sglang on its servers
generation.model_name                  | accept | -        | the hf backend decodes with the policy's own weights
                                                             (NeMo RL's GRPO sets it to policy.model_name)
reward_model_cfg.reward_model_type     | accept | -        | its one allowed value, bradley_terry, is what runs
generation.vllm_cfg                    | accept | -        | read only by the vllm backend, which generate() refuses
generation.vllm_kwargs                 | accept | -        | read only by the vllm backend, which generate() refuses
sequence_packing.sequence_length_round | accept | -        | unused in NeMo RL as well: the pad multiple is
                                                             make_sequence_length_divisible_by
"""


def _parse_inert(text: str) -> Any:
    if text == "-":
        return None
    marker = {"off": _OFF, "disabled": _DISABLED, "one": _ONE}.get(text)
    if marker is not None:
        return marker
    return int(text) if text.isdigit() else text


def _parse(table: str) -> tuple[tuple[str, str, Any, str], ...]:
    rows: list[tuple[str, str, Any, str]] = []
    for line in table.strip("\n").splitlines():
        if line.startswith(" "):  # the reason goes on
            key, action, inert, reason = rows.pop()
            rows.append((key, action, inert, f"{reason} {line.strip()}"))
            continue
        key, action, inert_text, reason = (cell.strip() for cell in line.split("|", 3))
        assert action in ("refuse", "warn", "accept"), line
        rows.append((key, action, _parse_inert(inert_text), reason))
    return tuple(rows)


UNHONOURED: tuple[tuple[str, str, Any, str], ...] = _parse(_TABLE)


def _inert(value: Any, inert: Any) -> bool:
    if value is None or value is False:
        return True
    if inert == _OFF:
        return bool(value in ({}, [], ""))
    if inert == _DISABLED:
        return isinstance(value, dict) and not value.get("enabled", False)
    if inert == _ONE:
        return bool(value == 1)
    return bool(value == inert)


def check_unhonoured(cfg: PolicyConfig) -> None:
    """Refuse or warn about :data:`UNHONOURED` keys set to a value that would change behaviour under NeMo RL."""
    for key, action, inert, reason in UNHONOURED:
        if action == "accept":
            continue
        value: Any = cfg
        for part in key.split("."):
            value = value[part] if value is not None else None
        if _inert(value, inert):
            continue
        if action == "refuse":
            raise ValueError(f"`policy.{key}` = {value!r} is not supported: {reason}")
        # at the user's line (their Policy(...) or PolicyConfig call), so Python's default filter shows it once
        # there; the ranks build the config again without warning (workers/tasks.py: _init_policy)
        interface.warn(f"`policy.{key}` = {value!r} is accepted for NeMo RL compatibility and ignored: {reason}")
