"""Data in and out of dask-lm: parquet inputs and outputs, checkpoints, model files, fingerprints.

The Arrow conversion is re-exported here (it lives in :mod:`dask_lm.data.arrow`), lazily: it imports torch, which
a job's driver (``dask-lm score``: checks, fingerprints, the manifest) never needs."""

from typing import Any

__all__ = ["from_arrow", "list_values_offsets", "pad_from_offsets", "to_arrow"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dask_lm.data import arrow

        return getattr(arrow, name)
    raise AttributeError(f"module 'dask_lm.io' has no attribute {name!r}")
