"""The TCP endpoint (the default transport): see :mod:`ctrlcomm.transport`. Also the
flush at exit of what open endpoints still have queued."""

from __future__ import annotations

import asyncio
import atexit
import errno
import os
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .. import _wire as w
from .._endpoint import COPY_THRESHOLD, FAIR_S, Expected, IoLock, turn_due, wake_future
from .._errors import StoreError, WireError
from . import _shm
from ._base import SETTLE_ROUNDS, PidWatch, _Bell, _let_go, _take_back, _unheld
from ._net import (
    LINGER_MS,
    MAX_POLL_S,
    _cpus,
    _dual_stack,
    _local_mode,
    _parse_tcp,
    _tcp,
    host_id,
    ipc_id,
    use_local_sockets,
)
from ._shm import HANDOVER, Ring, recv_fds, ring_size, send_fds, spin_budget


class _Conn:
    __slots__ = ("sock", "fd", "inbound", "rank", "decoder", "pending", "connecting", "events",
                 "backlog", "paused", "rsize", "io", "ring", "fresh")

    def __init__(self, sock: socket.socket, inbound: bool, rank: int | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        # where the stream's bytes go (send, sendmsg) or come from (recv_into): the socket,
        # or a same-host peer's shared ring (self.ring), the socket then telling only its end
        self.io: socket.socket | Ring = sock
        self.ring: Ring | None = None
        self.fresh = False  # accepted on the Unix socket, its first byte not read (_handover)
        self.inbound = inbound
        self.rank = rank
        self.decoder = w.StreamDecoder() if inbound else None
        self.pending: deque[memoryview] = deque()
        self.connecting = False
        self.events = -1
        self.backlog = 0  # bytes in pending
        self.paused = False
        self.rsize = READ_CHUNK  # bytes a read asks for (FLOOD_READ in a flood of small ones)


# the usual message's start, as a read compares it with what a step expects (TcpEndpoint._read)
_USUAL, _HEADER = w.usual_expected, w.usual_header  # (looked up once)
_EXPRESS_SIZE, _MAC_SIZE = w.EXPRESS_SIZE, w.MAC_SIZE
# What TcpEndpoint._io returns where a socket would block, and where it failed or its stream
# ended (the connection is lost then); what it is told a call is, a send or a receive
_AGAIN, _FAILED = -1, -2
_SEND, _RECV = "send", "connection"
READ_CHUNK = 256 * 1024
# A connection whose read held many messages of less than 4 KiB on average is read FLOOD_READ
# bytes at a time, until a full read holds larger ones again: a whole chunk of tiny
# messages (3,400 of them) takes 10-40 ms to decode and take, which an awaited call's read
# holds the event loop for; a small read's well within FAIR_S, after which the drain stops.
# (A flood of small messages pays one more system call per 200 of them.)
FLOOD_READ = 16 * 1024
PENDING_OVERHEAD = 128  # bytes a queued buffer costs beyond its data (object headers)
ACCEPT_BATCH = 32  # connections accepted per drain
UNIDENTIFIED_MAX = 64 * 1024  # the largest message a connection takes before it is identified
READ_BUDGET = 8 * 1024 * 1024  # per connection per drain, so one flooding peer cannot starve
# A writer waiting for room in a ring looks for it this often, should the reader have missed
# its ask (see Ring._ask: rare, a race in the instant both look)
ROOM_LOOK_S = 0.01
PUSH_LOOK_S = 0.05  # how often the pusher thread looks at what is queued (see _pusher)
SPIN_MISSES, SPIN_PROBE = 3, 32  # see TcpEndpoint._spin_for


def _frozen(parts: list[Any]) -> list[Any]:
    """``parts`` of a message to queue (sent after the call has returned): each one that may
    change once it has (an array's memory, a bytearray: not :func:`w.immutable`) copied,
    once per message however many destinations queue it; the others as they are."""
    return [p if w.immutable(p) else bytes(p) for p in parts]


class TcpEndpoint:
    """A rank's sockets in one group, over plain TCP (the default transport).

    On Linux it also listens on an abstract Unix-domain socket with a random name; a peer in
    the same network namespace of the same kernel connects there instead (a loopback TCP send
    costs the sender the whole TCP receive path; a Unix one about half the CPU). Only processes
    of this user may connect there (checked with ``SO_PEERCRED``); the framing and MAC are the
    same. When a rank uses them: :func:`use_local_sockets`; ``CTRLCOMM_LOCAL_SOCKETS=1``
    always, ``0`` never (not even listening).

    With ``shm`` (``transport="shm"``, the default) a peer of the same host, user and IPC
    namespace is sent to through a shared ring (:mod:`._shm`) handed over on that Unix
    connection, whatever the CPUs: the stream, its framing and MAC, are the same, read from
    the ring instead of the socket (one read path). A wait spins on the rings for up to
    ``spin_us`` microseconds first where each rank of the host has a CPU (see :meth:`wait`).
    """


    STREAM = True  # a StreamEndpoint: takes messages in the stream framing (send_framed)
    EXPRESS = True  # an ExpressEndpoint: its drain takes expected messages the short way
    kind = "tcp"

    def __init__(self, bind_host: str, *, on_lost: Callable[[int, str, bool], None] | None = None,
                 max_inbound: int = 256, shm: bool = False, spin_us: float | None = None
                 ) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            _dual_stack(ls, bind_host)
            ls.bind((bind_host, 0))
        except OSError as e:
            ls.close()
            raise StoreError(f"cannot bind group socket on {bind_host}: {e}") from None
        ls.listen(512)
        ls.setblocking(False)
        self.lsock = ls
        host, port = ls.getsockname()[:2]
        self.address = _tcp(host, port)
        self.ep = select.epoll()
        self.ep.register(ls.fileno(), select.EPOLLIN)
        # where peers on this host may connect instead ("unix:NAME@HOSTID"), or ""
        self.local_address = ""
        self.usock: socket.socket | None = None
        self._local_mode = "1" if shm else _local_mode()
        self.shm = shm
        if shm:
            self.kind = "shm"
        # peers sent to through a shared ring (see set_peers), and the rings read from
        self.ring_peers: set[int] = set()
        self.rings_in: list[Ring] = []
        self.rings_waiting: set[_Conn] = set()  # outbound ones waiting for room
        self.spin_max = spin_budget(spin_us)  # seconds (see wait)
        self.spin = 0.0  # this wait's budget: spin_max where the host has a CPU per rank
        self.spun = 0  # waits whose spin found nothing, in a row (the budget shrinks)
        if self._local_mode != "0" and host_id():
            made = _unix_listener()
            if made is not None:
                self.usock, name = made
                self.local_address = f"unix:{name}@{host_id()}"
                self.ep.register(self.usock.fileno(), select.EPOLLIN)
        self.local_peers: dict[int, str] = {}
        # whether the group is on this host only, with a CPU per rank (awaited waits then
        # give the loop a turn before sleeping): see set_peers
        self.spare_cpu = False
        self.bell = _Bell()
        self.ep.register(self.bell.fd, select.EPOLLIN)
        self.io, self.held_async = IoLock(), False  # see Core._abort_suspended
        # the descriptors that are not connections: the listeners, the bell, and the
        # same-host peers' processes (see watch)
        self._lfds = (ls.fileno(), self.usock.fileno() if self.usock is not None else -2,
                      self.bell.fd, -2)
        self.pids: PidWatch | None = None
        self.fd = self.ep.fileno()
        self.peers: dict[int, str] = {}
        self.conns: dict[int, _Conn] = {}  # by fd
        self.out: dict[int, _Conn] = {}  # by rank
        # the connections of self.out that are made, with nothing queued: a message to one
        # of these ranks is sent straight away (send_framed)
        self.direct: dict[int, _Conn] = {}
        self.on_lost = on_lost
        self.max_inbound = max_inbound  # inbound connections not identified yet, at most
        self.inbound = 0
        self.unknown: dict[int, _Conn] = {}  # those, by fd, oldest first
        self._hello: Callable[[int], bytes] | None = None  # see set_hello
        self.hello_len = 0
        self.dropped: dict[str, int] = {}
        self.closed = False
        self.key: bytes | None = None  # the group's MAC key, to authenticate what arrives
        self.me = -1  # this rank, for which what arrives must be MACed (set by the core)
        # where an awaited wait's reader callback hands what it reads (set by the core)
        self.sink: Callable[[w.Message | None], int | None] | None = None
        # one receive buffer, reused: recv(n) would allocate (and for large n, mmap) n bytes
        self._rbuf = bytearray(READ_CHUNK)
        self._rview = memoryview(self._rbuf)
        self._one = bytearray(1)  # (what an outbound connection's read takes: see _outbound)
        self._t0 = 0.0  # when a drain's first full chunk was read (a flood: see _read)
        self.unflushed: set[_Conn] = set()  # connections with queued data (or connecting)
        # whether a pusher thread runs (see _pusher), under its lock
        self._pushing, self._push_lock = False, threading.Lock()
        self._ready: list[tuple[int, int]] | None = None  # events seen by wait()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching self.fd
        self._waiter: asyncio.Future[None] | None = None
        # one timer for awaited waits, kept while it fires no later than a wait needs: a
        # timer per wait costs a heap push and a cancelled entry in the loop's heap each
        self._timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None  # raised by the next drain (see _on_readable)
        # the messages the call's step waits for, which a drain takes the short way (set by
        # the core while the step waits: see _read)
        self.expect: Expected | None = None
        self.turn = 0.0  # when an awaited wait last went through the event loop
        self.ended = 0.0  # when the last awaited call on this endpoint ended (run_async)
        self.yielding = 0  # awaited calls giving the loop a turn before they start (run_async)
        self._pid = os.getpid()  # (a forked child's close leaves the parent's sockets be)
        _live.add(self)
        _flush_at_mp_exit()

    def attach(self, sink: Callable[[w.Message | None], int | None],
               on_lost: Callable[[int, str, bool], None], key: bytes | None, me: int) -> None:
        """See :meth:`ctrlcomm._endpoint.Endpoint.attach`."""
        self.sink, self.on_lost, self.key, self.me = sink, on_lost, key, me

    def published(self) -> list[str]:
        """This rank's Unix socket ("unix:name@host"), where it has one, and with ``shm``
        its IPC namespace ("ipc:id": peers with another do not share memory with it)."""
        out = [self.local_address] if self.local_address else []
        if self.shm and self.local_address and ipc_id() and _shm.AVAILABLE:
            out.append(f"ipc:{ipc_id()}")
        return out

    def set_peers(self, peers: dict[int, str], fields: dict[int, list[str]] | None = None
                  ) -> None:
        """Peers' TCP endpoints, and their local addresses where they published one."""
        self.peers = dict(peers)
        self.local_peers = {}
        self.spare_cpu = False
        local = {r: x for r, f in (fields or {}).items() for x in f if x.startswith("unix:")}
        if self.usock is not None:
            for r, a in local.items():
                name, _, hid = a.removeprefix("unix:").rpartition("@")
                if a.startswith("unix:") and name and hid == host_id() \
                        and a != self.local_address:  # not this rank itself
                    self.local_peers[r] = name
            here, cpus = len(self.local_peers) + 1, _cpus()
            # (only measured with the whole group on one host: across hosts a message is
            # further away than a loop turn)
            self.spare_cpu = here == len(peers) and here <= cpus
            if self._local_mode == "auto" and not use_local_sockets(here, cpus):
                self.local_peers = {}  # this rank connects over TCP (it still accepts both)
            if self.shm and ipc_id() and _shm.AVAILABLE:
                mine = f"ipc:{ipc_id()}"
                self.ring_peers = {r for r in self.local_peers if mine in (fields or {})[r]}
                # a spin pays where every rank of this host has a CPU to spin on: else it
                # holds the CPU that the rank it waits for needs (benchmarks/README.md)
                self.spin = self.spin_max if here <= cpus else 0.0

    def watch(self, procs: dict[int, tuple[int, int]]) -> None:
        """Tell the core at once when a same-host peer's process exits (``procs``: their
        ``(pid, start time)``): a peer this rank has no connection with says nothing else."""
        if not procs or self.closed:
            return
        self.pids = PidWatch(procs)
        self.ep.register(self.pids.fd, select.EPOLLIN)
        self._lfds = (*self._lfds[:3], self.pids.fd)
        self._exits()

    def _exits(self) -> None:
        if self.pids is not None:
            self.pids.tell(self.on_lost)

    def _count(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    # ------------------------------------------------------------------ outgoing

    def _register(self, c: _Conn, events: int) -> None:
        """Set the epoll events of ``c`` (-1 in ``c.events``: not registered yet)."""
        if c.events != events:
            if c.ring is not None:
                self._register_ring(c, events)
            elif c.events == -1:
                self.ep.register(c.fd, events)
            else:
                self.ep.modify(c.fd, events)
            c.events = events

    def _register_ring(self, c: _Conn, events: int) -> None:
        """(_register.) ``events`` as they would be for a socket, on a ring's connection: its
        socket tells only its end (read while the ring is, or, outbound, always); the
        ring's eventfd its data (inbound, read) or room (outbound, asked for: EPOLLOUT)."""
        ring: Ring = c.ring  # type: ignore[assignment]
        if c.inbound:
            sock_ev = ring_ev = events & select.EPOLLIN
            if ring_ev:  # (a paused one is not spun on: the drain would not read it)
                if ring not in self.rings_in:
                    self.rings_in.append(ring)
                if ring.ready():  # (its wake-up taken meanwhile: see _ring_event)
                    os.eventfd_write(ring.data_fd, 1)
            elif ring in self.rings_in:
                self.rings_in.remove(ring)
        else:
            sock_ev = select.EPOLLIN
            ring_ev = select.EPOLLIN if events & select.EPOLLOUT else 0
            if not ring_ev:
                self.rings_waiting.discard(c)
            else:  # (the ring, full, asked its reader for room: Ring.sendmsg)
                self.rings_waiting.add(c)
        if c.events == -1:
            self.ep.register(c.fd, sock_ev)
            self.ep.register(ring.fd, ring_ev)
        else:
            self.ep.modify(c.fd, sock_ev)
            self.ep.modify(ring.fd, ring_ev)

    def _connect(self, dst: int) -> _Conn:
        s = None
        err = 0
        name = self.local_peers.get(dst)
        if name is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            # a Unix connect completes at once or not at all (EAGAIN: the listener's queue is
            # full); then TCP, which waits in the kernel, or says why the peer is unreachable
            if s.connect_ex("\0" + name) != 0:
                s.close()
                s = None
            elif dst in self.ring_peers:
                return self._connect_ring(dst, s)
        if s is None:
            family, addr = _parse_tcp(self.peers[dst])
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = s.connect_ex(addr)
        c = _Conn(s, inbound=False, rank=dst)
        self.conns[c.fd] = c
        self.out[dst] = c
        hello = self._hello(dst) if self._hello is not None else b""  # (first: see set_hello)
        if err in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            c.connecting = True
            self.unflushed.add(c)
            self._register(c, select.EPOLLOUT | select.EPOLLIN)
            if hello:
                self._queue(c, [hello], 0)
        elif err:
            self._lose(c, f"cannot connect to {self.peers[dst]}: {os.strerror(err)}")
        else:
            self._register(c, select.EPOLLIN)  # readable only at EOF: the peer is gone
            n = self._io(c, _SEND, s.send, hello) if hello else 0
            if n == _FAILED:
                return c
            if n < len(hello):
                self._queue(c, [hello], max(n, 0))
            else:
                self.direct[dst] = c
        return c

    def _connect_ring(self, dst: int, s: socket.socket) -> _Conn:
        """(_connect.) A ring for ``dst``, handed over on ``s``, a Unix connection made to it;
        the hello the ring's first bytes."""
        c = _Conn(s, inbound=False, rank=dst)
        self.conns[c.fd] = c
        self.out[dst] = c
        try:
            ring = Ring.create(ring_size(len(self.ring_peers)))
        except OSError as e:  # (out of memory or descriptors)
            self._lose(c, f"cannot make a shared ring for it: {e.strerror or e}")
            return c
        c.ring = c.io = ring
        self.conns[ring.fd] = c
        self._register(c, select.EPOLLIN)
        try:
            send_fds(s, ring)
        except OSError as e:
            self._lose(c, f"cannot hand it a shared ring: {e.strerror or e}")
            return c
        hello = self._hello(dst) if self._hello is not None else b""
        n = self._io(c, _SEND, ring.send, hello) if hello else 0
        if n >= 0 and n < len(hello):
            self._queue(c, [hello], n)
        elif n >= 0:
            self.direct[dst] = c
        return c

    def _io(self, c: _Conn, what: str, call: Callable[..., int], *args: Any) -> int:
        """``call(*args)``, a send or a receive (``what``: _SEND, _RECV) on ``c``'s socket:
        the bytes it moved, or _AGAIN where it would block. The endpoint's one boundary
        between its connections and the OS: where the call fails, or a receive finds the end
        of the stream, ``c`` is lost (:meth:`_lose`) and _FAILED comes back."""
        try:
            n = call(*args)
        except (BlockingIOError, InterruptedError):
            return _AGAIN
        except OSError as e:
            self._lose(c, f"{what} failed: {e.strerror or e}")
            return _FAILED
        if not n and what is _RECV:  # (a receive asks for at least a byte)
            self._lose(c, "connection closed")
            return _FAILED
        return n

    def push(self, budget_s: float) -> None:
        """Send what is queued now, waiting up to ``budget_s`` for connections still being
        made (an abort's word to peers this rank never sent to: with no call after it,
        nothing would send it before the process exits). What cannot go out by then stays
        queued."""
        deadline = time.monotonic() + budget_s
        while self.unflushed and not self.closed:
            for c in list(self.unflushed):
                if not c.connecting and c.sock.fileno() >= 0:
                    self._flush(c)
            waiting = [c for c in self.unflushed if c.connecting and c.sock.fileno() >= 0]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            p = select.poll()
            for c in waiting:
                p.register(c.fd, select.POLLOUT)
            try:
                ready = {fd for fd, _ in p.poll(left * 1000)}
            except OSError:
                return
            for c in waiting:
                if c.fd in ready:
                    self._connected(c)

    def _connected(self, c: _Conn) -> bool:
        """``c``, a connection being made, became writable (or failed): whether it is made;
        else it is lost."""
        err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._lose(c, f"cannot connect to {self.peers.get(c.rank or 0)}: {os.strerror(err)}")
            return False
        c.connecting = False
        return True

    def set_hello(self, hello: Callable[[int], bytes]) -> None:
        """``hello(dst)``: what this rank sends first on each connection it makes (framed),
        to say who sends on it (the core's HELLO). A connection accepted here takes messages
        of at most UNIDENTIFIED_MAX bytes, read a hello's length at a time, until its first
        good message says who sends on it (a peer's HELLO does, alone in its read): bytes
        from anyone without the key are never buffered toward a large message."""
        self._hello = hello
        self.hello_len = len(hello(0))

    def send(self, dst: int, frames: Sequence[Any]) -> None:
        """Queue a message for ``dst``; never waits for the peer."""
        self.send_many((dst,), frames)

    def send_last(self, dst: int, frames: Sequence[Any]) -> None:
        """A goodbye goes like any message: a connection's queue has no bound to be past."""
        self.send(dst, frames)

    def send_framed(self, dsts: Sequence[int], data: list[bytes]) -> None:
        """Queue ``data[i]``, a message in the stream framing already
        (:func:`w.stream_messages`), for ``dsts[i]``."""
        if len(dsts) == 1:
            self._send_to(dsts, data, len(data[0]))
            return
        for d, one in zip(dsts, data, strict=True):
            self._send_to((d,), [one], len(one))

    def send_many(self, dsts: Sequence[int], frames: Sequence[Any]) -> None:
        """Queue one message for each of ``dsts`` (framed once)."""
        lens = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        prefix = w.stream_prefix_lens(lens)
        total = sum(lens) + len(prefix)
        # a small message goes as one buffer (cheaper to send and, queued, to keep)
        parts = [prefix, *frames] if total >= COPY_THRESHOLD else [b"".join([prefix, *frames])]
        self._send_to(dsts, parts, total)

    def _send_to(self, dsts: Sequence[int], parts: list[Any], total: int) -> None:
        """Send one message, ``parts`` of ``total`` bytes, to each of ``dsts``: what the
        kernel takes at once, the rest queued. (The loop is here, not around a call per
        destination: a root's fan-out has one per rank.) A connected socket with nothing
        queued (:attr:`direct`, the usual) is sent on without looking at its state."""
        out, direct, io = self.out, self.direct, self._io
        one = parts[0] if len(parts) == 1 else None
        kept: list[Any] | None = None  # parts as queued: see _frozen (made once, if needed)
        for dst in dsts:
            c = direct.get(dst)
            if c is None:
                c = out.get(dst)
                if c is None:
                    c = self._connect(dst)
                if c.sock.fileno() < 0:  # lost: the core already knows
                    continue
                if c.pending or c.connecting:
                    kept = kept or _frozen(parts)
                    self._queue(c, kept, 0)  # (it asks epoll to say when it takes more)
                    continue
            n = io(c, _SEND, c.io.send, one) if one is not None \
                else io(c, _SEND, c.io.sendmsg, parts)
            if n == _FAILED:
                continue
            if n < total:
                kept = kept or _frozen(parts)
                self._queue(c, kept, max(n, 0))

    def _queue(self, c: _Conn, parts: list[Any], skip: int) -> None:
        """Queue ``parts`` (:func:`_frozen`: nothing in them can change) but their first
        ``skip`` bytes (already sent) for ``c``."""
        views = []
        for p in parts:
            v = memoryview(p).cast("B")
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            views.append(v[skip:])  # never empty: skip < v.nbytes here
            skip = 0
        size = sum(v.nbytes for v in views)
        if size < COPY_THRESHOLD and len(views) > 1:
            views = [memoryview(b"".join(views))]  # one object per small message, not three
        c.pending.extend(views)
        c.backlog += size + PENDING_OVERHEAD * len(views)
        self.unflushed.add(c)
        if not self._pushing:
            self._start_pusher()
        self.direct.pop(c.rank, None)  # type: ignore[arg-type]  # (outbound: a rank)
        self._register(c, select.EPOLLOUT | select.EPOLLIN)

    def _start_pusher(self) -> None:
        """Start the thread that sends what stays queued once the calls have returned (see
        :meth:`_pusher`), unless it runs."""
        with self._push_lock:
            if self._pushing or self.closed or os.getpid() != self._pid:
                return
            self._pushing = True
        threading.Thread(target=self._pusher, daemon=True, name="ctrlcomm-push").start()

    def _pusher(self) -> None:
        """Send what is queued as the peers take it, while anything is: a send returns with
        up to MAX_BACKLOG (the core's) still queued, and a rank that makes no call after it
        (a broadcast's root that sleeps, say) would otherwise hold it back until its next
        call. It sleeps until a socket (or ring) takes more, or PUSH_LOOK_S; then sends,
        holding ``io`` (a call that runs meanwhile sends it itself, in its waits)."""
        while True:
            with self._push_lock:
                if self.closed or not self.unflushed:
                    self._pushing = False
                    return
                try:
                    conns = list(self.unflushed)
                except RuntimeError:  # (changed meanwhile: looked at again below)
                    conns = []
            p = select.poll()
            for c in conns:
                fd = c.ring.room_fd if c.ring is not None else c.sock.fileno()
                if fd >= 0:
                    p.register(fd, select.POLLIN if c.ring is not None else select.POLLOUT)
            try:
                ready = {fd for fd, _ in p.poll(PUSH_LOOK_S * 1000)}
            except OSError:  # (a descriptor closed meanwhile)
                ready = set()
            if self.io.acquire(timeout=PUSH_LOOK_S):
                try:
                    if not self.closed:
                        self._pushed(conns, ready)
                finally:
                    self.io.release()

    def _pushed(self, conns: list[_Conn], ready: set[int]) -> None:
        """(_pusher, holding ``io``.) Send what ``conns`` have queued, those of ``ready``
        descriptors first taken note of: a ring's room told (else its eventfd would keep
        the pusher's poll ready), a connection made."""
        for c in conns:
            if c.ring is not None:
                if c.ring.room_fd in ready:
                    c.ring.clear()
            elif c.connecting and c.sock.fileno() in ready:
                self._connected(c)
        self.push(0.0)

    def _flush(self, c: _Conn) -> None:
        while c.pending:
            batch = [c.pending[i] for i in range(min(len(c.pending), 512))]
            n = self._io(c, _SEND, c.io.sendmsg, batch)
            if n < 0:  # (it would block: the rest later; or it failed: lost)
                return
            c.backlog -= n
            while n and c.pending:
                v = c.pending[0]
                if n >= v.nbytes:
                    n -= v.nbytes
                    c.pending.popleft()
                    c.backlog -= PENDING_OVERHEAD
                else:
                    c.pending[0] = v[n:]
                    n = 0
        self.unflushed.discard(c)
        self._register(c, select.EPOLLIN)
        if not c.connecting and c.rank is not None:
            self.direct[c.rank] = c

    def backlog(self, dst: int) -> int:
        """Bytes queued for ``dst`` that the kernel has not taken yet."""
        c = self.out.get(dst)
        return c.backlog if c is not None and c.sock.fileno() >= 0 else 0

    def pause(self, src: int) -> None:
        """Stop reading what ``src`` sends (the kernel's buffers, then ``src``, fill up)."""
        for c in self.conns.values():
            if c.inbound and c.rank == src and not c.paused:
                c.paused = True
                self._register(c, 0)

    def settle(self, sink: Callable[[w.Message | None], int | None]) -> None:
        """After a drain, read what the sockets hold now, to its end (a flood:
        SETTLE_ROUNDS drains at most): a connection accepted in one drain is read in the
        next, so before a peer is declared lost, what it sent before it went is taken
        (Core.settle, which drains first)."""
        for _ in range(SETTLE_ROUNDS):
            ready = self.ep.poll(0)
            if not ready or self.closed:
                return
            self._ready = ready
            self.drain(sink)

    def resume(self, src: int) -> None:
        for c in self.conns.values():
            if c.inbound and c.rank == src and c.paused:
                c.paused = False
                self._register(c, select.EPOLLIN)

    def _lose(self, c: _Conn, why: str) -> None:
        if self.closed:
            return
        self._drop_conn(c)
        if c.rank is not None and self.on_lost is not None:
            # End of the stream a peer sends on is certain: nothing more can come from it.
            # End of the stream we send on only makes it a suspect: it may have closed while
            # its own last messages to us are still on their way.
            self.on_lost(c.rank, why, c.inbound)

    def _drop_conn(self, c: _Conn) -> None:
        self.conns.pop(c.fd, None)
        if not c.inbound and self.direct.get(c.rank) is c:  # type: ignore[arg-type]
            del self.direct[c.rank]  # type: ignore[arg-type]
        self.unflushed.discard(c)
        if c.events != -1:
            try:
                self.ep.unregister(c.fd)
            except (OSError, ValueError):
                pass
        if c.inbound:
            self.inbound -= 1
            if self.unknown.get(c.fd) is c:
                del self.unknown[c.fd]
        ring = c.ring
        if ring is not None:
            self.conns.pop(ring.fd, None)
            if c.events != -1:
                try:
                    self.ep.unregister(ring.fd)
                except (OSError, ValueError):
                    pass
            if ring in self.rings_in:
                self.rings_in.remove(ring)
            self.rings_waiting.discard(c)
            ring.close()
        c.sock.close()
        c.pending.clear()

    # ------------------------------------------------------------------ incoming

    def _accept(self, ls: socket.socket) -> None:
        # a few at a time (the listener stays ready): what the connections accepted send is
        # read, and identifies a peer's, before a burst of others can take their places
        for _ in range(ACCEPT_BATCH):
            try:
                s, _ = ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if ls is self.usock and not _same_user(s):
                self._count("foreign_user")
                s.close()
                continue
            if len(self.unknown) >= self.max_inbound:
                # the oldest connection that has not said who it is goes: a peer's says so
                # in its first message, at once; idle ones (anyone can open them, without
                # the key) must not keep the peers out
                self._count("connection_limit")
                self._drop_conn(next(iter(self.unknown.values())))
            s.setblocking(False)
            c = _Conn(s, inbound=True, rank=None)
            c.decoder.max_message = UNIDENTIFIED_MAX  # type: ignore[union-attr]  # (see set_hello)
            c.fresh = ls is self.usock and self.shm  # (a ring may come with its first byte)
            self.conns[c.fd] = c
            self.unknown[c.fd] = c
            self.inbound += 1
            self._register(c, select.EPOLLIN)

    def _first(self, c: _Conn, sink: Callable[[w.Message | None], int | None]) -> bool:
        """One read of ``c``, a connection not identified yet (see set_hello): of what is
        left of a hello, else of a small piece. Whether it is identified now (then it takes
        messages of any size, and the caller reads on)."""
        dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
        if c.fresh and not self._handover(c, sink):
            return False
        want = self.hello_len - dec.pending()
        got = self._io(c, _RECV, c.io.recv_into, self._rbuf, want if want > 0 else 4096)
        if got < 0:
            return False
        if self._take(c, self._rbuf, got, sink) < 0 or c.rank is None:
            return False
        dec.max_message = w.MAX_MESSAGE
        return True

    def _handover(self, c: _Conn, sink: Callable[[w.Message | None], int | None]) -> bool:
        """(_first.) The first read of a connection accepted on the Unix socket: a peer's
        shared ring (its descriptors, with HANDOVER), from which the stream is read from now
        on; else the stream's first byte. Whether to read on."""
        try:
            data, fds = recv_fds(c.sock)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self._lose(c, f"connection failed: {e.strerror or e}")
            return False
        c.fresh = False
        if not data:
            self._lose(c, "connection closed")
            return False
        if not fds:  # a peer that streams on the socket (transport="tcp")
            return self._take(c, data, len(data), sink) >= 0
        ring = None
        if data == HANDOVER and len(fds) == 3:
            try:
                ring = Ring(fds[0], fds[1], fds[2], writer=False)
            except (OSError, ValueError):  # (not a ring's memory file)
                ring = None
        if ring is None:
            for fd in fds:
                os.close(fd)
            self._count("bad_handover")
            self._drop_conn(c)
            return False
        events, c.events = c.events, -1
        self.ep.unregister(c.fd)  # (registered again with its ring's eventfd)
        c.ring = c.io = ring
        self.conns[ring.fd] = c
        self._register(c, events)
        return True

    def _identify(self, c: _Conn, msgs: list[w.Message | None],
                  sink: Callable[[w.Message | None], int | None]) -> bool:
        """Hand the messages of a new connection to ``sink``; its first good one says which
        peer sends on it. False if the connection was dropped: each peer sends on one
        connection, and a second one claiming a rank connected already is a replay or an
        impostor (whose end must not mean a loss): nothing it sends is taken."""
        for m in msgs:
            if c.rank is not None:  # identified by a message before it in this read
                self._deliver(c.rank, [m], sink)
                continue
            if m is not None and any(o.inbound and o.rank == m.src
                                     for o in self.conns.values()):
                self._count("duplicate_source")
                self._drop_conn(c)
                return False
            src = sink(m)
            if src is not None:
                c.rank = src
                self.unknown.pop(c.fd, None)
        return True

    def _deliver(self, rank: int, msgs: list[w.Message | None],
                 sink: Callable[[w.Message | None], int | None]) -> None:
        """Hand ``msgs``, read on the connection of peer ``rank``, to ``sink``; one whose
        header names another sender is dropped (counted): a peer sends as itself only, as
        a read taken the short way (_expected) is by its header."""
        for m in msgs:
            if m is not None and m.src != rank:
                self._count("wrong_sender")
                continue
            sink(m)

    def drain(self, sink: Callable[[w.Message | None], int | None]) -> bool:
        """Handle every ready socket now; hand each whole message to ``sink``, decoded
        (``None`` for a malformed or unauthenticated one), but the ones :attr:`expect` names,
        which a read that begins with one takes the short way (:meth:`_read`). Whether
        anything else was read or happened (a message for the sink, a connection accepted or
        lost, a wake-up)."""
        if self._error is not None:  # met by an awaited wait's reader callback
            e, self._error = self._error, None
            raise e
        lfds = self._lfds
        ready, self._ready = self._ready, None
        x = self.expect
        self._t0 = 0.0
        other = exited = False
        for fd, ev in ready if ready is not None else self.ep.poll(0):
            if fd in lfds:
                other = True
                if fd == lfds[2]:
                    self.bell.clear()  # a wake-up (see wake): nothing to read
                elif fd == lfds[3]:
                    exited = True  # (told after what its sockets hold is read)
                else:
                    self._accept(self.lsock if fd == lfds[0] else self.usock)  # type: ignore[arg-type]
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            if c.ring is not None:
                if self._ring_event(c, fd, sink, x):
                    other = True
                continue
            if c.rank is not None and c.inbound:
                if self._read(c, sink, x):
                    other = True
                continue
            other = True
            if not c.inbound:
                self._outbound(c, fd, ev)
            elif self._first(c, sink):  # (else: not identified yet, or dropped)
                self._read(c, sink, x)
        if exited:
            self._exits()
        return other

    def _ring_event(self, c: _Conn, fd: int, sink: Callable[[w.Message | None], int | None],
                    x: Expected | None) -> bool:
        """(drain.) An event on a ring's connection: its eventfd (data in, or room out), or
        its socket, which only ends (what the peer wrote before is read first). As
        :meth:`_read` says."""
        ring: Ring = c.ring  # type: ignore[assignment]
        if fd == c.fd:
            if c.inbound and c.rank is not None:
                while ring.memfd >= 0 and not c.paused and ring.ready():
                    self._read(c, sink, None)
                if c.paused:  # (by what it read: its end is seen again as it resumes)
                    return True
            if c.fd in self.conns and self._io(c, _RECV, c.sock.recv_into, self._one, 1) > 0:
                self._lose(c, "a byte came on a shared ring's socket")
            return True
        ring.clear()  # (before reading: bytes written after it wake the next wait)
        if not c.inbound:
            if c.pending:
                self._flush(c)
            return True
        if c.rank is not None:
            other = self._read(c, sink, x)
        else:
            other = True
            if self._first(c, sink):
                self._read(c, sink, x)
        if ring.memfd >= 0 and not c.paused and ring.ready():
            os.eventfd_write(ring.data_fd, 1)  # a read cut short (a flood): the rest next time
        return other

    def _read(self, c: _Conn, sink: Callable[[w.Message | None], int | None],
              x: Expected | None) -> bool:
        """Read what inbound ``c`` holds, up to READ_BUDGET, into ``sink``. Where ``x``, the
        step a call waits for, expects a message of ``c``'s sender, and the read begins with
        it (the decoder holding nothing of an earlier one), that message is taken the short
        way (:meth:`_expected`). Whether anything else was read, or ``c`` was lost."""
        view, buf = self._rview, self._rbuf
        data: bytes | bytearray
        dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
        recv_into = c.io.recv_into
        rsize = c.rsize
        if x is not None and (c.rank not in x.left or dec.buf or dec._lens is not None
                              or c.paused):
            x = None
        budget = 0
        other = False
        while budget < READ_BUDGET:
            got = self._io(c, _RECV, recv_into, view, rsize)
            if got < 0:
                return other or got == _FAILED
            budget += got
            data, size = buf, got  # (what the decoder takes)
            if x is not None:
                end = self._expected(x, c.rank, got)  # type: ignore[arg-type]  # (identified)
                x = None
                if end == got:
                    if got < rsize:
                        return other
                    continue  # (a full read of exactly that message: more may wait)
                if end:  # more came behind it (a peer a call ahead, say)
                    size = got - end
                    data = bytes(view[end:got])
            other = True
            n = self._take(c, data, size, sink)
            if n < 0:
                break
            full = got == rsize
            # the next read's size: small after a read of many messages of less than 4 KiB
            # on average, the usual after a full one of larger ones (one threshold both
            # ways: no swing between the two sizes)
            if n > 64 and n > got >> 12:
                rsize = c.rsize = FLOOD_READ
            elif full and n <= got >> 12:
                rsize = c.rsize = READ_CHUNK
            if not full or c.paused:
                break
            # a flood (full chunks back to back): after FAIR_S of it the rest waits for the
            # next drain (the socket stays ready: nothing is lost), so an awaited call that
            # reads it gives the event loop its turn
            if not self._t0:
                self._t0 = time.monotonic()
            elif time.monotonic() - self._t0 >= FAIR_S:
                break
        return other

    def _take(self, c: _Conn, data: bytes | bytearray, size: int,
              sink: Callable[[w.Message | None], int | None]) -> int:
        """(_read, _first.) Hand the messages of ``data[:size]``, read from inbound ``c``, to
        ``sink`` through its decoder; how many were whole, or -1 where ``c`` was dropped
        (a malformed stream, or a connection that claims a peer's rank: _identify)."""
        dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
        try:
            msgs = dec.messages(data, size, self.key, self.me)
        except WireError:
            self._count("malformed_stream")
            self._drop_conn(c)
            return -1
        if c.rank is not None:
            self._deliver(c.rank, msgs, sink)
        elif not self._identify(c, msgs, sink):
            return -1
        if dec.error is not None:
            self._count("malformed_stream")
            self._drop_conn(c)
            return -1
        return len(msgs)

    def _expected(self, x: Expected, s: int, got: int) -> int:
        """(_read.) Whether the ``got`` bytes just read from sender ``s`` begin with the
        message ``x`` expects of it (pickled, no flags, no buffers): then its payload, copied,
        goes to ``x.raw[s]`` and ``s`` leaves ``x.left``. Where it ends in the receive
        buffer; 0 where the read does not begin so (the decoder takes it all then)."""
        buf = self._rbuf
        end = _USUAL(buf, got, _HEADER(x.kind, x.op, s, x.group_id, x.seq, x.round, x.root),
                     self.key, self.me)  # type: ignore[arg-type]  # (set by the core)
        if end:
            x.raw[s] = buf[_EXPRESS_SIZE:end - _MAC_SIZE]  # (a copy: buf is read into again)
            del x.left[s]
        return end

    def _outbound(self, c: _Conn, fd: int, ev: int) -> None:
        """An event on a connection this rank sends on: connected, room to send, or its
        end (a peer sends nothing back on it: a byte read is its end or an error)."""
        if c.connecting and ev & (select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP) \
                and not self._connected(c):
            return
        if ev & select.EPOLLOUT:
            self._flush(c)
        elif not c.pending:
            self.unflushed.discard(c)
        if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and fd in self.conns:
            self._io(c, _RECV, c.sock.recv_into, self._one, 1)  # (its end: lost there)

    def take_error(self) -> Exception | None:
        """The error the next drain would raise (met by an awaited wait's reader callback),
        taken."""
        e, self._error = self._error, None
        return e

    def wait(self, timeout: float) -> None:
        """Sleep until a socket is ready, :meth:`wake` is called or ``timeout`` seconds pass;
        where rings are read from, spin on them first (:meth:`_spin_for`)."""
        budget = self._spin_for()
        if budget:
            end = time.perf_counter() + min(budget, max(timeout, 0.0))
            rings = self.rings_in
            while True:
                for r in rings:
                    if r.ready():
                        self.spun = 0
                        return  # (the drain asks epoll, which finds the ring's eventfd)
                if time.perf_counter() >= end:
                    break
                os.sched_yield()  # (releases the GIL: another thread of this process runs)
            self.spun += 1
        if self.rings_waiting:
            timeout = min(timeout, ROOM_LOOK_S)
        # the next drain handles these events instead of asking epoll again
        self._ready = self.ep.poll(min(max(timeout, 0.0), MAX_POLL_S)) or None
        if self._ready is None and self.rings_waiting:
            self._look_for_room()

    def _spin_for(self) -> float:
        """How long this wait spins on the rings it reads from before it sleeps: the budget
        (``spin_us``; none where this host's ranks outnumber the CPUs) while spins find what
        comes; after SPIN_MISSES in a row that found nothing (a peer that comes late: the
        spin only burns a CPU) only every SPIN_PROBE-th wait, to see whether they come
        sooner again."""
        if not self.spin or not self.rings_in:
            return 0.0
        if self.spun < SPIN_MISSES or not self.spun % SPIN_PROBE:
            return self.spin
        self.spun += 1
        return 0.0

    def _look_for_room(self) -> None:
        """(wait.) Wake the next drain for a ring that has room while its writer waits for
        it: the reader did not see the ask (see Ring._ask)."""
        for c in list(self.rings_waiting):
            ring = c.ring
            if ring is not None and ring.memfd >= 0 and ring.has_room():
                os.eventfd_write(ring.room_fd, 1)
                self._ready = None

    def wake(self) -> None:
        """End a wait in progress, blocking or awaited (from any thread)."""
        self.bell.ring()

    async def wait_async(self, timeout: float) -> None:
        """Like :meth:`wait`, through the running event loop (other coroutines keep running).

        The epoll descriptor stays registered with the loop between waits (registering and
        unregistering it costs two system calls per wait); its reader callback reads the
        ready sockets and wakes the waiting call, or, when no call waits, unregisters it (it
        would fire again and again while the data waits unread). The timeout is one timer
        kept across waits while it fires no later than a wait needs."""
        ready = self.ep.poll(0)
        if ready:
            # no need to go through the event loop (two of its iterations); but when the
            # loop has not had a turn for FAIR_S, it gets one, so other tasks (and a
            # cancellation) are not held up by a stream that keeps the socket ready
            self._ready = ready
            if turn_due(self):
                await _unheld(self, asyncio.sleep(0))
            return
        budget = self._spin_for()
        if budget:
            # spinning, awaited: turns of the event loop until the budget ends, a ring has
            # something to read, or the call was closed meanwhile
            end, rings = time.perf_counter() + min(budget, max(timeout, 0.0)), self.rings_in
            while time.perf_counter() < end:
                await _unheld(self, asyncio.sleep(0))
                if self.closed:
                    return
                if any(r.ready() for r in rings):
                    self.spun = 0
                    self.turn = time.monotonic()
                    return
            self.spun += 1
        elif self.spare_cpu:
            # the ranks of this host have a CPU each: what is waited for is likely a few
            # microseconds away, and sleeping costs more (an epoll wake-up: tens of them).
            # The loop gets one turn first, then one more look before sleeping. (Where ranks
            # share CPUs the turn is only overhead.)
            await _unheld(self, asyncio.sleep(0))
            if self.closed:  # by another task meanwhile: the call finds out
                return
            ready = self.ep.poll(0)
            if ready:
                self._ready = ready
                self.turn = time.monotonic()
                return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._unwatch()
            loop.add_reader(self.fd, self._on_readable, loop)
            self._loop = loop
        fut = self._waiter = loop.create_future()
        if self.rings_waiting:
            self._look_for_room()
            timeout = min(timeout, ROOM_LOOK_S)
        at = loop.time() + max(timeout, 0.0)
        timer = self._timer
        if timer is None or timer.when() > at:
            if timer is not None:
                timer.cancel()
            # (one that fires sooner than this wait needs wakes it early: the call looks at
            # the time and waits again)
            self._timer = loop.call_at(at, self._on_timer, loop)
        _let_go(self)  # (as _unheld does, without a coroutine: the wait of every call that sleeps)
        try:
            await fut
        finally:
            self._waiter = None
            self.turn = time.monotonic()
            _take_back(self)

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop saw this endpoint's epoll descriptor readable. With a call waiting,
        read the ready sockets here, then wake it.

        Reading here, not in the woken task, matters: the loop looks at its descriptors once
        more before the task runs, and a socket still unread then would queue this callback
        again, to run after the task had started its next wait, waking it for nothing (one
        wasted round of the loop per call on a star's non-root ranks)."""
        if loop is not self._loop:  # a loop this endpoint has moved away from
            return
        fut = self._waiter
        if fut is None:
            # (Staying registered when the report is stale, the sockets read since, was
            # measured: world-2 awaited calls 4x slower, 22-26 us -> 107-114 us.)
            self._unwatch()
            return
        if fut.done():
            return
        with self.io:  # (a watchdog's abort may be sending: see Core._abort_suspended)
            # looked at again, held: a call of another loop sets them holding it (this
            # loop's, left, would read for that call, and wake it from the wrong thread)
            if loop is self._loop and fut is self._waiter:
                self._read_for(fut)

    def _read_for(self, fut: asyncio.Future[None]) -> None:
        """(_on_readable's reading, holding ``io``.)"""
        if not self.closed and self.sink is not None:
            ready = self.ep.poll(0)
            if not ready:  # read already (by the woken call): keep waiting
                return
            self._ready = ready
            try:
                other = self.drain(self.sink)
            except Exception as e:  # not expected; the woken call's next drain raises it
                self._error = e
            else:
                x = self.expect
                if not other and x is not None and x.left:
                    # only messages of the step read, the short way, and more to come:
                    # the call sleeps on (waking it would cost two rounds of the loop)
                    return
                self._ready = []  # read: the woken call need not ask epoll again
            if fut.done():  # closed from another thread meanwhile
                return
        fut.set_result(None)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:  # a timer of a loop this endpoint has moved away from
            return
        self._timer = None
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _unwatch(self, closing: bool = False) -> bool:
        """Stop watching the epoll descriptor in the event loop. ``closing``: it is to be
        closed; returns True when the loop, running in another thread, closes it itself
        once it has stopped watching it (closed here first, its number could be another
        descriptor's by then, which the loop's late remove_reader would unwatch, or whose
        add_reader would find the old entry and never watch it)."""
        loop, self._loop = self._loop, None
        timer, self._timer = self._timer, None
        if loop is None or loop.is_closed():
            return False
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if loop.is_running() and loop is not running:  # it runs in another thread
                if closing:
                    loop.call_soon_threadsafe(self._unwatch_and_close, loop)
                else:
                    loop.call_soon_threadsafe(self._unwatch_late, loop)
                if timer is not None:
                    loop.call_soon_threadsafe(timer.cancel)
                return closing
            else:
                loop.remove_reader(self.fd)
                if timer is not None:
                    timer.cancel()
        except (RuntimeError, ValueError, OSError):  # the loop is closing
            pass
        return False

    def _unwatch_late(self, loop: asyncio.AbstractEventLoop) -> None:
        """(In the loop's thread: see _unwatch.) Unless the endpoint has come back to this
        loop meanwhile: an awaited call of it, run before this (the loop blocked while
        another loop's call waited: a sync-over-async bridge), registered the descriptor
        again, and removing that took it away for good (each wait of the loop then ended
        only at a timer: seconds late, or at its deadline)."""
        if self._loop is loop:
            return
        try:
            loop.remove_reader(self.fd)
        except (RuntimeError, ValueError, OSError):
            pass

    def _unwatch_and_close(self, loop: asyncio.AbstractEventLoop) -> None:
        """(In the loop's thread: see _unwatch.)"""
        try:
            loop.remove_reader(self.fd)
        except (RuntimeError, ValueError, OSError):
            pass
        self.ep.close()

    def _close_in_child(self) -> None:
        """(close, in a forked child.) The sockets are the parent's, whose streams go on;
        only this process's descriptors go (no flush: what the parent queued is the
        parent's)."""
        for c in (*self.conns.values(), *self.out.values()):
            _close_conn(c)
        for s in (self.lsock, self.usock):
            if s is not None:
                s.close()
        self.ep.close()
        self.bell.close()
        if self.pids is not None:
            self.pids.close()

    def close(self, gone: Collection[int] = ()) -> None:
        """Close every socket; unsent data goes on in a short-lived thread (like a linger).
        (``gone``: as ZmqEndpoint.close's; here a connection to a gone peer fails at once.)"""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._pid:
            self._close_in_child()
            return
        fut = self._waiter
        if fut is not None and not fut.done():
            # a call waiting in another task (or in this thread's loop, under a signal
            # handler) looks again: woken through its loop's own wake-up, which a plain
            # set_result is not (the loop slept on in its selector until its next timer)
            try:
                fut.get_loop().call_soon_threadsafe(wake_future, fut)
            except RuntimeError:  # its loop is closed (the task will never run again)
                pass
        handed = self._unwatch(closing=True)  # (the loop's thread closes the epoll then)
        for c in self.out.values():
            if c.pending and not c.connecting and c.sock.fileno() >= 0:
                self._flush(c)
        left = [c for c in self.out.values() if c.pending and c.sock.fileno() >= 0]
        for c in set(self.conns.values()):  # (once each: a ring's is there twice)
            if c not in left:
                self._drop_conn(c)
        self.direct.clear()
        self.lsock.close()
        if self.usock is not None:
            self.usock.close()
        if not handed:
            self.ep.close()
        self.bell.close()
        if self.pids is not None:
            self.pids.close()
        if left:
            # not a daemon: a process that exits right after close() still delivers its last
            # messages (for at most LINGER_MS), as ZeroMQ's context termination does
            threading.Thread(target=_linger, args=(left,), daemon=False,
                             name="ctrlcomm-linger").start()


def _unix_listener() -> tuple[socket.socket, str] | None:
    """A listening abstract Unix socket with a random name, or None where there can be none
    (a sandbox without Unix sockets, say: then TCP only)."""
    name = "ctrlcomm-" + os.urandom(12).hex()
    try:
        us = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        us.bind("\0" + name)
        us.listen(512)
        us.setblocking(False)
    except OSError:
        us.close()
        return None
    return us, name


_PEERCRED = struct.Struct("iII")  # pid, uid, gid


def _same_user(s: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this user (or root)."""
    try:
        _, uid, _ = _PEERCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _PEERCRED.size))
    except OSError:
        return False
    return uid in (os.getuid(), 0)


_live: weakref.WeakSet[TcpEndpoint] = weakref.WeakSet()


# What runs at exit before the flush, given the seconds it may take (the group module's:
# wait for the groups collected unclosed to be closed)
BEFORE_EXIT_FLUSH: list[Callable[[float], None]] = []


@atexit.register
def _flush_at_exit() -> None:
    """Deliver what open endpoints still have queued when the process exits (at most
    LINGER_MS in all), as ZeroMQ does when its context is terminated at exit; and wait, in
    that time, for the lingering of groups closed just before (their threads: an exit
    past the point where it waits for threads, as atexit is, would not)."""
    end = time.monotonic() + LINGER_MS / 1000
    for hook in BEFORE_EXIT_FLUSH:
        hook(max(end - time.monotonic(), 0.0))
    conns = [c for ep in list(_live) if not ep.closed and ep._pid == os.getpid()
             for c in ep.out.values() if c.pending and c.sock.fileno() >= 0]
    if conns:
        _linger(conns, close=False)
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and t.name in ("ctrlcomm-linger", "ctrlcomm-zmq-linger"):
            t.join(max(end - time.monotonic(), 0.0))


_mp_flush_pid = 0  # the process whose multiprocessing exit flushes (see below)


def _flush_at_mp_exit() -> None:
    """In a process multiprocessing started, :func:`_flush_at_exit` at its exit too: such a
    process leaves through ``os._exit`` (its ``atexit`` functions do not run), after its
    own finalizers (``multiprocessing.util.Finalize``, registered here once per process: a
    forked child's registry starts empty). Without it a rank that returned with its group
    unclosed would lose what was still queued for its peers (they would see it "gone")."""
    global _mp_flush_pid
    if _mp_flush_pid == os.getpid():
        return
    _mp_flush_pid = os.getpid()
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # (not imported: a plain process, whose atexit flushes)
        mp_util.Finalize(None, _flush_at_exit, exitpriority=10)


def _linger(conns: list[_Conn], close: bool = True) -> None:
    deadline = time.monotonic() + LINGER_MS / 1000
    for c in conns:
        try:
            if c.ring is not None:
                _linger_ring(c, c.ring, deadline)
                continue
            c.sock.setblocking(True)
            while c.pending and time.monotonic() < deadline:
                c.sock.settimeout(max(deadline - time.monotonic(), 0.01))
                v = c.pending.popleft()
                n = c.sock.send(v)
                if n < v.nbytes:
                    c.pending.appendleft(v[n:])
        except OSError:
            pass
        finally:
            if close:
                _close_conn(c)


def _close_conn(c: _Conn) -> None:
    """Close ``c``'s socket, and its ring."""
    c.sock.close()
    if c.ring is not None:
        c.ring.close()  # (closed once however often asked: a ring is in two places)


def _linger_ring(c: _Conn, ring: Ring, deadline: float) -> None:
    """(_linger.) Write what ``c`` has queued into its ring as the reader makes room, until
    ``deadline`` or the reader's end (its socket's)."""
    p = select.poll()
    p.register(ring.room_fd, select.POLLIN)
    p.register(c.sock.fileno(), select.POLLIN)
    while c.pending:
        v = c.pending[0]
        try:
            n = ring.send(v)
        except BlockingIOError:
            n = 0
        if n >= v.nbytes:
            c.pending.popleft()
            continue
        if n:
            c.pending[0] = v[n:]
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ in p.poll(min(left, ROOM_LOOK_S) * 1000):  # (a lost ask: Ring._ask)
            if fd == c.sock.fileno():
                return  # the reader is gone
        ring.clear()
