"""Model directories checked on the driver, before any cluster starts: a damaged model is bad input (exit 2).

Without these checks a corrupt ``config.json`` or a truncated weight file would be found by the workers, after
the cluster has started and the output has been created, and reported as a runtime failure (exit 1) in the words of
whichever library tripped over it. Here every file that ``from_pretrained`` will read is checked from its
metadata alone (no tensor is loaded, nothing is unpickled), and an error names the file and what is wrong:

- ``config.json`` parses as a JSON object within :mod:`dask_lm.io.config_limits` (no impossible sizes, no deep
  nesting), and ``transformers.AutoConfig`` accepts it;
- neither ``config.json`` nor ``tokenizer_config.json`` asks for the model's own Python code (``auto_map``):
  dask-lm runs only the classes transformers ships, and passes ``trust_remote_code=False`` to every load
  (:func:`refuse_remote_code`, also called on every model and tokenizer name resolved:
  :func:`dask_lm.io.hub.resolve_model`);
- the weights ``from_pretrained`` would pick exist, in its order: ``model.safetensors``, then
  ``model.safetensors.index.json`` (whose shards must all exist), then ``pytorch_model.bin`` and its index;
- every safetensors file has a readable header: an 8-byte little-endian length, a JSON object, every tensor's
  ``data_offsets`` inside the data and of the size its dtype and shape say, and the file exactly
  ``8 + header length + largest end offset`` bytes long (a truncated download fails that last test);
- a ``.bin`` file is a zip archive with its central directory (``torch.save``'s format, which a truncated copy
  loses) or a pickle stream by its magic bytes;
- tokenizer JSON files, when the job tokenizes, parse as JSON.

:func:`model_files` lists what determines results (config, the weights that load, their index, tokenizer files):
the files :mod:`dask_lm.io.fingerprint` pins in a job's manifest.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Any

from dask_lm.interface import opt
from dask_lm.io.config_limits import check_config_limits

__all__ = [
    "load_tokenizer",
    "weight_files",
    "stated_vocab",
    "stated_positions",
    "config_vocab",
    "transformers_module",
    "ModelInfo",
    "check_model",
    "check_config",
    "refuse_remote_code",
    "check_safetensors",
    "check_tokenizer",
    "tokenizer_files",
    "TOKENIZER_FILES",
    "CODE_MAPS",
]

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# the files whose "auto_map" makes transformers import a module from the model's folder (config and tokenizer)
CODE_MAPS = (CONFIG, "tokenizer_config.json")
_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the header length
# bytes per element; sub-byte and exotic dtypes are left out of the size check rather than guessed
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class ModelInfo:
    """What the driver knows about a model directory once it has been checked."""

    path: str
    files: list[str] = field(default_factory=list)
    """Names (relative to ``path``) of every file that determines results: config, weights, index, tokenizer."""
    vocab_size: int | None = None
    """The vocabulary size from the config (``get_text_config()`` for composite models), when it states one."""


def check_model(model: str, *, load_config: bool = True) -> ModelInfo:
    """Check a Hugging Face model directory as ``from_pretrained`` will read it; ``ValueError`` names the file.
    ``load_config=False`` leaves out loading the config through transformers (seconds of imports) and so the
    vocabulary size: for a job that will not load the model (a finished one's ``--resume``, whose files are
    still compared by content)."""
    if not os.path.isdir(model):
        raise ValueError(f"{opt('model')} {model!r} is not a directory")
    config_path = os.path.join(model, CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"{opt('model')} {model!r} has no config.json: not a Hugging Face model directory")
    check_config(model)
    refuse_remote_code(model)
    weights = weight_files(model)
    vocab_size = _auto_config_vocab(model, config_path) if load_config else None
    headers = {}  # safetensors file -> its tensor names: each header is read once
    for name in weights:
        if name.endswith(".safetensors"):
            headers[name] = check_safetensors(os.path.join(model, name))
        elif not name.endswith(".index.json"):
            _check_pickle_container(os.path.join(model, name))
    for name in weights:
        if name.endswith(".index.json"):
            _check_index(model, name, headers)
    files = sorted({CONFIG, *weights, *tokenizer_files(model)})
    return ModelInfo(path=model, files=files, vocab_size=vocab_size)


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files present in ``directory`` (names from :data:`TOKENIZER_FILES`)."""
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, f))]


def check_tokenizer(directory: str) -> None:
    """The tokenizer's JSON files parse (a garbled ``tokenizer.json`` otherwise fails on every worker), and it asks
    for no code of its own (:func:`refuse_remote_code`)."""
    refuse_remote_code(directory)
    for name in tokenizer_files(directory):
        if name.endswith(".json"):
            _read_json(os.path.join(directory, name), "a tokenizer file")


def check_config(model: str) -> dict[str, Any]:
    """``model``'s ``config.json`` as JSON, within :mod:`dask_lm.io.config_limits`: a ``ValueError`` names the file
    and the key otherwise. JSON only (no transformers import), so it runs before anything starts."""
    path = os.path.join(model, CONFIG)
    cfg = _read_json(path, "a model config")
    check_config_limits(cfg, path)
    return cfg


