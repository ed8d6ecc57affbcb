"""The store's server: a :class:`~ctrlcomm.rendezvous.StoreState` run on a socket in a daemon
thread. Without a key it serves plain TCP (``_StoreTcp``: every limit of
:class:`~ctrlcomm.rendezvous.StoreLimits` enforced as bytes come); with one, ZeroMQ's ROUTER
with CurveZMQ."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.utils.z85

from .. import _wire as w
from .._errors import CtrlcommError, WireError
from ..transport._net import (
    BIND_LOOKUP_S,
    HANDSHAKE_FAILED,
    _bind_error,
    _bind_host,
    _bind_os_error,
    _close_monitor,
    _curve_server,
    _dual_stack,
    _handshakes_failed,
    _interface_address,
    _is_v6,
    _keepalive,
    _monitor,
    _numeric,
    _poll_ms,
    _store_curve,
    _tcp,
    context,
    store_curve_keys,
    warn_if_unkeyed,
)
from ._conn import NULL_GREETING, STORE_READ

_released: dict[tuple[str, int], float] = {}


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
        from ._state import StoreLimits, StoreState

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
STORE_OUT_MAX = w.STORE_MAX_FRAME * 2


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
