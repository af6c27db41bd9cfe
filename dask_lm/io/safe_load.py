"""Reading checkpoint files without running code from them.

A checkpoint directory may come from somewhere else (a shared drive, a download, another user), and a pickle runs
whatever it names while it loads. Every pickled file a checkpoint holds is therefore read as data only:

- torch files (the LR scheduler state) load with ``torch.load(weights_only=True)``: tensors, containers, numbers;
- DCP's ``.metadata`` is a plain pickle that torch's ``FileSystemReader`` reads with ``pickle.load``; here it is
  read once by an unpickler that resolves only DCP's metadata classes (and ``torch.Size``, dtypes, layouts,
  paths), and the reader hands that object to DCP instead of reading the file again;
- DCP's non-tensor items (optimizer hyperparameters such as ``lr`` and ``betas``) are ``torch.save`` blobs that
  DCP's default planner loads with ``weights_only=False``; the planner here loads them with ``weights_only=True``.

A file that needs anything else is refused with :class:`UnsafeCheckpointError` (a ``ValueError``) naming it.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from typing import Any

import torch

from dask_lm.errors import UnsafeCheckpointError

__all__ = ["UnsafeCheckpointError", "load_plain", "read_dcp_metadata", "dcp_load", "one_line"]

# what torch's DCP writes into .metadata (checked against the files torch 2.x writes, FSDP or not)
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name, from a fixed table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}
# looked up by name in a table made here: a name from the file is never an attribute lookup on torch
_TORCH_VALUES = {
    n: v for n, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))
}


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_plain(path: str, what: str) -> Any:
    """``torch.load(path, weights_only=True)``; anything else in the file is refused, naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a forbidden global; other errors for a corrupt file
        raise UnsafeCheckpointError(
            f"{what} file {path!r} does not hold plain data ({one_line(e)}), so it was not loaded: unpickling "
            "it could run code. Restore it from a checkpoint you trust, or delete it to start this state afresh"
        ) from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_VALUES:
            return _TORCH_VALUES[name]
        raise UnsafeCheckpointError(
            f"DCP metadata file {self.path!r} refers to {module}.{name}, which torch's checkpoint metadata never "
            "holds, so it was not loaded (unpickling it could run code): restore the optimizer checkpoint from a "
            "copy you trust"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"DCP metadata file {self.path!r} holds a persistent reference; refusing it")


def read_dcp_metadata(directory: str) -> Any:
    """The ``Metadata`` of the DCP checkpoint in ``directory``, unpickled with DCP's metadata classes only."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise UnsafeCheckpointError(
            f"DCP metadata file {path!r} cannot be read ({one_line(e)}): the optimizer "
            "checkpoint is incomplete or corrupt"
        ) from None
    if isinstance(metadata, Metadata):
        return metadata
    raise UnsafeCheckpointError(
        f"DCP metadata file {path!r} holds a {type(metadata).__name__}, not DCP checkpoint metadata"
    )


@functools.cache
def _readers() -> tuple[type, type]:
    """DCP's reader and planner, each with its one pickle-reading method replaced (built on first use: importing
    torch.distributed.checkpoint is slow)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def __init__(self, directory: str, metadata: Any) -> None:
            super().__init__(directory)
            self.checked_metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # what FileSystemReader.read_metadata does after its pickle.load, on the metadata read above
            metadata = self.checked_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    class CheckedPlanner(DefaultLoadPlanner):
        def __init__(self, directory: str) -> None:
            super().__init__()
            self.directory = directory

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as e:
                metadata = getattr(self, "metadata", None)  # set by set_up_planner
                info = metadata.storage_data.get(read_item.storage_index) if metadata is not None else None
                where = os.path.join(self.directory, info.relative_path) if info else self.directory
                raise UnsafeCheckpointError(
                    f"optimizer checkpoint file {where!r}: item {read_item.dest_index.fqn!r} does not hold plain data "
                    f"({one_line(e)}), so it was not loaded (unpickling it could run code): restore the optimizer "
                    "checkpoint from a copy you trust"
                ) from None
            # the base class unpickles with weights_only=False; hand it our own serialization of the plain object
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return CheckedReader, CheckedPlanner


def dcp_load(state: dict[str, Any], directory: str, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state`` with nothing unpickled beyond data.
    Raises :class:`UnsafeCheckpointError` for a file that is not plain data (unwrapped from DCP's
    ``CheckpointException``, which would otherwise carry it as a multi-line traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = _readers()
    reader = reader_cls(directory, read_dcp_metadata(directory))
    try:
        dcp.load(state, storage_reader=reader, planner=planner_cls(directory), **kwargs)
    except CheckpointException as e:
        ours = [exc for exc, _trace in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if ours:
            raise ours[0] from None
        raise