def refuse_remote_code(directory: str, what: str | None = None) -> None:
    """``ValueError`` when ``directory``'s ``config.json`` or ``tokenizer_config.json`` has ``auto_map``: the
    model's classes are Python modules in its own folder, which transformers would import (after a "[y/N]" prompt
    in a terminal, or at once with ``trust_remote_code=True``). dask-lm runs only the classes transformers ships,
    whatever the terminal. ``what`` names the setting the directory came from (``--model``, ``--tokenizer``)."""
    for name in CODE_MAPS:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        obj = _read_json(path, "a model config" if name == CONFIG else "a tokenizer file")
        if "auto_map" not in obj:
            continue
        auto_map = obj["auto_map"]  # {"AutoConfig": "mod.Class", "AutoTokenizer": [slow, fast]}, or a legacy list
        refs = sorted(
            {
                str(r)
                for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])
                for r in (v if isinstance(v, list) else [v])
                if r
            }
        )
        model_type = obj.get("model_type") if name == CONFIG else None
        kind = (
            f"architecture (model_type {model_type!r})"
            if isinstance(model_type, str)
            else "architecture"
            if name == CONFIG
            else "tokenizer"
        )
        raise ValueError(
            f'{what + " " if what else ""}{directory!r}: {path} has "auto_map" ({", ".join(refs[:3])}'
            f"{', ...' if len(refs) > 3 else ''}): the model asks to run Python code from its own "
            "folder, and dask-lm runs only the classes transformers ships, never a model's own code "
            f"(trust_remote_code is always False). If transformers ships this {kind}, delete "
            f'"auto_map" from {name} and its own classes load it; otherwise convert the model, '
            "where you trust its code, to one transformers ships"
        )


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it should be {what}: restore it (re-download the "
            "model, or save it again with save_pretrained)"
        ) from None
    except RecursionError:  # json's C decoder recurses once per nested array or object
        raise ValueError(
            f"{path} nests too deeply to be read as JSON (deeper than Python's recursion limit); it "
            f"should be {what}: restore it (re-download the model, or save it again with "
            "save_pretrained)"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path} holds a JSON {type(obj).__name__}, not an object; it should be {what}: restore it "
            "(re-download the model, or save it again with save_pretrained)"
        )
    return obj


def stated_vocab(model: str) -> int | None:
    """The vocabulary size ``config.json`` states (``vocab_size``, or its ``text_config``'s for composite models),
    read as JSON: no transformers import, so it can be checked before anything starts."""
    cfg = _read_json(os.path.join(model, CONFIG), "a model config")
    for where in (cfg, cfg.get("text_config")):
        vocab = where.get("vocab_size") if isinstance(where, dict) else None
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
            return vocab
    return None


def stated_positions(model: str) -> int | None:
    """``max_position_embeddings`` (or ``n_positions``) as ``config.json`` states it (its ``text_config``'s first,
    as a scoring replica reads it), as JSON."""
    cfg = _read_json(os.path.join(model, CONFIG), "a model config")
    for where in (cfg.get("text_config"), cfg):
        if isinstance(where, dict):
            for key in ("max_position_embeddings", "n_positions"):
                value = where.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def config_vocab(model: str) -> int | None:
    """That ``transformers.AutoConfig`` loads ``model``'s config (``ValueError`` naming the file otherwise), and the
    vocabulary size it states. Seconds of imports the first time: a job's driver runs it beside its other checks."""
    return _auto_config_vocab(model, os.path.join(model, CONFIG))


_IMPORT_LOCK = threading.Lock()


def transformers_module() -> Any:
    """``transformers`` with ``AutoConfig`` and ``AutoTokenizer`` resolved, imported by one thread at a time. Its
    lazy module is not safe to import from two threads at once: the second sees a half-initialised
    ``transformers.models.auto`` and fails with ``AttributeError: module 'transformers' has no attribute
    'AutoConfig'``. Seen when the driver's own config check (an attached cluster without workers yet) ran beside
    the row pre-scan's tokenizer load, each in its thread."""
    with _IMPORT_LOCK:
        import transformers

        transformers.AutoConfig, transformers.AutoTokenizer  # noqa: B018 (resolved here, under the lock)
    return transformers


