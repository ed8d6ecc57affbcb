"""Mailbox and the one execution loop both drivers run.

Theory of operation
-------------------
A group has one :class:`Core`. Every call (collective or point to point) is run by
:meth:`Core.execute`, a generator that does all the work and yields only when it must wait,
yielding the number of seconds it is willing to sleep. The blocking driver (:func:`run_sync`)
answers each yield by sleeping in the kernel (epoll or ``zmq_poll``); the asyncio driver (:func:`run_async`) by
awaiting the socket's descriptor through the event loop. Nothing else differs between the two.

Matching: collective messages are keyed by (seq, round, src) and kept until the plan asks for
them; messages of a later seq (a peer that is ahead) wait in the mailbox. Point-to-point
messages queue per (src, tag), in arrival order, which is send order per pair of ranks.

A collective message carries its op (and reduction op) and root. One whose seq is this rank's
current seq but whose op or root differ means the ranks diverged: :class:`MismatchError` at once.
Where no such message comes (every rank waits for another), the ranks a collective waits for
are asked what they are doing 1, 3, 7, 15... s into it and shortly before its deadline; an
answer names the collective the peer is in (or returned from last), and one at this seq with
another op or root raises a :class:`MismatchTimeoutError` (the call cannot complete: both a
mismatch and a timeout) when it is read, which the rank tells the others (a rank waiting in
that call raises one too, at once).

States: ``open`` -> ``closed`` (by :meth:`close`) or ``broken`` (timeout, mismatch, cancel of
a collective, peer lost, abort). A collective that fails leaves the seq counters of the ranks
out of step, so the group is then broken: every later call raises :class:`GroupBrokenError`
naming the first cause. A point-to-point ``recv`` that times out or is cancelled leaves the
group open (a late message is simply queued for the next ``recv``). Bad arguments are
rejected before a seq number is taken, so they leave the group open too.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Sequence
from itertools import repeat
from typing import Any, NamedTuple

from . import _ops, _plans
from . import _wire as w
from ._errors import (
    CodecError,
    CollectiveTimeoutError,
    ConcurrentUseError,
    CtrlcommError,
    GroupBrokenError,
    GroupClosedError,
    InvalidArgumentError,
    MismatchError,
    MismatchTimeoutError,
    PeerLostError,
)
from ._transport import (
    COPY_THRESHOLD,
    FAIR_S,
    Heartbeat,
    TcpEndpoint,
    ZmqEndpoint,
    _turn_due,
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
IO_TAKE_S = 1.0  # how long a call waits for those sockets at most (see run_async)
IO_LOOK_S = 0.001  # meanwhile, how often it looks whether another thread's call holds the group
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
LOST_PREFIX = "\x00lost:"  # an ABORT that reports lost ranks (not a user's abort)
MISMATCH_PREFIX = "\x00mismatch:"  # an ABORT that reports a mismatch (ranks out of step)
HOLD_HIGH = 256
HOLD_LOW = 64
MAX_BACKLOG = 4 * 1024 * 1024
RECENT = 64  # calls whose (op, root) are kept to find a mismatch after a call returned
BYE_TEXT = 2000  # characters of why a group was broken, said to the peers as it closes

Wait = Generator[float, None, Any]


def describe(op: int, root: int) -> str:
    name = w.OP_NAME.get(op & 0x0F, f"op{op & 0x0F}")
    red = op >> 4
    parts = [name]
    if red:
        from ._ops import NAMED_OPS

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


def _check_size(payload: Any, bufs: tuple[Any, ...]) -> None:
    size = memoryview(payload).nbytes + sum(memoryview(b).nbytes for b in bufs)
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
_ploads = w._ploads  # the usual payload is decoded in line (w.loads without its call)
_NONE_LOST: list[int] = []  # never changed (no rank lost; not waiting for any)
_first_pass = w.first_pass  # the usual object's encoding (Core._post)
_COLL, _PICKLE = w.COLL, w.PICKLE
_NO_STEP: tuple[dict[int, None], dict[int, Any], int, int, int, int, int] = \
    ({}, {}, _COLL, -1, 0, 0, 0)


class Core:
    def __init__(self, *, name: str, rank: int, size: int, group_id: int,
                 endpoint: TcpEndpoint | ZmqEndpoint,
                 codec: int, key: bytes, timeout: float,
                 heartbeat: Heartbeat | None = None,
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
        self.status: dict[int, tuple[int, str]] = {}
        # what a peer's answer said of the collective it is in or returned from last:
        # (seq, opcode, root)
        self.status_call: dict[int, tuple[int, int, int]] = {}
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
        self.suspects: dict[int, tuple[float, str]] = {}  # peer -> (grace ends, why)
        self.dropped: Counter[str] = Counter()
        self.sent = 0
        self.received = 0
        self.state = "open"
        self.cause: BaseException | None = None
        self.active: tuple[str, int, int, int] | None = None  # (name, seq, opcode, root)
        self.waiting_for: list[int] = []
        # the error the call in progress raises at its next look (a mismatch, or a peer's
        # abort of this call: see _fail_call)
        self.mismatch: CtrlcommError | None = None
        # this rank's object the current collective could not send (sent in its place)
        self._send_failed: _ops.Failed | None = None
        # the step _express waits for: (senders not read yet, payloads read by sender, kind,
        # seq, round, opcode, root); an error its reads met in an awaited wait's callback;
        # whether that callback handed anything to the sink (the general way takes over)
        self._xstep: tuple[dict[int, None], dict[int, Any], int, int, int, int, int] = _NO_STEP
        self._xerror: BaseException | None = None
        self._xfell = False
        self._in_place = False  # whether the current collective can send a failure so
        self.last: tuple[str, int | None] = ("nothing yet", None)
        self._lock = threading.Lock()
        self._owner = ""
        self._holder = 0  # the thread whose call last took the lock (0: close or abort did)
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
        # the (seq, opcode, root) of recent calls, by seq % len: a message of a call that
        # returned here, from a rank that called something else, is a mismatch found late
        self._recent: list[tuple[int, int, int]] = [(-1, 0, 0)] * RECENT
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
        self._stream = endpoint.STREAM
        # ... and, pickled, the usual small object is framed in line (Core._post)
        self._fast = self._stream and codec == w.PICKLE
        # ... and read from its sender's socket in line (Core._express)
        self._xp = self._fast and isinstance(endpoint, TcpEndpoint)
        endpoint.on_lost = self._lost
        endpoint.key = key
        endpoint.me = rank  # what a keyed message's MAC must be made for
        if isinstance(endpoint, TcpEndpoint):
            endpoint.set_hello(self._hello)
        self._sink = endpoint.sink = self._accept

    def _hello(self, dst: int) -> bytes:
        """The first message on a stream connection to ``dst``, framed: this rank sends on
        it (MACed for ``dst`` in a keyed group). Until a connection's first message says
        who sends on it, its peer takes small messages only (TcpEndpoint)."""
        frames = w.encode(w.Message(w.HELLO, self.rank, self.group_id, 0, 0, 0, w.NO_ROOT),
                          self.key, dst)
        return w.stream_prefix(frames) + b"".join(frames)

    def _lost(self, rank: int, why: str, certain: bool) -> None:
        text = f"is gone ({why}; its process died or exited without close())"
        if certain:
            # a goodbye that arrived before the connection closed is the better explanation
            self._known_gone(rank, text)
        else:
            self.suspects.setdefault(rank, (time.monotonic() + SUSPECT_GRACE, text))

    def _known_gone(self, rank: int, text: str) -> None:
        """``rank`` is gone, as ``text`` says: kept where an earlier word said why, but over a
        guess from its silence (``_guessed``)."""
        if rank in self._guessed:
            self._guessed.discard(rank)
            self.gone[rank] = text
        else:
            self.gone.setdefault(rank, text)

    def _check_lost(self, missing: list[int], now: float) -> tuple[list[int], float]:
        """Ranks among ``missing`` known gone, and when this should be asked again (a
        suspect's grace ends, or a peer's heartbeats would be overdue)."""
        hb, limit = self.hb, self.liveness_timeout
        if not self.gone and not self.suspects:
            # the common case, cheap: no peer lost or suspect, none silent for too long
            if now < self._live_until:
                return [], self._live_until
            if hb is not None and limit is not None:
                oldest = min(hb.last_seen.values(), default=now)
                self._live_until = oldest + limit + 0.01
            else:
                self._live_until = float("inf")
            if now < self._live_until:
                return [], self._live_until
        nxt = float("inf")
        caught_up = False
        for s in missing:
            if s in self.gone:
                continue
            if s in self.suspects:
                until, text = self.suspects[s]
                if now >= until:
                    self.gone[s] = text
                    self._guessed.add(s)
                    continue
                nxt = min(nxt, until)
            if hb is not None and limit is not None:
                silent = hb.silent_for(s, now)
                if silent > limit and not caught_up:
                    hb.catch_up()  # what a long C call of this process kept unread
                    caught_up = True
                    silent = hb.silent_for(s, now)
                if silent <= limit:
                    nxt = min(nxt, now + limit - silent + 0.01)
                    continue
                runs = hb.running(s) if silent <= RUNNING_LIMIT * limit else False
                if runs:
                    # a process of this host that runs (a long C call holding its GIL keeps
                    # its heartbeats in): waited for a while longer
                    nxt = min(nxt, now + min(limit, RUNNING_RECHECK_S))
                elif runs is None:  # not sure yet
                    nxt = min(nxt, now + RUNNING_UNSURE_S)
                else:
                    self.gone[s] = (f"stopped answering heartbeats {silent:.1f} s ago (its "
                                    "process is stopped, hung, or cut off from the network)")
                    self._guessed.add(s)
        return [s for s in missing if s in self.gone], nxt

    # ------------------------------------------------------------------------ receiving

    def _accept(self, m: w.Message | None) -> int | None:
        """Take one incoming message (None: a malformed one); returns its sender, or None if
        it was dropped."""
        if m is None:
            self.dropped["malformed"] += 1
            return None
        kind, src, gid, seq, rnd, op, root, _, _, _ = m
        if gid != self.group_id or src not in self._peers:
            self.dropped["other_group" if gid != self.group_id else "bad_src"] += 1
            return None
        if kind == w.HELLO:  # (it names the connection's sender: nothing else to do)
            return src
        self.received += 1
        k = kind
        if k == _COLL:
            if seq < self.seq - (self._cur_seq >= 0):
                past = self._recent[seq % RECENT]
                if past[0] == seq and (op != past[1] or root != past[2]):
                    self._late_mismatch(m, past)
                self.dropped["stale"] += 1
                return None
            slot = self.box.get(seq)
            if slot is None:
                slot = self.box[seq] = {}
            key = (rnd, src)
            if key in slot:
                self.dropped["duplicate"] += 1
                return None
            slot[key] = m
            held = self.held
            n = held[src] = held[src] + 1
            if n >= HOLD_HIGH and src not in self.paused:
                # this peer is far ahead: stop reading its stream (what this rank needs from
                # it came first, being of an earlier seq) until it has caught up
                self.paused.add(src)
                self.ep.pause(src)
            if seq == self._cur_seq and (op, root) != self._cur_call:
                self._set_mismatch(m)
        elif k == w.P2P:
            # each sender numbers its point-to-point messages to this rank 1, 2, 3...: an
            # old number is a replay (it would pass the MAC: the frame is genuine)
            if m.seq < self.p2p_in.get(m.src, 1):
                self.dropped["replayed"] += 1
                return None
            self.p2p_in[m.src] = m.seq + 1
            self.p2p.setdefault((m.src, m.round), deque()).append(m)
        elif k == w.STATUS_REQ:
            self._answer_status(m.src)
        elif k == w.STATUS_REP:
            self.status[m.src] = (self.seq, bytes(m.payload).decode(errors="replace"))
            if m.round == w.STATUS_IN_CALL:
                self.status_in_call[m.src] = seq
            else:
                self.status_in_call.pop(m.src, None)
            if m.round in (w.STATUS_IN_CALL, w.STATUS_RETURNED):
                self.status_call[m.src] = (seq, op, root)
                a = self.active
                # a rank this call waits for is in (or returned from) another call at this
                # seq: it will never send what this one waits for. (Made again for each
                # such answer read before the call raises: it names them all.)
                if a is not None and seq == a[1] and (op != a[2] or root != a[3]) \
                        and src in self.waiting_for \
                        and (self.mismatch is None or self.mismatch is self._probe_error):
                    self.mismatch = self._probe_error = self._probed_mismatch(a)
        elif k == w.BYE:
            why = bytes(m.payload).decode(errors="replace")  # (why it was broken, if it was)
            self._known_gone(m.src, f"closed the group (broken there: {why})" if why
                             else "closed the group")
            self.aborters.discard(m.src)
        elif k == w.ABORT:
            reason = bytes(m.payload).decode(errors="replace")
            if reason.startswith(MISMATCH_PREFIX):
                # another rank found the ranks out of step: so are the calls of this one
                desc = reason[len(MISMATCH_PREFIX):]
                if rnd == w.ABORT_BY_PROBE and m.op and (
                        (st := self.status.get(m.src)) is None or st[0] != self.seq):
                    # the call the teller is in (as its answer would have said: see
                    # _notify_mismatch), where this rank has no answer of its own
                    self.status[m.src] = (self.seq, f"in {describe(m.op, m.root)} #{seq} "
                                          "(it found the mismatch, and told this rank)")
                e: MismatchError = self._told_mismatch(seq, desc, m.src) \
                    if rnd == w.ABORT_BY_PROBE \
                    else MismatchError(f"{desc} (reported by rank {m.src})")
                self.brk(e)
                self._fail_call(e)
            elif reason.startswith(LOST_PREFIX):
                # a peer lost ranks and tells everyone: name those ranks, not the messenger
                head, _, text = reason[len(LOST_PREFIX):].partition("|")
                lost = [r for r in (int(x) for x in head.split(",") if x.strip().isdecimal())
                        if r in self._peers]  # (isdecimal: int() takes it; "²" isdigit)
                for r in lost:
                    self.gone.setdefault(r, f"is gone (reported by rank {m.src}: {text})")
                self.brk(PeerLostError(f"group {self.name!r}: rank(s) {lost} lost (reported by "
                                       f"rank {m.src}): {text}", ranks=lost))
            else:
                self.gone[m.src] = f"aborted the group: {reason}"
                self._guessed.discard(m.src)
                self.aborters.add(m.src)
                aborted = PeerLostError(f"group {self.name!r}: rank {m.src} aborted the "
                                        f"group: {reason}", ranks=[m.src])
                self.brk(aborted)
                a = self.active
                if rnd == w.ABORT_AT_CALL and a is not None and a[1] >= seq:
                    # about this call (or an earlier one): it fails here too, even where
                    # the sender's part of it came before the word, as on the others (an
                    # error that names the call, as when the word came before it waited)
                    self._fail_call(self._naming_call(f"{a[0]} #{a[1]}", aborted))
        return m.src

    def _set_mismatch(self, m: w.Message) -> None:
        a = self.active
        assert a is not None
        if self.mismatch is None:
            self.mismatch = MismatchError(self._mismatch_text(a[1], a[2], a[3], m))

    def _mismatch_text(self, seq: int, op: int, root: int, m: w.Message) -> str:
        """That this rank called (op, root) as collective #seq, and ``m``'s sender another."""
        return (f"group {self.name!r}: collective #{seq} mismatch: rank {self.rank} called "
                f"{describe(op, root)}, rank {m.src} called {describe(m.op, m.root)}")

    def _told_mismatch(self, seq: int, desc: str, src: int) -> MismatchError:
        """The error of a mismatch in collective #``seq`` that rank ``src`` found by asking the
        ranks it waited for, and told: where this rank is in that collective, a
        :class:`MismatchTimeoutError` like the one it would raise on finding it itself (its
        call cannot complete either), else a :class:`MismatchError`."""
        told = f"{desc} (reported by rank {src}, which asked the ranks it waited for)"
        a = self.active
        if a is None or a[1] != seq:
            return MismatchError(told)
        name = a[0]
        missing = list(self.waiting_for)
        # (what this rank's own probe heard, if it asked before it was told)
        states, detail = self._peer_states(missing,
                                           "not asked (told before this rank asked)")
        waiting = f" waiting for ranks {missing} ({detail})" if missing else ""
        return MismatchTimeoutError(
            f"{name} #{seq} on group {self.name!r} cannot complete on rank {self.rank}"
            f"{waiting}: {told}",
            mismatch=desc, op=name, seq=seq, group=self.name, waiting_for=missing,
            peer_states=states)

    def _fail_call(self, e: CtrlcommError) -> None:
        """The ranks are out of step, or a peer gave up this call: the collective in progress
        raises ``e`` at its next look, even if its own messages are all in (read with what
        showed it). Whether it raises must not depend on how the reads fell."""
        a = self.active
        if a is not None and a[1] >= 0 and self.mismatch is None:
            self.mismatch = e

    def _late_mismatch(self, m: w.Message, past: tuple[int, int, int]) -> None:
        """A message of call #seq, which returned here, shows its sender called another
        collective or root there (both returned without waiting for each other: a broadcast
        whose ranks named different roots, say). This rank's result of it may be wrong: the
        group breaks, and the call in progress raises (or the next one)."""
        e = MismatchError(
            f"{self._mismatch_text(*past, m)} (found after #{past[0]} had returned on rank "
            f"{self.rank}: its result there may be wrong)")
        if self.state == "open":
            self._notify_mismatch(e)
            self.brk(e)
        self._fail_call(e)

    def pump(self) -> None:
        if self._deferred:  # close() or abort() from another thread or task
            self._run_deferred()
        if self.ep.closed:  # closed by another task while a call waited
            raise GroupClosedError(f"group {self.name!r} (rank {self.rank}) was closed "
                                   "during the call")
        self.ep.drain(self._sink)

    def settle(self) -> None:
        """As :meth:`pump`, but what the sockets hold read to its end (the endpoint's
        settle), before a wait raises that a peer it waits for is lost."""
        self.pump()
        settle = getattr(self.ep, "settle", None)  # (a test's stand-in may have none)
        if settle is not None:
            settle(self._sink)

    def _answer_status(self, dst: int) -> None:
        """Tell ``dst`` what this rank is doing: in words, and in the header the collective
        it is in, or else the last one it returned from (so that a rank that waits for it in
        another call at that seq can tell a mismatch from a late rank)."""
        a = self.active
        seq, flag, op, root = 0, 0, 0, w.NO_ROOT
        if a is not None and a[1] >= 0:
            seq, flag, op, root = a[1], w.STATUS_IN_CALL, a[2], a[3]
        elif self.last[1] is not None:  # (idle ranks do not answer: this one is in a recv)
            past = self._recent[self.last[1] % RECENT]
            if past[0] == self.last[1]:
                seq, flag, op, root = past[0], w.STATUS_RETURNED, past[1], past[2]
        self._send_raw(dst, w.STATUS_REP, self.describe_state().encode(), seq, flag, op, root)

    def describe_state(self) -> str:
        a = self.active
        if a is None:
            last = self.last[0] if self.last[1] is None else f"{self.last[0]} #{self.last[1]}"
            return f"idle (last call: {last})"
        what = f"{describe(a[2], a[3])} #{a[1]}" if a[1] >= 0 else a[0]
        return f"in {what}, waiting for ranks {self.waiting_for}"

    # -------------------------------------------------------------------------- sending

    def _send_raw(self, dst: int, kind: int, payload: bytes, seq: int = 0, rnd: int = 0,
                  op: int = 0, root: int = w.NO_ROOT) -> None:
        msg = w.Message(kind, self.rank, self.group_id, seq, rnd, op, root, payload=payload)
        # (a goodbye is the last message: see ZmqEndpoint.send_last)
        send = getattr(self.ep, "send_last", self.ep.send) if kind == w.BYE else self.ep.send
        try:
            send(dst, w.encode(msg, self.key, dst))
        except Exception:  # a status or goodbye message is best effort
            pass

    def _decode(self, m: w.Message, what: str, seq: int | None = None) -> Any:
        try:
            return w.loads(m.payload, m.buffers, m.codec, self._unpickle)
        except Exception as e:  # unpickling runs code: anything can come out
            raise _undecodable(m, what, seq, e) from e

    # --------------------------------------------------------------------------- states

    def check_open(self) -> None:
        if self.state == "closed":
            raise GroupClosedError(f"group {self.name!r} (rank {self.rank}) is closed")
        if self.state == "broken":
            raise self._broken_error()

    def _broken_error(self) -> GroupBrokenError:
        """What a call raises on the group broken by :attr:`cause`: a PeerLostError where
        a peer was lost (it died, closed or aborted: as the call that saw it raised), naming
        the same ranks; else a GroupBrokenError saying why."""
        c = self.cause
        text = f"group {self.name!r} (rank {self.rank}) is broken: {c}"
        e = PeerLostError(text, ranks=c.ranks) if isinstance(c, PeerLostError) \
            else GroupBrokenError(text)
        e.__cause__ = c
        return e

    def _cause_in(self, call: str) -> BaseException:
        """What ``call``, in progress, raises on finding the group broken meanwhile by
        :attr:`cause`: where a peer was lost (reported by another rank, or it aborted), a
        PeerLostError naming the same ranks and this call, not only the reporter's (its text
        describes that rank's call); else the cause as it is."""
        c = self.cause
        if type(c) is not PeerLostError:
            return c  # type: ignore[return-value]
        return self._naming_call(call, c)

    def _naming_call(self, call: str, c: PeerLostError) -> PeerLostError:
        """Peer loss ``c`` as ``call``, in progress, raises it (see _cause_in)."""
        e = PeerLostError(f"{call} on group {self.name!r} cannot complete on rank "
                          f"{self.rank}: {c}", ranks=c.ranks)
        e.__cause__ = c
        return e

    def brk(self, cause: BaseException) -> None:
        if self.state == "open":
            self.cause = cause  # (first: a call in another thread raises it once broken)
            self.state = "broken"

    def enter(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"group {self.name!r} (rank {self.rank}) is busy with {self._owner}: a group is "
                f"used by one thread or coroutine at a time (called {what})")
        self._owner = what
        self._holder = _get_ident()
        try:
            self.check_open()
        except BaseException:
            self._unlock()
            raise

    def leave(self) -> None:
        self._owner = ""
        self._unlock()

    def _unlock(self) -> None:
        """Release the group, then run what close() or abort() asked for while it was held
        (they could not take the lock: whoever releases it must look)."""
        self._lock.release()
        if self._deferred:
            self._run_deferred_unlocked()

    # ------------------------------------------------------------------------ execution

    def collective(self, call: Call, timeout: float | None) -> Wait:
        """Run a call's plan to completion (a generator that yields seconds to wait).

        Each step's sends go out at once; then its receives: what is in the mailbox already,
        else waits, each followed by a read of every ready socket. (No non-blocking read
        before the first wait: the driver's wait returns at once when a socket is ready, and
        a rank that waits for a reply, as every non-root rank of a star does, would find
        nothing.) This loop runs for every call: it is kept flat.
        """
        name, opcode, root = call.name, call.opcode, call.root
        if self.state != "open" or not self._lock.acquire(False):  # False: do not block
            self.enter(name)  # raises: closed, broken, or busy
        self._owner = name
        self._holder = _get_ident()
        seq = self._cur_seq = self.seq
        self.seq = seq + 1
        self._cur_call = (opcode, root)
        self.active = (name, seq, opcode, root)
        self._recent[seq % RECENT] = (seq, opcode, root)
        t = self.timeout if timeout is None else timeout
        start = _monotonic()
        deadline = start + t
        self._in_place = call.plan in _FAIL_IN_PLACE
        probe_at = deadline - min(PROBE_GRACE, t / 10)  # as in _wait, with its first probe
        if start + FIRST_PROBE < probe_at:
            probe_at = start + FIRST_PROBE
        box = self.box
        ep = self.ep
        try:
            early = box.get(seq)
            if early:
                for m in early.values():
                    if (m.op, m.root) != (opcode, root):
                        self._set_mismatch(m)
                        break
            gen = call.plan(self.ctx, *call.args)
            send = gen.send
            reply: dict[int, Any] | None = None
            recvs: Sequence[int]
            while True:
                try:
                    rnd, sends, recvs = send(reply)  # type: ignore[arg-type]
                except StopIteration as e:
                    result = e.value
                    if self.mismatch is not None:  # found by a send's read (_backpressure)
                        raise self.mismatch from None
                    if self._send_failed is not None:  # its object could not be sent:
                        result, self._send_failed = self._send_failed, None  # raised above
                    elif self._check_folded and call.plan is _plans.all_reduce_doubling:
                        result = self._folded_result(result, opcode, seq)
                    break
                if sends:
                    if not recvs:  # (a step that waits finds its lost peers as it waits)
                        self._look(sends, name, seq)
                    self._post(sends, rnd, seq, opcode, root)
                    if ep.unflushed:  # else nothing is queued: no backlog to wait out
                        yield from self._backpressure([d for d, _ in sends], deadline, t,
                                                      name, seq)
                reply = {}
                if not recvs:
                    continue
                # per step: its missing ranks are asked, its sockets read to the end at a loss
                self._probed = self._looked = False
                self._settle_until = 0.0
                if self._xp and not box.get(seq) and not self.paused:
                    # the usual step: each message read straight from its sender's socket
                    # (what is left, or anything unusual, the general way below)
                    recvs = yield from self._express(recvs, reply, seq, rnd, opcode, root,
                                                     probe_at, name)
                    if not recvs:
                        continue
                    # what made it stop, seen now (as after a wait below): a close or
                    # abort asked for, an error met in a reader callback, events to read
                    self.pump()
                want = set(zip(repeat(rnd), recvs))  # the mailbox keys this step waits for
                while True:
                    if self.mismatch is not None:
                        raise self.mismatch
                    slot = box.get(seq)
                    if slot is not None:
                        if slot.keys() >= want:
                            # all in: this step completed, even if the group broke meanwhile
                            # (an abort of a later call, read with its last message: the
                            # next step that must wait, or the next call, raises)
                            break
                        missing = [s for s in recvs if (rnd, s) not in slot]
                    else:
                        missing = list(recvs)
                    if self.state == "broken":
                        raise self._cause_in(f"{name} #{seq}")
                    now = _monotonic()
                    if now < probe_at and now < self._live_until and not self.gone \
                            and not self.suspects and not self.paused:
                        # what _wait answers in the usual case, without its call: nobody
                        # lost or suspect, no deadline or probe due yet
                        self.waiting_for = missing
                        yield min(probe_at, self._live_until) - now
                    else:
                        yield self._wait(missing, deadline, t, name, seq, start)
                    if self._deferred or ep.closed:
                        self.pump()  # does what close() or abort() asked; raises if closed
                    ep.drain(self._sink)
                held = self.held
                unpickle = self._unpickle
                for s in recvs:
                    m = slot.pop((rnd, s))
                    held[s] -= 1
                    try:  # self._decode, without two calls for the usual codec (and with
                        # m's payload, buffers and codec by index: cheaper than by name)
                        reply[s] = _ploads(m[8], buffers=m[9]) \
                            if m[7] == _PICKLE and unpickle \
                            else w.loads(m[8], m[9], m[7], unpickle)
                    except Exception as e:  # unpickling runs code: anything can come out
                        raise _undecodable(m, name, seq, e) from e
                if self.paused:
                    self._resume_caught_up(recvs)
            self.last = (name, seq)
            return result
        except GeneratorExit:
            self._failed_seq = seq
            why = f"{name} #{seq} on group {self.name!r} was cancelled on rank {self.rank}"
            if self.state == "open":  # the others may be waiting for its part: they are told
                self._tell_peers(w.ABORT, why, seq, w.ABORT_AT_CALL)
            self.brk(GroupBrokenError(why))
            raise
        except BaseException as e:  # the ranks are out of step now
            self._failed_seq = seq
            if isinstance(e, PeerLostError) and self.state == "open" and e.ranks \
                    and not all(self.gone.get(r, "").startswith("is gone (reported") for r in e.ranks):
                # tell the others which ranks are gone: they may be waiting on this rank
                self._notify_lost(e)
            elif isinstance(e, MismatchError) and self.state == "open" \
                    and "(reported by rank" not in str(e):
                # the others may be waiting for this rank's part of a call it did not make
                self._notify_mismatch(e)
            elif isinstance(e, CollectiveTimeoutError) and self.state == "open" \
                    and e.waiting_for:
                # this rank's group breaks: the ranks it waited for that are late (not in
                # this call when they last answered) are told, or one would wait all its
                # own timeout for this rank's part once it came, and then call it "not in a
                # ctrlcomm call". (Not the others: those in this call wait for the same
                # ranks, or for one that does, and time out saying so, not that this rank
                # gave up a moment before them.)
                late = [r for r in e.waiting_for if self.status_in_call.get(r) != seq]
                self._tell_peers(w.ABORT, str(e)[:BYE_TEXT], seq, w.ABORT_AT_CALL, to=late)
            elif isinstance(e, CodecError) and self.state == "open":
                # an object from a peer that cannot be decoded here: this rank's group
                # breaks; the others, the sender too, are told (not left waiting for it)
                self._tell_peers(w.ABORT, str(e), seq, w.ABORT_AT_CALL)
            elif not isinstance(e, CtrlcommError) and self.state == "open":
                # Ctrl-C, or anything else that ended the call midway (a SystemExit or an
                # error raised by a signal handler as it waited...): caught, the process
                # goes on; the others are told, not left waiting for its part
                why = f"{name} #{seq} on group {self.name!r} was interrupted on rank {self.rank}"
                if not isinstance(e, KeyboardInterrupt):
                    why += f" ({type(e).__name__}: {e})"[:BYE_TEXT]
                self._tell_peers(w.ABORT, why, seq, w.ABORT_AT_CALL)
                self.brk(GroupBrokenError(why))  # (the cause: a KeyboardInterrupt says nothing)
            self.brk(e)
            raise
        finally:
            self._send_failed = None
            left = box.pop(seq, None)
            if left:  # duplicates, or the rest of a failed call
                self.dropped["stale"] += len(left)
                self._release([src for _, src in left])
            self.active = None
            self._cur_seq = -1
            self.mismatch = None
            self.waiting_for = _NONE_LOST
            self._owner = ""  # self.leave(), inline
            self._lock.release()
            if self._deferred:  # asked for while this call held the group
                self._run_deferred_unlocked()

    def _express(self, recvs: tuple[int, ...], reply: dict[int, Any], seq: int, rnd: int,
                 opcode: int, root: int, probe_at: float, name: str, kind: int = _COLL
                 ) -> Generator[float, None, Sequence[int]]:
        """Receive a step's messages the short way: wait, then read each ready sender's
        socket, and where a read begins with the message expected (this call's seq and
        step, the sender's rank, opcode and root, pickled; what comes behind it goes to the
        sink) take its payload without the decoder or the mailbox (:meth:`_xtake`; an
        awaited wait's reader callback runs it too, and wakes the call only when the step is
        complete or something else came), and unpickle it into ``reply`` here, in the call.
        Returns the senders still to receive from, the general way (Core.collective), which
        takes over at the first thing this path does not handle: a read that holds anything
        else (handed to the sink as drain would), a ready descriptor that is not an expected
        sender's, a peer lost or suspect, a deadline or probe due, an abort or close asked
        for, a mismatch. (``kind`` w.P2P: Core.recv's one message, ``seq`` the sender's
        next number and ``rnd`` the tag.)"""
        ep: TcpEndpoint = self.ep  # type: ignore[assignment]  # (self._xp: a TcpEndpoint)
        left = dict.fromkeys(recvs)  # the senders not read yet (ordered; O(1) to look up)
        raw: dict[int, bytearray] = {}  # the payloads read, by sender
        self._xstep = (left, raw, kind, seq, rnd, opcode, root)
        self._xfell = False
        ended = False
        try:
            while True:
                if self.mismatch is not None or self.state != "open" or self.gone \
                        or self.suspects or self._deferred or ep.closed or ep.failed:
                    break
                now = _monotonic()
                if now >= probe_at or now >= self._live_until:
                    break
                self.waiting_for = list(left)
                ep.xtake = self._xcallback  # (for an awaited wait's reader callback)
                yield min(probe_at, self._live_until) - now
                ep.xtake = None
                e = self._xerror
                if e is not None:
                    self._xerror = None
                    raise e
                ready = ep.pop_ready()
                if not ready:
                    if ready is None:  # the wait timed out (or ended by its timer): again
                        continue
                    # read by an awaited wait's callback: the general way, if it took
                    # anything that way, else what is left of the step, if anything
                    if self._xfell or not left:
                        break
                    continue
                if self._xtake(ready) or not left:  # (drain reads what it left)
                    break
            ended = True
        finally:
            ep.xtake = None
            self._xstep = _NO_STEP
            if self._xerror is not None:
                # an error in an awaited wait's reader callback, and the call was cancelled
                # before it resumed to raise it: not left for a later call to raise as its
                # own. A collective's cancellation breaks the group and tells the others
                # (Core.collective); a recv's leaves the group as it was, but what the
                # failed read took may be lost: the group breaks, and the others are told.
                e, self._xerror = self._xerror, None
                if kind != _COLL and self.state == "open":
                    self._tell_peers(w.ABORT, f"{name} on group {self.name!r} failed on rank "
                                              f"{self.rank} as it was cancelled: "
                                              f"{type(e).__name__}: {e}"[:BYE_TEXT])
                    self.brk(e)
            if kind != _COLL and raw:
                # a point-to-point message taken: its sender's next number, as _accept
                # counts (not lowered: what came behind it may have been counted already)
                for s, taken in raw.items():
                    if self.p2p_in.get(s, 1) <= seq:
                        self.p2p_in[s] = seq + 1
                    if not ended:
                        # the recv ends without it (cancelled, a close, an error in the
                        # loop's callback...) after an awaited wait's callback read it: it
                        # is the next recv's, first in line, as the general way keeps it
                        self.p2p.setdefault((s, rnd), deque()).appendleft(w.Message(
                            kind, s, self.group_id, seq, rnd, opcode, root, _PICKLE, taken,
                            ()))
        for s in recvs:  # (in the order of recvs, as the general way fills reply)
            data = raw.get(s)
            if data is not None:
                try:
                    reply[s] = _ploads(data)
                except Exception as e:  # unpickling runs code: anything can come out
                    raise _undecodable(w.Message(kind, s, self.group_id, seq, rnd, opcode,
                                                 root), name, seq if kind == _COLL else None,
                                       e) from e
        return list(left)

    def _xcallback(self, ready: list[tuple[int, int]]) -> bool:
        """:meth:`_xtake` for an awaited wait's reader callback: whether to wake the call
        (its step is complete, or the general way must take over; or an error, kept for the
        call to raise)."""
        try:
            fell = self._xtake(ready)
        except BaseException as e:  # (not into the event loop: the call raises it)
            self._xerror = e
            return True
        if not fell:
            return not self._xstep[0]
        self._xfell = True
        return True

    def _xtake(self, ready: list[tuple[int, int]]) -> bool:
        """The endpoint's read_expected for the step :meth:`_express` waits for
        (``self._xstep``): whether the general way must take over."""
        left, raw, kind, seq, rnd, opcode, root = self._xstep
        n = len(raw)
        fell = self.ep.read_expected(  # type: ignore[union-attr]  # (self._xp: a TcpEndpoint)
            ready, left, raw, self.group_id, kind, seq, rnd, opcode, root, self._sink)
        self.received += len(raw) - n
        return fell

    def _release(self, srcs: Sequence[int]) -> None:
        """One message of each of ``srcs`` left the mailbox."""
        held = self.held
        for src in srcs:
            held[src] -= 1
        if self.paused:
            self._resume_caught_up(srcs)

    def _resume_caught_up(self, srcs: Sequence[int]) -> None:
        for src in srcs:
            if src in self.paused and self.held[src] <= HOLD_LOW:
                self.paused.discard(src)
                self.ep.resume(src)

    def _post(self, sends: tuple[tuple[int, Any], ...], rnd: int, seq: int, opcode: int,
              root: int) -> None:
        if self._send_failed is not None:
            # this call sent a failure in place of an object already: its later sends carry
            # it too (recursive doubling's next partial result may be encodable again, and
            # a rank that got it would return a result the failure never reached)
            sends = tuple((d, self._send_failed) for d, _ in sends)
        obj = sends[0][1]
        each = False  # whether the destinations get different objects
        if len(sends) == 1:  # a non-root's one send: the usual
            dsts: Sequence[int] = (sends[0][0],)
        else:
            for _, o in sends:
                if o is not obj:
                    each = True
                    break
            dsts = [d for d, _ in sends]  # (else a root's result, the same for all)
        enc: Any = None  # (None: encoded the general way, by w.dumps)
        if self._fast and not each:
            # the usual message, a small object, pickled (w.dumps' first pass) and framed in
            # one piece; anything else goes on with what that pass found
            payload = _first_pass(obj)
            if type(payload) is bytes:
                if len(payload) < COPY_THRESHOLD:
                    self.ep.send_framed(  # type: ignore[union-attr]  # a TcpEndpoint
                        dsts, w.stream_messages(dsts, _COLL, self.rank, self.group_id, seq,
                                                rnd, opcode, root, _PICKLE, payload, self.key))
                    self.sent += len(sends)
                    return
                enc = (payload, ())
            else:
                enc = payload  # w.LARGE, or the exception pickling raised
        self._post_encoded(sends, each, dsts, rnd, seq, opcode, root, enc)

    def _post_encoded(self, sends: tuple[tuple[int, Any], ...], each: bool,
                      dsts: Sequence[int], rnd: int, seq: int, opcode: int, root: int,
                      enc: Any = None) -> None:
        """:meth:`_post`, the general way: the object of ``sends[0]`` to ``dsts``, or
        (``each``) each object of ``sends`` to its destination, encoded once per object.
        ``enc``: what _post's first pickling pass found of the one object (None: nothing),
        so that it is not pickled again for nothing: its encoding (payload, buffers),
        w.LARGE (pickled again, large buffers out of band: w.dumps_large), or the exception
        pickling raised."""
        codec, key, ep = self.codec, self.key, self.ep
        groups: Any
        if not each:
            groups = ((sends[0][1], dsts),)
        else:
            by_obj: dict[int, tuple[Any, list[int]]] = {}
            for dst, o in sends:
                entry = by_obj.get(id(o))
                if entry is None:
                    by_obj[id(o)] = (o, [dst])
                else:
                    entry[1].append(dst)
            groups = by_obj.values()
        for obj, to in groups:
            try:
                if enc is None:
                    payload, bufs = w.dumps(obj, codec)
                elif enc is w.LARGE:
                    payload, bufs = w.dumps_large(obj)
                elif type(enc) is tuple:
                    payload, bufs = enc
                else:
                    raise w.cannot_pickle(obj, enc) from enc
            except CodecError as e:
                payload, bufs = self._unsendable(e, opcode)
            if bufs or len(payload) > MAX_PAYLOAD:
                payload, bufs = self._sized(payload, bufs, opcode)
            if self._stream and not bufs and type(payload) is bytes \
                    and len(payload) < COPY_THRESHOLD:  # one piece, framed at once
                ep.send_framed(  # type: ignore[union-attr]  # a TcpEndpoint (STREAM)
                    to, w.stream_messages(to, w.COLL, self.rank, self.group_id, seq, rnd,
                                          opcode, root, codec, payload, key))
            else:  # each destination's MAC
                self._send_signed(to, w.frames_for(to, w.COLL, self.rank, self.group_id,
                                                   seq, rnd, opcode, root, codec, payload,
                                                   bufs, key))
        self.sent += len(sends)

    def _unsendable(self, e: CodecError, opcode: int) -> tuple[Any, tuple[Any, ...]]:
        """What a collective sends in place of an object this rank cannot encode: the
        failure, which every rank that gets it raises, as this one does when its plan is
        done (raising now would leave the others waiting for its part, or pairing it with
        this rank's next call). Only in a plan whose messages are a rank's object or a
        whole result (see _FAIL_IN_PLACE); in the others it is raised, and the others are
        told (the group breaks: it cannot stay in step)."""
        text = self._codec_text(e, opcode, self.seq - 1)
        if not self._in_place:
            raise CodecError(text)
        failed = _ops.Failed(text, "codec")
        if self._send_failed is None:
            self._send_failed = failed
        return w.dumps(failed, self.codec)

    def _folded_result(self, result: Any, opcode: int, seq: int) -> Any:
        """An all_reduce's result by recursive doubling, or the failure to raise where the
        codec cannot encode it: ranks that fold their value into a partner's get the result
        from it, and where it cannot send it they raise; every rank that holds the result
        looks, so that they all do."""
        if type(result) is _ops.Failed:
            return result
        try:
            w.dumps(result, self.codec)
        except CodecError as e:
            return _ops.Failed(self._codec_text(e, opcode, seq), "codec")
        return result

    def _codec_text(self, e: CodecError, opcode: int, seq: int) -> str:
        """What every rank of collective #``seq`` raises where this one cannot encode."""
        return f"{w.OP_NAME.get(opcode & 0xF, 'collective')} #{seq} on rank {self.rank}: {e}"

    def _sized(self, payload: Any, bufs: tuple[Any, ...], opcode: int
               ) -> tuple[Any, tuple[Any, ...]]:
        """``payload`` and ``bufs``, or, where they are more than a message may carry (the
        receivers would drop the stream), the failure to send instead (:meth:`_unsendable`)."""
        try:
            _check_size(payload, bufs)
        except CodecError as e:
            return self._unsendable(e, opcode)
        return payload, bufs

    def _send_signed(self, dsts: Sequence[int], each: list[list[Any]]) -> None:
        """Send ``each[i]`` to ``dsts[i]`` (one message, a MAC per destination). The frames
        but the MAC are the same objects in each: one that may change once the call returns
        (an array's memory) is copied here, once for all the destinations, where a
        transport, given one destination at a time, would copy it for each that queues it
        (a 64 MiB array broadcast to three ranks: three copies). The header still says what
        the sender passed (the receiver's arrays are writable)."""
        send = self.ep.send
        if len(each) > 1:
            shared = each[0][:-1]
            if not all(map(w.immutable, shared)):
                shared = [f if w.immutable(f) else bytes(f) for f in shared]
                each = [[*shared, f[-1]] for f in each]
        for d, frames in zip(dsts, each, strict=True):
            send(d, frames)

    def _backpressure(self, dsts: list[int], deadline: float, t: float, name: str,
                      seq: int | None) -> Wait:
        """Wait while more than MAX_BACKLOG bytes are queued for any of ``dsts``."""
        if self.ep.unflushed:  # a connection still being made, or a kernel buffer was full
            self.pump()
        while True:
            full = [d for d in dsts if self.ep.backlog(d) > MAX_BACKLOG]
            if not full:
                return
            if self.state == "broken":  # (a step that completed may still send after it)
                raise self._cause_in(name if seq is None else f"{name} #{seq}")
            self.waiting_for = full
            self.pump()
            # the pump may have sent it all: then no event would end a wait (two ranks
            # sending to each other waited for their deadlines so)
            full = [d for d in full if self.ep.backlog(d) > MAX_BACKLOG]
            if not full:
                return
            now = time.monotonic()
            lost, suspect_at = self._check_lost(full, now)
            if lost:
                what = name if seq is None else f"{name} #{seq}"
                raise PeerLostError(f"{what} on group {self.name!r}: rank {lost[0]} "
                                    f"{self.gone[lost[0]]}", ranks=lost)
            if now >= deadline:
                raise self._timeout(f"{name} (sending)", seq, t, full)
            yield min(deadline, suspect_at) - now

    def _wait(self, missing: list[int], deadline: float, t: float, name: str, seq: int | None,
              start: float = 0.0) -> float:
        """Before one wait for ``missing`` ranks: raise if one is lost or the deadline passed,
        ask them what they are doing shortly before it (and, in a collective that started at
        ``start``, 1, 3, 7... s into it: FIRST_PROBE); else the seconds to sleep (at most:
        the wait ends when something arrives)."""
        if self.paused:
            for s in missing:
                if s in self.paused:  # what is wanted came first from it; read on: why not?
                    self.paused.discard(s)
                    self.ep.resume(s)
        self.waiting_for = missing
        now = _monotonic()
        if now < self._live_until and not self.gone and not self.suspects:
            lost, suspect_at = _NONE_LOST, self._live_until  # the usual case, cheaply
        else:
            lost, suspect_at = self._check_lost(missing, now)
        if lost:
            until = self._settle_until
            if until == 0.0 or now < min(deadline, until):
                # first, what the sockets hold read to its end, and looked at by the caller:
                # a peer that sent what is waited for and then left (exited, closed: its
                # heartbeats stopped long ago) had it taken, not lost (a connection it made
                # while this rank was away is accepted in one drain, read in the next). A
                # settle's reads are bounded (a flood: FAIR_S a drain, SETTLE_ROUNDS drains):
                # while one takes anything, another follows, for SETTLE_S at most (what a
                # lost peer sent is finite; a live one may flood on)
                n = self.received
                self.settle()
                self._settle_until = (until or now + SETTLE_S) if self.received != n \
                    else -math.inf
                return 0.0
            what = f"{name} #{seq}" if seq is not None else name
            raise PeerLostError(
                f"{what} on group {self.name!r} cannot complete on rank {self.rank}: "
                + "; ".join(f"rank {s} {self.gone[s]}" for s in lost), ranks=lost)
        if now >= deadline:
            if not self._looked:  # a last read first: what is wanted may be in a socket
                self._looked = True
                return 0.0
            raise self._timeout(name, seq, t, missing)
        if self._probed:
            return min(deadline, suspect_at) - now
        probe_at = deadline - min(PROBE_GRACE, t / 10)
        if now >= probe_at:
            self._probed = True
            for s in missing:
                self.status.pop(s, None)
                self.status_call.pop(s, None)
                self.status_in_call.pop(s, None)
                self._send_raw(s, w.STATUS_REQ, b"")
            return min(deadline, suspect_at) - now
        if seq is not None:  # a collective: ask early, then less and less often
            last = self._last_probe
            early = start + FIRST_PROBE if last < start else 2 * last - start + FIRST_PROBE
            if now >= early:
                self._last_probe = now
                for s in missing:
                    self._send_raw(s, w.STATUS_REQ, b"")
                early = 2 * now - start + FIRST_PROBE
            if early < probe_at:
                probe_at = early
        return min(probe_at, suspect_at) - now

    def _peer_states(self, ranks: list[int],
                     unknown: str = "did not answer (not in a ctrlcomm call, or stuck)"
                     ) -> tuple[dict[int, str], str]:
        """What each of ``ranks`` answered it was doing, when last asked, and that in words
        (``rank 1: in ...; rank 2: ...``)."""
        now = self.seq
        states = {s: e[1] if (e := self.status.get(s)) is not None and e[0] == now else unknown
                  for s in ranks}
        return states, "; ".join(f"rank {s}: {v}" for s, v in states.items())

    def _timeout(self, name: str, seq: int | None, t: float, missing: list[int]
                 ) -> CollectiveTimeoutError:
        states, detail = self._peer_states(missing)
        what = f"{name} #{seq}" if seq is not None else name
        text = (f"{what} on group {self.name!r} timed out after {t:g} s on rank {self.rank} "
                f"waiting for ranks {missing} ({detail})")
        a = self.active
        if a is not None and seq is not None and a[1] == seq:
            desc = self._mismatch_desc(a, missing)
            if desc:  # (found only now: the answers came too late to raise earlier)
                return MismatchTimeoutError(
                    f"{text}: {desc}", mismatch=desc,
                    op=_op_of(name), seq=seq, group=self.name, waiting_for=missing, peer_states=states)
        return CollectiveTimeoutError(text, op=_op_of(name), seq=seq, group=self.name,
                                      waiting_for=missing, peer_states=states)

    def _mismatch_desc(self, a: tuple[str, int, int, int], missing: list[int]) -> str:
        """Which of ``missing`` said they are in (or returned from) another call than
        ``a`` (the active one: name, seq, op, root) at its seq, in words ("" if none): such a
        rank will never send what this one waits for."""
        seq = a[1]
        other = [(s, c) for s in missing if (c := self.status_call.get(s)) is not None
                 and c[0] == seq and (c[1], c[2]) != (a[2], a[3])]
        if not other:
            return ""
        return (f"collective #{seq} mismatch on group {self.name!r}: rank {self.rank} called "
                f"{describe(a[2], a[3])}; "
                + "; ".join(f"rank {s} called {describe(op, root)}" for s, (_, op, root) in other))

    def _probed_mismatch(self, a: tuple[str, int, int, int]) -> MismatchTimeoutError:
        """The error of collective ``a`` (name, seq, op, root) when a rank it waits for
        answered that it is in another call at this seq: the call cannot complete, as at a
        timeout, and raises now."""
        name, seq = a[0], a[1]
        missing = list(self.waiting_for)
        states, detail = self._peer_states(missing, "not answered yet")
        desc = self._mismatch_desc(a, missing)
        return MismatchTimeoutError(
            f"{name} #{seq} on group {self.name!r} cannot complete on rank {self.rank} waiting "
            f"for ranks {missing} ({detail}): {desc}", mismatch=desc,
            op=name, seq=seq, group=self.name, waiting_for=missing, peer_states=states)

    # ------------------------------------------------------------------ point to point

    def send(self, obj: Any, dst: int | tuple[int, ...], tag: int, timeout: float | None,
             what: str = "") -> Wait:
        """Point to point: ``obj`` to ``dst``, or to each rank of a tuple (encoded once).
        ``what`` names the call in errors (default: ``send(dst=..., tag=...)``)."""
        self.enter(what or "send")
        dsts = dst if isinstance(dst, tuple) else (dst,)
        name = what  # (or the default: _send_name)
        try:
            self._look(dsts, name, dst=dst, tag=tag)
            payload = _first_pass(obj) if self._fast else None
            ep, count = self.ep, self.p2p_out
            if type(payload) is bytes and len(payload) < COPY_THRESHOLD:
                # the usual message, a small object, pickled and framed in one piece (as
                # Core._post); anything else the general way, with what that pass found
                for d in dsts:
                    n = count.get(d, 1)
                    ep.send_framed((d,), w.stream_messages(  # type: ignore[union-attr]  # (a TcpEndpoint)
                        (d,), w.P2P, self.rank, self.group_id, n, tag, 0, w.NO_ROOT, _PICKLE,
                        payload, self.key))
                    count[d] = n + 1
                self.sent += len(dsts)
            else:
                name = _send_name(name, dst, tag)
                try:  # (what the first pass found: encoded on from there, as w.dumps)
                    bufs: tuple[Any, ...] = ()
                    if payload is None:  # (no first pass: another codec or transport)
                        payload, bufs = w.dumps(obj, self.codec)
                    elif payload is w.LARGE:
                        payload, bufs = w.dumps_large(obj)
                    elif type(payload) is not bytes:  # the exception pickling raised
                        raise w.cannot_pickle(obj, payload) from payload
                    if bufs or len(payload) > MAX_PAYLOAD:
                        _check_size(payload, bufs)
                except CodecError as e:
                    raise CodecError(f"{name} on group {self.name!r}, rank {self.rank}: {e}"
                                     ) from None
                for d in dsts:
                    n = count.get(d, 1)
                    msg = w.Message(w.P2P, self.rank, self.group_id, n, tag, 0, w.NO_ROOT,
                                    self.codec, payload, bufs)
                    ep.send(d, w.encode(msg, self.key, d))
                    count[d] = n + 1
                    self.sent += 1
            if ep.unflushed:  # else nothing is queued: no backlog to wait out
                name = _send_name(name, dst, tag)
                t = self.timeout if timeout is None else float(timeout)
                yield from self._backpressure(list(dsts), time.monotonic() + t, t, name, None)
            if self.gone or self.suspects:  # lost while it was sent: the rest was dropped
                self._unreachable(dsts, _send_name(name, dst, tag))
        finally:
            self.waiting_for = []
            self.leave()

    def _look(self, dsts: Sequence[Any], name: str, seq: int | None = None, dst: Any = None,
              tag: int = 0) -> None:
        """Before a send that does not wait for ``dsts`` (ranks, or a collective step's
        sends, (rank, object) pairs, whose call is ``name`` #``seq``; or a point-to-point
        send's, named by ``name``, ``dst`` and ``tag``: _send_name): what has come in read
        (every LOOK_S), and PeerLostError raised where one of them is known lost, or silent
        past liveness_timeout. (The usual case: a clock read and three compares.)"""
        now = _monotonic()
        silence = False
        if now >= self._look_at:
            self._look_at = now + LOOK_S
            self.pump()
            silence = now >= self._live_until  # (asked as often as what came in is read)
        if not (self.gone or self.suspects or silence):
            return
        ranks = [d for d, _ in dsts] if seq is not None else list(dsts)
        what = _send_name(name, dst, tag) if seq is None else f"{name} #{seq}"
        self._check_lost(ranks, now)  # (moves to gone those it finds lost)
        self._unreachable(ranks, what)

    def _unreachable(self, dsts: Sequence[int], name: str) -> None:
        """Raise PeerLostError if the connection to one of ``dsts`` is lost (the rank is gone,
        or the stream this rank sends it failed): a message to it would be dropped unsaid."""
        lost = [d for d in dsts if d in self.gone or d in self.suspects]
        if any(d not in self.gone for d in lost):
            # a stream that failed as this rank sent on it: the peer's goodbye or abort,
            # which says why better than the failure, is most likely in already (sent
            # before it closed); read, it makes the rank gone with its word (a send-only
            # step would raise before any wait read it: a broadcast's root said that a rank
            # which had aborted "died")
            self.pump()
            lost = [d for d in dsts if d in self.gone or d in self.suspects]
        if lost:
            raise PeerLostError(
                f"{name} on group {self.name!r}: " + "; ".join(
                    f"rank {d} {self.gone[d] if d in self.gone else self.suspects[d][1]}"
                    for d in lost), ranks=lost)

    def send_self(self, obj: Any, tag: int, what: str) -> None:
        """A send to this rank itself (as MPI allows): ``obj`` encoded, for :meth:`recv_self`;
        ``what`` names the call in errors."""
        self.check_open()
        try:
            payload, bufs = w.dumps(obj, self.codec)
        except CodecError as e:
            raise CodecError(f"{what} on rank {self.rank}: {e}") from None
        # (what a peer gets: the buffers as they are where they cannot change (the wire's
        # FLAG_IMMUTABLE), else each a writable copy: the sender's own memory may change
        # once the call returns)
        if not all(w.immutable(b) for b in bufs):
            bufs = tuple(bytearray(b) for b in bufs)
        self.to_self.setdefault(tag, deque()).append((payload, bufs))

    def recv_self(self, tag: int, what: str) -> Any:
        """The next object this rank sent itself with ``tag``; InvalidArgumentError where there
        is none (nothing else could send it: the receive would wait for ever)."""
        self.check_open()
        q = self.to_self.get(tag)
        if not q:
            raise InvalidArgumentError(f"{what} on rank {self.rank}: this rank sent itself "
                                       "nothing (nothing else can: the receive would wait for "
                                       "ever)")
        payload, bufs = q.popleft()
        return w.loads(payload, bufs, self.codec, self._unpickle)

    def recv(self, src: int, tag: int, timeout: float | None, what: str = "") -> Wait:
        """The next message of ``src`` with ``tag``; ``what`` names the call in errors."""
        self.enter(what or "recv")
        t = self.timeout if timeout is None else float(timeout)
        name = what or f"recv(src={src}, tag={tag})"
        start = _monotonic()
        deadline = start + t
        self._probed = self._looked = False
        self._settle_until = 0.0
        self.active = (name, -1, 0, w.NO_ROOT)
        try:
            if self._xp and not self.p2p.get((src, tag)) and not self.paused:
                # the usual: the message read straight from its sender's socket when it
                # comes, if it is the next one that sender numbered for this rank, with this
                # tag (anything else, or anything unusual, the general way below)
                probe_at = deadline - min(PROBE_GRACE, t / 10)  # as in collective
                if start + FIRST_PROBE < probe_at:
                    probe_at = start + FIRST_PROBE
                n = self.p2p_in.get(src, 1)
                reply: dict[int, Any] = {}
                left = yield from self._express((src,), reply, n, tag, 0, w.NO_ROOT, probe_at,
                                                name, w.P2P)
                if not left:  # (_express counted it in p2p_in)
                    return reply[src]
            while True:
                q = self.p2p.get((src, tag))
                if not q:
                    # (what made the short way stop, if it ran, seen now.) Not when the
                    # message is here already: a flood of them would be read on, a chunk
                    # per call, however many wait here
                    self.pump()
                    q = self.p2p.get((src, tag))
                if q:
                    m = q.popleft()
                    if not q:
                        del self.p2p[(src, tag)]
                    return self._decode(m, name)
                if self.state == "broken":  # (as a collective's wait raises it)
                    c = self.cause
                    if isinstance(c, GroupBrokenError):
                        raise self._cause_in(name)
                    raise GroupBrokenError(str(c)) from c
                yield self._wait([src], deadline, t, name, None)
        finally:
            self.active = None
            self.waiting_for = []
            self.leave()

    # ------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        if os.getpid() != self._pid:
            # a forked child's copy (leaving a `with` block after a fork, say): the sockets
            # are the parent's, whose group goes on: nothing is said to the peers (a BYE
            # from here broke the group there), only this process's copies are let go
            self.ep.close()
            return
        if self.hb is not None:
            self.hb.close()
        self._defer("close", "")

    def _in_call(self) -> bool:
        """Whether this thread is inside a call on this group that is running (blocking,
        :func:`run_sync`, or awaited and not suspended, :func:`run_async`): a signal handler
        or a reduction callable under it. That call does what close() or abort() asks at
        its next look; a suspended awaited call is not on the stack, and it is done now.
        (Read off the stack, only here, where close() or abort() finds the group held by
        this thread: a flag set per call would cost every call, and one a call refused as
        the group is busy set and cleared wiped the holder's.)"""
        f: Any = sys._getframe(1)
        codes = (run_sync.__code__, run_async.__code__)
        while f is not None:
            if f.f_code in codes and f.f_locals.get("core") is self:
                return True
            f = f.f_back
        return False

    def _defer(self, what: str, reason: str) -> None:
        """Do what close() or abort() must do with the sockets: now if the group is idle,
        else in the thread (or task) whose call holds it, woken at once for it. (The state
        has changed already: a call that starts meanwhile raises.)"""
        self._deferred.append((what, reason))
        if self._lock.acquire(False):
            # (held by no call: one asked meanwhile in this thread, from a signal handler,
            # waits for this one, run by the loop below, not inside it)
            self._holder = 0
            try:
                self._run_deferred()
            finally:
                self._unlock()
        elif self._holder == _get_ident() and not self._in_call():
            # held by an awaited call suspended in this thread's event loop (which may never
            # run again): no other thread uses the sockets: do it now; the call, if it
            # resumes, finds the group closed or broken. (Not so when a blocking call of
            # this thread is under this one, in a signal handler or a reduction callable:
            # it is mid-wait or mid-step, and does it itself, below.) Its wait is ended
            # (an abort leaves the sockets open: nothing else would wake it before its
            # next probe, liveness check or deadline). (Taking the sockets from a watchdog's
            # abort sending meanwhile: see _abort_suspended; ``io`` is re-entrant: a signal
            # handler's close() or abort() while this thread's loop reads, in its reader
            # callback, holding it, waited for itself)
            io = self.ep.io
            took = io.acquire(timeout=IO_TAKE_S)
            try:
                self._run_deferred()
            finally:
                if took:
                    io.release()
            self.ep.wake()
        else:
            # held by another thread: it runs this at its next wake-up, or when its call
            # ends, whichever is first (after releasing the lock, it looks: _unlock)
            self.ep.wake()
            if what == "abort" and self._holder != _get_ident():
                self._abort_suspended()

    def _abort_suspended(self) -> None:
        """abort() from a thread (a watchdog) while an awaited call of another thread's event
        loop holds the group, suspended in a wait: that loop may not run again for long
        (blocked: what a watchdog is for), and the word it would send waited for it (a
        peer then waited out its timeout). It is sent from here: the call's thread uses
        no socket while the call is suspended (``ep.io``, which it holds otherwise, and its
        loop's reader callback takes, is free, ``held_async`` set). The call, as it
        resumes, raises. (A blocking call is woken, and does it itself at once.)"""
        ep = self.ep
        if not ep.held_async or not ep.io.acquire(timeout=ABORT_TAKE_S):
            return
        try:
            # only the aborts: a close() asked meanwhile (which closes sockets that loop
            # still watches) waits for the call's thread, and does not hold up the word
            while ep.held_async and not ep.closed:
                item = next((d for d in self._deferred if d[0] == "abort"), None)
                if item is None:
                    break
                try:
                    self._deferred.remove(item)
                except ValueError:  # (run by another thread meanwhile)
                    continue
                self._send_abort(item[1])
        finally:
            ep.io.release()
        ep.wake()

    def _run_deferred_unlocked(self) -> None:
        # (the loop: what is asked while this runs is run too, or by whoever holds the
        # lock when it is asked)
        while self._deferred and self._lock.acquire(False):
            self._holder = 0  # (as in _defer)
            try:
                self._run_deferred()
            finally:
                self._lock.release()

    def _run_deferred(self) -> None:
        """(Holding the lock.)"""
        while self._deferred:
            what, reason = self._deferred.pop(0)
            if self.ep.closed:
                continue
            if what == "abort":
                self._send_abort(reason)
            else:
                # a group closed broken says why: a peer that waited for this rank learns
                # the first cause (a third rank's abort, say, whose own word may come later)
                cause = self.cause
                self._tell_peers(w.BYE, "" if cause is None
                                 else f"{type(cause).__name__}: {cause}"[:BYE_TEXT])
                # (nothing to linger for: see there)
                self.ep.close(gone=set(self.gone).difference(self.aborters))

    def _send_abort(self, reason: str) -> None:
        """(Holding the group, or its sockets for a suspended call: _abort_suspended.) The
        call it concerns, chosen here, by the thread that holds the group (another thread's
        abort() cannot know whether the call in progress will complete): a collective in
        progress, which fails here too; else the last one, where it failed here; else the
        next."""
        a = self.active
        if a is not None and a[1] >= 0:
            seq = a[1]
            c = self.cause
            self._fail_call(c if isinstance(c, CtrlcommError) else GroupBrokenError(reason))
        elif self._failed_seq == self.seq - 1 >= 0:
            seq = self._failed_seq
        else:
            seq = self.seq
        self._tell_peers(w.ABORT, reason, seq, w.ABORT_AT_CALL)

    def _tell_peers(self, kind: int, text: str, seq: int = 0, rnd: int = 0,
                    to: Sequence[int] | None = None, op: int = 0,
                    root: int = w.NO_ROOT) -> None:
        """A control message to every peer (or those of ``to``) not known gone (best
        effort)."""
        payload = text.encode()
        for p in range(self.size) if to is None else to:
            if p != self.rank and (p not in self.gone or kind == w.BYE and p in self.aborters):
                self._send_raw(p, kind, payload, seq, rnd, op, root)
        if kind == w.ABORT:
            # the word goes out now, to peers this rank has not sent to yet as well (queued on a
            # connection still being made, it would wait for this rank's next call, or exit)
            push = getattr(self.ep, "push", None)
            if push is not None:
                push(ABORT_PUSH_S)

    def _notify_lost(self, e: PeerLostError) -> None:
        self._tell_peers(w.ABORT, f"{LOST_PREFIX}{','.join(map(str, e.ranks))}|{e}")

    def _notify_mismatch(self, e: MismatchError) -> None:
        if isinstance(e, MismatchTimeoutError) and e.seq is not None:
            # the description only, and in the header which call and how it was found (a
            # peer of an earlier version reads a plain mismatch)
            # (and, where it is in that call still, which call this rank made: a rank told
            # before it asked says what this one was doing, as if it had asked)
            a = self.active
            op, root = (a[2], a[3]) if a is not None and a[1] == e.seq else (0, w.NO_ROOT)
            self._tell_peers(w.ABORT, f"{MISMATCH_PREFIX}{e.mismatch}", e.seq,
                             w.ABORT_BY_PROBE, op=op, root=root)
        else:
            self._tell_peers(w.ABORT, f"{MISMATCH_PREFIX}{e}")

    def abort(self, reason: str) -> None:
        if self.state == "closed":
            return
        self.brk(GroupBrokenError(f"group {self.name!r} was aborted by rank {self.rank} "
                                  f"(this rank): {reason}"))
        if os.getpid() != self._pid:  # a forked child's copy: as in close(), not a word
            return
        self._defer("abort", reason)


