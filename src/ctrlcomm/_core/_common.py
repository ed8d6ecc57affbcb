"""What the core's classes share: its settings, the names of a call's parts, and the helpers
of its messages' text."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, final

from .. import _plans
from .. import _wire as w
from .._endpoint import Expected, wake_future
from .._errors import (
    CodecError,
    InvalidArgumentError,
)

# Seconds before a deadline at which a rank asks the peers it waits for what they are doing,
# so that the timeout error can say it (capped at a tenth of the timeout).
PROBE_GRACE = 0.25
# A collective that has waited this long asks the ranks it waits for which call they are in,
# and again after twice as long each time (1, 3, 7, 15... s into the call): an answer of
# another collective, or another root, at this seq is a mismatch that no message shows (an
# all_reduce here, a broadcast there), raised then instead of at the deadline.
FIRST_PROBE = 1.0
# A peer that closed the connection we send on is declared lost after this many seconds
# unless its goodbye (or the end of the stream it sends on) explains it first.
SUSPECT_GRACE = 1.0
EXIT_GRACE = 0.05  # a same-host peer seen to exit is gone this long after (Core._lost)
# A send that does not wait (a point-to-point send, a collective's step that only sends: a
# broadcast's root, a gather's leaf) reads what has come in at most this often, and looks
# whether a destination is lost: a peer's goodbye, abort or end of stream, which a wait would
# have read, and a peer silent past liveness_timeout (ZeroMQ's sends never fail)
LOOK_S = 0.1
# Before a wait raises that a peer it waits for is lost, it reads what has come in to the end
# (Core.settle), again while a read takes anything, for this long at most (what a lost peer
# sent is finite; a live one flooding meanwhile would go on: the loss is raised then)
SETTLE_S = 2.0
# How long an abort() waits for the sockets of an awaited call it finds suspended in another
# thread's loop (Core._abort_suspended: the call's thread holds them while it runs a step)
ABORT_TAKE_S = 0.1
IO_TAKE_S = 1.0  # how long a call waits for those sockets at most (see _aio.run_async)
# An abort (abort(), a cancelled or interrupted call, a lost peer or mismatch told) waits this
# long at most for connections still being made, so that its word goes out on them (a rank
# that makes no call after it would never send it)
ABORT_PUSH_S = 0.1
# A silent peer of this host whose process runs (see Heartbeat.running) is looked at again
# this often while it is waited for (sooner after a first look, which cannot tell), and is
# waited for while silent for up to RUNNING_LIMIT times liveness_timeout (a minute by
# default: a long C call holding its GIL; a thread that spins in a hung process looks the same).
RUNNING_RECHECK_S = 0.5
RUNNING_UNSURE_S = 0.25
RUNNING_LIMIT = 12
# Flow control. A rank stops reading a peer that is HOLD_HIGH collective messages ahead, and
# reads it again at HOLD_LOW; a sender with more than MAX_BACKLOG bytes queued for one peer
# waits (within its deadline) before it queues more. Memory stays bounded however far a
# broadcast root runs ahead of its receivers.
HOLD_HIGH = 256
HOLD_LOW = 64
MAX_BACKLOG = 4 * 1024 * 1024
BACKLOG_LOOK_S = 0.005  # how often a sender that waits out a backlog, not leading, looks again
RECENT = 64  # calls whose (op, root) are kept to find a mismatch after a call returned
# The flight recorder: how many of its last calls a group keeps (Group.flight_record), unless
# CTRLCOMM_FLIGHT_RECORD says otherwise (0: none)
FLIGHT_RECORD = 64
BYE_TEXT = 2000  # characters of why a group was broken, said to the peers as it closes

# A call: a generator that yields how long it waits (seconds: on the endpoint, the call
# leading; a Follower: on its own), and returns the call's result
Wait = Generator["float | Follower", None, Any]


def describe(op: int, root: int) -> str:
    name = w.OP_NAME.get(op & 0x0F, f"op{op & 0x0F}")
    red = op >> 4
    parts = [name]
    if red:
        from .._ops import NAMED_OPS

        parts.append(f"op={NAMED_OPS[red - 1]!r}" if red <= len(NAMED_OPS) else "op=<callable>")
    if root != w.NO_ROOT:
        parts.append(f"root={root}")
    return parts[0] + (f"({', '.join(parts[1:])})" if len(parts) > 1 else "")


# The plans whose every message is a rank's own object (or one per destination), a whole
# result, or a partial result that the receiver combines (a reduction's, whose combine
# passes a failure on, _ops.Failed): a failure sent in place of one reaches every rank that
# would have used it, and each raises it (Core._unsendable; a rank that sent one sends it
# in place of everything else it sends in that call, Core._post). In the others a message
# bundles parts (a tree's gather or scatter, Bruck's blocks): a failure in its place would
# break the plan.
_FAIL_IN_PLACE = frozenset({
    _plans.broadcast, _plans.broadcast_flat, _plans.gather_flat, _plans.scatter_flat,
    _plans.reduce, _plans.reduce_flat, _plans.all_reduce_flat, _plans.all_reduce_star,
    _plans.all_reduce_doubling, _plans.all_gather_flat, _plans.all_gather_star,
    _plans.all_to_all,
})

# What one message may carry, encoded (header and framing aside): a receiver drops a stream
# whose message is larger (w.MAX_MESSAGE).
MAX_PAYLOAD = w.MAX_MESSAGE - 64 * 1024


def _size(payload: Any, bufs: tuple[Any, ...]) -> int:
    """The bytes of an encoded object: its payload and out-of-band buffers."""
    return memoryview(payload).nbytes + sum(memoryview(b).nbytes for b in bufs)


def _check_size(payload: Any, bufs: tuple[Any, ...]) -> None:
    size = _size(payload, bufs)
    if size > MAX_PAYLOAD:
        raise CodecError(f"the object is {size / 2**30:.2f} GiB encoded ({size:,} bytes), more "
                         f"than a message carries ({MAX_PAYLOAD:,} bytes): send it in parts")


def _op_of(name: str) -> str:
    """The operation a call's name in errors names: ``recv`` of ``recv(src=1, tag=3)``,
    ``all_reduce`` of ``all_reduce (sending)``, ``recv_obj`` of ``recv_obj(src=0)``."""
    return name.split("(", 1)[0].split(" ", 1)[0]


def _send_name(what: str, dst: Any, tag: int) -> str:
    """A send's name in its errors: ``what``, or ``send(dst=..., tag=...)`` (made only where
    it is needed: not on the usual send's path)."""
    return what or f"send(dst={dst}, tag={tag})"