def load_tokenizer(directory: str) -> Any:
    """The tokenizer in ``directory`` as ``AutoTokenizer.from_pretrained(directory, trust_remote_code=False)`` loads
    it, through the class its ``tokenizer_config.json`` names where transformers has that class: ``AutoTokenizer``
    itself imports the auto-config machinery, and with it torch (seconds a driver that only tokenizes need not
    spend). A config that names no class transformers has goes to ``AutoTokenizer``."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    with _IMPORT_LOCK:  # transformers' lazy module, one thread at a time (transformers_module says why)
        import transformers

        cls = getattr(transformers, named, None) if isinstance(named, str) and named.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers_module().AutoTokenizer
    return cls.from_pretrained(directory, trust_remote_code=False)


def _auto_config_vocab(model: str, config_path: str) -> int | None:
    transformers = transformers_module()
    try:
        cfg = transformers.AutoConfig.from_pretrained(model, trust_remote_code=False)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError, ... for a config it cannot use
        raise ValueError(
            f"{config_path} is not a config transformers can load ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]})"
        ) from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else None


def weight_files(model: str) -> list[str]:
    """The weights ``from_pretrained`` loads, in its order of preference (plus the index that names them)."""
    if os.path.isfile(os.path.join(model, SAFETENSORS)):
        return [SAFETENSORS]
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        if os.path.isfile(os.path.join(model, index)):
            return [index, *sorted(set(_index_map(model, index).values()))]
    if os.path.isfile(os.path.join(model, BIN)):
        return [BIN]
    raise ValueError(
        f"{opt('model')} {model!r} has no weights (*.safetensors or pytorch_model*.bin): from_pretrained "
        f"loads {SAFETENSORS}, {SAFETENSORS_INDEX} with its shards, or {BIN}"
    )


def _index_map(model: str, index: str) -> dict[str, str]:
    path = os.path.join(model, index)
    weight_map = _read_json(path, "a weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f'{path} has no "weight_map" of tensor names to file names; restore it (re-download the '
            "model, or save it again with save_pretrained)"
        )
    for name in sorted(set(weight_map.values())):
        if os.path.basename(name) != name or not os.path.isfile(os.path.join(model, name)):
            raise ValueError(
                f"{path} names the weight file {name!r}, which is not in {model}: the download is "
                "incomplete; fetch the missing shard(s)"
            )
    return weight_map


def _check_index(model: str, index: str, headers: dict[str, list[str]]) -> None:
    """Every tensor the index places in a safetensors shard is in that shard's header."""
    by_file: dict[str, set[str]] = {}
    for tensor, name in _index_map(model, index).items():
        by_file.setdefault(name, set()).add(tensor)
    for name, tensors in sorted(by_file.items()):
        if name not in headers:
            continue
        missing = sorted(tensors - set(headers[name]))
        if missing:
            raise ValueError(
                f"{os.path.join(model, index)} places {len(missing)} tensor(s) in {name} that it does "
                f"not hold (first: {missing[0]!r}): the index and the shards come from different "
                "saves; fetch them again together"
            )


def check_safetensors(path: str) -> list[str]:
    """Check a safetensors file's header against its size; returns its tensor names."""
    st = os.stat(path)
    fix = "re-download the model, or save it again with save_pretrained"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is {len(head)} bytes long: too short for a safetensors file; {fix}")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise ValueError(
                f"{path} is not a safetensors file: its first 8 bytes give a header of {length:,} bytes "
                f"(more than the format's {_MAX_HEADER:,}); {fix}"
            )
        if 8 + length > st.st_size:
            raise ValueError(
                f"{path} is truncated: its header alone needs {8 + length:,} bytes but the file has "
                f"{st.st_size:,}; {fix}"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e}); {fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object; {fix}")
    data = st.st_size - 8 - length
    end = 0
    names = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets in the header; {fix}")
        if offsets[1] > data:
            raise ValueError(
                f"{path} is truncated: tensor {name!r} ends at byte {offsets[1]:,} of the data but the "
                f"file holds {data:,} bytes of data; {fix}"
            )
        shape, width = info.get("shape"), _DTYPE_BYTES.get(info.get("dtype"))
        if (
            width
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and offsets[1] - offsets[0] != math.prod(shape) * width
        ):
            raise ValueError(
                f"{path}: tensor {name!r} ({info.get('dtype')} {shape}) should take "
                f"{math.prod(shape) * width:,} bytes but its data_offsets give "
                f"{offsets[1] - offsets[0]:,}; {fix}"
            )
        end = max(end, offsets[1])
        names.append(name)
    if st.st_size != 8 + length + end:
        raise ValueError(
            f"{path} is {st.st_size:,} bytes but its header describes {8 + length + end:,} "
            f"(8 + a {length:,}-byte header + {end:,} bytes of tensors): the file is damaged; {fix}"
        )
    return names


def _check_pickle_container(path: str) -> None:
    """``torch.save`` writes a zip archive (its central directory sits at the end, so a truncated copy has none);
    older files are a bare pickle stream. Judged by magic bytes only: the file is never unpickled."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"PK":
        if zipfile.is_zipfile(path):
            return
        raise ValueError(
            f"{path} is a damaged zip archive (no central directory: truncated?); re-download the "
            "model, or save it again with save_pretrained"
        )
    if len(magic) == 2 and magic[0] == 0x80 and 2 <= magic[1] <= 5:
        return
    raise ValueError(
        f"{path} is neither a torch.save zip archive nor a pickle stream (it starts with "
        f"{magic!r}); re-download the model, or save it again with save_pretrained"
    )
