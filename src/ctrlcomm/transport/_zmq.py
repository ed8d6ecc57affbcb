"""The ZeroMQ endpoint (``transport="zmq"``): see :mod:`ctrlcomm.transport`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq
import zmq.utils.z85

from .. import _wire as w
from .._endpoint import COPY_THRESHOLD, FAIR_S, IoLock, turn_due
from .._errors import CtrlcommError, FormationError
from ._base import SETTLE_ROUNDS, PidWatch, _Bell, _unheld
from ._net import LINGER_MS, MAX_POLL_S, _bind_error, _curve_client, _curve_server, _is_v6, _refused, _tcp

HWM = 100_000
# What ZeroMQ's I/O thread may hold for one peer, in large frames, before a sender waits as
# the TCP transport's does (the core's MAX_BACKLOG more): it sends on its own, so a call
# that queues a large object returns without waiting for the receiver (README), but a loop
# of them to a slow or dead receiver must not queue without end (a copy each, where the
# object may change). Small frames, copied by ZeroMQ, are bounded by HWM.
ZMQ_ALLOWANCE = 256 * 1024 * 1024
TRACK_POLL_S = 0.005  # how often a wait over the allowance looks whether ZeroMQ sent more
HELD_BACKLOG = 1 << 62  # a peer's backlog while messages are held for it (ZmqEndpoint)
HELD_POLL_S = 0.05  # how often any wait looks whether a held message fits now (ZmqEndpoint)
# While a socket's last message (the goodbye) has not left ZeroMQ's queue at close, the peer's
# address is tried (a plain TCP connection, given at most FAREWELL_PROBE_S): refused, the peer
# has closed (see _farewell). At once, then after FAREWELL_FIRST_GAP_S, the gap doubling up to
# FAREWELL_PROBE_S (a peer there at the first try often closes right after: every rank closes
# at once).
FAREWELL_PROBE_S = 0.5
FAREWELL_FIRST_GAP_S = 0.01


class ZmqEndpoint:
    """A rank's sockets in one group, over ZeroMQ (``transport="zmq"``)."""


    STREAM = False  # frames only (ZeroMQ's own framing)
    EXPRESS = False
    kind = "zmq"

    def __init__(self, bind_host: str, *, ipv6: bool = False,
                 on_lost: Callable[[int, str, bool], None] | None = None,
                 zmq_context: zmq.Context[Any] | None = None, encrypt: bool = False) -> None:
        # its own context unless given one: close() then terminates it in a thread that the
        # process waits for at exit, so what was sent last still goes out (pyzmq does not
        # terminate contexts at exit: the I/O thread's queue was lost with the process)
        self._own_ctx = zmq_context is None
        self._pid = os.getpid()  # (a forked child must not touch the parent's ZeroMQ)
        ctx: zmq.Context[Any] = zmq_context or zmq.Context(io_threads=1)
        self._ctx = ctx
        self.rx = ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.LINGER, 0)
        # CurveZMQ: this rank's key pair; peers learn the public key from the (authenticated)
        # address table and check that they talk to this rank; traffic is encrypted
        self.curve_public = b""
        self.peer_keys: dict[int, bytes] = {}
        if encrypt:
            self.curve_public, secret = zmq.curve_keypair()
            _curve_server(self.rx, secret)
        self.rx.setsockopt(zmq.RCVHWM, HWM)
        self.rx.setsockopt(zmq.MAXMSGSIZE, w.MAX_MESSAGE)  # (a frame of more is never ours)
        if ipv6 or ":" in bind_host:
            self.rx.setsockopt(zmq.IPV6, 1)
        addr = _tcp(bind_host, "*")
        try:
            self.rx.bind(addr)
        except zmq.ZMQError as e:
            self.rx.close(0)
            if self._own_ctx:
                ctx.term()  # (its only socket closed: at once)
            raise _bind_error(e, "group socket", addr) from None
        self.address: str = self.rx.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.fd: int = self.rx.getsockopt(zmq.FD)
        self.peers: dict[int, str] = {}
        self.tx: dict[int, zmq.Socket[Any]] = {}
        # large frames queued for each peer, as ZeroMQ's trackers and their sizes, oldest
        # first; and whether backlog() last found more than ZMQ_ALLOWANCE for a peer (the
        # next wait, the core's for it to go down, is short: see wait)
        self._queued: dict[int, deque[tuple[zmq.MessageTracker, int]]] = {}
        self._queued_bytes: dict[int, int] = {}
        self._over = False
        # messages ZeroMQ refused for a peer, its queue full (HWM messages: a peer that takes
        # nothing), in order; sent before any later one, as its queue has room (backlog,
        # which the core asks while it waits for room, within the call's deadline)
        self._held: dict[int, deque[tuple[Sequence[Any], list[bool] | None]]] = {}
        # per peer told goodbye: the goodbye's tracker (see send_last, _farewell)
        self._last: dict[int, zmq.MessageTracker] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.rx, zmq.POLLIN)
        self.bell = _Bell()
        self._poller.register(self.bell.fd, zmq.POLLIN)
        self.pids: PidWatch | None = None  # same-host peers' processes (see watch)
        self._exited = False  # their descriptor was seen readable: the next drain tells
        self.io, self.held_async = IoLock(), False  # see Core._abort_suspended
        # (loop, wake) of an awaited wait in progress (see wake)
        self._aw: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None
        self.turn = 0.0  # when an awaited wait last went through the event loop
        self.ended = 0.0  # when the last awaited call on this endpoint ended (run_async)
        self.yielding = 0  # awaited calls giving the loop a turn before they start (run_async)
        self.closed = False
        self.dropped: dict[str, int] = {}  # (ZeroMQ drops nothing it took; see Endpoint)
        self.key: bytes | None = None  # the group's MAC key, to authenticate what arrives
        self.me = -1  # this rank, for which what arrives must be MACed (set by the core)
        self.sink: Callable[[w.Message | None], int | None] | None = None  # unused here
        # ZeroMQ reconnects silently: a lost peer is not reported by this transport
        self.on_lost = on_lost

    def attach(self, sink: Callable[[w.Message | None], int | None],
               on_lost: Callable[[int, str, bool], None], key: bytes | None, me: int) -> None:
        """See :meth:`ctrlcomm._endpoint.Endpoint.attach`."""
        self.sink, self.on_lost, self.key, self.me = sink, on_lost, key, me

    def published(self) -> list[str]:
        """This rank's CurveZMQ public key ("curve:key"), where it encrypts."""
        return ["curve:" + self.curve_public.decode()] if self.curve_public else []

    def set_peers(self, peers: dict[int, str], fields: dict[int, list[str]] | None = None
                  ) -> None:
        """Peers' endpoints, and their CurveZMQ public keys (every peer's, where this rank
        encrypts: FormationError names those without one)."""
        keys = {r: x[len("curve:"):].encode() for r, f in (fields or {}).items()
                for x in f if x.startswith("curve:")}
        if self.curve_public:
            lacking = sorted(set(peers) - set(keys))
            if lacking:
                raise FormationError(f"ranks {lacking} published no encryption key (were they "
                                     "created without encrypt=True?)")
        self.peers = dict(peers)
        self.peer_keys = keys

    def _sock(self, dst: int) -> zmq.Socket[Any]:
        s = self.tx.get(dst)
        if s is None:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, LINGER_MS)
            s.setsockopt(zmq.SNDHWM, HWM)
            if self.curve_public:
                if dst not in self.peer_keys:
                    raise CtrlcommError(f"rank {dst} published no encryption key")
                _curve_client(s, self.peer_keys[dst])
            if _is_v6(self.peers[dst]):
                s.setsockopt(zmq.IPV6, 1)
            s.connect(self.peers[dst])
            self.tx[dst] = s
        return s

    def send(self, dst: int, frames: Sequence[Any]) -> None:
        """Queue a message for ``dst``; never waits for the peer."""
        self.send_many((dst,), frames)

    def send_many(self, dsts: Sequence[int], frames: Sequence[Any]) -> None:
        """Queue one message for each of ``dsts``. A large frame goes zero-copy (ZeroMQ's
        I/O thread reads it after this returns): as it is where it cannot change
        (w.immutable), else copied first, once for all the destinations."""
        held = self._held
        if len(frames) == 3 and type(frames[0]) is bytes and type(frames[1]) is bytes \
                and len(frames[1]) < COPY_THRESHOLD:  # the usual: header, small payload, MAC
            head, payload, mac = frames
            for dst in dsts:
                if held and dst in held:
                    held[dst].append((frames, None))
                    continue
                s = self._sock(dst)
                try:
                    s.send(head, zmq.SNDMORE | zmq.DONTWAIT)
                except zmq.Again:  # (its queue full: ZeroMQ takes a message whole or not)
                    held[dst] = deque([(frames, None)])
                    continue
                s.send(payload, zmq.SNDMORE | zmq.DONTWAIT)
                s.send(mac, zmq.DONTWAIT)
            return
        big = [memoryview(f).nbytes >= COPY_THRESHOLD for f in frames]
        if any(big):
            frames = [memoryview(bytes(f)) if b and not w.immutable(f) else f
                      for f, b in zip(frames, big, strict=True)]
        for dst in dsts:
            if held and dst in held:
                held[dst].append((frames, big))
                continue
            try:
                self._send_one(dst, frames, big)
            except zmq.Again:
                held[dst] = deque([(frames, big)])

    def _send_one(self, dst: int, frames: Sequence[Any], big: list[bool] | None) -> None:
        """Send one message to ``dst`` (``big``: which frames go zero-copy, tracked; None:
        none). zmq.Again where ZeroMQ's queue for it is full, before any frame went."""
        s = self._sock(dst)
        last = len(frames) - 1
        for i, f in enumerate(frames):
            flags = (zmq.SNDMORE if i < last else 0) | zmq.DONTWAIT
            if big is not None and big[i]:
                tracker = s.send(f, flags, copy=False, track=True)
                size = memoryview(f).nbytes
                q = self._queued.get(dst)
                if q is None:
                    q = self._queued[dst] = deque()
                    self._queued_bytes[dst] = 0
                q.append((tracker, size))
                self._queued_bytes[dst] += size
            else:
                s.send(f, flags)

    def _push(self, dst: int) -> None:
        """Send what is held for ``dst`` while ZeroMQ's queue for it has room."""
        q = self._held.get(dst)
        while q:
            frames, big = q[0]
            try:
                self._send_one(dst, frames, big)
            except zmq.Again:
                return
            q.popleft()
        self._held.pop(dst, None)

    def push(self, budget_s: float) -> None:
        """Hand ZeroMQ what is held for peers whose queues have room now; ZeroMQ's I/O thread
        sends the rest on its own, so nothing here waits (``budget_s`` is not needed)."""
        for dst in list(self._held):
            self._push(dst)

    def send_last(self, dst: int, frames: Sequence[Any]) -> None:
        """Queue the last message for ``dst`` before close() (a goodbye), tracked, so that
        close() knows when all that was queued for ``dst`` has left ZeroMQ's queue (see
        _farewell)."""
        if dst in self._held:
            self._push(dst)
        if dst in self._last or dst in self._held:
            self.send(dst, frames)  # (held behind the rest: it goes as they do, untracked)
            return
        s = self._sock(dst)
        s.copy_threshold = 0  # (pyzmq copies a small frame, and tracks nothing, otherwise)
        try:
            for f in frames[:-1]:
                s.send(f, zmq.SNDMORE | zmq.DONTWAIT)
            self._last[dst] = s.send(frames[-1], zmq.DONTWAIT, copy=False, track=True)
        except zmq.Again:  # (its queue full, before any frame went: held, untracked)
            self._held[dst] = deque([(frames, None)])

    @property
    def unflushed(self) -> Collection[int]:
        """The peers with large frames still queued in ZeroMQ, or messages held for them
        (``backlog`` tells how much)."""
        for dst in list(self._queued):
            self._queued_for(dst)
        if self._held:
            return set(self._queued).union(self._held)
        return self._queued

    def _queued_for(self, dst: int) -> int:
        """The bytes of large frames ZeroMQ still holds for ``dst`` (forgetting those sent)."""
        q = self._queued.get(dst)
        if q is None:
            return 0
        n = self._queued_bytes[dst]
        while q and q[0][0].done:
            n -= q.popleft()[1]
        if q:
            self._queued_bytes[dst] = n
        else:
            del self._queued[dst], self._queued_bytes[dst]
        return n

    def backlog(self, dst: int) -> int:
        """The bytes of large frames queued for ``dst`` beyond ZMQ_ALLOWANCE: what the
        core's limit counts (ZeroMQ's I/O thread sends the rest on its own); where messages
        are held for ``dst`` (its queue was full), those that now fit are sent, and while
        any is left, more than any limit (HELD_BACKLOG)."""
        if dst in self._held:
            self._push(dst)
            if dst in self._held:
                self._over = True
                return HELD_BACKLOG
        over = self._queued_for(dst) - ZMQ_ALLOWANCE
        if over > 0:
            self._over = True
            return over
        return 0

    def pause(self, src: int) -> None:
        pass

    def resume(self, src: int) -> None:
        pass

    def watch(self, procs: dict[int, tuple[int, int]]) -> None:
        """Tell the core at once when a same-host peer's process exits (``procs``: their
        ``(pid, start time)``): ZeroMQ reconnects silently, and heartbeats take seconds."""
        if not procs or self.closed:
            return
        self.pids = PidWatch(procs)
        self._poller.register(self.pids.fd, zmq.POLLIN)
        self._exited = True  # (those gone already)

    def _exits(self) -> None:
        self._exited = False
        if self.pids is not None:
            self.pids.tell(self.on_lost)

    def drain(self, sink: Callable[[w.Message | None], int | None], limit: int = 1 << 30
              ) -> int:
        """Receive every message waiting now and hand each to ``sink``, decoded (``None``
        for a malformed or unauthenticated one). Returns the count. A flood is taken for
        FAIR_S at most, the rest at the next drain (as TcpEndpoint.drain). What is held for
        peers whose queues were full goes out first, as far as it fits (as the TCP
        endpoint's drain sends what is pending as its sockets take more)."""
        if self._held:
            for dst in list(self._held):
                self._push(dst)
        n = 0
        rx = self.rx
        clock = time.monotonic
        until = clock() + FAIR_S
        while n < limit:
            try:
                frames = rx.recv_multipart(zmq.DONTWAIT)
            except zmq.Again:
                break
            n += 1
            sink(w.decode_or_none(frames, self.key, self.me))
            # (after each message: one of 1 MiB, MAC checked, takes a millisecond or more;
            # counting them, 128 of those held an awaited caller's loop for 330 ms)
            if clock() >= until:
                break
        if self._exited:  # (told after what came before it)
            self._exits()
        return n

    def settle(self, sink: Callable[[w.Message | None], int | None]) -> None:
        """After a drain, receive what has come in, to its end (a flood: SETTLE_ROUNDS
        drains at most): before a peer is declared lost, what it sent first is taken
        (Core.settle, which drains first)."""
        for _ in range(SETTLE_ROUNDS):
            if not self.drain(sink):
                return

    def _capped(self, timeout: float) -> float:
        """A wait's ``timeout``, TRACK_POLL_S at most where the core waits for a backlog
        to go down: nothing wakes it as ZeroMQ sends, so it looks again soon (it asks
        backlog() again, which sets ``_over`` again while still over; any other wait, once
        that one ended, is as long as asked)."""
        if self._over:
            self._over = False
            return min(timeout, TRACK_POLL_S)
        if self._held:  # (nothing wakes a wait as a full queue gets room: drain pushes)
            return min(timeout, HELD_POLL_S)
        return timeout

    def wait(self, timeout: float) -> None:
        """Sleep until a message may be waiting, :meth:`wake` is called or ``timeout``
        seconds pass."""
        bfd = self.bell.fd
        timeout = self._capped(timeout)
        for s, _ in self._poller.poll(int(min(max(timeout, 0.0), MAX_POLL_S) * 1000 + 0.999)):
            if s == bfd:
                self.bell.clear()
            elif self.pids is not None and s == self.pids.fd:
                self._exited = True

    def wake(self) -> None:
        """End a wait in progress, blocking or awaited (from any thread)."""
        self.bell.ring()  # (a blocking wait polls it)
        aw = self._aw
        if aw is not None:
            try:
                aw[0].call_soon_threadsafe(aw[1])
            except RuntimeError:  # the loop is closed
                pass

    async def wait_async(self, timeout: float) -> None:
        """Like :meth:`wait`, through the running event loop (other coroutines keep running)."""
        if self.rx.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if turn_due(self):  # (no need to go through the event loop, but for that)
                await _unheld(self, asyncio.sleep(0))
            return
        timeout = self._capped(timeout)
        try:
            await _unheld(self, self._readable(timeout))
        finally:
            self.turn = time.monotonic()

    async def _readable(self, timeout: float) -> None:
        """Return when the socket's descriptor is readable, :meth:`wake` is called or
        ``timeout`` seconds pass, through the running event loop (a reader callback: no
        thread, no polling). ``_aw`` holds ``(loop, wake)`` meanwhile."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        def exited() -> None:
            self._exited = True
            wake()

        fd, pids = self.fd, self.pids
        loop.add_reader(fd, wake)
        if pids is not None:
            loop.add_reader(pids.fd, exited)
        timer = loop.call_later(max(timeout, 0.0), wake)
        aw = self._aw = (loop, wake)
        if self.bell.clear():
            # a close() or abort() that rang before _aw was set had no loop to wake (its
            # call found nothing to do at the core's last look, just before this wait)
            wake()
        try:
            await fut
        finally:
            timer.cancel()
            if self._aw is aw:  # (else close() took the reader away already: see there)
                self._aw = None
                loop.remove_reader(fd)
                if pids is not None:
                    loop.remove_reader(pids.fd)
                    if self.closed:  # (close() left it to this loop)
                        pids.close()

    def _end_awaited_wait(self) -> None:
        """(close.) An awaited wait of this thread's loop (close() from another task: a
        close from another thread is done by the thread whose call holds the group, once
        woken): its readers go before the descriptors do, with rx (a number reused at once
        found the loop's stale entry, and add_reader then registered nothing); and the wait
        ends, finding the endpoint closed."""
        aw, self._aw = self._aw, None
        if aw is None:
            return
        try:
            here = asyncio.get_running_loop() is aw[0]
        except RuntimeError:
            here = False
        if here or not aw[0].is_running():  # (a loop not running: nothing selects now)
            try:
                aw[0].remove_reader(self.fd)
                if self.pids is not None:
                    aw[0].remove_reader(self.pids.fd)
                aw[1]()
            except Exception:  # (a closed loop: its selector, entry included, is gone)
                pass
        else:
            self._aw = aw  # (its own thread removes it; wake() ends the wait)

    def close(self, gone: Collection[int] = ()) -> None:
        """Close the sockets. What is queued for peers still goes out, in a thread the
        process's exit waits for (at most LINGER_MS), but for peers known gone: ``gone`` (the
        core's), and those whose BYE waits unread here; ZeroMQ would try to reconnect to them
        until LINGER_MS, and hold the exit as long."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._pid:  # a forked child: the sockets are the parent's
            return
        self._end_awaited_wait()
        gone = set(gone)
        try:
            for _ in range(100_000):
                frames = self.rx.recv_multipart(zmq.DONTWAIT)
                try:  # (the header only; the whole message where it says BYE: its MAC)
                    kind = w.HEADER.unpack_from(frames[0])[2]
                except (struct.error, TypeError, IndexError):
                    continue
                if kind == w.BYE and (m := w.decode_or_none(frames, self.key, self.me)):
                    gone.add(m.src)
        except zmq.ZMQError:  # (Again: all read)
            pass
        self.rx.close(0)
        for dst in list(self._held):  # (what still fits; the rest, for a peer that takes
            self._push(dst)           # nothing, is dropped)
        farewells = []
        for dst, s in self.tx.items():
            tracker = self._last.pop(dst, None)
            if tracker is not None and dst not in gone:  # (closed by _farewell)
                farewells.append((s, tracker, self.peers[dst]))
            else:
                # LINGER_MS: queued messages still go out, in ZeroMQ's I/O thread
                s.close(0 if dst in gone else None)
        self.tx.clear()
        self.bell.close()
        if self.pids is not None and self._aw is None:  # (else its loop removes it: later)
            self.pids.close()
        # (not a daemon: a process that exits right after close() still delivers its last
        # messages, for at most LINGER_MS, as the TCP transport's linger does. A caller who
        # terminates a context of theirs right after close(), as Megatron's shutdown does,
        # waits in term() until this thread has closed the sockets: not ZeroMQ's linger,
        # LINGER_MS, for a peer that has closed)
        threading.Thread(target=_farewell,
                         args=(farewells, self._ctx if self._own_ctx else None),
                         daemon=False, name="ctrlcomm-zmq-linger").start()


def _farewell(socks: list[tuple[zmq.Socket[Any], zmq.MessageTracker, str]],
              ctx: zmq.Context[Any] | None) -> None:
    """(A thread of ZmqEndpoint.close.) Close each socket told goodbye
    (with the goodbye's tracker and the peer's address) once the goodbye, its last message,
    has left ZeroMQ's queue (lingering, as the other sockets, for what the I/O thread may
    still hold: nothing is queued to wait for); or at once where the peer's address refuses
    a connection: it has closed, and nothing queued will reach it (ZeroMQ would try again
    and again); else at LINGER_MS, as the other sockets. Then terminate ``ctx``, the
    endpoint's own context (None: the caller's, which the caller terminates).

    (Why not linger LINGER_MS on every socket: a process whose peers had closed first would
    wait 5 s to exit, the usual end of a group closed on every rank at once, where goodbyes
    take connections made at close.)"""
    end = time.monotonic() + LINGER_MS / 1000
    left = list(enumerate(socks))
    probe_at = [0.0] * len(socks)
    gap = [FAREWELL_FIRST_GAP_S] * len(socks)
    try:
        while left:
            still = []
            for i, (s, tracker, address) in left:
                now = time.monotonic()
                if tracker.done:
                    s.close(LINGER_MS)
                elif now >= end or (now >= probe_at[i] and
                                    _refused(address, min(FAREWELL_PROBE_S, end - now))):
                    s.close(0)
                else:
                    if now >= probe_at[i]:
                        probe_at[i] = time.monotonic() + gap[i]
                        gap[i] = min(gap[i] * 2, FAREWELL_PROBE_S)
                    still.append((i, (s, tracker, address)))
            left = still
            if left:
                time.sleep(TRACK_POLL_S)
    finally:
        # (whatever went wrong above: a socket left open would hold term(), and the exit,
        # for ever)
        for _, (s, _, _) in left:
            with contextlib.suppress(Exception):
                s.close(0)
        if ctx is not None:
            ctx.term()
