"""The group's session: its state (see _lifecycle), the one call that holds it, and what close()
and abort() do, now or in the call's thread; telling the peers."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Sequence
from typing import Any

from .. import _wire as w
from .._errors import (
    ConcurrentUseError,
    CtrlcommError,
    GroupBrokenError,
    GroupClosedError,
    MismatchError,
    MismatchTimeoutError,
    PeerLostError,
)
from .._lifecycle import BREAK, BROKEN, CLOSE, CLOSED, OPEN, after
from ._common import (
    ABORT_PUSH_S,
    ABORT_TAKE_S,
    BYE_TEXT,
    DRIVER_CODES,
    FOLLOW_LOOK_S,
    IO_TAKE_S,
    Follower,
    _get_ident,
)
from ._sending import _Sending


class _Session(_Sending):
    """The group's session: its state (see _lifecycle), the one call that holds it, and what
    close() and abort() do, now or in the call's thread; telling the peers."""

    # --------------------------------------------------------------------------- states

    def check_open(self) -> None:
        """Raise what a call raises in the group's state (_lifecycle.CALL_RAISES)."""
        if self.state == CLOSED:
            raise GroupClosedError(f"group {self.name!r} (rank {self.rank}) is closed")
        if self.state == BROKEN:
            raise self._broken_error()

    def check_usable(self, broken_ok: bool) -> str:
        """As :meth:`check_open`, but a broken group too where ``broken_ok``; returns the
        state in which a wait of the call raises as a collective's does (BROKEN; none where
        ``broken_ok``)."""
        if self.state != OPEN and not (broken_ok and self.state == BROKEN):
            self.check_open()
        return "" if broken_ok else BROKEN

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
        """The group breaks (see _lifecycle): ``cause`` is kept where it is the first."""
        if self.state == OPEN:
            self.cause = cause  # (first: a call in another thread raises it once broken)
        self.state = after(self.state, BREAK)

    def enter_collective(self, what: str) -> None:
        """(Holding ``io``.) A collective starts: raise where the group is closed or broken,
        or another collective is in progress (collectives run one at a time, in the order
        they start; one of another thread is refused, see Group)."""
        self.check_open()
        if self._owner:
            raise ConcurrentUseError(
                f"group {self.name!r} (rank {self.rank}) is busy with {self._owner}: "
                f"collectives run one at a time (called {what}); one of another thread does "
                "not wait for the one in progress, as the order of the two could differ "
                "between ranks")

    def collective_in_progress(self) -> bool:
        return bool(self._owner)

    def end_call(self, lead: int) -> None:
        """(Holding ``io``.) A call, or its wait, ends; ``lead``: the number of the lead it
        took (0: none). The lead is free again (unless it was taken over: Core.lead), the
        followers woken (one takes it); what close() or abort() asked meanwhile is done."""
        if lead and lead == self._lead_n:
            self._asleep = False
            self._lock.release()
            if self._deferred or self._followers:
                self.after_lead()
        elif self._deferred:
            self.run_deferred_here()

    def after_lead(self) -> None:
        """(end_call, the lead released.)"""
        if self._deferred:
            self.run_deferred_here()
        self.wake_followers()

    def follow(self, delay: float) -> Generator[Any, None, None]:
        """(A call's wait that does not lead, holding ``io``.) Sleep, for ``delay`` at most,
        until the leader read something or gave up the lead."""
        f = Follower(min(delay, FOLLOW_LOOK_S))
        followers = self._followers
        followers.append(f)
        try:
            yield f
        finally:
            try:
                followers.remove(f)
            except ValueError:  # (its loop closed meanwhile: wake_followers took it out)
                pass

    def wake_followers(self) -> None:
        """(Holding ``io``.) Each follower looks again (one of a closed loop is let go)."""
        followers = self._followers
        if not all([f.wake() for f in followers]):
            followers[:] = [f for f in followers if f.loop is None or not f.loop.is_closed()]

    # ------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self.state == CLOSED:
            return
        self.state = after(self.state, CLOSE)
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
        while f is not None:
            if f.f_code in DRIVER_CODES and f.f_locals.get("core") is self:
                return True
            f = f.f_back
        return False

    def _defer(self, what: str, reason: str) -> None:
        """Do what close() or abort() must do with the sockets: now, where no call sleeps on
        the endpoint (its waits and reads are the leader's), or where the leader is an awaited
        call suspended in this thread's event loop (which may never run again: it finds the
        group closed or broken if it resumes); else the leader, woken at once, does it. (The
        state has changed already: a call that starts meanwhile raises.) Not in the middle
        of a call of this thread (a signal handler, a reduction callable under it): that
        call does it, at its next look or its end. (``io`` is held by a call only while it
        runs: taken within IO_TAKE_S, else the call that holds it does it as it ends.)"""
        self._deferred.append((what, reason))
        if not self._in_call():
            io = self.ep.io
            if io.acquire(timeout=IO_TAKE_S):
                try:
                    if self._deferred:
                        self.run_deferred_here()
                finally:
                    io.release()
        # (a wait ends: the leader does what is left; a closed endpoint's wake is nothing)
        self.ep.wake()
        if what == "abort" and self._deferred and self._holder != _get_ident():
            self._abort_suspended()

    def run_deferred_here(self) -> None:
        """(Holding ``io``.) What close() or abort() asked, done now where the endpoint is not
        another call's to wait on (see _defer); else its leader is woken to do it."""
        if self._lock.acquire(False):  # (no call leads)
            self._holder = 0
            try:
                self._run_deferred()
            finally:
                self._lock.release()
        elif self._holder == _get_ident():
            # this call leads, or the leader is an awaited call suspended in this thread's
            # loop, not reading meanwhile
            self._run_deferred()
        else:
            # the leader is another thread's (it does it, woken), or this thread runs the
            # loop of _run_deferred already (this was asked in its sending: a signal
            # handler's close() in an abort's send; the loop takes it next)
            self.ep.wake()
            return
        self.wake_followers()

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

    def _run_deferred(self) -> None:
        """(Holding ``io`` and the lead, or the leader suspended in this thread's loop.)"""
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
        if a is not None and a.seq >= 0:
            seq = a.seq
            c = self.cause
            self._fail_call(c if isinstance(c, CtrlcommError) else GroupBrokenError(reason))
        elif self._failed_seq == self.seq - 1 >= 0:
            seq = self._failed_seq
        else:
            seq = self.seq
        self._tell_peers(w.ABORT, reason, seq, w.ABORT_AT_CALL)

    def _tell_peers(self, kind: int, text: str | w.AbortReason, seq: int = 0, rnd: int = 0,
                    to: Sequence[int] | None = None, op: int = 0,
                    root: int = w.NO_ROOT) -> None:
        """A control message to every peer (or those of ``to``) not known gone (best
        effort). ``text``: a goodbye's, or an abort's own reason (else an AbortReason)."""
        payload = text.encode()
        for p in range(self.size) if to is None else to:
            if p != self.rank and (p not in self.gone or kind == w.BYE and p in self.aborters):
                self._send_raw(p, kind, payload, seq, rnd, op, root)
        if kind == w.ABORT:
            # the word goes out now, to peers this rank has not sent to yet as well (queued on a
            # connection still being made, it would wait for this rank's next call, or exit)
            self.ep.push(ABORT_PUSH_S)

    def _notify_lost(self, e: PeerLostError) -> None:
        self._tell_peers(w.ABORT, w.AbortReason(w.ABORT_LOST, str(e), tuple(e.ranks)))

    def _notify_mismatch(self, e: MismatchError) -> None:
        if isinstance(e, MismatchTimeoutError) and e.seq is not None:
            # the description only, and in the header which call and how it was found (a
            # peer of an earlier version reads a plain mismatch)
            # (and, where it is in that call still, which call this rank made: a rank told
            # before it asked says what this one was doing, as if it had asked)
            a = self.active
            op, root = (a.op, a.root) if a is not None and a.seq == e.seq else (0, w.NO_ROOT)
            self._tell_peers(w.ABORT, w.AbortReason(w.ABORT_MISMATCH, e.mismatch), e.seq,
                             w.ABORT_BY_PROBE, op=op, root=root)
        else:
            self._tell_peers(w.ABORT, w.AbortReason(w.ABORT_MISMATCH, str(e)))

    def abort(self, reason: str) -> None:
        if self.state == CLOSED:
            return
        self.brk(GroupBrokenError(f"group {self.name!r} was aborted by rank {self.rank} "
                                  f"(this rank): {reason}"))
        if os.getpid() != self._pid:  # a forked child's copy: as in close(), not a word
            return
        self._defer("abort", reason)

    def pump(self) -> None:
        """(Holding ``io``.) What close() or abort() asked done (run_deferred_here), then
        what arrived read (not while the leader sleeps on the endpoint: its reads are
        its own, and it wakes the followers after each)."""
        if self._deferred:  # close() or abort() from another thread or task
            self.run_deferred_here()
        if self.ep.closed:  # closed by another task while a call waited
            raise GroupClosedError(f"group {self.name!r} (rank {self.rank}) was closed "
                                   "during the call")
        if not self._asleep:
            self.ep.drain(self._sink)
            if self._followers:
                self.wake_followers()

    def settle(self) -> None:
        """As :meth:`pump`, but what the sockets hold read to its end (the endpoint's
        settle), before a wait raises that a peer it waits for is lost."""
        self.pump()
        if not self._asleep:
            self.ep.settle(self._sink)

    def _fail_call(self, e: CtrlcommError) -> None:
        """The ranks are out of step, or a peer gave up this call: the collective in progress
        raises ``e`` at its next look, even if its own messages are all in (read with what
        showed it). Whether it raises must not depend on how the reads fell."""
        a = self.active
        if a is not None and a.seq >= 0 and self.mismatch is None:
            self.mismatch = e
