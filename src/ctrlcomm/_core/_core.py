"""The core's calls: a collective's steps from start to end, and point-to-point calls (see
the package's docstring for how they run)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .. import _plans
from .. import _wire as w
from .._endpoint import (
    Endpoint,
    Expected,
    Liveness,
)
from .._errors import (
    CodecError,
    CollectiveTimeoutError,
    CtrlcommError,
    GroupBrokenError,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
)
from .._lifecycle import BROKEN, OPEN
from ._common import (
    _COLL,
    _FAIL_IN_PLACE,
    _NONE_LOST,
    _PICKLE,
    BYE_TEXT,
    FIRST_PROBE,
    MAX_PAYLOAD,
    NO_STEP,
    PROBE_GRACE,
    RECENT,
    Active,
    Call,
    PointWait,
    Wait,
    _check_size,
    _first_pass,
    _get_ident,
    _monotonic,
    _new,
    _ploads,
    _running_loop,
    _send_name,
    _size,
    _undecodable,
    said,
)
from ._mailbox import _Mailbox


class Core(_Mailbox):
    def __init__(self, *, name: str, rank: int, size: int, group_id: int,
                 endpoint: Endpoint,
                 codec: int, key: bytes, timeout: float,
                 heartbeat: Liveness | None = None,
                 liveness_timeout: float | None = None) -> None:
        super().__init__(name=name, rank=rank, size=size, group_id=group_id, endpoint=endpoint,
                         codec=codec, key=key, timeout=timeout, heartbeat=heartbeat,
                         liveness_timeout=liveness_timeout)
        self._sink = self._accept
        endpoint.attach(self._accept, self._lost, key, rank)  # (MACs made for this rank)
        if self._xs is not None:
            self._xs.set_hello(self._hello)

    # ------------------------------------------------------------------------ execution

    def collective(self, call: Call, timeout: float | None) -> Wait:  # noqa: C901
        """Run a call's plan to completion (a generator that yields seconds to wait).

        Each step's sends go out at once; then its receives: what is in the mailbox already,
        else waits, each followed by a read of every ready socket (the endpoint's drain,
        which may take the step's messages the short way: :class:`Expected`). (No
        non-blocking read before the first wait: the driver's wait returns at once when a
        socket is ready, and a rank that waits for a reply, as every non-root rank of a star
        does, would find nothing.) This loop runs for every call: it is kept flat, the usual
        path in line and the unusual in methods (each call of a method here cost 1-2% of a
        small call), which is why it is the one function of the tree over the complexity
        bound.
        """
        name, opcode, root = call.name, call.opcode, call.root
        if self.state != OPEN or self._owner:
            self.enter_collective(name)  # raises: closed, broken, or busy
        self._owner = name
        if self._io_waiters:
            self._nudge()  # (an awaited collective of another thread waits for the sockets)
        # the lead (see the package's docstring), where no point-to-point call has it: its
        # number (self.lead(), in line; 0: none)
        lead = 0
        if self._lock.acquire(False):
            self._holder = _get_ident()
            self._lead_loop = _running_loop()
            lead = self._lead_n = self._lead_n + 1
        seq = self._cur_seq = self.seq
        self.seq = seq + 1
        self._cur_call = (opcode, root)
        start = self._since = _monotonic()  # (before active: flight_record reads both)
        self.active = self._recent[seq % RECENT] = _new(Active, (name, seq, opcode, root))
        t = self.timeout if timeout is None else timeout
        deadline = start + t
        # (for the flight recorder: messages and bytes sent and received, and how it ended)
        nsent = nrecv = bsent = brecv = 0
        err = None
        self._in_place = call.plan in _FAIL_IN_PLACE
        probe_at = deadline - min(PROBE_GRACE, t / 10)  # as in _wait, with its first probe
        if start + FIRST_PROBE < probe_at:
            probe_at = start + FIRST_PROBE
        box = self.box
        ep = self.ep
        xr = self._xr
        gid = self.group_id
        try:
            if box.get(seq):  # messages of this call came before it began
                self._check_early(seq, opcode, root)
            gen = call.plan(self.ctx, *call.args)
            send = gen.send
            reply: dict[int, Any] | None = None
            recvs: Sequence[int]
            while True:
                try:
                    rnd, sends, recvs = send(reply)  # type: ignore[arg-type]
                except StopIteration as e:
                    result = e.value
                    if self.mismatch is not None or self._send_failed is not None \
                            or self._check_folded:
                        result = self._result(result, call, seq)
                    break
                if sends:
                    if not recvs:  # (a step that waits finds its lost peers as it waits)
                        self._look(sends, name, seq)
                    bsent += self._post(sends, rnd, seq, opcode, root)
                    nsent += len(sends)
                    if ep.unflushed:  # else nothing is queued: no backlog to wait out
                        yield from self._backpressure([d for d, _ in sends], deadline, t,
                                                      name, seq, lead)
                reply = {}
                if not recvs:
                    continue
                # per step: its missing ranks are asked, its sockets read to the end at a loss
                self._probed = self._looked = False
                self._settle_until = 0.0
                left = dict.fromkeys(recvs)
                slot = box.get(seq)
                if slot is not None:  # (a loop: a comprehension is a call of its own)
                    for s in recvs:
                        if (rnd, s) in slot:
                            del left[s]
                raw: dict[int, bytearray] = {}
                x = self.step = _new(Expected, (left, raw, gid, _COLL, seq, rnd, opcode, root))
                if xr is not None and lead:
                    xr.expect = x
                while True:
                    if self.mismatch is not None:
                        raise self.mismatch
                    if not left:
                        # all in: this step completed, even if the group broke meanwhile
                        # (an abort of a later call, read with its last message: the next
                        # step that must wait, or the next call, raises)
                        break
                    if self.state == BROKEN:
                        raise self._cause_in(f"{name} #{seq}")
                    now = _monotonic()
                    if now < probe_at and now < self._live_until and not self.gone \
                            and not self.suspects and not self.paused:
                        # what _wait answers in the usual case, without its call: nobody
                        # lost or suspect, no deadline or probe due yet
                        self.waiting_for = list(left)
                        delay = min(probe_at, self._live_until) - now
                    else:
                        delay = self._wait(list(left), deadline, t, name, seq, start)
                    if not lead:
                        lead = self.lead()
                        if lead and xr is not None:
                            xr.expect = x
                    if lead:
                        self._asleep = True
                        yield delay
                        self._asleep = False
                        if self._deferred or ep.closed:
                            self.pump()  # does what close() or abort() asked; raises if closed
                        ep.drain(self._sink)
                        if self._followers:
                            self.wake_followers()
                    else:
                        yield from self.follow(delay)
                        self.pump()
                self.step = NO_STEP
                if xr is not None:
                    if lead:
                        xr.expect = None
                    self.received += len(raw)
                held = self.held
                unpickle = self._unpickle
                for s in recvs:
                    data = raw.get(s)
                    if data is not None:  # taken the short way: pickled, no buffers
                        brecv += len(data)
                        try:
                            reply[s] = _ploads(data)
                        except Exception as e:  # unpickling runs code: anything can come out
                            m = _new(w.Message, (_COLL, s, gid, seq, rnd, opcode, root,
                                                 _PICKLE, data, ()))
                            raise _undecodable(m, name, seq, e) from e
                        continue
                    m = box[seq].pop((rnd, s))
                    held[s] -= 1
                    brecv += _size(m.payload, m.buffers)
                    try:  # self._decode, without two calls for the usual codec
                        reply[s] = _ploads(m.payload, buffers=m.buffers) \
                            if m.codec == _PICKLE and unpickle \
                            else w.loads(m.payload, m.buffers, m.codec, unpickle)
                    except Exception as e:  # unpickling runs code: anything can come out
                        raise _undecodable(m, name, seq, e) from e
                nrecv += len(recvs)
                if self.paused:
                    self._resume_caught_up(recvs)
            self.last = (name, seq)
            return result
        except GeneratorExit:
            if xr is not None:
                # an error an awaited wait's reader callback met, not raised: this call's
                # (it is cancelled: the group breaks, below), not left for the next one
                xr.take_error()
            self._failed_seq = seq
            why = f"{name} #{seq} on group {self.name!r} was cancelled on rank {self.rank}"
            err = "cancelled"
            if self.state == OPEN:  # the others may be waiting for its part: they are told
                self._tell_peers(w.ABORT, why, seq, w.ABORT_AT_CALL)
            self.brk(GroupBrokenError(why))
            raise
        except BaseException as e:  # the ranks are out of step now
            err = said(e)
            self._failed(e, name, seq)
            raise
        finally:
            if self.flight is not None:
                self.flight.append((name, seq, root, None, start, _monotonic(), err, nsent,
                                    nrecv, bsent, brecv, self.waiting_for))
            self._send_failed = None
            if self.step is not NO_STEP:  # (a step that did not complete)
                self.received += len(self.step.raw)
                if xr is not None and xr.expect is self.step:
                    xr.expect = None
                self.step = NO_STEP
            rest = box.pop(seq, None)
            if rest:  # duplicates, or the rest of a failed call
                self.dropped["stale"] += len(rest)
                self._release([src for _, src in rest])
            self.active = None
            self._cur_seq = -1
            self.mismatch = None
            self.waiting_for = _NONE_LOST
            self._owner = ""
            if lead and lead == self._lead_n:  # (self.end_call(lead), in line)
                self._asleep = False
                self._lock.release()
                if self._deferred or self._followers:
                    self.after_lead()
            elif self._deferred:  # asked for while this call ran
                self.run_deferred_here()

    def _check_early(self, seq: int, opcode: int, root: int) -> None:
        """Messages of this call that came before it began: of the same call?"""
        early = self.box.get(seq)
        if early:
            for m in early.values():
                if (m.op, m.root) != (opcode, root):
                    self._set_mismatch(m)
                    break

    def _result(self, result: Any, call: Call, seq: int) -> Any:
        """What the plan returned, or what this rank's part makes of it."""
        if self.mismatch is not None:  # found by a send's read (_backpressure)
            raise self.mismatch from None
        if self._send_failed is not None:  # its object could not be sent: raised above
            result, self._send_failed = self._send_failed, None
        elif self._check_folded and call.plan is _plans.all_reduce_doubling:
            result = self._folded_result(result, call.opcode, seq)
        return result

    def _failed(self, e: BaseException, name: str, seq: int) -> None:
        """A collective ended by ``e``: the ranks are out of step now. The group breaks, and
        the others are told what they need to know (not left waiting for this rank)."""
        self._failed_seq = seq
        self._attach_record(e)
        if isinstance(e, PeerLostError) and self.state == OPEN and e.ranks \
                and not all(self.gone.get(r, "").startswith("is gone (reported") for r in e.ranks):
            # tell the others which ranks are gone: they may be waiting on this rank
            self._notify_lost(e)
        elif isinstance(e, MismatchError) and self.state == OPEN \
                and "(reported by rank" not in str(e):
            # the others may be waiting for this rank's part of a call it did not make
            self._notify_mismatch(e)
        elif isinstance(e, CollectiveTimeoutError) and self.state == OPEN \
                and e.waiting_for:
            # this rank's group breaks: the ranks it waited for that are late (not in
            # this call when they last answered) are told, or one would wait all its
            # own timeout for this rank's part once it came, and then call it "not in a
            # ctrlcomm call". (Not the others: those in this call wait for the same
            # ranks, or for one that does, and time out saying so, not that this rank
            # gave up a moment before them.)
            late = [r for r in e.waiting_for if self.status_in_call.get(r) != seq]
            self._tell_peers(w.ABORT, str(e)[:BYE_TEXT], seq, w.ABORT_AT_CALL, to=late)
        elif isinstance(e, CodecError) and self.state == OPEN:
            # an object from a peer that cannot be decoded here: this rank's group
            # breaks; the others, the sender too, are told (not left waiting for it)
            self._tell_peers(w.ABORT, str(e), seq, w.ABORT_AT_CALL)
        elif not isinstance(e, CtrlcommError) and self.state == OPEN:
            # Ctrl-C, or anything else that ended the call midway (a SystemExit or an
            # error raised by a signal handler as it waited...): caught, the process
            # goes on; the others are told, not left waiting for its part
            why = f"{name} #{seq} on group {self.name!r} was interrupted on rank {self.rank}"
            if not isinstance(e, KeyboardInterrupt):
                why += f" ({type(e).__name__}: {e})"[:BYE_TEXT]
            self._tell_peers(w.ABORT, why, seq, w.ABORT_AT_CALL)
            self.brk(GroupBrokenError(why))  # (the cause: a KeyboardInterrupt says nothing)
        self.brk(e)

    def _record_p2p(self, op: str, peer: Any, tag: int, start: float, err: str | None,
                    sent: int, received: int, size: int | None, waited: list[int]) -> None:
        """A point-to-point call, ended, into the flight recorder (see _CoreState)."""
        if self.flight is not None:
            self.flight.append((op, None, peer, tag, start, _monotonic(), err, sent, received,
                                size if sent else 0, None if sent else size, waited))

    def _attach_record(self, e: BaseException) -> None:
        """A timeout, mismatch or loss carries the flight record, with the call it ended
        still in progress (what it waited for), for the one who reads the error."""
        if isinstance(e, (CollectiveTimeoutError, MismatchError, GroupBrokenError)) \
                and not e.flight_record:
            e.flight_record = self.flight_record()

    def send(self, obj: Any, dst: int | tuple[int, ...], tag: int, timeout: float | None,
             what: str = "", broken_ok: bool = False) -> Wait:
        """Point to point: ``obj`` to ``dst``, or to each rank of a tuple (encoded once).
        ``what`` names the call in errors (default: ``send(dst=..., tag=...)``). It runs
        beside any other call: it waits for none (but a backlog: _backpressure).
        ``broken_ok``: it runs on a broken group too, as a shrink's survivors talk there."""
        stop = self.check_usable(broken_ok)
        dsts = dst if isinstance(dst, tuple) else (dst,)
        name = what  # (or the default: _send_name)
        self._look(dsts, name, dst=dst, tag=tag)
        try:  # (the usual object pickled by w.dumps' first pass: see _encoded)
            payload, bufs = self._encoded(obj, _first_pass(obj) if self._fast else None)
            if bufs or len(payload) > MAX_PAYLOAD:
                _check_size(payload, bufs)
        except CodecError as e:
            raise CodecError(f"{_send_name(name, dst, tag)} on group {self.name!r}, "
                             f"rank {self.rank}: {e}") from None
        ep, count = self.ep, self.p2p_out
        start = _monotonic()
        for d in dsts:  # (each destination numbers what it gets from this rank: 1, 2...)
            n = count.get(d, 1)
            self._emit(w.P2P, (d,), n, tag, 0, w.NO_ROOT, self.codec, payload, bufs)
            count[d] = n + 1
        self.sent += len(dsts)
        err = None
        try:
            if ep.unflushed:  # else nothing is queued: no backlog to wait out
                name = _send_name(name, dst, tag)
                t = self.timeout if timeout is None else float(timeout)
                yield from self._backpressure(list(dsts), time.monotonic() + t, t, name, None,
                                              False, stop)
            if self.gone or self.suspects:  # lost while it was sent: the rest was dropped
                self._unreachable(dsts, _send_name(name, dst, tag))
        except BaseException as e:
            err = self._p2p_failed(e)
            raise
        finally:
            if self.flight is not None:
                self._record_p2p(what or "send", dst, tag, start, err, len(dsts), 0,
                                 _size(payload, bufs),
                                 list(dsts) if err else _NONE_LOST)
        if self._deferred:  # asked for while this call ran
            self.run_deferred_here()

    def recv(self, src: int, tag: int, timeout: float | None, what: str = "",
             broken_ok: bool = False) -> Wait:
        """The next message of ``src`` with ``tag``; ``what`` names the call in errors;
        ``broken_ok``: as for :meth:`send`.

        Receives of one (src, tag) take its messages in the order they were called: each
        waits in that line (``_lines``) until it is first. The first receive to wait takes
        the lead where no call has it (it sleeps on the endpoint, and, first in its line,
        names what it waits for to it: _expect); the others follow (see the package's
        docstring)."""
        stop = self.check_usable(broken_ok)
        p2p, key = self.p2p, (src, tag)
        lines = self._lines
        line = lines.get(key)
        if line is None:
            q = p2p.get(key)
            if q:  # there already, and no receive of it called before this one
                got = self._next_of(key, q, what or f"recv(src={src}, tag={tag})")
                self._record_p2p(what or "recv", src, tag, _monotonic(), None, 0, 1, self._got,
                                 _NONE_LOST)
                return got
        t = self.timeout if timeout is None else float(timeout)
        name = what or f"recv(src={src}, tag={tag})"
        start = _monotonic()
        deadline = start + t
        me = PointWait(name, [src], start, tag)
        if line is None:
            line = lines[key] = [me]
        else:
            line.append(me)
        lead = 0  # (self.lead(), in line)
        if self._lock.acquire(False):
            self._holder = _get_ident()
            self._lead_loop = me.loop
            lead = self._lead_n = self._lead_n + 1
        x = NO_STEP
        err = None
        try:
            while True:
                if line[0] is me or self._first_past_gone(line, me):
                    if x.raw:  # taken the short way (what the mailbox held came later)
                        return self._took(x, src, name)
                    q = p2p.get(key)
                    if q:
                        return self._next_of(key, q, name)
                if self.state == stop:
                    raise self._broken_in_recv(name)
                delay = self._wait([src], deadline, t, name, None, st=me)
                if not lead:
                    lead = self.lead()
                if lead and lead == self._lead_n:
                    if not x.left and line[0] is me:
                        # (first, or the number it waited for came with another tag)
                        x = self._expect(src, tag)
                    self._asleep = True
                    yield delay
                    self._asleep = False
                else:
                    yield from self.follow(delay)
                self.pump()
        except BaseException as e:
            err = self._recv_failed(e, name, lead)
            raise
        finally:
            self._recv_ends(me, key, x, lead)
            self._record_p2p(name, src, tag, start, err, 0, int(err is None),
                             self._got if err is None else None, me.waiting_for)

    def _recv_failed(self, e: BaseException, name: str, lead: int) -> str:
        """(recv ended by ``e``.) What its flight record says of it."""
        if isinstance(e, GeneratorExit) and lead:
            self._cancelled_recv(name)
        return self._p2p_failed(e)

    def _p2p_failed(self, e: BaseException) -> str:
        """(A point-to-point call ended by ``e``.) What its flight record says of it; the
        error carries the record."""
        if isinstance(e, GeneratorExit):
            return "cancelled"
        self._attach_record(e)
        return said(e)

    def _broken_in_recv(self, name: str) -> BaseException:
        """What a recv raises on finding the group broken (as a collective's wait does, but
        the cause named as a GroupBrokenError's cause where it is not one itself)."""
        c = self.cause
        if isinstance(c, GroupBrokenError):
            return self._cause_in(name)
        e = GroupBrokenError(str(c))
        e.__cause__ = c
        return e

    def _next_of(self, key: tuple[int, int], q: deque[w.Message], name: str) -> Any:
        """(recv.) The first message of ``key``'s queue ``q``, taken and decoded."""
        m = q.popleft()
        if not q:
            del self.p2p[key]
        self._got = _size(m.payload, m.buffers)
        return self._decode(m, name)

    def _cancelled_recv(self, name: str) -> None:
        """(recv, leading, cancelled.) An error its awaited wait's reader callback met, not
        raised yet: not left for a later call to raise as its own."""
        e = self._xr.take_error() if self._xr is not None else None
        if e is not None and self.state == OPEN:
            # The recv leaves the group as it was, but what the failed read took may be
            # lost: the group breaks, and the others are told.
            self._tell_peers(w.ABORT, f"{name} on group {self.name!r} failed on rank "
                                      f"{self.rank} as it was cancelled: "
                                      f"{type(e).__name__}: {e}"[:BYE_TEXT])
            self.brk(e)

    def _recv_ends(self, me: PointWait, key: tuple[int, int], x: Expected, lead: int
                   ) -> None:
        """(recv, however it ends.) Out of its line and, leading, out of the lead; a message
        taken the short way that it did not return goes back first in its queue. (Where
        its loop was closed with it pending, a later call took both over already: _lead_left,
        _first_past_gone.)"""
        if x is not NO_STEP:
            if self.pstep is x:
                self.pstep = NO_STEP
                if self._xr is not None:
                    self._xr.expect = None
            if x.raw:  # (taken the short way as the recv ended without it)
                self._requeue(x)
        line = self._lines.get(key)
        if line is not None and me in line:
            first = line[0] is me
            line.remove(me)
            if not line:
                del self._lines[key]
            elif first:  # the next in line may have its message there already
                self.wake_followers()
                if self._asleep and lead != self._lead_n:
                    self.ep.wake()
        self.end_call(lead)

    def _first_past_gone(self, line: list[PointWait], me: PointWait) -> bool:
        """(recv, not first in its line.) Whether it is first once the recvs before it that
        will never resume (awaited, of an event loop closed with them pending) leave the
        line."""
        while line[0] is not me and line[0].gone():
            line.pop(0)
        return line[0] is me

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


__all__ = ["Call", "Core"]
