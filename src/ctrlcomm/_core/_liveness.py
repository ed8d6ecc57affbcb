"""Which peers are gone or silent, what the ranks waited for are asked, and when a wait ends: a
loss, a timeout, the next probe."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from .. import _wire as w
from .._endpoint import PROCESS_EXITED
from .._errors import (
    CollectiveTimeoutError,
    MismatchTimeoutError,
    PeerLostError,
)
from .._patience import first_warning, waited
from ._common import (
    _NONE_LOST,
    EXIT_GRACE,
    FIRST_PROBE,
    LOOK_S,
    PROBE_GRACE,
    RECENT,
    RUNNING_LIMIT,
    RUNNING_RECHECK_S,
    RUNNING_UNSURE_S,
    SETTLE_S,
    SUSPECT_GRACE,
    Past,
    Said,
    _monotonic,
    _op_of,
    _send_name,
    describe,
)
from ._mismatch import _Mismatch

EXITED = "is gone (its process exited)"


class _Liveness(_Mismatch):
    """Which peers are gone or silent, what the ranks waited for are asked, and when a wait ends:
    a loss, a timeout, the next probe."""

    def _lost(self, rank: int, why: str, certain: bool) -> None:
        if why == PROCESS_EXITED:
            # seen on this host as it exited: what it sent last may be on its way still
            # (ZeroMQ's I/O thread), so it is gone EXIT_GRACE from now; a goodbye read
            # meanwhile, or as the call settles, says better why (a guess, as a silence is)
            until = min(self.suspects.get(rank, (math.inf, ""))[0],
                        time.monotonic() + EXIT_GRACE)
            self.suspects[rank] = (until, EXITED)
            return
        text = f"is gone ({why}; its process died or exited without close())"
        if certain:
            # a goodbye that arrived before the connection closed is the better explanation
            self._known_gone(rank, text)
        else:
            self.suspects.setdefault(rank, (time.monotonic() + SUSPECT_GRACE, text))

    def _known_gone(self, rank: int, text: str) -> None:
        """``rank`` is gone, as ``text`` says: kept where an earlier word said why, but over a
        guess from its silence (``_guessed``)."""
        self.reported.discard(rank)  # (seen here now)
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
                    self.reported.discard(s)
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
                    self.reported.discard(s)
        return [s for s in missing if s in self.gone], nxt

    def forget_hearsay(self) -> None:
        """Forget which ranks are gone by another rank's word or by an abort of theirs (both
        may be alive): only what this rank sees says so from now on (see _forming's
        shrink)."""
        for r in self.reported | self.aborters:
            self.gone.pop(r, None)
            self._guessed.discard(r)
            # (unless this rank saw its process exit: a word heard first made that moot,
            # and it is seen once only; a connection's end is not kept, as a rank's abort
            # ends its connections and it may be alive and in the shrink)
            if self.suspects.get(r, (0.0, ""))[1] != EXITED:
                self.suspects.pop(r, None)
        self.reported.clear()
        self.aborters.clear()

    def _answer_status(self, dst: int) -> None:
        """Tell ``dst`` what this rank is doing: in words, and in the header the collective
        it is in, or else the last one it returned from (so that a rank that waits for it in
        another call at that seq can tell a mismatch from a late rank)."""
        a = self.active
        st = w.Status(0, 0, 0, w.NO_ROOT, self.describe_state())
        if a is not None and a.seq >= 0:
            st = st._replace(where=w.STATUS_IN_CALL, seq=a.seq, op=a.op, root=a.root)
        elif self.last[1] is not None:  # (idle ranks do not answer: this one is in a recv)
            past = self._recent[self.last[1] % RECENT]
            if past.seq == self.last[1]:
                st = st._replace(where=w.STATUS_RETURNED, seq=past.seq, op=past.op,
                                 root=past.root)
        self._send_raw(dst, w.STATUS_REP, st.encode(), st.seq, st.where, st.op, st.root)

    def describe_state(self) -> str:
        a = self.active
        calls = [f"in {describe(a.op, a.root)} #{a.seq}, waiting for ranks {self.waiting_for}"
                 ] if a is not None else []
        calls += [f"in {p.name}, waiting for ranks {p.waiting_for}"
                  for line in self._lines.values() for p in line]
        if not calls:
            last = self.last[0] if self.last[1] is None else f"{self.last[0]} #{self.last[1]}"
            return f"idle (last call: {last})"
        return "; ".join(calls)

    def _wait(self, missing: list[int], deadline: float, t: float, name: str, seq: int | None,
              start: float = 0.0, st: Any = None) -> float:
        """Before one wait for ``missing`` ranks: raise if one is lost or the deadline passed,
        ask them what they are doing shortly before it (and, in a collective that started at
        ``start``, 1, 3, 7... s into it: FIRST_PROBE); else the seconds to sleep (at most:
        the wait ends when something arrives). ``st`` keeps what the call's waits keep
        (``waiting_for``, ``_probed``, ``_looked``, ``_settle_until``): a point-to-point
        call's PointWait; the core itself for the collective."""
        if st is None:
            st = self
        if self.paused:
            for s in missing:
                if s in self.paused:  # what is wanted came first from it; read on: why not?
                    self.paused.discard(s)
                    self.ep.resume(s)
        st.waiting_for = missing
        now = _monotonic()
        if now < self._live_until and not self.gone and not self.suspects:
            lost, suspect_at = _NONE_LOST, self._live_until  # the usual case, cheaply
        else:
            lost, suspect_at = self._check_lost(missing, now)
        if lost:
            return self._settle_or_raise(lost, now, deadline, name, seq, st)
        if now >= deadline:
            if not st._looked:  # a last read first: what is wanted may be in a socket
                st._looked = True
                return 0.0
            raise self._timeout(name, seq, t, missing)
        if st._probed:
            return min(deadline, suspect_at) - now
        probe_at = deadline - min(PROBE_GRACE, t / 10)
        if now >= probe_at:
            st._probed = True
            for s in missing:
                self.status.pop(s, None)
                self.status_call.pop(s, None)
                self.status_in_call.pop(s, None)
                self._send_raw(s, w.STATUS_REQ, b"")
            return min(deadline, suspect_at) - now
        if seq is not None:  # a collective: ask early, then less and less often
            probe_at = min(probe_at, self._probe_early(missing, now, start, name, seq, t))
        return min(probe_at, suspect_at) - now

    def _settle_or_raise(self, lost: list[int], now: float, deadline: float, name: str,
                         seq: int | None, st: Any) -> float:
        """(_wait, ranks it waits for lost.) First, what the sockets hold read to its end,
        and looked at by the caller: a peer that sent what is waited for and then left
        (exited, closed: its heartbeats stopped long ago) had it taken, not lost (a
        connection it made while this rank was away is accepted in one drain, read in the
        next). A settle's reads are bounded (a flood: FAIR_S a drain, SETTLE_ROUNDS drains):
        while one takes anything, another follows, for SETTLE_S at most (what a lost peer
        sent is finite; a live one may flood on). Then PeerLostError."""
        until = st._settle_until
        if until == 0.0 or now < min(deadline, until):
            # (what the short way took: counted as its step ends)
            n = self.received + len(self.step.raw) + len(self.pstep.raw)
            self.settle()
            st._settle_until = (until or now + SETTLE_S) \
                if self.received + len(self.step.raw) + len(self.pstep.raw) != n \
                else -math.inf
            return 0.0
        what = f"{name} #{seq}" if seq is not None else name
        raise PeerLostError(
            f"{what} on group {self.name!r} cannot complete on rank {self.rank}: "
            + "; ".join(f"rank {s} {self.gone[s]}" for s in lost), ranks=lost)

    def _probe_early(self, missing: list[int], now: float, start: float, name: str = "",
                     seq: int | None = None, t: float | None = None) -> float:
        """(_wait, in a collective ``name`` #``seq`` with timeout ``t`` that started at
        ``start``.) Ask ``missing`` what they are doing 1, 3, 7... s into it (FIRST_PROBE);
        when to ask next. From a tenth of its timeout on (see ``_patience``), it also logs a
        warning that says what it waits for (what they said when last asked)."""
        last = self._last_probe
        early = start + FIRST_PROBE if last < start else 2 * last - start + FIRST_PROBE
        if now >= early:
            self._last_probe = now
            if now - start >= first_warning(t):
                waited(f"{name} #{seq} on group {self.name!r}, rank {self.rank}", now - start,
                       t, f"ranks {missing} ({self._peer_states(missing, 'no answer yet')[1]})")
            for s in missing:
                self._send_raw(s, w.STATUS_REQ, b"")
            early = 2 * now - start + FIRST_PROBE
        return early

    def _timeout(self, name: str, seq: int | None, t: float, missing: list[int]
                 ) -> CollectiveTimeoutError:
        states, detail = self._peer_states(missing)
        what = f"{name} #{seq}" if seq is not None else name
        text = (f"{what} on group {self.name!r} timed out after {t:g} s on rank {self.rank} "
                f"waiting for ranks {missing} ({detail})")
        a = self.active
        if a is not None and seq is not None and a.seq == seq:
            desc = self._mismatch_desc(a, missing)
            if desc:  # (found only now: the answers came too late to raise earlier)
                return MismatchTimeoutError(
                    f"{text}: {desc}", mismatch=desc,
                    op=_op_of(name), seq=seq, group=self.name, waiting_for=missing, peer_states=states)
        return CollectiveTimeoutError(text, op=_op_of(name), seq=seq, group=self.name,
                                      waiting_for=missing, peer_states=states)

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

    def _take_status(self, m: w.Message) -> None:
        """(_accept) A peer's answer to this rank's status question."""
        src = m.src
        where, seq, op, root, text = w.decode_status(m)
        self.status[src] = Said(self.seq, text)
        if where == w.STATUS_IN_CALL:
            self.status_in_call[src] = seq
        else:
            self.status_in_call.pop(src, None)
        if where:
            self.status_call[m.src] = Past(seq, op, root)
            a = self.active
            # a rank this call waits for is in (or returned from) another call at this
            # seq: it will never send what this one waits for. (Made again for each
            # such answer read before the call raises: it names them all.)
            if a is not None and seq == a.seq and (op != a.op or root != a.root) \
                    and src in self.waiting_for \
                    and (self.mismatch is None or self.mismatch is self._probe_error):
                self.mismatch = self._probe_error = self._probed_mismatch(a)
