"""The only module that touches sockets (ZeroMQ and the OS).

- :class:`Endpoint`: a rank's inbound PULL socket, bound on one interface, plus one PUSH socket
  per peer it sends to (created on first use). ZeroMQ queues sends in its I/O thread, so a
  send never waits for the peer; per pair of ranks, messages arrive in the order sent.
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
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from . import _wire as w
from ._errors import CtrlcommError, StoreError, WireError

_ctx: zmq.Context[Any] | None = None
_ctx_pid = -1
_ctx_lock = threading.Lock()

# Outgoing messages may wait this long for delivery after close (in ZeroMQ's I/O thread; the
# caller never blocks), so a group's last messages reach peers even if it closes at once.
LINGER_MS = 5000
HWM = 100_000
COPY_THRESHOLD = 65536


def context() -> zmq.Context[Any]:
    """The process's ZeroMQ context (one I/O thread), made anew after a fork."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx_pid != os.getpid():
            _ctx = zmq.Context(io_threads=1)
            _ctx.setsockopt(zmq.MAX_SOCKETS, 65536) if hasattr(zmq, "MAX_SOCKETS") else None
            _ctx_pid = os.getpid()
        return _ctx


def local_address_for(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent)."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def _tcp(host: str, port: int | str) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def _is_v6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")


def check_bind_host(host: str) -> None:
    """Raise for an address that is not this machine's (before ZeroMQ reports it obscurely)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        socket.getaddrinfo(host, None)


def _bind_error(e: zmq.ZMQError, what: str, addr: str) -> CtrlcommError:
    if e.errno == zmq.EADDRINUSE:
        return StoreError(f"cannot bind {what} on {addr}: address already in use")
    return StoreError(f"cannot bind {what} on {addr}: {e}")


class Endpoint:
    """A rank's sockets in one group."""

    def __init__(self, bind_host: str, *, ipv6: bool = False) -> None:
        ctx = context()
        self.rx = ctx.socket(zmq.PULL)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.setsockopt(zmq.RCVHWM, HWM)
        self.rx.setsockopt(zmq.MAXMSGSIZE, 1 << 34)
        if ipv6 or ":" in bind_host:
            self.rx.setsockopt(zmq.IPV6, 1)
        addr = _tcp(bind_host, "*")
        try:
            self.rx.bind(addr)
        except zmq.ZMQError as e:
            self.rx.close(0)
            raise _bind_error(e, "group socket", addr) from None
        self.address: str = self.rx.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.fd: int = self.rx.getsockopt(zmq.FD)
        self.peers: dict[int, str] = {}
        self.tx: dict[int, zmq.Socket[Any]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.rx, zmq.POLLIN)
        self.closed = False

    def set_peers(self, peers: dict[int, str]) -> None:
        self.peers = dict(peers)

    def _sock(self, dst: int) -> zmq.Socket[Any]:
        s = self.tx.get(dst)
        if s is None:
            s = context().socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, LINGER_MS)
            s.setsockopt(zmq.SNDHWM, HWM)
            if _is_v6(self.peers[dst]):
                s.setsockopt(zmq.IPV6, 1)
            s.connect(self.peers[dst])
            self.tx[dst] = s
        return s

    def send(self, dst: int, frames: Sequence[Any]) -> None:
        """Queue a message for ``dst``; never waits for the peer."""
        s = self._sock(dst)
        last = len(frames) - 1
        for i, f in enumerate(frames):
            big = not isinstance(f, bytes) and memoryview(f).nbytes >= COPY_THRESHOLD
            s.send(f, (zmq.SNDMORE if i < last else 0) | zmq.DONTWAIT, copy=not big)

    def drain(self, sink: Callable[[list[Any]], None], limit: int = 1 << 30) -> int:
        """Receive every message waiting now and hand each to ``sink``. Returns the count."""
        n = 0
        rx = self.rx
        while n < limit:
            try:
                frames = rx.recv_multipart(zmq.DONTWAIT)
            except zmq.Again:
                break
            n += 1
            sink(frames)
        return n

    def wait(self, timeout: float) -> None:
        """Sleep until a message may be waiting or ``timeout`` seconds pass."""
        self._poller.poll(max(0, int(timeout * 1000 + 0.999)))

    async def wait_async(self, timeout: float) -> None:
        """Like :meth:`wait`, through the running event loop (other coroutines keep running)."""
        if self.rx.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(self.fd, wake)
        timer = loop.call_later(max(timeout, 0.0), wake)
        try:
            await fut
        finally:
            timer.cancel()
            loop.remove_reader(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rx.close(0)
        for s in self.tx.values():
            s.close()  # LINGER_MS: queued messages still go out, in ZeroMQ's I/O thread
        self.tx.clear()


class StoreConnection:
    """One client connection to a store."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = _tcp(host, port)
        if _is_v6(self.addr):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(self.addr)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    def request(self, req: w.StoreRequest, deadline: float) -> w.StoreReply | None:
        """Send ``req`` and wait for its reply until ``deadline``; ``None`` on timeout."""
        self.sock.send_multipart([b"", *w.encode_store_request(req)], zmq.DONTWAIT)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poller.poll(max(1, int(left * 1000))):
                if time.monotonic() >= deadline:
                    return None
                continue
            frames = self.sock.recv_multipart()
            try:
                rep = w.decode_store_reply(frames[1:])
            except WireError:
                continue
            if rep.req_id == req.req_id:
                return rep

    def close(self) -> None:
        self.sock.close(0)


class StoreServer:
    """A rendezvous store served from a daemon thread of this process.

    Args:
        host: address to bind (``"0.0.0.0"`` binds every interface: an explicit opt-in).
        port: port to bind; 0 picks a free one (see :attr:`port`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        from ._store import StoreState

        ctx = context()
        self.host = host
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        addr = _tcp(host, port or "*")
        if _is_v6(addr):
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            self.sock.bind(addr)
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise _bind_error(e, "store", _tcp(host, port)) from None
        self.port = int(self.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.state = StoreState()
        self.dropped = 0
        self._wake_addr = f"inproc://ctrlcomm-store-{id(self)}-{os.getpid()}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name=f"ctrlcomm-store:{self.port}",
                                         daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"StoreServer({self.host!r}, {self.port})"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        st = self.state
        try:
            while not self._stop:
                nd = st.next_deadline()
                timeout = None if nd is None else max(0, int((nd - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(timeout))
                if self._wake_rx in events:
                    break
                replies = st.expire(time.monotonic())
                if self.sock in events:
                    for _ in range(1000):
                        try:
                            frames = self.sock.recv_multipart(zmq.DONTWAIT)
                        except zmq.Again:
                            break
                        if len(frames) < 2:
                            self.dropped += 1
                            continue
                        peer = frames[0]
                        body = frames[2:] if frames[1] == b"" else frames[1:]
                        try:
                            req = w.decode_store_request(body)
                        except WireError:
                            self.dropped += 1
                            continue
                        replies += st.handle(peer, req, time.monotonic())
                for peer, rep in replies:
                    try:
                        self.sock.send_multipart([peer, b"", *w.encode_store_reply(rep)],
                                                 zmq.DONTWAIT)
                    except zmq.ZMQError:
                        st.forget_peer(peer)
        finally:
            self.sock.close(0)
            self._wake_rx.close(0)

    def close(self) -> None:
        """Stop serving (idempotent; returns at once)."""
        if self._stop:
            return
        self._stop = True
        s = context().socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self._wake_addr)
        try:
            s.send(b"", zmq.DONTWAIT)
        except zmq.ZMQError:
            pass
        s.close(0)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
