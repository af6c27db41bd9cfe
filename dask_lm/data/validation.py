"""Checks on a batch before any rank works on it. Each error names the key, the row and the fix.

A rejected call changes nothing: a batch the driver holds is checked on the driver before anything is scattered
or submitted, and rows that stay on the workers are checked where their partition is
(:mod:`dask_lm.workers.dataflow`) before any rank task runs, so the Policy keeps working after it. Both sides
import it, hence its home in ``data/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dask_lm.data.batch import BatchedDataDict

__all__ = ["validate_input_batch", "validate_train_batch"]

_SHAPE_HELP = "`input_ids` must be an integer tensor [B, S] of right-padded token ids"


def validate_input_batch(
    data: Any, *, what: str, vocab_size: int | None, max_length: int | None, pad_token_id: int | None = None
) -> BatchedDataDict[Any]:
    """Return ``data`` as a BatchedDataDict after checking ``input_ids`` / ``input_lengths``; raise ``ValueError``."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{what}: data must be a BatchedDataDict (or dict) with `input_ids` and `input_lengths`, "
            f"got {type(data).__name__}"
        )
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            hint = " ([B] true length of each row)" if key == "input_lengths" else " ([B, S] right-padded token ids)"
            raise ValueError(f"{what}: data is missing the key `{key}`{hint}; it has {sorted(data.keys())}")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what}: {_SHAPE_HELP}, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"{what}: `input_ids` has dtype {ids.dtype}; token ids must be integers (convert with .long())"
        )
    if ids.dim() != 2:
        raise ValueError(f"{what}: {_SHAPE_HELP}, got shape {list(ids.shape)}")
    b, s = ids.shape
    if b == 0 or s == 0:
        raise ValueError(f"{what}: `input_ids` is empty (shape {list(ids.shape)}); pass at least one row")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError(f"{what}: `input_lengths` must be an integer tensor [B]")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"{what}: `input_lengths` has dtype {lengths.dtype}; lengths must be integers")
    if lengths.shape[0] != b:
        raise ValueError(f"{what}: `input_lengths` has {lengths.shape[0]} entries but `input_ids` has {b} rows")
    for key, value in data.items():
        if not isinstance(value, (torch.Tensor, list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise ValueError(
                f"{what}: `{key}` is not per-row data (a tensor or list with one entry per row); "
                "keep other values out of the batch"
            )
        n = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
        if n != b:
            raise ValueError(f"{what}: `{key}` has {n} rows but `input_ids` has {b}")
    lens = lengths.detach().to("cpu", torch.int64)
    short = (lens < 1).nonzero()
    if short.numel():
        r = int(short[0])
        raise ValueError(f"{what}: `input_lengths[{r}]` = {int(lens[r])}; every row needs at least one token")
    over = (lens > s).nonzero()
    if over.numel():
        r = int(over[0])
        raise ValueError(f"{what}: `input_lengths[{r}]` = {int(lens[r])} but `input_ids` has only {s} columns")
    if max_length is not None:
        too_long = (lens > max_length).nonzero()
        if too_long.numel():
            r = int(too_long[0])
            raise ValueError(
                f"{what}: row {r} has {int(lens[r])} tokens, more than "
                f"`policy.max_total_sequence_length` = {max_length}; truncate the row or raise "
                "max_total_sequence_length"
            )
    cpu_ids = ids.detach().to("cpu", torch.int64)
    valid = torch.arange(s)[None, :] < lens[:, None]
    bad = valid & ((cpu_ids < 0) | (cpu_ids >= vocab_size if vocab_size is not None else torch.zeros_like(valid)))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{what}: `input_ids[{r}, {c}]` = {int(cpu_ids[r, c])} is outside the model's vocabulary "
            f"[0, {vocab_size}); the tokenizer and the model do not match"
        )
    if pad_token_id is not None:
        _check_right_padding(cpu_ids, lens, pad_token_id, what)
    return data if isinstance(data, BatchedDataDict) else BatchedDataDict(data)


def _check_right_padding(ids: torch.Tensor, lens: torch.Tensor, pad: int, what: str) -> None:
    """A left-padded row starts with pad tokens and ends with real ones: its logprobs would be silently wrong."""
    s = ids.shape[1]
    pos = torch.arange(s)[None, :]
    is_pad = ids == pad
    n_pad = (s - lens)[:, None]
    head_is_pad = (is_pad | (pos >= n_pad)).all(dim=1)  # the first s - n positions are all pad
    tail_is_pad = (is_pad | (pos < lens[:, None])).all(dim=1)  # positions from n on are all pad
    left = (lens < s) & is_pad[:, 0] & head_is_pad & ~tail_is_pad
    if bool(left.any()):
        r = int(left.nonzero()[0])
        k = s - int(lens[r])
        raise ValueError(
            f"{what}: row {r} looks left-padded (it starts with {k} pad tokens and its last {k} "
            "positions are not padding); dask-lm needs right padding: tokens first, then pad, with "
            "`input_lengths` giving the count of real tokens"
        )


_PER_TOKEN = ("token_mask", "advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
_PER_ROW = ("sample_mask", "rewards")


def validate_train_batch(
    data: BatchedDataDict[Any],
    loss_fn: Any,
    *,
    check_dim_skip_keys: Any = None,
    vocab_size: int | None = None,
    what: str = "train",
) -> BatchedDataDict[Any]:
    """Checks for ``Policy.train`` beyond :func:`validate_input_batch` (run that first); returns a new batch.

    * the loss follows the ``LossFunction`` protocol and every key it needs is in the data;
    * every tensor with 2+ dims has the sequence width of ``input_ids`` in dim 1 (``check_dim_skip_keys`` aside);
    * float data is finite where it counts (a NaN advantage would silently poison every weight);
    * ``sample_mask`` defaults to ones; ``token_mask`` is zeroed past each row's length (padding never trains).
    """
    from dask_lm.losses.base import LossInputType, loss_attribute
    from dask_lm.losses.loss_input import input_type_of

    if not callable(loss_fn):
        raise ValueError(
            f"{what}: loss_fn must be callable as loss_fn(data=..., global_valid_seqs=..., "
            f"global_valid_toks=..., **inputs), got {type(loss_fn).__name__}"
        )
    for attr in ("loss_type", "input_type"):
        if not hasattr(loss_fn, attr):
            raise ValueError(
                f"{what}: {type(loss_fn).__name__} has no `{attr}` attribute; a loss needs `loss_type` "
                "(LossType) and `input_type` (LossInputType), see dask_lm.losses.LossFunction"
            )
    kind = input_type_of(loss_fn)
    required = list(loss_attribute(loss_fn, "required_keys") or ())
    if kind == LossInputType.DISTILLATION:
        required += [k for k in ("teacher_topk_logits", "teacher_topk_indices") if k not in required]
    out: BatchedDataDict[Any] = BatchedDataDict(dict(data.items()))
    b, s = out["input_ids"].shape
    lens = out["input_lengths"].detach().to("cpu", torch.int64)
    if "sample_mask" not in out:
        out["sample_mask"] = torch.ones(b, dtype=torch.float32)
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(
            f"{what}: {type(loss_fn).__name__} needs the data keys {missing}, which the batch lacks "
            f"(it has {sorted(out.keys())})"
        )
    skip = set(check_dim_skip_keys or ())
    valid = torch.arange(s)[None, :] < lens[:, None]
    for key, value in out.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and key not in skip and value.shape[1] != s:
            raise ValueError(
                f"{what}: `{key}` has shape {list(value.shape)} but `input_ids` is [{b}, {s}]: per-token "
                "data must have the same sequence width (pad it to S), or list the key in "
                "check_dim_skip_keys"
            )
        if value.is_floating_point():
            v = value.detach().to("cpu")
            region = v if v.dim() < 2 or v.shape[1] != s else v[valid]
            bad = ~torch.isfinite(region)
            if bool(bad.any()):
                where = "" if v.dim() < 2 or v.shape[1] != s else " (within the rows' lengths)"
                raise ValueError(
                    f"{what}: `{key}` holds {int(bad.sum())} NaN/inf values{where}; fix the data before training on it"
                )
    for key in _PER_TOKEN:
        if key in out and (not isinstance(out[key], torch.Tensor) or tuple(out[key].shape) != (b, s)):
            got = list(out[key].shape) if isinstance(out[key], torch.Tensor) else type(out[key]).__name__
            raise ValueError(
                f"{what}: `{key}` must be a tensor [{b}, {s}] (one value per token, in get_logprobs' "
                f"positions), got {got}"
            )
    for key in _PER_ROW:
        if key in out and (not isinstance(out[key], torch.Tensor) or tuple(out[key].shape) != (b,)):
            got = list(out[key].shape) if isinstance(out[key], torch.Tensor) else type(out[key]).__name__
            raise ValueError(f"{what}: `{key}` must be a tensor [{b}] (one value per row), got {got}")
    if "token_mask" in out:
        tm = out["token_mask"]
        out["token_mask"] = tm * valid.to(tm.device, tm.dtype)
    if kind == LossInputType.DISTILLATION:
        _check_teacher(out, b, s, valid, vocab_size, what)
    if loss_attribute(loss_fn, "requires_pairs") and b % 2:
        raise ValueError(
            f"{what}: {type(loss_fn).__name__} takes (chosen, rejected) row pairs, but the batch has {b} rows"
        )
    return out


def _check_teacher(
    data: BatchedDataDict[Any], b: int, s: int, valid: torch.Tensor, vocab_size: int | None, what: str
) -> None:
    """Teacher top-k tensors as ``get_topk_logits`` returns them: same [B, S, k], ids inside the vocabulary."""
    values, idx = data["teacher_topk_logits"], data["teacher_topk_indices"]
    for key, t in (("teacher_topk_logits", values), ("teacher_topk_indices", idx)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[:2]) != (b, s) or t.shape[2] < 1:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{what}: `{key}` must be a tensor [{b}, {s}, k] with k >= 1 (get_topk_logits' output), got {got}"
            )
    if values.shape != idx.shape:
        raise ValueError(
            f"{what}: `teacher_topk_logits` {list(values.shape)} and `teacher_topk_indices` "
            f"{list(idx.shape)} must have the same shape"
        )
    if idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"{what}: `teacher_topk_indices` has dtype {idx.dtype}; vocabulary ids must be integers")
    ids = idx.detach().to("cpu", torch.int64)[valid]
    limit = vocab_size if vocab_size is not None else None
    bad = (ids < 0) | (ids >= limit) if limit is not None else ids < 0
    if bool(bad.any()):
        raise ValueError(
            f"{what}: `teacher_topk_indices` holds ids outside the student's vocabulary [0, {limit}) "
            "within the rows' lengths; teacher and student must share a tokenizer"
        )
