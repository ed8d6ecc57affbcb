"""The short way of a step's receives: each expected message read straight from its sender's
socket into the call (Core._express); anything else is left to the mailbox."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence
from typing import Any

from .. import _wire as w
from .._endpoint import (
    ExpressEndpoint,
)
from .._lifecycle import OPEN
from ._common import (
    _COLL,
    _NO_STEP,
    _PICKLE,
    BYE_TEXT,
    _monotonic,
    _new,
    _ploads,
    _undecodable,
    _XStep,
)
from ._liveness import _Liveness


class _Express(_Liveness):
    """The short way of a step's receives: each expected message read straight from its sender's
    socket into the call (Core._express); anything else is left to the mailbox."""

    def _express(self, recvs: Sequence[int], reply: dict[int, Any], seq: int, rnd: int,
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
        ep = self._xr
        assert ep is not None  # (self._xp)
        left = dict.fromkeys(recvs)  # the senders not read yet (ordered; O(1) to look up)
        raw: dict[int, bytearray] = {}  # the payloads read, by sender
        self._xstep = _new(_XStep, (left, raw, kind, seq, rnd, opcode, root))
        self._xfell = False
        ended = False
        try:
            while True:
                now = _monotonic()
                if self._x_stopped(ep, probe_at, now):
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
            self._x_end(w.Message(kind, -1, self.group_id, seq, rnd, opcode, root), raw,
                        ended, name)
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

    def _x_stopped(self, ep: ExpressEndpoint, probe_at: float, now: float) -> bool:
        """Whether the short way stops here (see _express): the general way takes over."""
        return self.mismatch is not None or self.state != OPEN or bool(self.gone) \
            or bool(self.suspects) or bool(self._deferred) or ep.closed or ep.failed \
            or now >= probe_at or now >= self._live_until

    def _x_end(self, step: w.Message, raw: dict[int, bytearray], ended: bool, name: str
               ) -> None:
        """(The short way's end, whatever it was.) ``step``: the messages it read (their
        kind, seq, round, opcode and root)."""
        kind, seq, rnd = step.kind, step.seq, step.round
        if self._xerror is not None:
            # an error in an awaited wait's reader callback, and the call was cancelled
            # before it resumed to raise it: not left for a later call to raise as its
            # own. A collective's cancellation breaks the group and tells the others
            # (Core.collective); a recv's leaves the group as it was, but what the
            # failed read took may be lost: the group breaks, and the others are told.
            e, self._xerror = self._xerror, None
            if kind != _COLL and self.state == OPEN:
                self._tell_peers(w.ABORT, f"{name} on group {self.name!r} failed on rank "
                                          f"{self.rank} as it was cancelled: "
                                          f"{type(e).__name__}: {e}"[:BYE_TEXT])
                self.brk(e)
        if kind == _COLL or not raw:
            return
        # a point-to-point message taken: its sender's next number, as _accept counts
        # (not lowered: what came behind it may have been counted already)
        for s, taken in raw.items():
            if self.p2p_in.get(s, 1) <= seq:
                self.p2p_in[s] = seq + 1
            if not ended:
                # the recv ends without it (cancelled, a close, an error in the loop's
                # callback...) after an awaited wait's callback read it: it is the next
                # recv's, first in line, as the general way keeps it
                self.p2p.setdefault((s, rnd), deque()).appendleft(w.Message(
                    kind, s, self.group_id, seq, rnd, step.op, step.root, _PICKLE, taken,
                    ()))

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
            return not self._xstep.left
        self._xfell = True
        return True

    def _xtake(self, ready: list[tuple[int, int]]) -> bool:
        """The endpoint's read_expected for the step :meth:`_express` waits for
        (``self._xstep``): whether the general way must take over."""
        left, raw, kind, seq, rnd, opcode, root = self._xstep
        n = len(raw)
        xr = self._xr
        assert xr is not None  # (self._xp)
        fell = xr.read_expected(
            ready, left, raw, self.group_id, kind, seq, rnd, opcode, root, self._sink)
        self.received += len(raw) - n
        return fell