def _undecodable(m: w.Message, what: str, seq: int | None, e: Exception) -> CodecError:
    where = what if seq is None else f"{what} #{seq}"
    return CodecError(f"{where}: cannot decode the object from rank {m.src}: "
                      f"{type(e).__name__}: {e}")


class Call(NamedTuple):
    """A collective to run: its plan is called as ``plan(ctx, *args)``."""

    name: str
    plan: Callable[..., _plans.Plan]
    args: tuple[Any, ...]
    opcode: int
    root: int = w.NO_ROOT
    reduces: bool = False  # the result may be or hold an _ops.Failed, raised by the caller


_monotonic = time.monotonic
_get_ident = threading.get_ident
_running_loop = asyncio._get_running_loop  # (None in a blocking call)
_ploads = w._ploads  # the usual payload is decoded in line (w.loads without its call)
_NONE_LOST: list[int] = []  # never changed (no rank lost; not waiting for any)
_first_pass = w.first_pass  # the usual object's encoding (Core._post)
_COLL, _PICKLE = w.COLL, w.PICKLE


class Active(NamedTuple):
    """The call a group is in: its name, its number (-1: a point-to-point call), and its
    opcode and root (a collective's)."""

    name: str
    seq: int
    op: int
    root: int


class Past(NamedTuple):
    """A collective as a rank made it (or said it made it): its number, opcode and root."""

    seq: int
    op: int
    root: int


class PointWait:
    """A point-to-point call that waits (a recv; a send waiting out a backlog): its place in
    the line of its (src, tag) and what its waits keep (as a collective keeps them on the
    core: Core._wait's ``st``)."""

    __slots__ = ("name", "waiting_for", "since", "tag", "loop", "_probed", "_looked",
                 "_settle_until")

    def __init__(self, name: str, waiting_for: list[int], since: float = 0.0,
                 tag: int = 0) -> None:
        self.name = name
        self.waiting_for = waiting_for
        # (for the flight recorder: when the call began, monotonic, and its tag)
        self.since = since
        self.tag = tag
        self.loop = _running_loop()  # (an awaited call's: None for a blocking one)
        self._probed = self._looked = False
        self._settle_until = 0.0

    def gone(self) -> bool:
        """Whether it is an awaited call of an event loop closed with it pending (a loop
        driven by hand: asyncio.run cancels its tasks): it will never resume."""
        return self.loop is not None and self.loop.is_closed()


@final
class Follower:
    """A wait of a call that does not lead (see the package's docstring): yielded to the
    driver in place of seconds, it sleeps on its own until ``delay`` passes or another call
    wakes it (:meth:`wake`, holding ``io``). The driver gives it what it sleeps on (an event,
    or a future of its loop) before it lets ``io`` go, so that no wake-up is lost."""

    __slots__ = ("delay", "event", "loop", "fut")

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.event: threading.Event | None = None
        self.loop: Any = None
        self.fut: Any = None

    def wake(self) -> bool:
        """Wake it; False where its loop is closed (nobody waits there any more)."""
        ev = self.event
        if ev is not None:
            ev.set()
        elif self.fut is not None:
            try:
                self.loop.call_soon_threadsafe(wake_future, self.fut)
            except RuntimeError:
                return False
        return True


# The longest a follower sleeps at once: it looks again whether the lead's holder can still
# read for it (Core.lead), and sleeps on
FOLLOW_LOOK_S = 1.0


class Said(NamedTuple):
    """What a peer answered it was doing, and the number of this rank's call when it came."""

    seq: int
    text: str


# What no step waits for (between steps and calls): nothing is ever added to it
NO_STEP = Expected({}, {}, -1, _COLL, -1, 0, 0, 0)
# A named tuple made without its Python-level __new__: the core makes a few per call, and
# that __new__ would cost more than the rest of making them
_new = tuple.__new__


# The drivers' code objects (each driver adds its own): a frame of one of them whose ``core``
# is a group's core is a call of that group in progress (Core._in_call).
DRIVER_CODES: set[Any] = set()


def flight_record_size() -> int:
    """How many calls a group's flight recorder keeps: ``CTRLCOMM_FLIGHT_RECORD``, else
    FLIGHT_RECORD."""
    text = os.environ.get("CTRLCOMM_FLIGHT_RECORD", "").strip()
    if not text:
        return FLIGHT_RECORD
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise InvalidArgumentError(
            f"CTRLCOMM_FLIGHT_RECORD must be a number of calls >= 0 (0: none), got {text!r}")
    return n


def said(e: BaseException, limit: int = 300) -> str:
    """An error as a flight record tells it: its class and the start of its message."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
