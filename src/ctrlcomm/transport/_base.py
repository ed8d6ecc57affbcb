"""What both endpoints share: the bell that wakes a wait from another thread, and the hand-over
of an endpoint's ``io`` lock while an awaited call is suspended in a wait."""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable
from typing import Any


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
