"""``NamedSharding``: the ranks of a Policy as an array with named axes (NeMo RL's ``Policy.sharding_annotations``).

NeMo RL's Policy lays its ranks out as ``arange(world_size).reshape(pp, dp, cp, tp)`` with the axis names
``pipeline_parallel``, ``data_parallel``, ``context_parallel``, ``tensor_parallel``
(``nemo_rl/models/policy/lm_policy.py:242-255``), and its loops read the data-parallel degree from it:
``policy.sharding_annotations.get_axis_size("data_parallel")`` pads a partial batch to a multiple of the
data-parallel ranks (``nemo_rl/algorithms/sft.py:321``, ``dpo.py:328``, ``rm.py:376``, ``grpo.py:4668``).

dask-lm shards with FSDP2 data parallelism only, so its layout is ``[1, world_size, 1, 1]``: every rank is a
data-parallel rank. The methods and their results follow ``nemo_rl/distributed/named_sharding.py``: ``shape`` is a
``{name: size}`` dict, ``layout`` a copy of the integer array, ``get_ranks`` drops the axes it is given.

>>> s = NamedSharding.data_parallel(2)
>>> s.get_axis_size("data_parallel"), s.shape
(2, {'pipeline_parallel': 1, 'data_parallel': 2, 'context_parallel': 1, 'tensor_parallel': 1})
>>> s.get_worker_coords(1)
{'pipeline_parallel': 0, 'data_parallel': 1, 'context_parallel': 0, 'tensor_parallel': 0}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["NamedSharding", "POLICY_AXES"]

POLICY_AXES = ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")
"""NeMo RL's axis names for a Policy's ranks, outermost first."""


class NamedSharding:
    """An N-dimensional array of rank ids with one name per axis, outermost first."""

    def __init__(self, layout: Sequence[Any] | np.ndarray[Any, Any], names: Sequence[str]) -> None:
        try:
            array = np.array(layout)
        except ValueError as e:  # a ragged nesting
            raise ValueError(f"NamedSharding: the layout is not a rectangular array of rank ids: {e}") from None
        if not np.issubdtype(array.dtype, np.integer):
            if not (np.issubdtype(array.dtype, np.number) and np.equal(np.mod(array, 1), 0).all()):
                raise ValueError(f"NamedSharding: the layout must hold integer rank ids, got {array.dtype} values")
            array = array.astype(np.int64)
        self._layout: np.ndarray[Any, Any] = array
        self._names = [str(n) for n in names]
        if array.ndim != len(self._names):
            raise ValueError(
                f"NamedSharding: the layout has {array.ndim} dimensions but {len(self._names)} names "
                f"were given ({self._names})"
            )
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"NamedSharding: axis names must be distinct, got {self._names}")
        ranks, counts = np.unique(array, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"NamedSharding: ranks {ranks[counts > 1].tolist()} appear more than once in the layout")
        self._axis = {name: i for i, name in enumerate(self._names)}

    @classmethod
    def data_parallel(cls, world_size: int) -> NamedSharding:
        """A Policy's layout on ``world_size`` ranks that are all data-parallel (dask-lm's only layout)."""
        return cls(np.arange(world_size).reshape(1, world_size, 1, 1), POLICY_AXES)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, self._layout.shape))

    @property
    def ndim(self) -> int:
        return int(self._layout.ndim)

    @property
    def size(self) -> int:
        return int(self._layout.size)

    @property
    def layout(self) -> np.ndarray[Any, Any]:
        """A copy of the rank ids, one array dimension per name."""
        copy: np.ndarray[Any, Any] = self._layout.copy()
        return copy

    def get_axis_index(self, name: str) -> int:
        return self._axis[self._check(name)]

    def get_axis_size(self, name: str) -> int:
        """How many ranks lie along axis ``name`` (``"data_parallel"``: the data-parallel degree)."""
        return int(self._layout.shape[self._axis[self._check(name)]])

    def get_worker_coords(self, worker_id: int) -> dict[str, int]:
        """``{axis name: index}`` of rank ``worker_id``."""
        where = np.argwhere(self._layout == worker_id)
        if not len(where):
            raise ValueError(
                f"NamedSharding: rank {worker_id} is not in the layout (ranks "
                f"{sorted(self._layout.flatten().tolist())})"
            )
        return {name: int(i) for name, i in zip(self._names, where[0])}

    @staticmethod
    def is_axis_zero(coords: dict[str, int], axes: Sequence[str]) -> bool:
        """True when ``coords`` is 0 on every axis of ``axes`` (an axis missing from ``coords`` counts as 0)."""
        return all(coords.get(axis, 0) == 0 for axis in axes)

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """The sorted ranks at ``coords`` (axes not given: every index); [] when an index is out of range."""
        index: list[Any] = [slice(None)] * self.ndim
        for name, i in coords.items():
            axis = self._axis[self._check(name)]
            if not 0 <= i < self._layout.shape[axis]:
                return []
            index[axis] = i
        return sorted(np.unique(self._layout[tuple(index)]).tolist())

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The sub-layout at ``coords`` over the axes not given, or the one rank when every axis is given."""
        index: list[Any] = [slice(None)] * self.ndim
        for name, i in coords.items():
            axis = self._axis[self._check(name)]
            if not 0 <= i < self._layout.shape[axis]:
                raise IndexError(
                    f"NamedSharding: index {i} is out of range for axis {name!r} of size {self._layout.shape[axis]}"
                )
            index[axis] = i
        sub = self._layout[tuple(index)]
        rest = [n for n in self._names if n not in coords]
        return int(sub) if not rest else NamedSharding(sub, rest)

    def _check(self, name: str) -> str:
        if name not in self._axis:
            raise ValueError(f"NamedSharding: no axis named {name!r}; the axes are {self._names}")
        return name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type, compared by content

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        return f"NamedSharding({dims}; ranks {self._layout.flatten().tolist()})"
