"""An in-memory stand-in for a transport's endpoint, for tests of the core's decisions (the
order of its steps, what its mailbox makes of messages) and for measuring its own CPU: it
implements :class:`ctrlcomm._endpoint.Endpoint` with no sockets, and a subclass says what a
send does and what a drain delivers. Not for tests of communication: those run real ranks
over real sockets (:func:`ctrlcomm.testing.run_group`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from .. import _wire as w
from .._endpoint import IoLock


class StandInEndpoint:
    """Every part of the endpoint protocol that a core's test does not look at, done
    nothing: sends are dropped, a drain delivers nothing, a wait returns at once. A stream
    endpoint (the core frames its small messages itself: :meth:`send_framed`), without the
    short way of reading (``EXPRESS``)."""

    STREAM = True
    EXPRESS = False
    kind = "stand-in"
    address = "stand-in"

    def __init__(self) -> None:
        self.io, self.held_async = IoLock(), False
        self.closed = False
        self.unflushed: Collection[Any] = set()
        self.dropped: dict[str, int] = {}
        self.peers: dict[int, str] = {}
        self.turn = self.ended = 0.0
        self.yielding = 0
        self.key: bytes | None = None
        self.me = -1
        self.sink: Callable[[w.Message | None], int | None] | None = None
        self.on_lost: Callable[[int, str, bool], None] | None = None

    def attach(self, sink: Callable[[w.Message | None], int | None],
               on_lost: Callable[[int, str, bool], None], key: bytes | None, me: int) -> None:
        self.sink, self.on_lost, self.key, self.me = sink, on_lost, key, me

    def published(self) -> list[str]:
        return []

    def set_peers(self, peers: dict[int, str], fields: dict[int, list[str]] | None = None
                  ) -> None:
        self.peers = dict(peers)

    def set_hello(self, hello: Callable[[int], bytes]) -> None:
        pass

    def send(self, dst: int, frames: Sequence[Any]) -> None:
        pass

    def send_many(self, dsts: Sequence[int], frames: Sequence[Any]) -> None:
        for d in dsts:
            self.send(d, frames)

    def send_framed(self, dsts: Sequence[int], data: list[bytes]) -> None:
        pass

    def send_last(self, dst: int, frames: Sequence[Any]) -> None:
        self.send(dst, frames)

    def backlog(self, dst: int) -> int:
        return 0

    def pause(self, src: int) -> None:
        pass

    def resume(self, src: int) -> None:
        pass

    def push(self, budget_s: float) -> None:
        pass

    def drain(self, sink: Callable[[w.Message | None], int | None]) -> object:
        return 0

    def settle(self, sink: Callable[[w.Message | None], int | None]) -> None:
        self.drain(sink)

    def wait(self, timeout: float) -> None:
        pass

    async def wait_async(self, timeout: float) -> None:
        pass

    def wake(self) -> None:
        pass

    def watch(self, procs: dict[int, tuple[int, int]]) -> None:
        pass

    def close(self, gone: Collection[int] = ()) -> None:
        self.closed = True
