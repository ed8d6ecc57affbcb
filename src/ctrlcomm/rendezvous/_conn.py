"""A store client's connection to its server: :class:`StoreStream` (plain TCP, the default)
and :class:`StoreConnection` (ZeroMQ DEALER, keyed stores), both with request ids so that a
late reply to a timed-out request is recognised and dropped; a ZMTP greeting is read to tell
the two kinds of server apart."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.utils.z85

from .. import _wire as w
from .._errors import StoreError, WireError
from ..transport._net import (
    KEYED_STORE,
    MAX_POLL_MS,
    MAX_POLL_S,
    _close_monitor,
    _curve_client,
    _handshakes_failed,
    _is_v6,
    _monitor,
    _parse_tcp,
    _store_curve,
    _tcp,
    context,
    store_curve_keys,
)

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
                    self._look_at_greeting(deadline - now)
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
            if self.sock in ready:
                rep = self._reply(req)
                if rep is not None:
                    return rep

    def _look_at_greeting(self, left: float) -> None:
        """(A request unanswered.) A store without a key (which its greeting names) never
        completes a keyed client's handshake, nor a store with one (or with encryption) a
        client's without: raise that where the greeting says so."""
        assert self._probe is not None
        keyed = bool(self.key)
        mechanism = _zmtp_mechanism(*self._probe, min(PROBE_S, left), null=not keyed)
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
            self._probe = None  # (the store runs as this client does, or, where keyed,
            # with another key, or none yet)

    def _reply(self, req: w.StoreRequest) -> w.StoreReply | None:
        """What the socket holds: ``req``'s reply, or None (a stale or garbled one)."""
        got = self.sock.recv_multipart()  # (not into frames: a resend sends those)
        try:
            rep = w.decode_store_reply(got[1:], self.key)
        except WireError:
            if self.key and _plain_reply(got[1:], req.req_id):
                # (where CurveZMQ is missing, and a keyed client's store runs plain)
                raise StoreError(f"the store at {self.addr} answers without "
                                 "authentication: it runs without this group's auth_key"
                                 ) from None
            return None
        return rep if rep.req_id == req.req_id else None

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
                    self._pause(deadline)  # (refused, or unreachable: again shortly)
                    continue
                sent = False
            sock = self.sock
            assert sock is not None
            if not sent:
                sent = self._send_all(sock, data, deadline - now)
                if not sent:
                    continue
            if self._readable(sock, deadline):
                rep = self._take(sock, req, deadline)
                if rep is not None:
                    return rep

    def _pause(self, deadline: float) -> None:
        if self._sleep(min(STORE_RETRY_S, deadline - time.monotonic())):
            raise self._closed_error()

    def _send_all(self, sock: socket.socket, data: bytes, left: float) -> bool:
        try:
            sock.setblocking(True)
            sock.settimeout(max(left, 0.001))
            sock.sendall(data)
            sock.setblocking(False)
            return True
        except OSError:  # (its end, or a send that timed out: the deadline)
            self._drop()
            return False

    def _readable(self, sock: socket.socket, deadline: float) -> bool:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._bell_r, select.POLLIN)
        wait = min(deadline - time.monotonic(), MAX_POLL_S)
        ready = dict(poller.poll(max(1, int(wait * 1000))))
        if self.rung or self._bell_r in ready:
            raise self._closed_error()
        return sock.fileno() in ready

    def _take(self, sock: socket.socket, req: w.StoreRequest, deadline: float
              ) -> w.StoreReply | None:
        """Read what ``sock`` holds: ``req``'s reply, or None (not yet; or the connection
        dropped, to be made again)."""
        dec = self._dec
        assert dec is not None
        try:
            got = sock.recv(STORE_READ)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            got = b""
        if not got:
            self._drop()
            return None
        if not dec.pending() and got[:1] == b"\xff":  # ZMTP's signature
            self._drop()
            self._zmtp_store(deadline)
            return None
        try:
            msgs = dec.feed(got)
        except WireError:
            self._drop()
            return None
        for frames in msgs:
            try:
                rep = w.decode_store_reply(frames)
            except WireError:
                continue
            if rep.req_id == req.req_id:
                return rep
        return None

    def _zmtp_store(self, deadline: float) -> None:
        """A ZeroMQ store (one with a key) greets first; looked at again, with a NULL
        client's greeting, which such a store counts (rank 0 then says a rank without the
        key came). Not one: a port that is not a store's (again shortly)."""
        if _zmtp_mechanism(*self._where, min(PROBE_S, deadline - time.monotonic()),
                           null=True) not in (None, b"NULL"):
            raise StoreError(f"the store at {self.addr} runs with an auth_key, or "
                             "encryption, and this client has neither: it answers "
                             "nothing unauthenticated")
        self._pause(deadline)

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
# A TCP store's reads, and what it queues for one client at most (a client that takes none
# of its replies is disconnected past it)
STORE_READ = 65536
