"""How the ranks of a policy agree: small all-reduces that make every rank take the same branch, or fail together.

SPMD code goes wrong in one way above all: one rank raises (or skips a step) while its peers go on to the next
collective and wait there until the timeout. Everything here is a collective of its own, so the rule for callers
is the usual one: every rank calls the same helpers in the same order, whatever happened locally.

``group`` is the process group the agreement runs on; ``None`` means this rank is alone (a one-rank policy), and
every helper then returns the local answer without any communication. ``where`` is the device the flag tensor
lives on: the device of the group's backend (a gloo group takes host tensors, an NCCL group device tensors).
Flags travel as int64 and sums as float64 (exact for the token and sequence counts the trainer adds up).

- :func:`all_agree` / :func:`any_rank`: a boolean that is True only when it holds on every rank / on some rank;
- :func:`sum_over_ranks` / :func:`max_over_ranks`: numbers reduced over the ranks;
- :func:`first_message`: the first rank's failure message, handed to every rank (an object all-gather);
- :func:`raise_together` and the context manager :func:`failing_together`: a local exception becomes "every rank
  raises": the failing rank its own error, the others :class:`~dask_lm.errors.PeerFailedError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dask_lm.errors import PeerFailedError

__all__ = [
    "all_agree",
    "any_rank",
    "sum_over_ranks",
    "max_over_ranks",
    "first_message",
    "capture",
    "raise_together",
    "failing_together",
]


def _all_reduce(t: torch.Tensor, op: Any, group: Any, standalone: bool) -> None:
    import torch.distributed as dist

    if standalone:
        # a group outside torch.distributed's world (device.standalone_group) is driven through its own methods
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        group.allreduce([t], opts).wait()
    else:
        dist.all_reduce(t, op=op, group=group)


def _flag_reduce(flag: bool, group: Any, where: torch.device | str, op_name: str, standalone: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=where)
    _all_reduce(t, getattr(dist.ReduceOp, op_name), group, standalone)
    return bool(t.item())


def all_agree(ok: bool, group: Any, *, where: torch.device | str = "cpu", standalone: bool = False) -> bool:
    """True only when ``ok`` holds on every rank of ``group`` (a MIN of a flag; doubles as a barrier).

    ``standalone``: ``group`` is a process group of its own (the refit group shared with inference processes),
    called through its own ``allreduce``; the peers there contribute an int64 flag as well."""
    if group is None:
        return ok
    return _flag_reduce(ok, group, where, "MIN", standalone)


def any_rank(flag: bool, group: Any, *, where: torch.device | str = "cpu") -> bool:
    """True when ``flag`` holds on at least one rank (a MAX of a flag): "does anyone still have work?"."""
    if group is None:
        return flag
    return _flag_reduce(flag, group, where, "MAX", False)


def sum_over_ranks(values: Sequence[float], group: Any, *, where: torch.device | str = "cpu") -> list[float]:
    """Each of ``values`` summed over the ranks, in float64 (one all-reduce for the whole list)."""
    if group is None:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def max_over_ranks(values: Sequence[int], group: Any, *, where: torch.device | str = "cpu") -> list[int]:
    """Each of ``values`` (integers: counts of micro-batches, steps) maximised over the ranks."""
    if group is None:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.int64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def first_message(message: str | None, group: Any) -> str | None:
    """The message of the lowest rank that has one (None when no rank has), the same on every rank: an object
    all-gather, so each rank learns *what* failed elsewhere, not only *that* something did."""
    if group is None:
        return message
    import torch.distributed as dist

    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, message, group=group)
    return next((m for m in messages if m is not None), None)


def capture(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn``; its exception (any, KeyboardInterrupt included: the peers must hear of it too) is returned,
    not raised, so the caller still reaches the agreement every other rank is waiting in."""
    try:
        fn()
        return None
    except BaseException as e:
        return e


def raise_together(
    error: BaseException | None,
    group: Any,
    *,
    peer_message: str,
    where: torch.device | str = "cpu",
    agreed: bool | None = None,
    on_failure: Callable[[], None] | None = None,
) -> None:
    """Agree whether any rank failed; if one did, ``on_failure()`` runs (cleanup: it must not use ``group``) and
    every rank raises: ``error`` where it happened, ``PeerFailedError(peer_message)`` on the others.

    ``agreed``: the outcome was already agreed on (by an earlier :func:`all_agree`); no collective is issued. A
    failure of the agreement itself (a peer that is gone) counts as this rank's failure."""
    try:
        all_ok = agreed if agreed is not None else all_agree(error is None, group, where=where)
    except BaseException as e:
        all_ok, error = False, error or e
    if all_ok:
        return
    if on_failure is not None:
        on_failure()
    raise error or PeerFailedError(peer_message)


@contextlib.contextmanager
def failing_together(
    group: Any, *, peer_message: str, where: torch.device | str = "cpu", on_failure: Callable[[], None] | None = None
) -> Iterator[None]:
    """The body's exception, if any, is held until every rank has reported in; then :func:`raise_together`.

    Usage, on every rank::

        with failing_together(group, peer_message="another rank failed to write the weights"):
            write_my_part()
    """
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        error = e
    raise_together(error, group, peer_message=peer_message, where=where, on_failure=on_failure)
