"""What the core asks of a transport: the :class:`Endpoint` protocol.

The core (``_core``) and the drivers know a transport only through this protocol; they never ask
which one they have. ``ctrlcomm.transport`` implements it twice (TCP, ZeroMQ), and a third
transport implements it the same way. Two capabilities are optional: an endpoint whose messages
travel as one byte stream per peer, in the wire's stream framing, says so (``STREAM``) and
implements :class:`StreamEndpoint` too, which lets the core frame a small message in one
piece; one whose drain can also take the messages a call waits for the short way (a read
that begins with one: a header compared, not decoded) is an :class:`ExpressEndpoint`
(``EXPRESS``). There is one read path either way: :meth:`Endpoint.drain`.

Who owns what: the endpoint owns its sockets and the buffers behind them; the core owns the
messages once :meth:`Endpoint.drain` hands them to the sink, and decides everything about
them (matching, liveness, errors). The endpoint tells the core of a lost peer through
``on_lost`` and never raises for one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from . import _wire as w

# A payload shorter than this is copied into one buffer with its header (cheaper than a
# scatter-gather send of two); a longer one travels as its own buffer, uncopied.
COPY_THRESHOLD = 65536
FAIR_S = 0.005  # awaited waits skip the event loop for at most this long in a row

# What an endpoint tells ``on_lost`` of a same-host peer whose process it saw exit (its
# process descriptor): the core waits a moment for what the peer sent last (see Core._lost)
PROCESS_EXITED = "its process exited"

Sink = Callable[[w.Message | None], "int | None"]
LostCallback = Callable[[int, str, bool], None]


class IoLock:
    """An endpoint's ``io``: a re-entrant lock (as ``threading.RLock``) on its sockets that a
    coroutine can also wait for without blocking its event loop (:meth:`acquire_async`):
    whoever releases it wakes the coroutines waiting, through their loops."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._guard = threading.Lock()  # (the waiters' list, between threads)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()
        if self.waiters:  # (read without the guard: a waiter added meanwhile looks again)
            self.wake_waiters()

    def nudge(self) -> None:
        """Wake the coroutines waiting (each looks again whether to give up): a collective
        started, which a collective waiting gives up for."""
        if self.waiters:
            self.wake_waiters()

    def retake(self) -> None:
        """Take the lock back as a call resumes from a wait (another call may hold it a
        moment). An exception raised meanwhile by a signal handler (Ctrl-C) is raised once
        it is held, not instead: the call's end releases it."""
        lock, exc = self._lock, None
        while True:
            try:
                lock.acquire()
                break
            except BaseException as e:
                exc = e
                if lock._is_owned():  # type: ignore[attr-defined]  # (raised just after)
                    break
        if exc is not None:
            raise exc

    def wake_waiters(self) -> None:
        """Wake the coroutines waiting (:meth:`release`'s second half, also for a caller that
        released ``_lock`` itself)."""
        with self._guard:  # (emptied in place: the core holds the list, see Core)
            waiters = self.waiters[:]
            self.waiters.clear()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(wake_future, fut)
            except RuntimeError:  # (its loop is closed: nobody waits there)
                pass

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined, no-any-return]

    async def acquire_async(self, timeout: float, give_up: Callable[[], bool]) -> bool:
        """Take the lock within ``timeout`` seconds, waiting in the event loop (its holder,
        another thread, wakes this at its release); False at the timeout, or as soon as
        ``give_up()`` says so (looked at first and after each wake-up)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not give_up():
            fut: asyncio.Future[None] = loop.create_future()
            with self._guard:
                self.waiters.append((loop, fut))
            if self._lock.acquire(False):  # (released before this waiter was seen)
                self._forget(loop, fut)
                return True
            left = end - loop.time()
            if left <= 0:
                self._forget(loop, fut)
                return False
            timer = loop.call_later(left, wake_future, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._forget(loop, fut)
            if self._lock.acquire(False):
                return True
        return False

    def _forget(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        with self._guard:
            try:
                self.waiters.remove((loop, fut))
            except ValueError:  # (woken: taken off already)
                pass


def wake_future(fut: asyncio.Future[None]) -> None:
    """Complete ``fut`` unless it is done (a waiter woken, from its loop's thread)."""
    if not fut.done():
        fut.set_result(None)


class Expected(NamedTuple):
    """The messages a step of a call waits for, one from each sender of ``left``, as an
    :class:`ExpressEndpoint`'s drain may take them the short way: their header (a
    collective's, or a point-to-point message's: ``kind``), with the group, call number,
    round (a point-to-point tag), opcode and root given, pickled, no flags, no buffers. The
    core takes a sender out of ``left`` when its message comes either way; a drain that takes
    one the short way puts its payload in ``raw`` and takes it out of ``left`` too."""

    left: dict[int, None]  # the senders whose message has not come yet
    raw: dict[int, bytearray]  # the payloads taken the short way, by sender
    group_id: int
    kind: int
    seq: int
    round: int
    op: int
    root: int


@runtime_checkable
class Endpoint(Protocol):
    """One rank's sockets in one group, as the core uses them.

    A send never blocks: what the kernel (or ZeroMQ) does not take at once is queued and goes
    out during later waits and drains (``backlog`` says how much is queued for a peer). A wait
    returns when something arrived, when :meth:`wake` was called from another thread, or at
    its timeout; the caller then drains. Sockets are used under ``io`` (a re-entrant lock held
    by whichever call runs, never across a wait); one call at a time waits on the endpoint
    (the core's leader: see the core's docstring), and while it waits no other call drains.
    """

    STREAM: bool  # True: a StreamEndpoint too
    EXPRESS: bool  # True: an ExpressEndpoint too
    kind: str  # the transport's name ("shm", "tcp", "zmq"), as Group.stats() reports it
    dropped: dict[str, int]  # messages dropped before the core saw them, by reason
    address: str  # where peers reach this rank ("tcp://host:port")
    closed: bool
    io: IoLock
    held_async: bool  # an awaited call holding ``io`` is suspended in a wait (io released)
    turn: float  # when an awaited wait last went through the event loop
    ended: float  # when the last awaited call on this endpoint ended (the asyncio driver)
    yielding: int  # awaited calls giving the loop a turn before they start (the driver)
    peers: dict[int, str]

    def attach(self, sink: Sink, on_lost: LostCallback, key: bytes | None, me: int) -> None:
        """Hand arriving messages to ``sink``; tell ``on_lost(rank, why, eof)`` of a peer's
        loss; check every message's MAC with ``key`` as sent to rank ``me``."""

    def published(self) -> list[str]:
        """The fields this endpoint adds to its rank's address record ("prefix:value"), for
        its peers' :meth:`set_peers`."""

    def set_peers(self, peers: dict[int, str], fields: dict[int, list[str]] | None = None
                  ) -> None:
        """The peers' addresses by rank (connections are made on first send), and the
        fields each published (this endpoint takes those of its own prefixes). Raises
        FormationError where a peer lacks a field this endpoint cannot do without."""

    def send(self, dst: int, frames: Sequence[Any]) -> None: ...

    def send_many(self, dsts: Sequence[int], frames: Sequence[Any]) -> None:
        """The same frames to several peers (framed once)."""

    def send_last(self, dst: int, frames: Sequence[Any]) -> None:
        """A goodbye: sent even where a peer's queue is full (it may be dropped at close)."""

    @property
    def unflushed(self) -> Collection[Any]:
        """What still waits to go out (connections or peers); empty when all went."""

    def backlog(self, dst: int) -> int:
        """Bytes queued for ``dst`` that its socket did not take yet."""

    def pause(self, src: int) -> None:
        """Stop reading from ``src`` (the core holds too much of its) until :meth:`resume`."""

    def resume(self, src: int) -> None: ...

    def push(self, budget_s: float) -> None:
        """Send what is queued, for at most ``budget_s`` seconds."""

    def drain(self, sink: Sink) -> object:
        """Read what arrived without waiting, into ``sink`` (the one read path: an
        :class:`ExpressEndpoint` takes its ``expect`` the short way in it)."""

    def settle(self, sink: Sink) -> None:
        """Read until nothing more arrives at once (a bounded number of drains)."""

    def wait(self, timeout: float) -> None: ...

    async def wait_async(self, timeout: float) -> None: ...

    def wake(self) -> None:
        """End a wait in progress, from any thread."""

    def watch(self, procs: dict[int, tuple[int, int]]) -> None:
        """Tell ``on_lost`` (with PROCESS_EXITED) as soon as one of these same-host peers'
        processes exits: ``{rank: (pid, start time)}``."""

    def close(self, gone: Collection[int] = ()) -> None:
        """Close the sockets, after a bounded linger for what is queued (not to ``gone``)."""


@runtime_checkable
class StreamEndpoint(Endpoint, Protocol):
    """An endpoint whose peers' messages travel as one byte stream each, in the wire's stream
    framing (``STREAM`` true): the core may frame small messages itself."""

    def set_hello(self, hello: Callable[[int], bytes]) -> None:
        """The first message on a new connection to a peer, framed (who sends on it)."""

    def send_framed(self, dsts: Sequence[int], data: list[bytes]) -> None:
        """Bytes already in the stream framing, to each of ``dsts``."""


@runtime_checkable
class ExpressEndpoint(StreamEndpoint, Protocol):
    """A stream endpoint whose :meth:`Endpoint.drain` takes the messages a call's step waits
    for (``expect``, set by the core while the step waits) the short way, where a read of a
    sender's socket begins with its message: compared with the header expected and copied,
    without the decoder or the sink. Everything else goes to the sink as usual; the drain
    returns whether anything did (an awaited wait's reader callback wakes the call then, or
    when the step is complete)."""

    expect: Expected | None

    def drain(self, sink: Sink) -> bool: ...

    def take_error(self) -> Exception | None:
        """The error an awaited wait's reader callback met and the next drain would raise,
        taken (the call it read for was cancelled before it could raise it)."""


def turn_due(ep: Endpoint) -> bool:
    """Whether an awaited wait that need not go through the event loop (what it waits for is
    there) gives the loop a turn all the same: when it has had none through ``ep`` for
    FAIR_S, so that other tasks (and a cancellation) are not held up by a stream that keeps
    the socket ready."""
    now = time.monotonic()
    if now - ep.turn < FAIR_S:
        return False
    ep.turn = now
    return True


@runtime_checkable
class Liveness(Protocol):
    """What the core asks of a heartbeat: when each peer was last heard from, on its own
    thread, so that a rank busy elsewhere still answers (``transport.Heartbeat``)."""

    last_seen: dict[int, float]  # by rank: the monotonic time of its last heartbeat

    def silent_for(self, rank: int, now: float) -> float:
        """Seconds since ``rank`` was last heard from (0 for unknown ranks)."""

    def catch_up(self) -> None:
        """Read the heartbeats waiting now (a long call of this process may have kept them
        unread)."""

    def running(self, rank: int) -> bool | None:
        """Whether silent ``rank`` is a process of this host that runs (None: unknown)."""

    def close(self) -> None: ...
