"""What dask-lm does with each NeMo RL ``PolicyConfig`` key it does not act on as NeMo RL does (:data:`UNHONOURED`),
and the check that refuses or warns about them (:func:`check_unhonoured`, run by ``PolicyConfig.__post_init__``).

This table is the one place that says so: the config reference (:mod:`dask_lm.config.doc`) and the NeMo RL key
table (``docs/reference/nemo_rl_keys.md``) are rendered from it, so what the pages say a key does is what the check
does. Every other NeMo RL key of the config's dataclasses is honoured as NeMo RL honours it (:data:`DASK_LM_KEYS`
lists the keys that are dask-lm's own)."""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Any, NamedTuple

from dask_lm import interface
from dask_lm.config.equivalents import optimizer_substitute

if TYPE_CHECKING:  # the type only: policy.py imports this module to run the check
    from dask_lm.config.policy import PolicyConfig

__all__ = ["UNHONOURED", "CLOSED", "DASK_LM_KEYS", "Row", "Finding", "findings", "check_unhonoured", "condition"]


class Row(NamedTuple):
    key: str  # dotted under `policy.`
    action: str  # "refuse", "warn" or "accept"
    inert: Any  # the value(s) at which the key changes nothing: see _inert
    reason: str  # what the key does here (and, for a refusal, the way out)


class Finding(NamedTuple):
    key: str
    action: str  # "refuse" or "warn"
    value: Any
    reason: str


# ------------------------------------------------------------------------------------------ the table
# One row per key (dotted under `policy.`; a key may have two rows, the refusal checked first). The action is taken
# when the value is not inert: "refuse": honouring the key changes results (or whether the job fits) and dask-lm
# cannot, so running without it would be wrong; "warn": the run is correct without it (a performance or placement
# knob, a faster kernel of the same math, a key NeMo RL itself never reads); "accept": nothing of a dask-lm run
# depends on it whatever the value (it configures a NeMo RL component dask-lm does not start), so it loads silently.
# Inert: "off" (null, false or empty), "disabled" (null, or a section without a true `enabled`, as NeMo RL reads
# `.get("enabled", False)`), "one" (1), "absent" (only a key left out: NeMo RL never reads it, so any value is
# reported), "=other" (equal to the sibling key `other`), "-" (accept rows), "a,b" (any of these values), or the one
# inert value.
# Where NeMo RL (7ea279a) declares or reads the keys below that are new to its configs: the generation keys in
# nemo_rl/models/generation/interfaces.py:197-226 (val_* "only honored on the NeMo-Gym vLLM rollout path", :207;
# use_async_rollouts read for sglang only, :241), vllm/config.py:168-186 (refit_*, quant_cfg, real_quant*),
# sglang/config.py:202, trtllm/config.py:54, dynamo/config.py:256, megatron/config.py:69 (mcore_generation_config);
# bad_words is read by vllm/vllm_worker.py:666 only; sequence_packing.fuse_loss by models/megatron/train.py:518
# only; dequantize_base_checkpoint by models/policy/workers/dtensor_policy_worker_v2.py:318; LoRA is read from
# dtensor_cfg.lora_cfg (lm_policy.py:176, automodel/setup.py:663), never from `lora`, which only its
# tests/unit/models/policy/test_dtensor_worker.py:158 writes (with learning_rate, :129); no file reads
# activation_checkpointing_enabled (examples/configs/rm.yaml:38); automodel_kwargs go to NeMo Automodel's
# from_pretrained (models/automodel/setup.py:678-770).
_OFF, _DISABLED, _ONE, _ABSENT = "off", "disabled", "one", "absent"
# key | action | inert | what it does here. An indented line continues the row: the reason goes on; or, under a
# key too long for its column, "| action | inert | reason" follow; or, under a long inert value, "| reason".
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
dtensor_cfg.lora                       | refuse | disabled | LoRA is not implemented yet (every parameter would
                                                             train); set lora.enabled to false