def run_sync(core: Core, gen: Wait) -> Any:
    """Blocking driver: run ``gen`` in this thread, sleeping in ``zmq_poll`` when it waits."""
    try:
        delay = next(gen)
        while True:
            try:
                core.ep.wait(delay)
            except BaseException as e:  # Ctrl-C while it slept: the call sees it where it
                # waits, so it ends now (the lock released, the others told), not when the
                # exception's traceback, which holds the generator, goes
                delay = gen.throw(e)
                continue
            delay = gen.send(None)
    except StopIteration as e:
        return e.value


def _take_io(core: Core, io: Any) -> bool:
    """(run_async, finding ``io`` held.) Whether it is taken: waited for while the group is
    free (the holder, another thread's call, is about to take it, or has just left it; or a
    copy held at a fork: up to IO_TAKE_S), looking every IO_LOOK_S; not once the group is
    held (a call of another thread has it: refused, without blocking this loop longer)."""
    end = _monotonic() + IO_TAKE_S
    while not core._lock.locked():
        if io.acquire(timeout=IO_LOOK_S):
            return True
        if _monotonic() >= end:
            return False
    return False


def cancelled_before_it_began(core: Core, collective: str, how: str = "was cancelled"
                              ) -> None:
    """An awaited collective ``collective`` (a name; "": a point-to-point call) was
    cancelled before it began: the group breaks, as where one is cancelled while it runs
    (the others are told). Its caller cannot tell the two apart, and a rank that went on
    would pair its next collective with the others' this one. Where an awaited collective
    of this event loop has the turn (run_async), this one would have waited for it and
    been made: the group breaks once that one has ended (_pass_turn), which the others
    made too. Not where another call holds the group otherwise: this one would have been
    refused (ConcurrentUseError), which leaves the group working (and breaking it would end
    that call); nor in a world of one."""
    if not collective or core.state != "open" or core.size <= 1:
        return
    why = (f"{collective} on group {core.name!r} {how} on rank {core.rank} before it began "
           "(queued behind another collective of its event loop)")
    held = core._turn.get(0)
    if held is not None and held[0] == _get_ident() and held[1] is asyncio._get_running_loop():
        core._owed = core._owed or why
    elif not core._lock.locked():
        core.abort(f"{collective} #{core.seq} on group {core.name!r} {how} "
                   f"on rank {core.rank} (before it began)")


