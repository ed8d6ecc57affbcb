"""The group's session: its state (see _lifecycle), the one call that holds it, and what close()
and abort() do, now or in the call's thread; telling the peers."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
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
    IO_TAKE_S,
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

    def enter(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"group {self.name!r} (rank {self.rank}) is busy with {self._owner}: a group is "
                f"used by one thread or coroutine at a time (called {what})")
        if self._io_waiters:  # (an awaited call of another thread waits for the sockets)
            self._nudge()
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
        self.ep.settle(self._sink)

    def _fail_call(self, e: CtrlcommError) -> None:
        """The ranks are out of step, or a peer gave up this call: the collective in progress
        raises ``e`` at its next look, even if its own messages are all in (read with what
        showed it). Whether it raises must not depend on how the reads fell."""
        a = self.active
        if a is not None and a.seq >= 0 and self.mismatch is None:
            self.mismatch = e
