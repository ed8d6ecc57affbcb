"""Transports: the only package that touches sockets for a group's messages.

Each transport implements :class:`ctrlcomm._endpoint.Endpoint`; the group makes one with
:func:`make_endpoint` and hands it to the core, which never asks which one it has.

- ``_tcp``: :class:`TcpEndpoint` (``"tcp"``, and ``"shm"``, the default): a listening TCP
  socket bound on one interface, one outgoing connection per peer it sends to (made on first
  use), all registered in one epoll set whose descriptor both drivers wait on. Sends are
  non-blocking: what the kernel does not take at once is queued and flushed whenever the
  rank waits, so a send never waits for the peer. A connection that reaches end-of-file or
  fails tells the core at once that its peer is gone. Why not ZeroMQ here: each ZeroMQ
  message crosses two extra threads (the I/O threads of sender and receiver); on a 2-core
  machine that measured 149 us per round trip against 22 us for a plain socket, and it hides
  a dead peer behind silent reconnection.
- ``_shm``: :class:`Ring`, the shared-memory ring that carries the stream to a peer of this
  host under ``"shm"`` (the TCP endpoint's connection to it, made on its Unix socket,
  hands the ring over and then only tells its end).
- ``_zmq``: :class:`ZmqEndpoint` (``transport="zmq"``): a PULL socket bound on one interface
  plus one PUSH socket per peer. ZeroMQ queues sends in its I/O thread; per pair of ranks,
  messages arrive in the order sent.
- ``_heartbeat``: :class:`Heartbeat`, UDP datagrams that tell peers this process is alive.
- ``_base``: what both endpoints share (the bell that wakes a wait, the ``io`` hand-over of
  a suspended awaited call); ``_net``: names, addresses, this host, CurveZMQ keys.

Waiting: the blocking driver calls ``Endpoint.wait`` (the thread sleeps in the kernel); the
asyncio driver awaits ``Endpoint.wait_async``, a reader callback on the socket's file
descriptor. ZeroMQ's descriptor is edge-triggered: callers drain the socket (receive until
``EAGAIN``) before waiting again, which ``Endpoint.drain`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._endpoint import Endpoint
from ._heartbeat import Heartbeat as Heartbeat
from ._tcp import TcpEndpoint as TcpEndpoint
from ._zmq import ZmqEndpoint as ZmqEndpoint

TRANSPORTS = ("shm", "tcp", "zmq")


def make_endpoint(transport: str, bind_host: str,
                  on_lost: Callable[[int, str, bool], None] | None = None,
                  zmq_context: Any = None, encrypt: bool = False,
                  spin_us: float | None = None) -> Endpoint:
    """A new endpoint of ``transport`` bound on ``bind_host`` (a free port)."""
    if transport in ("shm", "tcp"):
        return TcpEndpoint(bind_host, on_lost=on_lost, shm=transport == "shm",
                           spin_us=spin_us)
    if transport == "zmq":
        return ZmqEndpoint(bind_host, on_lost=on_lost, zmq_context=zmq_context, encrypt=encrypt)
    raise ValueError(f"unknown transport {transport!r}")