dtensor_cfg.lora                       | warn   | absent   | NeMo RL reads no `lora` key (its LoRA section is
                                                             dtensor_cfg.lora_cfg; its own unit-test config carries
                                                             this one), so nothing reads it here either
dtensor_cfg.automodel_kwargs.backend   | warn   | off      | the kernels of NeMo Automodel's own model classes (TE or
                                                             torch attention, linear and RMSNorm, grouped-GEMM
                                                             experts, DeepEP dispatch, the gate's precision): dask-lm
                                                             runs transformers' modules, the same math
dtensor_cfg.automodel_kwargs.backend.fake_balanced_gate
                                       | refuse | off      | a balanced fake MoE router (a test aid) replaces the
                                                             model's own; set it to false
dtensor_cfg.automodel_kwargs.use_liger_kernel
                                       | warn   | off      | Liger's Triton kernels compute the same layers; dask-lm
                                                             trains with transformers' modules
dtensor_cfg.automodel_kwargs.use_sdpa_patching
                                       | warn   | absent   | Automodel's patching of SDPA; attention here is
                                                             policy.attn_implementation
dtensor_cfg.automodel_kwargs.attn_implementation
                                       | warn   | absent   | attention here is policy.attn_implementation (sdpa or
                                                             eager, the same math); set that key instead
dtensor_cfg.automodel_kwargs.force_hf  | warn   | true     | dask-lm always runs transformers' implementation of the
                                                             model (what force_hf true asks for), never Automodel's
dtensor_cfg.automodel_kwargs.freeze_config.freeze_language_model
                                       | refuse | off      | dask-lm trains every parameter of the model; set it to
                                                             false
dtensor_cfg.automodel_kwargs.freeze_config.freeze_vision_tower
                                       | accept | -        | a text-only causal LM (all dask-lm loads) has no vision
                                                             tower to freeze
dtensor_cfg.automodel_kwargs.freeze_config.freeze_audio_tower
                                       | accept | -        | a text-only causal LM (all dask-lm loads) has no audio
                                                             tower to freeze
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
megatron_cfg.extra                     | accept | -        | the Megatron backend's own keys, read only by that
                                                             backend, which is refused
optimizer.name                         | warn   | -        | Transformer Engine's
                                                             FusedAdam runs as torch's AdamW (adam_w_mode true, its
                                                             default) or Adam (false), the same update, fused on GPU
                                                             ranks; options without that equivalent are refused
quant_cfg                              | refuse | off      | quantised training is not supported yet; remove it
quant_calib_data                       | accept | -        | read only with quant_cfg, which is refused
quant_calib_size                       | accept | -        | read only with quant_cfg, which is refused
quant_batch_size                       | accept | -        | read only with quant_cfg, which is refused
quant_sequence_length                  | accept | -        | read only with quant_cfg, which is refused
disable_modelopt_layer_spec            | accept | -        | read only by the Megatron backend with quant_cfg, both
                                                             refused
is_vlm                                 | refuse | off      | dask-lm runs text-only causal LMs; set it to false
draft                                  | refuse | disabled | training an Eagle draft model alongside the policy is not
                                                             supported; set draft.enabled to false
router_replay                          | refuse | disabled | replaying the generation's MoE routing is not supported,
                                                             so train-time logprobs would route afresh; set
                                                             router_replay.enabled to false
pretrained_checkpoint                  | warn   | off      | a Megatron checkpoint (NeMo RL reads it with the Megatron
                                                             backend only); the weights load from model_name
dequantize_base_checkpoint             | warn   | off      | NeMo Automodel's dequantising checkpoint reader; here
                                                             the weights load through transformers' from_pretrained,
                                                             which applies the checkpoint's quantization_config as
                                                             transformers does
learning_rate                          | warn   | absent   | NeMo RL reads no such key (its unit-test config carries
                                                             it): the learning rate is optimizer.kwargs.lr, here as
                                                             there
