"""Models named as users name them: a local directory, or a Hugging Face Hub id resolved once on the driver.

``--model Qwen/Qwen2.5-0.5B`` (CLI), ``model="Qwen/Qwen2.5-0.5B"`` (``score_parquet`` / ``sft_parquet``) and
``{"model_name": "Qwen/Qwen2.5-0.5B"}`` (``Policy``) work as they do in transformers: the driver resolves the id
through ``huggingface_hub.snapshot_download`` into the local snapshot directory of the Hugging Face cache,
downloading what is missing, and every worker loads that directory. Resolving once, on the driver, means one
download per job rather than one per worker, one commit for every rank (a branch that moves mid-job cannot give
two ranks different weights), and checks (:mod:`dask_lm.io.modelcheck`) and content pins
(:mod:`dask_lm.io.fingerprint`) that see the files the workers will read.

The Hub's own conventions hold, read when the call is made (so a test or a notebook may set them late):
``HF_HUB_CACHE`` / ``HF_HOME`` for the cache, ``HF_HUB_OFFLINE=1`` for no network (the cache only), the token
from ``HF_TOKEN`` or ``hf auth login``. ``revision`` is a branch, tag or commit. Workers on other machines must
see the same path: put ``HF_HOME`` on a shared filesystem, or download on every node to the same place.

Only data files are fetched: config, safetensors weights and index, tokenizer and generation files. Neither a
repository's Python code (dask-lm passes ``trust_remote_code=False`` to every load) nor pickled
``pytorch_model*.bin`` weights (unpickling a file from the Hub would run whatever it holds): a repository without
safetensors weights is refused with the fix. A model or tokenizer whose config asks for code of its own
(``auto_map``), local or from the Hub, is refused here, as soon as it is named
(:func:`dask_lm.io.modelcheck.refuse_remote_code`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dask_lm.io.modelcheck import refuse_remote_code

__all__ = ["ModelSource", "resolve_model", "looks_like_hub_id"]

# what from_pretrained reads for a causal LM and its tokenizer, data only: no code, no pickles, no ONNX / GGUF
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# the Hub's repository names: an optional namespace, then letters, digits, "-", "_", "." (at most 96 characters)
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are and how they were named: what a job's manifest records."""

    path: str
    """The local directory the workers load (absolute)."""
    hub_id: str | None = None
    """The Hub id the user gave, or ``None`` for a local directory."""
    revision: str | None = None
    """The requested branch / tag / commit (``None``: the repository's default branch)."""
    commit: str | None = None
    """The commit the cache snapshot holds, when the path is a Hub cache snapshot."""

    def record(self) -> dict[str, str | None]:
        return {"path": self.path, "hub_id": self.hub_id, "revision": self.revision, "commit": self.commit}


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` in the Hub's spelling, and not a path (``./m``, ``/models/m``, ``~/m``)."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~")) and ".." not in name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(name: str | os.PathLike[str], *, revision: str | None = None, what: str | None = None) -> ModelSource:
    """A local model directory as it is, or a Hub id resolved to its local snapshot (downloading what is missing).

    ``what`` names the setting in errors (``--model``, ``policy.model_name``, ``--tokenizer``). Raises
    ``ValueError`` that says which name was tried, where it was looked for, and how to fix it, and for a model
    that asks to run code of its own (:func:`~dask_lm.io.modelcheck.refuse_remote_code`)."""
    from dask_lm.interface import opt

    what = what or opt("model")
    text = os.fspath(name)
    if os.path.exists(text):
        if not os.path.isdir(text):
            raise ValueError(
                f"{what} {text!r} is a file; pass the model's directory (with config.json) or a "
                "Hugging Face Hub id such as Qwen/Qwen2.5-0.5B"
            )
        if revision is not None:
            raise ValueError(
                f"{what} {text!r} is a local directory: a revision ({revision!r}) applies only to a "
                "Hub id; drop the revision"
            )
        refuse_remote_code(text, what)
        return ModelSource(path=os.path.abspath(text))
    if not looks_like_hub_id(text):
        raise ValueError(
            f"{what} {text!r} does not exist: pass a local Hugging Face model directory, or a Hub id "
            "such as Qwen/Qwen2.5-0.5B"
        )
    return _from_hub(text, revision, what)


def _from_hub(repo_id: str, revision: str | None, what: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = _cache_dir()
    offline = _offline()
    shown = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    where = f"the Hugging Face cache {cache}"
    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=offline, allow_patterns=_PATTERNS
        )
    except GatedRepoError:
        raise ValueError(
            f"{what} {shown}: the model is gated on the Hugging Face Hub; accept its terms at "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} {shown}: no such model on the Hugging Face Hub, or it is private (log in with "
            f"`hf auth login` or set HF_TOKEN); it is not a local directory either"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{what} {shown}: the revision does not exist on the Hub; pass a branch, tag or commit "
            f"of https://huggingface.co/{repo_id}"
        ) from None
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x: an interrupted download
            raise ValueError(f"{what} {shown}: {e}") from None
        if offline:
            raise ValueError(
                f"{what} {shown}: not a local directory, and not in {where}, and HF_HUB_OFFLINE=1 "
                f"forbids downloading it; download it once (`hf download {repo_id}`) or unset "
                "HF_HUB_OFFLINE, or pass a local model directory"
            ) from None
        raise ValueError(
            f"{what} {shown}: not a local directory, not in {where}, and the Hub could not be "
            f"reached ({type(e.__cause__ or e).__name__}); check the network, or download it where "
            f"there is one (`hf download {repo_id}`) and point HF_HOME at that cache"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(
            f"{what} {shown}: the Hugging Face Hub answered {e}; retry, or pass a local model directory"
        ) from None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ValueError(
            f"{what} {shown}: the repository has no safetensors weights (only pickled ones, which dask-lm "
            "does not download: loading them would run code from the file); convert it once where you "
            "trust it (from_pretrained, then save_pretrained(dir, safe_serialization=True)) and pass "
            "that directory"
        )
    refuse_remote_code(path, what)
    commit = os.path.basename(path) if os.path.basename(os.path.dirname(path)) == "snapshots" else None
    return ModelSource(path=os.path.abspath(path), hub_id=repo_id, revision=revision, commit=commit)
