"""The only module that touches sockets (ZeroMQ and the OS).

- :class:`TcpEndpoint` (the default data plane): a listening TCP socket bound on one interface,
  one outgoing connection per peer it sends to (made on first use), all registered in one
  epoll set whose descriptor both drivers wait on. Sends are non-blocking (a small message is
  framed into one buffer, once for all its destinations); what the kernel does not take at
  once is queued and flushed whenever the rank waits, so a
  send never waits for the peer. A connection that reaches end-of-file or fails tells the core
  at once that its peer is gone. Why not ZeroMQ here: each ZeroMQ message crosses two extra
  threads (the I/O threads of sender and receiver); on a 2-core machine that measured 149 us
  per round trip against 22 us for a plain socket, and it hides a dead peer behind silent
  reconnection.
- :class:`ZmqEndpoint` (``transport="zmq"``): a PULL socket bound on one interface plus one
  PUSH socket per peer. ZeroMQ queues sends in its I/O thread; per pair of ranks, messages
  arrive in the order sent.
- :class:`StoreConnection`: a DEALER socket for store requests, with request ids so a late
  reply to a timed-out request is recognised and dropped.
- :class:`StoreServer`: runs a :class:`ctrlcomm._store.StoreState` on a ROUTER socket in a
  daemon thread.

Waiting: the blocking driver calls :meth:`Endpoint.wait` (``zmq_poll``: the thread sleeps in the
kernel); the asyncio driver awaits :meth:`Endpoint.wait_async`, a reader callback on the socket's
file descriptor. ZeroMQ's descriptor is edge-triggered: callers must drain the socket (receive
until ``EAGAIN``) before waiting again, which :meth:`Endpoint.drain` does.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import zmq
import zmq.utils.z85

from . import _wire as w
from ._errors import CtrlcommError, StoreError, StoreTimeoutError, WireError

log = logging.getLogger("ctrlcomm")

_ctx: zmq.Context[Any] | None = None
_ctx_pid = -1
_ctx_lock = threading.Lock()

# Outgoing messages may wait this long for delivery after close (in ZeroMQ's I/O thread; the
# caller never blocks), so a group's last messages reach peers even if it closes at once.
LINGER_MS = 5000
HWM = 100_000
COPY_THRESHOLD = 65536
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


def context() -> zmq.Context[Any]:
    """The process's ZeroMQ context (one I/O thread), made anew after a fork."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx_pid != os.getpid():
            _ctx = zmq.Context(io_threads=1)
            _ctx.setsockopt(zmq.MAX_SOCKETS, 65536) if hasattr(zmq, "MAX_SOCKETS") else None
            _ctx_pid = os.getpid()
        return _ctx


def _numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# The names being looked up, each with its lookup's (event, answer): a caller that finds its
# name here waits for that lookup instead of starting another, so a resolver that hangs holds
# one thread per name, not one per try. (Forgotten in a forked child: the threads are not.)
_lookups: dict[str, tuple[threading.Event, list[Any]]] = {}
_lookups_lock = threading.Lock()


def _forget_lookups() -> None:
    global _lookups, _lookups_lock
    _lookups, _lookups_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_lookups)


def _answer(host: str, answer: list[Any], done: threading.Event, value: Any) -> None:
    """Give the callers waiting on ``host``'s lookup its answer (addresses, or what was
    raised), and forget the lookup: the next caller starts another."""
    answer.append(value)
    with _lookups_lock:
        if _lookups.get(host, (None,))[0] is done:
            del _lookups[host]
    done.set()


def _look_up(host: str, answer: list[Any], done: threading.Event) -> None:
    value: Any
    try:
        try:  # (IPv4 first, as ZeroMQ and IPv4 sockets ask: /etc/hosts may give a name
            # "::1" alone when asked for any family, and 127.0.0.1 when asked for IPv4)
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror:
            # (then any family, even where the IPv4 query failed on a DNS that is down: the
            # hosts file may hold the name's IPv6 address, and each caller has its deadline)
            infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
        value = infos
    except BaseException as e:  # noqa: BLE001  (handed to the callers)
        value = e
    _answer(host, answer, done, value)


def resolve(host: str, timeout: float) -> str:
    """``host``'s address, looked up within ``timeout`` seconds: a number as it is, a name as
    its first IPv4 address, or its first IPv6 one where it has none (ZeroMQ, given a name,
    looks for IPv4 only). Raises socket.gaierror where the name does not resolve (or
    UnicodeError), TimeoutError where the lookup took longer.

    The system's resolver has no deadline of its own: a DNS server that does not answer holds
    ``getaddrinfo`` for its timeout times its attempts, per server (5 s x 2 each by default),
    and ZeroMQ, given a name, looks it up in ``connect()`` and then again at each reconnection
    in its I/O thread, which every socket of the process shares. So a name is looked up here,
    in a thread this one waits for until the deadline (and leaves behind if it has not
    returned: nothing can stop a ``getaddrinfo``), and sockets are given numbers.
    """
    if _numeric(host):
        return host
    with _lookups_lock:
        entry = _lookups.get(host)
        fresh = entry is None
        if entry is None:
            entry = _lookups[host] = (threading.Event(), [])
    done, answer = entry
    if fresh:
        try:
            threading.Thread(target=_look_up, args=(host, answer, done),
                             name=f"ctrlcomm-resolve-{host}", daemon=True).start()
        except RuntimeError:  # (no thread can be started: looked up here, without deadline)
            _look_up(host, answer, done)
        except BaseException:  # (interrupted: the entry must not stay, waited for forever)
            _answer(host, answer, done,
                    socket.gaierror(socket.EAI_AGAIN, "the lookup was interrupted"))
            raise
    left = max(timeout, 0.0)
    if not done.wait(min(left, threading.TIMEOUT_MAX)):
        raise TimeoutError(f"looking up host {host!r} took longer than the {left:.3g} s left "
                           "(is its DNS server reachable?)")
    if isinstance(answer[0], socket.gaierror):  # (one per caller: callers may share it)
        raise socket.gaierror(answer[0].errno, answer[0].strerror)
    if isinstance(answer[0], BaseException):
        raise answer[0]
    infos = answer[0]
    if not infos:  # (never, by getaddrinfo's contract)
        raise socket.gaierror(socket.EAI_NONAME, f"{host!r} resolves to no address")
    return str(infos[0][4][0])


def local_address_for(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent;
    ``host`` a number, or a name looked up without a deadline: see :func:`resolve`)."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def _wildcard(host: str) -> bool:
    """Whether ``host`` (a number) is an unspecified address: 0.0.0.0, ::, ::0..."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _dual_stack(sock: socket.socket, bind_host: str) -> None:
    """A socket to bind on the IPv6 wildcard takes IPv4 too (as Linux's default does; set
    here, not left to net.ipv6.bindv6only): peers given an IPv4 wildcard find it there."""
    if sock.family == socket.AF_INET6 and _wildcard(bind_host):
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


def _tcp(host: str, port: int | str) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def _is_v6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")


# ------------------------------------------------------------------ CurveZMQ encryption


def curve_available() -> bool:
    return bool(zmq.has("curve"))


ENCRYPTED_STORE = b"ctrlcomm-store"  # (the derivation of an encrypted store's key pair)


def store_curve_keys(key: bytes, person: bytes = ENCRYPTED_STORE) -> tuple[bytes, bytes]:
    """The store's CurveZMQ key pair (public, secret; Z85), derived from the group's shared
    key: every client can then check it talks to the real store, and nothing but the shared
    key has to be distributed. ``person`` tells apart the pairs of an encrypted store
    (``encrypt=True``) and a keyed one (:data:`KEYED_STORE`)."""
    seed = hashlib.blake2b(key, person=person, digest_size=32).digest()
    secret = zmq.utils.z85.encode(seed)
    return zmq.curve_public(secret), secret


# With a key and without encryption, a store's ZeroMQ socket still runs CurveZMQ's handshake,
# with a key pair derived from the key: the server's public key is never sent, so a peer
# without the key cannot complete the handshake and ZeroMQ takes nothing from it. Without,
# anyone who reaches the port could make ZeroMQ buffer a message whole before ctrlcomm sees
# it: one of millions of empty frames grew the process by 32 times what was sent, and taking
# it apart stalled the store for 37 s. (Its traffic is then encrypted too, as a side effect;
# the key pair differs from an encrypted store's, so a client that encrypts and a store that
# does not still do not talk.) A group's sockets with transport="zmq" are left as they are
# (README, Security): a group's traffic can be large, and encrypt=True is there for it.
KEYED_STORE = b"ctrlcomm-sauth"


# The handshakes a store counts as failed: a peer that speaks another mechanism (no key), or
# whose CurveZMQ boxes do not open (another key). Not those cut short (no detail: a port
# scan, a client gone mid-handshake).
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def _monitor(sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any] | None:
    """A monitor of ``events`` on ``sock`` (at an address of this process's own: pyzmq's
    default names it by descriptor, which a socket closed just before may still hold), or
    None where ZeroMQ cannot make one (out of descriptors, say): then nothing is counted."""
    try:
        return sock.get_monitor_socket(
            events, addr=f"inproc://ctrlcomm-monitor-{next(_store_ids)}-{os.getpid()}")
    except zmq.ZMQError:
        return None


def _close_monitor(sock: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> None:
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)


def _handshakes_failed(monitor: zmq.Socket[Any]) -> int:
    """How many failed handshakes a socket's monitor reports now (its events read)."""
    n = 0
    for _ in range(1000):
        try:
            frames = monitor.recv_multipart(zmq.DONTWAIT)
        except zmq.Again:
            break
        n += len(frames) == 2  # (an event: its number and value, then the address)
    return n


