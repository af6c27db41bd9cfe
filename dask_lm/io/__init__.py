"""Data in and out of dask-lm: Arrow conversion (and, later, parquet and checkpoints)."""

from dask_lm.data.arrow import from_arrow, list_values_offsets, pad_from_offsets, to_arrow

__all__ = ["from_arrow", "list_values_offsets", "pad_from_offsets", "to_arrow"]