def _pass_turn(core: Core, turn: tuple[int, asyncio.AbstractEventLoop]) -> None:
    """(An awaited collective's turn ends, in its loop.) The next one queued in that loop
    is woken, the turn its (first come, first served: one that starts meanwhile queues
    behind it); else the turn is free."""
    box = core._turn
    if box.get(0) != turn:
        return
    q = core._turns
    while q and q[0].done():
        # a call queued next that gave up (its timer, or a cancellation, settled its future
        # before its task could run _queue_turn's handling: this may run first, in the
        # same pass of the loop): not made here, though the others make it
        f = q.popleft()
        if not f.cancelled():
            f.exception()  # (retrieved: _TurnTimeout)
        core._owed = core._owed or (
            f"a collective on group {core.name!r} queued on rank {core.rank} behind another "
            "of its event loop was cancelled or timed out before it began")
    if core._owed:  # (a collective queued behind this one was not made: see there)
        why, core._owed = core._owed, ""
        core.abort(why)
    if q:
        q.popleft().set_result(None)  # (not done: those were taken above)
        return
    del box[0]  # (ours: another thread only ever adds it where absent)


class _TurnTimeout(Exception):
    """(_queue_turn's timer fired.)"""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_TurnTimeout())


async def _queue_turn(core: Core, collective: str, timeout: float | None,
                      turn: tuple[int, asyncio.AbstractEventLoop]) -> None:
    """Wait for the turn while another awaited collective of this event loop has it, up to
    ``timeout`` (the group's default for None). Cancelled, or past it, the call is not made
    here, though the others would make it: the group breaks once the holder's call has
    ended (cancelled_before_it_began). (Its own future and timer, not asyncio.wait_for: on
    Python 3.10 and 3.11 that returns the result, the cancellation lost, where a task is
    cancelled as the future completes, CPython gh-86296: the call then ran.)"""
    loop = turn[1]
    fut = loop.create_future()
    core._turns.append(fut)
    t = core.timeout if timeout is None else timeout
    timer = None if math.isinf(t) else loop.call_later(t, _expire, fut)
    try:
        await fut
    except BaseException as e:
        timed_out = isinstance(e, _TurnTimeout)
        # (first: the turn's holder, this call where handed the turn as it gave up, breaks
        # the group as it passes the turn on)
        cancelled_before_it_began(core, collective, "timed out" if timed_out else
                                  "was cancelled")
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            _pass_turn(core, turn)  # (handed the turn as it gave up: to the next)
        elif not fut.done():
            fut.cancel()  # (passed over in the queue)
        if timed_out:
            raise CollectiveTimeoutError(
                f"{collective} on group {core.name!r} timed out after {t:g} s on rank "
                f"{core.rank} queued behind {core._owner or 'another call'}, another task's "
                "of this event loop: not made here, though the others may make it, so the "
                "group breaks once that call has ended", op=collective,
                group=core.name) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


