"""Megatron-LM's ``AsyncZMQCommunicator`` API on the ctrlcomm core.

Same constructor and methods (``all_reduce_max`` awaited, ``sync_all_reduce_max``, ``close``)
and contract (one value gives an int, several a tuple; no value is a ``ValueError``; a world
of one returns at once; the leader of a subgroup is its first rank), without the original's
flaws: the event loop is woken by the socket (no 1 ms sleep-polling), there is no PUB/SUB
whose slow subscriber loses the first message, values have any size, every call takes an
optional ``timeout=``, and ranks that disagree (another op, another number of values) raise
instead of mixing values. ``all_reduce_min``, ``all_reduce_sum``, ``broadcast`` and
``barrier`` come in the same two styles.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Coroutine
from typing import Any

from . import _dropin as di
from ._errors import InvalidArgumentError, show


def _values(name: str, rank: int, vals: tuple[Any, ...]) -> tuple[int, ...]:
    if not vals:
        raise InvalidArgumentError(f"{name} on rank {rank} needs at least one value")
    out = []
    for v in vals:
        # what the original's struct.pack("!i") takes: anything with __index__ (numpy ints,
        # a one-element integer tensor), not a float
        try:
            out.append(operator.index(v))
        except TypeError:
            raise InvalidArgumentError(f"{name} on rank {rank}: values must be ints (or have "
                                       "__index__: a numpy int, a one-element integer "
                                       f"tensor), got {show(v)} ({type(v).__name__})") from None
    return tuple(out)


def _shape(result: tuple[int, ...]) -> int | tuple[int, ...]:
    return result[0] if len(result) == 1 else result


class AsyncZMQCommunicator:
    """Asyncio-friendly collectives of a few integers among the ranks of a process group.

    Args:
        zmq_context: accepted for compatibility. The communicator's sockets are ctrlcomm's
            own (plain TCP, the fastest here); with ``transport="zmq"`` they are ZeroMQ
            sockets made from this context.
        process_group: a torch ProcessGroup (``None``: the default group), used once, to
            form the ctrlcomm group.
        hostname: address the leader (the group's first rank) binds its store to.
        timeout: default deadline of every call, in seconds.
        transport: ``"shm"``, ``"tcp"`` or ``"zmq"`` (see ``Group.create``); ``None``:
            ``CTRLCOMM_TRANSPORT`` where it is set, else ``"shm"``.
    """

    def __init__(self, zmq_context: Any, process_group: Any = None,
                 hostname: str | None = None, *, timeout: float = 300.0,
                 transport: str | None = None) -> None:
        from .torch import group_from_torch

        self.zmq_context = zmq_context
        kw: dict[str, Any] = {"transport": transport}
        if zmq_context is not None:  # (used where the transport is "zmq")
            kw["zmq_context"] = zmq_context
        self.group = group_from_torch(process_group, hostname=hostname, name="megatron",
                                      timeout=timeout, **kw)
        self.rank = self.group.rank
        self.world_size = self.group.world_size
        self.is_leader = self.rank == 0

    async def _areduce(self, name: str, op: str, vals: tuple[Any, ...], async_op: bool,
                       timeout: float | None) -> int | tuple[int, ...]:
        v = _values(name, self.rank, vals)
        if self.world_size == 1:
            return _shape(v)
        if not async_op:
            # as Megatron's: block this rank (and its loop) until done, then let the loop
            # run once (its engine loop relies on that turn: "the consensus path yields")
            out = self.group.all_reduce(v, op=op, timeout=timeout)
            await asyncio.sleep(0)
            return _shape(out)
        return _shape(await self.group.aio.all_reduce(v, op=op, timeout=timeout))

    def _reduce(self, name: str, op: str, vals: tuple[Any, ...],
                timeout: float | None) -> int | tuple[int, ...]:
        v = _values(name, self.rank, vals)
        if self.world_size == 1:
            return _shape(v)
        return _shape(self.group.all_reduce(v, op=op, timeout=timeout))

    def _awaited(self, name: str, op: str, vals: tuple[Any, ...], async_op: bool,
                 timeout: float | None) -> Coroutine[Any, Any, int | tuple[int, ...]]:
        # (a coroutine that breaks the group where it is cancelled before it began, as
        # group.aio's: an async def's would make no call at all, and this rank's next would
        # pair with the others' this one)
        return di.awaited(self.group, name,
                          lambda: self._areduce(name, op, vals, async_op, timeout),
                          type(self).__name__)

    @di.coroutine_function
    def all_reduce_max(self, *local_vals: int, async_op: bool = True,
                       timeout: float | None = None) -> Coroutine[Any, Any, int | tuple[int, ...]]:
        """Element-wise max over ranks: an int for one value, else a tuple."""
        return self._awaited("all_reduce_max", "max", local_vals, async_op, timeout)

    def sync_all_reduce_max(self, *local_vals: int,
                            timeout: float | None = None) -> int | tuple[int, ...]:
        """Blocking variant of :meth:`all_reduce_max`."""
        return self._reduce("sync_all_reduce_max", "max", local_vals, timeout)

    @di.coroutine_function
    def all_reduce_min(self, *local_vals: int, async_op: bool = True,
                       timeout: float | None = None) -> Coroutine[Any, Any, int | tuple[int, ...]]:
        return self._awaited("all_reduce_min", "min", local_vals, async_op, timeout)

    def sync_all_reduce_min(self, *local_vals: int,
                            timeout: float | None = None) -> int | tuple[int, ...]:
        return self._reduce("sync_all_reduce_min", "min", local_vals, timeout)

    @di.coroutine_function
    def all_reduce_sum(self, *local_vals: int, async_op: bool = True,
                       timeout: float | None = None) -> Coroutine[Any, Any, int | tuple[int, ...]]:
        return self._awaited("all_reduce_sum", "sum", local_vals, async_op, timeout)

    def sync_all_reduce_sum(self, *local_vals: int,
                            timeout: float | None = None) -> int | tuple[int, ...]:
        return self._reduce("sync_all_reduce_sum", "sum", local_vals, timeout)

    @di.coroutine_function
    def broadcast(self, obj: Any = None, src: int = 0, *,
                  timeout: float | None = None) -> Coroutine[Any, Any, Any]:
        """``src``'s object on every rank. ``src`` is a rank within the process group, as
        ``torch.distributed.get_rank(process_group)`` gives it (0: the leader, its first
        global rank), not a global rank as torch.distributed.broadcast's ``src``."""
        return self.group.aio.broadcast(obj, src=src, timeout=timeout)

    def sync_broadcast(self, obj: Any = None, src: int = 0, *,
                       timeout: float | None = None) -> Any:
        return self.group.broadcast(obj, src=src, timeout=timeout)

    @di.coroutine_function
    def barrier(self, *, timeout: float | None = None) -> Coroutine[Any, Any, None]:
        return self.group.aio.barrier(timeout=timeout)

    def sync_barrier(self, *, timeout: float | None = None) -> None:
        self.group.barrier(timeout=timeout)

    def close(self) -> None:
        """Close the communicator's sockets (idempotent)."""
        self.group.close()


__all__ = ["AsyncZMQCommunicator"]
