"""The mailbox: every message that arrives is taken here (matched by call, round and sender, or
queued per source and tag), and flow control: a peer far ahead is not read until this rank
catches up; a sender waits out a peer's backlog."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

from .. import _wire as w
from .._endpoint import Expected
from .._errors import (
    MismatchError,
    PeerLostError,
)
from .._lifecycle import BROKEN
from ._common import (
    _COLL,
    BACKLOG_LOOK_S,
    HOLD_HIGH,
    HOLD_LOW,
    MAX_BACKLOG,
    NO_STEP,
    RECENT,
    Said,
    Wait,
    _get_ident,
    _new,
    _ploads,
    _running_loop,
    _undecodable,
    describe,
)
from ._liveness import _Liveness


class _Mailbox(_Liveness):
    """The mailbox: every message that arrives is taken here (matched by call, round and sender,
    or queued per source and tag), and flow control: a peer far ahead is not read until this
    rank catches up; a sender waits out a peer's backlog."""

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
        if kind != _COLL:
            return self._take_other(m)
        # a collective's message, kept in the mailbox by (seq, round, sender) (the usual
        # message: not a method of its own, one call less for each)
        if seq < self.seq - (self._cur_seq >= 0):
            past = self._recent[seq % RECENT]
            if past.seq == seq and (op != past.op or root != past.root):
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
        if seq == self._cur_seq:
            if (op, root) != self._cur_call:
                self._set_mismatch(m)
            elif rnd == self.step.round:
                self.step.left.pop(src, None)  # (the step waits for it no more)
        return src

    def _take_other(self, m: w.Message) -> int | None:
        """(_accept) A message that is not a collective's."""
        kind, src, _, seq, rnd, _, _, _, _, _ = m
        if kind == w.P2P:
            # each sender numbers its point-to-point messages to this rank 1, 2, 3...: an
            # old number is a replay (it would pass the MAC: the frame is genuine)
            x = self.pstep
            expected = x.kind == w.P2P  # (a recv's: its sender's the one in it)
            nxt = self.p2p_in.get(src, 1)
            if expected and src in x.raw and x.seq >= nxt:
                nxt = x.seq + 1  # (taken the short way: counted as the recv returns it)
            if seq < nxt:
                self.dropped["replayed"] += 1
                return None
            self.p2p_in[src] = seq + 1
            self.p2p.setdefault((src, rnd), deque()).append(m)
            if expected and seq >= x.seq:
                # the number the recv waits for came, or passed with another tag: not to
                # be taken the short way now (a replay of it would be)
                x.left.pop(src, None)
        elif kind == w.STATUS_REQ:
            self._answer_status(src)
        elif kind == w.STATUS_REP:
            self._take_status(m)
        elif kind == w.BYE:
            why = w.said(m.payload)  # (why its group was broken, if it was)
            self._known_gone(src, f"closed the group (broken there: {why})" if why
                             else "closed the group")
            self.aborters.discard(src)
        elif kind == w.ABORT:
            self._take_abort(m)
        return src

    def _take_abort(self, m: w.Message) -> None:
        """(_accept) A peer's word that the group is broken: a mismatch it found, ranks it
        lost, or an abort of its own."""
        _, _, _, seq, rnd, _, _, _, _, _ = m
        told = w.decode_abort(m.payload)
        reason = told.text
        if told.kind == w.ABORT_MISMATCH:
            # another rank found the ranks out of step: so are the calls of this one
            desc = reason
            if rnd == w.ABORT_BY_PROBE and m.op and (
                    (st := self.status.get(m.src)) is None or st.seq != self.seq):
                # the call the teller is in (as its answer would have said: see
                # _notify_mismatch), where this rank has no answer of its own
                self.status[m.src] = Said(self.seq, f"in {describe(m.op, m.root)} #{seq} "
                                      "(it found the mismatch, and told this rank)")
            e: MismatchError = self._told_mismatch(seq, desc, m.src) \
                if rnd == w.ABORT_BY_PROBE \
                else MismatchError(f"{desc} (reported by rank {m.src})")
            self.brk(e)
            self._fail_call(e)
        elif told.kind == w.ABORT_LOST:
            # a peer lost ranks and tells everyone: name those ranks, not the messenger
            text = reason
            lost = [r for r in told.ranks if r in self._peers]
            for r in lost:
                if r not in self.gone:
                    self.reported.add(r)
                    self.gone[r] = f"is gone (reported by rank {m.src}: {text})"
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
            if rnd == w.ABORT_AT_CALL and a is not None and a.seq >= seq:
                # about this call (or an earlier one): it fails here too, even where
                # the sender's part of it came before the word, as on the others (an
                # error that names the call, as when the word came before it waited)
                self._fail_call(self._naming_call(f"{a.name} #{a.seq}", aborted))

    def _expect(self, src: int, tag: int) -> Expected:
        """(recv) What it waits for, as an express endpoint's drain may take it the short
        way: the next message ``src`` numbers for this rank, if it has ``tag``."""
        x = self.pstep = _new(Expected, ({src: None}, {}, self.group_id, w.P2P,
                                         self.p2p_in.get(src, 1), tag, 0, w.NO_ROOT))
        if self._xr is not None:
            self._xr.expect = x
        return x

    def _took(self, x: Expected, src: int, name: str) -> Any:
        """(recv) The message ``x`` expected of ``src``, taken the short way: counted as the
        mailbox counts one, and decoded."""
        data = x.raw.pop(src)
        self._count_p2p(src, x.seq)
        self._got = len(data)
        try:
            return _ploads(data)
        except Exception as e:  # unpickling runs code: anything can come out
            raise _undecodable(w.Message(w.P2P, src, self.group_id, x.seq, x.round, 0,
                                         w.NO_ROOT), name, None, e) from e

    def _count_p2p(self, src: int, seq: int) -> None:
        """Message ``seq`` of ``src`` was taken the short way: the mailbox counts it (its
        sender's next number, not lowered: what came behind it may have been counted)."""
        self.received += 1
        if self.p2p_in.get(src, 1) <= seq:
            self.p2p_in[src] = seq + 1

    def _requeue(self, x: Expected) -> None:
        """The message of ``x`` (a recv's) taken the short way, which its recv did not return
        (it was cancelled, closed, or its loop closed): counted as the mailbox counts one,
        and first in its queue, the next recv's."""
        src, data = x.raw.popitem()
        self._count_p2p(src, x.seq)
        self.p2p.setdefault((src, x.round), deque()).appendleft(_new(w.Message, (
            w.P2P, src, self.group_id, x.seq, x.round, 0, w.NO_ROOT, w.PICKLE, data, ())))

    # ------------------------------------------------------------------------ the lead

    def lead(self) -> int:
        """(Holding ``io``.) Take the lead (see the package's docstring) where no call has it,
        or where the call that has it will never resume (an awaited call of an event loop
        closed with it pending: a loop driven by hand; asyncio.run cancels its tasks): the
        lead's number, this call's until it ends (end_call); 0 where another call has
        it."""
        if not self._lock.acquire(False) and not self._lead_left():
            return 0
        self._holder = _get_ident()
        self._lead_loop = _running_loop()
        n = self._lead_n = self._lead_n + 1
        return n

    def _lead_left(self) -> bool:
        """(lead, finding it held.) Whether its holder's loop is closed: then what that call
        held is let go (its message taken the short way goes back first in its queue), and
        the lead, held still, is the caller's."""
        loop = self._lead_loop
        if loop is None or not loop.is_closed():
            return False
        self._asleep = False
        x = self.pstep
        if x is not NO_STEP:
            if x.raw:
                self._requeue(x)
            self.pstep = NO_STEP
        if self._xr is not None:
            self._xr.expect = None
        return True

    def pause(self, lead: int, delay: float) -> Generator[Any, None, None]:
        """One wait of a call, ``lead``: its lead's number (0: it does not lead). One that
        does not leads for this wait where none does (a send waiting out a backlog), else
        follows."""
        if not lead:
            n = self.lead()
            if not n:
                yield from self.follow(delay)
                return
            try:
                self._asleep = True
                yield delay
            finally:
                self.end_call(n)
        else:
            self._asleep = True
            yield delay
            self._asleep = False

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

    def _backpressure(self, dsts: list[int], deadline: float, t: float, name: str,
                      seq: int | None, lead: int, stop: str = BROKEN) -> Wait:
        """Wait while more than MAX_BACKLOG bytes are queued for any of ``dsts`` (``lead``:
        the number of the call's lead, 0 where it does not lead; ``stop``: the state in
        which it raises the group's cause, none for a send made on a broken group)."""
        if self.ep.unflushed:  # a connection still being made, or a kernel buffer was full
            self.pump()
        while True:
            full = [d for d in dsts if self.ep.backlog(d) > MAX_BACKLOG]
            if not full:
                return
            if self.state == stop:  # (a step that completed may still send after it)
                raise self._cause_in(name if seq is None else f"{name} #{seq}")
            if seq is not None:
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
            delay = min(deadline, suspect_at) - now
            # (a follower looks again soon: what wakes the leader as a queue drains, if
            # anything does, is the leader's; ZeroMQ's sends wake nobody)
            yield from self.pause(lead, delay if lead else min(delay, BACKLOG_LOOK_S))

    def _decode(self, m: w.Message, what: str, seq: int | None = None) -> Any:
        try:
            return w.loads(m.payload, m.buffers, m.codec, self._unpickle)
        except Exception as e:  # unpickling runs code: anything can come out
            raise _undecodable(m, what, seq, e) from e
