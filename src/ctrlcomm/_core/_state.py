"""The state every part of the core shares, made once (each part's class below says what of it
is its own): the chain _CoreState <- _Sending <- _Session <- _Mismatch <- _Liveness <-
_Mailbox <- Core, each part calling only those below it."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, cast

from .. import _ops, _plans
from .. import _wire as w
from .._endpoint import (
    Endpoint,
    ExpressEndpoint,
    Liveness,
    StreamEndpoint,
)
from .._errors import (
    CtrlcommError,
    MismatchError,
)
from .._lifecycle import OPEN
from ._common import (
    NO_STEP,
    RECENT,
    Active,
    Follower,
    Past,
    PointWait,
    Said,
    _op_of,
    flight_record_size,
)


class _CoreState:
    """A group's core, as it is made: its settings and its state."""

    def __init__(self, *, name: str, rank: int, size: int, group_id: int,
                 endpoint: Endpoint,
                 codec: int, key: bytes, timeout: float,
                 heartbeat: Liveness | None = None,
                 liveness_timeout: float | None = None) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.group_id = group_id
        self.ep = endpoint
        self.codec = codec
        # a data-only group never unpickles, whatever codec a message's header names
        self._unpickle = codec == w.PICKLE
        if not key:
            raise ValueError("a group's core needs its MAC key (made at formation)")
        self.key = key
        self.timeout = timeout
        self.seq = 0  # next collective's sequence number
        # the seq, and (opcode, root), of the collective in progress (-1: none): a message of
        # that seq with another opcode or root is a mismatch, and one of an earlier seq (of
        # a seq below self.seq when there is none) is stale
        self._cur_seq = -1
        self._cur_call = (0, 0)
        self._peers = frozenset(range(size)) - {rank}  # the ranks a message may come from
        # collective messages: seq -> {(round, src): message}; held[src] counts them per sender
        self.box: dict[int, dict[tuple[int, int], w.Message]] = {}
        # a plain dict, one entry per rank (a Counter, a dict subclass, is read and written
        # the slow way: this is counted twice per message)
        self.held: dict[int, int] = dict.fromkeys(range(size), 0)
        self.paused: set[int] = set()
        self.p2p: dict[tuple[int, int], deque[w.Message]] = {}
        # what this rank sent itself, per tag: encoded (a copy, as a peer gets), in order
        self.to_self: dict[int, deque[tuple[Any, tuple[Any, ...]]]] = {}
        self._failed_seq = -1  # the last collective that raised here (see _run_deferred)
        self.p2p_in: dict[int, int] = {}  # next point-to-point number expected per sender
        self.p2p_out: dict[int, int] = {}  # next number to send per destination
        # what a peer answered it was doing, in words, and this rank's self.seq then (an
        # answer read in an earlier call is not shown as the peer's state now)
        self.status: dict[int, Said] = {}
        # what a peer's answer said of the collective it is in or returned from last:
        # (seq, opcode, root)
        self.status_call: dict[int, Past] = {}
        # the peers whose last answer said they are in a collective (not returned from it):
        # its seq
        self.status_in_call: dict[int, int] = {}
        self.gone: dict[int, str] = {}  # peers known closed / lost / aborted, with why
        # those of them declared gone on silence (heartbeats, a grace that ran out), not on
        # a word or the end of their stream: a goodbye read later says why better
        self._guessed: set[int] = set()
        # those of them that aborted, not known closed: still there, and told goodbye (an
        # aborted rank's own goodbye to a rank closed already lingered: 5 s at its exit)
        self.aborters: set[int] = set()
        # those of them gone by another rank's word only (an ABORT_LOST report)
        self.reported: set[int] = set()
        self.suspects: dict[int, tuple[float, str]] = {}  # peer -> (grace ends, why)
        self.dropped: Counter[str] = Counter()
        self.sent = 0
        self.received = 0
        self.state = OPEN
        self.cause: BaseException | None = None
        self.active: Active | None = None
        self.waiting_for: list[int] = []
        # the error the call in progress raises at its next look (a mismatch, or a peer's
        # abort of this call: see _fail_call)
        self.mismatch: CtrlcommError | None = None
        # this rank's object the current collective could not send (sent in its place)
        self._send_failed: _ops.Failed | None = None
        # the messages the collective's step in progress waits for: the mailbox takes a
        # sender out of it as its message comes, the endpoint's drain too where it takes one
        # the short way (an ExpressEndpoint's ``expect``, while the collective leads)
        self.step = NO_STEP
        # the message the recv that leads waits for, where it is first in its line (it is
        # the endpoint's ``expect`` then): the mailbox's count of its sender's numbers
        # looks at what the short way took of it
        self.pstep = NO_STEP
        self._in_place = False  # whether the current collective can send a failure so
        self.last: tuple[str, int | None] = ("nothing yet", None)
        # Calls run at once (see the package's docstring). The endpoint's ``io`` is held by
        # whichever runs (never across a wait). ``_lock`` is the lead: held by the one call
        # that sleeps on the endpoint and reads it (taken as a call starts where it is free,
        # else as it next waits), or by close() and abort() doing their part; the others
        # (``_followers``) sleep on their own, woken by the leader after each read.
        self._lock = threading.Lock()
        self._holder = 0  # the thread whose call last took the lead (0: close or abort did)
        # the lead's number, counted each time it is taken: the call that took it gives it
        # up only while it is still its own (it is taken over from an awaited call whose
        # event loop was closed with it pending: Core.lead)
        self._lead_n = 0
        self._lead_loop: asyncio.AbstractEventLoop | None = None  # (its awaited holder's)
        self._asleep = False  # whether the leader is in a wait (the endpoint is its)
        self._followers: list[Follower] = []
        # the recvs waiting, in the order they were called, per (src, tag): the first
        # takes the next message
        self._lines: dict[tuple[int, int], list[PointWait]] = {}
        self._owner = ""  # the collective in progress (one at a time), by name
        # (called as a collective starts: an awaited collective waiting for the sockets, in
        # another thread's loop, then gives up: _aio._take_io)
        self._nudge = endpoint.io.nudge
        self._io_waiters = endpoint.io.waiters  # (the same list for the endpoint's life)
        # awaited collectives of one event loop take turns (run_async): at key 0, the
        # (thread, loop) whose awaited collective has the turn (none: none has; taken with
        # setdefault, which no other thread can interleave), and the futures of those
        # queued behind it (of that loop only), first come first
        self._turn: dict[int, tuple[int, asyncio.AbstractEventLoop]] = {}
        self._turns: deque[asyncio.Future[None]] = deque()
        # why the group breaks once the turn's holder has ended: a collective queued behind
        # it gave up (cancelled, timed out) before it began (cancelled_before_it_began)
        self._owed = ""
        # what close() and abort() asked for while a call held the group ("close", "") or
        # ("abort", reason): the sockets are used by the thread holding the group only, so
        # that thread does it, woken at once (see _defer)
        self._deferred: list[tuple[str, str]] = []
        # recent collectives (their Active record: seq, opcode, root), by seq % len: a message
        # of a call that returned here, from a rank that called something else, is a
        # mismatch found late
        self._recent: list[Active] = [Active("", -1, 0, 0)] * RECENT
        # the flight recorder: this rank's last calls, each (name, seq, peer, tag, start,
        # end, error, sent, received, bytes sent, bytes received, ranks last waited for),
        # where seq is None for a point-to-point call (peer: its src or dst; a
        # collective's root, or NO_ROOT); times are monotonic (see flight_record)
        n = flight_record_size()
        self.flight: deque[tuple[Any, ...]] | None = deque(maxlen=n) if n else None
        self._since = 0.0  # when the collective in progress began
        self._got = 0  # the size of the message a recv took last (for its flight record)
        self.ctx = _plans.Ctx(rank, size)
        self.hb = heartbeat
        self._pid = os.getpid()  # (close() in a forked child leaves the parent's sockets be)
        self.liveness_timeout = liveness_timeout
        self._live_until = 0.0  # until then no peer's heartbeats can be overdue
        self._look_at = 0.0  # when a send that does not wait reads its sockets next (_look)
        # recursive doubling in a world that is not a power of two, with a data-only codec: a
        # result that cannot be encoded where every partial one could (a sum beyond 64
        # bits) is sent by the folded ranks alone (Core._folded_result)
        self._check_folded = codec == w.MSGPACK and size > 2 and size & (size - 1) != 0
        self._probed = False  # whether the current step asked the ranks it waits for
        self._last_probe = -math.inf  # when a collective last asked them early (FIRST_PROBE)
        self._probe_error: MismatchError | None = None  # the last raised from an answer
        self._looked = False  # whether it read its sockets once more at the deadline
        # before a wait raises a loss, the sockets are read to their end (see _wait): 0.0,
        # not yet in this step; else until when it reads again while a read takes anything
        # (SETTLE_S; -inf once one took nothing)
        self._settle_until = 0.0
        # small messages go to a stream endpoint framed in one piece (Core._post)
        self._xs = cast(StreamEndpoint, endpoint) if endpoint.STREAM else None
        self._stream = self._xs is not None
        # ... and, pickled, the usual small object is framed in line (Core._post)
        self._fast = self._stream and codec == w.PICKLE
        # ... and read the short way where a read begins with it (ExpressEndpoint)
        self._xr = cast(ExpressEndpoint, endpoint) if self._fast and endpoint.EXPRESS else None
        self._sink: Callable[[w.Message | None], int | None]  # (the mailbox's: Core)

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last calls on the group, oldest first, then those in progress (see
        :meth:`ctrlcomm.Group.flight_record`)."""
        # (what another thread's calls change, read first, each in one step: a list made of
        # a deque or dict is made without a switch of threads; then the clock, so that no
        # call in progress began after it)
        done = list(self.flight) if self.flight is not None else []
        a, since, waiting = self.active, self._since, self.waiting_for
        recvs = [p for line in list(self._lines.values()) for p in list(line)]
        now = time.monotonic()
        wall = time.time() - now
        out = [_record(r, wall) for r in done]
        if a is not None:
            out.append(_record((a.name, a.seq, a.root, None, since, None, None, None, None,
                                None, None, waiting), wall, now))
        for p in recvs:
            out.append(_record((p.name, None, p.waiting_for[0], p.tag, p.since, None, None,
                                None, None, None, None, p.waiting_for), wall, now))
        return out


def _record(r: tuple[Any, ...], wall: float, now: float = 0.0) -> dict[str, Any]:
    """A flight record's tuple as the dict Group.flight_record returns."""
    name, seq, peer, tag, start, end, err, sent, received, bsent, breceived, waited = r
    p2p = seq is None
    if p2p:  # (a name as errors give it, "recv_obj(src=1)": the call's)
        name = _op_of(name)
    state = "running" if end is None else "done" if err is None else "failed"
    return {
        "op": name, "seq": seq,
        "root": None if p2p or peer == w.NO_ROOT else peer,
        "peer": peer if p2p else None, "tag": tag,
        "state": state, "error": err,
        "started": start + wall,
        "duration_s": (now if end is None else end) - start,
        "messages_sent": sent, "messages_received": received,
        "bytes_sent": bsent, "bytes_received": breceived,
        "waited_for": list(waited),
    }
