"""Saying what a long wait waits for: warnings through :mod:`logging` (the ``ctrlcomm``
logger) at growing intervals, so that a job that seems hung tells which ranks it waits for
long before its timeout (300 s by default) runs out.

The first warning comes after a tenth of the timeout (at least 5 s, at most 30 s: 30 s of
300 s), each next one after twice as long as the wait so far: 30, 60, 120, 240 s. A wait
without a timeout warns from 30 s on. Collectives warn when they ask the ranks they wait for
what they are doing (1, 3, 7, 15... s into the call, ``_core``), from the first warning's
time on; formation warns through :class:`Patience`.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger("ctrlcomm")

FIRST_WARNING_MAX_S = 30.0
FIRST_WARNING_MIN_S = 5.0


def first_warning(timeout: float | None) -> float:
    """Seconds into a wait with ``timeout`` before its first warning."""
    if timeout is None or math.isinf(timeout):
        return FIRST_WARNING_MAX_S
    return min(max(timeout / 10, FIRST_WARNING_MIN_S), FIRST_WARNING_MAX_S)


def waited(what: str, elapsed: float, timeout: float | None, waiting_for: str) -> None:
    """Log that ``what`` has waited ``elapsed`` s of its ``timeout``, for ``waiting_for``."""
    of = "" if timeout is None or math.isinf(timeout) else f" of {timeout:g} s"
    log.warning("%s: %.0f s%s, waiting for %s", what, elapsed, of, waiting_for)


class Patience:
    """A wait that began now, with ``timeout``: :meth:`due` tells when it should say what it
    waits for, :meth:`say` says it (and schedules the next time)."""

    __slots__ = ("what", "timeout", "start", "next")

    def __init__(self, what: str, timeout: float | None, start: float | None = None) -> None:
        self.what = what
        self.timeout = timeout
        self.start = time.monotonic() if start is None else start
        self.next = self.start + first_warning(timeout)

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.next

    def left(self, now: float | None = None) -> float:
        """Seconds until the next warning is due (0 if it is)."""
        return max(self.next - (time.monotonic() if now is None else now), 0.0)

    def say(self, waiting_for: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        waited(self.what, elapsed, self.timeout, waiting_for)
        self.next = self.start + 2 * elapsed


class Watch:
    """While a blocking wait lasts (``with Watch(...)``), a thread that logs what it waits for
    at :class:`Patience`'s times: ``waiting_for``, which the waiting thread keeps up to date
    (through :func:`note`, in that thread), so that a wait deep in a store client's retries
    is told too. Formation uses it: its waits are many, and some have no loop to say it."""

    __slots__ = ("patience", "waiting_for", "_stop", "_outer")

    def __init__(self, what: str, timeout: float | None, waiting_for: str = "") -> None:
        self.patience = Patience(what, None if timeout is None else round(timeout, 1))
        self.waiting_for = waiting_for
        self._stop = threading.Event()
        self._outer: Watch | None = None

    def __enter__(self) -> Watch:
        self._outer = getattr(_local, "watch", None)
        _local.watch = self
        threading.Thread(target=self._run, name="ctrlcomm-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        _local.watch = self._outer

    def _run(self) -> None:
        while not self._stop.wait(self.patience.left()):
            self.patience.say(self.waiting_for)


_local = threading.local()


def until_due() -> float:
    """Seconds until this thread's :class:`Watch` next warns (inf without one): a wait that
    must look up what it waits for (a store request) does so just before, not all along."""
    watch = getattr(_local, "watch", None)
    return math.inf if watch is None else watch.patience.left()


def note(waiting_for: str) -> None:
    """Say what this thread waits for now, to its :class:`Watch` (if it has one)."""
    watch = getattr(_local, "watch", None)
    if watch is not None:
        watch.waiting_for = waiting_for