activation_checkpointing_enabled       | warn   | absent   | NeMo RL reads no such key (two of its example configs
                                                             carry it): activation checkpointing is
                                                             dtensor_cfg.activation_checkpointing, here as there
generation_batch_size                  | warn   | 32       | the hf backend decodes each rank's whole shard as one
                                                             batch
sequence_packing.fuse_loss             | warn   | off      | NeMo RL reads it in its Megatron backend only: the loss
                                                             of a packed micro-batch is the same either way
sequence_packing.sequence_length_round | accept | -        | unused in NeMo RL as well: the pad multiple is
                                                             make_sequence_length_divisible_by
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
reward_model_cfg.reward_model_type     | accept | -        | its one allowed value, bradley_terry, is what runs
generation.backend                     | warn   | hf,dtensor,megatron,sglang
                                                          | vllm, trtllm and dynamo are engines NeMo RL runs beside
                                                             the Policy (its generation workers), which dask-lm does
                                                             not start: Policy.generate() refuses them; use hf (the
                                                             policy's own workers) or sglang (running servers)
generation.val_temperature             | warn   | =temperature
                                                          | NeMo RL samples validation with it on its NeMo-Gym vLLM
                                                             path only; generate() samples with temperature
generation.val_top_p                   | warn   | =top_p   | NeMo RL samples validation with it on its NeMo-Gym vLLM
                                                             path only; generate() samples with top_p
generation.val_top_k                   | warn   | =top_k   | NeMo RL samples validation with it on its NeMo-Gym vLLM
                                                             path only; generate() samples with top_k
generation.bad_words                   | warn   | off      | NeMo RL bans these words in its vLLM backend only; hf and
                                                             sglang decoding (there and here) do not
generation.use_async_rollouts          | warn   | off      | NeMo RL's asynchronous rollouts through its own SGLang
                                                             servers; generate() here answers each call when all its
                                                             rows are done
generation.colocated                   | accept | -        | placement follows the backend: hf decodes on the policy's
                                                             own workers, sglang on its servers
generation.model_name                  | accept | -        | the hf backend decodes with the policy's own weights
                                                             (NeMo RL's GRPO sets it to policy.model_name)
generation.port_range_low              | accept | -        | ports of the inference servers NeMo RL launches; dask-lm
                                                             launches none
generation.port_range_high             | accept | -        | ports of the inference servers NeMo RL launches; dask-lm
                                                             launches none
generation._mtp_weights_from_refit     | accept | -        | NeMo RL fills it in itself (multi-token-prediction draft
                                                             weights of its engines)
generation._debug_payload_metrics      | accept | -        | NeMo RL fills it in itself (a measurement of its Ray
                                                             generation calls)
generation.vllm_cfg                    | accept | -        | read only by the vllm backend, which generate() refuses
generation.vllm_kwargs                 | accept | -        | read only by the vllm backend, which generate() refuses
generation.refit_transport             | accept | -        | how NeMo RL refits its vLLM engines; dask-lm's refits
                                                             are its own methods
generation.refit_cfg                   | accept | -        | how NeMo RL refits its vLLM engines; dask-lm's refits
                                                             are its own methods
generation.quant_cfg                   | accept | -        | quantised vLLM rollouts, read only by the vllm backend
generation.real_quant                  | accept | -        | quantised vLLM rollouts, read only by the vllm backend
generation.real_quant_export_cpu_offload
                                       | accept | -        | quantised vLLM rollouts, read only by the vllm backend
generation.real_quant_ignore           | accept | -        | quantised vLLM rollouts, read only by the vllm backend
generation.mcore_generation_config     | accept | -        | settings of Megatron's inference engine; the megatron
                                                             backend name decodes with the hf path here
generation.sglang_kwargs               | accept | -        | options of the SGLang servers NeMo RL launches; dask-lm
                                                             sends to servers already running
generation.sglang_cfg.extra            | accept | -        | the options of the SGLang servers NeMo RL launches
                                                             (model_path, mem_fraction_static, ...), kept unread:
                                                             dask-lm sends to servers already running, listed in
                                                             sglang_cfg.server_urls
generation.trtllm_cfg                  | accept | -        | read only by the trtllm backend, which generate() refuses
generation.trtllm_kwargs               | accept | -        | read only by the trtllm backend, which generate() refuses
generation.dynamo_cfg                  | accept | -        | read only by the dynamo backend, which generate() refuses
"""

# Sections whose keys NeMo RL passes on to another library (NeMo Automodel's from_pretrained): only the keys the
# table names load, since dask-lm cannot tell whether another one changes the model.
CLOSED = ("dtensor_cfg.automodel_kwargs", "dtensor_cfg.automodel_kwargs.freeze_config")

# The config keys that are dask-lm's own (NeMo RL has no such key): everything else of the dataclasses in
# dask_lm.config that the table does not name is a NeMo RL key dask-lm honours.
DASK_LM_KEYS = frozenset(
    {
        "model_revision",
        "attn_implementation",
        "inference_packing",
        "inference_mb_tokens",
        "inference_compile",
        "train_compile",
        "collective_timeout_s",
        "dtensor_cfg.reshard_after_forward",
        "generation.sglang_cfg.server_urls",
        "generation.sglang_cfg.rows_per_request",
        "generation.sglang_cfg.timeout_s",
        "generation.sglang_cfg.retries",
    }
)


def _parse_inert(text: str) -> Any:
    if text == "-":
        return None
    if "," in text:  # any of these values
        return tuple(text.split(","))
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.isdigit() else text


def _parse(table: str) -> tuple[Row, ...]:
    rows: list[list[str]] = []
    for line in table.strip("\n").splitlines():
        if line.startswith(" "):  # a long key's cells, or the last cell going on
            cells = [c.strip() for c in line.split("|")]
            last = rows[-1]
            if len(cells) == 4 and not cells[0] and len(last) == 1:
                last += cells[1:]
            elif len(last) == 3:  # a long inert value: the reason starts on the next line
                last.append(cells[-1])
            else:
                last[-1] += " " + line.strip()
            continue
        rows.append([c.strip() for c in line.split("|")])
    parsed = []
    for cells in rows:
        key, action, inert, reason = cells
        assert action in ("refuse", "warn", "accept"), cells
        parsed.append(Row(key, action, _parse_inert(inert), reason))
    return tuple(parsed)


UNHONOURED: tuple[Row, ...] = _parse(_TABLE)


def _lookup(owner: Any, key: str) -> tuple[Any, Any]:
    """``(value, its section)`` of dotted ``key`` in a config or a plain dict (None where a part is missing)."""
    parent, value = None, owner
    for part in key.split("."):
        parent = value
        value = value.get(part) if value is not None and hasattr(value, "get") else None
    return value, parent


def _inert(value: Any, inert: Any, section: Any) -> bool:
    if inert == _ABSENT:
        return value is None
    if value is None:
        return True
    if isinstance(inert, str) and inert.startswith("="):
        return bool(value == (section.get(inert[1:]) if section is not None else None))
    if inert == _OFF:
        return value is False or value in ({}, [], "")
    if inert == _DISABLED:
        return value is False or (isinstance(value, dict) and not value.get("enabled", False))
    if inert == _ONE:
        return type(value) is int and value == 1
    if isinstance(inert, tuple):
        return value in inert
    return type(value) is type(inert) and bool(value == inert)


def condition(row: Row) -> str:
    """When the row's action is taken, in words: ``"when set"``, ``"when > 1"``, ``"when enabled"``, ..."""
    if row.action == "accept":
        return ""
    if row.key == "optimizer.name":
        return "when it names Transformer Engine's FusedAdam"
    inert = row.inert
    if inert == _ABSENT:
        return "when present"
    if inert == _OFF:
        return "when set"
    if inert == _DISABLED:
        return "when enabled"
    if inert == _ONE:
        return "when > 1"
    if isinstance(inert, str) and inert.startswith("="):
        return f"when it differs from `{row.key.rpartition('.')[0]}.{inert[1:]}`".replace("`.", "`")
    if isinstance(inert, tuple):
        return f"when not {' / '.join(f'`{v}`' for v in inert)}"
    text = {True: "true", False: "false"}.get(inert, inert) if isinstance(inert, bool) else inert
    return f"when not `{text}`"


def findings(cfg: PolicyConfig | dict[str, Any]) -> list[Finding]:
    """Every key of ``cfg`` (a config, or a NeMo RL ``policy`` dict) that dask-lm refuses or warns about, in table
    order: all of them, where :func:`check_unhonoured` stops at the first refusal."""
    out: list[Finding] = []
    refused: set[str] = set()
    for row in UNHONOURED:
        if row.action == "accept" or row.key in refused:
            continue
        if row.key == "optimizer.name":  # inert unless it names a class that runs as another one
            out += _optimizer_findings(cfg)
            continue
        value, section = _lookup(cfg, row.key)
        if _inert(value, row.inert, section):
            continue
        out.append(Finding(row.key, row.action, value, row.reason))
        if row.action == "refuse":
            refused.add(row.key)  # its warn row would only repeat it
    for closed in CLOSED:
        section, _ = _lookup(cfg, closed)
        known = _known_keys(closed)
        for name, value in section.items() if isinstance(section, dict) else ():
            if name not in known and value is not None:
                out.append(
                    Finding(
                        f"{closed}.{name}",
                        "refuse",
                        value,
                        "NeMo RL passes it on to NeMo Automodel, and dask-lm cannot tell whether it "
                        f"changes the model; remove it (the keys known here: {', '.join(known)})",
                    )
                )
    return out


def _known_keys(section: str) -> list[str]:
    keys = {row.key for row in UNHONOURED} | set(CLOSED)
    return sorted(k[len(section) + 1 :].split(".")[0] for k in keys if k.startswith(section + "."))


def _optimizer_findings(cfg: Any) -> list[Finding]:
    optimizer, _ = _lookup(cfg, "optimizer")
    if optimizer is None or optimizer.get("name") is None:
        return []
    try:
        substitute = optimizer_substitute(optimizer.get("name"), dict(optimizer.get("kwargs") or {}))
    except ValueError as e:
        return [Finding("optimizer.kwargs", "refuse", optimizer.get("kwargs"), str(e))]
    if substitute is None:
        return []
    return [Finding("optimizer.name", "warn", optimizer.get("name"), substitute.description)]


def check_unhonoured(cfg: PolicyConfig) -> None:
    """Refuse the first key of :data:`UNHONOURED` (or of a :data:`CLOSED` section) set to a value that would change
    results; report every key merely warned about in one warning."""
    found = findings(cfg)
    for f in found:
        if f.action == "refuse":
            raise ValueError(f"`policy.{f.key}` = {_short(f.value)} is not supported: {f.reason}")
    if found:
        # one warning for the whole config, at the user's line (their Policy(...) or PolicyConfig call), so Python's
        # default filter shows it once there; the ranks build the config again without warning
        # (workers/tasks.py: _init_policy)
        lines = "\n".join(f"- `policy.{f.key}` = {_short(f.value)}: {f.reason}" for f in found)
        interface.warn(f"{len(found)} NeMo RL config key(s) are accepted and act differently here:\n{lines}")


_REPR = reprlib.Repr()  # a long value (a whole refit_cfg) shortened: the key and its start are what a reader needs
_REPR.maxstring, _REPR.maxother, _REPR.maxdict, _REPR.maxlist, _REPR.maxlevel = 60, 60, 4, 6, 2


def _short(value: Any) -> str:
    return _REPR.repr(value)