async def run_async(core: Core, gen: Wait, collective: str = "",
                    timeout: float | None = None) -> Any:
    """Asyncio driver: as :func:`run_sync`, but waits through the event loop.

    A call whose messages were read already completes without suspending, as
    ``asyncio.Queue.get`` does when the queue holds something; but its endpoint reads the
    sockets itself, so a task awaiting such calls back to back, from a peer that keeps
    sending, would never let the loop run (other tasks, timeouts, cancellation: seen 1.4 s
    for 60,000 messages). So a call started right after the last one ended, when the loop
    has had no turn through this endpoint for FAIR_S, gives it one first, before it takes
    anything (a cancellation there loses nothing). A call started later, or one that waited
    through the loop, costs nothing more. While such a turn is pending, a call that starts
    (another task's, scheduled in the same pass of the loop) takes one too, behind it: the
    calls keep the order the tasks started them in (two sends gathered stay in order, and
    the second does not find the group taken by a third).

    ``collective``: the name of the collective ``gen`` runs. One cancelled in that turn,
    before it began, breaks the group as one cancelled while it runs does (the others are
    told): its caller cannot tell the two apart, and a rank that went on would pair its
    next collective with the others' this one.

    Awaited collectives of one event loop take turns, first come first: one started while
    another (another task's) has the turn waits for it, up to ``timeout`` (the call's:
    its own deadline starts as it begins). So collectives gathered with asyncio.gather run
    on every rank in the order their tasks started, as torch's async_op works queue;
    before, one was refused (ConcurrentUseError) on a rank where the other waited, and run
    on a rank where the other had not had to: paired with the wrong call, silently. (The
    order is the one in which calls reach the group: where a task makes several in a row,
    another task's may come between them on one rank and not on another.) A call
    cancelled or timed out while queued is not made here, though the others may make it:
    the group breaks once the holder's call has ended (cancelled_before_it_began). A turn
    left by a loop closed before its call could end is taken over. Point-to-point calls,
    and calls of other threads, are refused or waited for as before."""
    turn = None
    if collective:
        turn = (_get_ident(), asyncio.get_running_loop())
        held = core._turn.setdefault(0, turn)
        if held is not turn and held[1].is_closed():
            # (left by a call of a loop closed before it could end: nothing can pass it;
            # where a call queued there gave up, the group breaks, as _pass_turn would)
            if core._owed or any(f.done() for f in core._turns):
                core.abort(core._owed or f"a collective on group {core.name!r} queued on "
                           f"rank {core.rank} gave up before it began (its loop closed)")
            core._turns.clear()
            core._owed = ""
            core._turn[0] = held = turn
        if held is not turn:
            if held != turn:
                turn = None  # (another thread's or loop's turn: refused as before)
            else:
                try:
                    await _queue_turn(core, collective, timeout, turn)
                except BaseException:
                    gen.close()
                    raise
    ep = core.ep
    try:
        if ep.yielding or (_monotonic() - ep.ended < FAIR_S and _turn_due(ep)):
            ep.yielding += 1
            try:
                await asyncio.sleep(0)  # (gen not started: nothing to close if cancelled here)
            except BaseException:
                cancelled_before_it_began(core, collective)
                raise
            finally:
                ep.yielding -= 1
        # (ep.io: held while the call runs, released while it is suspended in a wait: see
        # Core._abort_suspended)
        io = ep.io
        if not io.acquire(False) and not _take_io(core, io):
            # held by another thread's call (an awaited one mid-step, a long reduction
            # callable say, or a watchdog's abort for one suspended), which holds the group
            # too: refused at once, as the group would refuse it, without blocking this
            # loop; or held past IO_TAKE_S (a copy held by a thread of the parent that
            # forked this process)
            gen.close()
            raise ConcurrentUseError(
                f"group {core.name!r} (rank {core.rank}) is busy with "
                f"{core._owner or 'a call'} in another thread: a group is used by one thread "
                "or coroutine at a time")
        try:
            delay = next(gen)
            while True:
                try:
                    await ep.wait_async(delay)
                except BaseException:  # cancelled: let the generator record what that means
                    gen.close()
                    raise
                delay = gen.send(None)
        except StopIteration as e:
            return e.value
        finally:
            ep.ended = _monotonic()
            io.release()
    finally:
        if turn is not None:
            _pass_turn(core, turn)


__all__ = ["Call", "Core", "cancelled_before_it_began", "run_sync", "run_async"]