def _store_curve(key: bytes | None, encrypt: bool) -> bytes | None:
    """The derivation (``person`` of :func:`store_curve_keys`) of the CurveZMQ key pair a
    store's socket with this ``key`` runs with: the encrypted store's where ``encrypt``,
    :data:`KEYED_STORE` where only keyed (and CurveZMQ is there: pyzmq's wheels have it),
    None for none."""
    if encrypt:
        return ENCRYPTED_STORE
    return KEYED_STORE if key and curve_available() else None


def _curve_client(sock: zmq.Socket[Any], server_public: bytes) -> None:
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _curve_server(sock: zmq.Socket[Any], secret: bytes) -> None:
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


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


def _bind_error(e: zmq.ZMQError, what: str, addr: str) -> CtrlcommError:
    if e.errno == zmq.EADDRINUSE:
        hint = ("; if it is another group's store (torch's new_group reuses its world's "
                "port), a group formed through it passes host_store=False, or give this "
                "group a port of its own") if what == "store" else ""
        return StoreError(f"cannot bind {what} on {addr}: address already in use{hint}")
    return StoreError(f"cannot bind {what} on {addr}: {e}")


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
    moment). An exception raised meanwhile by a signal handler (Ctrl-C) is raised once it is
    held, not instead: the call's end releases it (it released a watchdog's hold, which then
    raised from abort(), and ``held_async`` stayed set)."""
    io, exc = ep.io, None
    while True:
        try:
            io.acquire()
            break
        except BaseException as e:
            exc = e
            if io._is_owned():  # (raised just after it was taken)
                break
    ep.held_async = False
    if exc is not None:
        raise exc


class ZmqEndpoint:
    """A rank's sockets in one group, over ZeroMQ (``transport="zmq"``)."""

    STREAM = False  # frames only (ZeroMQ's own framing)

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
        self.io, self.held_async = threading.RLock(), False  # see Core._abort_suspended
        # (loop, wake) of an awaited wait in progress (see wake)
        self._aw: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None
        self.turn = 0.0  # when an awaited wait last went through the event loop
        self.ended = 0.0  # when the last awaited call on this endpoint ended (run_async)
        self.yielding = 0  # awaited calls giving the loop a turn before they start (run_async)
        self.closed = False
        self.key: bytes | None = None  # the group's MAC key, to authenticate what arrives
        self.me = -1  # this rank, for which what arrives must be MACed (set by the core)
        self.sink: Callable[[w.Message | None], int | None] | None = None  # unused here
        # ZeroMQ reconnects silently: a lost peer is not reported by this transport
        self.on_lost = on_lost

    def set_peers(self, peers: dict[int, str], curve_keys: dict[int, bytes] | None = None
                  ) -> None:
        self.peers = dict(peers)
        self.peer_keys = dict(curve_keys or {})

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
            if _turn_due(self):  # (no need to go through the event loop, but for that)
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

        fd = self.fd
        loop.add_reader(fd, wake)
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
        aw, self._aw = self._aw, None
        if aw is not None:
            # an awaited wait of this thread's loop (close() from another task: a close
            # from another thread is done by the thread whose call holds the group, once
            # woken): its reader goes before the descriptor does, with rx (a number reused at
            # once found the loop's stale entry, and add_reader then registered nothing);
            # and the wait ends, finding the endpoint closed
            try:
                here = asyncio.get_running_loop() is aw[0]
            except RuntimeError:
                here = False
            if here or not aw[0].is_running():  # (a loop not running: nothing selects now)
                try:
                    aw[0].remove_reader(self.fd)
                    aw[1]()
                except Exception:  # (a closed loop: its selector, entry included, is gone)
                    pass
            else:
                self._aw = aw  # (its own thread removes it; wake() ends the wait)
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

    (Before, every socket lingered LINGER_MS: a process whose peers had closed first waited
    5 s to exit, the usual end of a group closed on every rank at once, where goodbyes take
    connections made at close.)"""
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


def _refused(address: str, timeout: float) -> bool:
    """Whether a TCP connection to the ZeroMQ endpoint ``address`` ("tcp://host:port") is
    refused: nothing listens there (its socket closed). Not where it is taken (the peer is
    there: one that closes at once, before ZeroMQ's greeting, which ZeroMQ drops), nor where
    it cannot tell (no answer within ``timeout``, no route)."""
    try:
        with socket.create_connection(_parse_tcp(address)[1], timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


# A request unanswered for this long is sent again (same id: the server answers it once).
# This rides out a store that restarts, or a request lost with a dying connection.
STORE_RESEND_S = 1.0


# How long a client waits for a store's greeting (see _zmtp_mechanism) at most.
PROBE_S = 0.5

# ZMTP 3.0's greeting of a client of the NULL mechanism (signature, version, mechanism,
# as-server, filler: 64 bytes).
NULL_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") \
    + b"\x00" * 32


def _zmtp_mechanism(host: str, port: int, timeout: float, null: bool = False) -> bytes | None:
    """The security mechanism a ZeroMQ socket at ``host:port`` announces in its greeting
    (``b"NULL"``, ``b"CURVE"``), or None where it says none within ``timeout`` seconds.
    Only ZMTP's signature and major version are sent: the peer sends its greeting, and the
    connection ends before a mechanism is spoken (nothing is taken, nothing is counted).
    With ``null``, where the peer's mechanism is another, the rest of a NULL client's
    greeting follows, and the peer is given the rest of the ``timeout`` to end the
    connection: it has then seen a client without its key (a keyed store counts it in its
    ``dropped``)."""
    deadline = time.monotonic() + timeout
    mechanism = None
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.001)) as s:
            s.sendall(NULL_GREETING[:11])
            got = b""
            while len(got) < 32:
                left = deadline - time.monotonic()
                if left <= 0:  # (one deadline in all: a peer may send a byte at a time)
                    return None
                s.settimeout(left)
                chunk = s.recv(64 - len(got))
                if not chunk:
                    return None
                got += chunk
            if got[0] != 0xFF or got[10] < 3:
                return None
            mechanism = got[12:32].rstrip(b"\x00")
            if null and mechanism != b"NULL":
                s.sendall(NULL_GREETING[11:])
                while (left := deadline - time.monotonic()) > 0:
                    s.settimeout(left)
                    if not s.recv(4096):  # (the peer ended it: it saw the mechanism differ)
                        break
    except (OSError, ValueError):  # (refused, timed out, reset; an unusable host)
        pass  # (the mechanism, where the greeting had named it before)
    return mechanism


def _plain_reply(frames: Sequence[Any], req_id: int) -> bool:
    try:
        return w.decode_store_reply(frames).req_id == req_id
    except WireError:
        return False


class StoreConnection:
    """One client connection to a store."""

    def __init__(self, host: str, port: int, key: bytes | None = None,
                 encrypt: bool = False) -> None:
        self.key = key
        self._curve = _store_curve(key, encrypt)
        assert self._curve is None or key, "encryption needs the shared key"
        # (a keyed client's handshake with a store without a key fails, unanswered, as does
        # a client's without a key with a store with one (where ZeroMQ saw the mechanism
        # differ on this side first, it does not even try again): such a store is looked
        # for while a request waits, and said at once; see request)
        self._looks = (host, port) if self._curve == KEYED_STORE or not (key or encrypt) \
            else None
        self._probe = self._looks
        # a fixed identity across reconnections lets the server recognise a resent request
        self._id = b"c" + os.urandom(15)
        self.addr = _tcp(host, port)
        made = self._socket()
        assert made is not None  # (not watched: always a socket)
        self.sock, self._events = made
        self._stale = False
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        # (interrupt(): another thread closing the client wakes a request waiting here)
        self._bell_r, self._bell_w = os.pipe()
        os.set_blocking(self._bell_w, False)
        self._poller.register(self._bell_r, zmq.POLLIN)
        self._bell_lock = threading.Lock()
        self.rung = False
        self._pid = os.getpid()

    def _socket(self, watched: bool = False
                ) -> tuple[zmq.Socket[Any], zmq.Socket[Any] | None] | None:
        """A socket connected to the store, and the monitor of its handshakes that fail on
        this side (watched from before it connects: see _renew). With ``watched``, None
        where the monitor cannot be made, before the socket connects: a connection with
        this client's routing id would take the old socket's over at a keyed store
        (ROUTER_HANDOVER), its replies then lost with the new socket, closed unused."""
        sock: zmq.Socket[Any] = context().socket(zmq.DEALER)
        events = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                assert self.key
                _curve_client(sock, store_curve_keys(self.key, self._curve)[0])
            sock.setsockopt(zmq.ROUTING_ID, self._id)
            if _is_v6(self.addr):
                sock.setsockopt(zmq.IPV6, 1)
            events = _monitor(sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            if events is None and watched:
                sock.close(0)
                return None
            sock.connect(self.addr)
        except BaseException:
            _close_monitor(sock, events)
            sock.close(0)
            raise
        return sock, events

    def _send(self, frames: list[bytes]) -> None:
        """Send (or resend) a request: on a new socket where this one's handshake failed."""
        if self._events is not None and _handshakes_failed(self._events):
            self._stale = True
        if self._stale:
            self._renew()
        with contextlib.suppress(zmq.Again):  # (no connection yet, nor a queue: resent)
            self.sock.send_multipart(frames, zmq.DONTWAIT)

    def _renew(self) -> None:
        """A new socket for one whose handshake failed on this side (another mechanism, a
        port that does not speak ZMTP): ZeroMQ makes no new connection after that (where
        the store saw it first, it does), so that a store restarted since, or run as this
        client is, would never be reached. Its greeting is looked at again."""
        with self._bell_lock:
            if self._bell_w < 0:
                raise StoreError(f"the store client of {self.addr} was closed (by another "
                                 "thread) while this request waited")
            try:
                made = self._socket(watched=self._events is not None)
            except zmq.ZMQError:  # (out of descriptors, say: the next send tries again)
                return
            if made is None:  # (a socket that could not tell of its own failed handshake,
                return  # not connected: the next send tries again)
            sock, events = made
            self._poller.unregister(self.sock)
            _close_monitor(self.sock, self._events)
            self.sock.close(0)
            self.sock, self._events, self._stale = sock, events, False
            self._poller.register(sock, zmq.POLLIN)
        self._probe = self._looks

    def interrupt(self) -> None:
        """Wake the request waiting in another thread: it raises StoreError (closed)."""
        with self._bell_lock:
            if self._bell_w >= 0:
                self.rung = True
                try:
                    os.write(self._bell_w, b"x")
                except OSError:  # (full: rung already)
                    pass

    def request(self, req: w.StoreRequest, deadline: float) -> w.StoreReply | None:
        """Send ``req`` and wait for its reply until ``deadline``; ``None`` on timeout."""
        if self.rung:
            raise StoreError(f"the store client of {self.addr} was closed")
        frames = [b"", *w.encode_store_request(req, self.key)]
        self._send(frames)
        resend_at = time.monotonic() + STORE_RESEND_S
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            if now >= resend_at:
                if self._probe is not None:
                    # unanswered: a store without a key (which its greeting names) never
                    # completes a keyed client's handshake, nor a store with one (or with
                    # encryption) a client's without
                    keyed = bool(self.key)
                    mechanism = _zmtp_mechanism(*self._probe, min(PROBE_S, deadline - now),
                                                null=not keyed)
                    if keyed and mechanism == b"NULL":
                        raise StoreError(f"the store at {self.addr} answers without "
                                         "authentication: it runs without this group's "
                                         "auth_key (or, where it has the key, without "
                                         "CurveZMQ, which a keyed store of this version runs)")
                    if not keyed and mechanism not in (None, b"NULL"):
                        raise StoreError(f"the store at {self.addr} runs with an auth_key, "
                                         "or encryption, and this client has neither: it "
                                         "answers nothing unauthenticated")
                    if mechanism is not None:
                        self._probe = None  # (the store runs as this client does, or, where
                        # keyed, with another key, or none yet)
                    now = time.monotonic()  # (the look took time: the wait below is shorter)
                    if self.rung:
                        raise StoreError(f"the store client of {self.addr} was closed (by "
                                         "another thread) while this request waited")
                    if now >= deadline:
                        return None
                self._send(frames)
                resend_at = now + STORE_RESEND_S
            wait = min(deadline, resend_at) - now
            ready = dict(self._poller.poll(min(max(1, int(wait * 1000)), MAX_POLL_MS)))
            if not ready:
                continue
            if self.rung:
                raise StoreError(f"the store client of {self.addr} was closed (by another "
                                 "thread) while this request waited")
            if self.sock not in ready:
                continue
            got = self.sock.recv_multipart()  # (not into frames: a resend sends those)
            try:
                rep = w.decode_store_reply(got[1:], self.key)
            except WireError:
                if self.key and _plain_reply(got[1:], req.req_id):
                    # (where CurveZMQ is missing, and a keyed client's store runs plain)
                    raise StoreError(f"the store at {self.addr} answers without "
                                     "authentication: it runs without this group's auth_key"
                                     ) from None
                continue
            if rep.req_id == req.req_id:
                return rep

    def close(self) -> None:
        with self._bell_lock:
            if self._bell_w < 0:
                return
            if os.getpid() == self._pid:
                # (not in a forked child: the sockets are the parent's, and a monitor
                # disabled there signals the parent's ZeroMQ threads through the
                # descriptors they share: libzmq 4.3.4 then aborts the parent)
                _close_monitor(self.sock, self._events)
                self.sock.close(0)
            os.close(self._bell_r)
            os.close(self._bell_w)
            self._bell_r = self._bell_w = -1


class StoreStream:
    """One client connection to a store without a key: plain TCP (see :class:`StoreServer`).
    The connection is made as a request needs it, and made again where it ended (a store
    restarted, or one that closed it to take another at its limit), the request then sent
    again (the store answers a request of the same id once: see StoreState.handle)."""

    def __init__(self, host: str, port: int) -> None:
        self.key: bytes | None = None
        self.addr = _tcp(host, port)
        self._family, self._where = _parse_tcp(self.addr)
        if ":" in host:
            self._family = socket.AF_INET6
        self._id = os.urandom(w.STORE_ID_SIZE)  # (the store knows this client by it)
        self.sock: socket.socket | None = None
        self._dec: w.StoreStreamDecoder | None = None
        self._bell_r, self._bell_w = os.pipe()
        os.set_blocking(self._bell_w, False)
        self._bell_lock = threading.Lock()
        self.rung = False

    def _connect(self, deadline: float) -> bool:
        try:
            s = socket.socket(self._family, socket.SOCK_STREAM)
        except OSError:
            return False
        try:
            s.settimeout(max(min(deadline - time.monotonic(), PROBE_S * 2), 0.001))
            s.connect(self._where)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(w.store_hello(self._id))
            s.setblocking(False)
        except OSError:
            s.close()
            return False
        self.sock = s
        self._dec = w.StoreStreamDecoder(w.MAX_STORE_KEYS + 8, w.STORE_MAX_FRAME * 2)
        return True

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = self._dec = None

    def interrupt(self) -> None:
        """Wake the request waiting in another thread: it raises StoreError (closed)."""
        with self._bell_lock:
            if self._bell_w >= 0:
                self.rung = True
                with contextlib.suppress(OSError):  # (full: rung already)
                    os.write(self._bell_w, b"x")

    def _closed_error(self) -> StoreError:
        return StoreError(f"the store client of {self.addr} was closed (by another thread) "
                          "while this request waited")

    def request(self, req: w.StoreRequest, deadline: float) -> w.StoreReply | None:
        """Send ``req`` and wait for its reply until ``deadline``; ``None`` on timeout (the
        store unreachable, or silent)."""
        if self.rung:
            raise StoreError(f"the store client of {self.addr} was closed")
        data = w.store_stream_message(w.encode_store_request(req))
        sent = False
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            if self.sock is None:
                if not self._connect(deadline):
                    # (refused, or unreachable: again shortly, until the deadline)
                    if self._sleep(min(STORE_RETRY_S, deadline - time.monotonic())):
                        raise self._closed_error()
                    continue
                sent = False
            sock = self.sock
            assert sock is not None and self._dec is not None
            if not sent:
                try:
                    sock.setblocking(True)
                    sock.settimeout(max(deadline - now, 0.001))
                    sock.sendall(data)
                    sock.setblocking(False)
                    sent = True
                except OSError:  # (its end, or a send that timed out: the deadline)
                    self._drop()
                    continue
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            poller.register(self._bell_r, select.POLLIN)
            wait = min(deadline - time.monotonic(), MAX_POLL_S)
            ready = dict(poller.poll(max(1, int(wait * 1000))))
            if self.rung or self._bell_r in ready:
                raise self._closed_error()
            if sock.fileno() not in ready:
                continue
            try:
                got = sock.recv(STORE_READ)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                self._drop()
                continue
            if not got:
                self._drop()
                continue
            if not self._dec.pending() and got[:1] == b"\xff":  # ZMTP's signature
                self._drop()
                # a ZeroMQ store (one with a key) greets first; looked at again, with a
                # NULL client's greeting, which such a store counts (rank 0 then says a
                # rank without the key came). Not one: a port that is not a store's
                if _zmtp_mechanism(*self._where, min(PROBE_S, deadline - time.monotonic()),
                                   null=True) not in (None, b"NULL"):
                    raise StoreError(f"the store at {self.addr} runs with an auth_key, or "
                                     "encryption, and this client has neither: it answers "
                                     "nothing unauthenticated")
                if self._sleep(min(STORE_RETRY_S, deadline - time.monotonic())):
                    raise self._closed_error()
                continue
            try:
                msgs = self._dec.feed(got)
            except WireError:
                self._drop()
                continue
            for frames in msgs:
                try:
                    rep = w.decode_store_reply(frames)
                except WireError:
                    continue
                if rep.req_id == req.req_id:
                    return rep

    def _sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless woken by :meth:`interrupt` (then True)."""
        r, _, _ = select.select([self._bell_r], [], [], max(seconds, 0.0))
        return bool(r) or self.rung

    def close(self) -> None:
        with self._bell_lock:
            if self._bell_w < 0:
                return
            self._drop()
            os.close(self._bell_r)
            os.close(self._bell_w)
            self._bell_r = self._bell_w = -1


def store_connection(host: str, port: int, key: bytes | None, encrypt: bool
                     ) -> StoreConnection | StoreStream:
    """A client's connection to the store at ``host:port``: over ZeroMQ with a key (and
    CurveZMQ, as the store runs), over plain TCP without."""
    if key or encrypt:
        return StoreConnection(host, port, key, encrypt)
    return StoreStream(host, port)


# A TCP store client tries a connection again this often while its store refuses it.
STORE_RETRY_S = 0.05

_released: dict[tuple[str, int], float] = {}
_store_ids = itertools.count()
# the longest a poll may sleep: ZeroMQ takes milliseconds as a C int (a longer wait, of
# a request with an hours-long deadline, sleeps again)
MAX_POLL_MS = 3_600_000
MAX_POLL_S = MAX_POLL_MS / 1000


# How long StoreServer waits for the lookup of a host name it is to bind (by default).
BIND_LOOKUP_S = 30.0


def _bind_host(host: str, port: int, timeout: float) -> str:
    """What ZeroMQ is given to bind for ``host``: an address, ``*`` or an interface's name
    (``eth0``) as they are; a host name looked up here, within ``timeout`` seconds (ZeroMQ
    would look it up itself, without a deadline: see :func:`resolve`)."""
    if not isinstance(host, str) or not host:
        raise StoreError(f"cannot bind store: host must be a non-empty str, got {host!r}")
    if host.startswith("[") and host.endswith("]") and _numeric(host[1:-1]):
        return host[1:-1]  # ([::1], as a URL writes it)
    if host == "*" or _numeric(host) or host in {n for _, n in socket.if_nameindex()}:
        return host
    try:
        return resolve(host, timeout)
    except TimeoutError as e:
        raise StoreTimeoutError(f"cannot bind store on {host}:{port}: {e}",
                                answered=False) from None
    except (OSError, UnicodeError) as e:
        raise StoreError(f"cannot bind store on {host}:{port}: {host!r} is not an address, "
                         f"an interface of this host or a name that resolves ({e})") from None


def auth_key_or_env(given: str | bytes | None = None) -> bytes | None:
    """The key a group or a store takes: ``given``, else ``CTRLCOMM_AUTH_KEY`` from the
    environment (empty there is unset, as shells have it); as bytes, None for none. (One
    place for the fallback every entry point has: Group.create, from_env under torchrun,
    group_from_torch, vLLM's dataclass, the store command, the bench, run_group.)"""
    key = given if given is not None else (os.environ.get("CTRLCOMM_AUTH_KEY") or None)
    return key.encode() if isinstance(key, str) else key


_warned_unkeyed = False

UNKEYED_WARNING = (
    "%s binds %s, which other hosts can reach, without an auth_key. What the default "
    "protects: nobody who did not join a group can make its ranks unpickle anything or "
    "change a result (every message and heartbeat is authenticated with a secret rank 0 "
    "makes at formation, which the store gives only to the ranks that joined), and the "
    "store's limits bound what strangers make it hold. What it does not: one who reads "
    "the network while a group forms learns that secret, and anyone who reaches the store "
    "can join a forming group in a rank's place before that rank comes (the rank is then "
    "told it joined already). Give every rank and store the same auth_key (or set "
    "CTRLCOMM_AUTH_KEY) for those, and encrypt=True to hide what is sent. (Said once.)")


def warn_if_unkeyed(what: str, address: str, key: bytes | None) -> None:
    """Log, once per process, what a socket bound without a key beyond the loopback
    (``address``: a numeric address, ``*``, or an interface's name) protects, and what
    not."""
    global _warned_unkeyed
    if key or _warned_unkeyed:
        return
    host = address.strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        if host == "lo":
            return
    _warned_unkeyed = True
    log.warning(UNKEYED_WARNING, what, address)


class StoreServer:
    """A rendezvous store served from a daemon thread of this process.

    Without a key it serves plain TCP (:data:`w.STORE_STREAM_MAGIC` framing), with its
    :class:`~ctrlcomm._store.StoreLimits` enforced as bytes come: anyone who reaches the
    port may connect, so nobody may make it hold more than the limits say. With a key it
    serves ZeroMQ with CurveZMQ: a peer without the key cannot complete the handshake.

    Args:
        host: address to bind (``"0.0.0.0"`` binds every interface: an explicit opt-in), an
            interface's name, or a host name (looked up within ``lookup_timeout`` seconds;
            :class:`StoreTimeoutError` past it).
        port: port to bind; 0 picks a free one (see :attr:`port`).
        auth_key: the shared key: requests and replies then carry a MAC, and a peer without
            it cannot complete the handshake (counted in :attr:`dropped`, with the requests
            dropped as malformed or unauthenticated).
        encrypt: CurveZMQ encryption, for groups made with ``encrypt=True`` (needs the key).
        limits: what the store takes at most (default: ``StoreLimits()``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 listen_socket: socket.socket | None = None,
                 auth_key: bytes | str | None = None, encrypt: bool = False,
                 lookup_timeout: float = BIND_LOOKUP_S, limits: Any = None) -> None:
        from ._store import StoreLimits, StoreState

        self.host = host
        self.key = auth_key.encode() if isinstance(auth_key, str) else auth_key
        if encrypt and not self.key:
            raise CtrlcommError("an encrypted store needs an auth_key (its CurveZMQ keys are "
                                "derived from it)")
        if limits is not None and not isinstance(limits, StoreLimits):
            raise CtrlcommError(f"StoreServer: limits must be a StoreLimits, got a "
                                f"{type(limits).__name__}")
        self.encrypt = encrypt
        self.state = StoreState(limits)
        self.limits = self.state.limits
        self.dropped = 0
        self._stop = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._lsock: socket.socket | None = None
        try:
            if self.key:
                self._bind_zmq(host, port, listen_socket, lookup_timeout)
            else:
                self._bind_tcp(host, port, listen_socket, lookup_timeout)
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._thread = threading.Thread(target=self._serve, name=f"ctrlcomm-store:{self.port}",
                                         daemon=True)
        try:
            self._thread.start()
        except BaseException:  # ("can't start new thread")
            self._release()
            raise

    def __repr__(self) -> str:
        return f"StoreServer({self.host!r}, {self.port})"

    def _bind_tcp(self, host: str, port: int, listen_socket: socket.socket | None,
                  lookup_timeout: float) -> None:
        if listen_socket is not None:
            # serve from a socket the caller already bound (and so reserved) at host:port
            ls = socket.socket(fileno=os.dup(listen_socket.fileno()))
        else:
            addr = _bind_host(host, port, lookup_timeout)
            if addr == "*":
                addr = "0.0.0.0"
            elif not _numeric(addr):
                addr = _interface_address(addr)
            # a store this process closed on this port just before may still hold it a few
            # milliseconds (ZeroMQ releases a listener asynchronously): only then is a
            # failed bind tried again
            retry_until = _released.get((host, port), 0.0) + 2.0
            while True:
                ls = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
                try:
                    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    _dual_stack(ls, addr)
                    ls.bind((addr, port))
                    ls.listen(1024)
                    break
                except OSError as e:
                    ls.close()
                    if e.errno == errno.EADDRINUSE and time.monotonic() < retry_until:
                        time.sleep(0.01)
                        continue
                    raise _bind_os_error(e, "store", _tcp(addr, port)) from None
        ls.setblocking(False)
        self._lsock = ls
        self.port = int(ls.getsockname()[1])
        warn_if_unkeyed(f"a store (port {self.port})", str(ls.getsockname()[0]), None)

    def _bind_zmq(self, host: str, port: int, listen_socket: socket.socket | None,
                  lookup_timeout: float) -> None:
        assert self.key
        sock = self.sock = context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            person = _store_curve(self.key, self.encrypt)
            if person is not None:
                _curve_server(sock, store_curve_keys(self.key, person)[1])
                # a client's new connection takes its routing id over from its old one,
                # which the store may not have seen end yet (else ZeroMQ refuses the new
                # one: a client that made a new socket, see StoreConnection._renew, would be
                # unanswered meanwhile); the handshake needs the key, so nobody without it
                # can take a client's connection over
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, w.STORE_MAX_FRAME)  # (see there)
            # a connection whose handshake has not completed (a stranger without the key
            # never completes it) is closed after this long, not ZeroMQ's 30 s
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            if listen_socket is not None:
                # ZeroMQ closes what it is given, so it gets its own copy of the descriptor
                host, port = listen_socket.getsockname()[:2]
                sock.setsockopt(zmq.USE_FD, os.dup(listen_socket.fileno()))
            addr = _tcp(_bind_host(host, port, lookup_timeout), port or "*")
            if _is_v6(addr):
                sock.setsockopt(zmq.IPV6, 1)
            # ZeroMQ releases a listener asynchronously: an address this process just
            # closed may be busy for a few milliseconds more. Only then is a failed bind
            # tried again.
            retry_until = _released.get((host, port), 0.0) + 2.0
            while True:
                try:
                    sock.bind(addr)
                    break
                except zmq.ZMQError as e:
                    if e.errno == zmq.EADDRINUSE and time.monotonic() < retry_until:
                        time.sleep(0.01)
                        continue
                    raise _bind_error(e, "store", _tcp(host, port)) from None
            self.port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
            # counts the connections whose handshake failed (a peer without the key, or
            # with another): ZeroMQ drops them before anything reaches _serve
            self._monitor = _monitor(sock, HANDSHAKE_FAILED) if person is not None else None
        except BaseException:
            sock.close(0)
            raise

    def _release(self) -> None:
        if self.sock is not None:
            _close_monitor(self.sock, self._monitor)
            self.sock.close(0)
        if self._lsock is not None:
            self._lsock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _serve(self) -> None:
        try:
            if self.sock is not None:
                self._serve_zmq(self.sock)
            else:
                _StoreTcp(self).serve()
        finally:
            self._release()

    def _serve_zmq(self, sock: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        monitor = self._monitor
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        st = self.state
        while not self._stop:
            events = dict(poller.poll(_poll_ms(st.next_deadline())))
            if self._wake_r in events:
                break
            if monitor is not None and monitor in events:
                self.dropped += _handshakes_failed(monitor)
            replies = st.expire(time.monotonic())
            if sock in events:
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.DONTWAIT)
                    except zmq.Again:
                        break
                    if len(frames) < 2:
                        self.dropped += 1
                        continue
                    peer = frames[0]
                    replies += self.answer(peer, frames[2:] if frames[1] == b"" else frames[1:])
            for peer, rep in replies:
                try:
                    sock.send_multipart([peer, b"", *w.encode_store_reply(rep, self.key)],
                                        zmq.DONTWAIT)
                except zmq.ZMQError:
                    st.forget_peer(peer)

    def answer(self, peer: bytes, body: Sequence[Any]) -> list[tuple[bytes, Any]]:
        """The replies to send now for a request of ``peer``, its frames ``body`` (none for
        one malformed or unauthenticated, which is counted and never answered)."""
        try:
            req = w.decode_store_request(body, self.key)
        except w.UnknownStoreOp as e:  # (a later version's call: refused)
            return [(peer, w.StoreReply(w.R_ERROR, e.req_id, (str(e).encode(),)))]
        except WireError:
            self.dropped += 1
            return []
        return self.state.handle(peer, req, time.monotonic())

    def close(self) -> None:
        """Stop serving (idempotent; returns at once)."""
        if self._stop:
            return
        self._stop = True
        _released[(self.host, self.port)] = time.monotonic()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# How long a ZeroMQ store gives a connection to complete its handshake (a peer without the
# key never does).
HANDSHAKE_IVL_MS = 5000
# A TCP store's reads, and what it queues for one client at most (a client that takes none
# of its replies is disconnected past it)
STORE_READ = 65536
STORE_OUT_MAX = w.STORE_MAX_FRAME * 2


def _poll_ms(deadline: float | None) -> int | None:
    """A poll's timeout, in ms, for a wait until ``deadline`` (None: no deadline)."""
    if deadline is None:
        return None
    return min(max(0, int((deadline - time.monotonic()) * 1000) + 1), MAX_POLL_MS)


def _keepalive(s: socket.socket) -> None:
    """TCP keepalives on a store's connection: one whose client is gone without a word (a
    host that went down) ends within about 25 s, not TCP's 2 hours (its client, back,
    reconnects under its id, which a connection still open would keep)."""
    with contextlib.suppress(OSError, AttributeError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _interface_address(name: str) -> str:
    """The IPv4 address of the interface ``name`` (what ZeroMQ binds for an interface's
    name)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                              struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise StoreError(f"cannot bind the store on interface {name!r}: it has no IPv4 "
                             f"address ({e.strerror or e})") from None
    return socket.inet_ntoa(got[20:24])


def _bind_os_error(e: OSError, what: str, addr: str) -> CtrlcommError:
    if e.errno == errno.EADDRINUSE:
        return _bind_error(zmq.ZMQError(zmq.EADDRINUSE), what, addr)
    return CtrlcommError(f"cannot bind {what} on {addr}: {e.strerror or e}")


class _StoreClientConn:
    """One connection to a TCP store, as the store sees it."""

    __slots__ = ("sock", "decoder", "peer", "out", "last", "closing")

    def __init__(self, sock: socket.socket, decoder: w.StoreStreamDecoder) -> None:
        self.sock = sock
        self.decoder = decoder
        self.peer: bytes | None = None  # the client's id, once its hello came
        self.out = bytearray()
        self.last = time.monotonic()
        self.closing = False  # closed once what is queued is sent


class _StoreTcp:
    """A TCP store's loop (:class:`StoreServer`'s thread): connections accepted up to the
    limit (the least recently active one closed for a new one), requests read within the
    limits, each client's replies queued for it and sent as its socket takes them. A
    client reconnecting (its hello names it) gets the replies of requests that waited."""

    def __init__(self, server: StoreServer) -> None:
        import selectors

        self.server = server
        self.limits = server.limits
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _StoreClientConn] = {}
        self.by_peer: dict[bytes, _StoreClientConn] = {}
        self.READ, self.WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE

    def serve(self) -> None:
        server, st = self.server, self.server.state
        assert server._lsock is not None
        self.sel.register(server._lsock, self.READ, "accept")
        self.sel.register(server._wake_r, self.READ, "wake")
        try:
            while not server._stop:
                nd = st.next_deadline()
                ms = _poll_ms(nd)
                replies: list[tuple[bytes, Any]] = []
                for key, ev in self.sel.select(None if ms is None else ms / 1000):
                    if key.data == "wake":
                        return
                    if key.data == "accept":
                        self._accept(server._lsock)
                        continue
                    c = self.conns.get(key.fd)
                    if c is None:
                        continue
                    if ev & self.WRITE:
                        self._flush(c)
                    if ev & self.READ and key.fd in self.conns:
                        replies += self._read(c)
                replies += st.expire(time.monotonic())
                for peer, rep in replies:
                    c = self.by_peer.get(peer)
                    if c is not None:  # (else gone: it asks again as it reconnects)
                        self._send(c, w.store_stream_message(w.encode_store_reply(rep)))
        finally:
            for c in list(self.conns.values()):
                self._close(c)
            self.sel.close()

    def _accept(self, ls: socket.socket) -> None:
        for _ in range(64):
            try:
                s, _ = ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self.conns:
                    self._close(self._idlest())  # (a descriptor for the next one)
                    continue
                return
            if len(self.conns) >= self.limits.max_connections:
                self.server.dropped += 1
                self._close(self._idlest())
            s.setblocking(False)
            _keepalive(s)
            c = _StoreClientConn(s, w.StoreStreamDecoder(self.limits.max_frames,
                                                         w.STORE_MAX_FRAME * 2, self._room))
            self.conns[s.fileno()] = c
            self.sel.register(s, self.READ)

    def _room(self) -> int:
        """The largest frame a request may have now: a value the store could keep (a larger
        one is dropped as it comes, never buffered, and refused: see StoreStreamDecoder)."""
        st, lim = self.server.state, self.limits
        return max(min(lim.max_value_bytes, lim.max_total_bytes - st.held), 4096 + 64)

    def _skipped(self, peer: bytes, m: w.Skipped) -> list[tuple[bytes, Any]]:
        """The reply to a request the decoder did not keep (its value too large now)."""
        try:
            _, _, _, req_id, _, _ = w.STORE_REQ.unpack(m.first)
        except (struct.error, TypeError):
            self.server.dropped += 1
            return []
        lim = self.limits
        why = (f"a value of {m.size} bytes is over the store's max_value_bytes "
               f"({lim.max_value_bytes})") if m.size > lim.max_value_bytes else \
            (f"the store is full: it holds {self.server.state.held} bytes, and a value of "
             f"{m.size} more would pass its max_total_bytes ({lim.max_total_bytes})")
        return [(peer, w.StoreReply(w.R_ERROR, req_id, (why.encode(),)))]

    def _idlest(self) -> _StoreClientConn:
        """The connection to close for a new one: the least recently active, one without a
        request waiting first (its client reconnects as it next asks)."""
        waiting = {wt.peer for wt in self.server.state.waiters}
        idle = [c for c in self.conns.values() if c.peer not in waiting]
        return min(idle or self.conns.values(), key=lambda c: c.last)

    def _read(self, c: _StoreClientConn) -> list[tuple[bytes, Any]]:
        replies: list[tuple[bytes, Any]] = []
        for _ in range(16):  # (a share, then the others' turn: the socket stays ready)
            try:
                data = c.sock.recv(STORE_READ)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(c)
                break
            if not data:
                self._close(c)
                break
            c.last = time.monotonic()
            if c.peer is None and not c.decoder.pending() and data[:1] == b"\xff":
                # a ZeroMQ peer (a client with a key): told this store speaks ZMTP's NULL
                # mechanism, then closed, so that it says the store has no key
                self._send(c, NULL_GREETING)
                c.closing = True
                self._flush(c)
                break
            try:
                msgs = c.decoder.feed(data)
            except WireError:
                self.server.dropped += 1
                self._close(c)
                break
            for frames in msgs:
                if isinstance(frames, w.Skipped):
                    if c.peer is None:  # (a hello of megabytes: not a client of ours)
                        self.server.dropped += 1
                        self._close(c)
                        return replies
                    replies += self._skipped(c.peer, frames)
                    continue
                if c.peer is None:
                    try:
                        peer = w.store_hello_id(frames)
                    except WireError:
                        self.server.dropped += 1
                        self._close(c)
                        return replies
                    if peer in self.by_peer:
                        # a client's id, on a connection of its still open: not handed over
                        # (whoever read the id off the wire would take its replies); the
                        # client reconnects once its old connection is seen to end
                        self.server.dropped += 1
                        self._close(c)
                        return replies
                    c.peer = peer
                    self.by_peer[peer] = c
                    continue
                replies += self.server.answer(c.peer, frames)
            if c.decoder.error is not None:
                self.server.dropped += 1
                self._close(c)
                break
            if len(data) < STORE_READ:
                break
        return replies

    def _send(self, c: _StoreClientConn, data: bytes) -> None:
        if c.sock.fileno() < 0:
            return
        if len(c.out) + len(data) > STORE_OUT_MAX:
            self.server.dropped += 1  # (it takes none of its replies)
            self._close(c)
            return
        c.out += data
        self._flush(c)

    def _flush(self, c: _StoreClientConn) -> None:
        if c.sock.fileno() < 0:
            return
        if c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._close(c)
                return
            del c.out[:n]
        if c.out:
            self.sel.modify(c.sock, self.READ | self.WRITE)
        elif c.closing:
            self._close(c)
        else:
            self.sel.modify(c.sock, self.READ)

    def _close(self, c: _StoreClientConn) -> None:
        fd = c.sock.fileno()
        if fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(c.sock)
            self.conns.pop(fd, None)
            c.sock.close()
        if c.peer is not None and self.by_peer.get(c.peer) is c:
            del self.by_peer[c.peer]


# ------------------------------------------------------------------------------- TCP


def _parse_tcp(endpoint: str) -> tuple[int, tuple[str, int]]:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {endpoint!r}")
    hostport = endpoint[6:]
    host, _, port = hostport.rpartition(":")
    if host.startswith("["):
        return socket.AF_INET6, (host[1:-1], int(port))
    return socket.AF_INET, (host, int(port))


class _Conn:
    __slots__ = ("sock", "fd", "inbound", "rank", "decoder", "pending", "connecting", "events",
                 "backlog", "paused", "rsize")

    def __init__(self, sock: socket.socket, inbound: bool, rank: int | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.inbound = inbound
        self.rank = rank
        self.decoder = w.StreamDecoder() if inbound else None
        self.pending: deque[memoryview] = deque()
        self.connecting = False
        self.events = -1
        self.backlog = 0  # bytes in pending
        self.paused = False
        self.rsize = READ_CHUNK  # bytes a read asks for (FLOOD_READ in a flood of small ones)


# the usual message's start, as TcpEndpoint.read_expected compares it
_EXPRESS, _EXPRESS_SIZE, _EXPRESS_LEAD = w.EXPRESS.unpack_from, w.EXPRESS.size, w.EXPRESS_LEAD
_EXPRESS_MAC_LEN, _MAC_SIZE, _MAC_OK = w.EXPRESS_MAC_LEN, w.MAC_SIZE, w.usual_mac_ok
_HEAD, _MAGIC, _VERSION, _PICKLE = w.HEADER.pack, w.MAGIC, w.VERSION, w.PICKLE
_EPOLLIN = select.EPOLLIN
FAIR_S = 0.005  # awaited waits skip the event loop for at most this long in a row
SETTLE_ROUNDS = 8  # drains of a settle (see TcpEndpoint.settle): accept, identify, read


def _turn_due(ep: TcpEndpoint | ZmqEndpoint) -> bool:
    """Whether an awaited wait that need not go through the event loop (what it waits for is
    there) gives the loop a turn all the same: when it has had none through ``ep`` for
    FAIR_S, so that other tasks (and a cancellation) are not held up by a stream that keeps
    the socket ready."""
    now = time.monotonic()
    if now - ep.turn < FAIR_S:
        return False
    ep.turn = now
    return True
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


def host_id() -> str:
    """Who can reach this process's abstract Unix sockets and is let in: the same kernel
    (boot id), the same network namespace (they are scoped to it) and the same user (others
    are refused: see :func:`_same_user`). Empty where there are none (not Linux)."""
    global _host_id
    if _host_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            netns = os.stat("/proc/self/ns/net").st_ino
            _host_id = hashlib.blake2b(f"{boot}/{netns}/{os.getuid()}".encode(),
                                       digest_size=8).hexdigest()
        except OSError:
            _host_id = ""
    return _host_id


_host_id: str | None = None


def _proc_stat(path: str) -> list[bytes]:
    """The fields of a ``/proc/.../stat`` file after the command name: state first, then
    ppid..., the start time at index 19 (raises OSError, ValueError)."""
    with open(path, "rb") as f:
        st = f.read()
    return st[st.rindex(b")") + 2:].split()


def proc_address() -> str:
    """This process as same-host peers can look it up in ``/proc``:
    ``proc:HOST:PID:START``, where HOST names the kernel, network and PID namespace and user
    (``host_id`` and the PID namespace: there a pid means this process) and START is its
    start time, which a later process reusing the pid does not share. Empty where there is
    no ``/proc``."""
    hid = host_id()
    if not hid:
        return ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
        start = int(_proc_stat("/proc/self/stat")[19])
    except (OSError, ValueError, IndexError):
        return ""
    key = hashlib.blake2b(f"{hid}/{pidns}".encode(), digest_size=8).hexdigest()
    return f"proc:{key}:{os.getpid()}:{start}"


def same_host_procs(addresses: dict[int, str], mine: str) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, start time)}`` of the peers whose :func:`proc_address` (``addresses``:
    ``{rank: "proc:..."}``) says they are processes this one (``mine``: the one it
    published) can look up in ``/proc``."""
    if not mine:
        return {}
    key = mine.split(":")[1]
    out = {}
    for r, a in addresses.items():
        parts = a.split(":")
        if len(parts) == 4 and parts[0] == "proc" and parts[1] == key and a != mine:
            try:
                out[r] = (int(parts[2]), int(parts[3]))
            except ValueError:
                continue
    return out


def _local_mode() -> str:
    """``CTRLCOMM_LOCAL_SOCKETS``: "auto" (default), "1" (always) or "0" (never)."""
    mode = os.environ.get("CTRLCOMM_LOCAL_SOCKETS", "auto").strip().lower()
    return mode if mode in ("0", "1") else "auto"


def _cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup (v2) CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


def use_local_sockets(local_ranks: int, cpus: int) -> bool:
    """Whether ``local_ranks`` ranks of a group on one host with ``cpus`` CPUs should talk
    over Unix sockets ("auto"). A Unix send costs less CPU than a loopback TCP one, but wakes
    the receiver with a hint to run it on the sender's CPU: with a CPU free for each rank
    that serialises them (world 2 on 2 cores: latency up 15-20 %), when ranks outnumber the
    CPUs it does not matter and the cheaper sends win (worlds 4 and 8 on 2 cores: 5-15 %
    faster). Measured with ``ctrlcomm bench``; see benchmarks/README.md."""
    return local_ranks > cpus


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
    """

    STREAM = True  # takes messages in the stream framing (send_framed)

    kind = "tcp"

    def __init__(self, bind_host: str, *, on_lost: Callable[[int, str, bool], None] | None = None,
                 max_inbound: int = 256) -> None:
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
        self._local_mode = _local_mode()
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
        self.io, self.held_async = threading.RLock(), False  # see Core._abort_suspended
        # the descriptors that are not connections: the listeners, and the bell
        self._lfds = (ls.fileno(), self.usock.fileno() if self.usock is not None else -2,
                      self.bell.fd)
        self.fd = self.ep.fileno()
        self.peers: dict[int, str] = {}
        self.conns: dict[int, _Conn] = {}  # by fd
        self.out: dict[int, _Conn] = {}  # by rank
        # the sockets of self.out that are connected, with nothing queued: a message to one
        # of these ranks is sent straight away (send_framed)
        self.direct: dict[int, socket.socket] = {}
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
        self.unflushed: set[_Conn] = set()  # connections with queued data (or connecting)
        self._ready: list[tuple[int, int]] | None = None  # events seen by wait()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching self.fd
        self._waiter: asyncio.Future[None] | None = None
        # one timer for awaited waits, kept while it fires no later than a wait needs: a
        # timer per wait costs a heap push and a cancelled entry in the loop's heap each
        self._timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None  # raised by the next drain (see _on_readable)
        # what an awaited wait's reader callback hands the ready sockets to first, while
        # the call reads the short way (Core._express): whether to wake the call
        self.xtake: Callable[[list[tuple[int, int]]], bool] | None = None
        self.turn = 0.0  # when an awaited wait last went through the event loop
        self.ended = 0.0  # when the last awaited call on this endpoint ended (run_async)
        self.yielding = 0  # awaited calls giving the loop a turn before they start (run_async)
        self._pid = os.getpid()  # (a forked child's close leaves the parent's sockets be)
        _live.add(self)
        _flush_at_mp_exit()

    def set_peers(self, peers: dict[int, str], local: dict[int, str] | None = None) -> None:
        """Peers' TCP endpoints, and their local addresses where they published one."""
        self.peers = dict(peers)
        self.local_peers = {}
        self.spare_cpu = False
        if self.usock is not None:
            for r, a in (local or {}).items():
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

    def _count(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    # ------------------------------------------------------------------ outgoing

    def _register(self, c: _Conn, events: int) -> None:
        """Set the epoll events of ``c`` (-1 in ``c.events``: not registered yet)."""
        if c.events != events:
            if c.events == -1:
                self.ep.register(c.fd, events)
            else:
                self.ep.modify(c.fd, events)
            c.events = events

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
            try:
                n = s.send(hello) if hello else 0
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._lose(c, f"send failed: {e.strerror or e}")
                return c
            if n < len(hello):
                self._queue(c, [hello], n)
            else:
                self.direct[dst] = s
        return c

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
        queued (:attr:`direct`, the usual) is sent on without looking at its connection."""
        out, direct = self.out, self.direct
        one = parts[0] if len(parts) == 1 else None
        kept: list[Any] | None = None  # parts as queued: see _frozen (made once, if needed)
        for dst in dsts:
            s = direct.get(dst)
            if s is None:
                c = out.get(dst)
                if c is None:
                    c = self._connect(dst)
                if c.sock.fileno() < 0:  # lost: the core already knows
                    continue
                if c.pending or c.connecting:
                    kept = kept or _frozen(parts)
                    self._queue(c, kept, 0)  # (it asks epoll to say when it takes more)
                    continue
                s = c.sock
            try:
                n = s.send(one) if one is not None else s.sendmsg(parts)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._lose(out[dst], f"send failed: {e.strerror or e}")
                continue
            if n < total:
                kept = kept or _frozen(parts)
                self._queue(out[dst], kept, n)

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
        self.direct.pop(c.rank, None)  # type: ignore[arg-type]  # (outbound: a rank)
        self._register(c, select.EPOLLOUT | select.EPOLLIN)

    def _flush(self, c: _Conn) -> None:
        while c.pending:
            batch = [c.pending[i] for i in range(min(len(c.pending), 512))]
            try:
                n = c.sock.sendmsg(batch)
            except BlockingIOError:
                return
            except OSError as e:
                self._lose(c, f"send failed: {e.strerror or e}")
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
            self.direct[c.rank] = c.sock

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
        if not c.inbound and self.direct.get(c.rank) is c.sock:  # type: ignore[arg-type]
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
            self.conns[c.fd] = c
            self.unknown[c.fd] = c
            self.inbound += 1
            self._register(c, select.EPOLLIN)

    def _first(self, c: _Conn, sink: Callable[[w.Message | None], int | None]) -> bool:
        """One read of ``c``, a connection not identified yet (see set_hello): of what is
        left of a hello, else of a small piece. Whether it is identified now (then it takes
        messages of any size, and the caller reads on)."""
        dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
        want = self.hello_len - dec.pending()
        try:
            got = c.sock.recv_into(self._rbuf, want if want > 0 else 4096)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            self._lose(c, f"connection failed: {e.strerror or e}")
            return False
        if not got:
            self._lose(c, "connection closed")
            return False
        try:
            msgs = dec.messages(self._rbuf, got, self.key, self.me)
        except WireError:
            self._count("malformed_stream")
            self._drop_conn(c)
            return False
        if not self._identify(c, msgs, sink):
            return False
        if dec.error is not None:
            self._count("malformed_stream")
            self._drop_conn(c)
            return False
        if c.rank is None:
            return False
        dec.max_message = w.MAX_MESSAGE
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
        the short way (read_expected) checks too. (drain does the same inline.)"""
        for m in msgs:
            if m is not None and m.src != rank:
                self._count("wrong_sender")
                continue
            sink(m)

    def drain(self, sink: Callable[[w.Message | None], int | None]) -> None:
        """Handle every ready socket now; hand each whole message to ``sink``, decoded
        (``None`` for a malformed or unauthenticated one)."""
        if self._error is not None:  # met by an awaited wait's reader callback
            e, self._error = self._error, None
            raise e
        lfds = self._lfds
        view, buf, key, me = self._rview, self._rbuf, self.key, self.me
        ready, self._ready = self._ready, None
        t0 = 0.0  # (when a flood's first full chunk was read)
        for fd, ev in ready if ready is not None else self.ep.poll(0):
            if fd in lfds:
                if fd == lfds[2]:
                    self.bell.clear()  # a wake-up (see wake): nothing to read
                else:
                    self._accept(self.lsock if fd == lfds[0] else self.usock)  # type: ignore[arg-type]
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            if c.inbound:
                if c.rank is None and not self._first(c, sink):
                    continue  # (not identified yet, or dropped)
                # read it, here rather than in a method: a root wakes with one ready
                # socket per rank, and a call per socket is paid with caches its peers
                # have emptied
                dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
                recv_into = c.sock.recv_into
                rsize = c.rsize
                budget = 0
                while budget < READ_BUDGET:
                    try:
                        got = recv_into(view, rsize)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as e:
                        self._lose(c, f"connection failed: {e.strerror or e}")
                        break
                    if not got:
                        self._lose(c, "connection closed")
                        break
                    budget += got
                    try:
                        msgs = dec.messages(buf, got, key, me)
                    except WireError:
                        self._count("malformed_stream")
                        self._drop_conn(c)
                        break
                    if (rank := c.rank) is not None:
                        for m in msgs:  # (_deliver, inline)
                            if m is not None and m.src != rank:
                                self._count("wrong_sender")  # a peer sends as itself only
                                continue
                            sink(m)
                    elif not self._identify(c, msgs, sink):
                        break
                    if dec.error is not None:
                        self._count("malformed_stream")
                        self._drop_conn(c)
                        break
                    full = got == rsize
                    # the next read's size: small after a read of many messages of less
                    # than 4 KiB on average, the usual after a full one of larger ones (one
                    # threshold both ways: no swing between the two sizes)
                    n = len(msgs)
                    if n > 64 and n > got >> 12:
                        rsize = c.rsize = FLOOD_READ
                    elif full and n <= got >> 12:
                        rsize = c.rsize = READ_CHUNK
                    if not full or c.paused:
                        break
                    # a flood (full chunks back to back): after FAIR_S of it the rest
                    # waits for the next drain (the socket stays ready: nothing is lost),
                    # so an awaited call that reads it gives the event loop its turn
                    if not t0:
                        t0 = time.monotonic()
                    elif time.monotonic() - t0 >= FAIR_S:
                        break
                continue
            if c.connecting and ev & (select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP) \
                    and not self._connected(c):
                continue
            if ev & select.EPOLLOUT:
                self._flush(c)
            elif not c.pending:
                self.unflushed.discard(c)
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and fd in self.conns:
                try:
                    data = c.sock.recv(1)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    self._lose(c, f"connection failed: {e.strerror or e}")
                    continue
                if not data:
                    self._lose(c, "connection closed")

    def pop_ready(self) -> list[tuple[int, int]] | None:
        """The events the last wait saw, not read yet (None: none seen; an empty list: an
        awaited wait's reader callback read them), and forget them."""
        ready, self._ready = self._ready, None
        return ready

    @property
    def failed(self) -> bool:
        """Whether a reader callback met an error that the next drain raises."""
        return self._error is not None

    def read_expected(self, ready: list[tuple[int, int]], left: dict[int, None],
                      raw: dict[int, bytearray], group_id: int, kind: int, seq: int,
                      rnd: int, op: int, root: int,
                      sink: Callable[[w.Message | None], int | None]) -> bool:
        """Read the ``ready`` sockets of the senders in ``left`` the short way
        (Core._express): where a read begins with the message expected from that sender
        (``group_id``, ``kind``, ``seq``, ``rnd``, ``op``, ``root``: a collective's, or a
        point-to-point one's; pickled, no flags, no buffers) its payload, copied, goes to
        ``raw[sender]`` and the sender leaves ``left``; what comes behind it goes to
        ``sink``, as drain would hand it. False: all read so. True: it met something else
        (another descriptor, another message, a decoder holding part of one, the end of a
        connection), handed that read to ``sink`` or lost the connection, and left the
        events from there on for drain."""
        conns = self.conns
        buf, view, key, me = self._rbuf, self._rview, self.key, self.me
        assert key is not None  # (set by the core: every group has one)
        for i, (fd, ev) in enumerate(ready):
            c = conns.get(fd)
            # (a connection in error is dropped, out of conns, at once: no decoder here
            # holds an error)
            if ev != _EPOLLIN or c is None or not c.inbound or c.rank not in left \
                    or c.paused or c.decoder.buf or c.decoder._lens is not None:  # type: ignore[union-attr]
                self._ready = ready[i:]  # not what this path reads
                return True
            s = c.rank
            try:
                got = c.sock.recv_into(buf, c.rsize)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                self._lose(c, f"connection failed: {e.strerror or e}")
                self._ready = ready[i + 1:] or None
                return True
            if got >= _EXPRESS_SIZE:
                lead, size, mac_len, head = _EXPRESS(buf)
                at = _EXPRESS_SIZE + size
                end = at + _MAC_SIZE
                if lead == _EXPRESS_LEAD and mac_len == _EXPRESS_MAC_LEN and got >= end and \
                        head == _HEAD(_MAGIC, _VERSION, kind, op, _PICKLE, w.FLAG_MAC, s,
                                      group_id, seq, rnd, root, 0) and \
                        _MAC_OK(key, view[:at], view[at:end], me):
                    raw[s] = buf[_EXPRESS_SIZE:at]  # (a copy: buf is read into again)
                    del left[s]
                    if got == end:
                        continue
                    # more came behind it (a peer a call ahead, say): the general way
                    self._take(c, got, sink, end)
                    self._ready = ready[i + 1:] or None
                    return True
            if got == 0:
                self._lose(c, "connection closed")
            else:
                self._take(c, got, sink)  # not the message expected
            self._ready = ready[i + 1:] or None
            return True
        return False

    def _take(self, c: _Conn, got: int, sink: Callable[[w.Message | None], int | None],
              start: int = 0) -> None:
        """Hand what a read of ``c``, an identified inbound connection, put in the receive
        buffer (its bytes ``start`` to ``got``) to ``sink``, the way :meth:`drain` does
        (read_expected read it, expecting another message, or took a message from its
        start)."""
        dec: w.StreamDecoder = c.decoder  # type: ignore[assignment]  # (inbound)
        try:
            msgs = dec.messages(self._rbuf, got, self.key, self.me) if not start else \
                dec.messages(bytes(self._rview[start:got]), got - start, self.key, self.me)
        except WireError:
            self._count("malformed_stream")
            self._drop_conn(c)
            return
        self._deliver(c.rank, msgs, sink)  # type: ignore[arg-type]  # (identified)
        if dec.error is not None:
            self._count("malformed_stream")
            self._drop_conn(c)

    def wait(self, timeout: float) -> None:
        """Sleep until a socket is ready, :meth:`wake` is called or ``timeout`` seconds pass."""
        # the next drain handles these events instead of asking epoll again
        self._ready = self.ep.poll(min(max(timeout, 0.0), MAX_POLL_S)) or None

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
            if _turn_due(self):
                await _unheld(self, asyncio.sleep(0))
            return
        if self.spare_cpu:
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
            xtake = self.xtake
            if xtake is not None:
                # the call reads what it expects (Core._express: read_expected, which
                # leaves in self._ready what drain must still see)
                self._ready = None
                if not xtake(ready):
                    return  # its step is not complete yet: it sleeps on
            else:
                self._ready = ready
            if self._ready:
                try:
                    self.drain(self.sink)
                except Exception as e:  # not expected; the woken call's next drain raises it
                    self._error = e
                else:
                    self._ready = []  # read: the woken call need not ask epoll again
            else:
                self._ready = []
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

    def close(self, gone: Collection[int] = ()) -> None:
        """Close every socket; unsent data goes on in a short-lived thread (like a linger).
        (``gone``: as ZmqEndpoint.close's; here a connection to a gone peer fails at once.)"""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._pid:
            # a forked child: the sockets are the parent's, whose streams go on; only this
            # process's descriptors go (no flush: what the parent queued is the parent's)
            for c in (*self.conns.values(), *self.out.values()):
                c.sock.close()
            for s in (self.lsock, self.usock):
                if s is not None:
                    s.close()
            self.ep.close()
            self.bell.close()
            return
        fut = self._waiter
        if fut is not None and not fut.done():
            # a call waiting in another task (or in this thread's loop, under a signal
            # handler) looks again: woken through its loop's own wake-up, which a plain
            # set_result is not (the loop slept on in its selector until its next timer)
            try:
                fut.get_loop().call_soon_threadsafe(_wake_waiter, fut)
            except RuntimeError:  # its loop is closed (the task will never run again)
                pass
        handed = self._unwatch(closing=True)  # (the loop's thread closes the epoll then)
        for c in self.out.values():
            if c.pending and not c.connecting and c.sock.fileno() >= 0:
                self._flush(c)
        left = [c for c in self.out.values() if c.pending and c.sock.fileno() >= 0]
        for c in list(self.conns.values()):
            if c not in left:
                self._drop_conn(c)
        self.direct.clear()
        self.lsock.close()
        if self.usock is not None:
            self.usock.close()
        if not handed:
            self.ep.close()
        self.bell.close()
        if left:
            # not a daemon: a process that exits right after close() still delivers its last
            # messages (for at most LINGER_MS), as ZeroMQ's context termination does
            threading.Thread(target=_linger, args=(left,), daemon=False,
                             name="ctrlcomm-linger").start()


def _wake_waiter(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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
    forked child's registry starts empty). Before, a rank that returned with its group
    unclosed lost what was still queued for its peers (they saw it "gone")."""
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
        c.sock.setblocking(True)
        try:
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
                c.sock.close()


def make_endpoint(transport: str, bind_host: str,
                  on_lost: Callable[[int, str, bool], None] | None = None,
                  zmq_context: Any = None, encrypt: bool = False) -> TcpEndpoint | ZmqEndpoint:
    if transport == "tcp":
        return TcpEndpoint(bind_host, on_lost=on_lost)
    if transport == "zmq":
        return ZmqEndpoint(bind_host, on_lost=on_lost, zmq_context=zmq_context, encrypt=encrypt)
    raise ValueError(f"unknown transport {transport!r}")


# ------------------------------------------------------------------------- liveness


# A silent same-host peer that used at least this share of a CPU since the last look runs
# (Heartbeat.running). One long C call uses a whole CPU, or its share of one where processes
# outnumber CPUs; a hung process's threads waiting for the GIL use about 0.1%.
RUNNING_CPU_SHARE = 0.05
# running() judges a process by its CPU time over at least RUNNING_WINDOW_S (its CPU times
# move in ticks of 1/CLK_TCK s); a look older than RUNNING_STALE_S starts a new window.
RUNNING_WINDOW_S = 0.2
RUNNING_STALE_S = 2.0
try:
    _CLK_TCK = float(os.sysconf("SC_CLK_TCK"))  # the unit of CPU times in /proc
except (AttributeError, OSError, ValueError):
    _CLK_TCK = 100.0


class Heartbeat:
    """Tells peers this process is alive, and notes when each peer last said so.

    A daemon thread sends one small UDP datagram per peer every ``interval`` seconds and
    records the peers' datagrams. It runs beside the caller's thread, so a rank that is busy
    elsewhere, or idle, still answers; a process that is stopped (SIGSTOP), hung with the GIL
    held, or cut off from the network falls silent. The cost is one datagram per peer per
    interval and one wake-up per interval.

    The thread needs the GIL: while a long C call holds it, the process sends nothing and
    reads nothing. Two things keep that from being taken for a lost peer: a check reads the
    heartbeats waiting in the socket first (:meth:`catch_up`), and a silent peer on this host
    (the same kernel, network and PID namespace) whose process runs is waited for a while
    longer; a stopped, exited or hung one is lost (:meth:`running`).

    Datagram: group id (8 bytes), sender rank (4 bytes), beat number (8 bytes: 1, 2, 3...),
    then a MAC, with the group's key, of those and of the rank it is sent to (a forged
    heartbeat could otherwise hide a dead peer). A beat whose number is not above the last
    one taken from its sender is dropped: a recorded heartbeat replayed, to its rank or to
    another, cannot hide a stopped peer either. (``key`` may be given once the group is
    formed, before :meth:`start`: the socket's port is part of the address a rank publishes.)
    """

    FMT = struct.Struct("<QIQ")

    def __init__(self, bind_host: str, group_id: int, rank: int, key: bytes | None,
                 interval: float) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        _dual_stack(self.sock, bind_host)
        self.sock.bind((bind_host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.group_id, self.rank, self.key, self.interval = group_id, rank, key, interval
        self.sock.settimeout(interval)  # (non-blocking at the OS level: see catch_up)
        self.peers: dict[int, tuple[str, int]] = {}
        self.procs: dict[int, tuple[int, int]] = {}  # same-host peers: (pid, start time)
        self._cpu_seen: dict[int, tuple[float, float]] = {}  # their (time, CPU s) last looked
        self._running: dict[int, bool] = {}  # what the last look over a window found
        self.last_seen: dict[int, float] = {}
        self.beats: dict[int, int] = {}  # the number of the last beat taken from each peer
        self.dropped: dict[str, int] = {}  # datagrams dropped, by reason (Group.stats)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mac(self, body: bytes, dst: int) -> bytes:
        assert self.key, "a heartbeat's key is set before it starts"
        return hashlib.blake2b(b"hb" + body + struct.pack("<q", dst), key=self.key,
                               digest_size=16).digest()

    def datagram(self, dst: int, n: int) -> bytes:
        """Beat number ``n`` of this rank, for rank ``dst``."""
        body = self.FMT.pack(self.group_id, self.rank, n)
        return body + self._mac(body, dst)

    def start(self, peers: dict[int, tuple[str, int]],
              procs: dict[int, tuple[int, int]] | None = None) -> None:
        """Start beating to ``peers`` (``{rank: (host, udp port)}``); ``procs``: the
        same-host ones' ``(pid, start time)`` (:func:`same_host_procs`)."""
        if self.sock.family == socket.AF_INET6:
            # (bound to "::", every interface, both families: an IPv4 peer is sent to as
            # ::ffff:a.b.c.d; sendto an IPv4 address failed, unseen, and the peer found this
            # rank silent)
            peers = {r: (f"::ffff:{h}" if _numeric(h) and ":" not in h else h, p)
                     for r, (h, p) in peers.items()}
        self.peers = dict(peers)
        self.procs = dict(procs or {})
        now = time.monotonic()
        self.last_seen = dict.fromkeys(peers, now)  # grace: a new group counts as seen
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ctrlcomm-heartbeat:{self.rank}")
        self._thread.start()

    def _run(self) -> None:
        next_send = 0.0
        n = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                n += 1
                for dst, addr in self.peers.items():
                    try:
                        self.sock.sendto(self.datagram(dst, n), addr)
                    except OSError:
                        pass  # unreachable now; the peer's silence is what we report
                next_send = now + self.interval
            try:
                # (in the try too: close() closes the socket after waiting a second for this
                # thread, which a starved process may not have run by then)
                self.sock.settimeout(max(next_send - time.monotonic(), 0.001))
                data = self.sock.recv(64)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            self._accept(data)

    def _drop(self, why: str) -> None:
        why = "heartbeat_" + why
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _accept(self, data: bytes) -> None:
        n = self.FMT.size
        if len(data) != n + 16:
            if data or not self._stop.is_set():  # (not close()'s wake-up)
                self._drop("malformed")
            return
        gid, src, beat = self.FMT.unpack_from(data)
        if gid != self.group_id or src not in self.peers:
            self._drop("other_group" if gid != self.group_id else "bad_src")
            return
        if not hmac.compare_digest(self._mac(data[:n], self.rank), data[n:]):
            self._drop("unauthenticated")
            return
        if beat <= self.beats.get(src, 0):  # a replay (or one overtaken on the way)
            self._drop("replayed")
            return
        self.beats[src] = beat
        self.last_seen[src] = time.monotonic()

    def catch_up(self) -> None:
        """Read the heartbeats waiting in the socket now. The thread reads them too, but not
        while a long C call of this process held the GIL: they wait in the socket then, and a
        check right after that call would find every peer silent. (At most a few per peer:
        datagrams anyone keeps sending cannot hold the caller here.)"""
        for _ in range(64 + 4 * len(self.peers)):
            fd = self.sock.fileno()
            if fd < 0:  # closed
                return
            try:
                # os.read, not recv: a socket with a timeout polls before it reads, and the
                # thread may take the datagram in between (the descriptor is non-blocking)
                data = os.read(fd, 64)
            except OSError:  # none left (EAGAIN), or closed
                return
            self._accept(data)

    def running(self, rank: int) -> bool | None:
        """Whether silent peer ``rank`` is a process of this host that runs, as while one long
        C call holds its GIL and so keeps its heartbeat thread from sending: it used at least
        :data:`RUNNING_CPU_SHARE` of a CPU over the last window (RUNNING_WINDOW_S at least; a
        look within one answers what the last window found). False for a peer elsewhere, a
        process that is stopped (SIGSTOP), has exited, or used less (hung: its threads wait,
        the ones waiting for the GIL wake for a few microseconds every 5 ms). None on a first
        look at a process that is neither stopped nor gone: look again shortly."""
        p = self.procs.get(rank)
        if p is None:
            return False
        pid, start = p
        try:
            fields = _proc_stat(f"/proc/{pid}/stat")
            if int(fields[19]) != start:
                return False  # that process is gone; another has its pid
            if fields[0] in (b"T", b"t", b"Z", b"X"):
                return False  # stopped (or traced), or exited
            cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # user + system, all threads
        except (OSError, ValueError, IndexError):
            return False
        now = time.monotonic()
        before = self._cpu_seen.get(rank)
        if before is None or now - before[0] > RUNNING_STALE_S:
            self._cpu_seen[rank] = (now, cpu)
            self._running.pop(rank, None)
            return None
        if now - before[0] < RUNNING_WINDOW_S:
            # CPU times move in ticks (10 ms): looks closer than this cannot tell a running
            # process from a hung one (a busy loop of calls looks again and again): what the
            # last window found (stopped or gone, seen above, at once)
            return self._running.get(rank)
        self._cpu_seen[rank] = (now, cpu)
        runs = self._running[rank] = cpu - before[1] >= RUNNING_CPU_SHARE * (now - before[0])
        return runs

    def silent_for(self, rank: int, now: float) -> float:
        """Seconds since ``rank`` was last heard from (0 for unknown ranks)."""
        seen = self.last_seen.get(rank)
        return 0.0 if seen is None else now - seen

    def close(self) -> None:
        self._stop.set()
        try:  # wake the thread out of recv at once
            self.sock.sendto(b"", self.sock.getsockname()[:2])
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self.sock.close()
