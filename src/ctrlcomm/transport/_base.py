"""What both endpoints share: the bell that wakes a wait from another thread, and the hand-over
of an endpoint's ``io`` lock while an awaited call is suspended in a wait."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Awaitable
from typing import Any

from .._endpoint import PROCESS_EXITED, LostCallback


class _Bell:
    """An eventfd that wakes a wait on an endpoint from another thread (or task): the group's
    core rings it when ``close`` or ``abort`` is called while a call is in progress, so the
    call wakes at once instead of at its deadline."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # ring and close from different threads: a descriptor closed in between could be
        # another file's by the time it is written to
        self._lock = threading.Lock()

    def ring(self) -> None:
        with self._lock:
            if self.fd >= 0:
                try:
                    os.eventfd_write(self.fd, 1)
                except OSError:  # (rung past 2**64 - 2 times unread: it still wakes)
                    pass

    def clear(self) -> bool:
        """Take the rings: whether there were any."""
        try:
            os.eventfd_read(self.fd)
        except OSError:  # not rung (EAGAIN), or closed
            return False
        return True

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


async def _unheld(ep: Any, aw: Awaitable[Any]) -> None:
    """Await ``aw`` (a wait of an awaited call) with ``ep.io`` released, and ``held_async``
    set meanwhile: the call is suspended, its event loop's thread free to stay away (a
    watchdog's abort() sends from its own thread then: see Core._abort_suspended). Taken
    back as the call resumes, cancelled too."""
    _let_go(ep)
    try:
        await aw
    finally:
        _take_back(ep)


def _let_go(ep: Any) -> None:
    """Release ``ep.io`` as an awaited call is suspended (``held_async`` set): see
    :func:`_unheld`, and :func:`_take_back` as it resumes."""
    ep.held_async = True
    ep.io.release()


def _take_back(ep: Any) -> None:
    """Take ``ep.io`` back as a suspended call resumes (a watchdog's abort may hold it a
    moment; a signal's exception is raised once it is held: IoLock.retake), ``held_async``
    cleared either way (it stayed set once, a watchdog's abort then raising)."""
    try:
        ep.io.retake()
    finally:
        ep.held_async = False


SETTLE_ROUNDS = 8  # drains of a settle (see TcpEndpoint.settle): accept, identify, read


class PidWatch:
    """Same-host peers' processes, watched through process descriptors (``pidfd_open``): one
    epoll descriptor (:attr:`fd`) that an endpoint waits on with its sockets, readable as soon
    as a peer's process exits, kill -9 included, whatever the transport (ZeroMQ hides a
    closed connection; a TCP peer this rank never connected to tells nothing)."""

    def __init__(self, procs: dict[int, tuple[int, int]]) -> None:
        """``procs``: ``{rank: (pid, start time)}`` (``_net.same_host_procs``)."""
        self.ep = select.epoll()
        self.fd = self.ep.fileno()
        self.ranks: dict[int, int] = {}  # by pidfd
        self.gone: list[int] = []  # ranks whose process had exited before it was watched
        # (the start time is not compared: a pid that is a later process's means the peer
        # exited, and that process's exit then tells it, or heartbeats do; a look in /proc
        # per peer was most of a 256-rank group's formation here)
        for rank, (pid, _) in procs.items():
            try:
                pfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.gone.append(rank)
                continue
            except (OSError, AttributeError):  # (no pidfds here: heartbeats tell)
                continue
            self.ep.register(pfd, select.EPOLLIN)
            self.ranks[pfd] = rank

    def tell(self, on_lost: LostCallback | None) -> None:
        """Tell ``on_lost`` (an endpoint's) of each rank whose process exited since last
        told, with PROCESS_EXITED."""
        if on_lost is not None:
            for rank in self.exited():
                on_lost(rank, PROCESS_EXITED, True)

    def exited(self) -> list[int]:
        """The ranks whose process exited since last asked (each told once)."""
        out, self.gone = self.gone, []
        if self.ranks:
            for pfd, _ in self.ep.poll(0):
                rank = self.ranks.pop(pfd, None)
                if rank is not None:
                    self.ep.unregister(pfd)
                    os.close(pfd)
                    out.append(rank)
        return out

    def close(self) -> None:
        for pfd in self.ranks:
            os.close(pfd)
        self.ranks = {}
        self.ep.close()
